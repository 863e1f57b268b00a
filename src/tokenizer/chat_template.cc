#include "tokenizer/chat_template.h"

#include <fmt/core.h>

namespace ferry::tokenizer {

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

Result<std::string> ApplyChatTemplate(ChatTemplate t, std::span<const ChatMessage> messages,
                                      bool add_generation_prompt) {
    if (messages.empty()) return InvalidArgumentError("messages: empty");
    for (const ChatMessage& m : messages) {
        if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "tool") {
            return InvalidArgumentError(fmt::format(
                "messages: role '{}' is not one of system, user, assistant, tool", m.role));
        }
    }
    std::string out;
    switch (t) {
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

}  // namespace ferry::tokenizer
