#include "serve/proxy.h"

#include <fmt/core.h>

#include <atomic>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "core/crypto.h"
#include "core/log.h"
#include "serve/openai_request.h"

namespace ferry::serve {

namespace {

using Json = nlohmann::json;

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// An OpenAI error body; with `request_id` it names the request (body and X-Request-Id).
http::Reply ErrorReply(int status, const std::string& message, const std::string& request_id = "") {
    Json err = {{"message", message},
                {"type", status < 500 ? "invalid_request_error" : "server_error"},
                {"param", nullptr},
                {"code", status}};
    if (request_id.empty()) return {status, "application/json", Dump({{"error", err}}), {}};
    err["request_id"] = request_id;
    return {status, "application/json", Dump({{"error", err}}), {{"X-Request-Id", request_id}}};
}

class RoundRobin : public RoutingPolicy {
  public:
    size_t PickPrefill(const http::Request&, size_t n) override { return p_++ % n; }
    size_t PickDecode(const http::Request&, size_t n) override { return d_++ % n; }

  private:
    std::atomic<size_t> p_{0}, d_{0};
};

// A prefill worker's transfer agent, as GET /v1/kv/agent says (push needs it in the decode
// request).
struct AgentInfo {
    std::string engine_id, host;
    int port = 0, tp_size = 1;
};

}  // namespace

std::unique_ptr<RoutingPolicy> MakeRoundRobin() { return std::make_unique<RoundRobin>(); }

struct Proxy::Impl : std::enable_shared_from_this<Impl> {
    ProxyConfig cfg;
    std::unique_ptr<http::Client> client;
    std::unique_ptr<http::Server> server;
    std::atomic<http::Server*> server_ready{nullptr};  // for handlers that run before Start ends
    std::mutex mu;
    std::map<size_t, AgentInfo> agents;  // by prefill index
    std::atomic<uint64_t> requests{0}, succeeded{0}, failed{0}, client_gone{0}, inflight{0};

    // One client request on its way through the workers.
    struct Flow {
        std::mutex mu;
        std::shared_ptr<http::Exchange> ex;
        std::vector<std::shared_ptr<http::ClientCall>> calls;
        bool cancelled = false;
        bool answered = false;
        bool stream = false;
        std::string path;
        Json body;
        std::string request_id;
        size_t prefill = 0, decode = 0;
        int attempt = 0;  // push: 1 once retried after refreshing the prefill worker's agent
        // Relay state.
        int status = 0;
        std::string content_type = "application/json";
        std::string collected;
        bool started = false;

        void Add(std::shared_ptr<http::ClientCall> c) {
            std::lock_guard lock(mu);
            if (cancelled) {
                c->Cancel();
                return;
            }
            calls.push_back(std::move(c));
        }
        void CancelAll() {
            std::vector<std::shared_ptr<http::ClientCall>> cs;
            {
                std::lock_guard lock(mu);
                cancelled = true;
                cs.swap(calls);
            }
            for (auto& c : cs) c->Cancel();
        }
        // A second attempt: the first one's calls end (their callbacks see Cancelled), the
        // flow goes on.
        void CancelAttempt() {
            std::vector<std::shared_ptr<http::ClientCall>> cs;
            {
                std::lock_guard lock(mu);
                cs.swap(calls);
                status = 0;
                collected.clear();
                content_type = "application/json";
            }
            for (auto& c : cs) c->Cancel();
        }
        // The first answer wins; later ones are dropped.
        bool Claim() {
            std::lock_guard lock(mu);
            if (answered) return false;
            answered = true;
            return true;
        }
    };

    http::ClientRequest ToWorker(const http::Endpoint& ep, const std::string& path,
                                 const Json& body, const std::string& request_id) const {
        http::ClientRequest r;
        r.method = "POST";
        r.host = ep.host;
        r.port = ep.port;
        r.target = path;
        r.body = Dump(body);
        r.timeout = cfg.worker_timeout;
        r.headers.push_back({"X-Request-Id", request_id});
        Authorize(&r);
        return r;
    }

