#include "tokenizer/unicode.h"

#include <algorithm>
#include <iterator>

#include "core/utf8.h"

namespace ferry::tokenizer {

namespace {

struct ClassRange {
    uint32_t first;
    UnicodeClass cls;
};
constexpr ClassRange kClassRanges[] = {
#include "tokenizer/unicode_classes.inc"
};

}  // namespace

size_t Utf8Len(unsigned char c) {
    const size_t n = Utf8SequenceLength(c);
    return n ? n : 1;
}

std::vector<CodePoint> DecodeUtf8(std::string_view s) {
    std::vector<CodePoint> out;
    size_t i = 0;
    while (i < s.size()) {
        auto c = static_cast<unsigned char>(s[i]);
        size_t n = std::min(Utf8Len(c), s.size() - i);
        uint32_t cp = c;
        if (n > 1) {
            cp = c & (0xff >> (n + 1));
            for (size_t k = 1; k < n; ++k) {
                auto cc = static_cast<unsigned char>(s[i + k]);
                if ((cc & 0xc0) != 0x80) {  // malformed: take the lead byte alone
                    n = 1;
                    cp = c;
                    break;
                }
                cp = (cp << 6) | (cc & 0x3f);
            }
        }
        out.push_back({cp, i, n});
        i += n;
    }
    return out;
}

void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
        out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
        out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
        out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else if (cp < 0x10000) {
        out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
        out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
        out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else {
        out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
        out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
        out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
        out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
}

UnicodeClass ClassOf(uint32_t c) {
    const ClassRange* end = std::end(kClassRanges);
    const ClassRange* it =
        std::upper_bound(std::begin(kClassRanges), end, c,
                         [](uint32_t v, const ClassRange& r) { return v < r.first; });
    return it == std::begin(kClassRanges) ? UnicodeClass::kOther : (it - 1)->cls;
}

bool IsSpace(uint32_t c) {
    return c == ' ' || (c >= 0x09 && c <= 0x0d) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
           c == 0x205f || c == 0x3000;
}
bool IsLetter(uint32_t c) {
    if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    return ClassOf(c) == UnicodeClass::kLetter;
}
bool IsDigit(uint32_t c) {
    if (c < 0x80) return c >= '0' && c <= '9';
    return ClassOf(c) == UnicodeClass::kNumber;
}

}  // namespace ferry::tokenizer
