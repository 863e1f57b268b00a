// The P/D driver: takes one client completion request, routes it to a prefill and a decode
// worker and drives the pull or push protocol between them (docs/disaggregation.md), relaying the
// decode worker's answer (streamed or whole) to the client.
//
// pull (vLLM's NixlConnector protocol, as vLLM's toy_proxy_server does it): the request goes to
//   a prefill worker with kv_transfer_params {do_remote_decode: true}, max_tokens 1, not
//   streamed; the kv_transfer_params of its answer go with the original request to a decode
//   worker.
// push (layer-wise): the request goes to a prefill and a decode worker at once, under a transfer
//   id; the decode worker names its blocks to the prefill worker, which writes each layer into
//   them. A prefill worker whose agent moved (it restarted) makes the decode worker answer 503
//   before any token; the driver then asks the prefill worker where its agent is now and tries
//   once more.
//
// The prompt's tokens: given as token ids, or text and chat messages tokenized with the workers'
// tokenizer (DriverConfig::tokenizer) once a worker's KV events are followed; hashed by block as
// the workers hash them (core/block_hash.h), they are what a cache-aware policy scores.
//
// The P/D decision (multi-turn chat): when the chosen decode worker already holds all but fewer
// than `pd_min_uncached_tokens` of the prompt's tokens in its prefix cache (its KV events say so,
// router/kv_index.h), the prefill worker is skipped and the request goes to the decode worker as
// the client sent it: it prefills the short rest itself, as a colocated worker would.
//
// EPD (vLLM's disagg_epd_proxy.py): with encode workers, a chat request with image parts first
// goes to one of them as a prefill request would (max_tokens 1, not streamed), chosen by a
// rendezvous hash of its images' URLs so that a repeated image meets the encode worker that
// already holds it; the ec_transfer_params of its answer go with the request to the prefill and
// decode workers, which pull the embeddings instead of encoding. An encode worker that fails
// (other than refusing the images, a 400 relayed as it came) only costs the encoding: the
// request goes on without the params and the workers encode for themselves.
//
// Event-driven: no thread waits on a worker. A client that leaves cancels its worker calls (the
// workers then abort and free their blocks). Every request carries one id (the client's valid
// X-Request-Id, else 128 random bits) to every worker as X-Request-Id, and every error names it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "http/http.h"
#include "router/protocol.h"
#include "router/quarantine.h"
#include "router/router.h"
#include "router/worker_call.h"
#include "tokenizer/tokenizer.h"

namespace ferry::router {

struct DriverConfig {
    Protocol protocol = Protocol::kPull;
    // Deadlines of the calls to workers, each from the call's start to its last byte. A decode
    // call (the client's whole answer, streamed) not over by `worker_timeout` and a prefill call
    // not answered by `prefill_timeout` fail the request (504), and that worker gets no new
    // request until it answers again (Router::ReportTimedOut; the membership's poll of its
    // /metrics brings it back). An encode call not answered by `encode_timeout` costs only the
    // encoding (the workers encode for themselves) and puts that encode worker in quarantine
    // until it answers a probe (router/quarantine.h). A prefill worker's agent lookup (GET
    // /v1/kv/agent) fails the request (502) after `agent_timeout`.
    std::chrono::milliseconds worker_timeout{600000};
    std::chrono::milliseconds prefill_timeout{60000};
    std::chrono::milliseconds encode_timeout{10000};
    std::chrono::milliseconds agent_timeout{5000};
    // Once a decode worker's answer body started (its first token), the longest silence between
    // its pieces: past it the worker counts as lost (a stream is migrated, as for a worker that
    // died). A request waiting in the worker's queue before its first token is not cut off by
    // it; a running one preempted for longer than this would be (then it is migrated). 0: none.
    std::chrono::milliseconds stream_idle_timeout{30000};
    // The deployment's router token, sent to the workers on every call ("" = none).
    std::string router_token;
    // Skip the prefill worker when the decode worker lacks fewer than this many prompt tokens
    // (0: never skip).
    int pd_min_uncached_tokens = 16;
    // The workers' tokenizer (their model file's): text prompts and chat messages are turned
    // into token ids as the workers do (model/prompt.h) and hashed by block, so that
    // cache-aware routing and the P/D decision see them. Null: only prompts given as token ids
    // are scored. Used only once a followed worker has stated its block hashes.
    std::shared_ptr<const tokenizer::Tokenizer> tokenizer = {};
    // Encode workers (EPD); none: images go to the prefill and decode workers as they came.
    // With encode workers and no prefill worker (vLLM's 1e1pd), requests go to the decode
    // workers whole.
    std::vector<http::Endpoint> encode = {};
    // More encode workers, found in the discovery store (Membership); null: none.
    std::shared_ptr<const EncoderSet> store_encoders = {};
    // Tries per stage of one request (1: none again). A prefill worker that fails (unreachable,
    // cut off, past its deadline, a 5xx answer) has the request prefilled by another; a decode
    // worker lost before the client saw a byte has it sent to another with the same KV source
    // (push: the hand-off planned again), and one lost mid-stream has it migrated: another
    // decode worker gets the prompt and the tokens already streamed (ferry_continue) and the
    // client's stream goes on. A worker that failed a request is not tried for it again and
    // gets no new request until it answers (Router::ReportTimedOut).
    int max_attempts = 3;
    // With no prefill worker left to try, the decode worker prefills the prompt itself (as the
    // P/D decision does for a cached prompt) instead of the request failing.
    bool prefill_fallback = true;
};

struct DriverStats {
    uint64_t requests = 0, succeeded = 0, failed = 0, client_gone = 0, in_flight = 0;
    uint64_t prefill_skipped = 0;       // the decode worker held (nearly) the whole prompt
    uint64_t encoded = 0;               // requests whose images an encode worker took
    uint64_t encode_failed = 0;         // ... that failed there (the workers encoded themselves)
    uint64_t encoders_quarantined = 0;  // encode workers out of rotation now (timed out)
    uint64_t timeouts = 0;              // worker calls that ran past their deadline
    uint64_t prefill_retried = 0;       // prefills sent to another worker after a failure
    uint64_t prefill_fallback = 0;      // ... or, with none left, prefilled by the decode worker
    uint64_t decode_retried = 0;        // requests sent to another decode worker before a byte
    uint64_t migrated = 0;              // streams migrated to another decode worker
    uint64_t encode_retried = 0;        // encode steps sent to another encode worker
};

class Driver : public std::enable_shared_from_this<Driver> {
  public:
    // `router` holds at least one worker of each role by the first request. `client` is not
    // owned: destroy it (which stops its calls) before the driver goes.
    static std::shared_ptr<Driver> Create(DriverConfig config, std::shared_ptr<Router> router,
                                          http::Client* client);

