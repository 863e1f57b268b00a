#include "kv/block_pool.h"

#include <gtest/gtest.h>

#include "kv/kv_cache.h"
#include "testing/testing.h"

namespace ferry::kv {
namespace {

using ::ferry::testing::StatusHas;

std::vector<int32_t> Tokens(int n, int salt) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back(i * 7 + salt);
    return t;
}

// Caches the full blocks of `tokens` held in `blocks`.
void CacheAll(KvBlockPool* pool, const std::vector<BlockId>& blocks,
              const std::vector<int32_t>& tokens) {
    BlockHash parent = pool->root();
    const int bt = pool->block_tokens();
    for (size_t b = 0; (b + 1) * bt <= tokens.size(); ++b) {
        auto chunk = std::span(tokens).subspan(b * bt, bt);
        const BlockHash h = HashBlockTokens(parent, chunk);
        pool->Cache(blocks[b], h, parent, chunk);
        parent = h;
    }
}

TEST(KvBlockPool, AllocatesAndRefusesBeyondCapacity) {
    KvBlockPool pool(8, 4, true);
    auto a = pool.Allocate(5);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(pool.num_free(), 3);
    EXPECT_THAT(pool.Allocate(4).status(),
                StatusHas(Code::kResourceExhausted, "4 blocks wanted, 3 free"));
    EXPECT_EQ(pool.num_free(), 3);  // nothing taken
    pool.Free(*a);
    EXPECT_EQ(pool.num_free(), 8);
}

TEST(KvBlockPool, FindsTheLongestCachedPrefixAndSharesIt) {
    KvBlockPool pool(16, 4, true);
    auto t = Tokens(14, 1);  // 3 full blocks + 2
    auto a = *pool.Allocate(4);
    CacheAll(&pool, a, t);
    pool.Free(a);
    EXPECT_EQ(pool.num_cached(), 3);
    std::vector<BlockHash> hashes;
    auto other = t;
    other[9] = 999;  // differs inside the third block
    auto hit = pool.AcquireCachedPrefix(other, SIZE_MAX, &hashes);
    EXPECT_EQ(hit, (std::vector<BlockId>{a[0], a[1]}));
    EXPECT_EQ(hashes.size(), 2u);
    EXPECT_EQ(pool.refcount(a[0]), 1);
    auto again = pool.AcquireCachedPrefix(t, 2, &hashes);  // capped at 2 blocks
    EXPECT_EQ(again.size(), 2u);
    EXPECT_EQ(pool.refcount(a[0]), 2);
    pool.Free(hit);
    pool.Free(again);
}

TEST(KvBlockPool, EvictsLeastRecentlyFreedTailsFirst) {
    KvBlockPool pool(6, 2, true);
    auto t1 = Tokens(6, 1), t2 = Tokens(6, 2);
    auto a = *pool.Allocate(3);
    CacheAll(&pool, a, t1);
    auto b = *pool.Allocate(3);
    CacheAll(&pool, b, t2);
    pool.Free(a);  // a's blocks: tail, middle, head queue up first
    pool.Free(b);
    auto fresh = *pool.Allocate(1);  // evicts a's tail
    EXPECT_EQ(fresh[0], a[2]);
    std::vector<BlockHash> hashes;
    EXPECT_EQ(pool.AcquireCachedPrefix(t1, SIZE_MAX, &hashes).size(), 2u);
    EXPECT_EQ(pool.AcquireCachedPrefix(t2, SIZE_MAX, &hashes).size(), 3u);
}

TEST(KvBlockPool, AHashCollisionIsNotAHit) {
    KvBlockPool pool(4, 2, true);
    auto t = Tokens(2, 1);
    auto a = *pool.Allocate(1);
    const BlockHash h = HashBlockTokens(pool.root(), t);
    std::vector<int32_t> liar = {5, 6};
    pool.Cache(a[0], h, pool.root(), liar);  // recorded under t's hash with other tokens
    pool.Free(a);
    std::vector<BlockHash> hashes;
    EXPECT_TRUE(pool.AcquireCachedPrefix(t, SIZE_MAX, &hashes).empty());
}

// Its hashes are the reproducible ones (core/block_hash.h) from the pool's seed, and what changes
// in the cache comes out as vLLM's events: one BlockStored per chain (the first block's parent
// none), one BlockRemoved per run of evictions, AllBlocksCleared on a reset.
TEST(KvBlockPool, HashesAreTheSeedsChainAndChangesAreEvents) {
    KvBlockPool pool(6, 2, true, RootBlockHash("7"));
    pool.set_record_events(true);
    auto t = Tokens(6, 1);
    auto a = *pool.Allocate(3);
    CacheAll(&pool, a, t);
    std::vector<schema::KvCacheEvent> ev = pool.TakeEvents();
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].kind, schema::KvCacheEvent::Kind::kStored);
    EXPECT_EQ(ev[0].hashes, HashFullBlocks(RootBlockHash("7"), t, 2));
    EXPECT_FALSE(ev[0].parent) << "a prompt's first block has no parent (vLLM: None)";
    EXPECT_EQ(ev[0].tokens, t);
    // A later block of the same chain, stored on its own: its parent is named.
    auto longer = Tokens(8, 1);
    auto b = *pool.Allocate(1);
    pool.Cache(b[0], HashBlockTokens(ev[0].hashes.back(), std::span(longer).subspan(6, 2)),
               ev[0].hashes.back(), std::span(longer).subspan(6, 2));
    ev = pool.TakeEvents();
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].parent, std::optional<BlockHash>(HashFullBlocks(pool.root(), t, 2).back()));
    EXPECT_EQ(ev[0].hashes, std::vector<BlockHash>{HashFullBlocks(pool.root(), longer, 2)[3]});
    pool.Free(a);
    pool.Free(b);
    auto fresh = *pool.Allocate(6);  // evicts every cached block
    ev = pool.TakeEvents();
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].kind, schema::KvCacheEvent::Kind::kRemoved);
    EXPECT_EQ(ev[0].hashes.size(), 4u);
    pool.ResetCache();
    ev = pool.TakeEvents();
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].kind, schema::KvCacheEvent::Kind::kAllCleared);
    EXPECT_TRUE(pool.TakeEvents().empty());
}

