// The block pool of a paged KV cache, with automatic prefix caching (vLLM's design): a full block
// is identified by a hash chained over the token ids of every block up to it; a finished
// sequence's blocks go back to the free list still holding their contents and stay findable by
// hash until they are reused (least recently freed first). A hit also compares the token ids and
// the parent hash, so a hash collision can never hand out the wrong KV.
//
// Not thread-safe: the engine's scheduler owns it.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "ferry/status.h"

namespace ferry::kv {

using BlockId = int32_t;

// Hash of a full block of `tokens` following a block with hash `parent` (0 for the first block).
uint64_t HashBlock(uint64_t parent, std::span<const int32_t> tokens);

class KvBlockPool {
  public:
    KvBlockPool(int num_blocks, int block_tokens, bool prefix_caching);

    int num_blocks() const { return static_cast<int>(blocks_.size()); }
    int block_tokens() const { return block_tokens_; }
    bool prefix_caching() const { return prefix_caching_; }
    // Blocks that can be allocated now (free, whether or not they still hold cached contents).
    int num_free() const { return static_cast<int>(free_.size()); }
    int num_used() const { return num_blocks() - num_free(); }
    int num_cached() const { return static_cast<int>(by_hash_.size()); }

    // Takes a reference on the longest run of cached blocks that hold the full blocks of
    // `tokens`, at most `max_blocks` of them; returns them in order and fills `hashes` with their
    // hashes.
    std::vector<BlockId> AcquireCachedPrefix(std::span<const int32_t> tokens, size_t max_blocks,
                                             std::vector<uint64_t>* hashes);
    // `n` fresh blocks (each with one reference), evicting cached ones as needed;
    // ResourceExhausted (and nothing taken) if fewer than `n` are free.
    Result<std::vector<BlockId>> Allocate(int n);
    // Drops one reference on each block. Blocks are released last-first so that a sequence's
    // tail is evicted before its head.
    void Free(std::span<const BlockId> blocks);
    // Records that `block` now holds the full block `tokens` whose chained hash is `hash`
    // (parent hash `parent`). If another block already holds that content, nothing changes.
    void Cache(BlockId block, uint64_t hash, uint64_t parent, std::span<const int32_t> tokens);
    // Forgets every cached block (contents can no longer be trusted, e.g. after a failed load).
    void ResetCache();

    int refcount(BlockId b) const { return blocks_[b].refs; }

  private:
    struct Block {
        int refs = 0;
        bool cached = false;
        uint64_t hash = 0;
        uint64_t parent = 0;
        std::vector<int32_t> tokens;
        std::list<BlockId>::iterator free_it;
        bool in_free = false;
    };
    void Uncache(BlockId b);

    int block_tokens_;
    bool prefix_caching_;
    std::vector<Block> blocks_;
    std::list<BlockId> free_;  // front = next to reuse
    std::unordered_map<uint64_t, BlockId> by_hash_;
};

}  // namespace ferry::kv
