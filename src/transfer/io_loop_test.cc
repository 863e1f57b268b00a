#include "transfer/io_loop.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace ferry {
namespace {

bool WaitTicks(const std::atomic<int>& ticks, int want, std::chrono::seconds limit) {
    auto until = std::chrono::steady_clock::now() + limit;
    while (ticks.load() < want && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return ticks.load() >= want;
}

// An idle loop with a tick sleeps until the tick is due. It used to round the time left down
// to whole milliseconds and so polled with a zero timeout through the last millisecond before
// every tick: about 200,000 wake-ups a second, a tenth of a core, in every agent.
TEST(IoLoopTest, IdleLoopWithATickSleepsBetweenTicks) {
    auto loop = IoLoop::Create("test-io");
    ASSERT_TRUE(loop.ok()) << loop.status().ToString();
    std::atomic<int> ticks{0};
    (*loop)->SetTick(std::chrono::milliseconds(10), [&] { ++ticks; });
    // Counted over 20 ticks, however long a loaded machine takes for them (a deadline wait, no
    // sleep of a fixed length).
    const int first = ticks.load();
    uint64_t before = (*loop)->wakeups();
    const bool ticking = WaitTicks(ticks, first + 20, std::chrono::seconds(30));
    uint64_t woke = (*loop)->wakeups() - before;
    int ticked = ticks.load() - first;
    (*loop)->Stop();
    EXPECT_TRUE(ticking) << "only " << ticked << " ticks in 30 s";
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