TEST(KvBlockPool, DisabledPrefixCachingNeverHits) {
    KvBlockPool pool(4, 2, false);
    auto t = Tokens(4, 1);
    auto a = *pool.Allocate(2);
    CacheAll(&pool, a, t);
    pool.Free(a);
    std::vector<BlockHash> hashes;
    EXPECT_TRUE(pool.AcquireCachedPrefix(t, SIZE_MAX, &hashes).empty());
}

TEST(KvCache, HeadMajorLayoutAndDtypeRoundTrip) {
    KvCacheSpec spec{.num_layers = 2,
                     .kv_heads = 3,
                     .head_dim = 4,
                     .block_tokens = 2,
                     .num_blocks = 5,
                     .dtype = KvDtype::kF16};
    auto cache = std::move(KvCache::Create(spec)).value();
    EXPECT_EQ(spec.HeadBytes(), 2u * 4 * 2);
    EXPECT_EQ(spec.BlockBytes(), 3 * spec.HeadBytes());
    EXPECT_EQ(cache->memory().size(), spec.TotalBytes());
    // Layer 1's V, block 3, head 2 sits where the layout says.
    EXPECT_EQ(cache->Offset(1, true, 3, 2),
              (1 * 2 + 1) * spec.TensorBytes() + 3 * spec.BlockBytes() + 2 * spec.HeadBytes());
    float rows[8] = {1, 2, 3, 4, 0.5f, -0.25f, 8, 16};
    cache->Store(1, true, 3, 2, 0, 2, rows, 4);
    float back[8];
    cache->Load(1, true, 3, 2, 2, back);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(back[i], rows[i]);
    EXPECT_THAT(KvCache::Create(KvCacheSpec{}).status(),
                StatusHas(Code::kInvalidArgument, "must all be positive"));
    EXPECT_THAT(ParseKvDtype("int4").status(), StatusHas(Code::kInvalidArgument, "'int4'"));
}

}  // namespace
}  // namespace ferry::kv