    void Authorize(http::ClientRequest* r) const {
        if (!cfg.router_token.empty()) {
            r->headers.push_back({"Authorization", "Bearer " + cfg.router_token});
        }
    }

    // The request as vLLM's proxy sends it to a prefill worker.
    static Json PrefillBody(Json body) {
        body["stream"] = false;
        body["max_tokens"] = 1;
        if (body.contains("max_completion_tokens")) body["max_completion_tokens"] = 1;
        body.erase("stream_options");
        body.erase("min_tokens");
        body.erase("min_completion_tokens");
        return body;
    }

    void Finish(const std::shared_ptr<Flow>& f, bool ok) {
        --inflight;
        (ok ? succeeded : failed)++;
        if (!ok && cfg.mode == kv::KvTransferMode::kPush) {
            // The prefill worker may have restarted with another agent: ask it again next time.
            std::lock_guard lock(mu);
            agents.erase(f->prefill);
        }
    }

    void Fail(const std::shared_ptr<Flow>& f, int status, const std::string& message) {
        if (!f->Claim()) return;
        f->CancelAll();
        Finish(f, false);
        FERRY_LOG(kInfo, "proxy: request {} failed: {} {}", f->request_id, status, message);
        if (f->started) {
            // Mid-stream: an error event, then the end.
            f->ex->Write(
                "data: " +
                Dump({{"error",
                       {{"message", message}, {"code", status}, {"request_id", f->request_id}}}}) +
                "\n\ndata: [DONE]\n\n");
            f->ex->End();
            return;
        }
        f->ex->Reply(ErrorReply(status, message, f->request_id));
    }

    // Sends the request to the decode worker and relays its answer to the client.
    void Decode(const std::shared_ptr<Flow>& f, Json body) {
        const http::Endpoint& ep = cfg.decode[f->decode];
        auto self = shared_from_this();
        http::ClientCallbacks cb;
        cb.on_head = [self, f](const http::ClientHead& h) {
            std::lock_guard lock(f->mu);
            f->status = h.status;
            if (const std::string* ct = http::FindHeader(h.headers, "content-type")) {
                f->content_type = *ct;
            }
            if (f->stream && h.status == 200) {
                f->started = true;
                f->ex->StartStream(
                    h.status, f->content_type,
                    {{"Cache-Control", "no-cache"}, {"X-Request-Id", f->request_id}});
            }
        };
        cb.on_data = [f](std::string_view d) {
            std::lock_guard lock(f->mu);
            if (f->started) {
                f->ex->Write(std::string(d));
            } else if (f->collected.size() < (64u << 20)) {
                f->collected.append(d);
            }
        };
        cb.on_done = [self, f, ep](const Status& st) {
            if (!st.ok()) {
                if (st.code() == Code::kCancelled) return;
                return self->Fail(
                    f, st.code() == Code::kDeadlineExceeded ? 504 : 502,
                    fmt::format("decode worker {}:{}: {}", ep.host, ep.port, st.message()));
            }
            bool retry = false;
            {
                std::lock_guard lock(f->mu);
                // push: the decoder could not reach the prefill worker's agent before any
                // token (503): that agent may have moved. Once: ask again, then retry.
                retry = self->cfg.mode == kv::KvTransferMode::kPush && f->attempt == 0 &&
                        f->status == 503 && !f->started && !f->cancelled && !f->answered;
                if (retry) f->attempt = 1;
            }
            if (retry) {
                FERRY_LOG(kInfo,
                          "proxy: request {}: the decode worker could not reach the "
                          "prefill worker's agent; asking it again and retrying",
                          f->request_id);
                f->CancelAttempt();
                {
                    std::lock_guard lock(self->mu);
                    self->agents.erase(f->prefill);
                }
                return self->Push(f);
            }
            if (!f->Claim()) return;
            f->CancelAll();
            std::lock_guard lock(f->mu);
            self->Finish(f, f->status == 200);
            if (f->started) {
                f->ex->End();
            } else {
                f->ex->Reply({f->status,
                              f->content_type,
                              std::move(f->collected),
                              {{"X-Request-Id", f->request_id}}});
            }
        };
        f->Add(client->Call(ToWorker(ep, f->path, body, f->request_id), std::move(cb)));
    }

