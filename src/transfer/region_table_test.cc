#include "transfer/region_table.h"

#include <gtest/gtest.h>

#include <thread>

#include "testing/testing.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::ferry::testing::ValueOrDie;

TEST(RegionTable, KeysAreCheckedAndBoundsEnforced) {
    RegionTable t;
    RegionInfo r = ValueOrDie(t.Allocate(8192));
    EXPECT_NE(r.key, 0u);
    RegionInfo r2 = ValueOrDie(t.Allocate(8192));
    EXPECT_NE(r.key, r2.key);
    EXPECT_TRUE(t.PinRemote(r.id, r.key, 0, 8192).ok());
    EXPECT_THAT(t.PinRemote(r.id, r.key + 1, 0, 1), StatusIs(Code::kPermissionDenied));
    EXPECT_THAT(t.PinRemote(r.id, r.key, 8192, 1), StatusIs(Code::kOutOfRange));
    EXPECT_THAT(t.PinRemote(r.id, r.key, 1, UINT64_MAX), StatusIs(Code::kOutOfRange));
    EXPECT_THAT(t.PinRemote(999, r.key, 0, 1), StatusIs(Code::kNotFound));
    EXPECT_THAT(t.Register(nullptr, 10), StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(t.Allocate(0), StatusIs(Code::kInvalidArgument));
}

TEST(RegionTable, AllocatedMemoryIsZeroedAndWritable) {
    RegionTable t;
    RegionInfo r = ValueOrDie(t.Allocate(1 << 20));
    auto* p = static_cast<uint8_t*>(r.base);
    EXPECT_EQ(p[0], 0);
    EXPECT_EQ(p[(1 << 20) - 1], 0);
    p[12345] = 7;
    EXPECT_EQ(p[12345], 7);
}

TEST(RegionTable, DeregisterWaitsForPinsAndRefusesNewOnes) {
    RegionTable t;
    RegionInfo r = ValueOrDie(t.Allocate(4096));
    RegionPin pin = ValueOrDie(t.PinRemote(r.id, r.key, 0, 10));
    std::atomic<bool> done{false};
    std::thread th([&] {
        EXPECT_TRUE(t.Deregister(r.id, std::chrono::seconds(30), [](RegionId) {}).ok());
        done = true;
    });
    // While pinned, Deregister has not returned and new pins are refused.
    while (t.Find(r.id)) std::this_thread::yield();
    EXPECT_FALSE(done.load());
    EXPECT_THAT(t.PinRemote(r.id, r.key, 0, 10), StatusIs(Code::kNotFound));
    pin.Release();
    th.join();
    EXPECT_TRUE(done.load());
    EXPECT_THAT(t.Deregister(r.id, std::chrono::seconds(1), [](RegionId) {}),
                StatusIs(Code::kNotFound));
}

TEST(RegionTable, StuckPinCallsTheHandlerAfterTheGrace) {
    RegionTable t;
    RegionInfo r = ValueOrDie(t.Allocate(4096));
    auto pin = std::make_shared<RegionPin>(ValueOrDie(t.PinRemote(r.id, r.key, 0, 10)));
    bool called = false;
    FERRY_ASSERT_OK(t.Deregister(r.id, std::chrono::milliseconds(50), [&](RegionId id) {
        EXPECT_EQ(id, r.id);
        called = true;
        pin->Release();  // what closing the stalled connection does
    }));
    EXPECT_TRUE(called);
}

}  // namespace
}  // namespace ferry
