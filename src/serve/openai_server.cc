#include "serve/openai_server.h"

#include <fmt/core.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "core/crypto.h"
#include "core/log.h"
#include "core/prometheus.h"
#include "http/http.h"
#include "router/protocol.h"
#include "router/router.h"
#include "serve/openai_request.h"

namespace ferry::serve {

namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

int64_t UnixSeconds() {
    return std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// --- metrics ----------------------------------------------------------------------------------

class Histogram {
  public:
    explicit Histogram(std::vector<double> bounds)
        : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
    void Observe(double v) {
        size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
        ++counts_[i];
        sum_ += v;
        ++count_;
    }
    void Render(const std::string& name, const std::string& help, PrometheusWriter* w) const {
        std::vector<uint64_t> cumulative(bounds_.size());
        uint64_t acc = 0;
        for (size_t i = 0; i < bounds_.size(); ++i) cumulative[i] = acc += counts_[i];
        w->Histogram(name, help, bounds_, cumulative, sum_, count_);
    }

  private:
    std::vector<double> bounds_;
    std::vector<uint64_t> counts_;
    double sum_ = 0;
    uint64_t count_ = 0;
};

// What the server adds to the engine's counters: latencies as the client sees them.
struct Metrics {
    std::mutex mu;
    Histogram ttft{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0}};
    Histogram itl{
        {0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5}};
    Histogram e2e{{0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0}};
    std::map<std::string, uint64_t> finished;  // by finish reason
    uint64_t bad_requests = 0;
    // Generated tokens per second over the last 10 s, in one-second buckets.
    std::array<uint64_t, 10> token_buckets{};
    int64_t bucket_second = 0;

    void AddTokens(uint64_t n, int64_t now_s) {
        Roll(now_s);
        token_buckets[now_s % 10] += n;
    }
    double TokensPerSecond(int64_t now_s) {
        Roll(now_s);
        uint64_t sum = 0;
        for (size_t i = 0; i < 10; ++i) {
            if (static_cast<int64_t>(i) != now_s % 10) sum += token_buckets[i];  // full seconds
        }
        return sum / 9.0;
    }

  private:
    void Roll(int64_t now_s) {
        if (bucket_second == 0) bucket_second = now_s;
        for (int64_t s = bucket_second + 1; s <= now_s && s <= bucket_second + 10; ++s) {
            token_buckets[s % 10] = 0;
        }
        bucket_second = std::max(bucket_second, now_s);
    }
};

// One request's state between the engine's step thread and the connection.
struct Pending {
    std::mutex mu;
    engine::RequestOutput all;  // non-streamed: everything so far
    bool finished = false;
    // Streamed.
    bool stream_started = false;
    bool sent_role = false;
    size_t text_offset = 0;
};

// A request's id from its X-Request-Id (1..128 of [A-Za-z0-9._:-]), else 128 random bits.
std::string RequestIdOf(const http::Request& req) {
    const std::string* x = req.Find("X-Request-Id");
    return x && ValidRequestId(*x) ? *x : RandomId128();
}

// The HTTP status of an error that ends a request: whose fault it is (docs/disaggregation.md).
int HttpStatusOf(const Status& st) {
    switch (st.code()) {
        case Code::kInvalidArgument:
        case Code::kOutOfRange:
            return 400;
        case Code::kPermissionDenied:
            return 403;
        case Code::kFailedPrecondition:
        case Code::kAlreadyExists:
        case Code::kAborted:
            return 409;
        case Code::kResourceExhausted:
            return 429;
        case Code::kUnavailable:
        case Code::kDeadlineExceeded:
        case Code::kCancelled:
        case Code::kNotFound:
            return 503;
        default:
            return 500;
    }
}

}  // namespace

struct OpenAiServer::Impl {
    std::shared_ptr<engine::Engine> engine;
    ServerConfig config;
    std::string model_name;
    int64_t created = UnixSeconds();
    std::unique_ptr<http::Server> http;
    // The same, for handlers: they may run before Start has stored `http`.
    std::atomic<http::Server*> http_ready{nullptr};
    std::atomic<bool> stopping{false};
    std::mutex stop_mu;
    std::condition_variable stop_cv;
    bool stopped = false;
    Metrics metrics;

    // Decode-first: the prefill workers this decoder sends its prompts to, and how they do.
    std::shared_ptr<router::Router> remote_prefill = std::make_shared<router::Router>();
    std::unique_ptr<http::Client> client;  // for the prefill workers