    // Calls a worker and hands its whole answer to `done` (status, body) or fails the flow.
    void CallWhole(const std::shared_ptr<Flow>& f, http::ClientRequest req, std::string what,
                   std::function<void(int, std::string)> done) {
        auto self = shared_from_this();
        f->Add(client->CallWhole(
            std::move(req), [self, f, what, done = std::move(done)](Result<http::ClientReply> r) {
                if (!r.ok()) {
                    if (r.status().code() == Code::kCancelled) return;
                    return self->Fail(f, r.status().code() == Code::kDeadlineExceeded ? 504 : 502,
                                      fmt::format("{}: {}", what, r.status().message()));
                }
                done(r->status, std::move(r->body));
            }));
    }

    void Pull(const std::shared_ptr<Flow>& f) {
        Json pb = PrefillBody(f->body);
        pb["kv_transfer_params"] = {{"do_remote_decode", true},    {"do_remote_prefill", false},
                                    {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                                    {"remote_host", nullptr},      {"remote_port", nullptr}};
        const http::Endpoint& ep = cfg.prefill[f->prefill];
        auto self = shared_from_this();
        CallWhole(f, ToWorker(ep, f->path, pb, f->request_id),
                  fmt::format("prefill worker {}:{}", ep.host, ep.port),
                  [self, f](int status, std::string body) {
                      if (status != 200) {
                          if (!f->Claim()) return;
                          f->CancelAll();
                          self->Finish(f, false);
                          return f->ex->Reply({status,
                                               "application/json",
                                               std::move(body),
                                               {{"X-Request-Id", f->request_id}}});
                      }
                      Json answer = Json::parse(body, nullptr, false);
                      Json decode = f->body;
                      if (answer.is_object() && answer.contains("kv_transfer_params") &&
                          answer["kv_transfer_params"].is_object() &&
                          !answer["kv_transfer_params"].empty()) {
                          decode["kv_transfer_params"] = answer["kv_transfer_params"];
                      }
                      {
                          std::lock_guard lock(f->mu);
                          if (f->cancelled) return;
                      }
                      self->Decode(f, std::move(decode));
                  });
    }

    void Push(const std::shared_ptr<Flow>& f) {
        std::optional<AgentInfo> info;
        {
            std::lock_guard lock(mu);
            auto it = agents.find(f->prefill);
            if (it != agents.end()) info = it->second;
        }
        auto self = shared_from_this();
        const http::Endpoint& ep = cfg.prefill[f->prefill];
        if (!info) {
            // Once per prefill worker: where its transfer agent is.
            http::ClientRequest r =
                http::GetRequest(ep.host, ep.port, "/v1/kv/agent", std::chrono::seconds(10));
            Authorize(&r);
            return CallWhole(
                f, r, fmt::format("prefill worker {}:{}", ep.host, ep.port),
                [self, f, ep](int status, std::string body) {
                    Json j = Json::parse(body, nullptr, false);
                    if (status != 200 || !j.is_object() || !j.contains("engine_id") ||
                        !j["engine_id"].is_string() || !j.contains("port") ||
                        !j["port"].is_number_integer()) {
                        return self->Fail(
                            f, 502,
                            fmt::format("prefill worker {}:{} has no KV agent (GET /v1/kv/agent "
                                        "answered {}): start it with --role prefill",
                                        ep.host, ep.port, status));
                    }
                    AgentInfo a;
                    a.engine_id = j["engine_id"].get<std::string>();
                    a.host = j.value("host", ep.host);
                    a.port = j["port"].get<int>();
                    a.tp_size = j.value("tp_size", 1);
                    {
                        std::lock_guard lock(self->mu);
                        self->agents[f->prefill] = a;
                    }
                    self->Push(f);
                });
        }
        // Unguessable: a client that could name the next transfer id could park requests under
        // it on the prefill worker.
        const std::string xid = RandomId128();
        Json pb = PrefillBody(f->body);
        pb["kv_transfer_params"] = {{"do_remote_decode", true},
                                    {"do_remote_prefill", false},
                                    {"transfer_mode", "push"},
                                    {"transfer_id", xid}};
        Json db = f->body;
        db["kv_transfer_params"] = {{"do_remote_decode", false},
                                    {"do_remote_prefill", true},
                                    {"transfer_mode", "push"},
                                    {"transfer_id", xid},
                                    {"remote_engine_id", info->engine_id},
                                    {"remote_host", info->host},
                                    {"remote_port", info->port},
                                    {"tp_size", info->tp_size}};
        // Both at once: the decode worker allocates and names its blocks while the prefill
        // worker waits for them.
        Decode(f, std::move(db));
        CallWhole(f, ToWorker(ep, f->path, pb, f->request_id),
                  fmt::format("prefill worker {}:{}", ep.host, ep.port),
                  [self, f](int status, std::string body) {
                      if (status == 200) return;
                      // The decode worker would wait for KV that never comes: stop it.
                      if (!f->Claim()) return;
                      f->CancelAll();
                      self->Finish(f, false);
                      f->ex->Reply({status, "application/json", std::move(body), {}});
                  });
    }

    void Completions(std::shared_ptr<http::Exchange> ex, bool chat) {
        ++requests;
        const std::string& text = ex->request().body;
        if (!JsonDepthWithin(text, kMaxJsonDepth)) {
            return ex->Reply(ErrorReply(400, "the body nests too deep"));
        }
        Json body = Json::parse(text, nullptr, false);
        if (body.is_discarded() || !body.is_object()) {
            return ex->Reply(ErrorReply(400, "the body must be a JSON object"));
        }
        if (body.contains("kv_transfer_params")) {
            return ex->Reply(
                ErrorReply(400, "kv_transfer_params are the proxy's to set, not the client's"));
        }
        auto f = std::make_shared<Flow>();
        f->ex = ex;
        f->path = chat ? "/v1/chat/completions" : "/v1/completions";
        f->stream =
            body.contains("stream") && body["stream"].is_boolean() && body["stream"].get<bool>();
        f->body = std::move(body);
        // One id through every worker: the client's X-Request-Id if it gave a valid one, else
        // 128 random bits; the workers name their requests "cmpl-" + it.
        const std::string* given = ex->request().Find("X-Request-Id");
        f->request_id = given && ValidRequestId(*given) ? *given : RandomId128();
        f->prefill = cfg.policy->PickPrefill(ex->request(), cfg.prefill.size());
        f->decode = cfg.policy->PickDecode(ex->request(), cfg.decode.size());
        FERRY_LOG(kInfo, "proxy: request {}: prefill {}:{}, decode {}:{} ({})", f->request_id,
                  cfg.prefill[f->prefill].host, cfg.prefill[f->prefill].port,
                  cfg.decode[f->decode].host, cfg.decode[f->decode].port,
                  cfg.mode == kv::KvTransferMode::kPush ? "push" : "pull");
        ++inflight;
        auto self = shared_from_this();
        ex->OnClose([self, f] {
            if (!f->Claim()) return;
            ++self->client_gone;
            self->Finish(f, false);
            f->CancelAll();  // the workers see their connections close and abort
        });
        if (cfg.mode == kv::KvTransferMode::kPush) {
            Push(f);
        } else {
            Pull(f);
        }
    }

    std::string Metrics() const {
        std::string out;
        auto counter = [&](const char* name, const char* help, double v) {
            out +=
                fmt::format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, v);
        };
        counter("ferry_proxy_requests_total", "Completion requests received.", double(requests));
        counter("ferry_proxy_requests_succeeded_total", "Requests answered with 200.",
                double(succeeded));
        counter("ferry_proxy_requests_failed_total", "Requests answered with an error.",
                double(failed));
        counter("ferry_proxy_client_gone_total", "Requests whose client left first.",
                double(client_gone));
        out += fmt::format(
            "# HELP ferry_proxy_requests_in_flight Requests being relayed.\n# TYPE "
            "ferry_proxy_requests_in_flight gauge\nferry_proxy_requests_in_flight {}\n",
            inflight.load());
        http::Server* srv = server_ready.load();
        http::ServerStats hs = srv ? srv->Stats() : http::ServerStats{};
        out += fmt::format(
            "# HELP ferry_http_connections_open Open HTTP connections.\n# TYPE "
            "ferry_http_connections_open gauge\nferry_http_connections_open {}\n",
            hs.connections_open);
        return out;
    }

