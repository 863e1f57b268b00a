#include "transfer/io_loop.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace ferry {
namespace {

// An idle loop with a tick sleeps until the tick is due. It used to round the time left down
// to whole milliseconds and so polled with a zero timeout through the last millisecond before
// every tick: about 200,000 wake-ups a second, a tenth of a core, in every agent.
TEST(IoLoopTest, IdleLoopWithATickSleepsBetweenTicks) {
    auto loop = IoLoop::Create("test-io");
    ASSERT_TRUE(loop.ok()) << loop.status().ToString();
    std::atomic<int> ticks{0};
    (*loop)->SetTick(std::chrono::milliseconds(10), [&] { ++ticks; });
    uint64_t before = (*loop)->wakeups();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    uint64_t woke = (*loop)->wakeups() - before;
    int ticked = ticks.load();
    (*loop)->Stop();
    EXPECT_GE(ticked, 5);  // it does tick (a slow machine ticks less, never more)
    // About one wake-up per tick; the old rounding gave hundreds per tick.
    EXPECT_LE(woke, static_cast<uint64_t>(3 * ticked + 5)) << "ticks: " << ticked;
}

TEST(IoLoopTest, PostedTasksRunOnTheLoopThread) {
    auto loop = IoLoop::Create("test-io");
    ASSERT_TRUE(loop.ok()) << loop.status().ToString();
    std::atomic<bool> in_loop{false};
    ASSERT_TRUE((*loop)->RunSync([&] { in_loop = (*loop)->InLoopThread(); }));
    EXPECT_TRUE(in_loop.load());
    EXPECT_FALSE((*loop)->InLoopThread());
    (*loop)->Stop();
    EXPECT_FALSE((*loop)->RunSync([] {}));  // stopped: nothing runs
}

}  // namespace
}  // namespace ferry