    std::vector<http::Route> Routes();
    // An OpenAI error body; with `request_id` (the X-Request-Id a request goes by here) the body
    // names it ("request_id") and the X-Request-Id header carries it.
    http::Reply Error(int status, const BadRequest& e, const std::string& request_id = "");
    void Completions(const std::shared_ptr<http::Exchange>& ex, bool chat);
    // Submits a parsed request and streams or returns its answer; the engine request id.
    // `retry`, if given, sees an error that ends the request before anything was sent to the
    // client and may take the request over (true: nothing is answered here).
    // `base` is the request's id without its "cmpl-" prefix ("": the X-Request-Id it came with,
    // or a random one).
    std::string Dispatch(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                         std::function<bool(const Status&)> retry = nullptr, std::string base = "");
    // Sends the prompt to the prefill worker `ticket` routed it to, to prefill and push here,
    // then dispatches locally under `base` (the request's id). A first attempt whose prefill
    // worker turns out unreachable (it restarted: the agent it had is gone) asks it again where
    // its agent is and tries once more. The ticket ends with the prefill worker's answer.
    void DecodeFirst(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                     std::shared_ptr<router::Ticket> ticket, std::string base, int attempt = 0);
    // Who is asking: kRouterRequester for a holder of the router token, else the client's
    // address. An error reply if the request must be refused (a wrong token, or a token where
    // one is required).
    std::optional<http::Reply> Authenticate(const http::Request& req, bool internal,
                                            std::string* requester);
    void SendToRemotePrefill(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                             std::shared_ptr<router::Ticket> ticket, const std::string& base,
                             int attempt, const router::AgentInfo& agent);
    void AddRemotePrefill(const std::shared_ptr<http::Exchange>& ex);
    std::string RenderMetrics();
};

http::Reply OpenAiServer::Impl::Error(int status, const BadRequest& e,
                                      const std::string& request_id) {
    Json err = {{"message", e.message},
                {"type", status == 400 || status == 413 ? "invalid_request_error"
                         : status == 401                ? "authentication_error"
                         : status == 403                ? "permission_error"
                         : status == 404                ? "not_found_error"
                         : status == 409                ? "conflict_error"
                         : status == 429                ? "rate_limit_error"
                         : status == 503                ? "service_unavailable"
                                                        : "server_error"},
                {"param", e.param.empty() ? Json() : Json(e.param)},
                {"code", e.code.empty() ? Json() : Json(e.code)}};
    if (status == 400) {
        std::lock_guard lock(metrics.mu);
        ++metrics.bad_requests;
    }
    if (request_id.empty()) return {status, "application/json", Dump({{"error", err}}), {}};
    err["request_id"] = request_id;
    return {status, "application/json", Dump({{"error", err}}), {{"X-Request-Id", request_id}}};
}

std::vector<http::Route> OpenAiServer::Impl::Routes() {
    std::vector<http::Route> r;
    r.push_back({"GET", "/health", [](std::shared_ptr<http::Exchange> ex) {
                     ex->Reply({200, "application/json", "{\"status\":\"ok\"}", {}});
                 }});
    r.push_back({"GET", "/v1/models", [this](std::shared_ptr<http::Exchange> ex) {
                     Json m = {{"id", model_name},   {"object", "model"},
                               {"created", created}, {"owned_by", "ferry"},
                               {"root", model_name}, {"max_model_len", engine->max_model_len()}};
                     ex->Reply({200,
                                "application/json",
                                Dump({{"object", "list"}, {"data", Json::array({m})}}),
                                {}});
                 }});
    r.push_back({"GET", "/metrics", [this](std::shared_ptr<http::Exchange> ex) {
                     ex->Reply({200, "text/plain; version=0.0.4", RenderMetrics(), {}});
                 }});
    if (config.kv_agent_info) {
        r.push_back({"GET", "/v1/kv/agent", [this](std::shared_ptr<http::Exchange> ex) {
                         std::string who;
                         if (auto refused = Authenticate(ex->request(), false, &who)) {
                             return ex->Reply(*refused);
                         }
                         ex->Reply({200, "application/json", config.kv_agent_info(), {}});
                     }});
    }
    // vLLM's /tokenize and /detokenize.
    r.push_back({"POST", "/tokenize",
                 [this](std::shared_ptr<http::Exchange> ex) {
                     const model::Tokenizer& tk = engine->model().tokenizer();
                     TokenizeRequest tr;
                     BadRequest bad;
                     if (!ParseTokenizeRequest(ex->request().body, tk, model_name, &tr, &bad)) {
                         return ex->Reply(Error(400, bad));
                     }
                     Json strs;
                     if (tr.return_token_strs) {
                         strs = Json::array();
                         for (int32_t t : tr.tokens) strs.push_back(tk.token_text(t));
                     }
                     ex->Reply({200,
                                "application/json",
                                Dump({{"count", tr.tokens.size()},
                                      {"max_model_len", engine->max_model_len()},
                                      {"tokens", tr.tokens},
                                      {"token_strs", strs}}),
                                {}});
                 },
                 config.max_body_bytes});
    r.push_back(
        {"POST", "/detokenize",
         [this](std::shared_ptr<http::Exchange> ex) {
             const model::Tokenizer& tk = engine->model().tokenizer();
             std::vector<int32_t> tokens;
             BadRequest bad;
             if (!ParseDetokenizeRequest(ex->request().body, tk, model_name, &tokens, &bad)) {
                 return ex->Reply(Error(400, bad));
             }
             ex->Reply({200,
                        "application/json",
                        Dump({{"prompt", tk.Decode(tokens, /*specials=*/true)}}),
                        {}});
         },
         config.max_body_bytes});
    r.push_back({"POST", "/add_remote_prefill_eps",
                 [this](std::shared_ptr<http::Exchange> ex) { AddRemotePrefill(ex); }, 1u << 20});
    r.push_back({"POST", "/v1/completions",
                 [this](std::shared_ptr<http::Exchange> ex) { Completions(ex, false); },
                 config.max_body_bytes});
    r.push_back({"POST", "/v1/chat/completions",
                 [this](std::shared_ptr<http::Exchange> ex) { Completions(ex, true); },
                 config.max_body_bytes});
    return r;
}

