#include "core/child_process.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "testing/testing.h"

namespace ferry {
namespace {

// Both ways of starting a child (posix_spawn, and fork+exec with the parent-death signal that
// `ferry demo` asks for): the readiness line, later lines, stdin, stderr to a file, and an end
// with grace.
TEST(ChildProcess, BothLaunchersGiveLinesTakeStdinAndEnd) {
    for (bool die_with_parent : {false, true}) {
        SCOPED_TRACE(die_with_parent ? "fork+exec" : "posix_spawn");
        const std::string err = ::testing::TempDir() + "child-process-stderr-" +
                                std::to_string(getpid()) + (die_with_parent ? "-f" : "-s");
        ChildOptions o;
        o.stderr_path = err;
        o.die_with_parent = die_with_parent;
        std::string rest;
        auto c =
            ChildProcess::Start({"/bin/sh", "-c",
                                 "echo noise; echo ready 42; echo oops >&2; read x; echo got $x; "
                                 "sleep 30"},
                                "ready ", &rest, std::chrono::seconds(10), o);
        ASSERT_TRUE(c.ok()) << c.status().ToString();
        EXPECT_EQ(rest, "42");
        FERRY_ASSERT_OK(c->WriteLine("hello"));
        auto line = c->ReadLine("got ", std::chrono::seconds(10));
        ASSERT_TRUE(line.ok()) << line.status().ToString();
        EXPECT_EQ(*line, "got hello");
        const pid_t pid = c->pid();
        c->Terminate(std::chrono::seconds(5));  // sh dies of SIGTERM
        EXPECT_EQ(c->pid(), -1);
        EXPECT_NE(kill(pid, 0), 0);  // reaped: gone
        std::ifstream in(err);
        std::stringstream s;
        s << in.rdbuf();
        EXPECT_EQ(s.str(), "oops\n");
        std::remove(err.c_str());
    }
}

// ChildOptions::env sets variables for the child only, over the parent's, with either launcher;
// FindProgram resolves a name as the shell would.
TEST(ChildProcess, TheChildGetsTheEnvironmentItIsGivenOverOurs) {
    ASSERT_EQ(setenv("FERRY_CHILD_TEST_KEPT", "kept", 1), 0);
    ASSERT_EQ(setenv("FERRY_CHILD_TEST_SET", "ours", 1), 0);
    for (bool die_with_parent : {false, true}) {
        SCOPED_TRACE(die_with_parent ? "fork+exec" : "posix_spawn");
        ChildOptions o;
        o.die_with_parent = die_with_parent;
        o.env = {"FERRY_CHILD_TEST_SET=theirs", "FERRY_CHILD_TEST_NEW=a=b"};
        std::string rest;
        auto c = ChildProcess::Start(
            {"/bin/sh", "-c",
             "echo env $FERRY_CHILD_TEST_KEPT $FERRY_CHILD_TEST_SET $FERRY_CHILD_TEST_NEW"},
            "env ", &rest, std::chrono::seconds(10), o);
        ASSERT_TRUE(c.ok()) << c.status().ToString();
        EXPECT_EQ(rest, "kept theirs a=b");
    }
    EXPECT_STREQ(std::getenv("FERRY_CHILD_TEST_SET"), "ours");
    unsetenv("FERRY_CHILD_TEST_KEPT");
    unsetenv("FERRY_CHILD_TEST_SET");

    auto sh = FindProgram("sh");
    ASSERT_TRUE(sh.ok()) << sh.status().ToString();
    EXPECT_EQ(access(sh->c_str(), X_OK), 0) << *sh;
    EXPECT_EQ(*FindProgram("/bin/sh"), "/bin/sh");
    EXPECT_THAT(FindProgram("ferry-no-such-program"), testing::StatusIs(Code::kNotFound));
}

TEST(ChildProcess, AChildThatExitsOrIsSilentIsAnError) {
    std::string rest;
    auto gone = ChildProcess::Start({"/bin/sh", "-c", "exit 3"}, "ready", &rest);
    EXPECT_EQ(gone.status().code(), Code::kUnavailable) << gone.status().ToString();
    auto silent = ChildProcess::Start({"/bin/sh", "-c", "exec sleep 30"}, "ready", &rest,
                                      std::chrono::milliseconds(200));
    EXPECT_EQ(silent.status().code(), Code::kDeadlineExceeded) << silent.status().ToString();
    auto none = ChildProcess::Start({}, "ready", &rest);
    EXPECT_EQ(none.status().code(), Code::kInvalidArgument);
}

TEST(ChildProcess, WaitExitGivesTheExitCodeOrTheSignal) {
    std::string rest;
    auto three =
        ChildProcess::Start({"/bin/sh", "-c", "echo ready; read x; exit 3"}, "ready", &rest);
    ASSERT_TRUE(three.ok()) << three.status().ToString();
    EXPECT_EQ(three->WaitExit(std::chrono::milliseconds(50)), std::nullopt) << "still running";
    three->CloseStdin();
    EXPECT_EQ(three->WaitExit(std::chrono::seconds(10)), std::optional<int>(3));
    EXPECT_EQ(three->WaitExit(std::chrono::milliseconds(0)), std::nullopt) << "reaped once";
    auto killed =
        ChildProcess::Start({"/bin/sh", "-c", "echo ready; exec sleep 30"}, "ready", &rest);
    ASSERT_TRUE(killed.ok());
    killed->Signal(SIGTERM);
    EXPECT_EQ(killed->WaitExit(std::chrono::seconds(10)), std::optional<int>(128 + SIGTERM));
}

}  // namespace
}  // namespace ferry
