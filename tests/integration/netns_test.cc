// Fault injection across "hosts": two agents in network namespaces of their own, joined through
// a third ("router") namespace where ferry_impair_bridge forwards every frame and adds latency,
// loss, reordering or a cut link (a userspace netem: this kernel has no sch_netem).
//
//   ns A (10.77.x.1) --veth-- ns R [impair bridge] --veth-- ns B (10.77.x.2)
//
// Under each fault the initiator runs WRITE+READ-back rounds of mixed sizes: every transfer must
// either complete with the bytes intact or fail within its deadline; none may hang or corrupt.
// Needs root (CAP_NET_ADMIN) for `ip netns`; skipped with a message otherwise.
#include <unistd.h>

#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "testing/process.h"
#include "testing/testing.h"

namespace ferry {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using testing::ChildProcess;

int Sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

class NetnsFaults : public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        id_ = std::to_string(getpid() % 100000);
        a_ = "ferry-a" + id_;
        b_ = "ferry-b" + id_;
        r_ = "ferry-r" + id_;
        if (Sh("ip netns add " + a_) != 0) {
            GTEST_SKIP() << "cannot create network namespaces (needs root / CAP_NET_ADMIN)";
        }
        made_ = true;
        subnet_ = "10.77." + std::to_string(getpid() % 250) + ".";
        const std::string la = "fa" + id_, ra = "ra" + id_, lb = "fb" + id_, rb = "rb" + id_;
        std::vector<std::string> steps = {
            "ip netns add " + b_,
            "ip netns add " + r_,
            "ip link add " + la + " type veth peer name " + ra,
            "ip link add " + lb + " type veth peer name " + rb,
            "ip link set " + la + " netns " + a_,
            "ip link set " + lb + " netns " + b_,
            "ip link set " + ra + " netns " + r_,
            "ip link set " + rb + " netns " + r_,
            "ip -n " + a_ + " addr add " + subnet_ + "1/24 dev " + la,
            "ip -n " + b_ + " addr add " + subnet_ + "2/24 dev " + lb,
        };
        for (const auto& [ns, dev] : std::vector<std::pair<std::string, std::string>>{
                 {a_, la}, {b_, lb}, {r_, ra}, {r_, rb}, {a_, "lo"}, {b_, "lo"}}) {
            steps.push_back("ip -n " + ns + " link set " + dev + " up");
        }
        for (const std::string& s : steps) {
            ASSERT_EQ(Sh(s), 0) << s;
        }
        std::string line;
        bridge_ = testing::ValueOrDie(
            ChildProcess::Start({"/usr/bin/ip", "netns", "exec", r_, FERRY_IMPAIR_BRIDGE, ra, rb},
                                "READY", &line, seconds(20)),
            "start the bridge");
    }

    void TearDown() override {
        bridge_ = ChildProcess();
        if (made_) {
            for (const std::string& ns : {a_, b_, r_}) Sh("ip netns del " + ns);
        }
    }

    // "delay_ms jitter_ms loss reorder cut"
    void Impair(const std::string& settings) {
        ASSERT_TRUE(bridge_.WriteLine(settings).ok());
        ASSERT_TRUE(bridge_.ReadLine("SET", seconds(10)).ok());
    }

    // `ip netns exec NS [env UCX...] PROGRAM`: UCX is kept to the namespace's veth (its address
    // list would also offer the namespace's loopback, which means another host over there).
    std::vector<std::string> In(const std::string& ns, const std::string& dev) {
        std::vector<std::string> argv = {"/usr/bin/ip", "netns", "exec", ns};
        if (GetParam() == "ucx" || GetParam() == "ucx_rma") {
            argv.insert(argv.end(), {"/usr/bin/env", "UCX_TLS=tcp", "UCX_NET_DEVICES=" + dev});
        }
        argv.push_back(FERRY_NETNS_PEER);
        return argv;
    }

    ChildProcess StartTarget(std::string* address, std::string* region) {
        std::string line;
        std::vector<std::string> argv = In(b_, "fb" + id_);
        argv.insert(argv.end(),
                    {"--role", "target", "--listen", subnet_ + "2", "--backend", GetParam()});
        ChildProcess t = testing::ValueOrDie(
            ChildProcess::Start(argv, "READY ", &line, seconds(60)), "start the target");
        std::istringstream in(line);
        in >> *address >> *region;
        return t;
    }

    ChildProcess StartInitiator(const std::string& address, const std::string& region,
                                int transfers, int timeout_ms) {
        std::string line;
        std::vector<std::string> argv = In(a_, "fa" + id_);
        argv.insert(argv.end(),
                    {"--role", "initiator", "--peer", address, "--remote-region", region,
                     "--listen", subnet_ + "1", "--backend", GetParam(), "--transfers",
                     std::to_string(transfers), "--timeout-ms", std::to_string(timeout_ms)});
        return testing::ValueOrDie(ChildProcess::Start(argv, "CONNECTED", &line, seconds(60)),
                                   "start the initiator");
    }

    struct Summary {
        int ok = -1, failed = -1, corrupt = -1, late = -1;
        std::vector<std::string> lines;
    };
    Summary Wait(ChildProcess& initiator, seconds timeout) {
        Summary s;
        auto line = initiator.ReadLine("SUMMARY", timeout, &s.lines);
        EXPECT_TRUE(line.ok()) << "the initiator hung: " << line.status().ToString();
        if (line.ok()) {
            std::sscanf(line->c_str(), "SUMMARY ok=%d failed=%d corrupt=%d late=%d", &s.ok,
                        &s.failed, &s.corrupt, &s.late);
        }
        return s;
    }

    std::string Describe(const Summary& s) {
        std::string out;
        for (const auto& l : s.lines) out += l + "\n";
        return out;
    }

    std::string id_, a_, b_, r_, subnet_;
    bool made_ = false;
    ChildProcess bridge_;
};