std::optional<http::Reply> OpenAiServer::Impl::Authenticate(const http::Request& req, bool internal,
                                                            std::string* requester) {
    const std::string* auth = req.Find("Authorization");
    if (config.router_token.empty()) {
        if (internal) {
            return Error(403, {"this route changes where the worker sends prompts: it is served "
                               "only to the router of a deployment with a secret (start the "
                               "worker with --secret-file)",
                               "", "admin_route_disabled"});
        }
        size_t colon = req.remote.rfind(':');
        *requester = colon == std::string::npos ? req.remote : req.remote.substr(0, colon);
        return std::nullopt;
    }
    constexpr std::string_view kBearer = "Bearer ";
    if (!auth || auth->size() < kBearer.size() ||
        !std::equal(kBearer.begin(), kBearer.end(), auth->begin(), [](char a, char b) {
            return std::tolower(static_cast<unsigned char>(a)) ==
                   std::tolower(static_cast<unsigned char>(b));
        })) {
        return Error(401, {"kv_transfer_params and internal routes need the deployment's router "
                           "token (Authorization: Bearer ...; `ferry secret router-token`)",
                           "", "missing_router_token"});
    }
    if (!SecretEqual(std::string_view(*auth).substr(kBearer.size()), config.router_token)) {
        return Error(403, {"the router token is not this deployment's", "", "wrong_router_token"});
    }
    *requester = kv::kRouterRequester;
    return std::nullopt;
}

void OpenAiServer::Impl::Completions(const std::shared_ptr<http::Exchange>& ex, bool chat) {
    const model::Tokenizer& tk = engine->model().tokenizer();
    ParsedRequest pr;
    BadRequest bad;
    if (!ParseOpenAiRequest(ex->request().body, chat, tk, model_name, engine->max_model_len(), &pr,
                            &bad)) {
        const std::string* x = ex->request().Find("X-Request-Id");
        return ex->Reply(Error(400, bad, x && ValidRequestId(*x) ? *x : ""));
    }
    if (!pr.kv_transfer_json.empty()) {
        // The connector's own format: a malformed field is named before anything else.
        const std::string* x = ex->request().Find("X-Request-Id");
        const std::string rid = x && ValidRequestId(*x) ? *x : "";
        if (!config.parse_kv_params) {
            return ex->Reply(Error(400,
                                   {"kv_transfer_params: this worker has no KV connector (start "
                                    "it with a prefill or decode role)",
                                    "kv_transfer_params", ""},
                                   rid));
        }
        Result<std::shared_ptr<kv::ConnectorParams>> kv =
            config.parse_kv_params(pr.kv_transfer_json);
        if (!kv.ok()) {
            return ex->Reply(Error(400, {kv.status().message(), "kv_transfer_params", ""}, rid));
        }
        pr.kv_transfer = std::move(*kv);
    }
    if (pr.kv_transfer) {
        // Internal fields: honoured only from the router (with a secret), and counted against
        // whoever sent them.
        if (auto refused = Authenticate(ex->request(), false, &pr.kv_transfer->requester)) {
            return ex->Reply(*refused);
        }
    }
    if (pr.kv_transfer && pr.kv_transfer->prefill_only() && pr.stream) {
        // vLLM's proxies ask the prefill worker for a whole answer (it carries the params).
        pr.stream = false;
    }
    if (!pr.kv_transfer && config.kv_agent_info &&
        static_cast<int>(pr.prompt.size()) >= config.remote_prefill_min_tokens) {
        const std::string base = RequestIdOr(ex->request().Find("X-Request-Id"));
        Result<router::Ticket> t =
            remote_prefill->Route(router::Role::kPrefill, {base, pr.prompt.size()});
        if (t.ok()) {
            return DecodeFirst(ex, chat, std::move(pr),
                               std::make_shared<router::Ticket>(std::move(*t)), base);
        }
    }
    Dispatch(ex, chat, std::move(pr));
}

