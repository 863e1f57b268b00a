#include "router/driver.h"

#include <fmt/core.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "core/crypto.h"
#include "core/host_port.h"
#include "core/json_depth.h"
#include "core/json_fields.h"
#include "core/log.h"
#include "core/request_id.h"
#include "schema/kv_transfer_params.h"
#include "tokenizer/prompt.h"

namespace ferry::router {

namespace {

using Json = nlohmann::json;

}  // namespace

// One client request on its way through the workers.
struct Driver::Flow {
    std::mutex mu;
    std::shared_ptr<http::Exchange> ex;
    std::vector<std::shared_ptr<http::ClientCall>> calls;
    bool cancelled = false;
    bool answered = false;
    bool stream = false;
    std::string path;
    Json body;
    std::string request_id;
    size_t prompt_tokens = 0;
    // The workers it was routed to, counted on them until their tickets end.
    Ticket prefill, decode;
    size_t prefill_worker = 0;
    bool prefill_routed = false;  // false: skipped, the decode worker prefills itself
    http::Endpoint prefill_ep, decode_ep;
    int attempt = 0;  // push: 1 once retried after refreshing the prefill worker's agent
    // What routing needs again on a retry.
    std::vector<BlockHash> block_hashes;
    // Failures and retries: the workers that failed this request (not tried for it again), the
    // tries made per stage, and the calls' generation (a callback of an earlier one is stale).
    std::vector<size_t> failed_prefill, failed_decode;
    int prefill_tries = 1, decode_tries = 1;
    int gen = 0;
    bool fallback = false;  // no prefill worker left: the decode worker prefills
    Json decode_body;       // what the decode worker was last sent (a retry sends it again)
    // Streamed with migration: the decode worker's events relayed whole, one by one, and the
    // ids of the tokens they carried (vLLM's return_token_ids, asked for by the driver and
    // taken out again unless the client asked too).
    bool track_ids = false;
    bool client_wants_ids = false;
    std::vector<int32_t> generated;
    std::string sse;  // an incomplete event
    // Relay state.
    int status = 0;
    std::string content_type = "application/json";
    std::string collected;
    bool started = false;

    bool Current(int g) {
        std::lock_guard lock(mu);
        return g == gen && !cancelled;
    }
    RouteRequest Retry(Role role) const {
        RouteRequest rr{request_id, prompt_tokens, block_hashes};
        rr.avoid = role == Role::kPrefill ? failed_prefill : failed_decode;
        return rr;
    }

