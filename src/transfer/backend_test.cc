#include "transfer/backend.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "testing/testing.h"

namespace ferry {
namespace {

BackendCapabilities Caps(Locality l, DataPath p, bool one_sided) {
    BackendCapabilities c;
    c.locality = l;
    c.data_path = p;
    c.one_sided = one_sided;
    return c;
}

TEST(RankBackends, SameHostThenOwnDataPathThenOneSidedThenName) {
    const auto stream_any = Caps(Locality::kAnyHost, DataPath::kStream, false);
    const auto own_any = Caps(Locality::kAnyHost, DataPath::kOwn, false);
    const auto own_any_rma = Caps(Locality::kAnyHost, DataPath::kOwn, true);
    const auto stream_local = Caps(Locality::kSameHost, DataPath::kStream, true);
    const auto stream_any_1s = Caps(Locality::kAnyHost, DataPath::kStream, true);
    // Today's three: shm, ucx, tcp, whatever order they are offered in.
    for (auto order : {std::vector<std::string>{"tcp", "ucx", "shm"},
                       std::vector<std::string>{"ucx", "shm", "tcp"},
                       std::vector<std::string>{"shm", "tcp", "ucx"}}) {
        std::vector<std::pair<std::string, BackendCapabilities>> in;
        for (const auto& n : order) {
            in.emplace_back(n, n == "shm" ? stream_local : n == "ucx" ? own_any : stream_any);
        }
        EXPECT_EQ(RankBackends(in), (std::vector<std::string>{"shm", "ucx", "tcp"}));
    }
    // Each key decides where the ones before it tie.
    EXPECT_EQ(RankBackends({{"a", own_any}, {"b", own_any_rma}}),
              (std::vector<std::string>{"b", "a"}));
    EXPECT_EQ(RankBackends({{"a", stream_any}, {"b", stream_any_1s}}),
              (std::vector<std::string>{"b", "a"}));
    EXPECT_EQ(RankBackends({{"z", stream_any}, {"y", stream_any}}),
              (std::vector<std::string>{"y", "z"}));
    EXPECT_EQ(RankBackends({{"fabric", own_any_rma}, {"local", stream_local}}),
              (std::vector<std::string>{"local", "fabric"}));
    EXPECT_TRUE(RankBackends({}).empty());
}

TEST(BackendRegistry, EveryRegisteredBackendIsCreatedUnderItsNameAndOneCarriesTheSideChannel) {
    const std::vector<std::string> known = KnownBackends();
    ASSERT_FALSE(known.empty());
    EXPECT_EQ(known, AvailableBackends());
    AgentConfig config;
    config.name = "registry-test";
    bool side_channel = false;
    for (const std::string& n : known) {
        auto b = CreateBackend(n, config, LocalHostId());
        ASSERT_TRUE(b.ok()) << n << ": " << b.status().ToString();
        EXPECT_EQ((*b)->name(), n);
        const BackendCapabilities c = (*b)->capabilities();
        EXPECT_TRUE(c.touches(MemoryKind::kHost)) << n;
        if (c.side_channel) {
            side_channel = true;
            EXPECT_EQ(c.data_path, DataPath::kStream) << n << ": the side channel is a stream";
            EXPECT_EQ(c.locality, Locality::kAnyHost) << n;
        }
    }
    EXPECT_TRUE(side_channel);
    auto missing = CreateBackend("carrier-pigeon", config, LocalHostId());
    ASSERT_FALSE(missing.ok());
    EXPECT_EQ(missing.status().code(), Code::kNotFound);
    EXPECT_NE(missing.status().message().find("carrier-pigeon"), std::string::npos);
    EXPECT_NE(missing.status().message().find(known[0]), std::string::npos)
        << "the error lists the known backends: " << missing.status().message();
}

TEST(BackendRegistry, OptionalOperationsOfAStreamBackendAreUnimplemented) {
    AgentConfig config;
    config.name = "registry-test";
    auto b = testing::ValueOrDie(CreateBackend("tcp", config, LocalHostId()));
    EXPECT_EQ(b->capabilities().data_path, DataPath::kStream);
    Status s = b->Notify(PeerRef{"p", 1, "x"}, "payload", "me");
    EXPECT_EQ(s.code(), Code::kUnimplemented) << s.ToString();
}

TEST(BackendRegistry, TheSelfBackendIsSeparateAndNeverReachesAPeer) {
    AgentConfig config;
    config.name = "registry-test";
    auto self = testing::ValueOrDie(CreateSelfBackend(config, LocalHostId()));
    const BackendCapabilities c = self->capabilities();
    EXPECT_EQ(c.locality, Locality::kSelf);
    EXPECT_EQ(c.data_path, DataPath::kOwn);
    EXPECT_TRUE(c.touches(MemoryKind::kFile));
    EXPECT_FALSE(c.side_channel);
    // Not a backend for peers: not listed, not selectable in AgentConfig.backends.
    const std::vector<std::string> known = KnownBackends();
    EXPECT_EQ(std::find(known.begin(), known.end(), std::string(self->name())), known.end());
    AgentMetadata me, peer;
    me.name = "registry-test";
    peer.name = "other";
    EXPECT_FALSE(self->CanReach(me, peer));
    EXPECT_FALSE(self->CanReach(me, me));
    // A backend for peers moves nothing between an agent's own regions.
    auto tcp = testing::ValueOrDie(CreateBackend("tcp", config, LocalHostId()));
    EXPECT_EQ(tcp->PlanSelf(true, {}, {}).status().code(), Code::kUnimplemented);
}

}  // namespace
}  // namespace ferry
