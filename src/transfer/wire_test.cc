#include "transfer/wire.h"

#include <gtest/gtest.h>

#include "testing/testing.h"

namespace ferry::wire {
namespace {

using ::ferry::testing::StatusIs;

TEST(WireHeader, RoundTrips) {
    FrameHeader h{FrameType::kWrite, 3, 1234, 0xABCDEF0123ull, 1 << 20};
    char buf[kHeaderSize];
    EncodeHeader(h, buf);
    auto d = DecodeHeader(std::string_view(buf, kHeaderSize));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->type, FrameType::kWrite);
    EXPECT_EQ(d->flags, 3);
    EXPECT_EQ(d->body_len, 1234u);
    EXPECT_EQ(d->request_id, 0xABCDEF0123ull);
    EXPECT_EQ(d->payload_len, 1u << 20);
}

TEST(WireHeader, RejectsBadMagicVersionTypeAndBounds) {
    char buf[kHeaderSize];
    auto encode = [&](FrameHeader h) {
        EncodeHeader(h, buf);
        return std::string(buf, kHeaderSize);
    };
    std::string good = encode({FrameType::kRead, 0, 10, 1, 0});
    std::string bad = good;
    bad[0] ^= 0xFF;
    EXPECT_THAT(DecodeHeader(bad), StatusIs(Code::kInvalidArgument));
    bad = good;
    bad[4] = 99;  // version
    auto r = DecodeHeader(bad);
    EXPECT_THAT(r, StatusIs(Code::kInvalidArgument));
    EXPECT_NE(r.status().message().find("version 99"), std::string::npos);
    bad = good;
    bad[5] = 0;  // type
    EXPECT_THAT(DecodeHeader(bad), StatusIs(Code::kInvalidArgument));
    bad[5] = char(200);
    EXPECT_THAT(DecodeHeader(bad), StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(DecodeHeader(encode({FrameType::kRead, 0, kMaxBody + 1, 1, 0})),
                StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(DecodeHeader(encode({FrameType::kWrite, 0, 1, 1, kMaxPayload + 1})),
                StatusIs(Code::kInvalidArgument));
    // Only writes and responses carry payloads.
    EXPECT_THAT(DecodeHeader(encode({FrameType::kNotify, 0, 1, 1, 10})),
                StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(DecodeHeader(good.substr(0, 20)), StatusIs(Code::kInvalidArgument));
}

TEST(WireDataRequest, RoundTripsInlineAndCma) {
    DataRequest r;
    r.mode = DataMode::kCma;
    r.segments = {{1, 2, 3, 100}, {4, 5, 6, 28}};
    static char buf[128];
    r.initiator_iov = {{buf, 64}, {buf + 64, 64}};
    r.shares = {{9, 7, 12345, reinterpret_cast<uint64_t>(buf), 128}};
    auto d = DecodeDataRequest(EncodeDataRequest(r));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->mode, DataMode::kCma);
    ASSERT_EQ(d->segments.size(), 2u);
    EXPECT_EQ(d->segments[1].region, 4u);
    EXPECT_EQ(d->segments[1].length, 28u);
    EXPECT_EQ(d->TotalLength(), 128u);
    ASSERT_EQ(d->initiator_iov.size(), 2u);
    EXPECT_EQ(d->initiator_iov[1].iov_base, buf + 64);
    ASSERT_EQ(d->shares.size(), 1u);
    EXPECT_EQ(d->shares[0].inode, 12345u);

    r.mode = DataMode::kInline;
    d = DecodeDataRequest(EncodeDataRequest(r));
    ASSERT_TRUE(d.ok());
    EXPECT_TRUE(d->initiator_iov.empty());
}

TEST(WireDataRequest, RejectsLies) {
    DataRequest r;
    r.segments = {{1, 2, 3, 100}};
    std::string good = EncodeDataRequest(r);
    // Truncated anywhere.
    for (size_t n = 0; n < good.size(); ++n) {
        EXPECT_THAT(DecodeDataRequest(good.substr(0, n)), StatusIs(Code::kInvalidArgument)) << n;
    }
    // Trailing garbage.
    EXPECT_THAT(DecodeDataRequest(good + "x"), StatusIs(Code::kInvalidArgument));
    // A count far larger than the input.
    std::string big = good;
    big[1] = '\xff';
    big[2] = '\xff';
    EXPECT_THAT(DecodeDataRequest(big), StatusIs(Code::kInvalidArgument));
    // Zero-length segment.
    r.segments = {{1, 2, 3, 0}};
    EXPECT_THAT(DecodeDataRequest(EncodeDataRequest(r)), StatusIs(Code::kInvalidArgument));
    // cma buffers that do not cover the segments.
    r.mode = DataMode::kCma;
    r.segments = {{1, 2, 3, 100}};
    static char buf[64];
    r.initiator_iov = {{buf, 64}};
    EXPECT_THAT(DecodeDataRequest(EncodeDataRequest(r)), StatusIs(Code::kInvalidArgument));
    // Unknown mode.
    std::string m = good;
    m[0] = 7;
    EXPECT_THAT(DecodeDataRequest(m), StatusIs(Code::kInvalidArgument));
}

TEST(WireHandshake, HelloAndAckRoundTrip) {
    Hello h;
    h.name = "prefill-0";
    h.epoch = 77;
    h.nonce = RandomNonce();
    h.purpose = Purpose::kSideChannel;
    h.wants_auth = 1;
    auto d = DecodeHello(EncodeHello(h));
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(d->name, "prefill-0");
    EXPECT_EQ(d->nonce, h.nonce);
    EXPECT_EQ(d->purpose, Purpose::kSideChannel);
    std::string long_name = EncodeHello(Hello{std::string(kMaxNameLen + 1, 'x')});
    EXPECT_THAT(DecodeHello(long_name), StatusIs(Code::kInvalidArgument));

    HelloAck a;
    a.name = "decode-0";
    a.auth_required = 1;
    a.proof[3] = 9;
    auto da = DecodeHelloAck(EncodeHelloAck(a));
    ASSERT_TRUE(da.ok());
    EXPECT_EQ(da->proof, a.proof);
}

TEST(WireHandshake, ProofsBindSecretNoncesAndDirection) {
    Nonce c = RandomNonce(), s = RandomNonce();
    EXPECT_EQ(ServerProof("k", c, s), ServerProof("k", c, s));
    EXPECT_NE(ServerProof("k", c, s), ServerProof("k2", c, s));
    EXPECT_NE(ServerProof("k", c, s), ClientProof("k", c, s));  // no reflection
    EXPECT_NE(ServerProof("k", c, s), ServerProof("k", s, c));
}

TEST(WireResponseAndPull, RoundTripAndBounds) {
    auto r = DecodeResponse(EncodeResponse({Code::kOutOfRange, "outside", 42}));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->code, Code::kOutOfRange);
    EXPECT_EQ(r->message, "outside");
    EXPECT_EQ(r->value, 42u);
    std::string bad = EncodeResponse({Code::kOk, "", 0});
    bad[0] = 100;
    EXPECT_THAT(DecodeResponse(bad), StatusIs(Code::kInvalidArgument));

    PullRequest p;
    p.key = "mm:1234";
    p.capacity = 4096;
    auto dp = DecodePullRequest(EncodePullRequest(p));
    ASSERT_TRUE(dp.ok());
    EXPECT_EQ(dp->key, "mm:1234");
    p.key = "";
    EXPECT_THAT(DecodePullRequest(EncodePullRequest(p)), StatusIs(Code::kInvalidArgument));
}

}  // namespace
}  // namespace ferry::wire