void OpenAiServer::Impl::DecodeFirst(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                     ParsedRequest pr, std::shared_ptr<router::Ticket> ticket,
                                     std::string base, int attempt) {
    auto shared = std::make_shared<ParsedRequest>(std::move(pr));
    router::FindAgent(
        *client, remote_prefill, router::Role::kPrefill, ticket->worker(), config.router_token,
        [this, ex, chat, shared, ticket, base, attempt](Result<router::AgentInfo> agent) {
            if (!agent.ok()) {
                ticket->End(router::Outcome::kWorkerFailed);
                return ex->Reply(Error(503, {"remote " + agent.status().message(), "", ""}, base));
            }
            SendToRemotePrefill(ex, chat, std::move(*shared), ticket, base, attempt, *agent);
        });
}

void OpenAiServer::Impl::SendToRemotePrefill(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                             ParsedRequest pr,
                                             std::shared_ptr<router::Ticket> ticket,
                                             const std::string& base, int attempt,
                                             const router::AgentInfo& agent) {
    const http::Endpoint ep = ticket->endpoint();
    const std::string key = fmt::format("{}:{}", ep.host, ep.port);
    // Unguessable: a client that could name the next transfer id could park requests under it.
    const std::string xid = RandomId128();
    // This worker's own params for the local request, in the connector's format (the router's
    // push decode params: written once), parsed as any request's are.
    Result<std::shared_ptr<kv::ConnectorParams>> kvp =
        config.parse_kv_params ? config.parse_kv_params(router::PushDecodeParams(xid, agent).dump())
                               : Result<std::shared_ptr<kv::ConnectorParams>>(
                                     FailedPreconditionError("this worker has no KV connector"));
    if (!kvp.ok() || !*kvp) {
        ticket->End(router::Outcome::kCancelled);
        return ex->Reply(
            Error(500,
                  {fmt::format("decode-first: {}", kvp.ok() ? "no params" : kvp.status().message()),
                   "", ""},
                  base));
    }
    // The prefill worker gets the prompt as token ids (the chat template is applied here) and
    // the sampling parameters: it samples the first token, which comes back with the KV.
    const model::SamplingParams& sp = pr.sampling;
    Json body = {{"prompt", pr.prompt},
                 {"max_tokens", 1},
                 {"stream", false},
                 {"temperature", sp.temperature},
                 {"top_p", sp.top_p},
                 {"top_k", sp.top_k},
                 {"ignore_eos", sp.ignore_eos},
                 {"kv_transfer_params", router::PushPrefillParams(xid)}};
    if (sp.seed) body["seed"] = static_cast<int64_t>(*sp.seed);
    if (sp.logprobs >= 0) body["logprobs"] = sp.logprobs;
    auto original = std::make_shared<ParsedRequest>(pr);  // for a second attempt
    (*kvp)->requester = kv::kRouterRequester;             // this worker's own request
    pr.kv_transfer = std::move(*kvp);
    auto prefill_call = std::make_shared<std::shared_ptr<http::ClientCall>>();
    auto call_mu = std::make_shared<std::mutex>();
    std::function<bool(const Status&)> retry;
    if (attempt == 0) {
        retry = [this, ex, chat, key, original, prefill_call, call_mu, ticket,
                 base](const Status& st) {
            if (st.code() != Code::kUnavailable || stopping) return false;
            {
                std::lock_guard lock(*call_mu);
                if (*prefill_call) (*prefill_call)->Cancel();
            }
            remote_prefill->ForgetAgent(router::Role::kPrefill, ticket->worker());
            FERRY_LOG(kInfo,
                      "serve: request {}: remote prefill via {} failed ({}); asking it again", base,
                      key, st.ToString());
            DecodeFirst(ex, chat, std::move(*original), ticket, base, 1);
            return true;
        };
    }
    const std::string id = Dispatch(ex, chat, std::move(pr), std::move(retry), base);
    if (id.empty()) return ticket->End(router::Outcome::kCancelled);
    http::ClientRequest r;
    r.host = ep.host;
    r.port = ep.port;
    r.target = "/v1/completions";
    r.body = Dump(body);
    r.timeout = std::chrono::minutes(10);
    r.headers.push_back({"X-Request-Id", id.substr(id.find('-') + 1)});
    router::Authorize(&r, config.router_token);
    std::lock_guard lock(*call_mu);
    *prefill_call = client->CallWhole(
        std::move(r),
        [this, id, key, ticket](Result<http::ClientReply> got) {
            // Cancelled: a second attempt took over, and carries the ticket on.
            if (!got.ok() && got.status().code() == Code::kCancelled) return;
            ticket->End(got.ok() ? router::OutcomeOfStatus(got->status)
                                 : router::Outcome::kWorkerFailed);
            if (got.ok() && got->status == 200) return;
            // The KV will not come: the request ends with the prefill worker's error, and the
            // next request asks it again where its agent is (it may have restarted).
            remote_prefill->ForgetAgent(router::Role::kPrefill, ticket->worker());
            engine->Abort(id, UnavailableError(fmt::format(
                                  "remote prefill worker {} failed: {}", key,
                                  got.ok() ? fmt::format("HTTP {}: {}", got->status, got->body)
                                           : got.status().message())));
        },
        4096);
}

