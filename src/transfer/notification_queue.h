// The notifications an agent received and its user has not taken yet, from every backend. Bounded
// in bytes: past the bound a notification is dropped (and logged), so a peer that floods cannot
// exhaust the receiver's memory while its user is not taking them.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "ferry/agent.h"

namespace ferry::internal {

class NotificationQueue {
  public:
    static constexpr size_t kDefaultMaxBytes = 256u << 20;
    explicit NotificationQueue(size_t max_bytes = kDefaultMaxBytes) : max_bytes_(max_bytes) {}

    // Queues one (any thread). False: dropped, the queue holds `max_bytes` already.
    bool Push(std::string peer, std::string payload);
    // All queued, oldest first.
    std::vector<Notification> Take();
    // Waits until one is queued, the deadline passes or Close was called, then takes all.
    std::vector<Notification> Wait(Clock::time_point deadline);
    // Wakes every waiter for good (shutdown).
    void Close();

    size_t bytes() const;

  private:
    const size_t max_bytes_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Notification> notes_;
    size_t bytes_ = 0;
    bool closed_ = false;
};

}  // namespace ferry::internal
