// The parts AgentCore is made of, each on its own: config checks, backend selection, the peer
// table's epoch rule, the notification queue's bound, named objects against the region table.
#include <gtest/gtest.h>

#include <thread>

#include "testing/testing.h"
#include "transfer/agent_config.h"
#include "transfer/notification_queue.h"
#include "transfer/object_directory.h"
#include "transfer/peer_table.h"

namespace ferry::internal {
namespace {

using ::ferry::testing::StatusHas;
using ::ferry::testing::StatusIs;

AgentConfig Valid() {
    AgentConfig c;
    c.name = "prefill-0";
    c.backends = {"tcp"};
    return c;
}

TEST(AgentConfigCheck, EachBadFieldIsNamed) {
    FERRY_EXPECT_OK(ValidateAgentConfig(Valid()));
    AgentConfig c = Valid();
    c.name = "a/b";
    EXPECT_THAT(ValidateAgentConfig(c), StatusHas(Code::kInvalidArgument, "AgentConfig.name"));
    c = Valid();
    c.backends = {};
    EXPECT_THAT(ValidateAgentConfig(c), StatusHas(Code::kInvalidArgument, "no backend"));
    c = Valid();
    c.backends = {"tcp", "carrier-pigeon"};
    EXPECT_THAT(ValidateAgentConfig(c), StatusHas(Code::kInvalidArgument, "'carrier-pigeon'"));
    c = Valid();
    c.force_backend = "shm";
    EXPECT_THAT(ValidateAgentConfig(c), StatusHas(Code::kInvalidArgument, "force_backend"));
    c = Valid();
    c.default_timeout = std::chrono::milliseconds(0);
    EXPECT_THAT(ValidateAgentConfig(c), StatusHas(Code::kInvalidArgument, "default_timeout"));
    c = Valid();
    c.stalled_frame_timeout = std::chrono::milliseconds(-1);
    EXPECT_THAT(ValidateAgentConfig(c), StatusHas(Code::kInvalidArgument, "stalled_frame"));
    c = Valid();
    c.file_io = "mmap";
    EXPECT_THAT(ValidateAgentConfig(c), StatusHas(Code::kInvalidArgument, "file_io 'mmap'"));
    c = Valid();
    c.file_queue_depth = 0;
    EXPECT_THAT(ValidateAgentConfig(c), StatusHas(Code::kInvalidArgument, "file_queue_depth"));
    c = Valid();
    c.io_threads = 3;
    EXPECT_EQ(IoThreadsFor(c), 3);
    c.io_threads = 1000;
    EXPECT_EQ(IoThreadsFor(c), 64);
    c.io_threads = 0;
    EXPECT_GE(IoThreadsFor(c), 1);
    EXPECT_LE(IoThreadsFor(c), 8);
}

// Reaches the peers whose name starts with its own name.
class PrefixBackend final : public Backend {
  public:
    explicit PrefixBackend(std::string name) : name_(std::move(name)) {}
    std::string_view name() const override { return name_; }
    BackendCapabilities capabilities() const override { return {}; }
    Result<std::string> Listen(ScopedFd*) override { return std::string(); }
    bool CanReach(const AgentMetadata&, const AgentMetadata& peer) const override {
        return peer.name.rfind(name_, 0) == 0;
    }

