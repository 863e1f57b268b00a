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
    EXPECT_EQ(d->revision, 0u);
    AgentMetadata md = Sample();
    md.revision = 41;
    auto r = DecodeMetadata(EncodeMetadata(md));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->revision, 41u);
}

// The revision travels as extension 1: a blob without it (an older writer) reads as revision
// 0, an unknown extension is skipped, a revision of the wrong size is refused by name.
TEST(Metadata, TheRevisionIsAnExtensionOthersSkip) {
    AgentMetadata md = Sample();
    md.revision = 7;
    const std::string blob = EncodeMetadata(md);
    // The trailer: u32 count 1, u16 tag 1, u32 length 8, u64 revision.
    const size_t trailer = 4 + 2 + 4 + 8;
    ASSERT_GT(blob.size(), trailer);
    const std::string body = blob.substr(0, blob.size() - trailer);
    auto none = DecodeMetadata(body + std::string("\0\0\0\0", 4));
    ASSERT_TRUE(none.ok()) << none.status().ToString();
    EXPECT_EQ(none->revision, 0u);
    EXPECT_EQ(none->regions.size(), 2u);
    std::string unknown = body + std::string(
                                     "\1\0\0\0"
                                     "\x09\0"
                                     "\3\0\0\0"
                                     "abc",
                                     13);
    auto skipped = DecodeMetadata(unknown);
    ASSERT_TRUE(skipped.ok()) << skipped.status().ToString();
    EXPECT_EQ(skipped->revision, 0u);
    std::string short_rev = body + std::string(
                                       "\1\0\0\0"
                                       "\1\0"
                                       "\4\0\0\0"
                                       "abcd",
                                       14);
    auto bad = DecodeMetadata(short_rev);
    EXPECT_THAT(bad, StatusIs(Code::kInvalidArgument));
    EXPECT_NE(bad.status().message().find("revision"), std::string::npos)
        << bad.status().ToString();
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
