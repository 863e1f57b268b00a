#include "router/worker_call.h"

#include <fmt/core.h>

#include "core/crypto.h"
#include "core/host_port.h"
#include "core/json_fields.h"
#include "router/protocol.h"
#include "schema/kv_transfer_params.h"

namespace ferry::router {

http::ClientRequest WorkerRequest(const http::Endpoint& ep, const std::string& path,
                                  const nlohmann::json& body, const std::string& request_id,
                                  const std::string& router_token,
                                  std::chrono::milliseconds timeout) {
    http::ClientRequest r;
    r.method = "POST";
    r.host = ep.host;
    r.port = ep.port;
    r.target = path;
    r.body = DumpJson(body);
    r.timeout = timeout;
    r.headers.push_back({"X-Request-Id", request_id});
    Authorize(&r, router_token);
    return r;
}

CallFailure FailureOf(std::string_view role, const http::Endpoint& ep, const Status& st) {
    CallFailure f;
    f.timed_out = st.code() == Code::kDeadlineExceeded;
    f.status = f.timed_out ? 504 : 502;
    f.message =
        fmt::format("{} worker {}: {}", role, FormatHostPort(ep.host, ep.port), st.message());
    return f;
}

std::shared_ptr<http::ClientCall> PlanPush(http::Client& client, std::shared_ptr<Router> router,
                                           size_t worker, const std::string& router_token,
                                           std::chrono::milliseconds timeout,
                                           std::function<void(Result<PushPlan>)> done) {
    return FindAgent(client, std::move(router), Role::kPrefill, worker, router_token, timeout,
                     [done = std::move(done)](Result<AgentInfo> agent) {
                         if (!agent.ok()) return done(agent.status());
                         PushPlan plan;
                         plan.agent = std::move(*agent);
                         plan.transfer_id = RandomId128();
                         plan.prefill_params = schema::PushPrefillRequestParams(plan.transfer_id);
                         plan.decode_params = schema::PushDecodeRequestParams(
                             plan.transfer_id, plan.agent, plan.agent.tp_size);
                         done(std::move(plan));
                     });
}

EncodeStep::EncodeStep(EncodeStepConfig config, http::Client* client, Quarantine* quarantine)
    : config_(std::move(config)), client_(client), quarantine_(quarantine) {}

std::vector<http::Endpoint> EncodeStep::Answering(const std::vector<http::Endpoint>& encoders) {
    return quarantine_->Filter(encoders);
}

std::shared_ptr<http::ClientCall> EncodeStep::Call(const nlohmann::json& body,
                                                   const std::vector<http::Endpoint>& answering,
                                                   const std::string& request_id,
                                                   std::function<void(Encoded)> done) {
    const http::Endpoint ep = answering[PickEncoder(ImageUrls(body), answering)];
    nlohmann::json eb = PrefillBody(body);
    // The encode worker's own params are its answer; a request never carries any to it.
    eb.erase("kv_transfer_params");
    eb.erase("ec_transfer_params");
    return client_->CallWhole(
        WorkerRequest(ep, "/v1/chat/completions", eb, request_id, config_.router_token,
                      config_.timeout),
        [this, ep, done = std::move(done)](Result<http::ClientReply> r) {
            Encoded e;
            e.worker = ep;
            if (!r.ok()) {
                if (r.status().code() == Code::kCancelled) {
                    e.kind = Encoded::Kind::kCancelled;
                    return done(std::move(e));
                }
                // Stopped, wedged, gone or cut off: the next requests skip it until it answers
                // a probe.
                if (r.status().code() == Code::kDeadlineExceeded) ++timeouts_;
                quarantine_->Add(ep);
                e.why = FailureOf("encode", ep, r.status()).message;
                return done(std::move(e));
            }
            if (r->status == 400) {
                // The images themselves are bad: every worker would say so.
                e.kind = Encoded::Kind::kRefused;
                e.refused = std::move(*r);
                return done(std::move(e));
            }
            nlohmann::json answer = r->status == 200
                                        ? nlohmann::json::parse(r->body, nullptr, false)
                                        : nlohmann::json();
            if (!answer.is_object()) {
                e.why = fmt::format("encode worker {}: answered {}",
                                    FormatHostPort(ep.host, ep.port), r->status);
                return done(std::move(e));
            }
            e.kind = Encoded::Kind::kEncoded;
            // The disk connector's answer names nothing: the consumers look in the shared
            // directory.
            if (answer.contains("ec_transfer_params") && answer["ec_transfer_params"].is_object()) {
                e.ec_transfer_params = std::move(answer["ec_transfer_params"]);
            }
            done(std::move(e));
        },
        kMaxEncodeAnswerBytes);
}

bool ReplanAfterUnreachableAgent(Router& router, size_t prefill_worker, int attempt,
                                 const Status& load_failure) {
    if (attempt != 0 || load_failure.code() != Code::kUnavailable) return false;
    router.ForgetAgent(Role::kPrefill, prefill_worker);
    return true;
}

}  // namespace ferry::router
