// The shared connection code of the stream backends (tcp, shm): listening and accepting (with
// bounds on unauthenticated handshakes, per source and in all), dialing, the set of live
// connections, handshake timeouts and the periodic check for stalled frames. The frames
// themselves are Connection's; what a request does is the ConnectionOwner's (the agent).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "transfer/backend.h"
#include "transfer/connection.h"
#include "transfer/io_loop.h"

namespace ferry::internal {

class StreamLinks {
  public:
    static constexpr size_t kMaxHandshakingPerSource = 64;
    static constexpr size_t kMaxHandshaking = 1024;
    static constexpr size_t kReceiveBudget = 256u << 20;
    static constexpr auto kHandshakeTimeout = std::chrono::seconds(10);
    static constexpr int kStallCheckEveryTicks = 25;

    struct Identity {
        std::string name;
        uint64_t epoch = 0;
        std::string secret;
        // Read by the peer in the shm handshake to prove it may attach to this process.
        const uint64_t* cma_probe = nullptr;
    };
    // `next_loop` spreads connections over the agent's I/O loops; `owner` serves their requests.
    StreamLinks(Identity identity, std::function<IoLoop*()> next_loop, ConnectionOwner* owner);
    ~StreamLinks();

    // Accepts connections on `listener` (watched on `loop`) for `backend`.
    Status Listen(Backend* backend, ScopedFd listener, IoLoop* loop);
    // A new client connection (its handshake under way). Cancelled once shut down.
    Result<std::shared_ptr<Connection>> Dial(Backend& backend, std::string_view address,
                                             const std::string& label, wire::Purpose purpose,
                                             uint64_t expect_epoch);
    // The handshake of `conn` ended (ready or closed): it leaves the handshake bounds.
    void HandshakeOver(const Connection& conn);
    // `conn` closed: forgets it. Returns whether another open connection goes to its process.
    bool Closed(Connection& conn, const Status& why);

    std::vector<std::shared_ptr<Connection>> Snapshot() const;
    // Closes every connection (and refuses new ones) and waits until each is closed.
    void CloseAll(const Status& why);
    // Drops the listeners and their acceptors (after the loops stopped).
    void ReleaseListeners();
    // Loop 0's tick: closes handshakes past kHandshakeTimeout; every kStallCheckEveryTicks, each
    // loop checks its connections for a frame stalled past `stalled_frame_timeout`.
    void Tick(Clock::time_point now, std::chrono::milliseconds stalled_frame_timeout);

    uint64_t handshakes_refused() const { return handshakes_refused_.load(); }
    uint64_t stalled_frames_dropped() const { return stalled_frames_dropped_.load(); }
    size_t handshakes_pending() const;
    const ReceiveBudget& receive_budget() const { return *receive_budget_; }
    const WireCounters& wire_counters() const { return *wire_counters_; }

  private:
    class Acceptor;
    void Accept(Backend* backend, ScopedFd fd);
    void Track(const std::shared_ptr<Connection>& c);

    const Identity id_;
    const std::function<IoLoop*()> next_loop_;
    ConnectionOwner* const owner_;
    const std::shared_ptr<ReceiveBudget> receive_budget_;
    const std::shared_ptr<WireCounters> wire_counters_ = std::make_shared<WireCounters>();

    std::vector<ScopedFd> listeners_;
    std::vector<std::shared_ptr<EventHandler>> acceptors_;

    mutable std::mutex mu_;
    bool closed_ = false;  // under mu_
    std::set<std::shared_ptr<Connection>> conns_;
    // Accepted connections still in their handshake, by source (under mu_): bounded per source
    // and in all, so strangers cannot hold many sockets or buffers.
    std::map<const Connection*, std::string> handshaking_;
    std::map<std::string, size_t, std::less<>> handshaking_by_source_;
    std::atomic<uint64_t> handshakes_refused_{0};
    std::atomic<uint64_t> stalled_frames_dropped_{0};
    uint64_t ticks_ = 0;  // loop 0
};

}  // namespace ferry::internal
