// Arbitrary text through the byte-level BPE tokenizer (every pre-tokenizer): encoding never
// fails and decoding gives back exactly the bytes.
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

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static std::unique_ptr<ferry::model::Tokenizer> tk = [] {
        std::string path = "/tmp/ferry-fuzz-bpe-" + std::to_string(getpid()) + ".gguf";
        ferry::model::RandomModelSpec s;
        s.dim = 16;
        s.num_layers = 1;
        s.num_heads = 1;
        s.num_kv_heads = 1;
        s.ffn_dim = 16;
        if (!ferry::model::WriteRandomModel(s, 1, path).ok()) std::abort();
        auto file = std::move(ferry::model::GgufFile::Open(path)).value();
        auto t = std::move(ferry::model::Tokenizer::FromGguf(*file)).value();
        unlink(path.c_str());
        return t;
    }();
    if (size == 0) return 0;
    std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
    static const char* const kPre[] = {"default", "llama-bpe", "qwen2", "smollm"};
    auto pieces = ferry::model::SplitPreTokens(text, kPre[data[0] % 4]);
    size_t total = 0;
    for (std::string_view p : pieces) {
        if (p.empty()) std::abort();
        total += p.size();
    }
    if (total != text.size()) std::abort();  // the pieces tile the text
    // Control-token texts inside the input become single tokens, which decode to nothing; only
    // inputs without "<|" round-trip byte for byte.
    auto ids = tk->Encode(text, false);
    if (text.find("<|") == std::string::npos && tk->Decode(ids) != text) std::abort();
    return 0;
}
