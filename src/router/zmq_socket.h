// ZeroMQ sockets as ferry's KV-event publisher (serve/kv_events.h) and follower
// (router/kv_index.h) use them: bounded, and read a whole message at a time without blocking.
// What the frames hold is schema/kv_events.h's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry::router {

// Sets ZMQ_MAXMSGSIZE on `socket` (a peer that declares more is disconnected by libzmq before
// anything is allocated for it) and ZMQ_LINGER 0 (nothing waits at close).
void BoundZmqSocket(void* socket, int64_t max_message_bytes);

// The frames of the next message waiting on `socket` (at most `max` kept, the rest read and
// dropped); empty when none is waiting.
std::vector<std::string> ReceiveZmqFrames(void* socket, size_t max = 8);

}  // namespace ferry::router
