// IoLoop: one thread running epoll over non-blocking sockets, with a task queue that any thread
// may post to and a periodic tick. Handlers run on the loop thread only.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/fd.h"
#include "ferry/status.h"

namespace ferry {

class EventHandler {
  public:
    virtual ~EventHandler() = default;
    // `events` is a mask of EPOLLIN, EPOLLOUT, EPOLLERR, EPOLLHUP, EPOLLRDHUP.
    virtual void OnEvents(uint32_t events) = 0;
};

class IoLoop {
  public:
    static Result<std::unique_ptr<IoLoop>> Create(std::string name);
    ~IoLoop();

    // Stops and joins the thread; tasks not yet run are dropped, handlers are released.
    void Stop();

    // Thread-safe. Runs `fn` on the loop thread, soon.
    void Post(std::function<void()> fn);
    // Runs `fn` on the loop thread and waits for it (inline when called from the loop thread).
    // Returns false if the loop has stopped and `fn` did not run.
    bool RunSync(const std::function<void()>& fn);
    bool InLoopThread() const { return std::this_thread::get_id() == thread_id_.load(); }

    // Loop thread only. A handler is held until Unwatch; events for it after Unwatch are dropped.
    Status Watch(int fd, uint32_t events, std::shared_ptr<EventHandler> handler);
    void Modify(int fd, uint32_t events);
    void Unwatch(int fd);

    // Runs `fn` on the loop thread every `period` (not more precisely than that).
    void SetTick(std::chrono::milliseconds period, std::function<void()> fn);

    // How many times the loop has returned from epoll_wait (an idle loop: about one per tick).
    uint64_t wakeups() const { return wakeups_.load(std::memory_order_relaxed); }

  private:
    explicit IoLoop(std::string name) : name_(std::move(name)) {}
    void Run();
    void Wake();
    void RunTasks();

    std::string name_;
    ScopedFd epoll_fd_;
    ScopedFd wake_fd_;
    std::thread thread_;
    std::atomic<std::thread::id> thread_id_{};
    std::atomic<bool> stopping_{false};
    std::atomic<uint64_t> wakeups_{0};

    std::mutex tasks_mu_;
    std::vector<std::function<void()>> tasks_;
    bool stopped_ = false;  // under tasks_mu_

    struct Watched {
        uint64_t token;
        std::shared_ptr<EventHandler> handler;
    };
    std::unordered_map<int, Watched> by_fd_;                                // loop thread
    std::unordered_map<uint64_t, std::shared_ptr<EventHandler>> by_token_;  // loop thread
    uint64_t next_token_ = 1;

    std::chrono::milliseconds tick_period_{0};
    std::function<void()> tick_;
    std::chrono::steady_clock::time_point next_tick_{};
};

}  // namespace ferry
