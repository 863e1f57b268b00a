// Byte-level BPE's pre-tokenizers (the regex splits before merges) and GPT-2's byte <-> code
// point mapping.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace ferry::tokenizer {

// The byte-level BPE pre-tokenizer for `pre` (tokenizer.ggml.pre), under the names llama.cpp
// reads: "gpt-2" (GPT-2's regex), "llama-bpe" (Llama 3), "qwen2", "smollm", "falcon",
// "deepseek-coder", ...; "default" and unknown names get llama.cpp's default list. Views into
// `text`.
std::vector<std::string_view> SplitPreTokens(std::string_view text, std::string_view pre);

// GPT-2's reversible byte <-> printable code point mapping.
struct ByteMap {
    uint32_t to_cp[256];
    std::unordered_map<uint32_t, uint8_t> to_byte;
    ByteMap() {
        uint32_t extra = 0;
        for (uint32_t b = 0; b < 256; ++b) {
            bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
            to_cp[b] = printable ? b : 256 + extra++;
            to_byte[to_cp[b]] = static_cast<uint8_t>(b);
        }
    }
};
const ByteMap& ByteLevelMap();

// The token text of byte `b` in a byte-level BPE vocabulary: GPT-2's printable code point for
// it, as UTF-8 ('a' -> "a", ' ' -> "Ġ").
std::string ByteLevelToken(uint8_t b);

}  // namespace ferry::tokenizer
