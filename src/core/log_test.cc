#include "core/log.h"

#include <gtest/gtest.h>

namespace ferry {
namespace {

TEST(EscapeForLog, PrintableAsciiStaysAsItIs) {
    EXPECT_EQ(EscapeForLog("agent peer-1:tcp 10.0.0.1:5555 {ok}"),
              "agent peer-1:tcp 10.0.0.1:5555 {ok}");
}

TEST(EscapeForLog, ALineBreakCannotForgeALineOfItsOwn) {
    std::string forged = "evil\nE 1764590000.000000 ferry[1] discovery: all agents left";
    std::string out = EscapeForLog(forged);
    EXPECT_EQ(out.find('\n'), std::string::npos);
    EXPECT_EQ(out, "evil\\nE 1764590000.000000 ferry[1] discovery: all agents left");
}

TEST(EscapeForLog, ControlBytesNonAsciiAndBackslashAreEscaped) {
    EXPECT_EQ(EscapeForLog(std::string("a\tb\rc\0d", 7)), "a\\tb\\rc\\x00d");
    EXPECT_EQ(EscapeForLog("\x1b[31mred"), "\\x1b[31mred");
    EXPECT_EQ(EscapeForLog("caf\xc3\xa9 \x7f"), "caf\\xc3\\xa9 \\x7f");
    // The backslash itself, so an escaped sequence can't be told from a sent one.
    EXPECT_EQ(EscapeForLog("\\n"), "\\\\n");
}

}  // namespace
}  // namespace ferry
