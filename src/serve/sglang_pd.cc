#include "serve/sglang_pd.h"

#include <fmt/core.h>

#include "core/host_port.h"
#include "core/log.h"
#include "schema/kv_transfer_params.h"
#include "serve/openai_server_parts.h"

namespace ferry::serve {

using Json = nlohmann::json;
using SteadyClock = std::chrono::steady_clock;

namespace {

// How long a decode worker trusts what a bootstrap server said (a prefill worker restarted
// under the same address has a new agent: its requests fail until this runs out).
constexpr std::chrono::seconds kRemember{5};

// The value of query parameter `key` in `target` ("" if absent).
std::string QueryParam(const std::string& target, std::string_view key) {
    const size_t q = target.find('?');
    if (q == std::string::npos) return "";
    std::string_view rest(target);
    rest.remove_prefix(q + 1);
    while (!rest.empty()) {
        const size_t amp = rest.find('&');
        std::string_view kv = rest.substr(0, amp);
        const size_t eq = kv.find('=');
        if (kv.substr(0, eq) == key) {
            return eq == std::string_view::npos ? "" : std::string(kv.substr(eq + 1));
        }
        if (amp == std::string_view::npos) break;
        rest.remove_prefix(amp + 1);
    }
    return "";
}

}  // namespace

SglangPd::SglangPd(OpenAiServer::Impl& server) : s_(server) {}

SglangPd::~SglangPd() { Stop(); }

void SglangPd::Stop() {
    if (bootstrap_) bootstrap_->Stop();
}

int SglangPd::bootstrap_port() const { return bootstrap_ ? bootstrap_->port() : 0; }

std::vector<http::Route> SglangPd::BootstrapRoutes() {
    std::vector<http::Route> r;
    r.push_back({"GET", "/health", [](std::shared_ptr<http::Exchange> ex) {
                     ex->Reply({200, "text/plain", "OK", {}});
                 }});
    // SGLang's decode workers ask with four ranks: all -1 for the server's layout, else one
    // rank's address. ferry's prefill ranks live in one process behind one agent.
    r.push_back(
        {"GET", "/route", [this](std::shared_ptr<http::Exchange> ex) {
             // Where the agent is: with a secret, the deployment's alone (as GET /v1/kv/agent);
             // ferry's decode workers send the router token.
             std::string who;
             if (auto refused = s_.Authenticate(ex->request(), false, &who)) {
                 return ex->Reply(*refused);
             }
             const std::string& t = ex->request().target;
             const char* keys[] = {"prefill_dp_rank", "prefill_cp_rank", "target_tp_rank",
                                   "target_pp_rank"};
             int v[4];
             for (int i = 0; i < 4; ++i) {
                 const std::string s = QueryParam(t, keys[i]);
                 char* end = nullptr;
                 const long n = s.empty() ? 0 : std::strtol(s.c_str(), &end, 10);
                 if (s.empty() || *end != '\0' || n < -1 || n > 1 << 20) {
                     return ex->Reply(
                         {400, "text/plain", "Missing inputs for bootstrap server.", {}});
                 }
                 v[i] = static_cast<int>(n);
             }
             schema::SglangPrefillInfo info = s_.config.sglang_prefill_info();
             info.http_port = s_.http_ready.load() ? s_.http_ready.load()->port() : 0;
             if (v[0] == -1 && v[1] == -1 && v[2] == -1 && v[3] == -1) {
                 return ex->Reply(
                     {200, "application/json", schema::SglangPrefillInfoJson(info).dump(), {}});
             }
             if (v[0] != 0 || v[1] != 0 || v[3] != 0 || v[2] < 0 || v[2] >= info.tp_size) {
                 return ex->Reply({404,
                                   "text/plain",
                                   fmt::format("Bootstrap info not found for dp_rank={} cp_rank={} "
                                               "tp_rank={} pp_rank={}",
                                               v[0], v[1], v[2], v[3]),
                                   {}});
             }
             ex->Reply(
                 {200, "application/json", schema::SglangRankInfoJson(info, v[2]).dump(), {}});
         }});
    // SGLang's prefill ranks register here; ferry's are the worker itself.
    r.push_back({"PUT", "/route",
                 [](std::shared_ptr<http::Exchange> ex) {
                     ex->Reply({405,
                                "text/plain",
                                "this bootstrap server fronts one ferry prefill worker; its ranks "
                                "do not register",
                                {}});
                 },
                 4096});
    return r;
}

Status SglangPd::Start() {
    if (s_.config.pd_role != "prefill" || s_.config.sglang_bootstrap_port < 0 ||
        !s_.config.sglang_prefill_info) {
        return Status::Ok();
    }
    http::ServerConfig hc;
    hc.name = "bootstrap";
    hc.host = s_.config.host;
    hc.port = s_.config.sglang_bootstrap_port;
    hc.io_threads = 1;
    hc.max_connections = 1024;
    hc.max_body_bytes = 4096;
    hc.request_deadline = s_.config.request_deadline;
    Result<std::unique_ptr<http::Server>> srv = http::Server::Start(hc, BootstrapRoutes());
    if (!srv.ok()) {
        return srv.status().WithContext(
            fmt::format("SGLang bootstrap server (--disaggregation-bootstrap-port {})", hc.port));
    }
    bootstrap_ = std::move(*srv);
    FERRY_LOG(kInfo, "serve: SGLang bootstrap server on {}",
              FormatHostPort(hc.host, bootstrap_->port()));
    return Status::Ok();
}

void SglangPd::Resolve(const std::string& host, int port,
                       std::function<void(Result<schema::SglangPrefillInfo>)> done) {
    if (port == 0) {
        port = s_.config.sglang_bootstrap_port > 0 ? s_.config.sglang_bootstrap_port
                                                   : schema::kSglangDefaultBootstrapPort;
    }
    const std::string key = FormatHostPort(host, port);
    {
        std::lock_guard lock(mu_);
        auto it = known_.find(key);
        if (it != known_.end() && SteadyClock::now() < it->second.until) {
            schema::SglangPrefillInfo info = it->second.info;
            return done(std::move(info));
        }
        auto& waiting = asking_[key];
        waiting.push_back(std::move(done));
        if (waiting.size() > 1) return;  // one lookup per server at a time
    }
    auto finish = [this, key](Result<schema::SglangPrefillInfo> r) {
        std::vector<std::function<void(Result<schema::SglangPrefillInfo>)>> waiters;
        {
            std::lock_guard lock(mu_);
            if (r.ok()) known_[key] = {*r, SteadyClock::now() + kRemember};
            waiters = std::move(asking_[key]);
            asking_.erase(key);
        }
        for (auto& w : waiters) w(r);
    };
    http::Client* client = s_.client.get();
    if (!client) return finish(UnavailableError("the server is stopping"));
    http::ClientRequest req = http::GetRequest(
        host, port,
        "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
        s_.config.agent_timeout);
    if (!s_.config.router_token.empty()) {
        req.headers.push_back({"Authorization", "Bearer " + s_.config.router_token});
    }
    client->CallWhole(
        std::move(req),
        [key, finish](Result<http::ClientReply> got) {
            if (!got.ok()) {
                return finish(UnavailableError(fmt::format(
                    "the bootstrap server at {} did not answer: {}", key, got.status().message())));
            }
            if (got->status != 200) {
                return finish(
                    UnavailableError(fmt::format("the bootstrap server at {} answered {}: {}", key,
                                                 got->status, got->body.substr(0, 200))));
            }
            Json j = Json::parse(got->body, nullptr, false);
            Result<schema::SglangPrefillInfo> info = schema::ParseSglangPrefillInfo(j);
            if (!info.ok()) {
                return finish(UnavailableError(
                    fmt::format("the bootstrap server at {}: {}", key, info.status().message())));
            }
            finish(std::move(info));
        },
        64u << 10);
}

void SglangPd::Apply(const std::shared_ptr<http::Exchange>& ex, ParsedRequest pr,
                     const schema::SglangBootstrap& b, std::function<void(ParsedRequest)> next) {
    const std::string rid = [&] {
        const std::string* x = ex->request().Find("X-Request-Id");
        return x && ValidRequestId(*x) ? *x : std::string();
    }();
    if (!pr.kv_transfer_params.is_null()) {
        return ex->Reply(s_.Error(400,
                                  {"a request takes bootstrap_room (SGLang's PD protocol) or "
                                   "kv_transfer_params, not both",
                                   "bootstrap_room", ""},
                                  rid));
    }
    // The fields are the router's where there is a secret: a stranger is refused before this
    // worker dials the bootstrap server it names (TakeKvParams checks the params again).
    std::string who;
    if (auto refused = s_.Authenticate(ex->request(), false, &who)) return ex->Reply(*refused);
    const std::string xid = schema::SglangTransferId(b.room);
    if (s_.config.pd_role == "prefill") {
        // SGLang's prefill worker answers one token (its request's max_new_tokens becomes 1);
        // the decode worker continues from it.
        pr.kv_transfer_params = schema::PushPrefillRequestParams(xid);
        pr.sampling.max_tokens = 1;
        pr.sglang = true;
        return next(std::move(pr));
    }
    if (s_.config.pd_role != "decode") {
        return ex->Reply(s_.Error(400,
                                  {"bootstrap_room: this worker has no prefill or decode role "
                                   "(SGLang's PD protocol needs --disaggregation-mode)",
                                   "bootstrap_room", ""},
                                  rid));
    }
    auto shared = std::make_shared<ParsedRequest>(std::move(pr));
    std::weak_ptr<http::Exchange> weak = ex;
    Resolve(b.host, b.port,
            [this, weak, shared, xid, rid,
             next = std::move(next)](Result<schema::SglangPrefillInfo> info) {
                std::shared_ptr<http::Exchange> ex = weak.lock();
                if (!ex || ex->closed()) return;
                if (!info.ok()) {
                    return ex->Reply(s_.Error(
                        503, {info.status().message(), "bootstrap_host", "bootstrap_unavailable"},
                        rid));
                }
                shared->kv_transfer_params =
                    schema::PushDecodeRequestParams(xid, info->agent, info->tp_size);
                shared->sglang = true;
                next(std::move(*shared));
            });
}

}  // namespace ferry::serve