void OpenAiServer::Impl::AddRemotePrefill(const std::shared_ptr<http::Exchange>& ex) {
    std::string who;
    if (auto refused = Authenticate(ex->request(), true, &who)) return ex->Reply(*refused);
    if (!config.kv_agent_info) {
        return ex->Reply(Error(400, {"this worker has no KV connector: start it with --role "
                                     "decode to use remote prefill workers",
                                     "", ""}));
    }
    const std::string& text = ex->request().body;
    Json j = JsonDepthWithin(text, kMaxJsonDepth) ? Json::parse(text, nullptr, false) : Json();
    if (!j.is_object() || !j.contains("endpoints") || !j["endpoints"].is_array() ||
        j["endpoints"].empty() || j["endpoints"].size() > 1024) {
        return ex->Reply(Error(
            400, {"the body must be {\"endpoints\": [\"HOST:PORT\", ...]}", "endpoints", ""}));
    }
    std::vector<http::Endpoint> eps;
    for (const Json& e : j["endpoints"]) {
        if (!e.is_string())
            return ex->Reply(Error(400, {"an endpoint is not a string", "endpoints", ""}));
        auto ep = http::ParseEndpoint(e.get<std::string>());
        if (!ep.ok()) return ex->Reply(Error(400, {ep.status().message(), "endpoints", ""}));
        eps.push_back(*ep);
    }
    for (const http::Endpoint& ep : eps) remote_prefill->AddWorker(router::Role::kPrefill, ep);
    Json all = Json::array();
    for (const router::WorkerState& w : remote_prefill->Workers(router::Role::kPrefill)) {
        all.push_back(fmt::format("{}:{}", w.endpoint.host, w.endpoint.port));
    }
    ex->Reply({200, "application/json", Dump({{"status", "ok"}, {"remote_prefill", all}}), {}});
}