    // Serves one POST of `path` (/v1/completions or /v1/chat/completions). Thread-safe.
    void Handle(const std::shared_ptr<http::Exchange>& ex, const std::string& path);

    DriverStats Stats() const;
    const DriverConfig& config() const { return config_; }

  private:
    struct Flow;
    Driver(DriverConfig config, std::shared_ptr<Router> router, http::Client* client);

    void Finish(const std::shared_ptr<Flow>& f, bool ok);
    void Fail(const std::shared_ptr<Flow>& f, int status, const std::string& message);
    // The prefill worker failed this request (`st`: the call; or it answered `reply`, a 5xx):
    // another prefill worker, else the decode worker alone (prefill_fallback), else the failure.
    void PrefillFailed(const std::shared_ptr<Flow>& f, const http::Endpoint& ep, const Status& st,
                       std::optional<http::ClientReply> reply);
    // The decode worker's call failed before it answered whole: another decode worker (from
    // the same KV source before the client saw a byte, migrated after), else the failure.
    void DecodeFailed(const std::shared_ptr<Flow>& f, const http::Endpoint& ep, const Status& st);
    // Routes the flow's `role` anew, avoiding the workers that failed it; false when none is left.
    bool Reroute(const std::shared_ptr<Flow>& f, Role role);
    void Decode(const std::shared_ptr<Flow>& f, nlohmann::json body);
    // Sends `body` to the prefill worker. A transport failure fails the request (502, 504 on a
    // deadline) and an answer other than 200 is relayed to the client as it came; `on_ok` gets
    // a 200 answer.
    void Prefill(const std::shared_ptr<Flow>& f, const nlohmann::json& body,
                 std::function<void(http::ClientReply)> on_ok);
    void Pull(const std::shared_ptr<Flow>& f);
    void Push(const std::shared_ptr<Flow>& f);
    // EPD: sends the request to one of `answering` (encode workers; router/worker_call.h),
    // puts the ec_transfer_params of its answer into the flow's body, then `next`.
    // One that fails (other than refusing the images) is left out and another tried, up to
    // max_attempts in all.
    void Encode(const std::shared_ptr<Flow>& f, const std::vector<http::Endpoint>& answering,
                std::function<void()> next, int tries = 1);
    // The encode workers now: the flags' and the store's (no duplicates), quarantined or not.
    std::vector<http::Endpoint> Encoders() const;

    DriverConfig config_;
    std::shared_ptr<Router> router_;
    http::Client* client_;
    std::unique_ptr<Quarantine> encoders_out_;  // encode workers that timed out
    std::unique_ptr<EncodeStep> encode_;
    std::atomic<uint64_t> requests_{0}, succeeded_{0}, failed_{0}, client_gone_{0}, in_flight_{0},
        prefill_skipped_{0}, encoded_{0}, encode_failed_{0}, timeouts_{0}, prefill_retried_{0},
        prefill_fallback_{0}, decode_retried_{0}, migrated_{0}, encode_retried_{0};
};

}  // namespace ferry::router
