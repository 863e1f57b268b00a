// Reading OpenAI completion answers in tests and soaks: the ids of an answer's tokens, whole or
// streamed, where its logprobs name them as "token_id:N" (vLLM's return_tokens_as_token_ids).
// No test framework here: the soaks use it too.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace ferry::testing {

// The token ids of a completion answer, whole or streamed.
inline std::vector<int32_t> TokensOf(const std::string& body, bool stream) {
    std::vector<int32_t> out;
    auto take = [&](const nlohmann::json& choice) {
        if (!choice.contains("logprobs") || !choice["logprobs"].is_object()) return;
        const nlohmann::json& lp = choice["logprobs"];
        if (lp.contains("content") && lp["content"].is_array()) {  // chat
            for (const nlohmann::json& t : lp["content"]) {
                std::string s = t["token"].get<std::string>();
                out.push_back(std::stoi(s.substr(s.find(':') + 1)));
            }
            return;
        }
        for (const nlohmann::json& t : lp["tokens"]) {
            std::string s = t.get<std::string>();
            out.push_back(std::stoi(s.substr(s.find(':') + 1)));
        }
    };
    if (!stream) {
        nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
        if (j.is_object() && j.contains("choices")) take(j["choices"][0]);
        return out;
    }
    size_t pos = 0;
    while ((pos = body.find("data: ", pos)) != std::string::npos) {
        size_t end = body.find("\n\n", pos);
        std::string ev = body.substr(pos + 6, end - pos - 6);
        pos = end;
        if (ev == "[DONE]") break;
        nlohmann::json j = nlohmann::json::parse(ev, nullptr, false);
        if (j.is_object() && j.contains("choices") && !j["choices"].empty()) take(j["choices"][0]);
    }
    return out;
}

}  // namespace ferry::testing
