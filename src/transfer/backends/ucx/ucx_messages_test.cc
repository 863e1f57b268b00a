#include "transfer/backends/ucx/ucx_messages.h"

#include <gtest/gtest.h>

#include "testing/testing.h"

namespace ferry::ucx {
namespace {

using ::ferry::testing::StatusHas;
using ::ferry::testing::StatusIs;

const Envelope kTo{0x1122334455667788ull, 0xdeadbeefull};

TEST(UcxMessages, EveryHeaderRoundTrips) {
    Announce a{kTo, 7, 3};
    EXPECT_EQ(*DecodeAnnounce(Encode(a)), a);
    Revoke r{kTo, 7, 11, 5};
    EXPECT_EQ(*DecodeRevoke(Encode(r, false), false), r);
    Revoke ack{kTo, 7, 11, 0};
    EXPECT_EQ(*DecodeRevoke(Encode(ack, true), true), ack);
    NotifyHeader n{kTo, "prefill-0"};
    EXPECT_EQ(*DecodeNotify(Encode(n)), n);
    GrantRequest g{{kTo, 7, 42}, 9, 0xabc};
    EXPECT_EQ(*DecodeGrantRequest(Encode(g)), g);
    PullRequest p{{kTo, 7, 43}, 1 << 20, "kv/req-1"};
    EXPECT_EQ(*DecodePullRequest(Encode(p)), p);
    Reply rep{43, 0x99, Code::kNotFound, 17, "no object 'kv/req-1'"};
    EXPECT_EQ(*DecodeReply(Encode(rep)), rep);
    GrantAnswer ans{0x7f0000001000ull, 4096, std::string("\x01\x02\x00\x03", 4)};
    EXPECT_EQ(*DecodeGrantAnswer(Encode(ans)), ans);

    DataRequest d{{kTo, 7, 44}, {{1, 0xabc, 0, 4096}, {2, 0xdef, 8192, 512}}};
    Result<DataRequest> back = DecodeDataRequest(Encode(d));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->head, d.head);
    ASSERT_EQ(back->segments.size(), 2u);
    EXPECT_EQ(back->segments[1].region, 2u);
    EXPECT_EQ(back->segments[1].key, 0xdefu);
    EXPECT_EQ(back->segments[1].offset, 8192u);
    EXPECT_EQ(back->segments[1].length, 512u);
    EXPECT_EQ(back->TotalLength(), 4608u);
    EXPECT_EQ(Encode(d).size(), kRequestHeaderFixed + 2 * kSegmentBytes);
}

TEST(UcxMessages, TheHeadOfEveryRequestIsItsFirstBytes) {
    // A target refuses a request whose body is malformed to the initiator the head names.
    for (const std::string& h :
         {Encode(GrantRequest{{kTo, 7, 42}, 1, 2}), Encode(PullRequest{{kTo, 7, 42}, 8, "k"}),
          Encode(DataRequest{{kTo, 7, 42}, {}})}) {
        Result<RequestHead> head = DecodeRequestHead(h);
        ASSERT_TRUE(head.ok());
        EXPECT_EQ(head->to, kTo);
        EXPECT_EQ(head->initiator, 7u);
        EXPECT_EQ(head->request_id, 42u);
    }
    uint64_t id = 0, proof = 0;
    FERRY_EXPECT_OK(DecodeReplyHead(Encode(Reply{5, 6, Code::kOk, 0, ""}), &id, &proof));
    EXPECT_EQ(id, 5u);
    EXPECT_EQ(proof, 6u);
}

TEST(UcxMessages, TruncatedOrTrailingBytesAreRefused) {
    const std::string headers[] = {Encode(Announce{kTo, 7, 3}),
                                   Encode(Revoke{kTo, 7, 11, 5}, false),
                                   Encode(NotifyHeader{kTo, "decode-1"}),
                                   Encode(GrantRequest{{kTo, 7, 42}, 9, 1}),
                                   Encode(PullRequest{{kTo, 7, 43}, 8, "k"}),
                                   Encode(Reply{43, 1, Code::kOk, 0, "m"}),
                                   Encode(DataRequest{{kTo, 7, 44}, {{1, 2, 3, 4}}})};
    auto decode = [](size_t which, std::string_view h) -> Status {
        switch (which) {
            case 0:
                return DecodeAnnounce(h).status();
            case 1:
                return DecodeRevoke(h, false).status();
            case 2:
                return DecodeNotify(h).status();
            case 3:
                return DecodeGrantRequest(h).status();
            case 4:
                return DecodePullRequest(h).status();
            case 5:
                return DecodeReply(h).status();
            default:
                return DecodeDataRequest(h).status();
        }
    };
    for (size_t i = 0; i < std::size(headers); ++i) {
        const std::string& h = headers[i];
        FERRY_EXPECT_OK(decode(i, h));
        for (size_t cut = 0; cut < h.size(); ++cut) {
            EXPECT_THAT(decode(i, std::string_view(h).substr(0, cut)),
                        StatusIs(Code::kInvalidArgument))
                << "header " << i << " cut at " << cut;
        }
        EXPECT_THAT(decode(i, h + "x"), StatusHas(Code::kInvalidArgument, "trailing")) << i;
    }
    // A revocation acknowledgement has no region: the longer layout is not one.
    EXPECT_THAT(DecodeRevoke(Encode(Revoke{kTo, 7, 11, 5}, false), true),
                StatusIs(Code::kInvalidArgument));
}

TEST(UcxMessages, LimitsAreEnforced) {
    DataRequest d{{kTo, 7, 44}, {}};
    d.segments.resize(wire::kMaxSegmentsPerFrame + 1);
    EXPECT_THAT(DecodeDataRequest(Encode(d)).status(),
                StatusHas(Code::kInvalidArgument, "exceeds the limit"));
    // A segment count that claims more than the header holds.
    std::string h = Encode(DataRequest{{kTo, 7, 44}, {{1, 2, 3, 4}}});
    h[32] = 2;
    EXPECT_THAT(DecodeDataRequest(h).status(), StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(
        DecodeNotify(Encode(NotifyHeader{kTo, std::string(wire::kMaxNameLen + 1, 'a')})).status(),
        StatusHas(Code::kInvalidArgument, "exceeds the limit"));
    EXPECT_THAT(DecodePullRequest(
                    Encode(PullRequest{{kTo, 7, 1}, 8, std::string(wire::kMaxKeyLen + 1, 'k')}))
                    .status(),
                StatusIs(Code::kInvalidArgument));
    // A status code ferry does not have.
    std::string r = Encode(Reply{1, 2, Code::kOk, 0, ""});
    r[16] = static_cast<char>(200);
    EXPECT_THAT(DecodeReply(r).status(), StatusHas(Code::kInvalidArgument, "200"));
    // Grant answers: the fixed part and at least one byte of rkey, at most kMaxPackedRkey.
    EXPECT_THAT(DecodeGrantAnswer(std::string(16, '\0')).status(),
                StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(DecodeGrantAnswer(std::string(16 + kMaxPackedRkey + 1, '\0')).status(),
                StatusIs(Code::kInvalidArgument));
    FERRY_EXPECT_OK(DecodeGrantAnswer(std::string(16 + kMaxPackedRkey, '\0')).status());
}

TEST(UcxMessages, Addresses) {
    const std::string worker("\x00\x01\xfe\xff", 4);
    std::string a = FormatAddress(worker, 0x0123456789abcdefull);
    EXPECT_EQ(a, "0001feff.0123456789abcdef");
    std::string back;
    uint64_t token = 0;
    FERRY_EXPECT_OK(ParseAddress(a, &back, &token));
    EXPECT_EQ(back, worker);
    EXPECT_EQ(token, 0x0123456789abcdefull);
    for (const char* bad : {"", "0001feff", "0001feff.0123", ".0123456789abcdef",
                            "zz01feff.0123456789abcdef", "0001feff.0123456789abcdeg"}) {
        EXPECT_THAT(ParseAddress(bad, &back, &token),
                    StatusHas(Code::kInvalidArgument, "ucx endpoint address"))
            << bad;
    }
}

TEST(UcxMessages, EveryIdHasAName) {
    for (uint16_t am = kAmWrite; am <= kAmLast; ++am) EXPECT_NE(AmName(am), "unknown") << am;
    EXPECT_EQ(AmName(0), "unknown");
}

}  // namespace
}  // namespace ferry::ucx
