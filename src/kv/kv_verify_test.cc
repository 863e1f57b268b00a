// Checksums and the handshake canary (kv_verify.h) across layouts: what the planner moves between
// two different layouts sums the same on both sides, a changed byte is found in its unit, and a
// canary read through a wrong mapping is refused naming the row.
#include "kv/kv_verify.h"

#include <fmt/core.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <set>

#include "testing/testing.h"

namespace ferry::kv {
namespace {

using ::ferry::testing::StatusHas;

KvLayout Layout(int layers, int heads, int head_begin, int blocks, int bt, int hd = 8) {
    KvLayout l;
    l.spec.num_layers = layers;
    l.spec.kv_heads = heads;
    l.spec.head_dim = hd;
    l.spec.block_tokens = bt;
    l.spec.num_blocks = blocks;
    l.spec.dtype = KvDtype::kF16;
    l.head_begin = head_begin;
    return l;
}

// One side of a transfer: its ranks' layouts and memory.
struct Side {
    std::vector<KvLayout> layouts;
    std::vector<std::vector<std::byte>> mem;
    std::vector<KvRankView> Views() const {
        std::vector<KvRankView> v;
        for (size_t r = 0; r < layouts.size(); ++r) v.push_back({layouts[r], mem[r].data()});
        return v;
    }
};

// `tp` ranks splitting `heads` kv heads.
Side MakeSide(int layers, int heads, int tp, int blocks, int bt, uint32_t seed) {
    Side s;
    std::mt19937 g(seed);
    for (int r = 0; r < tp; ++r) {
        s.layouts.push_back(Layout(layers, heads / tp, r * heads / tp, blocks, bt));
        s.mem.emplace_back(s.layouts.back().spec.TotalBytes());
        for (auto& b : s.mem.back()) b = static_cast<std::byte>(g());
    }
    return s;
}

// READs `tokens` of the sequence from `from` (its table `ft`) into `to` (table `tt`), as the
// connector plans it: every pair of ranks that share heads.
void Read(const Side& from, std::span<const BlockId> ft, Side* to, std::span<const BlockId> tt,
          int begin, int end) {
    for (size_t r = 0; r < to->layouts.size(); ++r) {
        for (size_t i = 0; i < from.layouts.size(); ++i) {
            const KvLayout& a = to->layouts[r];
            const KvLayout& b = from.layouts[i];
            if (std::max(a.head_begin, b.head_begin) >=
                std::min(a.head_begin + a.spec.kv_heads, b.head_begin + b.spec.kv_heads)) {
                continue;
            }
            auto plan = PlanKvMove(a, b, KvMove{tt, ft, begin, end});
            ASSERT_TRUE(plan.ok()) << plan.status().ToString();
            for (size_t k = 0; k < plan->local.size(); ++k) {
                const KvSpan& l = plan->local[k];
                const KvSpan& m = plan->remote[k];
                for (uint64_t c = 0; c < l.count; ++c) {
                    std::memcpy(to->mem[r].data() + l.offset + c * l.stride,
                                from.mem[i].data() + m.offset + c * m.stride, l.length);
                }
            }
        }
    }
}

std::vector<BlockId> Shuffled(int n, int of, uint32_t seed) {
    std::vector<BlockId> all(of);
    std::iota(all.begin(), all.end(), 0);
    std::mt19937 g(seed);
    std::shuffle(all.begin(), all.end(), g);
    all.resize(n);
    return all;
}

std::vector<int> AllUnits(int layers, int heads) {
    std::vector<int> u(UnitCount(layers, heads, 2));
    std::iota(u.begin(), u.end(), 0);
    return u;
}

TEST(KvVerify, SumsDoNotDependOnBlockSizeTpOrWhereTheBlocksLie) {
    // Sender: TP 1, blocks of 16; receiver: TP 2, blocks of 4 (and the other way round).
    for (auto [stp, sbt, rtp, rbt] : {std::tuple{1, 16, 2, 4}, {2, 4, 1, 16}, {4, 8, 2, 12}}) {
        SCOPED_TRACE(fmt::format("tp {} bt {} -> tp {} bt {}", stp, sbt, rtp, rbt));
        const int layers = 3, heads = 4, tokens = 45;
        Side sender = MakeSide(layers, heads, stp, 20, sbt, 1);
        Side receiver = MakeSide(layers, heads, rtp, 64, rbt, 2);
        auto st = Shuffled((tokens + sbt - 1) / sbt, 20, 3);
        auto rt = Shuffled((tokens + rbt - 1) / rbt, 64, 4);
        Read(sender, st, &receiver, rt, 0, tokens);
        const auto units = AllUnits(layers, heads);
        auto theirs = KvUnitSums(sender.Views(), st, 3, tokens, units, heads);
        auto ours = KvUnitSums(receiver.Views(), rt, 3, tokens, units, heads);
        ASSERT_TRUE(theirs.ok() && ours.ok()) << theirs.status().ToString();
        EXPECT_EQ(*ours, *theirs);
        EXPECT_EQ(FirstMismatch(*ours, *theirs), std::nullopt);
        // Units differ from each other (a sum that ignored its head or layer would not).
        EXPECT_EQ(std::set<uint64_t>(ours->begin(), ours->end()).size(), units.size());

        // One byte of layer 1's V of head 3 at token 20, on the receiver: that unit alone differs.
        const int r = 3 / (heads / rtp);
        const KvLayout& l = receiver.layouts[r];
        receiver.mem[r][l.Offset(1, true, rt[20 / rbt], 3 - l.head_begin, 20 % rbt) + 5] ^=
            std::byte{1};
        ours = KvUnitSums(receiver.Views(), rt, 3, tokens, units, heads);
        ASSERT_TRUE(ours.ok());
        auto bad = FirstMismatch(*ours, *theirs);
        ASSERT_TRUE(bad.has_value());
        const KvUnit u = UnitOf(units[*bad], heads, 2);
        EXPECT_EQ(UnitName(u), "layer 1 head 3 V");
        int differ = 0;
        for (size_t i = 0; i < units.size(); ++i) differ += (*ours)[i] != (*theirs)[i];
        EXPECT_EQ(differ, 1);
        // Outside the checked range it goes unseen: tokens [21, 45) sum the same.
        auto tail_o = KvUnitSums(receiver.Views(), rt, 21, tokens, units, heads);
        auto tail_t = KvUnitSums(sender.Views(), st, 21, tokens, units, heads);
        EXPECT_EQ(*tail_o, *tail_t);
    }
}

TEST(KvVerify, WhatCannotBeSummedIsNamed) {
    Side s = MakeSide(2, 2, 1, 8, 4, 1);
    const std::vector<BlockId> t = {0, 1, 2};
    const auto v = s.Views();
    const std::vector<int> u = {0};
    EXPECT_THAT(KvUnitSums(v, t, 4, 4, u, 2), StatusHas(Code::kInvalidArgument, "empty"));
    EXPECT_THAT(KvUnitSums(v, t, 0, 13, u, 2),
                StatusHas(Code::kInvalidArgument, "do not cover token 12"));
    const std::vector<BlockId> outside = {0, 8};
    EXPECT_THAT(KvUnitSums(v, outside, 0, 8, u, 2),
                StatusHas(Code::kInvalidArgument, "block 8 is outside"));
    const std::vector<int> big = {8};
    EXPECT_THAT(KvUnitSums(v, t, 0, 4, big, 2),
                StatusHas(Code::kInvalidArgument, "unit 8 is outside the model's 8"));
    const std::vector<int> neg = {-1};
    EXPECT_THAT(KvUnitSums(v, t, 0, 4, neg, 2), StatusHas(Code::kInvalidArgument, "unit -1"));
    // A rank that lacks the head (a side that holds only some heads).
    Side half = MakeSide(2, 2, 2, 8, 4, 1);
    std::vector<KvRankView> one = {half.Views()[0]};
    const std::vector<int> head1 = {2};
    EXPECT_THAT(KvUnitSums(one, t, 0, 4, head1, 2),
                StatusHas(Code::kInvalidArgument, "no rank holds head 1"));
}

TEST(KvVerify, ModesAndTheSample) {
    EXPECT_EQ(*ParseKvVerifyMode("sample"), KvVerifyMode::kSample);
    EXPECT_EQ(KvVerifyModeName(*ParseKvVerifyMode("all")), "all");
    EXPECT_THAT(ParseKvVerifyMode("most"), StatusHas(Code::kInvalidArgument, "'most'"));
    std::mt19937_64 rng(7);
    EXPECT_TRUE(ChooseUnits(KvVerifyMode::kOff, UnitCount(8, 4, 2), rng).empty());
    EXPECT_EQ(ChooseUnits(KvVerifyMode::kAll, UnitCount(8, 4, 2), rng).size(), 64u);
    EXPECT_EQ(ChooseUnits(KvVerifyMode::kSample, UnitCount(2, 2, 2), rng).size(),
              1u);  // 8 units: at least 1
    std::set<std::vector<int>> seen;
    for (int i = 0; i < 50; ++i) {
        auto s = ChooseUnits(KvVerifyMode::kSample, UnitCount(8, 4, 2), rng);
        ASSERT_EQ(s.size(), 4u);  // one in 16 of 64
        EXPECT_TRUE(std::is_sorted(s.begin(), s.end()));
        EXPECT_EQ(std::set<int>(s.begin(), s.end()).size(), 4u);
        EXPECT_GE(s.front(), 0);
        EXPECT_LT(s.back(), 64);
        seen.insert(s);
    }
    EXPECT_GT(seen.size(), 40u);  // random per request
    EXPECT_EQ(UnitName(UnitOf(13, 4, 2)), "layer 1 head 2 V");
    EXPECT_EQ(UnitName(UnitOf(3, 1, 1)), "layer 3 latent");  // a latent cache: one unit a layer
}

// A latent (MLA) cache: one tensor a layer, one unit a layer. Sums agree across block sizes, a
// changed byte is found in its layer's unit, and a canary row that came from the next layer (a
// layer mapping off by one) is named with the row it holds.
TEST(KvVerify, ALatentCacheChecksPerLayer) {
    auto latent = [](int layers, int blocks, int bt) {
        KvLayout l = Layout(layers, 1, 0, blocks, bt, 24);
        l.spec.latent = true;
        return l;
    };
    const int layers = 3, tokens = 45;
    Side sender, receiver;
    std::mt19937 g(7);
    for (auto [side, bt, blocks] : {std::tuple{&sender, 16, 20}, {&receiver, 8, 64}}) {
        side->layouts.push_back(latent(layers, blocks, bt));
        side->mem.emplace_back(side->layouts.back().spec.TotalBytes());
        for (auto& b : side->mem.back()) b = static_cast<std::byte>(g());
    }
    EXPECT_EQ(sender.layouts[0].spec.TotalBytes(), 20u * 16 * 24 * 2 * layers);  // no V plane
    auto st = Shuffled(3, 20, 3), rt = Shuffled(6, 64, 4);
    Read(sender, st, &receiver, rt, 0, tokens);
    std::vector<int> units(UnitCount(layers, 1, 1));
    std::iota(units.begin(), units.end(), 0);
    auto theirs = KvUnitSums(sender.Views(), st, 0, tokens, units, 1);
    auto ours = KvUnitSums(receiver.Views(), rt, 0, tokens, units, 1);
    ASSERT_TRUE(theirs.ok() && ours.ok()) << theirs.status().ToString();
    EXPECT_EQ(*ours, *theirs);
    const KvLayout& rl = receiver.layouts[0];
    receiver.mem[0][rl.Offset(2, false, rt[30 / 8], 0, 30 % 8) + 3] ^= std::byte{4};
    ours = KvUnitSums(receiver.Views(), rt, 0, tokens, units, 1);
    auto bad = FirstMismatch(*ours, *theirs);
    ASSERT_TRUE(bad.has_value());
    EXPECT_EQ(UnitName(UnitOf(units[*bad], 1, 1)), "layer 2 latent");

    // The canary: right through 16 -> 8, then layer 0's token 5 row replaced by layer 1's.
    KvLayout cs = latent(layers, 0, 16), cr = latent(layers, 0, 8);
    cs.spec = CanarySpec(cs.spec);
    cr.spec = CanarySpec(cr.spec);
    Side cs_side{{cs}, {std::vector<std::byte>(cs.spec.TotalBytes())}};
    Side cr_side{{cr}, {std::vector<std::byte>(cr.spec.TotalBytes())}};
    FillCanary(cs, cs_side.mem[0]);
    const auto ct = CanaryTable(cr.spec);
    Read(cs_side, CanaryTable(cs.spec), &cr_side, ct, 0, kCanaryTokens);
    FERRY_EXPECT_OK(CheckCanary(cr, cr_side.mem[0], 1));
    std::memcpy(cr_side.mem[0].data() + cr.Offset(0, false, ct[0], 0, 5),
                cr_side.mem[0].data() + cr.Offset(1, false, ct[0], 0, 5), cr.RowBytes());
    EXPECT_THAT(CheckCanary(cr, cr_side.mem[0], 1),
                StatusHas(Code::kDataLoss,
                          "layer 0 latent token 5 arrived wrong: it holds the "
                          "row of layer 1 latent token 5"));
}

// Every rank's canary, read through the planner into the receiver's canary-shaped scratch.
std::vector<Status> ReadCanaries(int layers, int heads, int stp, int sbt, int rtp, int rbt,
                                 int fault_heads = 0) {
    Side sender, receiver;
    for (int r = 0; r < stp; ++r) {
        KvLayout l = Layout(layers, heads / stp, r * heads / stp, 0, sbt);
        l.spec = CanarySpec(l.spec);
        sender.layouts.push_back(l);
        sender.mem.emplace_back(l.spec.TotalBytes());
        FillCanary(l, sender.mem.back());
    }
    for (int r = 0; r < rtp; ++r) {
        KvLayout l = Layout(layers, heads / rtp, r * heads / rtp, 0, rbt);
        l.spec = CanarySpec(l.spec);
        receiver.layouts.push_back(l);
        receiver.mem.emplace_back(l.spec.TotalBytes());
    }
    Side as_seen = sender;  // the receiver's idea of the sender (a wrong one, with a fault)
    for (KvLayout& l : as_seen.layouts) l.head_begin += fault_heads;
    Read(as_seen, CanaryTable(sender.layouts[0].spec), &receiver,
         CanaryTable(receiver.layouts[0].spec), 0, kCanaryTokens);
    std::vector<Status> out;
    for (int r = 0; r < rtp; ++r) {
        out.push_back(CheckCanary(receiver.layouts[r], receiver.mem[r], heads));
    }
    return out;
}

TEST(KvCanary, ArrivesRightThroughEveryLayoutPair) {
    EXPECT_EQ(CanaryTable(CanarySpec(Layout(1, 1, 0, 0, 16).spec)),
              (std::vector<BlockId>{4, 3, 2, 1, 0}));  // 72 tokens: 5 blocks, the last partial
    for (auto [stp, sbt, rtp, rbt] : {std::tuple{1, 16, 1, 16},
                                      {1, 16, 2, 32},
                                      {2, 32, 1, 16},
                                      {4, 128, 1, 16},
                                      {1, 8, 4, 12}}) {
        SCOPED_TRACE(fmt::format("tp {} bt {} -> tp {} bt {}", stp, sbt, rtp, rbt));
        for (const Status& s : ReadCanaries(2, 4, stp, sbt, rtp, rbt)) FERRY_EXPECT_OK(s);
    }
}

TEST(KvCanary, AHeadOffsetByOneIsNamedWithTheRowItHolds) {
    // The receiver takes the sender's heads to begin one later: its head 1 gets head 0's rows,
    // and its head 0 nothing.
    auto st = ReadCanaries(2, 4, 1, 16, 1, 16, 1);
    EXPECT_THAT(st[0], StatusHas(Code::kDataLoss, "layer 0 head 0 K token 0 arrived wrong"));
    // Two ranks of two heads: rank 1 (heads 2, 3) gets rows of heads 1, 2.
    st = ReadCanaries(2, 4, 1, 16, 2, 32, 1);
    EXPECT_THAT(st[1], StatusHas(Code::kDataLoss,
                                 "layer 0 head 2 K token 0 arrived wrong: it holds the row of "
                                 "layer 0 head 1 K token 0"));
}

}  // namespace
}  // namespace ferry::kv
