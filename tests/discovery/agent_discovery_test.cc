// Agents registering in a discovery store and finding each other by name, against the embedded
// store and a private etcd: real processes, SIGKILL, restarts under the same name, secrets, and
// the store itself restarting under running agents.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstring>
#include <sstream>
#include <thread>

#include "discovery/private_etcd.h"
#include "ferry/agent.h"
#include "ferry/discovery.h"
#include "testing/process.h"
#include "testing/testing.h"
#include "transfer/metadata.h"

namespace ferry {
namespace {

using ::ferry::testing::ChildProcess;
using ::ferry::testing::FreePort;
using ::ferry::testing::HaveEtcd;
using ::ferry::testing::PrivateEtcd;
using ::ferry::testing::StatusIs;
using ::ferry::testing::ValueOrDie;
using std::chrono::milliseconds;
using std::chrono::seconds;

class AgentDiscovery : public ::testing::TestWithParam<std::string> {
  protected:
    static void SetUpTestSuite() {
        if (HaveEtcd()) etcd_ = PrivateEtcd::Start().release();
    }
    static void TearDownTestSuite() {
        delete etcd_;
        etcd_ = nullptr;
    }

    void SetUp() override {
        if (GetParam() == "etcd") {
            ASSERT_NE(etcd_, nullptr) << "no private etcd (is etcd-server installed?)";
            url_ = etcd_->url();
        } else {
            StartEmbedded(0, "");
        }
        // Names unique per test: etcd outlives the tests of the suite.
        tag_ = std::to_string(++counter_);
        store_ = ValueOrDie(MetadataStore::Open(url_, {.secret = secret_}));
    }

    void StartEmbedded(uint16_t port, const std::string& secret) {
        StoreServerConfig c;
        c.listen_port = port;
        c.secret = secret;
        server_.reset();
        server_ = ValueOrDie(StoreServer::Start(c));
        url_ = server_->url();
    }

    std::string Name(const std::string& base) const { return base + "-" + tag_; }

    std::unique_ptr<Agent> MakeAgent(const std::string& name, milliseconds ttl = seconds(2)) {
        AgentConfig c = ::ferry::testing::TestConfig(name, "tcp");
        c.store = url_;
        c.store_ttl = ttl;
        c.secret = secret_;
        return ValueOrDie(Agent::Create(c));
    }

    struct Peer {
        ChildProcess process;
        std::string address;
        RegionId region = 0;
    };
    Peer StartPeer(const std::string& name, uint64_t seed, int skip_regions = 0) {
        std::vector<std::string> argv = {FERRY_TEST_PEER,
                                         "--name",
                                         name,
                                         "--backend",
                                         "tcp",
                                         "--seed",
                                         std::to_string(seed),
                                         "--store",
                                         url_,
                                         "--store-ttl-ms",
                                         "2000",
                                         "--skip-regions",
                                         std::to_string(skip_regions)};
        std::string line;
        Peer p;
        p.process = ValueOrDie(ChildProcess::Start(argv, "READY ", &line, seconds(30)), "peer");
        std::istringstream in(line);
        in >> p.address >> p.region;
        return p;
    }

    // Waits until `pred` holds (polling), up to `limit`; returns how long it took.
    template <typename P>
    Clock::duration Until(P pred, Clock::duration limit) {
        auto t0 = Clock::now();
        while (!pred() && Clock::now() - t0 < limit) {
            std::this_thread::sleep_for(milliseconds(50));
        }
        return Clock::now() - t0;
    }

