#include "serve/remote_prefill.h"

#include "core/json_fields.h"
#include "serve/openai_server_parts.h"

namespace ferry::serve {

using namespace server_parts;  // NOLINT(build/namespaces): the server's own parts

RemotePrefill::RemotePrefill(OpenAiServer::Impl& server) : m_(server) {
    router::RouterConfig rc;
    rc.agent_directory = server.config.remote_prefill_agents;
    router_ = std::make_shared<router::Router>(std::move(rc));
    for (const http::Endpoint& ep : server.config.remote_prefill) {
        router_->AddWorker(router::Role::kPrefill, ep);
    }
}

bool RemotePrefill::Take(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest& pr) {
    if (pr.kv_transfer || !pr.mm.empty() || !m_.config.kv_agent_info ||
        static_cast<int>(pr.prompt.size()) < m_.config.remote_prefill_min_tokens) {
        return false;
    }
    const std::string base = RequestIdOr(ex->request().Find("X-Request-Id"));
    Result<router::Ticket> t = router_->Route(router::Role::kPrefill, {base, pr.prompt.size()});
    if (!t.ok()) return false;
    if (m_.quarantine->Contains(t->endpoint())) {
        t->End(router::Outcome::kCancelled);  // it timed out lately: prefilled here
        return false;
    }
    auto tried = std::make_shared<std::vector<size_t>>(1, t->worker());
    DecodeFirst(ex, chat, std::move(pr), std::make_shared<router::Ticket>(std::move(*t)), base, 0,
                std::move(tried));
    return true;
}

std::string RemotePrefill::RenderMetrics() const {
    if (router_->Workers(router::Role::kPrefill).empty()) return "";
    std::string out = router_->RenderMetrics();
    out += fmt::format(
        "# HELP ferry_remote_prefill_retried_total Decode-first requests whose remote prefill "
        "failed and went to another prefill worker.\n"
        "# TYPE ferry_remote_prefill_retried_total counter\n"
        "ferry_remote_prefill_retried_total {}\n"
        "# HELP ferry_remote_prefill_fallback_total Decode-first requests prefilled here after "
        "every prefill worker tried failed (--kv-load-failure recompute).\n"
        "# TYPE ferry_remote_prefill_fallback_total counter\n"
        "ferry_remote_prefill_fallback_total {}\n",
        retried_.load(), fallbacks_.load());
    return out;
}

bool RemotePrefill::Failover(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                             const std::string& base, int attempt, const Tried& tried,
                             const Status& st) {
    if (m_.stopping || ex->closed()) return false;
    // The request's own fault (or its client's, or a cap): not a prefill worker's.
    switch (st.code()) {
        case Code::kInvalidArgument:
        case Code::kResourceExhausted:
        case Code::kPermissionDenied:
        case Code::kCancelled:
            return false;
        default:
            break;
    }
    if (attempt + 1 < kMaxAttempts) {
        Result<router::Ticket> t =
            router_->Route(router::Role::kPrefill, {.request_id = base,
                                                    .prompt_tokens = pr.prompt.size(),
                                                    .avoid = std::span<const size_t>(*tried)});
        if (t.ok() && !m_.quarantine->Contains(t->endpoint())) {
            ++retried_;
            FERRY_LOG(kInfo, "serve: request {}: remote prefill failed ({}); trying {}", base,
                      st.ToString(), FormatHostPort(t->endpoint().host, t->endpoint().port));
            tried->push_back(t->worker());
            DecodeFirst(ex, chat, std::move(pr), std::make_shared<router::Ticket>(std::move(*t)),
                        base, attempt + 1, tried);
            return true;
        }
        if (t.ok()) t->End(router::Outcome::kCancelled);
    }
    if (m_.engine->config().kv_load_failure != engine::EngineConfig::KvLoadFailure::kRecompute) {
        return false;
    }
    ++fallbacks_;
    FERRY_LOG(kInfo, "serve: request {}: remote prefill failed ({}); prefilling here", base,
              st.ToString());
    pr.kv_transfer = nullptr;
    m_.Dispatch(ex, chat, std::move(pr), nullptr, base);
    return true;
}

void RemotePrefill::DecodeFirst(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                ParsedRequest pr, std::shared_ptr<router::Ticket> ticket,
                                std::string base, int attempt, Tried tried) {
    auto shared = std::make_shared<ParsedRequest>(std::move(pr));
    router::PlanPush(
        *m_.client, router_, ticket->worker(), m_.config.router_token, m_.config.agent_timeout,
        [this, ex, chat, shared, ticket, base, attempt, tried](Result<router::PushPlan> plan) {
            if (!plan.ok()) {
                ticket->End(router::Outcome::kWorkerFailed);
                if (plan.status().code() == Code::kDeadlineExceeded) TimedOut(*ticket);
                Status st = UnavailableError("remote " + plan.status().message());
                if (Failover(ex, chat, std::move(*shared), base, attempt, tried, st)) return;
                return ex->Reply(m_.Error(503, {st.message(), "", ""}, base));
            }
            Send(ex, chat, std::move(*shared), ticket, base, attempt, *plan, tried);
        });
}

void RemotePrefill::Send(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                         std::shared_ptr<router::Ticket> ticket, const std::string& base,
                         int attempt, const router::PushPlan& plan, Tried tried) {
    const http::Endpoint ep = ticket->endpoint();
    const std::string key = FormatHostPort(ep.host, ep.port);
    // This worker's own params for the local request, in the connector's format (the router's
    // push decode params: written once), parsed as any request's are.
    Result<std::shared_ptr<kv::ConnectorParams>> kvp =
        m_.config.parse_kv_params ? m_.config.parse_kv_params(plan.decode_params)
                                  : Result<std::shared_ptr<kv::ConnectorParams>>(
                                        FailedPreconditionError("this worker has no KV connector"));
    if (!kvp.ok() || !*kvp) {
        ticket->End(router::Outcome::kCancelled);
        return ex->Reply(m_.Error(
            500,
            {fmt::format("decode-first: {}", kvp.ok() ? "no params" : kvp.status().message()), "",
             ""},
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
                 {"kv_transfer_params", plan.prefill_params}};
    if (sp.seed) body["seed"] = static_cast<int64_t>(*sp.seed);
    if (sp.logprobs >= 0) body["logprobs"] = sp.logprobs;
    auto original = std::make_shared<ParsedRequest>(pr);  // for a second attempt
    (*kvp)->requester = kv::kRouterRequester;             // this worker's own request
    pr.kv_transfer = std::move(*kvp);
    auto prefill_call = std::make_shared<std::shared_ptr<http::ClientCall>>();
    auto call_mu = std::make_shared<std::mutex>();
    // The request failed before anything was sent (its KV did not come): the same prefill
    // worker once more if it restarted (its agent is gone), else another one, else here.
    std::function<bool(const Status&)> retry = [this, ex, chat, key, original, prefill_call,
                                                call_mu, ticket, base, attempt,
                                                tried](const Status& st) {
        if (m_.stopping) return false;
        {
            std::lock_guard lock(*call_mu);
            if (*prefill_call) (*prefill_call)->Cancel();
        }
        if (attempt == 0 &&
            router::ReplanAfterUnreachableAgent(*router_, ticket->worker(), 0, st)) {
            FERRY_LOG(kInfo,
                      "serve: request {}: remote prefill via {} failed ({}); asking it again", base,
                      key, st.ToString());
            DecodeFirst(ex, chat, std::move(*original), ticket, base, 1, tried);
            return true;
        }
        // This worker's attempt is over (its call's answer, if it came, ended it already).
        ticket->End(router::Outcome::kWorkerFailed);
        return Failover(ex, chat, std::move(*original), base, attempt, tried, st);
    };
    const std::string id = m_.Dispatch(ex, chat, std::move(pr), std::move(retry), base);
    if (id.empty()) return ticket->End(router::Outcome::kCancelled);
    std::lock_guard lock(*call_mu);
    *prefill_call = m_.client->CallWhole(
        router::WorkerRequest(ep, "/v1/completions", body, id.substr(id.find('-') + 1),
                              m_.config.router_token, m_.config.remote_prefill_timeout),
        [this, id, key, ticket](Result<http::ClientReply> got) {
            // Cancelled: a second attempt took over, and carries the ticket on.
            if (!got.ok() && got.status().code() == Code::kCancelled) return;
            ticket->End(got.ok() ? router::OutcomeOfStatus(got->status)
                                 : router::Outcome::kWorkerFailed);
            if (!got.ok() && got.status().code() == Code::kDeadlineExceeded) TimedOut(*ticket);
            if (got.ok() && got->status == 200) return;
            // The KV will not come: the request ends with the prefill worker's error, and the
            // next request asks it again where its agent is (it may have restarted).
            router_->ForgetAgent(router::Role::kPrefill, ticket->worker());
            m_.engine->Abort(id, UnavailableError(fmt::format(
                                     "remote prefill worker {} failed: {}", key,
                                     got.ok() ? fmt::format("HTTP {}: {}", got->status, got->body)
                                              : got.status().message())));
        },
        4096);
}

void RemotePrefill::TimedOut(const router::Ticket& ticket) {
    // Stopped or wedged: no new prompt goes to it until it answers a probe.
    const size_t worker = ticket.worker();
    router_->ReportTimedOut(router::Role::kPrefill, worker);
    m_.quarantine->Add(ticket.endpoint(), [router = router_, worker] {
        router->ReportAnswered(router::Role::kPrefill, worker, std::nullopt);
    });
}

void RemotePrefill::AddWorkers(const std::shared_ptr<http::Exchange>& ex) {
    std::string who;
    if (auto refused = m_.Authenticate(ex->request(), true, &who)) return ex->Reply(*refused);
    if (!m_.config.kv_agent_info) {
        return ex->Reply(m_.Error(400, {"this worker has no KV connector: start it with --role "
                                        "decode to use remote prefill workers",
                                        "", ""}));
    }
    const std::string& text = ex->request().body;
    Json j = JsonDepthWithin(text, kMaxJsonDepth) ? Json::parse(text, nullptr, false) : Json();
    if (!j.is_object() || !j.contains("endpoints") || !j["endpoints"].is_array() ||
        j["endpoints"].empty() || j["endpoints"].size() > 1024) {
        return ex->Reply(m_.Error(
            400, {"the body must be {\"endpoints\": [\"HOST:PORT\", ...]}", "endpoints", ""}));
    }
    std::vector<http::Endpoint> eps;
    for (const Json& e : j["endpoints"]) {
        if (!e.is_string())
            return ex->Reply(m_.Error(400, {"an endpoint is not a string", "endpoints", ""}));
        auto ep = http::ParseEndpoint(e.get<std::string>());
        if (!ep.ok()) return ex->Reply(m_.Error(400, {ep.status().message(), "endpoints", ""}));
        eps.push_back(*ep);
    }
    for (const http::Endpoint& ep : eps) router_->AddWorker(router::Role::kPrefill, ep);
    Json all = Json::array();
    for (const router::WorkerState& w : router_->Workers(router::Role::kPrefill)) {
        all.push_back(FormatHostPort(w.endpoint.host, w.endpoint.port));
    }
    ex->Reply({200, "application/json", DumpJson({{"status", "ok"}, {"remote_prefill", all}}), {}});
}

}  // namespace ferry::serve
