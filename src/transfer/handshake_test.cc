// The handshake frame by frame, with no socket: two Handshake objects hand each other the
// frames each step says to send. The socket-level suites (tests/integration/multi_process_test.cc,
// bounds_test.cc, wire_abuse_test.cc) run the same paths over real connections between processes.
#include "transfer/handshake.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "testing/testing.h"

namespace ferry::internal {
namespace {

using ::ferry::testing::StatusHas;
using ::ferry::testing::StatusIs;

struct Frame {
    wire::FrameHeader header;
    std::string body;
};

Frame Split(const std::string& frame) {
    auto h = wire::DecodeHeader(std::string_view(frame).substr(0, wire::kHeaderSize));
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    return {*h, frame.substr(wire::kHeaderSize, h->body_len)};
}

Handshake::Step Feed(Handshake& to, const std::string& frame) {
    Frame f = Split(frame);
    return to.OnFrame(f.header, f.body);
}

HandshakeConfig Config(std::string name, std::string secret = "", uint64_t epoch = 1) {
    HandshakeConfig c;
    c.backend = "tcp";
    c.name = std::move(name);
    c.secret = std::move(secret);
    c.epoch = epoch;
    return c;
}

// Runs the frames back and forth until a side is done with nothing more to send or refuses.
// Returns the first refusal (OK if none) and which side made it.
struct Outcome {
    Status error;
    bool tell_peer = false;
    bool by_server = false;
    int frames = 0;
};

Outcome Exchange(Handshake& client, Handshake& server) {
    Outcome out;
    std::vector<std::string> to_server = {client.Hello()}, to_client;
    while (!to_server.empty() || !to_client.empty()) {
        std::vector<std::string> next_server, next_client;
        for (const std::string& f : to_server) {
            ++out.frames;
            Handshake::Step s = Feed(server, f);
            if (!s.error.ok()) return {s.error, s.tell_peer, true, out.frames};
            next_client.insert(next_client.end(), s.send.begin(), s.send.end());
        }
        for (const std::string& f : to_client) {
            ++out.frames;
            Handshake::Step s = Feed(client, f);
            if (!s.error.ok()) return {s.error, s.tell_peer, false, out.frames};
            next_server.insert(next_server.end(), s.send.begin(), s.send.end());
        }
        to_server = std::move(next_server);
        to_client = std::move(next_client);
    }
    return out;
}

TEST(Handshake, WithoutASecretBothSidesAreReadyAndKnowEachOther) {
    HandshakeConfig cc = Config("prefill-0", "", 11), sc = Config("decode-0", "", 22);
    cc.purpose = wire::Purpose::kSideChannel;
    Handshake client(Handshake::Side::kClient, cc, "127.0.0.1:1");
    Handshake server(Handshake::Side::kServer, sc, "127.0.0.1:2");
    Outcome o = Exchange(client, server);
    FERRY_ASSERT_OK(o.error);
    EXPECT_EQ(o.frames, 3);  // hello, hello-ack, ready
    EXPECT_TRUE(client.done());
    EXPECT_TRUE(server.done());
    EXPECT_EQ(client.peer_name(), "decode-0");
    EXPECT_EQ(client.peer_epoch(), 22u);
    EXPECT_EQ(server.peer_name(), "prefill-0");
    EXPECT_EQ(server.peer_epoch(), 11u);
    EXPECT_EQ(server.purpose(), wire::Purpose::kSideChannel);
    // Done: any further frame is out of place.
    Handshake::Step late = Feed(server, client.Hello());
    EXPECT_THAT(late.error, StatusHas(Code::kInvalidArgument, "unexpected state"));
    EXPECT_TRUE(late.tell_peer);
}

TEST(Handshake, ASharedSecretIsProvenBothWays) {
    HandshakeConfig cc = Config("a", "s3cret"), sc = Config("b", "s3cret");
    Handshake client(Handshake::Side::kClient, cc, "c");
    Handshake server(Handshake::Side::kServer, sc, "s");
    Outcome o = Exchange(client, server);
    FERRY_ASSERT_OK(o.error);
    EXPECT_EQ(o.frames, 4);  // hello, hello-ack with the server's proof, auth, ready
    EXPECT_TRUE(client.done());
    EXPECT_TRUE(server.done());
}

TEST(Handshake, EachSideRefusesAPeerThatDoesNotShareItsSecret) {
    struct Case {
        std::string client_secret, server_secret;
        bool by_server, tell_peer;
        std::string says;
    };
    for (const Case& c : std::vector<Case>{
             {"one", "two", false, false, "could not prove the deployment secret"},
             {"", "two", false, false, "requires a deployment secret and this agent has none"},
             {"one", "", true, true, "has no deployment secret, but a expects one"},
         }) {
        SCOPED_TRACE(c.client_secret + " / " + c.server_secret);
        HandshakeConfig cc = Config("a", c.client_secret), sc = Config("b", c.server_secret);
        Handshake client(Handshake::Side::kClient, cc, "c");
        Handshake server(Handshake::Side::kServer, sc, "s");
        Outcome o = Exchange(client, server);
        EXPECT_THAT(o.error, StatusHas(Code::kPermissionDenied, c.says));
        EXPECT_EQ(o.by_server, c.by_server);
        EXPECT_EQ(o.tell_peer, c.tell_peer);
        EXPECT_FALSE(client.done());
        EXPECT_FALSE(server.done());
    }
}

// A client that skips the proof, or sends one made without the secret, is refused; the server
// tells it why.
TEST(Handshake, TheServerRefusesAMissingOrForgedProof) {
    HandshakeConfig sc = Config("b", "s3cret");
    for (bool forged : {false, true}) {
        SCOPED_TRACE(forged ? "forged" : "missing");
        HandshakeConfig cc = Config("a", "s3cret");
        Handshake client(Handshake::Side::kClient, cc, "c");
        Handshake server(Handshake::Side::kServer, sc, "s");
        Handshake::Step ack = Feed(server, client.Hello());
        FERRY_ASSERT_OK(ack.error);
        ASSERT_EQ(ack.send.size(), 1u);
        const std::string next =
            forged ? wire::MakeFrame(wire::FrameType::kAuth, 0, std::string(32, 'x'))
                   : wire::MakeFrame(wire::FrameType::kReady, 0, {});
        Handshake::Step s = Feed(server, next);
        EXPECT_THAT(s.error, StatusHas(Code::kPermissionDenied,
                                       forged ? "does not know the deployment secret"
                                              : "did not answer the secret challenge"));
        EXPECT_TRUE(s.tell_peer);
        EXPECT_FALSE(server.done());
    }
}

TEST(Handshake, AClientRefusesAServerThatRestartedSinceItsMetadata) {
    HandshakeConfig cc = Config("a"), sc = Config("b", "", 0x42);
    cc.expect_epoch = 0x41;
    Handshake client(Handshake::Side::kClient, cc, "c");
    Handshake server(Handshake::Side::kServer, sc, "s");
    Outcome o = Exchange(client, server);
    EXPECT_THAT(o.error, StatusHas(Code::kUnavailable,
                                   "restarted (epoch 0000000000000041 -> "
                                   "0000000000000042)"));
    EXPECT_FALSE(o.by_server);
    EXPECT_FALSE(o.tell_peer);
}

TEST(Handshake, APeerNameOutsideTheAlphabetOrOurOwnIsRefused) {
    for (const std::string& name : {std::string("b"), std::string("bad name\n")}) {
        SCOPED_TRACE(name);
        // As a client's hello, to server "b".
        HandshakeConfig cc = Config(name), sc = Config("b");
        Handshake client(Handshake::Side::kClient, cc, "c");
        Handshake server(Handshake::Side::kServer, sc, "10.0.0.9:4000");
        Handshake::Step s = Feed(server, client.Hello());
        EXPECT_THAT(s.error, StatusHas(Code::kInvalidArgument, "handshake from 10.0.0.9:4000"));
        EXPECT_TRUE(s.tell_peer);
        EXPECT_TRUE(server.peer_name().empty());
        // As a server's hello-ack, to client "b".
        HandshakeConfig cc2 = Config("b");
        Handshake client2(Handshake::Side::kClient, cc2, "10.0.0.8:5000");
        wire::HelloAck ack;
        ack.name = name;
        ack.epoch = 1;
        Handshake::Step refused = Feed(
            client2, wire::MakeFrame(wire::FrameType::kHelloAck, 0, wire::EncodeHelloAck(ack)));
        EXPECT_THAT(refused.error,
                    StatusHas(Code::kInvalidArgument, "handshake from 10.0.0.8:5000"));
        EXPECT_FALSE(refused.tell_peer);
        EXPECT_TRUE(client2.peer_name().empty());
    }
}

TEST(Handshake, FramesOutOfOrderMalformedOrWithAPayloadAreProtocolErrors) {
    HandshakeConfig cc = Config("a"), sc = Config("b");
    struct Case {
        bool to_server;
        std::string frame;
        std::string says;
    };
    for (const Case& c : std::vector<Case>{
             {true, wire::MakeFrame(wire::FrameType::kReady, 0, {}), "expected hello, got"},
             {true, wire::MakeFrame(wire::FrameType::kHello, 0, "xx"), "protocol error from s"},
             {false, wire::MakeFrame(wire::FrameType::kHello, 0, {}), "expected hello-ack, got"},
             {false, wire::MakeFrame(wire::FrameType::kHelloAck, 0, "x"), "protocol error from c"},
         }) {
        SCOPED_TRACE(c.says);
        Handshake client(Handshake::Side::kClient, cc, "c");
        Handshake server(Handshake::Side::kServer, sc, "s");
        Handshake::Step s = Feed(c.to_server ? server : client, c.frame);
        EXPECT_THAT(s.error, StatusHas(Code::kInvalidArgument, c.says));
        EXPECT_TRUE(s.tell_peer);
    }
    Handshake server(Handshake::Side::kServer, sc, "s");
    Frame hello = Split(Handshake(Handshake::Side::kClient, cc, "c").Hello());
    hello.header.payload_len = 4096;
    EXPECT_THAT(server.OnFrame(hello.header, hello.body).error,
                StatusHas(Code::kInvalidArgument, "payload during the handshake"));
}

// The shm server's check that the client is the process it claims (reading its memory) runs for
// data connections only, and its refusal is told to the client.
TEST(Handshake, TheCrossMemoryCheckRunsForDataConnectionsAndCanRefuse) {
    HandshakeConfig sc = Config("b");
    sc.verify_cma = true;
    for (wire::Purpose purpose : {wire::Purpose::kData, wire::Purpose::kSideChannel}) {
        HandshakeConfig cc = Config("a");
        cc.purpose = purpose;
        int checked = 0;
        Handshake server(Handshake::Side::kServer, sc, "s", [&](const wire::Hello& h) {
            ++checked;
            EXPECT_EQ(h.name, "a");
            return PermissionDeniedError("shm: probe refused");
        });
        Handshake client(Handshake::Side::kClient, cc, "c");
        Handshake::Step s = Feed(server, client.Hello());
        if (purpose == wire::Purpose::kData) {
            EXPECT_EQ(checked, 1);
            EXPECT_THAT(s.error, StatusHas(Code::kPermissionDenied, "probe refused"));
            EXPECT_TRUE(s.tell_peer);
        } else {
            EXPECT_EQ(checked, 0);
            FERRY_EXPECT_OK(s.error);
            EXPECT_TRUE(s.ready);
        }
    }
}

}  // namespace
}  // namespace ferry::internal
