// The OpenAI-compatible HTTP API of a worker: POST /v1/completions and /v1/chat/completions
// (streamed as server-sent events or whole, with usage), GET /v1/models, /health and /metrics
// (Prometheus text). Requests go to an Engine; a client that goes away has its request aborted and
// its KV blocks freed. Bad input gets HTTP 400 with an OpenAI-style error object naming the field.
//
// Thread-safety: Start/Stop from one thread; requests are served on a pool of threads.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "engine/engine.h"
#include "ferry/status.h"

namespace ferry::serve {

struct ServerConfig {
    std::string host = "127.0.0.1";
    int port = 8000;                // 0: any free port (see OpenAiServer::port())
    std::string served_model_name;  // default: the model's name
    int max_connections = 1024;     // concurrent connections (threads)
    size_t max_body_bytes = 16u << 20;
    // A connection must deliver a complete request within this long of connecting or of its
    // previous response, else it is closed (slowloris; discovery/http_guard.h).
    std::chrono::milliseconds request_deadline{10000};
};

class OpenAiServer {
  public:
    // Binds and starts serving in the background. Unavailable if the port cannot be bound.
    static Result<std::unique_ptr<OpenAiServer>> Start(std::shared_ptr<engine::Engine> engine,
                                                       const ServerConfig& config);
    ~OpenAiServer();  // Stop()
    OpenAiServer(const OpenAiServer&) = delete;
    OpenAiServer& operator=(const OpenAiServer&) = delete;

    int port() const;
    const std::string& model_name() const;
    // Stops accepting, ends open streams and joins the server threads.
    void Stop();
    // Blocks until Stop() is called from another thread (or a signal handler's thread).
    void Wait();

  private:
    struct Impl;
    explicit OpenAiServer(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::serve
