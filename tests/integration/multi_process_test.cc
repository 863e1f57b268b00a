// Several real processes on loopback: data verified byte for byte, three agents relaying,
// SIGKILL and SIGSTOP mid-transfer, and the deployment secret across processes.
#include <signal.h>

#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>

#include "testing/process.h"
#include "testing/testing.h"

namespace ferry {
namespace {

using ::ferry::testing::ChildProcess;
using ::ferry::testing::OpenFds;
using ::ferry::testing::StatusIs;
using ::ferry::testing::TestConfig;
using ::ferry::testing::ValueOrDie;
using std::chrono::milliseconds;
using std::chrono::seconds;

uint8_t PeerByte(uint64_t i, uint64_t seed) { return static_cast<uint8_t>((i * seed + seed) >> 3); }

uint64_t Fnv1a(const uint8_t* p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

struct Peer {
    ChildProcess process;
    std::string address;
    RegionId region = 0;
};

class MultiProcess : public ::testing::TestWithParam<std::string> {
  protected:
    Peer StartPeer(const std::string& name, uint64_t seed, uint64_t region_size = 1 << 20,
                   const std::string& secret = "", bool ucx_rma = false) {
        std::vector<std::string> argv = {
            FERRY_TEST_PEER,      "--name",        name,
            "--backend",          GetParam(),      "--seed",
            std::to_string(seed), "--region-size", std::to_string(region_size)};
        if (!secret.empty()) argv.insert(argv.end(), {"--secret", secret});
        if (ucx_rma) argv.push_back("--ucx-rma");
        std::string line;
        Peer p;
        // Generous: a sanitizer build fills a large region slowly.
        p.process =
            ValueOrDie(ChildProcess::Start(argv, "READY ", &line, seconds(60)), "start peer");
        std::istringstream in(line);
        in >> p.address >> p.region;
        return p;
    }

    std::unique_ptr<Agent> Me(const std::string& secret = "") {
        AgentConfig c = TestConfig("test-driver", GetParam());
        c.secret = secret;
        return ValueOrDie(Agent::Create(c));
    }

    // Sends a command to a peer process and waits for its reply.
    std::string Command(Agent& me, const std::string& peer, const std::string& cmd,
                        std::chrono::milliseconds wait = seconds(30)) {
        EXPECT_TRUE(me.Notify(peer, cmd).ok());
        auto end = Clock::now() + wait;
        while (Clock::now() < end) {
            for (auto& n : me.WaitNotifications(end)) {
                if (n.peer == peer) return n.payload;
            }
        }
        return "timeout";
    }
};

TEST_P(MultiProcess, TwoProcessesReadAndWriteVerified) {
    Peer p = StartPeer("peer-1", 3, 8u << 20);
    auto me = Me();
    ASSERT_EQ(ValueOrDie(me->Connect(p.address)), "peer-1");
    EXPECT_EQ(ValueOrDie(me->PeerBackend("peer-1")), GetParam());
    const uint64_t n = 8u << 20;
    RegionInfo mine = ValueOrDie(me->AllocateRegion(n));
    auto x = ValueOrDie(me->PostRead(std::vector<Descriptor>{{mine.id, 0, n}}, "peer-1",
                                     std::vector<Descriptor>{{p.region, 0, n}}));
    FERRY_ASSERT_OK(x.Wait(seconds(30)));
    auto* b = static_cast<uint8_t*>(mine.base);
    for (uint64_t i = 0; i < n; ++i) {
        ASSERT_EQ(b[i], PeerByte(i, 3)) << "byte " << i;
    }
    // Write something else into the middle, read it all back.
    for (uint64_t i = 0; i < 1000; ++i) b[i] = static_cast<uint8_t>(i * 7);
    auto w = ValueOrDie(me->PostWrite(std::vector<Descriptor>{{mine.id, 0, 1000}}, "peer-1",
                                      std::vector<Descriptor>{{p.region, 5000, 1000}}));
    FERRY_ASSERT_OK(w.Wait(seconds(30)));
    RegionInfo check = ValueOrDie(me->AllocateRegion(n));
    auto r = ValueOrDie(me->PostRead(std::vector<Descriptor>{{check.id, 0, n}}, "peer-1",
                                     std::vector<Descriptor>{{p.region, 0, n}}));
    FERRY_ASSERT_OK(r.Wait(seconds(30)));
    auto* c = static_cast<uint8_t*>(check.base);
    for (uint64_t i = 0; i < n; ++i) {
        uint8_t want =
            (i >= 5000 && i < 6000) ? static_cast<uint8_t>((i - 5000) * 7) : PeerByte(i, 3);
        ASSERT_EQ(c[i], want) << "byte " << i;
    }
}

TEST_P(MultiProcess, ThreeProcessesRelay) {
    Peer p1 = StartPeer("peer-1", 5);
    Peer p2 = StartPeer("peer-2", 11);
    auto me = Me();
    ASSERT_TRUE(me->Connect(p1.address).ok());
    ASSERT_TRUE(me->Connect(p2.address).ok());
    // A process replies only to agents it knows: peer-1 first connects back to us (its reply
    // arrives once it has), then to peer-2, and pulls peer-2's region into its own.
    EXPECT_EQ(Command(*me, "peer-1", "connect " + me->ListenAddress()), "connected test-driver");
    EXPECT_EQ(Command(*me, "peer-1", "connect " + p2.address), "connected peer-2");
    std::string reply =
        Command(*me, "peer-1", "copy-from peer-2 " + std::to_string(p2.region) + " 1048576");
    std::vector<uint8_t> expect(1 << 20);
    for (uint64_t i = 0; i < expect.size(); ++i) expect[i] = PeerByte(i, 11);
    EXPECT_EQ(reply, "copied " + std::to_string(Fnv1a(expect.data(), expect.size())));
    // And the bytes really are in peer-1 now.
    RegionInfo mine = ValueOrDie(me->AllocateRegion(1 << 20));
    auto x = ValueOrDie(me->PostRead(std::vector<Descriptor>{{mine.id, 0, 1 << 20}}, "peer-1",
                                     std::vector<Descriptor>{{p1.region, 0, 1 << 20}}));
    FERRY_ASSERT_OK(x.Wait(seconds(30)));
    EXPECT_EQ(std::memcmp(mine.base, expect.data(), expect.size()), 0);
}

TEST_P(MultiProcess, SigkillMidTransferFailsEveryPendingTransferWithin2s) {
    // 24 transfers on disjoint slices on both sides: overlapping destinations would race.
    const uint64_t slice = 8u << 20;
    const uint64_t n = 24 * slice;
    Peer p = StartPeer("victim", 1, n);
    // The peer copies (on shm, one-sided copies into a dead peer's memory would just complete:
    // OneSidedShmCopiesWhileThePeerIsStopped covers that path).
    AgentConfig c = TestConfig("test-driver", GetParam());
    c.shm_map_peer_regions = false;
    auto me = ValueOrDie(Agent::Create(c));
    ASSERT_TRUE(me->Connect(p.address).ok());
    RegionInfo mine = ValueOrDie(me->AllocateRegion(n));
    std::vector<Transfer> xs;
    for (uint64_t i = 0; i < 24; ++i) {
        auto desc = std::vector<Descriptor>{{mine.id, i * slice, slice}};
        auto rdesc = std::vector<Descriptor>{{p.region, i * slice, slice}};
        xs.push_back(ValueOrDie(i % 2 ? me->PostRead(desc, "victim", rdesc)
                                      : me->PostWrite(desc, "victim", rdesc)));
    }
    p.process.Signal(SIGKILL);
    auto killed = Clock::now();
    int failed = 0;
    for (auto& x : xs) {
        Status s = x.Wait(seconds(10));
        if (!s.ok()) {
            EXPECT_THAT(s, StatusIs(Code::kUnavailable));
            ++failed;
        }
    }
    EXPECT_LT(Clock::now() - killed, seconds(2));
    EXPECT_GT(failed, 0) << "the peer finished all 192 MiB before the kill landed";
    p.process.Kill();
}

TEST_P(MultiProcess, SigstopHitsTheDeadlineAndTheAgentRecoversAfterSigcont) {
    Peer p = StartPeer("sleeper", 1);
    AgentConfig c = TestConfig("test-driver", GetParam());
    c.shm_map_peer_regions = false;  // the peer copies, so a stopped peer stalls the transfer
    auto me = ValueOrDie(Agent::Create(c));
    ASSERT_TRUE(me->Connect(p.address).ok());
    RegionInfo mine = ValueOrDie(me->AllocateRegion(1 << 20));
    auto desc = std::vector<Descriptor>{{mine.id, 0, 1 << 20}};
    auto rdesc = std::vector<Descriptor>{{p.region, 0, 1 << 20}};
    // Warm the connections up first.
    FERRY_ASSERT_OK(ValueOrDie(me->PostRead(desc, "sleeper", rdesc)).Wait(seconds(10)));
    ASSERT_TRUE(p.process.Stop());
    TransferOptions opts;
    opts.timeout = milliseconds(500);
    auto t0 = Clock::now();
    auto x = ValueOrDie(me->PostRead(desc, "sleeper", rdesc, opts));
    EXPECT_THAT(x.Wait(seconds(10)), StatusIs(Code::kDeadlineExceeded));
    EXPECT_LT(Clock::now() - t0, seconds(3));
    p.process.Signal(SIGCONT);
    auto y = ValueOrDie(me->PostRead(desc, "sleeper", rdesc));
    FERRY_EXPECT_OK(y.Wait(seconds(10)));
    EXPECT_EQ(static_cast<uint8_t*>(mine.base)[12345], PeerByte(12345, 1));
}

TEST_P(MultiProcess, OneSidedShmCopiesWhileThePeerIsStopped) {
    if (GetParam() != "shm") {
        GTEST_SKIP() << "one-sided copies are a shm property";
    }
    Peer p = StartPeer("sleeper", 7, 4 << 20);
    auto me = Me();
    ASSERT_TRUE(me->Connect(p.address).ok());
    RegionInfo mine = ValueOrDie(me->AllocateRegion(4 << 20));
    auto desc = std::vector<Descriptor>{{mine.id, 0, 4 << 20}};
    auto rdesc = std::vector<Descriptor>{{p.region, 0, 4 << 20}};
    // The first transfer is copied by the peer and asks for the mapping; once it is granted,
    // transfers are one-sided.
    auto end = Clock::now() + seconds(10);
    while (me->Stats().one_sided_transfers == 0 && Clock::now() < end) {
        FERRY_ASSERT_OK(ValueOrDie(me->PostRead(desc, "sleeper", rdesc)).Wait(seconds(10)));
    }
    ASSERT_GT(me->Stats().one_sided_transfers, 0u);
    std::memset(mine.base, 0, 4 << 20);
    ASSERT_TRUE(p.process.Stop());
    TransferOptions opts;
    opts.timeout = milliseconds(2000);
    Status s = ValueOrDie(me->PostRead(desc, "sleeper", rdesc, opts)).Wait(seconds(10));
    p.process.Signal(SIGCONT);
    FERRY_ASSERT_OK(s);
    for (size_t i : {size_t{0}, size_t{12345}, size_t{(4 << 20) - 1}}) {
        EXPECT_EQ(static_cast<uint8_t*>(mine.base)[i], PeerByte(i, 7)) << i;
    }
    // Once the peer is dead and its streams have closed, its mappings are dropped here and
    // transfers to it fail.
    p.process.Kill();
    auto t0 = Clock::now();
    Status after;
    do {
        auto x = me->PostRead(desc, "sleeper", rdesc);
        after = x.ok() ? x->Wait(seconds(10)) : x.status();
    } while (after.ok() && Clock::now() - t0 < seconds(2));
    EXPECT_THAT(after, StatusIs(Code::kUnavailable));
}

TEST_P(MultiProcess, DeploymentSecretAcrossProcesses) {
    Peer p = StartPeer("guarded", 1, 1 << 20, "team-secret");
    EXPECT_THAT(Me()->Connect(p.address), StatusIs(Code::kPermissionDenied));
    EXPECT_THAT(Me("wrong")->Connect(p.address), StatusIs(Code::kPermissionDenied));
    auto me = Me("team-secret");
    ASSERT_TRUE(me->Connect(p.address).ok());
    RegionInfo mine = ValueOrDie(me->AllocateRegion(4096));
    auto x = ValueOrDie(me->PostRead(std::vector<Descriptor>{{mine.id, 0, 4096}}, "guarded",
                                     std::vector<Descriptor>{{p.region, 0, 4096}}));
    FERRY_EXPECT_OK(x.Wait(seconds(10)));
}

TEST_P(MultiProcess, DeregisterDisconnectsAStoppedGranteeAndTheRegionGoes) {
    if (GetParam() != "ucx") GTEST_SKIP() << "grants are the ucx backend's one-sided access";
    // We grant our region to a peer (it reads it one-sided), then the peer stops (SIGSTOP) and we
    // deregister: it cannot acknowledge the revocation, so after the grace period we disconnect
    // it, and Deregister returns. Once it runs again, it cannot reach the region.
    Peer p = StartPeer("grantee", 9, 1 << 20, "", /*ucx_rma=*/true);
    auto me = ValueOrDie(Agent::Create(TestConfig("test-driver", "ucx_rma")));
    ASSERT_EQ(ValueOrDie(me->Connect(p.address)), "grantee");
    RegionInfo mine = ValueOrDie(me->AllocateRegion(1 << 20));
    RegionInfo other = ValueOrDie(me->AllocateRegion(1 << 20));
    for (uint64_t i = 0; i < (1 << 20); ++i) static_cast<uint8_t*>(mine.base)[i] = i * 13 >> 2;
    EXPECT_EQ(Command(*me, "grantee", "connect " + me->ListenAddress()), "connected test-driver");
    EXPECT_THAT(
        Command(*me, "grantee", "copy-from test-driver " + std::to_string(mine.id) + " 1048576"),
        ::testing::StartsWith("copied "));
    ASSERT_TRUE(p.process.Stop());
    auto t0 = Clock::now();
    FERRY_ASSERT_OK(me->Deregister(mine.id));
    auto took = Clock::now() - t0;
    EXPECT_GE(took, milliseconds(1500)) << "Deregister did not wait for the grantee";
    EXPECT_LT(took, seconds(10));
    p.process.Signal(SIGCONT);
    // The grantee was disconnected (both ways: UCX pairs the connections), and each side
    // waits a moment before reconnecting to the other: commands and answers may be lost until
    // then. The region it held is gone for it.
    std::string again;
    for (auto end = Clock::now() + seconds(20); Clock::now() < end;) {
        again = Command(*me, "grantee",
                        "copy-from test-driver " + std::to_string(mine.id) + " 4096", seconds(2));
        if (again != "timeout") break;
    }
    EXPECT_THAT(again, ::testing::StartsWith("error ")) << again;
    // And we still serve it what is still registered.
    std::string ok;
    for (auto end = Clock::now() + seconds(20); Clock::now() < end;) {
        ok = Command(*me, "grantee", "copy-from test-driver " + std::to_string(other.id) + " 4096",
                     seconds(2));
        if (ok.rfind("copied ", 0) == 0) break;
        std::this_thread::sleep_for(milliseconds(200));
    }
    EXPECT_THAT(ok, ::testing::StartsWith("copied "));
}

TEST_P(MultiProcess, KilledPeersLeaveNoDescriptorsBehind) {
    // Each peer reads from us (so we serve it) and we read from it, then it is killed: what
    // either side opened for it must close once we learn of its death and drop it.
    auto me = Me();
    RegionInfo mine = ValueOrDie(me->AllocateRegion(1 << 20));
    auto cycle = [&](int i) {
        const std::string name = "victim-" + std::to_string(i);
        Peer p = StartPeer(name, 7);
        ASSERT_EQ(ValueOrDie(me->Connect(p.address)), name);
        EXPECT_EQ(Command(*me, name, "connect " + me->ListenAddress()), "connected test-driver");
        EXPECT_THAT(
            Command(*me, name, "copy-from test-driver " + std::to_string(mine.id) + " 65536"),
            ::testing::StartsWith("copied "));
        auto x = ValueOrDie(me->PostRead(std::vector<Descriptor>{{mine.id, 0, 65536}}, name,
                                         std::vector<Descriptor>{{p.region, 0, 65536}}));
        FERRY_ASSERT_OK(x.Wait(seconds(30)));
        p.process.Kill();
        // We learn of the death by using the peer (or by the backend's keepalive).
        auto end = Clock::now() + seconds(10);
        Status s;
        do {
            auto y = me->PostRead(std::vector<Descriptor>{{mine.id, 0, 4096}}, name,
                                  std::vector<Descriptor>{{p.region, 0, 4096}});
            s = y.ok() ? y->Wait(seconds(5)) : y.status();
            if (s.ok()) std::this_thread::sleep_for(milliseconds(50));
        } while (s.ok() && Clock::now() < end);
        EXPECT_THAT(s, StatusIs(Code::kUnavailable));
        FERRY_EXPECT_OK(me->RemovePeer(name));
    };
    // The first peer may bring process-wide resources that stay (UCX's async timer, say).
    cycle(0);
    const size_t before = OpenFds().size();
    for (int i = 1; i <= 3; ++i) cycle(i);
    size_t fds = OpenFds().size();
    for (auto end = Clock::now() + seconds(15); fds > before && Clock::now() < end;) {
        std::this_thread::sleep_for(milliseconds(100));
        fds = OpenFds().size();
    }
    EXPECT_LE(fds, before) << "descriptors left open after three peers were killed and dropped";
}

INSTANTIATE_TEST_SUITE_P(Backends, MultiProcess, ::testing::ValuesIn(AvailableBackends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry
