#include "transfer/notification_queue.h"

#include "core/log.h"

namespace ferry::internal {

bool NotificationQueue::Push(std::string peer, std::string payload) {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes_ + payload.size() > max_bytes_) {
        FERRY_LOG(kWarn,
                  "dropping a notification from {}: {} bytes already queued "
                  "(call TakeNotifications)",
                  peer, bytes_);
        return false;
    }
    bytes_ += payload.size();
    notes_.push_back(Notification{std::move(peer), std::move(payload)});
    cv_.notify_all();
    return true;
}

std::vector<Notification> NotificationQueue::Take() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Notification> out(std::make_move_iterator(notes_.begin()),
                                  std::make_move_iterator(notes_.end()));
    notes_.clear();
    bytes_ = 0;
    return out;
}

std::vector<Notification> NotificationQueue::Wait(Clock::time_point deadline) {
    {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_until(lock, deadline, [&] { return !notes_.empty() || closed_; });
    }
    return Take();
}

void NotificationQueue::Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
}

size_t NotificationQueue::bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
}

}  // namespace ferry::internal