    std::vector<http::Route> Routes() {
        std::vector<http::Route> r;
        r.push_back({"POST", "/v1/completions",
                     [this](std::shared_ptr<http::Exchange> ex) { Completions(ex, false); },
                     cfg.max_body_bytes});
        r.push_back({"POST", "/v1/chat/completions",
                     [this](std::shared_ptr<http::Exchange> ex) { Completions(ex, true); },
                     cfg.max_body_bytes});
        r.push_back({"GET", "/health", [this](std::shared_ptr<http::Exchange> ex) {
                         ex->Reply({200,
                                    "application/json",
                                    Dump({{"status", "ok"},
                                          {"prefill_instances", cfg.prefill.size()},
                                          {"decode_instances", cfg.decode.size()}}),
                                    {}});
                     }});
        r.push_back({"GET", "/metrics", [this](std::shared_ptr<http::Exchange> ex) {
                         ex->Reply({200, "text/plain; version=0.0.4", Metrics(), {}});
                     }});
        // What any worker answers alike (the first decode worker does): the models it serves,
        // and vLLM's /tokenize and /detokenize (every worker has the same tokenizer).
        r.push_back({"GET", "/v1/models", [this](std::shared_ptr<http::Exchange> ex) {
                         ToFirstDecoder(ex, "GET", "/v1/models");
                     }});
        for (const char* path : {"/tokenize", "/detokenize"}) {
            r.push_back({"POST", path,
                         [this, path](std::shared_ptr<http::Exchange> ex) {
                             ToFirstDecoder(ex, "POST", path);
                         },
                         cfg.max_body_bytes});
        }
        return r;
    }

