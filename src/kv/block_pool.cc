#include "kv/block_pool.h"

#include <fmt/core.h>

#include <algorithm>
#include <cassert>

namespace ferry::kv {

KvBlockPool::KvBlockPool(int num_blocks, int block_tokens, bool prefix_caching, BlockHash root)
    : block_tokens_(block_tokens),
      prefix_caching_(prefix_caching),
      root_(root),
      blocks_(num_blocks) {
    for (BlockId b = 0; b < num_blocks; ++b) {
        blocks_[b].free_it = free_.insert(free_.end(), b);
        blocks_[b].in_free = true;
    }
}

std::vector<BlockId> KvBlockPool::AcquireCachedPrefix(std::span<const int32_t> tokens,
                                                      size_t max_blocks,
                                                      std::vector<BlockHash>* hashes,
                                                      std::span<const MmSpan> mm) {
    std::vector<BlockId> out;
    hashes->clear();
    if (!prefix_caching_) return out;
    BlockHash parent = root_;
    size_t full = std::min(tokens.size() / block_tokens_, max_blocks);
    for (size_t i = 0; i < full; ++i) {
        auto chunk = tokens.subspan(i * block_tokens_, block_tokens_);
        const int64_t start = static_cast<int64_t>(i) * block_tokens_;
        const BlockHash h =
            HashBlockTokens(parent, chunk, MmExtraKeys(mm, start, start + block_tokens_));
        auto it = by_hash_.find(h);
        if (it == by_hash_.end()) break;
        Block& b = blocks_[it->second];
        if (b.parent != parent ||
            !std::equal(chunk.begin(), chunk.end(), b.tokens.begin(), b.tokens.end())) {
            break;
        }
        if (b.refs++ == 0 && b.in_free) {
            free_.erase(b.free_it);
            b.in_free = false;
        }
        out.push_back(it->second);
        hashes->push_back(h);
        parent = h;
    }
    return out;
}

Result<std::vector<BlockId>> KvBlockPool::Allocate(int n) {
    if (n < 0 || n > num_free()) {
        return ResourceExhaustedError(
            fmt::format("kv cache: {} blocks wanted, {} free of {}", n, num_free(), num_blocks()));
    }
    std::vector<BlockId> out;
    out.reserve(n);
    for (int i = 0; i < n; ++i) {
        BlockId b = free_.front();
        free_.pop_front();
        Block& blk = blocks_[b];
        blk.in_free = false;
        if (blk.cached) Uncache(b);
        blk.refs = 1;
        out.push_back(b);
    }
    return out;
}

void KvBlockPool::Free(std::span<const BlockId> blocks) {
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
        Block& b = blocks_[*it];
        assert(b.refs > 0);
        if (--b.refs == 0) {
            // Uncached blocks are reused first; cached ones queue behind them in LRU order.
            b.free_it =
                b.cached ? free_.insert(free_.end(), *it) : free_.insert(free_.begin(), *it);
            b.in_free = true;
        }
    }
}

void KvBlockPool::Cache(BlockId block, const BlockHash& hash, const BlockHash& parent,
                        std::span<const int32_t> tokens) {
    if (!prefix_caching_) return;
    Block& b = blocks_[block];
    if (b.cached || by_hash_.count(hash)) return;
    b.cached = true;
    b.hash = hash;
    b.parent = parent;
    b.tokens.assign(tokens.begin(), tokens.end());
    by_hash_[hash] = block;
    if (!record_events_) return;
    if (!events_.empty() && events_.back().kind == schema::KvCacheEvent::Kind::kStored &&
        events_.back().hashes.back() == parent) {
        events_.back().hashes.push_back(hash);  // the next block of the same chain
        events_.back().tokens.insert(events_.back().tokens.end(), tokens.begin(), tokens.end());
        return;
    }
    schema::KvCacheEvent e;
    e.kind = schema::KvCacheEvent::Kind::kStored;
    e.hashes.push_back(hash);
    if (parent != root_) e.parent = parent;
    e.tokens.assign(tokens.begin(), tokens.end());
    events_.push_back(std::move(e));
}

void KvBlockPool::Uncache(BlockId b) {
    Block& blk = blocks_[b];
    by_hash_.erase(blk.hash);
    blk.cached = false;
    blk.tokens.clear();
    if (!record_events_) return;
    if (events_.empty() || events_.back().kind != schema::KvCacheEvent::Kind::kRemoved) {
        events_.push_back({schema::KvCacheEvent::Kind::kRemoved, {}, std::nullopt, {}});
    }
    events_.back().hashes.push_back(blk.hash);
}

void KvBlockPool::ResetCache() {
    const bool record = record_events_;
    record_events_ = false;  // one AllBlocksCleared, not a removal per block
    for (BlockId b = 0; b < num_blocks(); ++b) {
        if (blocks_[b].cached) Uncache(b);
    }
    record_events_ = record;
    if (record_events_)
        events_.push_back({schema::KvCacheEvent::Kind::kAllCleared, {}, std::nullopt, {}});
}

std::vector<schema::KvCacheEvent> KvBlockPool::TakeEvents() {
    std::vector<schema::KvCacheEvent> out;
    out.swap(events_);
    return out;
}

}  // namespace ferry::kv
