#include "tokenizer/tokenizer.h"

#include <fmt/core.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <queue>

#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/unicode.h"

namespace ferry::tokenizer {

namespace {

const std::string kSpmSpace = "\xe2\x96\x81";  // U+2581 '▁'

// --- GGUF array helpers -------------------------------------------------------------------------

Result<const gguf::GgufValue*> FindArray(const gguf::GgufFile& f, std::string_view key) {
    const gguf::GgufValue* v = f.Find(key);
    if (!v) return NotFoundError(fmt::format("{}: missing", key));
    if (v->type != gguf::GgufValueType::kArray) {
        return InvalidArgumentError(fmt::format("{}: not an array", key));
    }
    return v;
}

Result<std::vector<double>> NumberArray(const gguf::GgufFile& f, std::string_view key) {
    FERRY_ASSIGN_OR_RETURN(const gguf::GgufValue* v, FindArray(f, key));
    std::vector<double> out;
    out.reserve(v->array.size());
    for (const gguf::GgufValue& e : v->array) {
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

bool GetBool(const gguf::GgufFile& f, std::string_view key, bool fallback) {
    const gguf::GgufValue* v = f.Find(key);
    if (v && v->type == gguf::GgufValueType::kBool) return std::get<bool>(v->scalar);
    return fallback;
}

int32_t GetId(const gguf::GgufFile& f, std::string_view key, int32_t vocab) {
    auto v = f.GetUint(key);
    if (!v.ok() || *v >= static_cast<uint64_t>(vocab)) return -1;
    return static_cast<int32_t>(*v);
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const gguf::GgufFile& file) {
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
            AppendUtf8(ByteLevelMap().to_cp[b], &s);
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
        AppendUtf8(ByteLevelMap().to_cp[b], &s);
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
            auto b = ByteLevelMap().to_byte.find(cp.cp);
            int32_t id = b != ByteLevelMap().to_byte.end() ? byte_ids_[b->second] : -1;
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
        auto b = ByteLevelMap().to_byte.find(cp.cp);
        if (b != ByteLevelMap().to_byte.end()) {
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
    return tokenizer::ApplyChatTemplate(chat_template_, messages, add_generation_prompt);
}

}  // namespace ferry::tokenizer
