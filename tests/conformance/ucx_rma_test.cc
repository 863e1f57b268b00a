// ucx one-sided access (AgentConfig::ucx_rma): grants, revocation on Deregister, and the fallback
// to active messages where the target grants nothing. The conformance suites run the rest of the
// contract over the "ucx_rma" variant.
#include <atomic>
#include <cstring>
#include <thread>

#include "testing/testing.h"

namespace ferry {
namespace {

using ::ferry::testing::FillPattern;
using ::ferry::testing::FirstMismatch;
using ::ferry::testing::StatusIs;
using ::ferry::testing::TestConfig;
using ::ferry::testing::ValueOrDie;
using ::ferry::testing::WaitForCount;
using std::chrono::milliseconds;
using std::chrono::seconds;

std::unique_ptr<Agent> Make(const std::string& name, bool rma) {
    return ValueOrDie(Agent::Create(TestConfig(name, rma ? "ucx_rma" : "ucx")), name.c_str());
}

// agent-a and agent-b, each with or without one-sided access, that know each other.
struct Pair {
    Pair(bool a_rma, bool b_rma) : a(Make("agent-a", a_rma)), b(Make("agent-b", b_rma)) {}
    void Connect() {
        ASSERT_TRUE(a->AddPeer(b->Metadata()).ok());
        ASSERT_TRUE(b->AddPeer(a->Metadata()).ok());
    }
    std::unique_ptr<Agent> a;
    std::unique_ptr<Agent> b;
};

TEST(UcxRma, DeregisterRevokesTheGrantAndNothingLandsAfterItReturns) {
    Pair p(true, true);
    Agent* a = p.a.get();
    Agent* b = p.b.get();
    const size_t size = 4u << 20;
    RegionInfo la = ValueOrDie(a->AllocateRegion(size));
    FillPattern(la.base, size, 5);
    std::vector<uint8_t> user(size);
    RegionInfo ru = ValueOrDie(b->RegisterMemory(user.data(), user.size()));
    p.Connect();

    // Writes back to back, in 1 MiB pieces, through a grant; they keep trying after the
    // Deregister with the metadata they have.
    std::atomic<bool> stop{false};
    std::atomic<bool> deregistered{false};
    std::atomic<int> ok_before{0}, refused_after{0}, other{0};
    std::string other_error;
    std::thread writer([&] {
        uint64_t i = 0;
        while (!stop.load()) {
            uint64_t off = (i++ % 4) << 20;
            bool after = deregistered.load();
            auto x = a->PostWrite(std::vector<Descriptor>{{la.id, off, 1u << 20}}, "agent-b",
                                  std::vector<Descriptor>{{ru.id, off, 1u << 20}});
            Status s = x.ok() ? x->Wait(seconds(10)) : x.status();
            if (s.ok()) {
                if (!after) ++ok_before;
            } else if (s.code() == Code::kNotFound) {
                if (after) ++refused_after;
            } else if (other.fetch_add(1) == 0) {
                other_error = s.ToString();
            }
        }
    });
    EXPECT_TRUE(WaitForCount(ok_before, 8)) << "writes through the grant did not succeed";
    FERRY_EXPECT_OK(b->Deregister(ru.id));
    deregistered = true;
    // From here the memory is the user's again: no write of the peer may land in it.
    std::memset(user.data(), 0xee, user.size());
    EXPECT_TRUE(WaitForCount(refused_after, 20)) << "writes after Deregister were not refused";
    stop = true;
    writer.join();
    EXPECT_EQ(other.load(), 0) << other_error;
    size_t touched = 0;
    for (uint8_t v : user) touched += v != 0xee;
    EXPECT_EQ(touched, 0u);
    EXPECT_GE(a->Stats().one_sided_transfers, 8u);

    // Other regions of the target are granted as before.
    RegionInfo rb = ValueOrDie(b->AllocateRegion(size));
    ASSERT_TRUE(a->AddPeer(b->Metadata()).ok());
    auto x = ValueOrDie(a->PostWrite(std::vector<Descriptor>{{la.id, 0, size}}, "agent-b",
                                     std::vector<Descriptor>{{rb.id, 0, size}}));
    FERRY_ASSERT_OK(x.Wait(seconds(10)));
    EXPECT_EQ(FirstMismatch(rb.base, size, 5), -1);
}

TEST(UcxRma, ReadsInFlightWhenTheTargetDeregistersEndBeforeDeregisterReturns) {
    Pair p(true, true);
    Agent* a = p.a.get();
    Agent* b = p.b.get();
    const size_t size = 16u << 20;
    RegionInfo la = ValueOrDie(a->AllocateRegion(8 * size));
    RegionInfo rb = ValueOrDie(b->AllocateRegion(size));
    FillPattern(rb.base, size, 8);
    p.Connect();
    // A first read takes the grant.
    auto first = ValueOrDie(a->PostRead(std::vector<Descriptor>{{la.id, 0, 4096}}, "agent-b",
                                        std::vector<Descriptor>{{rb.id, 0, 4096}}));
    FERRY_ASSERT_OK(first.Wait(seconds(10)));
    std::vector<Transfer> xs;
    for (uint64_t i = 0; i < 8; ++i) {
        xs.push_back(ValueOrDie(a->PostRead(std::vector<Descriptor>{{la.id, i * size, size}},
                                            "agent-b", std::vector<Descriptor>{{rb.id, 0, size}})));
    }
    FERRY_ASSERT_OK(b->Deregister(rb.id));
    for (uint64_t i = 0; i < 8; ++i) {
        Status s = xs[i].Wait(seconds(10));
        if (s.ok()) {
            EXPECT_EQ(FirstMismatch(static_cast<uint8_t*>(la.base) + i * size, size, 8), -1);
        } else {
            EXPECT_THAT(s, StatusIs(Code::kNotFound));
        }
    }
}

TEST(UcxRma, ATargetThatGrantsNothingIsServedByActiveMessages) {
    Pair p(true, false);
    Agent* a = p.a.get();
    Agent* b = p.b.get();
    const size_t size = 1u << 20;
    RegionInfo la = ValueOrDie(a->AllocateRegion(2 * size));
    RegionInfo rb = ValueOrDie(b->AllocateRegion(size));
    FillPattern(la.base, size, 2);
    p.Connect();
    for (int i = 0; i < 2; ++i) {
        auto w = ValueOrDie(a->PostWrite(std::vector<Descriptor>{{la.id, 0, size}}, "agent-b",
                                         std::vector<Descriptor>{{rb.id, 0, size}}));
        FERRY_ASSERT_OK(w.Wait(seconds(10)));
        EXPECT_EQ(FirstMismatch(rb.base, size, 2), -1);
        auto r = ValueOrDie(a->PostRead(std::vector<Descriptor>{{la.id, size, size}}, "agent-b",
                                        std::vector<Descriptor>{{rb.id, 0, size}}));
        FERRY_ASSERT_OK(r.Wait(seconds(10)));
        EXPECT_EQ(FirstMismatch(static_cast<uint8_t*>(la.base) + size, size, 2), -1);
    }
    EXPECT_EQ(a->Stats().one_sided_transfers, 0u);
    EXPECT_EQ(a->Stats().transfers_posted, 4u);
}

TEST(UcxRma, AnInitiatorWithoutRmaNeverAsksForGrants) {
    Pair p(false, true);
    Agent* a = p.a.get();
    Agent* b = p.b.get();
    RegionInfo la = ValueOrDie(a->AllocateRegion(4096));
    RegionInfo rb = ValueOrDie(b->AllocateRegion(4096));
    FillPattern(la.base, 4096, 6);
    ASSERT_TRUE(a->AddPeer(b->Metadata()).ok());
    auto w = ValueOrDie(a->PostWrite(std::vector<Descriptor>{{la.id, 0, 4096}}, "agent-b",
                                     std::vector<Descriptor>{{rb.id, 0, 4096}}));
    FERRY_ASSERT_OK(w.Wait(seconds(10)));
    EXPECT_EQ(FirstMismatch(rb.base, 4096, 6), -1);
    EXPECT_EQ(a->Stats().one_sided_transfers, 0u);
    FERRY_ASSERT_OK(b->Deregister(rb.id));
}

}  // namespace
}  // namespace ferry
