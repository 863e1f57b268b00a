// The transfer planner against a reference that copies one token row at a time: every plan must
// move exactly the rows of the range (nothing outside it), and in as few spans as the layout
// allows.
#include "kv/kv_layout.h"

#include <fmt/core.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "testing/testing.h"

namespace ferry::kv {
namespace {

using ::ferry::testing::StatusHas;

KvLayout Layout(int layers, int heads, int head_begin, int blocks, int bt = 4, int hd = 8) {
    KvLayout l;
    l.spec.num_layers = layers;
    l.spec.kv_heads = heads;
    l.spec.head_dim = hd;
    l.spec.block_tokens = bt;
    l.spec.num_blocks = blocks;
    l.spec.dtype = KvDtype::kF32;
    l.head_begin = head_begin;
    return l;
}

std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
    std::vector<uint8_t> v(n);
    std::mt19937 g(seed);
    for (auto& b : v) b = static_cast<uint8_t>(g());
    return v;
}

// Applies `plan` (local -> remote) the way the transfer engine expands descriptors.
void Apply(const KvPlan& plan, const std::vector<uint8_t>& src, std::vector<uint8_t>* dst) {
    ASSERT_EQ(plan.local.size(), plan.remote.size());
    uint64_t bytes = 0;
    for (size_t i = 0; i < plan.local.size(); ++i) {
        const KvSpan& l = plan.local[i];
        const KvSpan& r = plan.remote[i];
        ASSERT_EQ(l.length, r.length);
        ASSERT_EQ(l.count, r.count);
        if (l.count > 1) {
            ASSERT_GE(l.stride, l.length);
            ASSERT_GE(r.stride, r.length);
        }
        for (uint64_t k = 0; k < l.count; ++k) {
            uint64_t lo = l.offset + k * l.stride, ro = r.offset + k * r.stride;
            ASSERT_LE(lo + l.length, src.size());
            ASSERT_LE(ro + r.length, dst->size());
            std::memcpy(dst->data() + ro, src.data() + lo, l.length);
            bytes += l.length;
        }
    }
    EXPECT_EQ(bytes, plan.bytes);
}

// The same move, one token row at a time.
void Reference(const KvLayout& L, const KvLayout& R, const KvMove& m,
               const std::vector<uint8_t>& src, std::vector<uint8_t>* dst) {
    const int lbt = L.spec.block_tokens, rbt = R.spec.block_tokens;
    int l1 = m.layer_end < 0 ? L.spec.num_layers : m.layer_end;
    int h0 = m.head_end < 0 ? std::max(L.head_begin, R.head_begin) : m.head_begin;
    int h1 = m.head_end < 0
                 ? std::min(L.head_begin + L.spec.kv_heads, R.head_begin + R.spec.kv_heads)
                 : m.head_end;
    for (int t = m.token_begin; t < m.token_end; ++t) {
        for (int l = m.layer_begin; l < l1; ++l) {
            for (bool v : {false, true}) {
                for (int h = h0; h < h1; ++h) {
                    std::memcpy(dst->data() + R.Offset(l, v, m.remote_blocks[t / rbt],
                                                       h - R.head_begin, t % rbt),
                                src.data() + L.Offset(l, v, m.local_blocks[t / lbt],
                                                      h - L.head_begin, t % lbt),
                                L.RowBytes());
                }
            }
        }
    }
}

void ExpectSameAsReference(const KvLayout& L, const KvLayout& R, const KvMove& m,
                           size_t* spans = nullptr) {
    auto src = Pattern(L.spec.TotalBytes(), 1);
    auto want = Pattern(R.spec.TotalBytes(), 2);
    auto got = want;
    Reference(L, R, m, src, &want);
    auto plan = PlanKvMove(L, R, m);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    Apply(*plan, src, &got);
    EXPECT_TRUE(got == want) << "tokens [" << m.token_begin << ", " << m.token_end << ")";
    if (spans) *spans = plan->local.size();
}

TEST(KvPlan, AdjacentWholeBlocksAtEveryLayerAreOneStridedSpan) {
    // 4 layers, a 2000-token prompt in 125 blocks of 16: one span pair for all of it.
    KvLayout L = Layout(4, 2, 0, 200, 16, 8), R = Layout(4, 2, 0, 300, 16, 8);
    std::vector<BlockId> lb(125), rb(125);
    std::iota(lb.begin(), lb.end(), 10);
    std::iota(rb.begin(), rb.end(), 70);
    KvMove m{lb, rb, 0, 2000};
    auto plan = PlanKvMove(L, R, m);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    ASSERT_EQ(plan->local.size(), 1u);
    EXPECT_EQ(plan->local[0], (KvSpan{10 * L.spec.BlockBytes(), 125 * L.spec.BlockBytes(),
                                      L.spec.TensorBytes(), 8}));
    EXPECT_EQ(plan->remote[0], (KvSpan{70 * R.spec.BlockBytes(), 125 * R.spec.BlockBytes(),
                                       R.spec.TensorBytes(), 8}));
    EXPECT_EQ(plan->bytes, 2000ull * 4 * 2 * 2 * 8 * 4);
    size_t spans = 0;
    ExpectSameAsReference(L, R, m, &spans);
    EXPECT_EQ(spans, 1u);
}

TEST(KvPlan, FragmentedTablesCostOneSpanPerRunAdjacentOnBothSides) {
    KvLayout L = Layout(2, 2, 0, 32), R = Layout(2, 2, 0, 32);
    std::vector<BlockId> lb = {3, 4, 5, 9, 10, 20};
    std::vector<BlockId> rb = {7, 8, 1, 2, 3, 4};
    size_t spans = 0;
    ExpectSameAsReference(L, R, {lb, rb, 0, 24}, &spans);
    // Runs adjacent on both sides: {3,4}/{7,8}, {5}/{1}, {9,10}/{2,3}, {20}/{4}.
    EXPECT_EQ(spans, 4u);
}

TEST(KvPlan, PartialBlocksMoveOnlyTheirSlots) {
    // A chunk of a chunked prefill: tokens [6, 17) of blocks of 4, so blocks 1 and 4 are partial.
    KvLayout L = Layout(3, 2, 0, 16), R = Layout(3, 2, 0, 16);
    std::vector<BlockId> lb = {0, 1, 2, 3, 4, 5}, rb = {5, 6, 7, 8, 9, 10};
    for (auto [a, b] : std::vector<std::pair<int, int>>{
             {6, 17}, {0, 1}, {3, 4}, {4, 8}, {5, 6}, {0, 24}, {7, 7}}) {
        ExpectSameAsReference(L, R, {lb, rb, a, b});
    }
}

TEST(KvPlan, HeadSlicesAreStridedAcrossBlocks) {
    // Local holds all 4 heads, remote (a TP 2 rank) heads [2, 4): a head slice per block.
    KvLayout L = Layout(2, 4, 0, 16), R = Layout(2, 2, 2, 16);
    std::vector<BlockId> lb = {0, 1, 2, 3}, rb = {4, 5, 6, 7};
    size_t spans = 0;
    ExpectSameAsReference(L, R, {lb, rb, 0, 16}, &spans);
    EXPECT_EQ(spans, 2u * 2);  // one per layer and K/V, each strided over the 4 blocks
    ExpectSameAsReference(L, R, {lb, rb, 2, 13});
    // And the other way, and an explicit single head.
    ExpectSameAsReference(R, L, {rb, lb, 0, 16});
    ExpectSameAsReference(L, R, {lb, rb, 0, 16, 0, -1, 3, 4});
}

TEST(KvPlan, LayerRangesMoveOnlyThoseLayers) {
    KvLayout L = Layout(4, 2, 0, 8), R = Layout(4, 2, 0, 8);
    std::vector<BlockId> lb = {0, 1, 2}, rb = {3, 4, 5};
    for (int l = 0; l < 4; ++l) {
        size_t spans = 0;
        ExpectSameAsReference(L, R, {lb, rb, 0, 12, l, l + 1}, &spans);
        EXPECT_EQ(spans, 1u);  // K and V of one layer: one span, strided by a tensor
        ExpectSameAsReference(L, R, {lb, rb, 5, 10, l, l + 1});
    }
}

TEST(KvPlan, RandomMovesMatchTheReference) {
    std::mt19937 g(42);
    for (int trial = 0; trial < 200; ++trial) {
        int bt = 1 + g() % 6, layers = 1 + g() % 3, heads = 1 + g() % 4, blocks = 24;
        KvLayout L = Layout(layers, heads, 0, blocks, bt, 4);
        KvLayout R = Layout(layers, heads, 0, blocks + 5, bt, 4);
        int tokens = 1 + g() % (bt * 8);
        int nb = (tokens + bt - 1) / bt;
        std::vector<BlockId> lb(nb), rb(nb);
        // Distinct ids per side, as a block table has: shuffled, or one adjacent run.
        std::vector<BlockId> pl(blocks), pr(blocks + 5);
        std::iota(pl.begin(), pl.end(), 0);
        std::iota(pr.begin(), pr.end(), 0);
        std::shuffle(pl.begin(), pl.end(), g);
        std::shuffle(pr.begin(), pr.end(), g);
        if (g() % 2) {
            for (int i = 0; i < nb; ++i) lb[i] = pl[i];
            for (int i = 0; i < nb; ++i) rb[i] = pr[i];
        } else {
            int s1 = g() % (blocks - nb + 1), s2 = g() % (blocks + 5 - nb + 1);
            std::iota(lb.begin(), lb.end(), s1);
            std::iota(rb.begin(), rb.end(), s2);
        }
        int a = g() % (tokens + 1), b = a + g() % (tokens - a + 1);
        int la = g() % layers, lz = la + 1 + g() % (layers - la);
        ExpectSameAsReference(L, R, {lb, rb, a, b, la, lz});
    }
}

// Different block sizes, both ways (16 to 32, 32 to 16, 16 to 128, 128 to 16, sizes that do
// not divide each other), with partial blocks at either end and head slices: the rows land where
// the token-by-token reference puts them, in few spans.
TEST(KvPlan, DifferentBlockSizesEitherWayMatchTheReference) {
    struct Sizes {
        int a, b;
    };
    for (Sizes z :
         {Sizes{16, 32}, Sizes{32, 16}, Sizes{16, 128}, Sizes{128, 16}, Sizes{4, 6}, Sizes{6, 4}}) {
        SCOPED_TRACE(fmt::format("{} to {}", z.a, z.b));
        const int tokens = 300;
        KvLayout L = Layout(2, 2, 0, 96, z.a, 4), R = Layout(2, 2, 0, 96, z.b, 4);
        auto table = [&](int bt, int first) {
            std::vector<BlockId> t((tokens + bt - 1) / bt);
            std::iota(t.begin(), t.end(), first);
            return t;
        };
        std::vector<BlockId> lb = table(z.a, 1), rb = table(z.b, 3);
        for (auto [a, b] : std::vector<std::pair<int, int>>{
                 {0, 300}, {0, 1}, {17, 300}, {128, 256}, {5, 7}, {31, 33}, {299, 300}}) {
            ExpectSameAsReference(L, R, {lb, rb, a, b});
        }
        // A head slice (a TP 2 rank's head [1, 2)) and one layer.
        KvLayout half = Layout(2, 1, 1, 96, z.b, 4);
        ExpectSameAsReference(L, half, {lb, rb, 3, 250});
        ExpectSameAsReference(L, R, {lb, rb, 9, 200, 1, 2});
        // Shuffled tables.
        std::mt19937 g(z.a * 1000 + z.b);
        std::shuffle(lb.begin(), lb.end(), g);
        std::shuffle(rb.begin(), rb.end(), g);
        ExpectSameAsReference(L, R, {lb, rb, 0, 300});
    }
    // 2048 tokens of 16-token blocks into 128-token blocks, 2 heads, 4 layers: one span per
    // 16-token piece and head (its 8 layer-K|V runs strided), 128 x 2.
    KvLayout L = Layout(4, 2, 0, 200, 16, 8), R = Layout(4, 2, 0, 40, 128, 8);
    std::vector<BlockId> lb(128), rb(16);
    std::iota(lb.begin(), lb.end(), 0);
    std::iota(rb.begin(), rb.end(), 0);
    size_t spans = 0;
    ExpectSameAsReference(L, R, {lb, rb, 0, 2048}, &spans);
    EXPECT_EQ(spans, 128u * 2);
}

TEST(KvPlan, RefusesWhatCannotBeMoved) {
    KvLayout L = Layout(2, 2, 0, 8), R = Layout(2, 2, 0, 8);
    std::vector<BlockId> lb = {0, 1}, rb = {2, 3};
    KvLayout other = R;
    other.spec.block_tokens = 8;
    const std::vector<BlockId> three = {0, 1, 2}, one = {2};  // 12 tokens of 4; 8 tokens of 8
    EXPECT_THAT(PlanKvMove(L, other, {three, one, 0, 12}),
                StatusHas(Code::kInvalidArgument,
                          "the remote block table has 1 blocks, the token range needs 2"));
    other = R;
    other.spec.num_layers = 3;
    EXPECT_THAT(PlanKvMove(L, other, {lb, rb, 0, 8}), StatusHas(Code::kInvalidArgument, "layers"));
    other = R;
    other.spec.dtype = KvDtype::kBF16;
    EXPECT_THAT(PlanKvMove(L, other, {lb, rb, 0, 8}),
                StatusHas(Code::kInvalidArgument, "dtype differs (local f32, remote bf16)"));
    EXPECT_THAT(PlanKvMove(L, R, {lb, rb, 0, 9}),
                StatusHas(Code::kInvalidArgument, "the local block table has 2 blocks"));
    std::vector<BlockId> bad = {2, 8};
    EXPECT_THAT(PlanKvMove(L, R, {lb, bad, 0, 8}),
                StatusHas(Code::kInvalidArgument, "remote block id 8 is outside"));
    KvLayout shard = Layout(2, 1, 1, 8);
    EXPECT_THAT(PlanKvMove(L, shard, {lb, rb, 0, 8, 0, -1, 0, 1}),
                StatusHas(Code::kInvalidArgument, "kv heads [0, 1) are not held by both sides"));
    EXPECT_THAT(PlanKvMove(L, R, {lb, rb, 0, 8, 1, 3}),
                StatusHas(Code::kInvalidArgument, "layers"));
}

}  // namespace
}  // namespace ferry::kv
