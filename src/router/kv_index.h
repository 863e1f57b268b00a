// What the router knows of its workers' prefix caches: the blocks each holds, from its KV events
// (serve/kv_events.h, vLLM's wire format), and the follower that keeps that current.
//
// The follower subscribes to each worker's events. It takes a worker's word only while in step
// with it: a worker it has just subscribed to, one whose sequence numbers skip (batches lost) or
// start again (it restarted) is out of step, gets no prefix credit (Router::SetKvInSync), and is
// brought back by a replay of its buffered batches (from 0 for a new or restarted worker, from the
// first missed one for a gap). A replay that cannot cover a gap clears what the router held for
// the worker (it may have missed removals) and goes on from what the replay had: the router may
// then under-credit a worker, never credit it with blocks it no longer holds.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/block_hash.h"
#include "ferry/status.h"
#include "schema/kv_events.h"

namespace ferry::router {

// The blocks each worker ("host:port") holds. Thread-safe.
class KvIndex {
  public:
    explicit KvIndex(size_t max_blocks_per_worker = size_t{1} << 22)
        : max_blocks_(max_blocks_per_worker) {}
    void Apply(const std::string& worker, const std::vector<schema::KvCacheEvent>& events);
    void Clear(const std::string& worker);
    // How many of `hashes`, from the first, the worker holds.
    size_t Matched(const std::string& worker, std::span<const BlockHash> hashes) const;
    size_t Blocks(const std::string& worker) const;
    uint64_t overflows() const;

  private:
    size_t max_blocks_;
    mutable std::mutex mu_;
    std::unordered_map<std::string, std::unordered_set<BlockHash, BlockHashKey>> by_worker_;
    uint64_t overflows_ = 0;
};

struct KvFollowerStats {
    uint64_t batches = 0, events = 0;
    uint64_t gaps = 0, restarts = 0, replays = 0, cleared = 0;
    uint64_t replays_deferred = 0;  // a gap too soon after a slow replay: cleared instead
    uint64_t malformed = 0, unknown_events = 0;
};

// Where a worker's events are: the PUB endpoint to subscribe to and the replay endpoint.
struct KvEventSource {
    std::string events, replay;
    bool operator==(const KvEventSource&) const = default;
};

class KvEventFollower {
  public:
    // `on_sync(worker, in_sync)`: called from the follower's thread when a worker comes into or
    // falls out of step.
    static std::unique_ptr<KvEventFollower> Start(
        std::shared_ptr<KvIndex> index, std::function<void(const std::string&, bool)> on_sync,
        std::chrono::milliseconds replay_timeout = std::chrono::milliseconds(2000));
    ~KvEventFollower();
    // The workers to follow, by "host:port". A worker no longer named, or whose source changed,
    // is dropped (its blocks cleared).
    void SetWorkers(std::map<std::string, KvEventSource> workers);
    KvFollowerStats Stats() const;

  private:
    struct Worker;
    KvEventFollower() = default;
    void Loop();
    void Apply(Worker& w, uint64_t seq, std::string_view payload);
    bool Replay(Worker& w, uint64_t from);

    std::shared_ptr<KvIndex> index_;
    std::function<void(const std::string&, bool)> on_sync_;
    std::chrono::milliseconds replay_timeout_{2000};
    void* ctx_ = nullptr;
    std::thread thread_;
    mutable std::mutex mu_;
    bool stop_ = false;
    bool changed_ = false;
    std::map<std::string, KvEventSource> wanted_;
    KvFollowerStats stats_;
    std::map<std::string, std::unique_ptr<Worker>> workers_;  // the follower thread's own
};

}  // namespace ferry::router
