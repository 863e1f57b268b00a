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
#include "router/driver.h"
#include "router/membership.h"
#include "router/protocol.h"
#include "router/router.h"
#include "tokenizer/tokenizer.h"

namespace ferry::serve {

// The proxy's own settings beside the router's, which it nests rather than copies: each default
// is written once, in the struct that uses it (`ferry proxy`'s flags read theirs from here).
struct ProxyConfig {
    std::string host = "127.0.0.1";
    int port = 8000;
    // Workers given as flags (their OpenAI servers); with a store, also those registered there
    // (router/membership.h), so that a proxy with a store needs none. Encode workers (EPD) are
    // the driver's (driver.encode).
    std::vector<http::Endpoint> prefill;
    std::vector<http::Endpoint> decode;
    int io_threads = 0;
    size_t max_body_bytes = 16u << 20;
    std::chrono::milliseconds request_deadline{10000};
    // The discovery store the workers register in ("" = none): a prefill worker's agent is
    // found in its record there (ferry/workers/HOST:PORT) before the proxy asks the worker.
    std::string store_url;
    std::string store_secret;
    // How each request is driven (router/driver.h): the protocol, the deadlines of the calls to
    // workers, the router token, the P/D decision, the tokenizer, the encode workers. The proxy
    // fills in `store_encoders`.
    router::DriverConfig driver;
    // The worker set (router/router.h): the policies. The proxy fills in the agent directory
    // and the KV index from the store.
    router::RouterConfig routing;
    // Membership from the store (router/membership.h): the model and the load poll. The proxy
    // fills in the directory, the KV index and the encoder set.
    router::MembershipConfig membership;
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