  private:
    std::string name_;
};

TEST(SelectBackend, FirstRankedThatReachesOrTheForcedOne) {
    PrefixBackend a("a"), ab("ab");
    auto find = [&](std::string_view n) -> Backend* {
        if (n == "a") return &a;
        if (n == "ab") return &ab;
        return nullptr;
    };
    AgentMetadata self, peer;
    peer.name = "abc";
    EXPECT_EQ(::ferry::testing::ValueOrDie(SelectBackend({"ab", "a"}, find, "", self, peer)), "ab");
    EXPECT_EQ(::ferry::testing::ValueOrDie(SelectBackend({"a", "ab"}, find, "", self, peer)), "a");
    peer.name = "axe";
    EXPECT_EQ(::ferry::testing::ValueOrDie(SelectBackend({"ab", "a"}, find, "", self, peer)), "a");
    EXPECT_THAT(SelectBackend({"ab", "a"}, find, "ab", self, peer).status(),
                StatusHas(Code::kFailedPrecondition, "forced backend ab cannot reach peer axe"));
    peer.name = "zed";
    EXPECT_THAT(SelectBackend({"ab", "a"}, find, "", self, peer).status(),
                StatusHas(Code::kFailedPrecondition, "no common backend with peer zed"));
}

AgentMetadata Md(std::string name, uint64_t epoch, RegionId region) {
    AgentMetadata md;
    md.name = std::move(name);
    md.epoch = epoch;
    md.regions = {{region, 4096, 1, MemoryKind::kHost}};
    return md;
}

TEST(PeerTable, SameEpochRefreshesANewEpochReplaces) {
    PeerTable t;
    std::shared_ptr<Peer> replaced;
    t.Upsert(Md("decode-0", 5, 1), "tcp", &replaced);
    EXPECT_EQ(replaced, nullptr);
    std::shared_ptr<Peer> first = t.Find("decode-0");
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(first->name, "decode-0");
    // The same process with more regions: the entry is the same, the backend stays.
    t.Upsert(Md("decode-0", 5, 2), "shm", &replaced);
    EXPECT_EQ(replaced, nullptr);
    EXPECT_EQ(t.Find("decode-0"), first);
    EXPECT_EQ(first->backend, "tcp");
    EXPECT_EQ(first->md.regions[0].id, 2u);
    // A copy of an older revision (a store event that arrives after the side channel's answer)
    // does not take back what a newer one added; an equal or newer one is taken.
    AgentMetadata newer = Md("decode-0", 5, 3);
    newer.revision = 4;
    t.Upsert(newer, "tcp", &replaced);
    AgentMetadata stale = Md("decode-0", 5, 1);
    stale.revision = 2;
    t.Upsert(stale, "tcp", &replaced);
    EXPECT_EQ(replaced, nullptr);
    EXPECT_EQ(first->md.regions[0].id, 3u);
    EXPECT_EQ(first->md.revision, 4u);
    newer.regions[0].id = 2;
    t.Upsert(newer, "tcp", &replaced);
    EXPECT_EQ(first->md.regions[0].id, 2u);
    // A restarted process: a new entry, the old one handed back to be closed.
    t.Upsert(Md("decode-0", 9, 1), "shm", &replaced);
    EXPECT_EQ(replaced, first);
    std::shared_ptr<Peer> second = t.Find("decode-0");
    ASSERT_NE(second, nullptr);
    EXPECT_NE(second, first);
    EXPECT_EQ(second->md.epoch, 9u);
    EXPECT_EQ(second->backend, "shm");
    EXPECT_EQ(t.Remove("decode-0"), second);
    EXPECT_EQ(t.Remove("decode-0"), nullptr);
    EXPECT_EQ(t.Find("decode-0"), nullptr);
}

TEST(NotificationQueue, BoundedInBytesOrderedAndWaitable) {
    NotificationQueue q(10);
    EXPECT_TRUE(q.Push("a", "12345"));
    EXPECT_TRUE(q.Push("b", "6789"));
    EXPECT_FALSE(q.Push("c", "xy")) << "11 bytes would exceed the bound of 10";
    EXPECT_EQ(q.bytes(), 9u);
    std::vector<Notification> got = q.Take();
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0].peer, "a");
    EXPECT_EQ(got[1].payload, "6789");
    EXPECT_EQ(q.bytes(), 0u);
    EXPECT_TRUE(q.Push("c", "xy")) << "taking them freed the room";
    (void)q.Take();
    // Wait returns as soon as one arrives, and for good once closed.
    std::thread pusher([&] { q.Push("d", "late"); });
    std::vector<Notification> waited = q.Wait(Clock::now() + std::chrono::seconds(30));
    pusher.join();
    ASSERT_EQ(waited.size(), 1u);
    EXPECT_EQ(waited[0].peer, "d");
    q.Close();
    EXPECT_TRUE(::ferry::testing::FinishesWithin(std::chrono::seconds(5), [&] {
        EXPECT_TRUE(q.Wait(Clock::now() + std::chrono::hours(1)).empty());
    }));
}

TEST(ObjectDirectory, ChecksTheRegionsWhenPublishedAndWhenPulled) {
    RegionTable regions;
    ObjectDirectory objects(regions);
    RegionInfo r = ::ferry::testing::ValueOrDie(regions.Allocate(8192));
    EXPECT_THAT(objects.Publish("", {{r.id, 0, 10}}), StatusHas(Code::kInvalidArgument, "key"));
    EXPECT_THAT(objects.Publish("k", {{r.id, 8000, 1000}}), StatusIs(Code::kOutOfRange));
    EXPECT_THAT(objects.Publish("k", {{r.id + 1, 0, 10}}), StatusIs(Code::kNotFound));
    FERRY_ASSERT_OK(objects.Publish("k", {{r.id, 100, 10}, {r.id, 0, 5}}));
    std::vector<RegionPin> pins;
    std::vector<iovec> iov;
    uint64_t size = 0;
    FERRY_ASSERT_OK(objects.Resolve("k", &pins, &iov, &size));
    EXPECT_EQ(size, 15u);
    ASSERT_EQ(iov.size(), 2u);
    EXPECT_EQ(iov[0].iov_base, static_cast<uint8_t*>(r.base) + 100);
    EXPECT_EQ(pins.size(), 1u);
    pins.clear();
    EXPECT_THAT(objects.Resolve("nope", &pins, &iov, &size), StatusHas(Code::kNotFound, "'nope'"));
    // Its region gone: the object is gone too.
    FERRY_ASSERT_OK(regions.Deregister(r.id, std::chrono::seconds(1), nullptr));
    EXPECT_THAT(objects.Resolve("k", &pins, &iov, &size), StatusIs(Code::kNotFound));
    FERRY_EXPECT_OK(objects.Unpublish("k"));
    EXPECT_THAT(objects.Unpublish("k"), StatusIs(Code::kNotFound));
}

}  // namespace
}  // namespace ferry::internal
