// FaultyBackend: wraps any backend and injects faults a test turns on and off while transfers run:
// stall, delay, drop, fail after N bytes, corrupt. Tests get the network's failure modes in one
// process, without root or namespaces (tests/netns keeps the real-network ones).
//
//   auto faults = std::make_shared<FaultPlan>();
//   FaultInjection inject("tcp", faults);       // agents created now get a faulty tcp
//   auto a = Agent::Create(...);
//   faults->stall = true;                       // nothing crosses any more ...
//
// A stream backend's dialed connections run through a relay (a socket pair and a thread per
// connection, in the dialing process): the agent talks to one end, the relay forwards between the
// other end and the real socket and applies the plan. Listening and accepting are the wrapped
// backend's own. A backend with its own data path (ucx) is wrapped at its calls: Post is held
// (stall), delayed, failed (drop, fail after N bytes) before the backend sees it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "transfer/backend.h"

namespace ferry::testing {

struct FaultPlan {
    // Forward nothing (in either direction, or post nothing) until cleared. A relay still notices
    // a side that closes.
    std::atomic<bool> stall{false};
    // Each forwarded piece, or each posted batch, waits this long first.
    std::atomic<int> delay_ms{0};
    // Closes every connection once this many bytes crossed in all (Relayed() counts them; own
    // data path: the bytes of posted chunks), and refuses what would cross after it. < 0: off.
    std::atomic<int64_t> fail_after_bytes{-1};
    // Flips every bit of the next byte forwarded from the target to the initiator (a stream
    // only), then clears itself.
    std::atomic<bool> corrupt_next{false};

    // Closes every connection now (streams), or fails what is posted and drops the peers (own
    // data path); later dials and posts go through.
    void Drop() { drops.fetch_add(1); }

    uint64_t Relayed() const { return relayed.load(); }
    int Connections() const { return connections.load(); }

    // The relays' and the wrapper's bookkeeping.
    std::atomic<uint64_t> relayed{0};
    std::atomic<int> connections{0};
    std::atomic<uint64_t> drops{0};
};

// Wraps `inner` (keeping its name and capabilities).
std::unique_ptr<Backend> MakeFaultyBackend(std::unique_ptr<Backend> inner,
                                           std::shared_ptr<FaultPlan> plan);

// While alive, every agent created gets backend `name` wrapped with `plan`.
class FaultInjection {
  public:
    FaultInjection(const std::string& name, std::shared_ptr<FaultPlan> plan)
        : guard_(name, [plan](std::unique_ptr<Backend> b) {
              return MakeFaultyBackend(std::move(b), plan);
          }) {}

  private:
    BackendWrapGuard guard_;
};

}  // namespace ferry::testing
