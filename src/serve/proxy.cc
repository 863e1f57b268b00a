#include "serve/proxy.h"

#include <fmt/core.h>

#include <atomic>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/json_fields.h"
#include "core/prometheus.h"
#include "discovery/worker_directory.h"
#include "router/driver.h"
#include "router/membership.h"

namespace ferry::serve {

namespace {

using Json = nlohmann::json;

}  // namespace

struct Proxy::Impl {
    ProxyConfig cfg;
    std::shared_ptr<WorkerDirectory> directory;  // null without a store
    std::shared_ptr<router::Router> router;
    std::unique_ptr<router::Membership> membership;
    std::unique_ptr<http::Client> client;
    std::shared_ptr<router::Driver> driver;
    std::unique_ptr<http::Server> server;
    std::atomic<http::Server*> server_ready{nullptr};  // for handlers that run before Start ends

    std::string Metrics() const {
        PrometheusWriter w;
        const router::DriverStats s = driver->Stats();
        w.Counter("ferry_proxy_requests_total", "Completion requests received.",
                  double(s.requests));
        w.Counter("ferry_proxy_requests_succeeded_total", "Requests answered with 200.",
                  double(s.succeeded));
        w.Counter("ferry_proxy_requests_failed_total", "Requests answered with an error.",
                  double(s.failed));
        w.Counter("ferry_proxy_client_gone_total", "Requests whose client left first.",
                  double(s.client_gone));
        w.Gauge("ferry_proxy_requests_in_flight", "Requests being relayed.", double(s.in_flight));
        w.Counter("ferry_proxy_prefill_skipped_total",
                  "Requests sent to the decode worker alone: it held all but a few prompt tokens.",
                  double(s.prefill_skipped));
        w.Counter("ferry_proxy_encoded_total", "Requests whose images an encode worker took (EPD).",
                  double(s.encoded));
        w.Counter("ferry_proxy_encode_failed_total",
                  "Requests whose encode worker failed: the workers encoded the images.",
                  double(s.encode_failed));
        w.Gauge("ferry_proxy_encoders_quarantined",
                "Encode workers left out after a call timed out, until they answer a probe.",
                double(s.encoders_quarantined));
        w.Counter("ferry_proxy_worker_timeouts_total",
                  "Calls to workers that ran past their deadline (--prefill-timeout-ms, "
                  "--encode-timeout-ms, --worker-timeout-ms).",
                  double(s.timeouts));
        w.Counter("ferry_proxy_prefill_retried_total",
                  "Prefills sent to another prefill worker after one failed (--max-attempts).",
                  double(s.prefill_retried));
        w.Counter("ferry_proxy_prefill_fallback_total",
                  "Requests prefilled by their decode worker: no prefill worker was left to try.",
                  double(s.prefill_fallback));
        w.Counter("ferry_proxy_decode_retried_total",
                  "Requests sent to another decode worker after one was lost before a byte.",
                  double(s.decode_retried));
        w.Counter("ferry_proxy_streams_migrated_total",
                  "Streams migrated to another decode worker after theirs was lost mid-stream.",
                  double(s.migrated));
        w.Counter("ferry_proxy_encode_retried_total",
                  "Encode steps sent to another encode worker after one failed.",
                  double(s.encode_retried));
        w.Append(router->RenderMetrics());
        w.Append(membership->RenderMetrics());
        http::Server* srv = server_ready.load();
        http::ServerStats hs = srv ? srv->Stats() : http::ServerStats{};
        w.Gauge("ferry_http_connections_open", "Open HTTP connections.",
                double(hs.connections_open));
        return w.Take();
    }

    std::vector<http::Route> Routes() {
        std::vector<http::Route> r;
        for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
            r.push_back(
                {"POST", path,
                 [this, path](std::shared_ptr<http::Exchange> ex) { driver->Handle(ex, path); },
                 cfg.max_body_bytes});
        }
        r.push_back(
            {"GET", "/health", [this](std::shared_ptr<http::Exchange> ex) {
                 ex->Reply(
                     {200,
                      "application/json",
                      DumpJson({{"status", "ok"},
                                {"prefill_instances", router->members(router::Role::kPrefill)},
                                {"decode_instances", router->members(router::Role::kDecode)},
                                {"policy", router->policy_name(router::Role::kPrefill)},
                                {"decode_policy", router->policy_name(router::Role::kDecode)}}),
                      {}});
             }});
        r.push_back({"GET", "/metrics", [this](std::shared_ptr<http::Exchange> ex) {
                         ex->Reply({200, "text/plain; version=0.0.4", Metrics(), {}});
                     }});
        // What any worker answers alike (a decode worker does): the models it serves,
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

