// UTF-8 decoding into code points and the Unicode classes the pre-tokenizers' regexes use
// (\p{L}, \p{N}, \p{P}, \s), for the tokenizer library's own files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::tokenizer {

// A stray continuation byte (no sequence starts with it) stands alone.
size_t Utf8Len(unsigned char c);

struct CodePoint {
    uint32_t cp;
    size_t offset;  // byte offset in the text
    size_t len;
};

// Malformed sequences decode as their lead byte alone; nothing is refused.
std::vector<CodePoint> DecodeUtf8(std::string_view s);
void AppendUtf8(uint32_t cp, std::string* out);

// \p{L}, \p{N}, \p{P} are the Unicode general categories (src/tokenizer/unicode_classes.inc,
// made by scripts/gen-unicode-classes); \s is Unicode's White_Space, as in the regex engines the
// models' own tokenizers run.
enum class UnicodeClass : uint8_t { kOther, kLetter, kNumber, kPunct, kMark, kSymbol, kSeparator };
UnicodeClass ClassOf(uint32_t c);
bool IsSpace(uint32_t c);
bool IsLetter(uint32_t c);
// \p{N}: every number, not only the ASCII digits ('½', '²', '٣').
bool IsDigit(uint32_t c);

}  // namespace ferry::tokenizer
