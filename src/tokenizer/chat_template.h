// The chat templates ferry renders (ChatML, Llama 3, Llama 2), picked from a GGUF file's
// tokenizer.chat_template or by name.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "ferry/status.h"

namespace ferry::tokenizer {

struct ChatMessage {
    std::string role;  // system | user | assistant | tool
    std::string content;
};

enum class ChatTemplate : uint8_t { kChatMl, kLlama3, kLlama2 };
Result<ChatTemplate> ParseChatTemplate(std::string_view name);  // chatml | llama3 | llama2
std::string_view ChatTemplateName(ChatTemplate t);

// Renders messages with template `t`; with `add_generation_prompt` it ends with the assistant
// header. The result contains the template's control tokens (and bos when the template has
// one), so encode it with add_bos = false. InvalidArgument for no messages or an unknown role.
Result<std::string> ApplyChatTemplate(ChatTemplate t, std::span<const ChatMessage> messages,
                                      bool add_generation_prompt);

}  // namespace ferry::tokenizer
