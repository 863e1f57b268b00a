// KV events in vLLM's wire format, so that KV-aware routers written for vLLM (llm-d's precise
// prefix-cache scorer, Dynamo's KV router, vLLM's own example subscriber) follow a ferry worker's
// prefix cache as they follow a vLLM worker's.
//
// A ZeroMQ PUB socket sends each batch as three frames: the topic, an 8-byte big-endian sequence
// number (0, 1, 2, ... from the worker's start), and the batch as msgpack, exactly as vLLM's
// msgspec structs encode it (vllm/distributed/kv_events.py):
//
//   layout "vllm" (vLLM's current structs; block hashes as the 32 bytes of core/block_hash.h):
//     EventBatch       {"ts": float, "events": [...], "data_parallel_rank": 0}
//     BlockStored      {"type": "BlockStored", "block_hashes": [bin32...],
//                       "parent_block_hash": bin32 | nil, "token_ids": [int...],
//                       "block_size": int, "lora_id": nil, "medium": "GPU", "lora_name": nil,
//                       "group_idx": 0}
//     BlockRemoved     {"type": "BlockRemoved", "block_hashes": [bin32...], "medium": "GPU",
//                       "group_idx": 0}
//     AllBlocksCleared {"type": "AllBlocksCleared"}
//   layout "legacy" (array_like structs and integer hashes, as vLLM's example subscriber
//   decodes them; the integer is the hash's last 8 bytes, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES):
//     [ts, [events...]]; ["BlockStored", [int...], int | nil, [int...], block_size, nil, "GPU"];
//     ["BlockRemoved", [int...], "GPU"]; ["AllBlocksCleared"]
//
// A ZeroMQ ROUTER socket (the replay endpoint) answers a request of an 8-byte big-endian sequence
// number with every buffered batch from it on, each as (sequence, payload), then (-1, empty).
// A subscriber that sees a gap asks for it; one that sees the sequence go back knows the worker
// restarted (its cache is empty again).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ferry/status.h"
#include "kv/block_pool.h"
#include "router/kv_index.h"
#include "schema/kv_events.h"

namespace ferry::serve {

struct KvEventsConfig {
    std::string endpoint;         // PUB: "tcp://*:5557" binds (a '*', "::", ipc:// or inproc://)
                                  // as vLLM does; any other address is connected to, unless
    bool bind = false;            // this says to bind it (one interface: "tcp://10.0.0.5:5557")
    std::string replay_endpoint;  // ROUTER, bound ("" = no replay)
    std::string topic;            // vLLM's default: ""
    schema::KvEventsLayout layout = schema::KvEventsLayout::kVllm;
    int block_size = 16;
    size_t buffer_batches = 10000;  // kept for replay
    size_t max_queue = 100000;      // batches waiting for the publisher thread; more are dropped
    // A batch that encodes larger is sent as two (each with its own sequence number), so that
    // subscribers bounded by ZMQ_MAXMSGSIZE take it (schema::kMaxKvEventBatchBytes).
    size_t max_batch_bytes = size_t(schema::kMaxKvEventBatchBytes);
    // Replay requests served per second (a token bucket of this many, refilled at this rate):
    // each one sends up to the whole buffer, so a client that asks again and again would keep
    // the publisher from the live events. Requests beyond it get no answer (a subscriber's
    // replay times out: it forgets the worker's blocks, never credits stale ones).
    double replays_per_second = 20;
};

struct KvEventsStats {
    uint64_t batches = 0, events = 0, dropped = 0, replays = 0;
    uint64_t replays_refused = 0;  // beyond replays_per_second
};

// The publisher: Publish never blocks (it queues for a thread of its own).
class KvEventPublisher {
  public:
    // Binds (or connects) the sockets: InvalidArgument naming the endpoint that failed.
    static Result<std::unique_ptr<KvEventPublisher>> Start(KvEventsConfig config);
    ~KvEventPublisher();
    void Publish(std::vector<schema::KvCacheEvent> events);
    KvEventsStats Stats() const;
    // Where the sockets are (with the port a "tcp://*:0" endpoint got).
    const std::string& endpoint() const { return bound_endpoint_; }
    // The PUB socket connects to endpoint() (vLLM's rule for an address without '*').
    bool connected() const { return connected_; }
    const std::string& replay_endpoint() const { return bound_replay_; }

  private:
    KvEventPublisher() = default;
    void Loop();
    void ServeReplay();
    void Wake();

    KvEventsConfig config_;
    void* ctx_ = nullptr;
    void* pub_ = nullptr;
    void* replay_ = nullptr;
    std::string bound_endpoint_, bound_replay_;
    bool connected_ = false;
    std::thread thread_;
    int wake_fd_ = -1;  // an eventfd: Publish and the destructor wake the thread's zmq_poll
    mutable std::mutex mu_;
    bool stop_ = false;
    double replay_tokens_ = 0;  // publisher thread only
    std::chrono::steady_clock::time_point replay_refill_;
    std::deque<std::pair<double, std::vector<schema::KvCacheEvent>>> queue_;
    std::deque<std::pair<uint64_t, std::string>> buffer_;  // publisher thread only
    uint64_t next_seq_ = 0;
    KvEventsStats stats_;
};

}  // namespace ferry::serve
