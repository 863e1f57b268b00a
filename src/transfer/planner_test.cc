#include "transfer/planner.h"

#include <gtest/gtest.h>

#include <map>

#include "testing/testing.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;

class PlannerTest : public ::testing::Test {
  protected:
    std::function<const RegionView*(RegionId)> Finder() {
        return [this](RegionId id) -> const RegionView* {
            auto it = views_.find(id);
            return it == views_.end() ? nullptr : &it->second;
        };
    }
    uint8_t mem_[1 << 16] = {};
    std::map<RegionId, RegionView> views_ = {{1, {mem_, sizeof(mem_), 11}},
                                             {2, {nullptr, 1 << 20, 22}}};
};

TEST_F(PlannerTest, AdjacentDescriptorsCoalesce) {
    std::vector<Descriptor> d = {{1, 0, 100}, {1, 100, 50}, {1, 200, 10}, {2, 0, 5}};
    std::vector<ferry::Run> runs;
    FERRY_ASSERT_OK(ExpandDescriptors(d, Finder(), "local", &runs));
    ASSERT_EQ(runs.size(), 3u);
    EXPECT_EQ(runs[0].length, 150u);
    EXPECT_EQ(runs[1].offset, 200u);
    EXPECT_EQ(runs[2].key, 22u);
}

TEST_F(PlannerTest, StridedDescriptorExpandsAndChecksItsLastRun) {
    std::vector<ferry::Run> runs;
    FERRY_ASSERT_OK(
        ExpandDescriptors(std::vector<Descriptor>{{2, 16, 8, 64, 4}}, Finder(), "r", &runs));
    ASSERT_EQ(runs.size(), 4u);
    EXPECT_EQ(runs[3].offset, 16u + 3 * 64);
    // stride == length is one contiguous run.
    FERRY_ASSERT_OK(
        ExpandDescriptors(std::vector<Descriptor>{{2, 0, 8, 8, 4}}, Finder(), "r", &runs));
    ASSERT_EQ(runs.size(), 1u);
    EXPECT_EQ(runs[0].length, 32u);
    EXPECT_THAT(
        ExpandDescriptors(std::vector<Descriptor>{{1, 0, 8, 1 << 15, 3}}, Finder(), "l", &runs),
        StatusIs(Code::kOutOfRange));
    EXPECT_THAT(ExpandDescriptors(std::vector<Descriptor>{{1, 0, 8, 4, 3}}, Finder(), "l", &runs),
                StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(ExpandDescriptors(std::vector<Descriptor>{{1, 1, 8, UINT64_MAX / 2, 3}}, Finder(),
                                  "l", &runs),
                StatusIs(Code::kOutOfRange));
}

TEST_F(PlannerTest, BoundsAndUnknownRegions) {
    std::vector<ferry::Run> runs;
    EXPECT_THAT(
        ExpandDescriptors(std::vector<Descriptor>{{1, sizeof(mem_), 1}}, Finder(), "l", &runs),
        StatusIs(Code::kOutOfRange));
    EXPECT_THAT(
        ExpandDescriptors(std::vector<Descriptor>{{1, UINT64_MAX, 2}}, Finder(), "l", &runs),
        StatusIs(Code::kOutOfRange));
    EXPECT_THAT(ExpandDescriptors(std::vector<Descriptor>{{3, 0, 1}}, Finder(), "l", &runs),
                StatusIs(Code::kNotFound));
    EXPECT_THAT(ExpandDescriptors(std::vector<Descriptor>{{1, 0, 0}}, Finder(), "l", &runs),
                StatusIs(Code::kInvalidArgument));
}

TEST_F(PlannerTest, PairingCutsAtEveryBoundaryAndMerges) {
    std::vector<ferry::Run> local, remote;
    FERRY_ASSERT_OK(ExpandDescriptors(std::vector<Descriptor>{{1, 0, 30}, {1, 1000, 70}}, Finder(),
                                      "l", &local));
    FERRY_ASSERT_OK(ExpandDescriptors(std::vector<Descriptor>{{2, 0, 50}, {2, 500, 50}}, Finder(),
                                      "r", &remote));
    auto segs = PairRuns(local, remote);
    ASSERT_TRUE(segs.ok());
    // l[0..30)->r[0..30), l[1000..1020)->r[30..50), l[1020..1070)->r[500..550)
    ASSERT_EQ(segs->size(), 3u);
    EXPECT_EQ((*segs)[1].local, mem_ + 1000);
    EXPECT_EQ((*segs)[1].remote.offset, 30u);
    EXPECT_EQ((*segs)[2].remote.offset, 500u);
    EXPECT_EQ((*segs)[2].remote.length, 50u);

    std::vector<ferry::Run> longer;
    FERRY_ASSERT_OK(
        ExpandDescriptors(std::vector<Descriptor>{{2, 0, 101}}, Finder(), "r", &longer));
    EXPECT_THAT(PairRuns(local, longer), StatusIs(Code::kInvalidArgument));
}

TEST_F(PlannerTest, ChunksRespectBytesAndSegmentLimits) {
    std::vector<PlannedSegment> segs;
    for (int i = 0; i < 10; ++i) {
        segs.push_back({mem_ + i * 1000, {2, 22, static_cast<uint64_t>(i) * 5000, 1000}, 1});
    }
    auto chunks = MakeChunks(segs, 2500, 1000);
    uint64_t total = 0;
    for (const Chunk& c : chunks) {
        EXPECT_LE(c.bytes, 2500u);
        total += c.bytes;
        uint64_t local = 0;
        for (const iovec& v : c.local) local += v.iov_len;
        EXPECT_EQ(local, c.bytes);
        EXPECT_EQ(c.local_regions, std::vector<RegionId>{1});
    }
    EXPECT_EQ(total, 10000u);
    EXPECT_EQ(chunks.size(), 4u);
    chunks = MakeChunks(segs, 1 << 20, 3);
    EXPECT_EQ(chunks.size(), 4u);  // 3 + 3 + 3 + 1 segments
}

}  // namespace
}  // namespace ferry
