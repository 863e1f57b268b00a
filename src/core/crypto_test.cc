#include "core/crypto.h"

#include <gtest/gtest.h>

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
