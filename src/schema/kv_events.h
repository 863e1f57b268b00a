// KV events on the wire, both ends in one place: vLLM's msgpack batches (the "vllm" layout:
// {"ts", "events", "data_parallel_rank"} with 32-byte hashes; "legacy": array_like structs and
// 64-bit integer hashes, as vLLM's example subscriber decodes), the framing of a ZeroMQ message
// (topic, 8-byte sequence number, payload) and the size bounds on ferry's sockets. The worker's
// publisher (serve/kv_events.h) encodes with it; the router's follower (router/kv_index.h)
// decodes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "schema/kv_event.h"

namespace ferry::schema {

enum class KvEventsLayout { kVllm, kLegacy };
// "vllm" or "legacy"; InvalidArgument naming the choices otherwise.
Result<KvEventsLayout> ParseKvEventsLayout(std::string_view name);

// One batch as msgpack, in `layout`.
std::string EncodeKvEventBatch(double ts, std::span<const KvCacheEvent> events,
                               KvEventsLayout layout, int block_size);

// The events' framing, shared by the publisher (serve/kv_events.h) and the follower: a ZeroMQ
// message of three frames (topic, sequence, payload); the sequence number is 8 bytes big-endian
// (-1: the end of a replay).
std::string KvEventSeqBytes(int64_t seq);
std::optional<int64_t> KvEventSeqOf(std::string_view frame);  // none unless 8 bytes
// What a peer may send one of ferry's ZeroMQ sockets in one frame (ZMQ_MAXMSGSIZE): a peer that
// declares more is disconnected by libzmq before anything is allocated for it. Event batches
// (the router's SUB and replay DEALER) are split by the publisher to stay within the first;
// subscriptions and replay requests (the worker's PUB and ROUTER) are a few bytes. The sockets
// are set so in router/zmq_socket.h.
inline constexpr int64_t kMaxKvEventBatchBytes = 16 << 20;
inline constexpr int64_t kMaxKvEventRequestBytes = 4 << 10;

// One batch's payload in the "vllm" layout (32-byte hashes): each event's kind and hashes (what
// an index needs; a stored block's parent and tokens are not read). InvalidArgument naming what
// is wrong. Events of a type it does not know are skipped (counted in *unknown when given).
Result<std::vector<KvCacheEvent>> DecodeKvEventBatch(std::string_view payload,
                                                     size_t* unknown = nullptr);

}  // namespace ferry::schema
