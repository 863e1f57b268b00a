#include "model/prompt.h"

#include <fmt/core.h>

#include <algorithm>

#include "core/json_fields.h"

namespace ferry::model {

namespace {

using Json = nlohmann::json;

bool Fail(PromptError* error, std::string message, std::string param) {
    *error = {std::move(message), std::move(param)};
    return false;
}

}  // namespace

bool ChatMessages(const Json& body, std::vector<ChatMessage>* out, PromptError* error) {
    if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty()) {
        return Fail(error, "'messages' must be a non-empty array", "messages");
    }
    for (size_t i = 0; i < body["messages"].size(); ++i) {
        const Json& m = body["messages"][i];
        std::string where = fmt::format("messages[{}]", i);
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
            return Fail(error, where + " must be an object with a string 'role'", where);
        }
        ChatMessage cm;
        cm.role = m["role"].get<std::string>();
        const Json& c = m.contains("content") ? m["content"] : Json();
        if (c.is_string()) {
            cm.content = c.get<std::string>();
        } else if (c.is_array()) {
            for (const Json& part : c) {
                if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
                    return Fail(error, where + ".content parts must be objects with a 'type'",
                                where + ".content");
                }
                std::string type = part["type"].get<std::string>();
                if (type != "text") {
                    return Fail(error,
                                fmt::format("{}.content: part type '{}' is not supported by "
                                            "this worker (text only)",
                                            where, type),
                                where + ".content");
                }
                if (!part.contains("text") || !part["text"].is_string()) {
                    return Fail(error, where + ".content: a text part needs a string 'text'",
                                where + ".content");
                }
                cm.content += part["text"].get<std::string>();
            }
        } else if (!c.is_null()) {
            return Fail(error, where + ".content must be a string or an array of parts",
                        where + ".content");
        }
        out->push_back(std::move(cm));
    }
    return true;
}

bool PromptTokens(const Json& body, bool chat, const Tokenizer& tk, std::vector<int32_t>* out,
                  PromptError* error) {
    out->clear();
    if (chat) {
        std::vector<ChatMessage> msgs;
        if (!ChatMessages(body, &msgs, error)) return false;
        auto text = tk.ApplyChatTemplate(msgs, true);
        if (!text.ok()) return Fail(error, text.status().message(), "messages");
        *out = tk.Encode(*text, false);
        return true;
    }
    if (!body.contains("prompt") || body["prompt"].is_null()) {
        return Fail(error, "'prompt' is required", "prompt");
    }
    const Json& p = body["prompt"];
    if (p.is_string()) {
        *out = tk.Encode(p.get<std::string>(), tk.add_bos());
    } else if (p.is_array() && !p.empty() && std::all_of(p.begin(), p.end(), [](const Json& e) {
                   return e.is_number_integer();
               })) {
        out->reserve(p.size());
        for (const Json& e : p) {
            const int64_t id = JsonFields::ClampedInt(e);
            if (id < 0 || id >= tk.vocab_size()) {
                out->clear();
                return Fail(error,
                            fmt::format("prompt token id {} is outside the vocabulary (0..{})",
                                        e.dump(), tk.vocab_size() - 1),
                            "prompt");
            }
            out->push_back(static_cast<int32_t>(id));
        }
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
        *out = tk.Encode(p[0].get<std::string>(), tk.add_bos());
    } else if (p.is_array() && p.size() > 1) {
        return Fail(error, "batched prompts are not supported: send one request per prompt",
                    "prompt");
    } else {
        return Fail(error, "'prompt' must be a string or an array of token ids", "prompt");
    }
    if (out->empty()) return Fail(error, "the prompt is empty", "prompt");
    return true;
}

}  // namespace ferry::model
