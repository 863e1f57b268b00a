// The prompt of an OpenAI request body as token ids: the one definition the worker (which
// computes them) and the router (which hashes them by block to score workers' caches,
// router/driver.h) share, so that both see the same tokens for the same body.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace ferry::tokenizer {

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
    std::string param;        // "messages[1].content[2].image_url", for errors
    size_t token_offset = 0;  // PromptTokens: where its placeholder tokens start
};

// Where an image stands in a rendered chat prompt: llama.cpp's media marker
// (mtmd_default_marker). Text that contains it is refused when images are taken.
inline constexpr std::string_view kImageMarker = "<__media__>";

// How an image becomes prompt tokens: `tokens_per_image` copies of `placeholder` (the encoder's
// embeddings stand in for them in the model; engine::MmInput).
struct ImageTokens {
    int tokens_per_image = 0;
    int32_t placeholder = 0;
};
// The placeholder token of a vocabulary: its "<image>" token if it has one (LLaVA's), else its
// end-of-sequence token (any id serves: the model never sees its row, and the prefix cache keys
// the image's blocks on its hash).
int32_t ImagePlaceholder(const Tokenizer& tokenizer);

// The "messages" of a chat body; false with `error` set. Image parts go to `images` and leave
// kImageMarker in their message's content; with `images` null (a model without a vision
// encoder) they are refused, naming the part.
bool ChatMessages(const nlohmann::json& body, std::vector<ChatMessage>* out, PromptError* error,
                  std::vector<ImagePart>* images = nullptr);

// The prompt's token ids: /v1/completions "prompt" (a string, one string in an array, or an
// array of token ids in the vocabulary) with bos as the model wants it; /v1/chat/completions
// "messages" rendered by the chat template with the generation prompt. False with `error` set
// for anything else (an empty prompt, batched prompts, ids outside the vocabulary). With
// `image_tokens`, a chat's image parts become placeholder tokens (split at kImageMarker after
// rendering, each piece tokenized alone, as llama.cpp's mtmd does) and go to `images` in order
// with their token offsets; without, they are refused.
bool PromptTokens(const nlohmann::json& body, bool chat, const Tokenizer& tokenizer,
                  std::vector<int32_t>* out, PromptError* error,
                  const ImageTokens* image_tokens = nullptr,
                  std::vector<ImagePart>* images = nullptr);

}  // namespace ferry::tokenizer