std::string OpenAiServer::Impl::Dispatch(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                         ParsedRequest pr, std::function<bool(const Status&)> retry,
                                         std::string base) {
    const model::Tokenizer& tk = engine->model().tokenizer();
    // One id for the request in every process (vLLM's rule: "cmpl-" + X-Request-Id): the
    // router's id, which it sends to each worker, else 128 random bits (nothing about other
    // requests can be derived from it).
    if (base.empty()) base = RequestIdOf(ex->request());
    const std::string id = fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", base);
    const Clock::time_point submitted = Clock::now();
    auto last = std::make_shared<Clock::time_point>(submitted);
    auto first = std::make_shared<bool>(true);
    auto pending = std::make_shared<Pending>();
    const std::string object = chat ? "chat.completion" : "text_completion";
    const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
    const int64_t created_at = UnixSeconds();

    auto usage_json = [](const engine::RequestOutput& o) {
        return Json{{"prompt_tokens", o.prompt_tokens},
                    {"completion_tokens", o.completion_tokens},
                    {"total_tokens", o.prompt_tokens + o.completion_tokens},
                    {"prompt_tokens_details", {{"cached_tokens", o.cached_tokens}}}};
    };
    // Log-probabilities of one output event, in the endpoint's format.
    const bool as_ids = pr.tokens_as_ids;
    auto logprobs_json = [&tk, chat, as_ids](const engine::RequestOutput& o, size_t* text_offset) {
        // A token's name: vLLM's (its text, or "bytes:\xNN" for part of a character), or
        // "token_id:N" when asked. The chat `bytes` field holds the token's own bytes, so a
        // client can join partial characters.
        auto name = [&](int32_t t) {
            return as_ids ? fmt::format("token_id:{}", t) : tk.LogprobName(t);
        };
        auto bytes = [&](int32_t t) {
            std::string b = tk.LogprobBytes(t);
            return std::vector<uint8_t>(b.begin(), b.end());
        };
        if (chat) {
            Json content = Json::array();
            for (size_t i = 0; i < o.tokens.size() && i < o.logprobs.size(); ++i) {
                Json top = Json::array();
                for (auto [tid, lp] : o.top_logprobs[i]) {
                    top.push_back({{"token", name(tid)}, {"logprob", lp}, {"bytes", bytes(tid)}});
                }
                content.push_back({{"token", name(o.tokens[i])},
                                   {"logprob", o.logprobs[i]},
                                   {"bytes", bytes(o.tokens[i])},
                                   {"top_logprobs", top}});
            }
            return Json{{"content", content}};
        }
        Json tokens = Json::array(), lps = Json::array(), tops = Json::array(),
             offsets = Json::array();
        for (size_t i = 0; i < o.tokens.size() && i < o.logprobs.size(); ++i) {
            tokens.push_back(name(o.tokens[i]));
            lps.push_back(o.logprobs[i]);
            Json top = Json::object();
            for (auto [tid, lp] : o.top_logprobs[i]) top[name(tid)] = lp;
            tops.push_back(o.top_logprobs[i].empty() ? Json() : top);
            offsets.push_back(*text_offset);
            *text_offset += tk.TokenBytes(o.tokens[i]).size();
        }
        return Json{{"tokens", tokens},
                    {"token_logprobs", lps},
                    {"top_logprobs", tops},
                    {"text_offset", offsets}};
    };
    auto sse = [](const Json& j) { return "data: " + Dump(j) + "\n\n"; };
    auto chunk = [this, id, chunk_object, created_at](Json choice) {
        return Json{{"id", id},
                    {"object", chunk_object},
                    {"created", created_at},
                    {"model", model_name},
                    {"choices", Json::array({std::move(choice)})}};
    };

    const bool stream = pr.stream;
    std::weak_ptr<http::Exchange> weak = ex;
    engine::Request er;
    er.id = id;
    er.prompt = pr.prompt;
    er.sampling = pr.sampling;
    er.kv_transfer = pr.kv_transfer;
    // A request whose KV comes from elsewhere can fail before its first token for reasons
    // with their own status (a refused claim 409, an unreachable peer 503): its stream starts
    // with the first output, so that such an error is an HTTP status, not a 200 with an error
    // event (and a retry can still take it over).
    const bool late_head = stream && pr.kv_transfer != nullptr;
    // Runs on the engine's step thread: formats and hands bytes to the connection, never waits.
    er.on_output = [this, weak, pending, submitted, last, first, stream, chat, id, base, object,
                    created_at, chunk_object, pr, usage_json, logprobs_json, sse, chunk,
                    retry](const engine::RequestOutput& o) {
        Clock::time_point now = Clock::now();
        {
            std::lock_guard lock(metrics.mu);
            if (!o.tokens.empty()) {
                if (*first) {
                    metrics.ttft.Observe(std::chrono::duration<double>(now - submitted).count());
                    *first = false;
                } else {
                    metrics.itl.Observe(std::chrono::duration<double>(now - *last).count());
                }
                metrics.AddTokens(o.tokens.size(), std::chrono::duration_cast<std::chrono::seconds>(
                                                       now.time_since_epoch())
                                                       .count());
            }
            *last = now;
            if (o.finish != engine::FinishReason::kNone) {
                metrics.e2e.Observe(std::chrono::duration<double>(now - submitted).count());
                ++metrics.finished[engine::FinishReasonName(o.finish)];
            }
        }
        const bool final = o.finish != engine::FinishReason::kNone;
        std::shared_ptr<http::Exchange> ex = weak.lock();
        std::unique_lock lock(pending->mu);
        if (final) pending->finished = true;
        if (!ex || ex->closed()) return;
        const bool nothing_sent = !stream ? true : !pending->stream_started;
        if (o.finish == engine::FinishReason::kError && nothing_sent &&
            pending->all.tokens.empty() && retry) {
            lock.unlock();
            if (retry(o.error)) return;
            lock.lock();
        }
        if (stream && !pending->stream_started) {
            if (o.finish == engine::FinishReason::kError) {
                return ex->Reply(Error(HttpStatusOf(o.error), {o.error.message(), "", ""}, base));
            }
            pending->stream_started = true;
            ex->StartStream(200, "text/event-stream",
                            {{"Cache-Control", "no-cache"}, {"X-Request-Id", base}});
        }
        if (!stream) {
            engine::RequestOutput& all = pending->all;
            all.tokens.insert(all.tokens.end(), o.tokens.begin(), o.tokens.end());
            all.logprobs.insert(all.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
            all.top_logprobs.insert(all.top_logprobs.end(), o.top_logprobs.begin(),
                                    o.top_logprobs.end());
            all.text += o.text;
            if (!final) return;
            all.finish = o.finish;
            all.prompt_tokens = o.prompt_tokens;
            all.completion_tokens = o.completion_tokens;
            all.cached_tokens = o.cached_tokens;
            if (o.finish == engine::FinishReason::kError) {
                // A transfer that failed is the remote worker's fault (503), refused params
                // the caller's (400, 403, 409, 429); 500 only for a fault of this worker.
                return ex->Reply(Error(HttpStatusOf(o.error), {o.error.message(), "", ""}, base));
            }
            size_t offset = 0;
            Json choice = {{"index", 0}, {"finish_reason", engine::FinishReasonName(all.finish)}};
            if (chat) {
                choice["message"] = {{"role", "assistant"}, {"content", all.text}};
            } else {
                choice["text"] = all.text;
            }
            choice["logprobs"] = pr.want_logprobs ? logprobs_json(all, &offset) : Json();
            Json out = {{"id", id},
                        {"object", object},
                        {"created", created_at},
                        {"model", model_name},
                        {"choices", Json::array({choice})},
                        {"usage", usage_json(all)}};
            if (o.kv_transfer) {
                out["kv_transfer_params"] = Json::parse(o.kv_transfer->ToJson());
            }
            return ex->Reply({200, "application/json", Dump(out), {{"X-Request-Id", base}}});
        }
        std::string bytes;
        if (chat && !pending->sent_role) {
            pending->sent_role = true;
            bytes += sse(chunk({{"index", 0},
                                {"delta", {{"role", "assistant"}, {"content", ""}}},
                                {"logprobs", Json()},
                                {"finish_reason", Json()}}));
        }
        if (o.finish == engine::FinishReason::kError) {
            bytes += sse({{"error",
                           {{"message", o.error.message()},
                            {"type", "server_error"},
                            {"request_id", base}}}});
            bytes += "data: [DONE]\n\n";
            ex->Write(std::move(bytes));
            return ex->End();
        }
        Json c = {{"index", 0}};
        if (chat) {
            c["delta"] = o.text.empty() && final ? Json::object() : Json{{"content", o.text}};
        } else {
            c["text"] = o.text;
        }
        c["logprobs"] = pr.want_logprobs ? logprobs_json(o, &pending->text_offset) : Json();
        c["finish_reason"] = final ? Json(engine::FinishReasonName(o.finish)) : Json();
        bytes += sse(chunk(c));
        if (final && pr.include_usage) {
            bytes += sse({{"id", id},
                          {"object", chunk_object},
                          {"created", created_at},
                          {"model", model_name},
                          {"choices", Json::array()},
                          {"usage", usage_json(o)}});
        }
        if (final) bytes += "data: [DONE]\n\n";
        ex->Write(std::move(bytes));
        if (final) ex->End();
    };
    if (stream && !late_head) {
        pending->stream_started = true;
        ex->StartStream(200, "text/event-stream",
                        {{"Cache-Control", "no-cache"}, {"X-Request-Id", base}});
    }
    Status st = engine->Submit(std::move(er));
    if (st.code() == Code::kAlreadyExists && base.size() < 200) {
        // The id is still in use here (a router's retry, a hold not yet released): the same id
        // with a random tail, so the logs still join.
        return Dispatch(ex, chat, std::move(pr), std::move(retry),
                        base + "-" + RandomId128().substr(0, 8));
    }
    if (!st.ok()) {
        int status = HttpStatusOf(st);
        if (status == 500) status = 400;
        BadRequest e{st.message(), st.code() == Code::kInvalidArgument ? "prompt" : "", ""};
        if (!stream || late_head) {
            ex->Reply(Error(status, e, base));
            return "";
        }
        Json err = {
            {"error",
             {{"message", e.message}, {"type", "invalid_request_error"}, {"request_id", base}}}};
        ex->Write(sse(err) + "data: [DONE]\n\n");
        ex->End();
        return "";
    }
    // A client that goes away has its request aborted and its blocks freed.
    ex->OnClose([engine = engine, id, pending] {
        bool finished;
        {
            std::lock_guard lock(pending->mu);
            finished = pending->finished;
        }
        if (!finished) engine->Abort(id);
    });
    return id;
}

std::string OpenAiServer::Impl::RenderMetrics() {
    engine::EngineStats s = engine->Stats();
    PrometheusWriter w;
    auto gauge = [&](const char* name, const char* help, double v) { w.Gauge(name, help, v); };
    auto counter = [&](const char* name, const char* help, double v) { w.Counter(name, help, v); };
    gauge("ferry_num_requests_running", "Requests in the running batch.", s.running);
    gauge("ferry_num_requests_waiting", "Requests waiting to be scheduled.", s.waiting);
    gauge("ferry_kv_blocks_total", "KV cache blocks.", s.kv_blocks_total);
    gauge("ferry_kv_blocks_used", "KV cache blocks in use.", s.kv_blocks_used);
    gauge("ferry_kv_blocks_free", "KV cache blocks free (cached or empty).",
          s.kv_blocks_total - s.kv_blocks_used);
    gauge("ferry_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.",
          s.kv_blocks_total ? double(s.kv_blocks_used) / s.kv_blocks_total : 0.0);
    counter("ferry_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
            double(s.prefix_query_tokens));
    counter("ferry_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
            double(s.prefix_hit_tokens));
    gauge("ferry_prefix_cache_hit_rate", "Prefix cache hits / queries (tokens) since start.",
          s.prefix_query_tokens ? double(s.prefix_hit_tokens) / s.prefix_query_tokens : 0.0);
    counter("ferry_prompt_tokens_total", "Prompt tokens computed (prefix hits excluded).",
            double(s.prompt_tokens));
    counter("ferry_generation_tokens_total", "Tokens generated.", double(s.generation_tokens));
    counter("ferry_num_preemptions_total", "Sequences preempted (recomputed later).",
            double(s.preemptions));
    counter("ferry_engine_steps_total", "Engine steps run.", double(s.steps));
    gauge("ferry_kv_requests_parked", "Requests waiting for a decoder's block ids (push).",
          s.kv_parked);
    gauge("ferry_kv_requests_loading", "Requests holding blocks while their KV arrives.",
          s.kv_loading);
    gauge("ferry_kv_requests_held", "Finished requests whose blocks a remote worker still uses.",
          s.kv_held);
    counter("ferry_kv_external_tokens_total", "Prompt tokens whose KV came from another worker.",
            double(s.kv_external_tokens));
    counter("ferry_kv_load_failures_total", "Requests whose remote KV did not arrive.",
            double(s.kv_load_failures));
    if (config.extra_metrics) w.Append(config.extra_metrics());
    if (http::Server* server = http_ready.load()) {
        http::ServerStats hs = server->Stats();
        gauge("ferry_http_connections_open", "Open HTTP connections.", double(hs.connections_open));
        counter("ferry_http_requests_total", "HTTP requests read.", double(hs.requests));
        counter("ferry_http_timed_out_total",
                "Connections closed for not sending a whole request in time.",
                double(hs.timed_out));
    }
    std::lock_guard lock(metrics.mu);
    int64_t now_s =
        std::chrono::duration_cast<std::chrono::seconds>(Clock::now().time_since_epoch()).count();
    gauge("ferry_generation_tokens_per_second", "Tokens generated per second over the last 10 s.",
          metrics.TokensPerSecond(now_s));
    w.Family("ferry_request_success_total", "counter", "Finished requests by finish reason.");
    for (const char* r : {"stop", "length", "abort", "error"}) {
        w.Sample("ferry_request_success_total", {{"finished_reason", r}},
                 double(metrics.finished[r]));
    }
    counter("ferry_request_bad_total", "Requests refused with HTTP 400.",
            double(metrics.bad_requests));
    metrics.ttft.Render("ferry_time_to_first_token_seconds", "Time to first token.", &w);
    metrics.itl.Render("ferry_inter_token_latency_seconds", "Time between output tokens.", &w);
    metrics.e2e.Render("ferry_e2e_request_latency_seconds", "Request latency, end to end.", &w);
    return w.Take();
}

OpenAiServer::OpenAiServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<OpenAiServer>> OpenAiServer::Start(std::shared_ptr<engine::Engine> engine,
                                                          const ServerConfig& config) {
    if (!engine) return InvalidArgumentError("serve: no engine");
    if (config.max_connections < 1) {
        return InvalidArgumentError("serve: max connections must be at least 1");
    }
    auto impl = std::make_unique<Impl>();
    impl->engine = std::move(engine);
    impl->config = config;
    impl->model_name = config.served_model_name.empty() ? impl->engine->model().config().name
                                                        : config.served_model_name;
    http::ServerConfig hc;
    hc.name = "serve";
    hc.host = config.host;
    hc.port = config.port;
    hc.io_threads = config.io_threads;
    hc.max_connections = static_cast<size_t>(config.max_connections);
    hc.max_body_bytes = config.max_body_bytes;
    hc.request_deadline = config.request_deadline;
    Impl* p = impl.get();
    hc.error_reply = [p](int status, const std::string& message) {
        return p->Error(status, {message, "", ""});
    };
    for (const http::Endpoint& ep : config.remote_prefill) {
        impl->remote_prefill->AddWorker(router::Role::kPrefill, ep);
    }
    impl->client = http::Client::Create(1);
    FERRY_ASSIGN_OR_RETURN(impl->http, http::Server::Start(std::move(hc), impl->Routes()));
    impl->http_ready = impl->http.get();
    return std::unique_ptr<OpenAiServer>(new OpenAiServer(std::move(impl)));
}

OpenAiServer::~OpenAiServer() { Stop(); }

int OpenAiServer::port() const { return impl_->http->port(); }
const std::string& OpenAiServer::model_name() const { return impl_->model_name; }

void OpenAiServer::Stop() {
    if (impl_->stopping.exchange(true)) return;
    impl_->http->Stop();
    impl_->client.reset();
    std::lock_guard lock(impl_->stop_mu);
    impl_->stopped = true;
    impl_->stop_cv.notify_all();
}

void OpenAiServer::Wait() {
    std::unique_lock lock(impl_->stop_mu);
    impl_->stop_cv.wait(lock, [&] { return impl_->stopped; });
}

}  // namespace ferry::serve
