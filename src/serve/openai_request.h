// Parsing of OpenAI /v1/completions and /v1/chat/completions request bodies: outside input, so
// every field is type- and range-checked and an error names the field.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/json_depth.h"
#include "core/request_id.h"
#include "engine/engine.h"
#include "kv/connector.h"
#include "model/sampler.h"
#include "schema/ec_transfer_params.h"
#include "tokenizer/prompt.h"
#include "tokenizer/tokenizer.h"

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
    // vLLM's return_tokens_as_token_ids: logprobs name tokens as "token_id:<id>".
    bool tokens_as_ids = false;
    // vLLM's return_token_ids: each choice (each chunk's, streamed) carries the ids of its
    // tokens ("token_ids"), and the answer the prompt's ("prompt_token_ids": completions on the
    // choice, chat on the answer; streamed, in the first chunk).
    bool return_token_ids = false;
    // "ferry_continue": {"token_ids": [...]}: a stream the router migrates from a decode worker
    // that died (router/driver.h) goes on after these output tokens (engine::Request::continued).
    // Internal: honoured only from the router where there is a secret.
    std::vector<int32_t> continued;
    // "kv_transfer_params": the object as the request gave it (null when absent or null). The
    // worker's KV connector reads it (its own format); the server keeps the result in
    // kv_transfer.
    nlohmann::json kv_transfer_params;
    std::shared_ptr<kv::ConnectorParams> kv_transfer;
    // "ec_transfer_params" (EPD): where an encode worker keeps this request's images'
    // embeddings (serve/ec_connector.h), as the router copied it from the encode worker's
    // answer; null when absent.
    nlohmann::json ec_transfer_params;
    std::shared_ptr<const schema::EcTransferParams> ec_source;  // the server's reading of it
    // Some of its image embeddings came from a peer outside the deployment: neither they nor
    // the KV computed from them are cached (engine::Request::no_cache).
    bool no_cache = false;
    // A chat's images (with a vision encoder: ParseOpenAiRequest's image_tokens), in prompt
    // order, their placeholder tokens in `prompt`; the server reads and encodes them into `mm`.
    std::vector<tokenizer::ImagePart> images;
    std::vector<engine::MmInput> mm;
    // SGLang's PD fields (bootstrap_host, bootstrap_port, bootstrap_room) as the body gave them
    // (an object of those present; null: none), and whether they made this request's
    // kv_transfer_params (serve/sglang_pd.h: the prefill side then streams if asked).
    nlohmann::json sglang_fields;
    bool sglang = false;
};

// Nesting deeper than this is refused before any JSON tree is built (JsonDepthWithin).
inline constexpr size_t kMaxJsonDepth = 64;

// Parses `body`; false with `error` filled for anything malformed. Chat requests without a token
// limit get what is left of `max_model_len` after the prompt. With `image_tokens` (a worker
// with a vision encoder) a chat's image parts become placeholder tokens and out->images;
// without, they are refused by name.
bool ParseOpenAiRequest(std::string_view body, bool chat, const tokenizer::Tokenizer& tokenizer,
                        const std::string& model_name, int max_model_len, ParsedRequest* out,
                        BadRequest* error, const tokenizer::ImageTokens* image_tokens = nullptr);

// SGLang's POST /generate (its GenerateReqInput): "text" (a string, or a batch of them) or
// "input_ids" (ids, or a batch of lists), "sampling_params" (an object for every prompt, or a list
// with one per prompt: max_new_tokens (default 128), temperature, top_p, top_k, stop,
// stop_token_ids, ignore_eos, sampling_seed; the rest only at their neutral values, anything
// unknown refused by name as SGLang's SamplingParams does), "stream", "return_logprob",
// "top_logprobs_num", "return_text_in_logprobs", "logprob_start_len" (-1 only: prompt
// log-probabilities are not computed here), "rid", and SGLang's PD fields.
struct GenerateRequest {
    std::vector<ParsedRequest> items;  // one per prompt (sampling, prompt, stream)
    bool batch = false;                // the body gave lists: the answer is a list
    bool stream = false;
    bool return_logprob = false;
    int top_logprobs_num = 0;
    bool return_text_in_logprobs = false;
    std::vector<std::string> rids;  // "" where none was given
    nlohmann::json sglang_fields;   // as ParsedRequest::sglang_fields
};
bool ParseGenerateRequest(std::string_view body, const tokenizer::Tokenizer& tokenizer,
                          int max_model_len, GenerateRequest* out, BadRequest* error);

// POST /tokenize, as vLLM's server defines it: {"prompt": text} (TokenizeCompletionRequest;
// add_special_tokens defaults to true) or {"messages": [...]} (TokenizeChatRequest, rendered with
// the chat template; add_generation_prompt defaults to true, add_special_tokens to false), and
// return_token_strs.
struct TokenizeRequest {
    std::vector<int32_t> tokens;
    bool return_token_strs = false;
};
bool ParseTokenizeRequest(std::string_view body, const tokenizer::Tokenizer& tokenizer,
                          const std::string& model_name, TokenizeRequest* out, BadRequest* error);

// POST /detokenize: {"tokens": [ids]}, each id in the vocabulary.
bool ParseDetokenizeRequest(std::string_view body, const tokenizer::Tokenizer& tokenizer,
                            const std::string& model_name, std::vector<int32_t>* tokens,
                            BadRequest* error);

}  // namespace ferry::serve
