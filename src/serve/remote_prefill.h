// Decode-first (Dynamo style): a decode worker sends long prompts to prefill workers, which push
// the KV back, and dispatches them here; the prefill workers are routed among as a proxy routes
// (router::Router), those that timed out wait in the server's quarantine, and
// /add_remote_prefill_eps adds more. Part of OpenAiServer (openai_server_parts.h).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "http/http.h"
#include "router/router.h"
#include "router/worker_call.h"
#include "serve/openai_request.h"
#include "serve/openai_server.h"

namespace ferry::serve {

class RemotePrefill {
  public:
    // The prefill workers of config.remote_prefill (their agents looked up through
    // config.remote_prefill_agents, else asked).
    explicit RemotePrefill(OpenAiServer::Impl& server);

    // Takes a parsed request (its images encoded) to a prefill worker if it is one decode-first
    // prefills elsewhere: no kv_transfer_params of its own, no images (a prompt of token ids
    // cannot carry them), at least config.remote_prefill_min_tokens long, and a prefill worker
    // that has not timed out lately. False (pr untouched): it is prefilled here.
    bool Take(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest& pr);
    // POST /add_remote_prefill_eps (the router's only).
    void AddWorkers(const std::shared_ptr<http::Exchange>& ex);
    // The prefill workers as a proxy reports them ("" with none).
    std::string RenderMetrics() const;

  private:
    // The prefill workers a request was sent to, in order (the last is the current one).
    using Tried = std::shared_ptr<std::vector<size_t>>;
    // Sends the prompt to the prefill worker `ticket` routed it to, to prefill and push here,
    // then dispatches locally under `base` (the request's id). A first attempt whose prefill
    // worker turns out unreachable (it restarted: the agent it had is gone) asks it again where
    // its agent is and tries once more. The ticket ends with the prefill worker's answer.
    void DecodeFirst(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                     std::shared_ptr<router::Ticket> ticket, std::string base, int attempt,
                     Tried tried);
    void Send(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
              std::shared_ptr<router::Ticket> ticket, const std::string& base, int attempt,
              const router::PushPlan& plan, Tried tried);
    // The remote prefill of `pr` (no kv params yet) failed with `st` before anything was sent
    // to the client: another prefill worker gets it (at most kMaxAttempts in all, none tried
    // before), or with none left and --kv-load-failure recompute it is prefilled here. False:
    // neither, the request ends with `st`.
    bool Failover(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                  const std::string& base, int attempt, const Tried& tried, const Status& st);
    // The prefill worker of `ticket` did not answer a call in time.
    void TimedOut(const router::Ticket& ticket);

    static constexpr int kMaxAttempts = 3;

    OpenAiServer::Impl& m_;
    std::shared_ptr<router::Router> router_;
    std::atomic<uint64_t> retried_{0}, fallbacks_{0};
};

}  // namespace ferry::serve
