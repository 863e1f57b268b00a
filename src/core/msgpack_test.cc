// msgpack against bytes Debian's python3-msgpack writes (msgpack.packb), and the reader's errors.
#include "core/msgpack.h"

#include <gtest/gtest.h>

namespace ferry {
namespace {

std::string Bytes(std::initializer_list<int> b) {
    std::string s;
    for (int c : b) s.push_back(char(c));
    return s;
}

TEST(Msgpack, WritesTheShortestFormsAsMsgpackDoes) {
    MsgpackWriter w;
    // packb([0, 127, 128, 65535, 65536, 2**32, -1, -33, -129, None, 1.5, "ts", b"\x01"])
    w.Array(13);
    for (uint64_t v : {0ull, 127ull, 128ull, 65535ull, 65536ull, 1ull << 32}) w.Uint(v);
    for (int64_t v : {-1, -33, -129}) w.Int(v);
    w.Nil();
    w.Float(1.5);
    w.Str("ts");
    const uint8_t one = 1;
    w.Bin(&one, 1);
    EXPECT_EQ(w.Take(), Bytes({0x9d, 0x00, 0x7f, 0xcc, 0x80, 0xcd, 0xff, 0xff, 0xce, 0x00, 0x01,
                               0x00, 0x00, 0xcf, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00,
                               0xff, 0xd0, 0xdf, 0xd1, 0xff, 0x7f, 0xc0, 0xcb, 0x3f, 0xf8, 0x00,
                               0x00, 0x00, 0x00, 0x00, 0x00, 0xa2, 0x74, 0x73, 0xc4, 0x01, 0x01}));
}

TEST(Msgpack, ReadsWhatItWritesAndNamesWhatIsWrong) {
    MsgpackWriter w;
    w.Map(2);
    w.Str("a");
    w.Int(-100000);
    w.Str("b");
    w.Array(2);
    w.Float(2.25);
    w.Uint(uint64_t{1} << 63);
    const std::string bytes = w.Take();
    MsgpackReader r(bytes);
    EXPECT_EQ(*r.ReadMap(), 2u);
    EXPECT_EQ(*r.ReadStr(), "a");
    EXPECT_EQ(*r.ReadInt(), -100000);
    EXPECT_EQ(*r.ReadStr(), "b");
    EXPECT_EQ(*r.ReadArray(), 2u);
    EXPECT_EQ(*r.ReadNumber(), 2.25);
    EXPECT_EQ(*r.ReadUint(), uint64_t{1} << 63);
    EXPECT_TRUE(r.done());
    MsgpackReader skip(bytes);
    EXPECT_TRUE(skip.Skip().ok());
    EXPECT_TRUE(skip.done());
    // A float32 (0xca) reads as a number too.
    const std::string float32 = Bytes({0xca, 0x3f, 0xc0, 0x00, 0x00});  // the reader holds a view
    MsgpackReader f(float32);
    EXPECT_EQ(*f.ReadNumber(), 1.5);
    const std::pair<std::string, const char*> bad[] = {
        {Bytes({0xdd, 0x7f, 0xff, 0xff, 0xff}), "bytes wanted"},  // 2**31 elements, none there
        {Bytes({0xdf, 0x00, 0x00, 0x01, 0x00, 0x01}), "claims 256 pairs"},
        {Bytes({0xc1}), "reserved byte 0xc1"},
        {Bytes({0xda, 0x00, 0x05, 0x61}), "5 bytes wanted"},
        {Bytes({0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}), "out of range"},
        {std::string(40, char(0x91)), "nested too deep"},
        {"", "1 bytes wanted"}};
    for (const auto& [b, says] : bad) {
        MsgpackReader r2(b);
        Status s = b[0] == char(0xcf) ? r2.ReadInt().status() : r2.Skip();
        ASSERT_FALSE(s.ok()) << says;
        EXPECT_NE(s.message().find(says), std::string::npos) << s.ToString();
    }
    const std::string minus_one = Bytes({0xff});
    MsgpackReader neg(minus_one);
    EXPECT_NE(neg.ReadUint().status().message().find("negative"), std::string::npos);
}

}  // namespace
}  // namespace ferry
