// Faults on the link, over every backend variant, through FaultyBackend (testing/faulty_backend.h):
// a stalled link makes a cancel certain, a link that fails after N bytes, a slow one, a dropped
// one, a corrupted byte. Each row also checks the agent is fine afterwards: the next transfer
// moves the right bytes.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "ferry/agent.h"
#include "testing/faulty_backend.h"
#include "testing/testing.h"

namespace ferry {
namespace {

using ::ferry::testing::FaultInjection;
using ::ferry::testing::FaultPlan;
using ::ferry::testing::FillPattern;
using ::ferry::testing::FirstMismatch;
using ::ferry::testing::StatusIs;
using ::ferry::testing::ValueOrDie;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr uint64_t kBytes = 1u << 20;

class FaultConformance : public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        plan_ = std::make_shared<FaultPlan>();
        AgentConfig ca = ::ferry::testing::TestConfig("agent-a", GetParam());
        // One stream, so the faulted connection is the one a transfer takes.
        ca.tcp_streams = 1;
        ca.shm_streams = 1;
        AgentConfig cb = ca;
        cb.name = "agent-b";
        {
            FaultInjection inject(::ferry::testing::BackendName(GetParam()), plan_);
            a_ = ValueOrDie(Agent::Create(ca));
        }
        b_ = ValueOrDie(Agent::Create(cb));
        la_ = ValueOrDie(a_->AllocateRegion(8 * kBytes));
        rb_ = ValueOrDie(b_->AllocateRegion(kBytes));
        FillPattern(rb_.base, kBytes, 7);
        ASSERT_TRUE(a_->AddPeer(b_->Metadata()).ok());
        ASSERT_TRUE(b_->AddPeer(a_->Metadata()).ok());
    }
    void TearDown() override {
        plan_->stall = false;  // let the relays end with their connections
    }

    Result<Transfer> Read(uint64_t local_off = 0, TransferOptions opts = {}) {
        return a_->PostRead(std::vector<Descriptor>{{la_.id, local_off, kBytes}}, "agent-b",
                            std::vector<Descriptor>{{rb_.id, 0, kBytes}}, opts);
    }
    Status ReadAndWait(uint64_t local_off = 0, TransferOptions opts = {}) {
        auto t = Read(local_off, opts);
        return t.ok() ? t->Wait(seconds(20)) : t.status();
    }
    // The agent works after the fault: a READ brings the right bytes.
    void ExpectHealthy() {
        std::memset(la_.base, 0, kBytes);
        FERRY_ASSERT_OK(ReadAndWait());
        EXPECT_EQ(FirstMismatch(la_.base, kBytes, 7), -1);
    }
    // One-sided shm copies through mapped regions cross no link once the mapping is granted.
    bool LinkFree() const { return GetParam() == "shm"; }
    bool OwnDataPath() const {
        const std::string b = ::ferry::testing::BackendName(GetParam());
        return b == "ucx";
    }

    std::shared_ptr<FaultPlan> plan_;
    std::unique_ptr<Agent> a_, b_;
    RegionInfo la_, rb_;
};

TEST_P(FaultConformance, ACancelOnAStalledLinkCancels) {
    plan_->stall = true;  // from the start: handshake and any mapping request stall too
    Transfer t = ValueOrDie(Read());
    EXPECT_EQ(ValueOrDie(t.Poll()), TransferState::kPending) << "finished over a stalled link";
    FERRY_EXPECT_OK(t.Cancel());
    EXPECT_THAT(t.Wait(seconds(10)), StatusIs(Code::kCancelled));
    plan_->stall = false;
    ExpectHealthy();
}

TEST_P(FaultConformance, DestroyingTheInitiatorCancelsEveryTransferInFlight) {
    plan_->stall = true;
    std::vector<Transfer> xs;
    for (uint64_t i = 0; i < 8; ++i) xs.push_back(ValueOrDie(Read(i * kBytes)));
    a_.reset();
    for (auto& x : xs) EXPECT_THAT(x.Wait(seconds(10)), StatusIs(Code::kCancelled));
    plan_->stall = false;
    // The target still serves others.
    auto c = ValueOrDie(Agent::Create(::ferry::testing::TestConfig("agent-c", GetParam())));
    ASSERT_TRUE(c->AddPeer(b_->Metadata()).ok());
    RegionInfo lc = ValueOrDie(c->AllocateRegion(kBytes));
    auto x = ValueOrDie(c->PostRead(std::vector<Descriptor>{{lc.id, 0, kBytes}}, "agent-b",
                                    std::vector<Descriptor>{{rb_.id, 0, kBytes}}));
    FERRY_ASSERT_OK(x.Wait(seconds(10)));
    EXPECT_EQ(FirstMismatch(lc.base, kBytes, 7), -1);
}

TEST_P(FaultConformance, ALinkThatFailsAfterNBytesFailsTheTransferAndTheNextOneReconnects) {
    FERRY_ASSERT_OK(ReadAndWait());  // connected (and, for shm, mapped)
    if (LinkFree()) GTEST_SKIP() << "one-sided shm copies cross no link";
    plan_->fail_after_bytes = static_cast<int64_t>(plan_->Relayed() + 100);
    Status s = ReadAndWait();
    EXPECT_THAT(s, StatusIs(Code::kUnavailable));
    plan_->fail_after_bytes = -1;
    ExpectHealthy();
}

TEST_P(FaultConformance, ASlowLinkMissesATightDeadlineAndMeetsALooseOne) {
    plan_->delay_ms = 100;
    TransferOptions tight;
    tight.timeout = milliseconds(50);
    EXPECT_THAT(ReadAndWait(0, tight), StatusIs(Code::kDeadlineExceeded));
    TransferOptions loose;
    loose.timeout = seconds(20);
    std::memset(la_.base, 0, kBytes);
    FERRY_ASSERT_OK(ReadAndWait(0, loose));
    EXPECT_EQ(FirstMismatch(la_.base, kBytes, 7), -1);
    plan_->delay_ms = 0;
    ExpectHealthy();
}

TEST_P(FaultConformance, ADroppedLinkFailsWhatIsInFlightWithUnavailable) {
    FERRY_ASSERT_OK(ReadAndWait());
    if (LinkFree()) GTEST_SKIP() << "one-sided shm copies cross no link";
    plan_->stall = true;  // the next transfer is in flight when the link drops
    Transfer t = ValueOrDie(Read());
    plan_->Drop();
    EXPECT_THAT(t.Wait(seconds(10)), StatusIs(Code::kUnavailable));
    plan_->stall = false;
    ExpectHealthy();
}

TEST_P(FaultConformance, ACorruptedFrameIsRefusedAndTheAgentGoesOn) {
    FERRY_ASSERT_OK(ReadAndWait());
    if (LinkFree()) GTEST_SKIP() << "one-sided shm copies cross no link";
    if (OwnDataPath()) GTEST_SKIP() << "the bytes of a backend with its own data path are its own";
    // The link is idle: the next byte toward the initiator starts the answer's frame header.
    plan_->corrupt_next = true;
    Status s = ReadAndWait();
    EXPECT_FALSE(s.ok()) << "a READ whose answer was corrupted succeeded";
    EXPECT_FALSE(plan_->corrupt_next.load()) << "nothing crossed toward the initiator";
    ExpectHealthy();
}

INSTANTIATE_TEST_SUITE_P(Backends, FaultConformance,
                         ::testing::ValuesIn(::ferry::testing::ConformanceVariants()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry
