#include "serve/openai_server.h"

#include "core/host_port.h"
#include "core/json_fields.h"
#include "serve/image_pipeline.h"
#include "serve/openai_server_parts.h"
#include "serve/remote_prefill.h"
#include "serve/sglang_pd.h"

namespace ferry::serve {

using namespace server_parts;  // NOLINT(build/namespaces): the server's own parts

http::Reply OpenAiServer::Impl::Error(int status, const BadRequest& e,
                                      const std::string& request_id) {
    if (status == 400) {
        std::lock_guard lock(metrics.mu);
        ++metrics.bad_requests;
    }
    return router::ErrorReply(status, {e.message, e.param, e.code}, request_id);
}

std::vector<http::Route> OpenAiServer::Impl::Routes() {
    std::vector<http::Route> r;
    r.push_back(
        {"GET", "/health", [this](std::shared_ptr<http::Exchange> ex) {
             if (draining.load()) {
                 return ex->Reply({503, "application/json", "{\"status\":\"draining\"}", {}});
             }
             ex->Reply({200, "application/json", "{\"status\":\"ok\"}", {}});
         }});
    r.push_back({"GET", "/v1/models", [this](std::shared_ptr<http::Exchange> ex) {
                     Json m = {{"id", model_name},   {"object", "model"},
                               {"created", created}, {"owned_by", "ferry"},
                               {"root", model_name}, {"max_model_len", engine->max_model_len()}};
                     ex->Reply({200,
                                "application/json",
                                DumpJson({{"object", "list"}, {"data", Json::array({m})}}),
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
                     const tokenizer::Tokenizer& tk = engine->model().tokenizer();
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
                                DumpJson({{"count", tr.tokens.size()},
                                          {"max_model_len", engine->max_model_len()},
                                          {"tokens", tr.tokens},
                                          {"token_strs", strs}}),
                                {}});
                 },
                 config.max_body_bytes});
    r.push_back(
        {"POST", "/detokenize",
         [this](std::shared_ptr<http::Exchange> ex) {
             const tokenizer::Tokenizer& tk = engine->model().tokenizer();
             std::vector<int32_t> tokens;
             BadRequest bad;
             if (!ParseDetokenizeRequest(ex->request().body, tk, model_name, &tokens, &bad)) {
                 return ex->Reply(Error(400, bad));
             }
             ex->Reply({200,
                        "application/json",
                        DumpJson({{"prompt", tk.Decode(tokens, /*specials=*/true)}}),
                        {}});
         },
         config.max_body_bytes});
    r.push_back({"POST", "/add_remote_prefill_eps",
                 [this](std::shared_ptr<http::Exchange> ex) { remote_prefill->AddWorkers(ex); },
                 1u << 20});
    r.push_back({"POST", "/v1/completions",
                 [this](std::shared_ptr<http::Exchange> ex) { Completions(ex, false); },
                 config.max_body_bytes});
    r.push_back({"POST", "/v1/chat/completions",
                 [this](std::shared_ptr<http::Exchange> ex) { Completions(ex, true); },
                 config.max_body_bytes});
    r.push_back({"POST", "/generate", [this](std::shared_ptr<http::Exchange> ex) { Generate(ex); },
                 config.max_body_bytes});
    AddSglangRoutes(&r);
    return r;
}

std::optional<http::Reply> OpenAiServer::Impl::Authenticate(const http::Request& req, bool internal,
                                                            std::string* requester) {
    const std::string* auth = req.Find("Authorization");
    if (config.router_token.empty()) {
        // Without a secret an internal route is this machine's alone (seed 004 curls
        // /add_remote_prefill_eps from the worker's own host): a peer on loopback.
        if (internal && !IsLoopbackHost(HostOf(req.remote))) {
            return Error(403, {"this route changes where the worker sends prompts: without a "
                               "secret it is served only to this host (loopback); with one, to "
                               "the deployment's router (start the worker with --secret-file)",
                               "", "admin_route_disabled"});
        }
        *requester = HostOf(req.remote);
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
    const tokenizer::Tokenizer& tk = engine->model().tokenizer();
    ParsedRequest pr;
    BadRequest bad;
    if (!ParseOpenAiRequest(ex->request().body, chat, tk, model_name, engine->max_model_len(), &pr,
                            &bad, images ? images->tokens() : nullptr)) {
        const std::string* x = ex->request().Find("X-Request-Id");
        return ex->Reply(Error(400, bad, x && ValidRequestId(*x) ? *x : ""));
    }
    if (!pr.sglang_fields.is_null()) {
        Result<std::optional<std::vector<schema::SglangBootstrap>>> b =
            schema::ParseSglangBootstrap(pr.sglang_fields, 0);
        if (!b.ok()) {
            const std::string* x = ex->request().Find("X-Request-Id");
            return ex->Reply(Error(400, {b.status().message(), "bootstrap_room", ""},
                                   x && ValidRequestId(*x) ? *x : ""));
        }
        if (*b) {
            const schema::SglangBootstrap first = (**b)[0];
            return sglang->Apply(ex, std::move(pr), first, [this, ex, chat](ParsedRequest p) {
                Continue(ex, chat, std::move(p));
            });
        }
    }
    Continue(ex, chat, std::move(pr));
}

std::optional<http::Reply> OpenAiServer::Impl::TakeKvParams(const http::Exchange& ex,
                                                            ParsedRequest* pr_ptr) {
    ParsedRequest& pr = *pr_ptr;
    if (!pr.kv_transfer_params.is_null()) {
        // The connector's own format: a malformed field is named before anything else.
        const std::string* x = ex.request().Find("X-Request-Id");
        const std::string rid = x && ValidRequestId(*x) ? *x : "";
        if (!config.parse_kv_params) {
            return Error(400,
                         {"kv_transfer_params: this worker has no KV connector (start it with a "
                          "prefill or decode role)",
                          "kv_transfer_params", ""},
                         rid);
        }
        Result<std::shared_ptr<kv::ConnectorParams>> kv =
            config.parse_kv_params(pr.kv_transfer_params);
        if (!kv.ok()) return Error(400, {kv.status().message(), "kv_transfer_params", ""}, rid);
        pr.kv_transfer = std::move(*kv);
    }
    if (pr.kv_transfer) {
        // Internal fields: honoured only from the router (with a secret), and counted against
        // whoever sent them.
        if (auto refused = Authenticate(ex.request(), false, &pr.kv_transfer->requester)) {
            return refused;
        }
    }
    return std::nullopt;
}

void OpenAiServer::Impl::Continue(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                  ParsedRequest pr) {
    if (auto refused = TakeKvParams(*ex, &pr)) return ex->Reply(*refused);
    if (!pr.continued.empty()) {
        // Internal, as kv_transfer_params: a migrated stream, from the router alone where
        // there is a secret (a client would have its prompt counted as output).
        std::string who;
        if (auto refused = Authenticate(ex->request(), false, &who)) return ex->Reply(*refused);
    }
    if (config.encode_only && (!chat || pr.images.empty())) {
        const std::string* x = ex->request().Find("X-Request-Id");
        return ex->Reply(Error(400,
                               {"this worker has the encode role: it takes chat requests with "
                                "images (text goes to prefill, decode or colocated workers)",
                                chat ? "messages" : "", "no_images"},
                               x && ValidRequestId(*x) ? *x : ""));
    }
    if (config.encode_only && !config.router_token.empty()) {
        // With a secret the encode role serves the router (and --encoder-urls workers) alone:
        // a request here leases a slot of its transfer buffer.
        std::string who;
        if (auto refused = Authenticate(ex->request(), false, &who)) return ex->Reply(*refused);
    }
    if (!pr.ec_transfer_params.is_null() && config.ec_connector && !config.encode_only &&
        !pr.images.empty()) {
        // Internal, as kv_transfer_params: from the router alone where there is a secret.
        const std::string* x = ex->request().Find("X-Request-Id");
        const std::string rid = x && ValidRequestId(*x) ? *x : "";
        Result<EcSource> src = schema::ParseEcTransferParams(pr.ec_transfer_params);
        if (!src.ok()) {
            return ex->Reply(Error(400, {src.status().message(), "ec_transfer_params", ""}, rid));
        }
        std::string who;
        if (auto refused = Authenticate(ex->request(), false, &who)) {
            return ex->Reply(*refused);
        }
        pr.ec_source = std::make_shared<const EcSource>(std::move(*src));
    }
    if (pr.kv_transfer && pr.kv_transfer->prefill_only() && pr.stream && !pr.sglang) {
        // vLLM's proxies ask the prefill worker for a whole answer (it carries the params).
        pr.stream = false;
    }
    if (!pr.images.empty()) return images->Serve(ex, chat, std::move(pr));
    Route(ex, chat, std::move(pr));
}

void OpenAiServer::Impl::Route(const std::shared_ptr<http::Exchange>& ex, bool chat,
                               ParsedRequest pr) {
    // A migrated stream computes its prompt and output so far here (nothing to prefill
    // elsewhere: it needs the KV of its output too).
    if (pr.continued.empty() && remote_prefill->Take(ex, chat, pr)) return;
    Dispatch(ex, chat, std::move(pr));
}

OpenAiServer::Impl::Impl() = default;
OpenAiServer::Impl::~Impl() = default;

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
    hc.max_inflight_body_bytes = config.max_inflight_body_bytes;
    hc.request_deadline = config.request_deadline;
    Impl* p = impl.get();
    hc.error_reply = [p](int status, const std::string& message) {
        return p->Error(status, {message, "", ""});
    };
    impl->remote_prefill = std::make_unique<RemotePrefill>(*impl);
    if (!config.vision && !config.encoder_cache_dir.empty()) {
        return InvalidArgumentError("serve: an encoder cache directory needs a vision encoder");
    }
    impl->client = http::Client::Create(1);
    impl->quarantine = std::make_unique<router::Quarantine>(impl->client.get());
    if (config.vision) {
        FERRY_ASSIGN_OR_RETURN(impl->images, ImagePipeline::Create(*impl));
    }
    impl->sglang = std::make_unique<SglangPd>(*impl);
    FERRY_ASSIGN_OR_RETURN(impl->http, http::Server::Start(std::move(hc), impl->Routes()));
    impl->http_ready = impl->http.get();
    FERRY_RETURN_IF_ERROR(impl->sglang->Start());
    return std::unique_ptr<OpenAiServer>(new OpenAiServer(std::move(impl)));
}

OpenAiServer::~OpenAiServer() { Stop(); }

int OpenAiServer::port() const { return impl_->http->port(); }

const std::string& OpenAiServer::model_name() const { return impl_->model_name; }

void OpenAiServer::Stop() {
    if (impl_->stopping.exchange(true)) return;
    // Requests still waiting for the encoder get 503 (their jobs see `stopping`).
    if (impl_->images) impl_->images->StopQueue();
    impl_->http->Stop();
    impl_->sglang->Stop();
    // The client first: its calls end (their callbacks may still reach the quarantine and the
    // encode step); the quarantine's probes hold only a weak reference to it.
    impl_->client.reset();
    impl_->images.reset();
    impl_->quarantine.reset();
    std::lock_guard lock(impl_->stop_mu);
    impl_->stopped = true;
    impl_->stop_cv.notify_all();
}

void OpenAiServer::SetDraining() { impl_->draining = true; }

void OpenAiServer::Wait() {
    std::unique_lock lock(impl_->stop_mu);
    impl_->stop_cv.wait(lock, [&] { return impl_->stopped; });
}

}  // namespace ferry::serve
