// Decode-first (Dynamo style): a decode worker sends long prompts to prefill workers, which push
// the KV back, and dispatches them here; the prefill workers are routed among as a proxy routes
// (router::Router), those that timed out wait in the server's quarantine, and
// /add_remote_prefill_eps adds more. Part of OpenAiServer (openai_server_parts.h).
#pragma once

#include <memory>
#include <string>

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
    // Sends the prompt to the prefill worker `ticket` routed it to, to prefill and push here,
    // then dispatches locally under `base` (the request's id). A first attempt whose prefill
    // worker turns out unreachable (it restarted: the agent it had is gone) asks it again where
    // its agent is and tries once more. The ticket ends with the prefill worker's answer.
    void DecodeFirst(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                     std::shared_ptr<router::Ticket> ticket, std::string base, int attempt = 0);
    void Send(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
              std::shared_ptr<router::Ticket> ticket, const std::string& base, int attempt,
              const router::PushPlan& plan);
    // The prefill worker of `ticket` did not answer a call in time.
    void TimedOut(const router::Ticket& ticket);

    OpenAiServer::Impl& m_;
    std::shared_ptr<router::Router> router_;
};

}  // namespace ferry::serve
