#include "tokenizer/prompt.h"

#include <fmt/core.h>

#include <algorithm>

#include "core/json_fields.h"

namespace ferry::tokenizer {

namespace {

using Json = nlohmann::json;

bool Fail(PromptError* error, std::string message, std::string param) {
    *error = {std::move(message), std::move(param)};
    return false;
}

// An image_url part as OpenAI's API defines it: {"type": "image_url", "image_url": {"url": ...,
// "detail": "auto" | "low" | "high"}}.
bool ImageUrlPart(const Json& part, const std::string& at, ImagePart* out, PromptError* error) {
    if (!part.contains("image_url") || !part["image_url"].is_object()) {
        return Fail(error, at + ": an image_url part needs an object 'image_url' with a 'url'",
                    at + ".image_url");
    }
    const Json& iu = part["image_url"];
    if (!iu.contains("url") || !iu["url"].is_string() ||
        iu["url"].get_ref<const std::string&>().empty()) {
        return Fail(error, at + ".image_url.url must be a non-empty string", at + ".image_url.url");
    }
    if (iu.contains("detail") && !iu["detail"].is_null()) {
        const Json& d = iu["detail"];
        if (!d.is_string() || (d != "auto" && d != "low" && d != "high")) {
            return Fail(error, at + ".image_url.detail must be \"auto\", \"low\" or \"high\"",
                        at + ".image_url.detail");
        }
        out->detail = d.get<std::string>();
    }
    out->url = iu["url"].get<std::string>();
    out->param = at + ".image_url";
    return true;
}

}  // namespace

bool ChatMessages(const Json& body, std::vector<ChatMessage>* out, PromptError* error,
                  std::vector<ImagePart>* images) {
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
        // With images, the marker in text would be taken for one.
        auto marker_free = [&](const std::string& text, const std::string& at) {
            if (images == nullptr || text.find(kImageMarker) == std::string::npos) return true;
            return Fail(error,
                        fmt::format("{} contains '{}', which marks an image's place; send "
                                    "images as image_url parts",
                                    at, kImageMarker),
                        at);
        };
        if (c.is_string()) {
            cm.content = c.get<std::string>();
            if (!marker_free(cm.content, where + ".content")) return false;
        } else if (c.is_array()) {
            for (size_t j = 0; j < c.size(); ++j) {
                const Json& part = c[j];
                const std::string at = fmt::format("{}.content[{}]", where, j);
                if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
                    return Fail(error, at + " must be an object with a string 'type'", at);
                }
                std::string type = part["type"].get<std::string>();
                if (type == "image_url") {
                    ImagePart image;
                    if (!ImageUrlPart(part, at, &image, error)) return false;
                    if (images == nullptr) {
                        return Fail(error,
                                    at + ": this model takes no images (it has no vision "
                                         "encoder); send text parts only",
                                    at);
                    }
                    image.message = i;
                    image.offset = cm.content.size();
                    images->push_back(std::move(image));
                    cm.content += kImageMarker;
                    continue;
                }
                if (type != "text") {
                    return Fail(error,
                                fmt::format("{}: part type '{}' is not supported (text or "
                                            "image_url)",
                                            at, type.substr(0, 64)),
                                at);
                }
                if (!part.contains("text") || !part["text"].is_string()) {
                    return Fail(error, at + ": a text part needs a string 'text'", at);
                }
                const std::string& text = part["text"].get_ref<const std::string&>();
                if (!marker_free(text, at + ".text")) return false;
                cm.content += text;
            }
        } else if (!c.is_null()) {
            return Fail(error, where + ".content must be a string or an array of parts",
                        where + ".content");
        }
        out->push_back(std::move(cm));
    }
    return true;
}

int32_t ImagePlaceholder(const Tokenizer& tk) {
    for (int32_t id = 0; id < tk.vocab_size(); ++id) {
        if (tk.token_text(id) == "<image>") return id;
    }
    return tk.eos_id() >= 0 ? tk.eos_id() : 0;
}

bool PromptTokens(const Json& body, bool chat, const Tokenizer& tk, std::vector<int32_t>* out,
                  PromptError* error, const ImageTokens* image_tokens,
                  std::vector<ImagePart>* images) {
    out->clear();
    if (chat) {
        std::vector<ChatMessage> msgs;
        std::vector<ImagePart> parts;
        if (!ChatMessages(body, &msgs, error, image_tokens ? &parts : nullptr)) return false;
        auto text = tk.ApplyChatTemplate(msgs, true);
        if (!text.ok()) return Fail(error, text.status().message(), "messages");
        if (!image_tokens) {
            *out = tk.Encode(*text, false);
            return true;
        }
        // Each piece between markers alone, the image's placeholders between them.
        std::string_view rest = *text;
        size_t n = 0;
        for (size_t at; (at = rest.find(kImageMarker)) != std::string_view::npos;) {
            if (n == parts.size()) break;
            const std::vector<int32_t> piece = tk.Encode(rest.substr(0, at), false);
            out->insert(out->end(), piece.begin(), piece.end());
            parts[n++].token_offset = out->size();
            out->insert(out->end(), size_t(image_tokens->tokens_per_image),
                        image_tokens->placeholder);
            rest.remove_prefix(at + kImageMarker.size());
        }
        if (n != parts.size() || rest.find(kImageMarker) != std::string_view::npos) {
            out->clear();
            return Fail(error,
                        fmt::format("the chat template kept {} of the request's {} images (an "
                                    "image in a message it leaves out?)",
                                    n, parts.size()),
                        "messages");
        }
        const std::vector<int32_t> piece = tk.Encode(rest, false);
        out->insert(out->end(), piece.begin(), piece.end());
        if (images) *images = std::move(parts);
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

}  // namespace ferry::tokenizer
