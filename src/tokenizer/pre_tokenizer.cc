#include "tokenizer/pre_tokenizer.h"

#include <algorithm>

#include "tokenizer/unicode.h"

namespace ferry::tokenizer {

namespace {

bool IsPunct(uint32_t c) { return ClassOf(c) == UnicodeClass::kPunct; }
bool IsOther(uint32_t c) { return !IsSpace(c) && !IsLetter(c) && !IsDigit(c); }

uint32_t Lower(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

// Length in code points of a contraction ('s 't 're 've 'm 'll 'd) at i, or 0.
size_t Contraction(const std::vector<CodePoint>& cps, size_t i, bool ignore_case) {
    if (cps[i].cp != '\'' || i + 1 >= cps.size()) return 0;
    auto at = [&](size_t k) -> uint32_t {
        if (k >= cps.size()) return 0;
        return ignore_case ? Lower(cps[k].cp) : cps[k].cp;
    };
    uint32_t a = at(i + 1), b = at(i + 2);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

// Splits `text` into pre-tokens as GPT-2's regex does
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// or, with `llama3`, as Llama 3's
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// `digits`: the longest run of digits in one pre-token (0: unlimited). SmolLM splits digits
// one by one before GPT-2's regex; Qwen2 is Llama 3's regex with single digits.
std::vector<std::string_view> PreTokenize(std::string_view text, bool llama3, int digits) {
    std::vector<CodePoint> cps = DecodeUtf8(text);
    std::vector<std::string_view> out;
    const size_t n = cps.size();
    auto emit = [&](size_t from, size_t to) {  // code point range
        size_t b = cps[from].offset;
        size_t e = to < n ? cps[to].offset : text.size();
        out.push_back(text.substr(b, e - b));
    };
    auto is_crlf = [](uint32_t c) { return c == '\r' || c == '\n'; };
    size_t i = 0;
    while (i < n) {
        uint32_t c = cps[i].cp;
        if (size_t k = Contraction(cps, i, llama3)) {
            emit(i, i + k);
            i += k;
            continue;
        }
        // Letters, with one optional leading char.
        if (llama3) {
            size_t j = i;
            if (!is_crlf(c) && !IsLetter(c) && !IsDigit(c) && j + 1 < n &&
                IsLetter(cps[j + 1].cp)) {
                ++j;
            }
            if (IsLetter(cps[j].cp)) {
                while (j < n && IsLetter(cps[j].cp)) ++j;
                emit(i, j);
                i = j;
                continue;
            }
            if (IsDigit(c)) {
                size_t j2 = i;
                while (j2 < n && j2 - i < static_cast<size_t>(digits) && IsDigit(cps[j2].cp)) {
                    ++j2;
                }
                emit(i, j2);
                i = j2;
                continue;
            }
        } else {
            if (digits > 0 && IsDigit(c)) {
                size_t j = i;
                while (j < n && j - i < static_cast<size_t>(digits) && IsDigit(cps[j].cp)) ++j;
                emit(i, j);
                i = j;
                continue;
            }
            size_t j = i + (c == ' ' && i + 1 < n ? 1 : 0);
            uint32_t d = cps[j].cp;
            if (IsLetter(d) || (IsDigit(d) && digits == 0)) {
                bool letter = IsLetter(d);
                while (j < n && (letter ? IsLetter(cps[j].cp) : IsDigit(cps[j].cp))) ++j;
                emit(i, j);
                i = j;
                continue;
            }
        }
        // Other symbols, with one optional leading space (and trailing newlines for llama3).
        {
            size_t j = i + (c == ' ' && i + 1 < n ? 1 : 0);
            if (IsOther(cps[j].cp)) {
                while (j < n && IsOther(cps[j].cp)) ++j;
                if (llama3) {
                    while (j < n && is_crlf(cps[j].cp)) ++j;
                }
                emit(i, j);
                i = j;
                continue;
            }
        }
        // Whitespace.
        size_t j = i;
        while (j < n && IsSpace(cps[j].cp)) ++j;
        if (llama3) {
            // \s*[\r\n]+ : the run up to and including its last newline.
            size_t last_nl = SIZE_MAX;
            for (size_t k = i; k < j; ++k) {
                if (is_crlf(cps[k].cp)) last_nl = k;
            }
            if (last_nl != SIZE_MAX) {
                emit(i, last_nl + 1);
                i = last_nl + 1;
                continue;
            }
        }
        // \s+(?!\S): leave the last space to the word that follows, unless it is the only one
        // (or, with digits split out first, the word is a digit).
        bool digit_next = !llama3 && digits > 0 && j < n && IsDigit(cps[j].cp);
        if (j < n && j - i > 1 && !digit_next) --j;
        emit(i, j);
        i = j;
    }
    return out;
}

// --- Pre-tokenizers as sequences of regex splits -------------------------------------------------
// Most models' pre-tokenizers are a list of regexes applied one after the other, each splitting
// every piece the previous one left, with the matches and the text between them both kept as
// pieces (Hugging Face's Split with "isolated" behaviour; llama.cpp's unicode_regex_split). Each
// regex here is a matcher: the number of code points it matches at a position, or 0.

using Pieces = std::vector<std::string_view>;
using Matcher = size_t (*)(const std::vector<CodePoint>& cps, size_t i);

Pieces SplitIsolated(const Pieces& in, Matcher match) {
    Pieces out;
    for (std::string_view piece : in) {
        std::vector<CodePoint> cps = DecodeUtf8(piece);
        const size_t n = cps.size();
        auto at = [&](size_t k) { return k < n ? cps[k].offset : piece.size(); };
        size_t gap = 0;
        for (size_t i = 0; i < n;) {
            size_t k = match(cps, i);
            if (k == 0) {
                ++i;
                continue;
            }
            if (gap < i) out.push_back(piece.substr(at(gap), at(i) - at(gap)));
            out.push_back(piece.substr(at(i), at(i + k) - at(i)));
            i += k;
            gap = i;
        }
        if (gap < n) out.push_back(piece.substr(at(gap)));
    }
    return out;
}

// A run of code points for which `pred` holds, after an optional leading \s when `space`.
template <bool (*pred)(uint32_t), bool space>
size_t RunOf(const std::vector<CodePoint>& cps, size_t i) {
    size_t j = i + (space && IsSpace(cps[i].cp) && i + 1 < cps.size() ? 1 : 0);
    size_t k = j;
    while (k < cps.size() && pred(cps[k].cp)) ++k;
    return k > j ? k - i : 0;
}
template <bool (*pred)(uint32_t)>
size_t OneOf(const std::vector<CodePoint>& cps, size_t i) {
    return pred(cps[i].cp) ? 1 : 0;
}

bool IsCrLf(uint32_t c) { return c == '\r' || c == '\n'; }
bool IsAsciiDigit(uint32_t c) { return c >= '0' && c <= '9'; }
// [\p{P}\$\+<=>\^~\|] and, for Falcon, also the backtick.
bool IsPunctOrMathAscii(uint32_t c) {
    return IsPunct(c) || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' ||
           c == '~' || c == '|';
}
bool IsFalconPunct(uint32_t c) { return IsPunctOrMathAscii(c) || c == '`'; }
// DeepSeek Coder's [一-龥ࠀ-一가-퟿].
bool IsDeepSeekCjk(uint32_t c) {
    return (c >= 0x4e00 && c <= 0x9fa5) || (c >= 0x0800 && c <= 0x4e00) ||
           (c >= 0xac00 && c <= 0xd7ff);
}
size_t ThreeAsciiDigits(const std::vector<CodePoint>& cps, size_t i) {
    return i + 2 < cps.size() && IsAsciiDigit(cps[i].cp) && IsAsciiDigit(cps[i + 1].cp) &&
                   IsAsciiDigit(cps[i + 2].cp)
               ? 3
               : 0;
}

enum class Stage : uint8_t {
    kGpt2,          // GPT-2's regex
    kLlama3,        // Llama 3's regex (\p{N}{1,3})
    kQwen2,         // Llama 3's regex with single digits
    kNumbers,       // \p{N}+
    kNumber,        // \p{N}
    kThreeDigits,   // [0-9][0-9][0-9]
    kPunctMath,     // [\p{P}\$\+<=>\^~\|]+
    kFalconPunct,   // [\p{P}\$\+<=>\^~\|`]+
    kCrLf,          // [\r\n]
    kSpaceLetters,  // \s?\p{L}+
    kSpacePunct,    // \s?\p{P}+
    kCjk,           // [一-龥ࠀ-一가-퟿]+
};

Pieces ApplyStage(const Pieces& in, Stage stage) {
    switch (stage) {
        case Stage::kGpt2:
        case Stage::kLlama3:
        case Stage::kQwen2: {
            Pieces out;
            for (std::string_view piece : in) {
                Pieces p = stage == Stage::kGpt2     ? PreTokenize(piece, false, 0)
                           : stage == Stage::kLlama3 ? PreTokenize(piece, true, 3)
                                                     : PreTokenize(piece, true, 1);
                out.insert(out.end(), p.begin(), p.end());
            }
            return out;
        }
        case Stage::kNumbers:
            return SplitIsolated(in, RunOf<IsDigit, false>);
        case Stage::kNumber:
            return SplitIsolated(in, OneOf<IsDigit>);
        case Stage::kThreeDigits:
            return SplitIsolated(in, ThreeAsciiDigits);
        case Stage::kPunctMath:
            return SplitIsolated(in, RunOf<IsPunctOrMathAscii, false>);
        case Stage::kFalconPunct:
            return SplitIsolated(in, RunOf<IsFalconPunct, false>);
        case Stage::kCrLf:
            return SplitIsolated(in, OneOf<IsCrLf>);
        case Stage::kSpaceLetters:
            return SplitIsolated(in, RunOf<IsLetter, true>);
        case Stage::kSpacePunct:
            return SplitIsolated(in, RunOf<IsPunct, true>);
        case Stage::kCjk:
            return SplitIsolated(in, RunOf<IsDeepSeekCjk, false>);
    }
    return in;
}

// tokenizer.ggml.pre -> its stages, as llama.cpp reads the names (llama-vocab.cpp).
std::vector<Stage> StagesFor(std::string_view pre) {
    auto is = [&](std::initializer_list<std::string_view> names) {
        return std::find(names.begin(), names.end(), pre) != names.end();
    };
    if (is({"gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en", "jina-v2-es",
            "jina-v2-de", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "trillion"})) {
        return {Stage::kGpt2};
    }
    if (is({"llama-bpe", "llama3", "falcon3", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe",
            "chatglm-bpe"})) {
        return {Stage::kLlama3};
    }
    if (is({"qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez"})) {
        return {Stage::kQwen2};
    }
    if (is({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"})) {
        return {Stage::kNumber, Stage::kGpt2};
    }
    if (pre == "falcon") return {Stage::kFalconPunct, Stage::kGpt2, Stage::kThreeDigits};
    if (pre == "deepseek-coder") {
        return {Stage::kCrLf, Stage::kSpaceLetters, Stage::kSpacePunct, Stage::kCjk,
                Stage::kNumber};
    }
    // "default" and names llama.cpp does not know either: its default list.
    return {Stage::kPunctMath, Stage::kGpt2, Stage::kNumbers, Stage::kThreeDigits};
}

}  // namespace

std::vector<std::string_view> SplitPreTokens(std::string_view text, std::string_view pre) {
    Pieces pieces = {text};
    if (text.empty()) return {};
    for (Stage stage : StagesFor(pre)) pieces = ApplyStage(pieces, stage);
    return pieces;
}

const ByteMap& ByteLevelMap() {
    static const ByteMap m;
    return m;
}

std::string ByteLevelToken(uint8_t b) {
    std::string s;
    AppendUtf8(ByteLevelMap().to_cp[b], &s);
    return s;
}

}  // namespace ferry::tokenizer
