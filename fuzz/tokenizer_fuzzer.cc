// Arbitrary text through the byte-level BPE tokenizer (every kind of pre-tokenizer): encoding never
// fails and decoding gives back exactly the bytes.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "gguf/gguf.h"
#include "model/model.h"
#include "test_tokenizer.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const ferry::tokenizer::Tokenizer* tk = &TestTokenizer();
    if (size == 0) return 0;
    std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
    static const char* const kPre[] = {"default", "gpt-2",  "llama-bpe",     "qwen2",
                                       "smollm",  "falcon", "deepseek-coder"};
    auto pieces = ferry::tokenizer::SplitPreTokens(text, kPre[data[0] % 7]);
    size_t total = 0;
    for (std::string_view p : pieces) {
        // The pieces tile the text, in order, none empty.
        if (p.empty() || p.data() != text.data() + total) std::abort();
        total += p.size();
    }
    if (total != text.size()) std::abort();
    // Control-token texts inside the input become single tokens, which decode to nothing; only
    // inputs without "<|" round-trip byte for byte.
    auto ids = tk->Encode(text, false);
    if (text.find("<|") == std::string::npos && tk->Decode(ids) != text) std::abort();
    return 0;
}