    std::unique_ptr<StoreServer> server_;
    std::string url_;
    std::string tag_;
    std::string secret_;
    std::unique_ptr<MetadataStore> store_;
    static PrivateEtcd* etcd_;
    static int counter_;
};
PrivateEtcd* AgentDiscovery::etcd_ = nullptr;
int AgentDiscovery::counter_ = 0;

TEST_P(AgentDiscovery, ConnectByNameThenTransferAndLeaveOnShutdown) {
    auto a = MakeAgent(Name("a"));
    auto b = MakeAgent(Name("b"));
    RegionInfo rb = ValueOrDie(b->AllocateRegion(1 << 20));
    RegionInfo la = ValueOrDie(a->AllocateRegion(1 << 20));
    // ConnectByName finds b in the store, then asks b itself for its current regions.
    ASSERT_EQ(ValueOrDie(a->ConnectByName(Name("b"))), Name("b"));
    ::ferry::testing::FillPattern(la.base, 1 << 20, 11);
    auto x = ValueOrDie(a->PostWrite(std::vector<Descriptor>{{la.id, 0, 1 << 20}}, Name("b"),
                                     std::vector<Descriptor>{{rb.id, 0, 1 << 20}}));
    FERRY_ASSERT_OK(x.Wait(seconds(10)));
    EXPECT_EQ(::ferry::testing::FirstMismatch(rb.base, 1 << 20, 11), -1);

    EXPECT_THAT(a->ConnectByName(Name("nobody")), StatusIs(Code::kNotFound));
    auto plain = ValueOrDie(Agent::Create(::ferry::testing::TestConfig(Name("plain"), "tcp")));
    EXPECT_THAT(plain->ConnectByName(Name("b")), StatusIs(Code::kFailedPrecondition));

    // The store entry follows b's regions too.
    Until(
        [&] {
            auto e = store_->Get(AgentKey(Name("b")));
            return e.ok() && e->value == b->Metadata();
        },
        seconds(5));
    EXPECT_EQ(ValueOrDie(store_->Get(AgentKey(Name("b")))).value, b->Metadata());
    b.reset();  // clean shutdown: the entry goes at once, not at the end of the lease
    EXPECT_THAT(store_->Get(AgentKey(Name("b"))), StatusIs(Code::kNotFound));
}

// An agent reachable only through the store (shm: no side channel) is known to its peers by its
// store entry alone: a region is in that entry as soon as registering it returns, and one
// deregistered is gone from it as soon as that returns.
TEST_P(AgentDiscovery, TheStoreEntryHoldsARegionOnceRegisteringItReturns) {
    auto a = MakeAgent(Name("regions"));
    for (int i = 0; i < 3; ++i) {
        RegionInfo r = ValueOrDie(a->AllocateRegion(4096));
        auto md = DecodeMetadata(ValueOrDie(store_->Get(AgentKey(Name("regions")))).value);
        ASSERT_TRUE(md.ok()) << md.status().ToString();
        EXPECT_NE(md->FindRegion(r.id), nullptr) << "region " << r.id;
        FERRY_ASSERT_OK(a->Deregister(r.id));
        md = DecodeMetadata(ValueOrDie(store_->Get(AgentKey(Name("regions")))).value);
        ASSERT_TRUE(md.ok());
        EXPECT_EQ(md->FindRegion(r.id), nullptr) << "region " << r.id;
    }
}

TEST_P(AgentDiscovery, ASigkilledAgentIsGoneWithinItsTtlPlusOneSecond) {
    Peer p = StartPeer(Name("victim"), 3);
    StoreEntry e = ValueOrDie(store_->Get(AgentKey(Name("victim"))));
    EXPECT_NE(e.lease, 0);
    p.process.Signal(SIGKILL);
    // A deadline wait: gone by ttl 2 s + 1 s (and a little for the poll).
    EXPECT_TRUE(
        ::ferry::testing::WaitUntil([&] { return !store_->Get(AgentKey(Name("victim"))).ok(); },
                                    seconds(3) + milliseconds(300)))
        << "the entry outlived ttl 2 s + 1 s";
    EXPECT_THAT(store_->Get(AgentKey(Name("victim"))), StatusIs(Code::kNotFound));
    p.process.Kill();
}

TEST_P(AgentDiscovery, ARestartUnderTheSameNameIsNoticedAndTheOldEpochFails) {
    auto me = MakeAgent(Name("me"));
    Peer first = StartPeer(Name("worker"), 5);
    ASSERT_EQ(ValueOrDie(me->ConnectByName(Name("worker"))), Name("worker"));
    RegionInfo mine = ValueOrDie(me->AllocateRegion(1 << 20));
    auto desc = std::vector<Descriptor>{{mine.id, 0, 1 << 20}};
    FERRY_ASSERT_OK(ValueOrDie(me->PostRead(desc, Name("worker"),
                                            std::vector<Descriptor>{{first.region, 0, 1 << 20}}))
                        .Wait(seconds(10)));
    // The process dies and another takes its name.
    ASSERT_TRUE(first.process.Stop());
    TransferOptions opts;
    opts.timeout = seconds(20);
    auto pending = ValueOrDie(me->PostRead(
        desc, Name("worker"), std::vector<Descriptor>{{first.region, 0, 1 << 20}}, opts));
    first.process.Signal(SIGKILL);  // while stopped: it never serves the pending read
    first.process.Kill();
    // Its region gets another id than the old process's, so a descriptor of the old epoch names
    // no region of the new one.
    Peer second = StartPeer(Name("worker"), 6, /*skip_regions=*/1);
    ASSERT_NE(first.region, second.region);
    // The transfer to the old process fails with Unavailable (not at its 20 s deadline), and
    // the watch hands `me` the new process without another ConnectByName.
    EXPECT_THAT(pending.Wait(seconds(5)), StatusIs(Code::kUnavailable))
        << "not failed within 5 s of the restart (a DeadlineExceeded here is the wait's own)";
    Status s;
    Until(
        [&] {
            auto x = me->PostRead(desc, Name("worker"),
                                  std::vector<Descriptor>{{second.region, 0, 1 << 20}});
            s = x.ok() ? x->Wait(seconds(10)) : x.status();
            return s.ok();
        },
        seconds(5));
    FERRY_ASSERT_OK(s);
    EXPECT_EQ(static_cast<uint8_t*>(mine.base)[4096], static_cast<uint8_t>((4096 * 6 + 6) >> 3));
    // The old epoch's region is not the new process's: refused, never touched.
    auto old =
        me->PostRead(desc, Name("worker"), std::vector<Descriptor>{{first.region, 0, 1 << 20}});
    Status olds = old.ok() ? old->Wait(seconds(10)) : old.status();
    EXPECT_THAT(olds, StatusIs(Code::kNotFound));
    EXPECT_NE(olds.message().find(std::to_string(first.region)), std::string::npos)
        << olds.ToString();
}

TEST_P(AgentDiscovery, TheDeploymentSecretIsRequired) {
    if (GetParam() == "embedded") {
        StartEmbedded(0, "team");
        AgentConfig c = ::ferry::testing::TestConfig(Name("nosecret"), "tcp");
        c.store = url_;
        EXPECT_THAT(Agent::Create(c), StatusIs(Code::kPermissionDenied));
        c.secret = "wrong";
        EXPECT_THAT(Agent::Create(c), StatusIs(Code::kPermissionDenied));
        c.secret = "team";
        FERRY_EXPECT_OK(Agent::Create(c).status());
        return;
    }
    // etcd: an entry sealed with another secret is not believed.
    AgentConfig bad = ::ferry::testing::TestConfig(Name("impostor"), "tcp");
    bad.store = url_;
    bad.secret = "wrong";
    auto impostor = ValueOrDie(Agent::Create(bad));
    AgentConfig good = ::ferry::testing::TestConfig(Name("honest"), "tcp");
    good.store = url_;
    good.secret = "team";
    auto honest = ValueOrDie(Agent::Create(good));
    EXPECT_THAT(honest->ConnectByName(Name("impostor")), StatusIs(Code::kPermissionDenied));
}

TEST_P(AgentDiscovery, AgentsRegisterAgainWhenTheStoreRestarts) {
    auto a = MakeAgent(Name("survivor"), seconds(2));
    FERRY_ASSERT_OK(store_->Get(AgentKey(Name("survivor"))).status());
    if (GetParam() == "embedded") {
        uint16_t port = server_->port();
        server_->Stop();
        server_.reset();
        std::this_thread::sleep_for(milliseconds(300));
        StartEmbedded(port, "");  // a new, empty store on the same address
    } else {
        ASSERT_TRUE(etcd_->Restart());
    }
    EXPECT_TRUE(::ferry::testing::WaitUntil(
        [&] { return store_->Get(AgentKey(Name("survivor"))).ok(); }, seconds(4)))
        << "not registered again within 4 s of the store's restart";
    FERRY_ASSERT_OK(store_->Get(AgentKey(Name("survivor"))).status());
    // Someone deletes the entry by hand: the agent puts it back.
    FERRY_ASSERT_OK(store_->Delete(AgentKey(Name("survivor"))));
    Until([&] { return store_->Get(AgentKey(Name("survivor"))).ok(); }, seconds(5));
    FERRY_ASSERT_OK(store_->Get(AgentKey(Name("survivor"))).status());
}

INSTANTIATE_TEST_SUITE_P(Stores, AgentDiscovery, ::testing::Values("embedded", "etcd"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

// `ferry discovery` as a process, an agent registering there, `ferry discovery ls` listing it.
TEST(DiscoveryCommand, ServeRegisterAndList) {
    std::string line;
    auto store = ::ferry::testing::ValueOrDie(::ferry::testing::ChildProcess::Start(
        {FERRY_BIN, "discovery", "--listen", "127.0.0.1:0"}, "ferry discovery: store at ", &line));
    std::string url = line.substr(0, line.find(' '));
    AgentConfig c = ::ferry::testing::TestConfig("listed-agent", "tcp");
    c.store = url;
    auto agent = ::ferry::testing::ValueOrDie(Agent::Create(c));
    std::string cmd = std::string(FERRY_BIN) + " discovery ls --store " + url;
    FILE* f = popen(cmd.c_str(), "r");
    ASSERT_NE(f, nullptr);
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
    EXPECT_EQ(pclose(f), 0) << out;
    EXPECT_NE(out.find("listed-agent"), std::string::npos) << out;
    EXPECT_NE(out.find("tcp=127.0.0.1:"), std::string::npos) << out;
    EXPECT_NE(out.find("(1 agents"), std::string::npos) << out;
    // The store checks agent entries: a blob that is not metadata, or another agent's, is refused.
    auto direct = ::ferry::testing::ValueOrDie(MetadataStore::Open(url));
    Status bad = direct->Put(AgentKey("bogus"), "garbage");
    EXPECT_THAT(bad, ::ferry::testing::StatusIs(Code::kInvalidArgument));
    EXPECT_NE(bad.message().find("metadata"), std::string::npos) << bad.ToString();
    EXPECT_THAT(direct->Put(AgentKey("bogus"), agent->Metadata()),
                ::ferry::testing::StatusIs(Code::kInvalidArgument));
    FERRY_EXPECT_OK(direct->Put("elsewhere/anything", "garbage"));
    // A bad flag is refused with a message naming it.
    f = popen((std::string(FERRY_BIN) + " discovery ls --store nowhere 2>&1").c_str(), "r");
    out.clear();
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
    EXPECT_NE(pclose(f), 0);
    EXPECT_NE(out.find("--store"), std::string::npos) << out;
}

}  // namespace
}  // namespace ferry
