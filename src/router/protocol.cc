#include "router/protocol.h"

#include <fmt/core.h>

#include "core/crypto.h"
#include "core/host_port.h"
#include "core/json_fields.h"

namespace ferry::router {

namespace {

using Json = nlohmann::json;

}  // namespace

const char* ProtocolName(Protocol protocol) {
    return protocol == Protocol::kPush ? "push" : "pull";
}

http::Reply ErrorReply(int status, const OpenAiError& error, const std::string& request_id) {
    http::Reply r{status,
                  "application/json",
                  DumpJson(schema::OpenAiErrorJson(status, error, request_id)),
                  {}};
    if (!request_id.empty()) r.headers.push_back({"X-Request-Id", request_id});
    return r;
}

std::string ErrorEvent(int status, const OpenAiError& error, const std::string& request_id) {
    return "data: " + DumpJson(schema::OpenAiErrorJson(status, error, request_id)) +
           "\n\ndata: [DONE]\n\n";
}

Json PrefillBody(Json body) {
    body["stream"] = false;
    body["max_tokens"] = 1;
    if (body.contains("max_completion_tokens")) body["max_completion_tokens"] = 1;
    body.erase("stream_options");
    body.erase("min_tokens");
    body.erase("min_completion_tokens");
    return body;
}

std::vector<std::string_view> ImageUrls(const Json& body) {
    std::vector<std::string_view> urls;
    if (!body.is_object() || !body.contains("messages") || !body["messages"].is_array()) {
        return urls;
    }
    for (const Json& m : body["messages"]) {
        if (!m.is_object() || !m.contains("content") || !m["content"].is_array()) continue;
        for (const Json& part : m["content"]) {
            if (!part.is_object() || !part.contains("type") || part["type"] != "image_url") {
                continue;
            }
            if (!part.contains("image_url") || !part["image_url"].is_object()) continue;
            const Json& iu = part["image_url"];
            if (iu.contains("url") && iu["url"].is_string()) {
                urls.push_back(iu["url"].get_ref<const std::string&>());
            }
        }
    }
    return urls;
}

size_t PickEncoder(const std::vector<std::string_view>& urls,
                   const std::vector<http::Endpoint>& encoders) {
    std::string key;
    for (std::string_view u : urls) key.append(HexEncode(Sha256(u).data(), 8));
    size_t best = 0;
    Digest best_score{};
    for (size_t i = 0; i < encoders.size(); ++i) {
        const Digest d = Sha256(fmt::format("{}|{}:{}", key, encoders[i].host, encoders[i].port));
        if (i == 0 || d > best_score) {
            best = i;
            best_score = d;
        }
    }
    return best;
}

Result<AgentInfo> ParseAgentInfo(int status, const std::string& body,
                                 const http::Endpoint& worker) {
    Json j = status == 200 ? Json::parse(body, nullptr, false) : Json();
    Result<schema::AgentAddress> address = j.is_object()
                                               ? schema::ParseAgentAddress(j, "agent", worker.host)
                                               : InvalidArgumentError("not a JSON object");
    if (!address.ok()) {
        return UnavailableError(fmt::format(
            "prefill worker {} has no usable KV agent (GET /v1/kv/agent answered {}: "
            "{}): start it with --role prefill",
            FormatHostPort(worker.host, worker.port), status, address.status().message()));
    }
    AgentInfo a;
    static_cast<schema::AgentAddress&>(a) = std::move(*address);
    const JsonFields f(j, "agent");
    Result<std::optional<int64_t>> tp = f.OptInt("tp_size", 1, 1024);
    if (!tp.ok()) {
        return UnavailableError(fmt::format("prefill worker {} names an agent with {}: not usable",
                                            FormatHostPort(worker.host, worker.port),
                                            tp.status().message()));
    }
    a.tp_size = static_cast<int>(tp->value_or(1));
    return a;
}

void Authorize(http::ClientRequest* request, const std::string& router_token) {
    if (!router_token.empty()) {
        request->headers.push_back({"Authorization", "Bearer " + router_token});
    }
}

std::shared_ptr<http::ClientCall> FindAgent(http::Client& client, std::shared_ptr<Router> router,
                                            Role role, size_t worker,
                                            const std::string& router_token,
                                            std::chrono::milliseconds timeout,
                                            std::function<void(Result<AgentInfo>)> done) {
    if (std::optional<AgentInfo> known = router->KnownAgent(role, worker)) {
        done(std::move(*known));
        return nullptr;
    }
    std::vector<WorkerState> ws = router->Workers(role);
    if (worker >= ws.size()) {
        done(InternalError(fmt::format("router: no {} worker {}", RoleName(role), worker)));
        return nullptr;
    }
    const http::Endpoint ep = ws[worker].endpoint;
    http::ClientRequest r = http::GetRequest(ep.host, ep.port, "/v1/kv/agent", timeout);
    Authorize(&r, router_token);
    return client.CallWhole(std::move(r), [router, role, worker, ep,
                                           done = std::move(done)](Result<http::ClientReply> got) {
        if (!got.ok()) {
            if (got.status().code() == Code::kCancelled) return done(got.status());
            return done(got.status().WithContext(fmt::format("{} worker {}: GET /v1/kv/agent",
                                                             RoleName(role),
                                                             FormatHostPort(ep.host, ep.port))));
        }
        Result<AgentInfo> a = ParseAgentInfo(got->status, got->body, ep);
        if (a.ok()) router->SetAgent(role, worker, *a);
        done(std::move(a));
    });
}

Outcome OutcomeOfStatus(int status) {
    if (status >= 200 && status < 300) return Outcome::kSucceeded;
    if (status >= 400 && status < 500 && status != 408 && status != 429) return Outcome::kRefused;
    return Outcome::kWorkerFailed;
}

}  // namespace ferry::router
