// Request bodies of /v1/completions and /v1/chat/completions, parsed with a real tokenizer; the
// first byte's bit 0 picks chat, bit 1 a worker that takes images (4 placeholder tokens each).
// An accepted body's ec_transfer_params go through their own parser (serve/ec_connector.h).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "gguf/gguf.h"
#include "model/model.h"
#include "serve/ec_connector.h"
#include "serve/openai_request.h"
#include "test_tokenizer.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
    ferry::serve::ParsedRequest out;
    ferry::serve::BadRequest error;
    const ferry::tokenizer::ImageTokens images{4, 1};
    bool ok = ferry::serve::ParseOpenAiRequest(body, data[0] & 1, TestTokenizer(), "m", 4096, &out,
                                               &error, (data[0] & 2) ? &images : nullptr);
    if (ok) {
        if (out.prompt.empty()) std::abort();  // an accepted request always has a prompt
        for (int32_t t : out.prompt) {
            if (t < 0 || t >= TestTokenizer().vocab_size()) std::abort();
        }
        // Every image's placeholders lie inside the prompt, in order, without overlap.
        size_t end = 0;
        for (const auto& im : out.images) {
            if (im.token_offset < end || im.token_offset + 4 > out.prompt.size()) std::abort();
            for (size_t i = 0; i < 4; ++i) {
                if (out.prompt[im.token_offset + i] != 1) std::abort();
            }
            end = im.token_offset + 4;
        }
        if (!out.ec_transfer_params.is_null()) {
            auto src = ferry::schema::ParseEcTransferParams(out.ec_transfer_params);
            if (src.ok() && (src->engine_id.empty() || src->host.empty() || src->port < 1 ||
                             src->port > 65535 || src->encoder.size() > 128)) {
                std::abort();  // accepted params are whole and in range
            }
            if (!src.ok() && src.status().message().empty()) std::abort();
        }
    } else if (error.message.empty()) {
        std::abort();  // every refusal says why
    }
    // The same bytes as SGLang's /generate body: every accepted prompt is in the vocabulary and
    // non-empty, its token budget positive, a batch one item per prompt; a refusal says why.
    if (data[0] & 4) {
        ferry::serve::GenerateRequest g;
        ferry::serve::BadRequest gerr;
        if (ferry::serve::ParseGenerateRequest(body, TestTokenizer(), 4096, &g, &gerr)) {
            if (g.items.empty() || (!g.batch && g.items.size() != 1) ||
                g.rids.size() != g.items.size()) {
                std::abort();
            }
            for (const auto& it : g.items) {
                if (it.prompt.empty() || it.sampling.max_tokens < 1) std::abort();
                for (int32_t t : it.prompt) {
                    if (t < 0 || t >= TestTokenizer().vocab_size()) std::abort();
                }
            }
        } else if (gerr.message.empty()) {
            std::abort();
        }
    }
    return 0;
}
