// A connection's table of requests waiting for answers, answer by answer, with no socket: what
// each answer completes, where a payload goes, and which answers are protocol errors.
#include "transfer/responses.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "testing/testing.h"

namespace ferry::internal {
namespace {

using ::ferry::testing::StatusHas;
using ::ferry::testing::StatusIs;

wire::FrameHeader Header(wire::FrameType type, uint64_t id, uint64_t payload = 0) {
    wire::FrameHeader h;
    h.type = type;
    h.request_id = id;
    h.payload_len = payload;
    return h;
}

std::string Answer(Code code, uint64_t value = 0, std::string message = "") {
    return wire::EncodeResponse(wire::Response{code, std::move(message), value});
}

std::shared_ptr<TransferOp> Op(TransferOp::Kind kind, uint64_t bytes) {
    auto op = std::make_shared<TransferOp>(1, kind, bytes, Clock::now() + std::chrono::seconds(10),
                                           "peer", wire::DataMode::kInline);
    op->Arm(1, {}, nullptr);
    return op;
}

Expectation ForOp(std::shared_ptr<TransferOp> op, std::vector<iovec> local, uint64_t bytes) {
    Expectation e;
    e.op = std::move(op);
    e.local = std::move(local);
    e.local_bytes = bytes;
    return e;
}

Expectation ForCaller(std::function<void(const Status&, std::string_view)> callback) {
    Expectation e;
    e.callback = std::move(callback);
    return e;
}

Status Finished(TransferOp& op) { return op.Wait(Clock::now() + std::chrono::seconds(1)); }

TEST(PendingResponses, AnAnswerToNoRequestIsAProtocolError) {
    PendingResponses table;
    auto o = table.OnAnswer(Header(wire::FrameType::kResponse, 7), Answer(Code::kOk), "p");
    EXPECT_EQ(o.protocol_error, "response to unknown request 7");
}

TEST(PendingResponses, AMetadataCallerGetsTheBodyOrTheError) {
    PendingResponses table;
    std::vector<std::pair<Status, std::string>> got;
    auto callback = [&](const Status& s, std::string_view body) {
        got.emplace_back(s, std::string(body));
    };
    table.Expect(1, ForCaller(callback));
    table.Expect(2, ForCaller(callback));
    table.Expect(3, ForCaller(callback));
    EXPECT_TRUE(
        table.OnAnswer(Header(wire::FrameType::kMetadata, 1), "blob", "p").protocol_error.empty());
    EXPECT_TRUE(table
                    .OnAnswer(Header(wire::FrameType::kResponse, 2),
                              Answer(Code::kNotFound, 0, "no such region"), "p")
                    .protocol_error.empty());
    // A payload on a metadata answer: the caller hears of it, the connection closes.
    auto o = table.OnAnswer(Header(wire::FrameType::kMetadata, 3, 10), "blob", "p");
    EXPECT_EQ(o.protocol_error, "unexpected payload on a metadata response");
    ASSERT_EQ(got.size(), 3u);
    FERRY_EXPECT_OK(got[0].first);
    EXPECT_EQ(got[0].second, "blob");
    EXPECT_THAT(got[1].first, StatusHas(Code::kNotFound, "no such region"));
    EXPECT_THAT(got[2].first, StatusIs(Code::kUnavailable));
    EXPECT_EQ(table.size(), 0u);
}

TEST(PendingResponses, AWriteCompletesWithTheTargetsAnswer) {
    PendingResponses table;
    auto ok = Op(TransferOp::Kind::kWrite, 64), refused = Op(TransferOp::Kind::kWrite, 64);
    table.Expect(1, ForOp(ok, {}, 64));
    table.Expect(2, ForOp(refused, {}, 64));
    EXPECT_TRUE(table.OnAnswer(Header(wire::FrameType::kResponse, 1), Answer(Code::kOk), "p")
                    .protocol_error.empty());
    EXPECT_TRUE(table
                    .OnAnswer(Header(wire::FrameType::kResponse, 2),
                              Answer(Code::kPermissionDenied, 0, "region not granted"), "peer-9")
                    .protocol_error.empty());
    FERRY_EXPECT_OK(Finished(*ok));
    EXPECT_THAT(Finished(*refused),
                StatusHas(Code::kPermissionDenied, "target peer-9: region not granted"));
}

// A read's payload goes to the op's memory only if it is exactly what was asked; a pull's may
// be shorter (the object's size), never longer, and the destination is clipped to it.
TEST(PendingResponses, APayloadGoesWhereTheRequestSaidOnlyIfItsLengthFits) {
    std::vector<char> a(40), b(40);
    std::vector<iovec> local = {{a.data(), a.size()}, {b.data(), b.size()}};
    {
        PendingResponses table;
        auto read = Op(TransferOp::Kind::kRead, 80);
        table.Expect(1, ForOp(read, local, 80));
        auto o = table.OnAnswer(Header(wire::FrameType::kResponse, 1, 80), Answer(Code::kOk), "p");
        EXPECT_TRUE(o.protocol_error.empty());
        ASSERT_TRUE(o.has_sink);
        ASSERT_EQ(o.sink.iov.size(), 2u);
        EXPECT_EQ(o.sink.iov[1].iov_len, 40u);
        o.sink.done(Status::Ok());
        FERRY_EXPECT_OK(Finished(*read));
    }
    {
        PendingResponses table;
        auto pull = Op(TransferOp::Kind::kPull, 80);
        table.Expect(1, ForOp(pull, local, 80));
        auto o =
            table.OnAnswer(Header(wire::FrameType::kResponse, 1, 50), Answer(Code::kOk, 50), "p");
        ASSERT_TRUE(o.has_sink);
        ASSERT_EQ(o.sink.iov.size(), 2u);
        EXPECT_EQ(o.sink.iov[0].iov_len, 40u);
        EXPECT_EQ(o.sink.iov[1].iov_len, 10u);
        o.sink.done(Status::Ok());
        FERRY_EXPECT_OK(Finished(*pull));
        EXPECT_EQ(pull->pull_size(), 50u);
    }
    struct Bad {
        TransferOp::Kind kind;
        uint64_t payload, value;
        Code code;
    };
    for (const Bad& bad : std::vector<Bad>{
             {TransferOp::Kind::kRead, 79, 0, Code::kOk},        // short read
             {TransferOp::Kind::kRead, 81, 0, Code::kOk},        // long read
             {TransferOp::Kind::kPull, 81, 81, Code::kOk},       // more than the buffer
             {TransferOp::Kind::kPull, 50, 60, Code::kOk},       // not the size it states
             {TransferOp::Kind::kRead, 80, 0, Code::kInternal},  // a payload with an error
         }) {
        SCOPED_TRACE(std::to_string(bad.payload) + " bytes");
        PendingResponses table;
        auto op = Op(bad.kind, 80);
        table.Expect(1, ForOp(op, local, 80));
        auto o = table.OnAnswer(Header(wire::FrameType::kResponse, 1, bad.payload),
                                Answer(bad.code, bad.value), "p");
        EXPECT_EQ(o.protocol_error, "payload length does not match the request");
        EXPECT_FALSE(o.has_sink);
        EXPECT_THAT(Finished(*op), StatusIs(Code::kDataLoss));
    }
}

TEST(PendingResponses, AMalformedOrWrongKindOfAnswerFailsTheTransfer) {
    PendingResponses table;
    auto a = Op(TransferOp::Kind::kWrite, 8), b = Op(TransferOp::Kind::kWrite, 8);
    table.Expect(1, ForOp(a, {}, 8));
    table.Expect(2, ForOp(b, {}, 8));
    EXPECT_FALSE(
        table.OnAnswer(Header(wire::FrameType::kResponse, 1), "\x01", "p").protocol_error.empty());
    EXPECT_EQ(table.OnAnswer(Header(wire::FrameType::kMetadata, 2), "x", "p").protocol_error,
              "metadata frame answering a transfer");
    EXPECT_THAT(Finished(*a), StatusIs(Code::kUnavailable));
    EXPECT_THAT(Finished(*b), StatusIs(Code::kUnavailable));
}

TEST(PendingResponses, TakeAllLeavesNothingWaiting) {
    PendingResponses table;
    table.Expect(1, ForOp(Op(TransferOp::Kind::kWrite, 8), {}, 8));
    table.Expect(2, ForOp(Op(TransferOp::Kind::kWrite, 8), {}, 8));
    auto all = table.TakeAll();
    EXPECT_EQ(all.size(), 2u);
    EXPECT_EQ(table.size(), 0u);
    EXPECT_FALSE(table.OnAnswer(Header(wire::FrameType::kResponse, 1), Answer(Code::kOk), "p")
                     .protocol_error.empty());
}

}  // namespace
}  // namespace ferry::internal