    // The first decode worker that is a member and answers (else the first member).
    std::optional<http::Endpoint> ADecoder() const {
        std::optional<http::Endpoint> any;
        for (const router::WorkerState& w : router->Workers(router::Role::kDecode)) {
            if (!w.member) continue;
            if (w.answering) return w.endpoint;
            if (!any) any = w.endpoint;
        }
        return any;
    }

    void ToFirstDecoder(const std::shared_ptr<http::Exchange>& ex, const char* method,
                        const char* target) {
        std::optional<http::Endpoint> decoder = ADecoder();
        if (!decoder) return ex->Reply(router::ErrorReply(503, "router: no decode worker"));
        http::ClientRequest req;
        req.method = method;
        req.host = decoder->host;
        req.port = decoder->port;
        req.target = target;
        req.body = ex->request().body;
        req.timeout = std::chrono::seconds(10);
        router::Authorize(&req, cfg.driver.router_token);
        client->CallWhole(req, [ex](Result<http::ClientReply> r) {
            if (!r.ok()) return ex->Reply(router::ErrorReply(502, r.status().message()));
            ex->Reply({r->status, "application/json", std::move(r->body), {}});
        });
    }
};

Proxy::Proxy(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Proxy>> Proxy::Start(ProxyConfig config) {
    if ((config.prefill.empty() || config.decode.empty()) && config.store_url.empty() &&
        !(config.prefill.empty() && !config.decode.empty() && !config.driver.encode.empty())) {
        return InvalidArgumentError(
            "proxy: at least one --prefill and one --decode worker (or --encode and --decode: "
            "E+PD, the decode workers serving whole requests), or a store they register in");
    }
    auto impl = std::make_shared<Impl>();
    impl->cfg = std::move(config);
    router::RouterConfig rc = std::move(impl->cfg.routing);
    if (!impl->cfg.store_url.empty()) {
        StoreOptions so;
        so.secret = impl->cfg.store_secret;
        FERRY_ASSIGN_OR_RETURN(std::unique_ptr<WorkerDirectory> d,
                               WorkerDirectory::Start(impl->cfg.store_url, so));
        impl->directory = std::move(d);
        rc.agent_directory = router::AgentsFromDirectory(impl->directory);
    }
    // The workers' prefix caches, from the KV events of those that publish them (their records
    // say where): what a cache-aware policy scores.
    auto kv_index = std::make_shared<router::KvIndex>();
    if (impl->directory) rc.kv_index = kv_index;
    impl->router = std::make_shared<router::Router>(std::move(rc));
    for (const http::Endpoint& ep : impl->cfg.prefill) {
        impl->router->AddWorker(router::Role::kPrefill, ep);
    }
    for (const http::Endpoint& ep : impl->cfg.decode) {
        impl->router->AddWorker(router::Role::kDecode, ep);
    }
    router::MembershipConfig mc = impl->cfg.membership;
    mc.directory = impl->directory;
    if (impl->directory) mc.kv_index = kv_index;
    auto store_encoders = std::make_shared<router::EncoderSet>();
    if (impl->directory) mc.encoders = store_encoders;
    impl->membership = router::Membership::Start(std::move(mc), impl->router);
    impl->client = http::Client::Create(std::max(1, impl->cfg.io_threads / 2));
    router::DriverConfig dc = impl->cfg.driver;
    if (impl->directory) dc.store_encoders = store_encoders;
    impl->driver = router::Driver::Create(std::move(dc), impl->router, impl->client.get());
    http::ServerConfig hc;
    hc.name = "proxy";
    hc.host = impl->cfg.host;
    hc.port = impl->cfg.port;
    hc.io_threads = impl->cfg.io_threads;
    hc.max_body_bytes = impl->cfg.max_body_bytes;
    hc.request_deadline = impl->cfg.request_deadline;
    hc.error_reply = [](int status, const std::string& message) {
        return router::ErrorReply(status, message);
    };
    FERRY_ASSIGN_OR_RETURN(impl->server, http::Server::Start(std::move(hc), impl->Routes()));
    impl->server_ready = impl->server.get();
    return std::unique_ptr<Proxy>(new Proxy(std::move(impl)));
}

Proxy::~Proxy() { Stop(); }

int Proxy::port() const { return impl_->server->port(); }

void Proxy::Stop() {
    if (impl_->server) impl_->server->Stop();
    if (impl_->membership) impl_->membership->Stop();
    impl_->client.reset();
}

}  // namespace ferry::serve
