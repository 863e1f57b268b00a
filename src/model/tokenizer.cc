#include "model/tokenizer.h"

#include <fmt/core.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <queue>

namespace ferry::model {

namespace {

// --- UTF-8 --------------------------------------------------------------------------------------

// A stray continuation byte (no sequence starts with it) stands alone.
size_t Utf8Len(unsigned char c) {
    const size_t n = Utf8SequenceLength(c);
    return n ? n : 1;
}

struct CodePoint {
    uint32_t cp;
    size_t offset;  // byte offset in the text
    size_t len;
};

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

// --- Unicode classes for the pre-tokenizers ----------------------------------------------------
// \p{L}, \p{N}, \p{P} are the Unicode general categories (src/model/unicode_classes.inc, made by
// scripts/gen-unicode-classes); \s is Unicode's White_Space, as in the regex engines the models'
// own tokenizers run.

enum class UnicodeClass : uint8_t { kOther, kLetter, kNumber, kPunct, kMark, kSymbol, kSeparator };
struct ClassRange {
    uint32_t first;
    UnicodeClass cls;
};
constexpr ClassRange kClassRanges[] = {
#include "model/unicode_classes.inc"
};

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
// \p{N}: every number, not only the ASCII digits ('½', '²', '٣').
bool IsDigit(uint32_t c) {
    if (c < 0x80) return c >= '0' && c <= '9';
    return ClassOf(c) == UnicodeClass::kNumber;
}
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
const ByteMap& Bytes() {
    static const ByteMap m;
    return m;
}

const std::string kSpmSpace = "\xe2\x96\x81";  // U+2581 '▁'

// --- GGUF array helpers -------------------------------------------------------------------------

Result<const GgufValue*> FindArray(const GgufFile& f, std::string_view key) {
    const GgufValue* v = f.Find(key);
    if (!v) return NotFoundError(fmt::format("{}: missing", key));
    if (v->type != GgufValueType::kArray) {
        return InvalidArgumentError(fmt::format("{}: not an array", key));
    }
    return v;
}

Result<std::vector<double>> NumberArray(const GgufFile& f, std::string_view key) {
    FERRY_ASSIGN_OR_RETURN(const GgufValue* v, FindArray(f, key));
    std::vector<double> out;
    out.reserve(v->array.size());
    for (const GgufValue& e : v->array) {
        if (auto* u = std::get_if<uint64_t>(&e.scalar)) {
            out.push_back(static_cast<double>(*u));
        } else if (auto* i = std::get_if<int64_t>(&e.scalar)) {
            out.push_back(static_cast<double>(*i));
        } else if (auto* d = std::get_if<double>(&e.scalar)) {
            out.push_back(*d);
        } else {
            return InvalidArgumentError(fmt::format("{}: not an array of numbers", key));
        }
    }
    return out;
}

bool GetBool(const GgufFile& f, std::string_view key, bool fallback) {
    const GgufValue* v = f.Find(key);
    if (v && v->type == GgufValueType::kBool) return std::get<bool>(v->scalar);
    return fallback;
}

int32_t GetId(const GgufFile& f, std::string_view key, int32_t vocab) {
    auto v = f.GetUint(key);
    if (!v.ok() || *v >= static_cast<uint64_t>(vocab)) return -1;
    return static_cast<int32_t>(*v);
}

}  // namespace

std::string ByteLevelToken(uint8_t b) {
    std::string s;
    AppendUtf8(Bytes().to_cp[b], &s);
    return s;
}

namespace {

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

Result<ChatTemplate> ParseChatTemplate(std::string_view name) {
    if (name == "chatml") return ChatTemplate::kChatMl;
    if (name == "llama3") return ChatTemplate::kLlama3;
    if (name == "llama2") return ChatTemplate::kLlama2;
    return InvalidArgumentError(
        fmt::format("chat template '{}' is not one of chatml, llama3, llama2", name));
}

std::string_view ChatTemplateName(ChatTemplate t) {
    switch (t) {
        case ChatTemplate::kChatMl:
            return "chatml";
        case ChatTemplate::kLlama3:
            return "llama3";
        case ChatTemplate::kLlama2:
            return "llama2";
    }
    return "?";
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& file) {
    std::unique_ptr<Tokenizer> t(new Tokenizer());
    FERRY_ASSIGN_OR_RETURN(std::string model, file.GetString("tokenizer.ggml.model"));
    if (model == "llama") {
        t->kind_ = Kind::kSentencePiece;
    } else if (model == "gpt2") {
        t->kind_ = Kind::kByteBpe;
    } else {
        return InvalidArgumentError(
            fmt::format("tokenizer.ggml.model '{}' is not supported (llama or gpt2)", model));
    }
    FERRY_ASSIGN_OR_RETURN(t->tokens_, file.GetStringArray("tokenizer.ggml.tokens"));
    const size_t n = t->tokens_.size();
    if (n == 0 || n > (1u << 24)) {
        return InvalidArgumentError(fmt::format("tokenizer.ggml.tokens: {} tokens", n));
    }
    auto types = NumberArray(file, "tokenizer.ggml.token_type");
    t->types_.assign(n, kNormal);
    if (types.ok()) {
        if (types->size() != n) {
            return InvalidArgumentError(fmt::format(
                "tokenizer.ggml.token_type: {} entries for {} tokens", types->size(), n));
        }
        for (size_t i = 0; i < n; ++i) {
            // GGUF's token types are 0 (undefined) to 6 (byte); anything else (a fraction, a
            // value no int holds) is a broken file, refused before it is converted.
            const double type = (*types)[i];
            if (!(type >= 0 && type <= static_cast<int>(kByte)) || type != std::floor(type)) {
                return InvalidArgumentError(
                    fmt::format("tokenizer.ggml.token_type[{}] = {} is not a token type (0 to {})",
                                i, type, static_cast<int>(kByte)));
            }
            t->types_[i] = static_cast<int32_t>(type);
        }
    }
    if (t->kind_ == Kind::kSentencePiece) {
        FERRY_ASSIGN_OR_RETURN(std::vector<double> scores,
                               NumberArray(file, "tokenizer.ggml.scores"));
        if (scores.size() != n) {
            return InvalidArgumentError(
                fmt::format("tokenizer.ggml.scores: {} entries for {} tokens", scores.size(), n));
        }
        t->scores_.resize(n);
        for (size_t i = 0; i < n; ++i) {
            // A score must be a float: NaN would make the merge order meaningless, and a double
            // beyond float's range has no float to become.
            if (std::isnan(scores[i]) ||
                (std::isfinite(scores[i]) &&
                 std::fabs(scores[i]) > std::numeric_limits<float>::max())) {
                return InvalidArgumentError(fmt::format(
                    "tokenizer.ggml.scores[{}] = {} is not a float score", i, scores[i]));
            }
            t->scores_[i] = static_cast<float>(scores[i]);
        }
    } else {
        auto merges = file.GetStringArray("tokenizer.ggml.merges");
        if (merges.ok()) {
            for (size_t r = 0; r < merges->size(); ++r) {
                const std::string& m = (*merges)[r];
                if (m.find(' ') == std::string::npos) {
                    return InvalidArgumentError(fmt::format(
                        "tokenizer.ggml.merges[{}] '{}' is not two tokens separated by a space", r,
                        m));
                }
                t->merge_rank_.emplace(m, static_cast<int32_t>(r));
            }
        } else if (merges.status().code() != Code::kNotFound) {
            return merges.status();
        }
        auto pre = file.GetString("tokenizer.ggml.pre");
        t->pre_ = pre.ok() ? *pre : "default";
    }
    for (size_t i = 0; i < n; ++i) {
        t->ids_.emplace(t->tokens_[i], static_cast<int32_t>(i));
        if ((t->types_[i] == kControl || t->types_[i] == kUserDefined) && !t->tokens_[i].empty()) {
            t->specials_.push_back(t->tokens_[i]);
        }
    }
    // Longest first, so "<|im_start|>" wins over a shorter special that prefixes it.
    std::sort(t->specials_.begin(), t->specials_.end(),
              [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
    for (int b = 0; b < 256; ++b) {
        t->byte_ids_[b] = -1;
        if (t->kind_ == Kind::kSentencePiece) {
            auto it = t->ids_.find(fmt::format("<0x{:02X}>", b));
            if (it != t->ids_.end()) t->byte_ids_[b] = it->second;
        } else {
            std::string s;
            AppendUtf8(Bytes().to_cp[b], &s);
            auto it = t->ids_.find(s);
            if (it != t->ids_.end()) t->byte_ids_[b] = it->second;
        }
    }
    const auto vocab = static_cast<int32_t>(n);
    t->bos_id_ = GetId(file, "tokenizer.ggml.bos_token_id", vocab);
    t->eos_id_ = GetId(file, "tokenizer.ggml.eos_token_id", vocab);
    t->unk_id_ = GetId(file, "tokenizer.ggml.unknown_token_id", vocab);
    t->add_bos_ = GetBool(file, "tokenizer.ggml.add_bos_token", t->kind_ == Kind::kSentencePiece) &&
                  t->bos_id_ >= 0;
    t->add_space_prefix_ = GetBool(file, "tokenizer.ggml.add_space_prefix", true);
    if (t->eos_id_ >= 0) t->stop_ids_.push_back(t->eos_id_);
    int32_t eot = GetId(file, "tokenizer.ggml.eot_token_id", vocab);
    if (eot >= 0) t->stop_ids_.push_back(eot);
    for (const char* s :
         {"<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>", "</s>"}) {
        auto it = t->ids_.find(s);
        if (it != t->ids_.end() && t->IsControl(it->second)) t->stop_ids_.push_back(it->second);
    }
    std::sort(t->stop_ids_.begin(), t->stop_ids_.end());
    t->stop_ids_.erase(std::unique(t->stop_ids_.begin(), t->stop_ids_.end()), t->stop_ids_.end());

    // Chat template: recognized from the Jinja text the model ships, else by its tokens.
    auto tmpl = file.GetString("tokenizer.chat_template");
    std::string text = tmpl.ok() ? *tmpl : "";
    if (text.find("<|start_header_id|>") != std::string::npos) {
        t->chat_template_ = ChatTemplate::kLlama3;
    } else if (text.find("<|im_start|>") != std::string::npos) {
        t->chat_template_ = ChatTemplate::kChatMl;
    } else if (text.find("[INST]") != std::string::npos) {
        t->chat_template_ = ChatTemplate::kLlama2;
    } else if (t->ids_.count("<|start_header_id|>")) {
        t->chat_template_ = ChatTemplate::kLlama3;
    } else if (t->ids_.count("<|im_start|>")) {
        t->chat_template_ = ChatTemplate::kChatMl;
    } else {
        t->chat_template_ =
            t->kind_ == Kind::kSentencePiece ? ChatTemplate::kLlama2 : ChatTemplate::kChatMl;
    }
    return t;
}

bool Tokenizer::IsControl(int32_t id) const {
    return id >= 0 && id < vocab_size() && types_[id] == kControl;
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_bos,
                                       bool parse_special) const {
    std::vector<int32_t> out;
    if (add_bos && bos_id_ >= 0) out.push_back(bos_id_);
    // Split on special token texts; the pieces between them go through the model's algorithm.
    size_t start = 0, i = 0;
    bool first = true;
    while (i < text.size()) {
        const std::string* hit = nullptr;
        if (!specials_.empty()) {
            for (const std::string& s : specials_) {
                // User-defined tokens (added tokens that are not special) are always matched,
                // as the models' own tokenizers and llama.cpp do; control tokens only when asked.
                if (s[0] == text[i] && text.compare(i, s.size(), s) == 0 &&
                    (parse_special || types_[ids_.at(s)] == kUserDefined)) {
                    hit = &s;
                    break;
                }
            }
        }
        if (!hit) {
            ++i;
            continue;
        }
        if (i > start) {
            EncodeText(text.substr(start, i - start), first, &out);
        }
        first = false;
        out.push_back(ids_.at(*hit));
        i += hit->size();
        start = i;
    }
    if (start < text.size()) EncodeText(text.substr(start), first, &out);
    return out;
}

void Tokenizer::EncodeText(std::string_view text, bool first, std::vector<int32_t>* out) const {
    if (kind_ == Kind::kSentencePiece) {
        EncodeSpm(text, first, out);
    } else {
        EncodeBpe(text, out);
    }
}

void Tokenizer::EncodeSpm(std::string_view raw, bool first, std::vector<int32_t>* out) const {
    std::string text;
    if (first && add_space_prefix_) text = kSpmSpace;
    for (char c : raw) {
        if (c == ' ') {
            text += kSpmSpace;
        } else {
            text.push_back(c);
        }
    }
    if (text.empty()) return;
    // Symbols are UTF-8 characters in a linked list; repeatedly merge the adjacent pair whose
    // concatenation is a token with the highest score (leftmost on ties).
    struct Sym {
        size_t off, len;
        int prev, next;
    };
    std::vector<Sym> syms;
    for (size_t i = 0; i < text.size();) {
        size_t n = std::min(Utf8Len(static_cast<unsigned char>(text[i])), text.size() - i);
        int idx = static_cast<int>(syms.size());
        syms.push_back({i, n, idx - 1, idx + 1});
        i += n;
    }
    syms.back().next = -1;
    struct Bigram {
        float score;
        int left;
        size_t len;
        bool operator<(const Bigram& o) const {
            return score < o.score || (score == o.score && left > o.left);
        }
    };
    std::priority_queue<Bigram> queue;
    auto try_pair = [&](int l) {
        if (l < 0 || syms[l].next < 0) return;
        const Sym& a = syms[l];
        const Sym& b = syms[a.next];
        auto it = ids_.find(std::string(text.substr(a.off, a.len + b.len)));
        if (it == ids_.end() || types_[it->second] == kControl) return;
        queue.push({scores_[it->second], l, a.len + b.len});
    };
    for (int i = 0; i + 1 < static_cast<int>(syms.size()); ++i) try_pair(i);
    while (!queue.empty()) {
        Bigram bg = queue.top();
        queue.pop();
        Sym& a = syms[bg.left];
        if (a.len == 0 || a.next < 0 || a.len + syms[a.next].len != bg.len) continue;  // stale
        Sym& b = syms[a.next];
        a.len += b.len;
        b.len = 0;
        a.next = b.next;
        if (a.next >= 0) syms[a.next].prev = bg.left;
        try_pair(a.prev);
        try_pair(bg.left);
    }
    for (int i = 0; i >= 0; i = syms[i].next) {
        const Sym& s = syms[i];
        auto it = ids_.find(std::string(text.substr(s.off, s.len)));
        if (it != ids_.end()) {
            out->push_back(it->second);
            continue;
        }
        for (size_t k = 0; k < s.len; ++k) {  // byte fallback
            int32_t id = byte_ids_[static_cast<unsigned char>(text[s.off + k])];
            out->push_back(id >= 0 ? id : unk_id_ >= 0 ? unk_id_ : 0);
        }
    }
}

void Tokenizer::EncodeBpe(std::string_view text, std::vector<int32_t>* out) const {
    for (std::string_view word : SplitPreTokens(text, pre_)) BpeWord(word, out);
}

void Tokenizer::BpeWord(std::string_view word, std::vector<int32_t>* out) const {
    // Bytes become printable code points; then the lowest-ranked adjacent pair is merged until
    // no pair is a merge.
    std::vector<std::string> parts;
    parts.reserve(word.size());
    for (unsigned char b : word) {
        std::string s;
        AppendUtf8(Bytes().to_cp[b], &s);
        parts.push_back(std::move(s));
    }
    while (parts.size() > 1 && !merge_rank_.empty()) {
        int best = INT_MAX;
        size_t at = 0;
        for (size_t i = 0; i + 1 < parts.size(); ++i) {
            auto it = merge_rank_.find(parts[i] + " " + parts[i + 1]);
            if (it != merge_rank_.end() && it->second < best) {
                best = it->second;
                at = i;
            }
        }
        if (best == INT_MAX) break;
        parts[at] += parts[at + 1];
        parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    for (const std::string& p : parts) {
        auto it = ids_.find(p);
        if (it != ids_.end()) {
            out->push_back(it->second);
            continue;
        }
        for (const CodePoint& cp : DecodeUtf8(p)) {  // unknown merge result: single bytes
            auto b = Bytes().to_byte.find(cp.cp);
            int32_t id = b != Bytes().to_byte.end() ? byte_ids_[b->second] : -1;
            out->push_back(id >= 0 ? id : unk_id_ >= 0 ? unk_id_ : 0);
        }
    }
}

std::string Tokenizer::TokenBytes(int32_t id) const {
    if (id < 0 || id >= vocab_size()) return "";
    const int32_t type = types_[id];
    const std::string& text = tokens_[id];
    if (type == kControl || type == kUnused) return "";
    if (type == kUserDefined) return text;
    if (kind_ == Kind::kSentencePiece) {
        if (type == kByte && text.size() == 6 && text.compare(0, 3, "<0x") == 0) {
            return std::string(1, static_cast<char>(std::stoi(text.substr(3, 2), nullptr, 16)));
        }
        std::string out;
        for (size_t i = 0; i < text.size();) {
            if (text.compare(i, kSpmSpace.size(), kSpmSpace) == 0) {
                out.push_back(' ');
                i += kSpmSpace.size();
            } else {
                out.push_back(text[i++]);
            }
        }
        return out;
    }
    std::string out;
    for (const CodePoint& cp : DecodeUtf8(text)) {
        auto b = Bytes().to_byte.find(cp.cp);
        if (b != Bytes().to_byte.end()) {
            out.push_back(static_cast<char>(b->second));
        } else {
            AppendUtf8(cp.cp, &out);
        }
    }
    return out;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool specials) const {
    std::string out;
    for (int32_t id : ids) out += specials ? LogprobBytes(id) : TokenBytes(id);
    return out;
}

std::string Tokenizer::LogprobBytes(int32_t id) const {
    if (IsControl(id)) return tokens_[id];
    return TokenBytes(id);
}

std::string Tokenizer::LogprobName(int32_t id) const {
    std::string bytes = LogprobBytes(id);
    if (IsValidUtf8(bytes)) return bytes;
    std::string out = "bytes:";
    for (unsigned char b : bytes) out += fmt::format("\\x{:02x}", b);
    return out;
}

Result<std::string> Tokenizer::ApplyChatTemplate(std::span<const ChatMessage> messages,
                                                 bool add_generation_prompt) const {
    if (messages.empty()) return InvalidArgumentError("messages: empty");
    for (const ChatMessage& m : messages) {
        if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "tool") {
            return InvalidArgumentError(fmt::format(
                "messages: role '{}' is not one of system, user, assistant, tool", m.role));
        }
    }
    std::string out;
    switch (chat_template_) {
        case ChatTemplate::kChatMl:
            for (const ChatMessage& m : messages) {
                out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
            }
            if (add_generation_prompt) out += "<|im_start|>assistant\n";
            break;
        case ChatTemplate::kLlama3: {
            out = "<|begin_of_text|>";
            for (const ChatMessage& m : messages) {
                std::string content = m.content;
                size_t b = content.find_first_not_of(" \t\r\n");
                size_t e = content.find_last_not_of(" \t\r\n");
                content = b == std::string::npos ? "" : content.substr(b, e - b + 1);
                out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + content +
                       "<|eot_id|>";
            }
            if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
            break;
        }
        case ChatTemplate::kLlama2: {
            // <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s><s>[INST] ...
            std::string system;
            size_t i = 0;
            if (messages[0].role == "system") {
                system = messages[0].content;
                i = 1;
            }
            bool first_user = true;
            for (; i < messages.size(); ++i) {
                const ChatMessage& m = messages[i];
                if (m.role == "assistant") {
                    out += " " + m.content + " </s>";
                    continue;
                }
                out += "<s>[INST] ";
                if (first_user && !system.empty()) {
                    out += "<<SYS>>\n" + system + "\n<</SYS>>\n\n";
                }
                first_user = false;
                out += m.content + " [/INST]";
            }
            break;
        }
    }
    return out;
}

}  // namespace ferry::model
