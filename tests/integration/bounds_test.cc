// Resource bounds against real processes (docs/security.md, "Budgets"): what a stranger, an idle
// crowd or a stalled peer can make a ferry process hold, read from that process's RSS.
//
// - an agent allocates nothing for a peer that has not proven the secret, and keeps at most 64
//   handshakes pending per source;
// - after a handshake, a frame header whose body stalls holds only the bytes sent, and the
//   connection is dropped at the stalled-frame deadline;
// - the discovery store serves puts and keeps an agent's lease with 1 000 idle connections and
//   40 long-poll watches open;
// - `ferry serve` answers a completion with 2 000 idle connections open, at a few KiB each, and
//   bodies that would amplify in a parser are refused without growing it.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "ferry/agent.h"
#include "ferry/discovery.h"
#include "http/http.h"
#include "testing/process.h"
#include "testing/testing.h"
#include "testing/tiny_model.h"
#include "testing/worker_process.h"
#include "transfer/wire.h"

namespace ferry {
namespace {

using ::ferry::testing::ChildProcess;
using ::ferry::testing::ClosedWithin;
using ::ferry::testing::DialLoopback;
using ::ferry::testing::PortAfter;
using ::ferry::testing::RssBytes;
using ::ferry::testing::SendAll;
using ::ferry::testing::ValueOrDie;
using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;
constexpr size_t kMiB = 1u << 20;

// How many of `fds` the other side has closed within `timeout` (all checked together).
size_t CountClosed(const std::vector<ScopedFd>& fds, milliseconds timeout) {
    std::vector<bool> closed(fds.size(), false);
    size_t n = 0;
    auto end = Clock::now() + timeout;
    char buf[4096];
    while (n < fds.size() && Clock::now() < end) {
        for (size_t i = 0; i < fds.size(); ++i) {
            if (closed[i]) continue;
            ssize_t r = recv(fds[i].get(), buf, sizeof buf, MSG_DONTWAIT);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
                closed[i] = true;
                ++n;
            }
        }
        if (n < fds.size()) std::this_thread::sleep_for(milliseconds(20));
    }
    return n;
}

class AgentBounds : public ::testing::Test {
  protected:
    void SetUp() override { ASSERT_GE(testing::RaiseFdLimit(), 4096u); }

    void StartPeer(const std::vector<std::string>& extra) {
        std::vector<std::string> argv = {FERRY_TEST_PEER, "--name", "bounded", "--backend", "tcp"};
        argv.insert(argv.end(), extra.begin(), extra.end());
        std::string line;
        peer_ = ValueOrDie(ChildProcess::Start(argv, "READY ", &line, seconds(60)), "peer");
        std::istringstream in(line);
        in >> address_ >> region_;
        port_ = PortAfter(address_);
    }

    std::string HelloFrame(const std::string& name) {
        wire::Hello h;
        h.name = name;
        h.epoch = 1;
        return wire::MakeFrame(wire::FrameType::kHello, 0, wire::EncodeHello(h));
    }

    // A header alone, declaring `body_len` bytes of body.
    static std::string Header(wire::FrameType type, uint32_t body_len) {
        char h[wire::kHeaderSize];
        wire::EncodeHeader({type, 0, body_len, 7, 0}, h);
        return std::string(h, wire::kHeaderSize);
    }

    // Reads frames until the ready frame of the handshake.
    static bool ReadUntilReady(int fd) {
        std::string buf;
        auto end = Clock::now() + seconds(10);
        char tmp[4096];
        while (Clock::now() < end) {
            while (buf.size() >= wire::kHeaderSize) {
                auto h = wire::DecodeHeader(std::string_view(buf.data(), wire::kHeaderSize));
                if (!h.ok()) return false;
                if (buf.size() < wire::kHeaderSize + h->body_len) break;
                if (h->type == wire::FrameType::kReady) return true;
                buf.erase(0, wire::kHeaderSize + h->body_len);
            }
            ssize_t n = recv(fd, tmp, sizeof tmp, 0);
            if (n <= 0) return false;
            buf.append(tmp, static_cast<size_t>(n));
        }
        return false;
    }

