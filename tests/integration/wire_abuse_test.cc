// A peer that lies on the wire: garbage, oversized lengths, malformed bodies, silence. Each
// abusive connection is closed with a log line; the agent keeps serving honest peers.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "core/fd.h"
#include "testing/testing.h"
#include "transfer/backend.h"
#include "transfer/wire.h"

namespace ferry {
namespace {

using ::ferry::testing::FillPattern;
using ::ferry::testing::FirstMismatch;
using ::ferry::testing::TestConfig;
using ::ferry::testing::ValueOrDie;

class WireAbuse : public ::testing::Test {
  protected:
    void SetUp() override {
        target_ = ValueOrDie(Agent::Create(TestConfig("target", "tcp")));
        region_ = ValueOrDie(target_->AllocateRegion(1 << 20));
        FillPattern(region_.base, 1 << 20, 5);
    }

    ScopedFd Dial() {
        std::string host;
        uint16_t port = 0;
        EXPECT_TRUE(SplitHostPort(target_->ListenAddress(), &host, &port).ok());
        ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_in sa{};
        sa.sin_family = AF_INET;
        sa.sin_port = htons(port);
        inet_pton(AF_INET, host.c_str(), &sa.sin_addr);
        EXPECT_EQ(connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
        return fd;
    }

    void SendAll(int fd, const std::string& bytes) {
        ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
                  static_cast<ssize_t>(bytes.size()));
    }

    // True if the agent closes the connection within `timeout` (reading and dropping whatever
    // it sends first, e.g. an error frame).
    bool ClosedWithin(int fd, std::chrono::milliseconds timeout) {
        auto end = Clock::now() + timeout;
        char buf[4096];
        while (Clock::now() < end) {
            pollfd p{fd, POLLIN, 0};
            if (poll(&p, 1, 50) > 0) {
                ssize_t n = recv(fd, buf, sizeof(buf), 0);
                if (n <= 0) return true;
            }
        }
        return false;
    }

    std::string Hello() {
        wire::Hello h;
        h.name = "liar";
        h.epoch = 1;
        return wire::MakeFrame(wire::FrameType::kHello, 0, wire::EncodeHello(h));
    }

    // An honest peer still gets its data.
    void ExpectStillServing() {
        auto honest = ValueOrDie(Agent::Create(TestConfig("honest", "tcp")));
        ASSERT_TRUE(honest->Connect(target_->ListenAddress()).ok());
        RegionInfo mine = ValueOrDie(honest->AllocateRegion(1 << 20));
        auto x =
            ValueOrDie(honest->PostRead(std::vector<Descriptor>{{mine.id, 0, 1 << 20}}, "target",
                                        std::vector<Descriptor>{{region_.id, 0, 1 << 20}}));
        FERRY_ASSERT_OK(x.Wait(std::chrono::seconds(10)));
        EXPECT_EQ(FirstMismatch(mine.base, 1 << 20, 5), -1);
    }

