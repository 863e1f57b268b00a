// Parsing of OpenAI /v1/completions and /v1/chat/completions request bodies: outside input, so
// every field is type- and range-checked and an error names the field.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/sampler.h"
#include "model/tokenizer.h"

namespace ferry::serve {

struct BadRequest {
    std::string message;
    std::string param;
    std::string code;
};

struct ParsedRequest {
    bool chat = false;
    std::vector<int32_t> prompt;
    model::SamplingParams sampling;
    bool stream = false;
    bool include_usage = false;
    bool want_logprobs = false;  // completions: logprobs >= 0; chat: logprobs true
};

// Parses `body`; false with `error` filled for anything malformed. Chat requests without a token
// limit get what is left of `max_model_len` after the prompt.
bool ParseOpenAiRequest(std::string_view body, bool chat, const model::Tokenizer& tokenizer,
                        const std::string& model_name, int max_model_len, ParsedRequest* out,
                        BadRequest* error);

}  // namespace ferry::serve
