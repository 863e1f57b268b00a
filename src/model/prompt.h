// The prompt of an OpenAI request body as token ids: the one definition the worker (which
// computes them) and the router (which hashes them by block to score workers' caches,
// router/driver.h) share, so that both see the same tokens for the same body.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/tokenizer.h"

namespace ferry::model {

struct PromptError {
    std::string message;
    std::string param;  // the body's field at fault ("prompt", "messages[2].content")
};

// An image of a chat message: an OpenAI content part {"type": "image_url", "image_url": {"url":
// ..., "detail": ...}}, checked for its form only (media/image.h reads and decodes the URL).
struct ImagePart {
    size_t message = 0;  // index in "messages"
    size_t offset = 0;   // where in that message's text content it stood (bytes)
    std::string url;
    std::string detail = "auto";
    std::string param;  // "messages[1].content[2].image_url", for errors
};

// The "messages" of a chat body; false with `error` set. Image parts go to `images`; with
// `images` null (a model without a vision encoder) they are refused, naming the part.
bool ChatMessages(const nlohmann::json& body, std::vector<ChatMessage>* out, PromptError* error,
                  std::vector<ImagePart>* images = nullptr);

// The prompt's token ids: /v1/completions "prompt" (a string, one string in an array, or an
// array of token ids in the vocabulary) with bos as the model wants it; /v1/chat/completions
// "messages" rendered by the chat template with the generation prompt. False with `error` set
// for anything else (an empty prompt, batched prompts, ids outside the vocabulary).
bool PromptTokens(const nlohmann::json& body, bool chat, const Tokenizer& tokenizer,
                  std::vector<int32_t>* out, PromptError* error);

}  // namespace ferry::model
