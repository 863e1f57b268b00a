// The disaggregation proxy (router): serves the OpenAI API in front of prefill and decode
// workers and drives one of the protocols of docs/disaggregation.md for every request:
//
// pull (vLLM's NixlConnector protocol, as vLLM's toy_proxy_server does it): the request goes to
//   a prefill worker with kv_transfer_params {do_remote_decode: true}, max_tokens 1, not
//   streamed; the kv_transfer_params of its answer go with the original request to a decode
//   worker, whose answer (streamed or whole) is relayed to the client.
// push (layer-wise): the request goes to a prefill and a decode worker at once, under a transfer
//   id; the decode worker names its blocks to the prefill worker, which writes each layer into
//   them; the decode worker's answer is relayed.
//
// Event-driven (src/http): a few I/O threads relay any number of streams; no thread waits on a
// worker. A client that leaves cancels its worker calls (the workers then abort and free their
// blocks). Worker choice is a RoutingPolicy (round robin here). push: a prefill worker whose
// agent moved (it restarted) makes the decode worker answer 503 before any token; the proxy then
// asks the prefill worker where its agent is now and tries once more.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "ferry/status.h"
#include "http/http.h"
#include "kv/connector.h"

namespace ferry::serve {

// Picks the worker of each kind for a request. Called from I/O threads: thread-safe.
class RoutingPolicy {
  public:
    virtual ~RoutingPolicy() = default;
    virtual size_t PickPrefill(const http::Request& r, size_t n) = 0;
    virtual size_t PickDecode(const http::Request& r, size_t n) = 0;
};
std::unique_ptr<RoutingPolicy> MakeRoundRobin();

struct ProxyConfig {
    std::string host = "127.0.0.1";
    int port = 8000;
    std::vector<http::Endpoint> prefill;  // their OpenAI servers
    std::vector<http::Endpoint> decode;
    kv::KvTransferMode mode = kv::KvTransferMode::kPull;
    // A worker call not answered by then fails the request (504).
    std::chrono::milliseconds worker_timeout{600000};
    int io_threads = 0;
    size_t max_body_bytes = 16u << 20;
    std::chrono::milliseconds request_deadline{10000};
    std::unique_ptr<RoutingPolicy> policy;  // null: round robin
    // The deployment's router token (RouterToken of its secret): sent to the workers on every
    // call ("Authorization: Bearer ..."); workers with a secret honour kv_transfer_params only
    // with it. "" = none.
    std::string router_token;
};

class Proxy {
  public:
    // InvalidArgument without workers of each kind; Unavailable if the port cannot be bound.
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
