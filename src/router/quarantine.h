// Workers that timed out on a call, kept out of routing until they answer again.
//
// A worker that does not answer within a call's deadline (stopped, wedged, a black hole) would
// cost every request sent to it that deadline. The caller adds it here; readers (Filter,
// Contains) then leave it out, and each read probes the workers whose probe is due (GET /health
// within `probe_timeout`, at most one in flight a worker, one every `probe_every`): a worker
// whose probe gets any HTTP answer is out of quarantine, and its `on_back` runs. Probing is lazy:
// no thread, no timer; a read never waits for a probe.
//
// Thread-safe. The probes run on the caller's http::Client; their callbacks hold only the
// quarantine's shared state, so the Quarantine may be destroyed (or the client) at any time.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "http/http.h"

namespace ferry::router {

struct QuarantineConfig {
    std::chrono::milliseconds probe_every{1000};
    std::chrono::milliseconds probe_timeout{1000};
};

class Quarantine {
  public:
    // `client` must outlive every read (probes are sent on it).
    explicit Quarantine(http::Client* client, QuarantineConfig config = {});
    ~Quarantine();
    Quarantine(const Quarantine&) = delete;
    Quarantine& operator=(const Quarantine&) = delete;

    // `ep` timed out: out until it answers a probe; then `on_back` runs (on an I/O thread).
    // Adding one already in quarantine keeps its first `on_back`.
    void Add(const http::Endpoint& ep, std::function<void()> on_back = nullptr);
    // Whether `ep` is in quarantine (and probes what is due).
    bool Contains(const http::Endpoint& ep);
    // Those of `eps` not in quarantine, in order (and probes what is due).
    std::vector<http::Endpoint> Filter(const std::vector<http::Endpoint>& eps);
    size_t size() const;
    // Workers put in quarantine so far, and taken out.
    uint64_t added() const;
    uint64_t released() const;

    struct State;

  private:
    std::shared_ptr<State> state_;
};

}  // namespace ferry::router
