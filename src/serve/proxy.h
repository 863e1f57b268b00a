// `ferry proxy`: the OpenAI API in front of prefill and decode workers. Each completion request
// is routed and driven by the router library (src/router: the worker set and its policy, the pull
// and push drivers of docs/disaggregation.md); this adds the HTTP front: the routes, /health,
// /metrics, and what any worker answers alike (/v1/models, /tokenize, /detokenize, from the first
// decode worker).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "ferry/status.h"
#include "http/http.h"
#include "model/tokenizer.h"
#include "router/protocol.h"
#include "router/router.h"

namespace ferry::serve {

struct ProxyConfig {
    std::string host = "127.0.0.1";
    int port = 8000;
    // Workers given as flags (their OpenAI servers); with a store, also those registered there
    // (router/membership.h), so that a proxy with a store needs none.
    std::vector<http::Endpoint> prefill;
    std::vector<http::Endpoint> decode;
    // Encode workers (EPD, router/driver.h): chat requests with images go to one first.
    std::vector<http::Endpoint> encode;
    router::Protocol protocol = router::Protocol::kPull;
    // A worker call not answered by then fails the request (504).
    // The deadlines of the calls to workers (router::DriverConfig).
    std::chrono::milliseconds worker_timeout{600000};
    std::chrono::milliseconds prefill_timeout{60000};
    std::chrono::milliseconds encode_timeout{10000};
    std::chrono::milliseconds agent_timeout{5000};
    int io_threads = 0;
    size_t max_body_bytes = 16u << 20;
    std::chrono::milliseconds request_deadline{10000};
    std::unique_ptr<router::RoutingPolicy> policy;         // prefill's; null: round robin
    std::unique_ptr<router::RoutingPolicy> decode_policy;  // null: the same as policy
    // The model the workers serve: store records of another are ignored ("": the first found).
    std::string model;
    // How often each worker's /metrics is read for its load (router/membership.h).
    std::chrono::milliseconds load_poll{250};
    // The P/D decision (router/driver.h): skip the prefill worker when the decode worker lacks
    // fewer than this many prompt tokens (0: never).
    int pd_min_uncached_tokens = 16;
    // The workers' tokenizer: text prompts and chat messages are scored by a cache-aware policy
    // and the P/D decision too (router/driver.h). Null: only token-id prompts are.
    std::shared_ptr<const model::Tokenizer> tokenizer = {};
    // The deployment's router token (RouterToken of its secret): sent to the workers on every
    // call ("Authorization: Bearer ..."); workers with a secret honour kv_transfer_params only
    // with it. "" = none.
    std::string router_token;
    // The discovery store the workers register in ("" = none): a prefill worker's agent is
    // found in its record there (ferry/workers/HOST:PORT) before the proxy asks the worker.
    std::string store_url;
    std::string store_secret;
};

class Proxy {
  public:
    // InvalidArgument without workers of each kind and without a store; Unavailable if the port
    // cannot be bound. With a store and no worker yet, requests get 503 until one registers.
    static Result<std::unique_ptr<Proxy>> Start(ProxyConfig config);
    ~Proxy();
    int port() const;
    void Stop();

    struct Impl;

  private:
    explicit Proxy(std::shared_ptr<Impl> impl);
    std::shared_ptr<Impl> impl_;
};

}  // namespace ferry::serve