    // An honest agent of this process still reads the peer's region.
    void ExpectStillServing(const std::string& secret = "") {
        AgentConfig c = testing::TestConfig("honest", "tcp");
        c.secret = secret;
        auto honest = ValueOrDie(Agent::Create(c));
        // The abusive sockets just closed: their handshakes may take a moment to be counted out.
        ASSERT_TRUE(
            testing::WaitUntil([&] { return honest->Connect(address_).ok(); }, seconds(10)));
        RegionInfo mine = ValueOrDie(honest->AllocateRegion(kMiB));
        auto x = ValueOrDie(honest->PostRead(std::vector<Descriptor>{{mine.id, 0, kMiB}}, "bounded",
                                             std::vector<Descriptor>{{region_, 0, kMiB}}));
        FERRY_ASSERT_OK(x.Wait(seconds(10)));
    }

    ChildProcess peer_;
    std::string address_;
    RegionId region_ = 0;
    uint16_t port_ = 0;
};

TEST_F(AgentBounds, StrangersCannotMakeAnAgentAllocateBeforeTheyProveTheSecret) {
    StartPeer({"--secret", "team-secret"});
    const size_t base = RssBytes(peer_.pid());
    ASSERT_GT(base, 0u);
    // 1 000 hello headers declaring a 4 MiB body each: once 96 MB -> 2.56 GB (2.9 GB kept).
    // Now each is refused on its header, before anything is allocated for it.
    {
        std::vector<ScopedFd> fds;
        for (int i = 0; i < 1000; ++i) {
            ScopedFd fd = DialLoopback(port_);
            if (!fd.valid()) continue;
            SendAll(fd.get(), Header(wire::FrameType::kHello, wire::kMaxBody));
            fds.push_back(std::move(fd));
        }
        EXPECT_GE(fds.size(), 900u);
        EXPECT_EQ(CountClosed(fds, seconds(20)), fds.size());
        const size_t rss = RssBytes(peer_.pid());
        EXPECT_LT(rss, base + 32 * kMiB) << "RSS " << base / kMiB << " -> " << rss / kMiB << " MiB";
    }
    // 1 000 connections stuck inside a well-formed hello: 64 are kept from this source (each a
    // 2 KiB buffer), the rest are closed as they come.
    {
        std::string hello = HelloFrame("stranger");
        std::vector<ScopedFd> fds;
        for (int i = 0; i < 1000; ++i) {
            ScopedFd fd = DialLoopback(port_);
            if (!fd.valid()) continue;
            SendAll(fd.get(), hello.substr(0, hello.size() - 1));
            fds.push_back(std::move(fd));
        }
        size_t closed = CountClosed(fds, seconds(5));
        EXPECT_GE(closed, fds.size() - 64) << "of " << fds.size();
        EXPECT_LT(closed, fds.size()) << "the first 64 wait for their handshake deadline";
        const size_t rss = RssBytes(peer_.pid());
        EXPECT_LT(rss, base + 32 * kMiB) << "RSS " << base / kMiB << " -> " << rss / kMiB << " MiB";
    }
    ExpectStillServing("team-secret");
}

TEST_F(AgentBounds, AStalledFrameHoldsOnlyItsBytesAndIsDroppedAtItsDeadline) {
    StartPeer({"--stalled-frame-ms", "1500"});
    const size_t base = RssBytes(peer_.pid());
    // 200 peers complete the handshake, then each sends a write header declaring a 4 MiB body
    // and 1 KiB of it: once 897 MB held for as long as they stayed open.
    std::vector<ScopedFd> fds;
    for (int i = 0; i < 200; ++i) {
        ScopedFd fd = DialLoopback(port_);
        ASSERT_TRUE(fd.valid());
        ASSERT_TRUE(SendAll(fd.get(), HelloFrame("staller-" + std::to_string(i))));
        ASSERT_TRUE(ReadUntilReady(fd.get())) << i;
        ASSERT_TRUE(SendAll(
            fd.get(), Header(wire::FrameType::kWrite, wire::kMaxBody) + std::string(1024, 'x')));
        fds.push_back(std::move(fd));
    }
    std::this_thread::sleep_for(milliseconds(300));
    const size_t rss = RssBytes(peer_.pid());
    // 200 x (64 KiB buffer + 1 KiB) is 13 MiB; the bound leaves room for a sanitizer's shadow
    // memory and still catches the old 4 MiB per header by a factor of 7.
    EXPECT_LT(rss, base + 128 * kMiB) << "RSS " << base / kMiB << " -> " << rss / kMiB << " MiB";
    // Dropped at the deadline (1.5 s here, 10 s by default), every one.
    EXPECT_EQ(CountClosed(fds, seconds(15)), fds.size());
    ExpectStillServing();
}

TEST_F(AgentBounds, HelloNamesOutsideTheAlphabetOrThisAgentsOwnAreRefused) {
    StartPeer({});
    for (const std::string& name :
         {std::string(), std::string("bounded"), std::string("evil\nW forged line"),
          std::string("caf\xc3\xa9"), std::string(129, 'a')}) {
        ScopedFd fd = DialLoopback(port_);
        ASSERT_TRUE(fd.valid());
        ASSERT_TRUE(SendAll(fd.get(), HelloFrame(name)));
        std::string got;
        EXPECT_TRUE(ClosedWithin(fd.get(), seconds(5), &got)) << name;
        EXPECT_EQ(got.find(std::string(1, static_cast<char>(wire::FrameType::kReady))),
                  std::string::npos);
    }
    ExpectStillServing();
}

TEST(StoreBounds, IdleConnectionsAndWatchesStarveNeitherLeasesNorPuts) {
    ASSERT_GE(testing::RaiseFdLimit(), 4096u);
    std::string line;
    ChildProcess store = ValueOrDie(
        ChildProcess::Start(
            {FERRY_BIN, "discovery", "--listen", "127.0.0.1:0", "--request-deadline-ms", "60000"},
            "ferry discovery: store at ", &line),
        "store");
    std::string url = line.substr(0, line.find(' '));
    uint16_t port = PortAfter(url);
    const size_t base = RssBytes(store.pid());
    // 1 000 idle connections: with a pool of 32 threads, 100 made an agent lose its lease.
    std::vector<ScopedFd> idle;
    for (int i = 0; i < 1000; ++i) {
        ScopedFd fd = DialLoopback(port);
        if (fd.valid()) idle.push_back(std::move(fd));
    }
    ASSERT_EQ(idle.size(), 1000u);
    // 40 long polls: once made an ordinary put wait 59 s.
    std::vector<std::thread> watchers;
    for (int i = 0; i < 40; ++i) {
        watchers.emplace_back([&] {
            auto s = ValueOrDie(MetadataStore::Open(url));
            (void)s->Watch("nothing/", 0, seconds(8));
        });
    }
    // An agent registers with a 2 s lease and must keep it through all this.
    ChildProcess agent =
        ValueOrDie(ChildProcess::Start({FERRY_TEST_PEER, "--name", "leased", "--backend", "tcp",
                                        "--store", url, "--store-ttl-ms", "2000"},
                                       "READY ", &line, seconds(60)),
                   "agent");
    auto store_client = ValueOrDie(MetadataStore::Open(url));
    auto t0 = Clock::now();
    FERRY_ASSERT_OK(store_client->Put("some/key", "value"));
    EXPECT_LT(Clock::now() - t0, seconds(2)) << "a put waited behind idle connections";
    std::this_thread::sleep_for(seconds(5));  // 2.5 lease periods
    auto entry = store_client->Get("ferry/agents/leased");
    EXPECT_TRUE(entry.ok()) << "the agent lost its lease: " << entry.status().ToString();
    const size_t rss = RssBytes(store.pid());
    RecordProperty("store_rss_per_idle_connection_bytes",
                   std::to_string((rss > base ? rss - base : 0) / idle.size()));
    EXPECT_LT(rss, base + 32 * kMiB) << "RSS " << base / kMiB << " -> " << rss / kMiB << " MiB";
    for (auto& t : watchers) t.join();
}

class ServeBounds : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        model_ = new testing::TinyModelFile("bounds-test", testing::TinyModelSpec(), 5);
    }
    static void TearDownTestSuite() {
        delete model_;
        model_ = nullptr;
    }
    static testing::TinyModelFile* model_;
};
testing::TinyModelFile* ServeBounds::model_ = nullptr;

