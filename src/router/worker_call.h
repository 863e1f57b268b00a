// Calls from one process to a worker, built and read in one place. `ferry proxy`'s driver, a
// decode-first worker's remote prefill and a worker's --encoder-urls all send their requests
// through here: one request shape (body, the request's id, the deployment's token, a deadline),
// one reading of a failed call (what the client gets, whether the worker timed out), and the
// EPD encode step whole (which encode worker, its body, its answer's meaning, the quarantine of a
// worker that timed out).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "http/http.h"
#include "router/quarantine.h"
#include "router/router.h"

namespace ferry::router {

// One POST of `body` to `path` on the worker at `ep`: X-Request-Id `request_id`, the router
// token when there is one, and `timeout` from the call's start to its last byte.
http::ClientRequest WorkerRequest(const http::Endpoint& ep, const std::string& path,
                                  const nlohmann::json& body, const std::string& request_id,
                                  const std::string& router_token,
                                  std::chrono::milliseconds timeout);

// A call that failed before the worker answered, as the client hears of it: 504 when it ran past
// its deadline (`timed_out`), 502 otherwise, the message "<role> worker HOST:PORT: <why>".
struct CallFailure {
    int status = 502;
    bool timed_out = false;
    std::string message;
};
CallFailure FailureOf(std::string_view role, const http::Endpoint& ep, const Status& st);

// Push's hand-off as `ferry proxy` and a decode-first worker both start it: where the prefill
// worker's agent is, a fresh transfer id (128 random bits: a client that could name the next one
// could park requests under it on the prefill worker), and each side's kv_transfer_params.
struct PushPlan {
    AgentInfo agent;
    std::string transfer_id;
    nlohmann::json prefill_params;  // the prefill worker's: write to whoever names the id
    nlohmann::json decode_params;   // the decoder's: name your blocks to `agent` under the id
};
// Finds `worker`'s agent (router/protocol.h FindAgent: known, in the store, or asked within
// `timeout`) and plans the hand-off. `done` runs once, on this thread when the agent is known,
// else on an I/O thread of `client`; an error names the worker (DeadlineExceeded past the
// deadline, Cancelled when the call was). The call, if one was made.
std::shared_ptr<http::ClientCall> PlanPush(http::Client& client, std::shared_ptr<Router> router,
                                           size_t worker, const std::string& router_token,
                                           std::chrono::milliseconds timeout,
                                           std::function<void(Result<PushPlan>)> done);

// Push's one retry, as `ferry proxy` and a decode-first worker both make it: a decoder that could
// not reach the prefill worker's agent before any token (`load_failure` Unavailable: the decode
// worker answered 503, or a decode-first worker's own load failed so) may have been given an
// agent that moved (the prefill worker restarted). On the first attempt the agent is forgotten
// (the next PlanPush asks again) and the caller plans the hand-off once more on the same
// workers; true when it is to. Any other failure, or a second one, ends the request.
bool ReplanAfterUnreachableAgent(Router& router, size_t prefill_worker, int attempt,
                                 const Status& load_failure);

// What an encode worker's answer means for the request (EPD).
struct Encoded {
    enum class Kind {
        kEncoded,    // 200: `ec_transfer_params` for the consumers (empty: the disk connector)
        kRefused,    // 400: the images themselves are bad; `refused` is the reply to relay
        kFailed,     // anything else: the consumers encode for themselves (`why`)
        kCancelled,  // the call was cancelled (its client left, or the process stops)
    };
    Kind kind = Kind::kFailed;
    http::Endpoint worker;
    nlohmann::json ec_transfer_params = nlohmann::json::object();
    http::ClientReply refused;
    std::string why;
};

// An encode worker's answer is a chat.completion with no tokens and its params (a few hundred
// bytes); one larger than this is a failure of that worker (the consumers encode), never read.
inline constexpr size_t kMaxEncodeAnswerBytes = 1u << 20;

struct EncodeStepConfig {
    std::string router_token;
    std::chrono::milliseconds timeout{10000};
};

// The encode step of a chat request with images (vLLM's disagg_epd_proxy.py): the client's body
// as a prefill worker would get it (one token, not streamed, no transfer params) goes to the
// encode worker the rendezvous hash of its image URLs picks (router/protocol.h: PickEncoder), so
// a repeated image meets the worker that holds it. A worker that runs past the deadline or cannot
// be reached goes into `quarantine` (no request until it answers a probe). Thread-safe.
class EncodeStep {
  public:
    // Neither is owned; both outlive the step.
    EncodeStep(EncodeStepConfig config, http::Client* client, Quarantine* quarantine);

    // Those of `encoders` not in quarantine, in order.
    std::vector<http::Endpoint> Answering(const std::vector<http::Endpoint>& encoders);

    // Sends `body`'s images to one of `answering` (not empty). `done` runs once, on an I/O
    // thread of the client. The call (cancel it to stop waiting: `done` then gets kCancelled).
    std::shared_ptr<http::ClientCall> Call(const nlohmann::json& body,
                                           const std::vector<http::Endpoint>& answering,
                                           const std::string& request_id,
                                           std::function<void(Encoded)> done);

    // Calls that ran past the deadline so far.
    uint64_t timeouts() const { return timeouts_.load(); }
    const EncodeStepConfig& config() const { return config_; }

  private:
    EncodeStepConfig config_;
    http::Client* client_;
    Quarantine* quarantine_;
    std::atomic<uint64_t> timeouts_{0};
};

}  // namespace ferry::router
