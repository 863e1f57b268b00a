// The block pool of a paged KV cache, with automatic prefix caching (vLLM's design): a full block
// is identified by a hash chained over the token ids of every block up to it (vLLM's reproducible
// sha256_cbor form from a seed's root, core/block_hash.h, so a router recomputes it); a finished
// sequence's blocks go back to the free list still holding their contents and stay findable by
// hash until they are reused (least recently freed first). A hit also compares the token ids and
// the parent hash, so a hash collision can never hand out the wrong KV.
//
// Not thread-safe: the engine's scheduler owns it.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/block_hash.h"
#include "ferry/status.h"
#include "schema/kv_event.h"

namespace ferry::kv {

using BlockId = int32_t;

class KvBlockPool {
  public:
    KvBlockPool(int num_blocks, int block_tokens, bool prefix_caching,
                BlockHash root = RootBlockHash("0"));
    const BlockHash& root() const { return root_; }

    int num_blocks() const { return static_cast<int>(blocks_.size()); }
    int block_tokens() const { return block_tokens_; }
    bool prefix_caching() const { return prefix_caching_; }
    // Blocks that can be allocated now (free, whether or not they still hold cached contents).
    int num_free() const { return static_cast<int>(free_.size()); }
    int num_used() const { return num_blocks() - num_free(); }
    int num_cached() const { return static_cast<int>(by_hash_.size()); }

    // Takes a reference on the longest run of cached blocks that hold the full blocks of
    // `tokens`, at most `max_blocks` of them; returns them in order and fills `hashes` with their
    // hashes. `mm`: the multimodal inputs of the prompt (their hashes are the blocks' extra keys).
    std::vector<BlockId> AcquireCachedPrefix(std::span<const int32_t> tokens, size_t max_blocks,
                                             std::vector<BlockHash>* hashes,
                                             std::span<const MmSpan> mm = {});
    // `n` fresh blocks (each with one reference), evicting cached ones as needed;
    // ResourceExhausted (and nothing taken) if fewer than `n` are free.
    Result<std::vector<BlockId>> Allocate(int n);
    // Drops one reference on each block. Blocks are released last-first so that a sequence's
    // tail is evicted before its head.
    void Free(std::span<const BlockId> blocks);
    // Records that `block` now holds the full block `tokens` whose chained hash is `hash`
    // (parent hash `parent`: the root for a prompt's first block). If another block already
    // holds that content, nothing changes.
    void Cache(BlockId block, const BlockHash& hash, const BlockHash& parent,
               std::span<const int32_t> tokens);
    // Forgets every cached block (contents can no longer be trusted, e.g. after a failed load).
    void ResetCache();

    // Events: off until asked for. Consecutive stores of one chain merge into one event, as
    // consecutive removals do.
    void set_record_events(bool on) { record_events_ = on; }
    std::vector<schema::KvCacheEvent> TakeEvents();

    int refcount(BlockId b) const { return blocks_[b].refs; }

  private:
    struct Block {
        int refs = 0;
        bool cached = false;
        BlockHash hash{};
        BlockHash parent{};
        std::vector<int32_t> tokens;
        std::list<BlockId>::iterator free_it;
        bool in_free = false;
    };
    void Uncache(BlockId b);

    int block_tokens_;
    bool prefix_caching_;
    BlockHash root_;
    std::vector<Block> blocks_;
    std::list<BlockId> free_;  // front = next to reuse
    std::unordered_map<BlockHash, BlockId, BlockHashKey> by_hash_;
    bool record_events_ = false;
    std::vector<schema::KvCacheEvent> events_;
};

}  // namespace ferry::kv