Result<http::ClientReply> Complete(int port, const std::string& body) {
    http::ClientRequest r;
    r.port = port;
    r.target = "/v1/completions";
    r.body = body;
    r.timeout = seconds(60);
    return http::Fetch(r);
}

TEST_F(ServeBounds, ACompletionIsServedWithThousandsOfIdleConnectionsOpen) {
    ASSERT_GE(testing::RaiseFdLimit(), 4096u);
    auto server = ValueOrDie(testing::ServerProcess::Start(
        FERRY_BIN, {"serve", "--model", model_->path(), "--port", "0"}));
    const std::string body = R"({"prompt": "hello", "max_tokens": 4, "temperature": 0})";
    auto first = ValueOrDie(Complete(server->port(), body));
    ASSERT_EQ(first.status, 200) << first.body;
    const size_t base = RssBytes(server->pid());
    const int threads = testing::ThreadCount(server->pid());
    std::vector<ScopedFd> idle;
    for (int i = 0; i < 2000; ++i) {
        ScopedFd fd = DialLoopback(static_cast<uint16_t>(server->port()));
        if (fd.valid()) idle.push_back(std::move(fd));
    }
    ASSERT_EQ(idle.size(), 2000u);
    auto again = ValueOrDie(Complete(server->port(), body));
    ASSERT_EQ(again.status, 200) << again.body;
    auto text = [](const std::string& body) {
        return nlohmann::json::parse(body)["choices"][0]["text"].get<std::string>();
    };
    EXPECT_EQ(text(again.body), text(first.body));
    const size_t rss = RssBytes(server->pid());
    // A socket and a few KiB each (3.5 KiB in release; a sanitizer's shadow multiplies it), and
    // no thread: there were 1 024 pre-spawned, one per connection.
    EXPECT_EQ(testing::ThreadCount(server->pid()), threads);
    EXPECT_LT(rss, base + 2000 * 64 * 1024)
        << "RSS " << base / kMiB << " -> " << rss / kMiB << " MiB for 2000 idle connections";
}

