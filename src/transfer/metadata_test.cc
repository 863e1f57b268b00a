#include "transfer/metadata.h"

#include <gtest/gtest.h>

#include "testing/testing.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;

AgentMetadata Sample() {
    AgentMetadata md;
    md.name = "decode-3";
    md.epoch = 0x1234;
    md.host_id = "boot/net:1/pid:2";
    md.endpoints = {{"shm", "boot|ferry-1"}, {"tcp", "127.0.0.1:7000"}};
    md.regions = {{1, 4096, 99, MemoryKind::kHost}, {7, 1 << 30, 5, MemoryKind::kHost}};
    return md;
}

TEST(Metadata, RoundTrips) {
    auto d = DecodeMetadata(EncodeMetadata(Sample()));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->name, "decode-3");
    EXPECT_EQ(d->epoch, 0x1234u);
    ASSERT_NE(d->FindEndpoint("tcp"), nullptr);
    EXPECT_EQ(d->FindEndpoint("tcp")->address, "127.0.0.1:7000");
    EXPECT_EQ(d->FindEndpoint("ucx"), nullptr);
    ASSERT_NE(d->FindRegion(7), nullptr);
    EXPECT_EQ(d->FindRegion(7)->length, 1u << 30);
}

TEST(Metadata, EveryTruncationIsRejected) {
    std::string blob = EncodeMetadata(Sample());
    for (size_t n = 0; n < blob.size(); ++n) {
        EXPECT_THAT(DecodeMetadata(blob.substr(0, n)), StatusIs(Code::kInvalidArgument)) << n;
    }
}

TEST(Metadata, RejectsMalformedFields) {
    std::string blob = EncodeMetadata(Sample());
    std::string bad = blob;
    bad[0] = 'X';
    EXPECT_THAT(DecodeMetadata(bad), StatusIs(Code::kInvalidArgument));
    bad = blob;
    bad[4] = 9;  // version
    EXPECT_THAT(DecodeMetadata(bad), StatusIs(Code::kInvalidArgument));
    AgentMetadata md = Sample();
    md.regions.push_back(md.regions[0]);
    auto dup = DecodeMetadata(EncodeMetadata(md));
    EXPECT_THAT(dup, StatusIs(Code::kInvalidArgument));
    EXPECT_NE(dup.status().message().find("twice"), std::string::npos);
    md = Sample();
    md.name = "bad name!";
    EXPECT_THAT(DecodeMetadata(EncodeMetadata(md)), StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(DecodeMetadata(blob + "junk"), StatusIs(Code::kInvalidArgument));
}

TEST(Metadata, AgentNames) {
    FERRY_EXPECT_OK(ValidateAgentName("prefill-0.rank:1_a"));
    EXPECT_THAT(ValidateAgentName(""), StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(ValidateAgentName(std::string(129, 'a')), StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(ValidateAgentName("a/b"), StatusIs(Code::kInvalidArgument));
}

}  // namespace
}  // namespace ferry
