// Where the KV of (layer, K|V, block, head, token slot) lives in one rank's cache allocation, and
// the transfer planner that turns "these tokens of these blocks, these layers, these heads" into
// as few descriptor pairs as the layout allows (DESIGN "Layouts"):
// - a run of block ids adjacent on both sides is one run of bytes per layer and K/V;
// - that run at every layer and K/V is one strided descriptor (stride: one layer's tensor);
// - a head slice of a run of blocks is one strided descriptor (stride: one block);
// - a partial block (the tail of a chunk) is one strided descriptor over its heads;
// - with different block sizes on the two sides, a piece that lies in one block of each side is
//   one strided descriptor over its heads or over its layers and K|V.
// The planner knows nothing of agents or peers: it returns offsets into each side's allocation
// (the connector adds region ids). A latent (MLA) cache has one tensor per layer: the plan moves
// it once, not as K and V.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ferry/status.h"
#include "kv/block_pool.h"
#include "kv/kv_cache.h"

namespace ferry::kv {

// How TP ranks split a model's `heads` kv heads: TP t dividing them gives each rank heads / t of
// its own, [rank * heads / t, (rank + 1) * heads / t); TP a multiple of them (more ranks than kv
// heads) gives each rank one head, replicated on t / heads ranks: rank r holds head
// r / (t / heads), the one its query heads attend to. Other TP sizes cannot split them.
inline bool TpSplitsHeads(int tp, int heads) {
    return tp >= 1 && heads >= 1 && (heads % tp == 0 || tp % heads == 0);
}
inline int RankKvHeads(int tp, int heads) { return tp >= heads ? 1 : heads / tp; }
inline int RankHeadBegin(int rank, int tp, int heads) {
    return tp >= heads ? rank / (tp / heads) : rank * (heads / tp);
}

// One rank's cache as a transfer sees it: its spec and the first global kv head it holds
// (rank r of tp holds heads [r * kv_heads, (r + 1) * kv_heads)).
struct KvLayout {
    KvCacheSpec spec;
    int head_begin = 0;

    size_t RowBytes() const { return size_t(spec.head_dim) * KvDtypeSize(spec.dtype); }
    size_t TensorOffset(int layer, bool v) const {
        return spec.Plane(layer, v) * spec.TensorBytes();
    }
    // Offset of (layer, K|V, block, local head, token slot) in the allocation.
    size_t Offset(int layer, bool v, BlockId block, int head, int slot) const {
        return TensorOffset(layer, v) + size_t(block) * spec.BlockBytes() +
               size_t(head) * spec.HeadBytes() + size_t(slot) * RowBytes();
    }
};

// A strided byte range of one side: `count` runs of `length` bytes, `stride` apart, from
// `offset` (the shape of ferry::Descriptor, without the region).
struct KvSpan {
    uint64_t offset = 0;
    uint64_t length = 0;
    uint64_t stride = 0;
    uint64_t count = 1;
    uint64_t TotalBytes() const { return length * count; }
    bool operator==(const KvSpan&) const = default;
};

// Pairs of spans that move the same bytes: local[i] expands to the same run lengths as
// remote[i].
struct KvPlan {
    std::vector<KvSpan> local;
    std::vector<KvSpan> remote;
    uint64_t bytes = 0;
};

struct KvMove {
    // Block tables of the sequence on each side: block i holds tokens [i * bt, (i + 1) * bt).
    std::span<const BlockId> local_blocks;
    std::span<const BlockId> remote_blocks;
    // Tokens [token_begin, token_end) move; whole blocks when the range is block-aligned (or
    // ends at a block's end), only the slots in the range otherwise.
    int token_begin = 0;
    int token_end = 0;
    // Layers [layer_begin, layer_end); layer_end < 0 means all.
    int layer_begin = 0;
    int layer_end = -1;
    // Global kv heads [head_begin, head_end); head_end < 0 means the heads both sides hold.
    int head_begin = 0;
    int head_end = -1;
};

// Plans `move` between `local` and `remote`. The block sizes may differ (any two sizes: the
// range is cut where either side's block ends). InvalidArgument when the two layouts cannot
// exchange KV (layers, head dim or dtype differ), when the head range is not held by both sides,
// or when a block table is too short for the token range or names a block outside its cache.
Result<KvPlan> PlanKvMove(const KvLayout& local, const KvLayout& remote, const KvMove& move);

}  // namespace ferry::kv