TEST_F(ServeBounds, BodiesThatWouldAmplifyAreRefusedWithoutGrowingTheServer) {
    // Memory, not time, is checked here: four 15 MiB uploads into a sanitizer build on a loaded
    // machine once took more than the 10 s slow-client deadline, which cut them before a 400.
    auto server = ValueOrDie(testing::ServerProcess::Start(
        FERRY_BIN,
        {"serve", "--model", model_->path(), "--port", "0", "--request-deadline-ms", "300000"}));
    const size_t base = RssBytes(server->pid());
    // Four at once of 15 MiB of '[' (once 1.0 -> 6.5 GB peak, 6.0 GB kept), and deep nesting
    // inside a valid-looking request.
    std::vector<std::thread> senders;
    std::atomic<int> refused{0};
    for (int i = 0; i < 4; ++i) {
        senders.emplace_back([&] {
            auto r = Complete(server->port(), std::string(15 * kMiB, '['));
            if (r.ok() && r->status == 400) ++refused;
        });
    }
    for (auto& t : senders) t.join();
    EXPECT_EQ(refused.load(), 4) << "each of the four deep bodies must get its 400";
    for (int i = 0; i < 4; ++i) {
        auto r = ValueOrDie(Complete(
            server->port(), R"({"prompt": "x", "max_tokens": 1, "logit_bias": )" +
                                std::string(100000, '[') + std::string(100000, ']') + "}"));
        EXPECT_EQ(r.status, 400) << r.body.substr(0, 200);
    }
    const size_t rss = RssBytes(server->pid());
    // The bodies themselves pass through (each up to the 16 MiB limit), no tree is built.
    EXPECT_LT(rss, base + 160 * kMiB) << "RSS " << base / kMiB << " -> " << rss / kMiB << " MiB";
    auto ok = ValueOrDie(Complete(server->port(), R"({"prompt": "hi", "max_tokens": 2})"));
    EXPECT_EQ(ok.status, 200) << ok.body;
}

}  // namespace
}  // namespace ferry
