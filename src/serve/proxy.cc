#include "serve/proxy.h"

#include <fmt/core.h>

#include <atomic>
#include <nlohmann/json.hpp>

#include "core/prometheus.h"
#include "discovery/worker_directory.h"
#include "router/driver.h"

namespace ferry::serve {

namespace {

using Json = nlohmann::json;

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

}  // namespace

struct Proxy::Impl {
    ProxyConfig cfg;
    std::shared_ptr<WorkerDirectory> directory;  // null without a store
    std::shared_ptr<router::Router> router;
    std::unique_ptr<http::Client> client;
    std::shared_ptr<router::Driver> driver;
    http::Endpoint first_decoder;
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
        w.Append(router->RenderMetrics());
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
        r.push_back({"GET", "/health", [this](std::shared_ptr<http::Exchange> ex) {
                         ex->Reply({200,
                                    "application/json",
                                    Dump({{"status", "ok"},
                                          {"prefill_instances", cfg.prefill.size()},
                                          {"decode_instances", cfg.decode.size()},
                                          {"policy", router->policy_name()}}),
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
        req.host = first_decoder.host;
        req.port = first_decoder.port;
        req.target = target;
        req.body = ex->request().body;
        req.timeout = std::chrono::seconds(10);
        router::Authorize(&req, cfg.router_token);
        client->CallWhole(req, [ex](Result<http::ClientReply> r) {
            if (!r.ok()) return ex->Reply(router::ErrorReply(502, r.status().message()));
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
    router::RouterConfig rc;
    rc.policy = std::move(impl->cfg.policy);
    if (!impl->cfg.store_url.empty()) {
        StoreOptions so;
        so.secret = impl->cfg.store_secret;
        FERRY_ASSIGN_OR_RETURN(std::unique_ptr<WorkerDirectory> d,
                               WorkerDirectory::Start(impl->cfg.store_url, so));
        impl->directory = std::move(d);
        rc.agent_directory = router::AgentsFromDirectory(impl->directory);
    }
    impl->router = std::make_shared<router::Router>(std::move(rc));
    for (const http::Endpoint& ep : impl->cfg.prefill) {
        impl->router->AddWorker(router::Role::kPrefill, ep);
    }
    for (const http::Endpoint& ep : impl->cfg.decode) {
        impl->router->AddWorker(router::Role::kDecode, ep);
    }
    impl->first_decoder = impl->cfg.decode.front();
    impl->client = http::Client::Create(std::max(1, impl->cfg.io_threads / 2));
    router::DriverConfig dc;
    dc.protocol = impl->cfg.protocol;
    dc.worker_timeout = impl->cfg.worker_timeout;
    dc.router_token = impl->cfg.router_token;
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
    impl_->client.reset();
}

}  // namespace ferry::serve
