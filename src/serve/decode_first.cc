// Decode-first (Dynamo style): a decode worker sends long prompts to prefill workers, which push
// the KV back, and dispatches them here; /add_remote_prefill_eps adds prefill workers.
#include "core/json_fields.h"
#include "serve/openai_server_parts.h"

namespace ferry::serve {

using namespace server_parts;  // NOLINT(build/namespaces): the server's own parts

void OpenAiServer::Impl::DecodeFirst(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                     ParsedRequest pr, std::shared_ptr<router::Ticket> ticket,
                                     std::string base, int attempt) {
    auto shared = std::make_shared<ParsedRequest>(std::move(pr));
    router::PlanPush(
        *client, remote_prefill, ticket->worker(), config.router_token, config.agent_timeout,
        [this, ex, chat, shared, ticket, base, attempt](Result<router::PushPlan> plan) {
            if (!plan.ok()) {
                ticket->End(router::Outcome::kWorkerFailed);
                if (plan.status().code() == Code::kDeadlineExceeded) TimedOut(*ticket);
                return ex->Reply(Error(503, {"remote " + plan.status().message(), "", ""}, base));
            }
            SendToRemotePrefill(ex, chat, std::move(*shared), ticket, base, attempt, *plan);
        });
}

void OpenAiServer::Impl::SendToRemotePrefill(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                             ParsedRequest pr,
                                             std::shared_ptr<router::Ticket> ticket,
                                             const std::string& base, int attempt,
                                             const router::PushPlan& plan) {
    const http::Endpoint ep = ticket->endpoint();
    const std::string key = FormatHostPort(ep.host, ep.port);
    // This worker's own params for the local request, in the connector's format (the router's
    // push decode params: written once), parsed as any request's are.
    Result<std::shared_ptr<kv::ConnectorParams>> kvp =
        config.parse_kv_params ? config.parse_kv_params(plan.decode_params)
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
                 {"kv_transfer_params", plan.prefill_params}};
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
    std::lock_guard lock(*call_mu);
    *prefill_call = client->CallWhole(
        router::WorkerRequest(ep, "/v1/completions", body, id.substr(id.find('-') + 1),
                              config.router_token, config.remote_prefill_timeout),
        [this, id, key, ticket](Result<http::ClientReply> got) {
            // Cancelled: a second attempt took over, and carries the ticket on.
            if (!got.ok() && got.status().code() == Code::kCancelled) return;
            ticket->End(got.ok() ? router::OutcomeOfStatus(got->status)
                                 : router::Outcome::kWorkerFailed);
            if (!got.ok() && got.status().code() == Code::kDeadlineExceeded) TimedOut(*ticket);
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

void OpenAiServer::Impl::TimedOut(const router::Ticket& ticket) {
    // Stopped or wedged: no new prompt goes to it until it answers a probe.
    const size_t worker = ticket.worker();
    remote_prefill->ReportTimedOut(router::Role::kPrefill, worker);
    quarantine->Add(ticket.endpoint(), [router = remote_prefill, worker] {
        router->ReportAnswered(router::Role::kPrefill, worker, std::nullopt);
    });
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
        all.push_back(FormatHostPort(w.endpoint.host, w.endpoint.port));
    }
    ex->Reply({200, "application/json", DumpJson({{"status", "ok"}, {"remote_prefill", all}}), {}});
}

}  // namespace ferry::serve