    std::unique_ptr<Agent> target_;
    RegionInfo region_;
};

TEST_F(WireAbuse, GarbageClosesOnlyThatConnection) {
    ScopedFd keep = Dial();  // an idle connection elsewhere stays open
    ScopedFd fd = Dial();
    SendAll(fd.get(), std::string(100, 'G'));
    EXPECT_TRUE(ClosedWithin(fd.get(), std::chrono::seconds(5)));
    EXPECT_FALSE(ClosedWithin(keep.get(), std::chrono::milliseconds(200)));
    ExpectStillServing();
}

TEST_F(WireAbuse, OversizedLengthsAreRefusedBeforeAllocating) {
    for (auto [body, payload] :
         {std::pair<uint32_t, uint64_t>{0xFFFFFFFFu, 0}, {16, ~0ull}, {wire::kMaxBody + 1, 0}}) {
        ScopedFd fd = Dial();
        char h[wire::kHeaderSize];
        wire::EncodeHeader({wire::FrameType::kHello, 0, 0, 0, 0}, h);
        std::string frame(h, wire::kHeaderSize);
        std::memcpy(frame.data() + 8, &body, 4);
        std::memcpy(frame.data() + 24, &payload, 8);
        SendAll(fd.get(), frame);
        EXPECT_TRUE(ClosedWithin(fd.get(), std::chrono::seconds(5)));
    }
    ExpectStillServing();
}

TEST_F(WireAbuse, TruncatedAndMalformedFramesAfterTheHandshake) {
    {
        ScopedFd fd = Dial();
        SendAll(fd.get(), Hello());
        // A write whose body is not a data request.
        SendAll(fd.get(), wire::MakeFrame(wire::FrameType::kWrite, 1, "nonsense", 0));
        EXPECT_TRUE(ClosedWithin(fd.get(), std::chrono::seconds(5)));
    }
    {
        ScopedFd fd = Dial();
        SendAll(fd.get(), Hello());
        // A write that claims more payload than its segments: the stream would desync.
        wire::DataRequest req;
        req.segments = {{region_.id, region_.key, 0, 10}};
        SendAll(fd.get(),
                wire::MakeFrame(wire::FrameType::kWrite, 1, wire::EncodeDataRequest(req), 20));
        EXPECT_TRUE(ClosedWithin(fd.get(), std::chrono::seconds(5)));
    }
    {
        ScopedFd fd = Dial();
        SendAll(fd.get(), Hello());
        // Half a frame, then the client vanishes.
        std::string f = wire::MakeFrame(wire::FrameType::kRead, 1, std::string(64, 'x'));
        SendAll(fd.get(), f.substr(0, 40));
    }
    {
        ScopedFd fd = Dial();
        // A data frame before any handshake.
        wire::DataRequest req;
        req.segments = {{region_.id, region_.key, 0, 10}};
        SendAll(fd.get(), wire::MakeFrame(wire::FrameType::kRead, 1, wire::EncodeDataRequest(req)));
        EXPECT_TRUE(ClosedWithin(fd.get(), std::chrono::seconds(5)));
    }
    ExpectStillServing();
}

TEST_F(WireAbuse, AWriteWithTheWrongKeyIsRefusedAndTheStreamStaysUsable) {
    ScopedFd fd = Dial();
    SendAll(fd.get(), Hello());
    wire::DataRequest req;
    req.segments = {{region_.id, region_.key ^ 0xFF, 0, 8}};
    SendAll(fd.get(), wire::MakeFrame(wire::FrameType::kWrite, 7, wire::EncodeDataRequest(req), 8) +
                          std::string(8, 'Z'));
    // Then a correct read on the same connection.
    wire::DataRequest ok;
    ok.segments = {{region_.id, region_.key, 0, 8}};
    SendAll(fd.get(), wire::MakeFrame(wire::FrameType::kRead, 8, wire::EncodeDataRequest(ok)));
    // Collect: hello-ack, ready, response(7, PermissionDenied), response(8, OK + 8 bytes).
    std::string in;
    auto end = Clock::now() + std::chrono::seconds(5);
    std::vector<std::pair<wire::FrameHeader, std::string>> frames;
    while (Clock::now() < end && frames.size() < 4) {
        char buf[4096];
        pollfd p{fd.get(), POLLIN, 0};
        if (poll(&p, 1, 50) <= 0) continue;
        ssize_t n = recv(fd.get(), buf, sizeof(buf), 0);
        ASSERT_GT(n, 0);
        in.append(buf, n);
        while (in.size() >= wire::kHeaderSize) {
            auto h = wire::DecodeHeader(in);
            ASSERT_TRUE(h.ok());
            size_t total = wire::kHeaderSize + h->body_len + h->payload_len;
            if (in.size() < total) break;
            frames.emplace_back(*h, in.substr(wire::kHeaderSize, h->body_len + h->payload_len));
            in.erase(0, total);
        }
    }
    ASSERT_EQ(frames.size(), 4u);
    auto r7 = wire::DecodeResponse(frames[2].second);
    ASSERT_TRUE(r7.ok());
    EXPECT_EQ(frames[2].first.request_id, 7u);
    EXPECT_EQ(r7->code, Code::kPermissionDenied);
    EXPECT_EQ(frames[3].first.request_id, 8u);
    EXPECT_EQ(frames[3].first.payload_len, 8u);
    // The refused write did not touch the region.
    EXPECT_EQ(FirstMismatch(region_.base, 1 << 20, 5), -1);
}

TEST_F(WireAbuse, DeregisterClosesAStreamStalledOnTheRegion) {
    const uint64_t big = wire::kMaxPayload;
    RegionInfo victim = ValueOrDie(target_->AllocateRegion(big));
    // A reader that asks for 64 MiB and never reads: the target's send stalls holding the region.
    ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    int small = 4096;
    setsockopt(fd.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    std::string host;
    uint16_t port = 0;
    ASSERT_TRUE(SplitHostPort(target_->ListenAddress(), &host, &port).ok());
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    inet_pton(AF_INET, host.c_str(), &sa.sin_addr);
    ASSERT_EQ(connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    SendAll(fd.get(), Hello());
    wire::DataRequest req;
    req.segments = {{victim.id, victim.key, 0, big}};
    SendAll(fd.get(), wire::MakeFrame(wire::FrameType::kRead, 1, wire::EncodeDataRequest(req)));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let the send start and stall

    auto t0 = Clock::now();
    FERRY_ASSERT_OK(target_->Deregister(victim.id));
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10));
    EXPECT_TRUE(ClosedWithin(fd.get(), std::chrono::seconds(5)));
    ExpectStillServing();
}

TEST_F(WireAbuse, ASilentClientIsDroppedAfterTheHandshakeTimeout) {
    ScopedFd fd = Dial();  // connects, never says hello (slowloris)
    EXPECT_TRUE(ClosedWithin(fd.get(), std::chrono::seconds(15)));
    ExpectStillServing();
}

}  // namespace
}  // namespace ferry