    void ToFirstDecoder(const std::shared_ptr<http::Exchange>& ex, const char* method,
                        const char* target) {
        http::ClientRequest req;
        req.method = method;
        req.host = cfg.decode[0].host;
        req.port = cfg.decode[0].port;
        req.target = target;
        req.body = ex->request().body;
        req.timeout = std::chrono::seconds(10);
        Authorize(&req);
        client->CallWhole(req, [ex](Result<http::ClientReply> r) {
            if (!r.ok()) return ex->Reply(ErrorReply(502, r.status().message()));
            ex->Reply({r->status, "application/json", std::move(r->body), {}});
        });
    }
};

Proxy::Proxy(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Proxy>> Proxy::Start(ProxyConfig config) {
    if (config.prefill.empty() || config.decode.empty()) {
        return InvalidArgumentError("proxy: at least one --prefill and one --decode worker");
    }
    auto impl = std::make_shared<Impl>();
    impl->cfg = std::move(config);
    if (!impl->cfg.policy) impl->cfg.policy = MakeRoundRobin();
    impl->client = http::Client::Create(std::max(1, impl->cfg.io_threads / 2));
    http::ServerConfig hc;
    hc.name = "proxy";
    hc.host = impl->cfg.host;
    hc.port = impl->cfg.port;
    hc.io_threads = impl->cfg.io_threads;
    hc.max_body_bytes = impl->cfg.max_body_bytes;
    hc.request_deadline = impl->cfg.request_deadline;
    hc.error_reply = [](int status, const std::string& message) {
        return ErrorReply(status, message);
    };
    FERRY_ASSIGN_OR_RETURN(impl->server, http::Server::Start(std::move(hc), impl->Routes()));
    impl->server_ready = impl->server.get();
    return std::unique_ptr<Proxy>(new Proxy(std::move(impl)));
}

Proxy::~Proxy() { Stop(); }

int Proxy::port() const { return impl_->server->port(); }

void Proxy::Stop() {
    if (impl_->server) impl_->server->Stop();
    impl_->client.reset();
}

}  // namespace ferry::serve
