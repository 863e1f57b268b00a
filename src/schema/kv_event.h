// A change to a worker's prefix cache, as its block pool emits it and as KV events carry it in
// vLLM's wire format (schema/kv_events.h): blocks stored (with their parent and tokens),
// blocks removed, everything cleared.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/block_hash.h"

namespace ferry::schema {

// What changed in the prefix cache (vLLM's KV events: BlockStored, BlockRemoved,
// AllBlocksCleared), in order.
struct KvCacheEvent {
    enum class Kind { kStored, kRemoved, kAllCleared };
    Kind kind = Kind::kStored;
    std::vector<BlockHash> hashes;  // stored or removed, in chain order for stored
    std::optional<BlockHash> parent =
        {};  // stored: the first block's parent; none for a prompt's first
    std::vector<int32_t> tokens = {};  // stored: every block's tokens, in order
};

}  // namespace ferry::schema
