// UTF-8 checks shared by the tokenizer, the engine's detokenizer and the serving benchmark.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace ferry {

// The length of the UTF-8 sequence lead byte `c` starts (1 to 4), or 0 for a byte no sequence
// starts with (a continuation byte, 0xf8 and above).
inline size_t Utf8SequenceLength(unsigned char c) {
    return c < 0x80             ? 1
           : (c & 0xe0) == 0xc0 ? 2
           : (c & 0xf0) == 0xe0 ? 3
           : (c & 0xf8) == 0xf0 ? 4
                                : 0;
}

// Whether `s` is whole, valid UTF-8: no truncated or overlong sequence, no surrogate, nothing
// beyond U+10FFFF.
inline bool IsValidUtf8(std::string_view s) {
    size_t i = 0;
    while (i < s.size()) {
        const auto c = static_cast<unsigned char>(s[i]);
        const size_t n = Utf8SequenceLength(c);
        if (n == 0 || i + n > s.size()) return false;
        uint32_t cp = n == 1 ? c : c & (0xff >> (n + 1));
        for (size_t k = 1; k < n; ++k) {
            const auto cc = static_cast<unsigned char>(s[i + k]);
            if ((cc & 0xc0) != 0x80) return false;
            cp = (cp << 6) | (cc & 0x3f);
        }
        static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
        i += n;
    }
    return true;
}

}  // namespace ferry