// Latency with jitter, loss and reordering: TCP absorbs them, so every transfer completes and
// every byte is right.
TEST_P(NetnsFaults, LatencyLossAndReorderingCompleteWithTheRightBytes) {
    std::string address, region;
    ChildProcess target = StartTarget(&address, &region);
    for (const char* settings : {"20 5 0 0 0", "2 0 0.02 0 0", "5 2 0 0.2 0", "10 5 0.01 0.1 0"}) {
        SCOPED_TRACE(settings);
        Impair(settings);
        ChildProcess initiator = StartInitiator(address, region, 12, 20000);
        Summary s = Wait(initiator, seconds(180));
        EXPECT_EQ(s.corrupt, 0) << Describe(s);
        EXPECT_EQ(s.ok, 12) << Describe(s);
    }
}

// A cut link: what is in flight fails within its deadline (no hang, no corruption), and after
// the link comes back new transfers work again.
TEST_P(NetnsFaults, ACutLinkFailsTransfersWithinTheirDeadlineAndRecoveryWorks) {
    std::string address, region;
    ChildProcess target = StartTarget(&address, &region);
    Impair("1 0 0 0 0");
    ChildProcess initiator = StartInitiator(address, region, 12, 1000);
    // Let a few rounds pass, then cut.
    std::vector<std::string> before;
    ASSERT_TRUE(initiator.ReadLine("ok 2 ", seconds(60), &before).ok());
    Impair("1 0 0 0 1");
    Summary s = Wait(initiator, seconds(240));
    EXPECT_EQ(s.corrupt, 0) << Describe(s);
    EXPECT_EQ(s.late, 0) << Describe(s);
    EXPECT_GT(s.failed, 0) << Describe(s);
    EXPECT_GE(s.ok, 3) << Describe(s);
    EXPECT_EQ(s.ok + s.failed + s.corrupt, 12) << Describe(s);
    // The link is back: a new initiator (new connections) works.
    Impair("1 0 0 0 0");
    ChildProcess again = StartInitiator(address, region, 4, 20000);
    Summary t = Wait(again, seconds(120));
    EXPECT_EQ(t.ok, 4) << Describe(t);
    EXPECT_EQ(t.corrupt, 0) << Describe(t);
}

INSTANTIATE_TEST_SUITE_P(Backends, NetnsFaults, ::testing::ValuesIn(testing::NetworkBackends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry
