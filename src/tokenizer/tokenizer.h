// Tokenizers read from GGUF metadata (tokenizer.ggml.*), the two kinds llama-family models ship:
// - "llama": SentencePiece-style BPE over Unicode characters with scores, '▁' for spaces and
//   <0xXX> byte fallback (Llama 2, TinyLlama, Mistral);
// - "gpt2": byte-level BPE with ranked merges and a regex pre-tokenizer (Llama 3, SmolLM, Qwen;
//   also the byte vocabulary of `ferry model init`).
// Control tokens written in the text ("<|im_start|>") are recognized as single tokens, as the
// chat templates need. Chat templates: ChatML, Llama 3 and Llama 2, picked from
// tokenizer.chat_template or by name.
//
// Immutable after construction; every method is const and thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/utf8.h"
#include "ferry/status.h"
#include "gguf/gguf.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/pre_tokenizer.h"

namespace ferry::tokenizer {

class Tokenizer {
  public:
    enum class Kind : uint8_t { kSentencePiece, kByteBpe };
    // Token types of tokenizer.ggml.token_type.
    enum TokenType : int32_t {
        kNormal = 1,
        kUnknown = 2,
        kControl = 3,
        kUserDefined = 4,
        kUnused = 5,
        kByte = 6
    };

    // InvalidArgument naming the key for missing or inconsistent metadata.
    static Result<std::unique_ptr<Tokenizer>> FromGguf(const gguf::GgufFile& file);

    Kind kind() const { return kind_; }
    int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
    int32_t bos_id() const { return bos_id_; }
    int32_t eos_id() const { return eos_id_; }
    bool add_bos() const { return add_bos_; }
    // Tokens that end generation: eos, eot and the end-of-turn tokens of the chat template.
    const std::vector<int32_t>& stop_ids() const { return stop_ids_; }
    const std::string& token_text(int32_t id) const { return tokens_[id]; }
    bool IsControl(int32_t id) const;

    // Text to token ids; `add_bos` prepends bos when the model wants one (add_bos()). With
    // `parse_special`, control token texts in `text` ("<|im_start|>") become those tokens, as chat
    // templates need; without, they are text like any other. User-defined tokens always match.
    std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                                bool parse_special = true) const;
    // The bytes token `id` adds to the text (control tokens add none). Bytes of one character
    // may be split across tokens: join before treating them as UTF-8.
    std::string TokenBytes(int32_t id) const;
    // The text of `ids`; with `specials`, control tokens add their own text ("<|im_end|>"), as
    // Hugging Face's decode does without skip_special_tokens.
    std::string Decode(std::span<const int32_t> ids, bool specials = false) const;
    // How an OpenAI logprobs entry names token `id`, the way vLLM does: its text when its bytes
    // are whole UTF-8 (a control token: its own text), else "bytes:" and each byte as \xNN
    // (a token holding part of a character: "bytes:\xe2\x96"). Distinct tokens never share a
    // name unless they are the same bytes.
    std::string LogprobName(int32_t id) const;
    // The bytes that name stands for: TokenBytes, or the text of a control token.
    std::string LogprobBytes(int32_t id) const;

    ChatTemplate chat_template() const { return chat_template_; }
    void set_chat_template(ChatTemplate t) { chat_template_ = t; }
    // Renders messages with the chat template; with `add_generation_prompt` it ends with the
    // assistant header. The result contains the template's control tokens (and bos when the
    // template has one), so encode it with add_bos = false.
    Result<std::string> ApplyChatTemplate(std::span<const ChatMessage> messages,
                                          bool add_generation_prompt) const;

  private:
    Tokenizer() = default;
    void EncodeText(std::string_view text, bool first, std::vector<int32_t>* out) const;
    void EncodeSpm(std::string_view text, bool first, std::vector<int32_t>* out) const;
    void EncodeBpe(std::string_view text, std::vector<int32_t>* out) const;
    void BpeWord(std::string_view word, std::vector<int32_t>* out) const;

    Kind kind_ = Kind::kByteBpe;
    std::string pre_;  // pre-tokenizer name (gpt2 kind)
    std::vector<std::string> tokens_;
    std::vector<float> scores_;
    std::vector<int32_t> types_;
    std::unordered_map<std::string, int32_t> ids_;
    std::unordered_map<std::string, int32_t> merge_rank_;  // "a b" -> rank
    std::vector<std::string> specials_;                    // control / user-defined texts
    int32_t bos_id_ = -1;
    int32_t eos_id_ = -1;
    int32_t unk_id_ = -1;
    int32_t byte_ids_[256];
    bool add_bos_ = false;
    bool add_space_prefix_ = true;
    std::vector<int32_t> stop_ids_;
    ChatTemplate chat_template_ = ChatTemplate::kChatMl;
};

}  // namespace ferry::tokenizer
