// Request bodies of /v1/completions and /v1/chat/completions, parsed with a real tokenizer.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "model/gguf.h"
#include "model/model.h"
#include "model/tokenizer.h"
#include "serve/openai_request.h"
#include "test_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
    ferry::serve::ParsedRequest out;
    ferry::serve::BadRequest error;
    bool ok = ferry::serve::ParseOpenAiRequest(body, data[0] & 1, TestTokenizer(), "m", 4096, &out,
                                               &error);
    if (ok) {
        if (out.prompt.empty()) std::abort();  // an accepted request always has a prompt
        for (int32_t t : out.prompt) {
            if (t < 0 || t >= TestTokenizer().vocab_size()) std::abort();
        }
    } else if (error.message.empty()) {
        std::abort();  // every refusal says why
    }
    return 0;
}