    void Add(std::shared_ptr<http::ClientCall> c) {
        if (!c) return;
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
    // A second attempt: the first one's calls end (their callbacks see Cancelled), the flow
    // goes on.
    void CancelAttempt() {
        std::vector<std::shared_ptr<http::ClientCall>> cs;
        {
            std::lock_guard lock(mu);
            cs.swap(calls);
            status = 0;
            collected.clear();
            sse.clear();
            content_type = "application/json";
        }
        for (auto& c : cs) c->Cancel();
    }
    // Relays one whole event of the decode worker's stream (mu held): the ids of its tokens
    // recorded, and taken out unless the client asked for them.
    void RelayEvent(std::string_view event) {
        constexpr std::string_view kData = "data: ";
        if (event.substr(0, kData.size()) != kData || event.substr(kData.size()) == "[DONE]") {
            ex->Write(std::string(event) + "\n\n");
            return;
        }
        Json j = Json::parse(event.substr(kData.size()), nullptr, false);
        if (!j.is_object() || !j.contains("choices") || !j["choices"].is_array()) {
            ex->Write(std::string(event) + "\n\n");
            return;
        }
        for (Json& c : j["choices"]) {
            if (!c.is_object()) continue;
            auto ids = c.find("token_ids");
            if (ids != c.end() && ids->is_array()) {
                for (const Json& t : *ids) {
                    if (t.is_number_integer()) generated.push_back(t.get<int32_t>());
                }
            }
            if (!client_wants_ids) {
                c.erase("token_ids");
                c.erase("prompt_token_ids");
            }
        }
        if (!client_wants_ids) j.erase("prompt_token_ids");
        ex->Write(std::string(kData) + DumpJson(j) + "\n\n");
    }
    // The first answer wins; later ones are dropped.
    bool Claim() {
        std::lock_guard lock(mu);
        if (answered) return false;
        answered = true;
        return true;
    }
    // Ends one worker's ticket (a no-op once ended).
    void End(Ticket Flow::*which, Outcome outcome) {
        std::lock_guard lock(mu);
        (this->*which).End(outcome);
    }
};

std::shared_ptr<Driver> Driver::Create(DriverConfig config, std::shared_ptr<Router> router,
                                       http::Client* client) {
    return std::shared_ptr<Driver>(new Driver(std::move(config), std::move(router), client));
}

Driver::Driver(DriverConfig config, std::shared_ptr<Router> router, http::Client* client)
    : config_(std::move(config)),
      router_(std::move(router)),
      client_(client),
      encoders_out_(std::make_unique<Quarantine>(client)),
      encode_(std::make_unique<EncodeStep>(
          EncodeStepConfig{config_.router_token, config_.encode_timeout}, client,
          encoders_out_.get())) {}

DriverStats Driver::Stats() const {
    DriverStats s{requests_.load(),    succeeded_.load(),    failed_.load(),
                  client_gone_.load(), in_flight_.load(),    prefill_skipped_.load(),
                  encoded_.load(),     encode_failed_.load()};
    s.encoders_quarantined = encoders_out_->size();
    s.timeouts = timeouts_.load() + encode_->timeouts();
    s.prefill_retried = prefill_retried_.load();
    s.prefill_fallback = prefill_fallback_.load();
    s.decode_retried = decode_retried_.load();
    s.migrated = migrated_.load();
    s.encode_retried = encode_retried_.load();
    return s;
}

// Counts the request's end; tickets still open end as `rest` (the flow's success, or another
// stage's failure: kCancelled).
void Driver::Finish(const std::shared_ptr<Flow>& f, bool ok) {
    --in_flight_;
    (ok ? succeeded_ : failed_)++;
    const Outcome rest = ok ? Outcome::kSucceeded : Outcome::kCancelled;
    f->End(&Flow::prefill, rest);
    f->End(&Flow::decode, rest);
    if (!ok && config_.protocol == Protocol::kPush && f->prefill_routed) {
        // The prefill worker may have restarted with another agent: ask it again next time.
        router_->ForgetAgent(Role::kPrefill, f->prefill_worker);
    }
}

void Driver::Fail(const std::shared_ptr<Flow>& f, int status, const std::string& message) {
    if (!f->Claim()) return;
    f->CancelAll();
    Finish(f, false);
    FERRY_LOG(kInfo, "proxy: request {} failed: {} {}", f->request_id, status, message);
    if (f->started) {
        // Mid-stream: an error event, then the end.
        f->ex->Write(ErrorEvent(status, {message}, f->request_id));
        f->ex->End();
        return;
    }
    f->ex->Reply(ErrorReply(status, message, f->request_id));
}

// Sends the request to the decode worker and relays its answer to the client.
void Driver::Decode(const std::shared_ptr<Flow>& f, Json body) {
    const http::Endpoint ep = f->decode_ep;
    auto self = shared_from_this();
    int gen;
    {
        std::lock_guard lock(f->mu);
        gen = f->gen;
        f->decode_body = body;
        f->status = 0;
        f->collected.clear();
        f->sse.clear();
    }
    if (f->track_ids) body["return_token_ids"] = true;
    http::ClientCallbacks cb;
    cb.on_head = [f, gen](const http::ClientHead& h) {
        std::lock_guard lock(f->mu);
        if (gen != f->gen) return;
        f->status = h.status;
        if (const std::string* ct = http::FindHeader(h.headers, "content-type")) {
            f->content_type = *ct;
        }
        if (f->stream && h.status == 200 && !f->started) {
            f->started = true;
            f->ex->StartStream(h.status, f->content_type,
                               {{"Cache-Control", "no-cache"}, {"X-Request-Id", f->request_id}});
        }
    };
    cb.on_data = [f, gen](std::string_view d) {
        std::lock_guard lock(f->mu);
        if (gen != f->gen) return;
        if (f->started && f->status == 200) {
            if (!f->track_ids) {
                f->ex->Write(std::string(d));
                return;
            }
            // Whole events only: one cut off by the worker's death is never half sent.
            f->sse.append(d);
            size_t from = 0, end;
            while ((end = f->sse.find("\n\n", from)) != std::string::npos) {
                f->RelayEvent(std::string_view(f->sse).substr(from, end - from));
                from = end + 2;
            }
            f->sse.erase(0, from);
            if (f->sse.size() > (64u << 20)) f->sse.clear();  // no event is this large
        } else if (f->collected.size() < (64u << 20)) {
            f->collected.append(d);
        }
    };
    cb.on_done = [self, f, ep, gen](const Status& st) {
        if (!f->Current(gen)) return;
        if (!st.ok()) {
            if (st.code() == Code::kCancelled) return;
            return self->DecodeFailed(f, ep, st);
        }
        bool retry = false;
        {
            std::lock_guard lock(f->mu);
            // push: the decoder could not reach the prefill worker's agent before any token
            // (503): that agent may have moved (router/worker_call.h). Claimed under the lock,
            // so one callback retries.
            retry = self->config_.protocol == Protocol::kPush && f->prefill_routed &&
                    !f->fallback && f->attempt == 0 && f->status == 503 && !f->started &&
                    !f->cancelled && !f->answered;
            if (retry) {
                f->attempt = 1;
                ++f->gen;
            }
        }
        if (retry && ReplanAfterUnreachableAgent(*self->router_, f->prefill_worker, 0,
                                                 UnavailableError("decode worker: 503"))) {
            FERRY_LOG(kInfo,
                      "proxy: request {}: the decode worker could not reach the prefill worker's "
                      "agent; asking it again and retrying",
                      f->request_id);
            f->CancelAttempt();
            return self->Push(f);
        }
        if (!f->Claim()) return;
        f->CancelAll();
        int status;
        bool started;
        std::string content_type, collected;
        {
            std::lock_guard lock(f->mu);
            status = f->status;
            started = f->started;
            content_type = f->content_type;
            collected = std::move(f->collected);
        }
        f->End(&Flow::decode, OutcomeOfStatus(status));
        self->Finish(f, status == 200);
        if (started && status != 200) {
            // A migrated stream's new decode worker refused it: the client's stream ends with
            // the error.
            f->ex->Write(ErrorEvent(status, {collected.substr(0, 512)}, f->request_id));
            f->ex->End();
        } else if (started) {
            f->ex->End();
        } else {
            f->ex->Reply({status,
                          std::move(content_type),
                          std::move(collected),
                          {{"X-Request-Id", f->request_id}}});
        }
    };
    http::ClientRequest call = WorkerRequest(ep, f->path, body, f->request_id, config_.router_token,
                                             config_.worker_timeout);
    // A stream that stalls (the worker stopped, wedged, cut off without a reset) fails at this
    // deadline and is migrated, instead of holding the client until worker_timeout.
    call.idle_timeout = config_.stream_idle_timeout;
    f->Add(client_->Call(std::move(call), std::move(cb)));
}

bool Driver::Reroute(const std::shared_ptr<Flow>& f, Role role) {
    const bool prefill = role == Role::kPrefill;
    RouteRequest rr;
    int tries;
    {
        std::lock_guard lock(f->mu);
        rr = f->Retry(role);
        tries = prefill ? f->prefill_tries : f->decode_tries;
    }
    if (tries >= config_.max_attempts) return false;
    Result<Ticket> t = router_->Route(role, rr);
    if (!t.ok()) return false;
    std::lock_guard lock(f->mu);
    if (f->cancelled || f->answered) {
        t->End(Outcome::kCancelled);  // the client left meanwhile
        return false;
    }
    if (prefill) {
        ++f->prefill_tries;
        f->prefill_worker = t->worker();
        f->prefill_ep = t->endpoint();
        f->prefill = std::move(*t);
    } else {
        ++f->decode_tries;
        f->decode_ep = t->endpoint();
        f->decode = std::move(*t);
    }
    return true;
}

void Driver::DecodeFailed(const std::shared_ptr<Flow>& f, const http::Endpoint& ep,
                          const Status& st) {
    const CallFailure failure = FailureOf("decode", ep, st);
    bool started;
    size_t worker;
    {
        std::lock_guard lock(f->mu);
        if (f->answered || f->cancelled) return;
        ++f->gen;  // this attempt's callbacks are stale from here on
        started = f->started;
        worker = f->decode.worker();
        f->failed_decode.push_back(worker);
        f->decode.End(Outcome::kWorkerFailed);
    }
    if (failure.timed_out) ++timeouts_;
    // Unreachable, cut off or past its deadline: no new request until it answers again.
    router_->ReportTimedOut(Role::kDecode, worker);
    if (!Reroute(f, Role::kDecode)) return Fail(f, failure.status, failure.message);
    const http::Endpoint to = f->decode_ep;
    if (started) {
        // Mid-stream: the prompt and what was streamed go to another decode worker, which
        // computes their KV and goes on; the client's stream continues with its next token.
        Json body;
        size_t sent;
        {
            std::lock_guard lock(f->mu);
            body = f->body;
            sent = f->generated.size();
            if (sent > 0) body["ferry_continue"] = {{"token_ids", f->generated}};
            f->status = 0;
        }
        ++migrated_;
        FERRY_LOG(kWarn, "proxy: request {}: {}; migrating its stream after {} tokens to {}",
                  f->request_id, failure.message, sent, FormatHostPort(to.host, to.port));
        return Decode(f, std::move(body));
    }
    ++decode_retried_;
    FERRY_LOG(kWarn, "proxy: request {}: {}; sending it to decode worker {}", f->request_id,
              failure.message, FormatHostPort(to.host, to.port));
    if (config_.protocol == Protocol::kPush && f->prefill_routed && !f->fallback) {
        // The prefill worker wrote into the lost decoder's blocks: the hand-off again, both.
        f->CancelAttempt();
        return Push(f);
    }
    // pull: the prefill worker holds the KV until it is read or its lease ends; the same
    // kv_transfer_params again (the client's body where no prefill worker was asked).
    Json body;
    {
        std::lock_guard lock(f->mu);
        body = f->decode_body;
    }
    Decode(f, std::move(body));
}

void Driver::PrefillFailed(const std::shared_ptr<Flow>& f, const http::Endpoint& ep,
                           const Status& st, std::optional<http::ClientReply> reply) {
    CallFailure failure = FailureOf("prefill", ep, st);
    if (st.message().rfind("prefill worker ", 0) == 0) failure.message = st.message();  // named
    const bool push = config_.protocol == Protocol::kPush;
    size_t worker;
    {
        std::lock_guard lock(f->mu);
        if (f->answered || f->cancelled) return;
        worker = f->prefill_worker;
        f->failed_prefill.push_back(worker);
        f->prefill.End(Outcome::kWorkerFailed);
        // push: a decode worker that answered has its KV (or fails on its own): it decides.
        if (push && f->status != 0) return;
        ++f->gen;
    }
    if (!reply) {
        if (failure.timed_out) ++timeouts_;
        router_->ReportTimedOut(Role::kPrefill, worker);
    }
    const std::string why = reply ? fmt::format("prefill worker {} answered {}",
                                                FormatHostPort(ep.host, ep.port), reply->status)
                                  : failure.message;
    if (push) f->CancelAttempt();  // the decode worker waits for KV that will not come
    if (Reroute(f, Role::kPrefill)) {
        ++prefill_retried_;
        FERRY_LOG(kWarn, "proxy: request {}: {}; prefilling it on {}", f->request_id, why,
                  FormatHostPort(f->prefill_ep.host, f->prefill_ep.port));
        return push ? Push(f) : Pull(f);
    }
    if (config_.prefill_fallback) {
        ++prefill_fallback_;
        {
            std::lock_guard lock(f->mu);
            f->fallback = true;
        }
        FERRY_LOG(kWarn,
                  "proxy: request {}: {}; no prefill worker left to try: the decode worker "
                  "prefills it",
                  f->request_id, why);
        return Decode(f, f->body);
    }
    if (!reply) return Fail(f, failure.status, failure.message);
    if (!f->Claim()) return;
    f->CancelAll();
    Finish(f, false);
    f->ex->Reply({reply->status,
                  "application/json",
                  std::move(reply->body),
                  {{"X-Request-Id", f->request_id}}});
}

void Driver::Prefill(const std::shared_ptr<Flow>& f, const Json& body,
                     std::function<void(http::ClientReply)> on_ok) {
    const http::Endpoint ep = f->prefill_ep;
    auto self = shared_from_this();
    int gen;
    {
        std::lock_guard lock(f->mu);
        gen = f->gen;
    }
    f->Add(client_->CallWhole(
        WorkerRequest(ep, f->path, body, f->request_id, config_.router_token,
                      config_.prefill_timeout),
        [self, f, ep, gen, on_ok = std::move(on_ok)](Result<http::ClientReply> r) {
            if (!f->Current(gen)) return;
            if (!r.ok()) {
                if (r.status().code() == Code::kCancelled) return;
                return self->PrefillFailed(f, ep, r.status(), std::nullopt);
            }
            if (r->status >= 500) return self->PrefillFailed(f, ep, Status::Ok(), std::move(*r));
            f->End(&Flow::prefill, OutcomeOfStatus(r->status));
            if (r->status == 200) return on_ok(std::move(*r));
            // A refusal (4xx) is the request's: relayed as it came. push: the decode worker
            // would wait for KV that never comes: stop it too.
            if (!f->Claim()) return;
            f->CancelAll();
            self->Finish(f, false);
            f->ex->Reply({r->status,
                          "application/json",
                          std::move(r->body),
                          {{"X-Request-Id", f->request_id}}});
        }));
}

void Driver::Pull(const std::shared_ptr<Flow>& f) {
    Json pb = PrefillBody(f->body);
    pb["kv_transfer_params"] = schema::PullPrefillRequestParams();
    auto self = shared_from_this();
    Prefill(f, pb, [self, f](http::ClientReply r) {
        Json answer = Json::parse(r.body, nullptr, false);
        Json decode = f->body;
        if (answer.is_object() && answer.contains("kv_transfer_params") &&
            answer["kv_transfer_params"].is_object() && !answer["kv_transfer_params"].empty()) {
            decode["kv_transfer_params"] = answer["kv_transfer_params"];
        }
        {
            std::lock_guard lock(f->mu);
            if (f->cancelled) return;
        }
        self->Decode(f, std::move(decode));
    });
}

void Driver::Push(const std::shared_ptr<Flow>& f) {
    auto self = shared_from_this();
    int gen;
    {
        std::lock_guard lock(f->mu);
        gen = f->gen;
    }
    auto planned = [self, f, gen](Result<PushPlan> plan) {
        if (!f->Current(gen)) return;
        if (!plan.ok()) {
            if (plan.status().code() == Code::kCancelled) return;
            // Its agent could not be found: the prefill worker failed this request.
            return self->PrefillFailed(f, f->prefill_ep, plan.status(), std::nullopt);
        }
        Json pb = PrefillBody(f->body);
        pb["kv_transfer_params"] = std::move(plan->prefill_params);
        Json db = f->body;
        db["kv_transfer_params"] = std::move(plan->decode_params);
        // Both at once: the decode worker allocates and names its blocks while the prefill
        // worker waits for them. The decode worker's answer is the client's.
        self->Decode(f, std::move(db));
        self->Prefill(f, pb, [](http::ClientReply) {});
    };
    f->Add(PlanPush(*client_, router_, f->prefill_worker, config_.router_token,
                    config_.agent_timeout, std::move(planned)));
}

void Driver::Encode(const std::shared_ptr<Flow>& f, const std::vector<http::Endpoint>& answering,
                    std::function<void()> next, int tries) {
    auto self = shared_from_this();
    f->Add(encode_->Call(
        f->body, answering, f->request_id,
        [self, f, answering, tries, next = std::move(next)](Encoded e) mutable {
            if (e.kind == Encoded::Kind::kCancelled) return;
            {
                std::lock_guard lock(f->mu);
                if (f->cancelled) return;
            }
            switch (e.kind) {
                case Encoded::Kind::kRefused:
                    if (!f->Claim()) return;
                    f->CancelAll();
                    self->Finish(f, false);
                    return f->ex->Reply({e.refused.status,
                                         "application/json",
                                         std::move(e.refused.body),
                                         {{"X-Request-Id", f->request_id}}});
                case Encoded::Kind::kEncoded:
                    ++self->encoded_;
                    if (!e.ec_transfer_params.empty()) {
                        std::lock_guard lock(f->mu);
                        f->body["ec_transfer_params"] = std::move(e.ec_transfer_params);
                    }
                    break;
                default: {
                    // Another encode worker, while there is one and tries are left; then the
                    // workers encode for themselves (the last resort).
                    std::vector<http::Endpoint> rest;
                    for (const http::Endpoint& ep : answering) {
                        if (ep.host != e.worker.host || ep.port != e.worker.port)
                            rest.push_back(ep);
                    }
                    if (!rest.empty() && tries < self->config_.max_attempts) {
                        ++self->encode_retried_;
                        FERRY_LOG(kWarn, "proxy: request {}: {}; encoding on {} more worker(s)",
                                  f->request_id, e.why, rest.size());
                        return self->Encode(f, rest, std::move(next), tries + 1);
                    }
                    ++self->encode_failed_;
                    FERRY_LOG(kWarn,
                              "proxy: request {}: {}; the workers encode its images themselves",
                              f->request_id, e.why);
                }
            }
            next();
        }));
}

void Driver::Handle(const std::shared_ptr<http::Exchange>& ex, const std::string& path) {
    ++requests_;
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
    if (body.contains("ec_transfer_params")) {
        return ex->Reply(
            ErrorReply(400, "ec_transfer_params are the proxy's to set, not the client's"));
    }
    auto f = std::make_shared<Flow>();
    f->ex = ex;
    f->path = path;
    f->stream =
        body.contains("stream") && body["stream"].is_boolean() && body["stream"].get<bool>();
    // The prompt's token ids, counted and hashed by block (what a cache-aware policy scores):
    // given as ids, or text and messages tokenized as the workers do, only while some worker's
    // blocks are followed (hashing costs this I/O thread's time).
    std::vector<BlockHash> block_hashes;
    const bool hashing = router_->block_size() > 0;
    if (body.contains("prompt") && body["prompt"].is_array() &&
        std::all_of(body["prompt"].begin(), body["prompt"].end(),
                    [](const Json& t) { return t.is_number_integer(); })) {
        f->prompt_tokens = body["prompt"].size();
        std::vector<int32_t> tokens;
        tokens.reserve(f->prompt_tokens);
        for (const Json& t : body["prompt"]) {
            const int64_t v = t.get<int64_t>();
            if (v < 0 || v > INT32_MAX) break;
            tokens.push_back(int32_t(v));
        }
        if (hashing && tokens.size() == f->prompt_tokens) {
            block_hashes = router_->PromptBlockHashes(tokens);
        }
    } else if (hashing && config_.tokenizer) {
        // A body the workers would refuse is routed unscored: the worker's 400 names the fault.
        std::vector<int32_t> tokens;
        tokenizer::PromptError unused;
        if (tokenizer::PromptTokens(body, path == "/v1/chat/completions", *config_.tokenizer,
                                    &tokens, &unused)) {
            f->prompt_tokens = tokens.size();
            block_hashes = router_->PromptBlockHashes(tokens);
        }
    }
    // Streamed with retries: relayed event by event with the tokens' ids, so that a decode
    // worker lost mid-stream can be replaced by another that goes on from them.
    f->client_wants_ids = body.contains("return_token_ids") &&
                          body["return_token_ids"].is_boolean() &&
                          body["return_token_ids"].get<bool>();
    f->track_ids = f->stream && config_.max_attempts > 1;
    if (body.contains("ferry_continue")) {
        return ex->Reply(ErrorReply(400, "ferry_continue is the proxy's to set, not the client's"));
    }
    f->body = std::move(body);
    // One id through every worker: the client's X-Request-Id if it gave a valid one, else 128
    // random bits; the workers name their requests "cmpl-" + it.
    f->request_id = RequestIdOr(ex->request().Find("X-Request-Id"));
    f->block_hashes = std::move(block_hashes);
    const RouteRequest rr{f->request_id, f->prompt_tokens, f->block_hashes};
    // The decode worker first: if its cache holds (nearly) the whole prompt, no prefill worker.
    Result<Ticket> d = router_->Route(Role::kDecode, rr);
    if (!d.ok()) return ex->Reply(ErrorReply(503, d.status().message(), f->request_id));
    const size_t held = d->prefix_blocks() * size_t(std::max(0, router_->block_size()));
    // E+PD: encode workers and no prefill worker; the decode workers serve whole requests.
    const std::vector<http::Endpoint> encoders = Encoders();
    const bool no_prefill = !encoders.empty() && router_->members(Role::kPrefill) == 0;
    const bool skip_prefill =
        no_prefill || (config_.pd_min_uncached_tokens > 0 && f->prompt_tokens > 0 && held > 0 &&
                       f->prompt_tokens < held + size_t(config_.pd_min_uncached_tokens));
    if (!skip_prefill) {
        Result<Ticket> p = router_->Route(Role::kPrefill, rr);
        if (!p.ok()) return ex->Reply(ErrorReply(503, p.status().message(), f->request_id));
        f->prefill_worker = p->worker();
        f->prefill_routed = true;
        f->prefill_ep = p->endpoint();
        f->prefill = std::move(*p);
    }
    f->decode_ep = d->endpoint();
    f->decode = std::move(*d);
    if (skip_prefill && !no_prefill) {
        ++prefill_skipped_;
        FERRY_LOG(kInfo,
                  "proxy: request {}: decode {} holds {} of its {} prompt tokens: no prefill "
                  "worker",
                  f->request_id, FormatHostPort(f->decode_ep.host, f->decode_ep.port), held,
                  f->prompt_tokens);
    } else if (!skip_prefill) {
        FERRY_LOG(kInfo, "proxy: request {}: prefill {}, decode {} ({})", f->request_id,
                  FormatHostPort(f->prefill_ep.host, f->prefill_ep.port),
                  FormatHostPort(f->decode_ep.host, f->decode_ep.port),
                  ProtocolName(config_.protocol));
    }
    ++in_flight_;
    auto self = shared_from_this();
    // Weak: the flow holds the exchange, so a strong reference here would keep both alive after
    // the request ends (the calls in flight hold the flow while it runs).
    ex->OnClose([self, weak = std::weak_ptr<Flow>(f)] {
        std::shared_ptr<Flow> f = weak.lock();
        if (!f || !f->Claim()) return;
        ++self->client_gone_;
        f->End(&Flow::prefill, Outcome::kClientGone);
        f->End(&Flow::decode, Outcome::kClientGone);
        self->Finish(f, false);
        f->CancelAll();  // the workers see their connections close and abort
    });
    auto go = [self, f, skip_prefill] {
        if (skip_prefill) {
            self->Decode(f, f->body);  // as the client sent it: the decode worker prefills the rest
        } else if (self->config_.protocol == Protocol::kPush) {
            self->Push(f);
        } else {
            self->Pull(f);
        }
    };
    std::vector<std::string_view> urls;
    if (!encoders.empty() && path == "/v1/chat/completions") urls = ImageUrls(f->body);
    if (urls.empty()) return go();
    // Encode workers that timed out get no request until they answer a probe; with none left
    // the workers encode the images themselves.
    const std::vector<http::Endpoint> answering = encode_->Answering(encoders);
    if (answering.empty()) return go();
    Encode(f, answering, std::move(go));
}

std::vector<http::Endpoint> Driver::Encoders() const {
    if (!config_.store_encoders) return config_.encode;
    std::vector<http::Endpoint> all = config_.encode;
    for (const http::Endpoint& ep : config_.store_encoders->Get()) {
        const bool dup = std::any_of(all.begin(), all.end(), [&](const http::Endpoint& e) {
            return e.host == ep.host && e.port == ep.port;
        });
        if (!dup) all.push_back(ep);
    }
    return all;
}

}  // namespace ferry::router
