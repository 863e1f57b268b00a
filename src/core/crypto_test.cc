#include "core/crypto.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace ferry {
namespace {

TEST(Hex, EncodesLowerCaseAndDecodesBack) {
    const uint8_t bytes[] = {0x00, 0x0f, 0xa5, 0xff};
    EXPECT_EQ(HexEncode(bytes, sizeof bytes), "000fa5ff");
    std::string out = "stale";
    ASSERT_TRUE(HexDecode("000fa5ff", &out));
    EXPECT_EQ(out, std::string("\x00\x0f\xa5\xff", 4));
    ASSERT_TRUE(HexDecode("", &out));
    EXPECT_TRUE(out.empty());
}

TEST(Hex, RefusesOddLengthsAndOtherCharacters) {
    std::string out;
    EXPECT_FALSE(HexDecode("abc", &out));
    EXPECT_FALSE(HexDecode("0g", &out));
    EXPECT_FALSE(HexDecode("AB", &out));  // upper case is not what HexEncode writes
    EXPECT_FALSE(HexDecode("a.", &out));
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

TEST(Sha256, MatchesTheStandardVectors) {
    Digest d = Sha256("abc");
    EXPECT_EQ(HexEncode(d.data(), d.size()),
              "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    d = Sha256("");
    EXPECT_EQ(HexEncode(d.data(), d.size()),
              "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(RandomId128, IsThirtyTwoHexCharactersAndNeverRepeats) {
    std::set<std::string> seen;
    for (int i = 0; i < 1000; ++i) {
        std::string id = RandomId128();
        ASSERT_EQ(id.size(), 32u);
        EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
        EXPECT_TRUE(seen.insert(id).second);
    }
}

TEST(RouterToken, DependsOnTheSecretAndIsEmptyWithout) {
    EXPECT_EQ(RouterToken(""), "");
    std::string a = RouterToken("team"), b = RouterToken("other");
    EXPECT_EQ(a.rfind("ferry-rt1-", 0), 0u);
    EXPECT_EQ(a.size(), 10u + 64u);
    EXPECT_NE(a, b);
    EXPECT_EQ(a, RouterToken("team"));
    EXPECT_TRUE(SecretEqual(a, RouterToken("team")));
    EXPECT_FALSE(SecretEqual(a, b));
    EXPECT_FALSE(SecretEqual(a, a.substr(1)));
}

}  // namespace
}  // namespace ferry
