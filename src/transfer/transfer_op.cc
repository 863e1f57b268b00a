#include "transfer/transfer_op.h"

#include <algorithm>
#include <cstring>

#include "transfer/connection.h"
#include "transfer/iov_cursor.h"

namespace ferry::internal {

void TransferOp::Arm(uint32_t chunks, std::vector<RegionPin> pins,
                     std::function<void()> on_success) {
    std::lock_guard<std::mutex> lock(mu_);
    chunks_left_ = chunks;
    for (const RegionPin& p : pins) {
        local_regions_.push_back(p.entry()->id);
    }
    pins_ = std::move(pins);
    on_success_ = std::move(on_success);
}

void TransferOp::AddConnection(const std::shared_ptr<Connection>& c) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& w : conns_) {
        if (w.lock() == c) {
            return;
        }
    }
    conns_.push_back(c);
}

void TransferOp::FinishLocked(const Status& s) {
    finished_ = true;
    status_ = s;
    ReportLocked();
}

void TransferOp::ReportLocked() {
    reported_ = true;
    reported_flag_.store(true, std::memory_order_release);
    cv_.notify_all();
    if (on_reported_) {
        std::function<void()> f = std::move(on_reported_);
        on_reported_ = nullptr;
        f();
    }
}

void TransferOp::SetOnReported(std::function<void()> f) {
    std::lock_guard<std::mutex> lock(mu_);
    if (reported_) {
        f();
        return;
    }
    on_reported_ = std::move(f);
}

void TransferOp::ChunkDone(const Status& s, uint64_t value) {
    std::vector<RegionPin> release;  // destroyed after the lock below is dropped
    std::function<void()> on_success;
    bool failed_now = false;
    bool success_now = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (chunks_left_ > 0) {
            --chunks_left_;
        }
        if (kind_ == Kind::kPull && s.ok()) {
            pull_size_ = value;
        }
        if (chunks_left_ == 0 || (!s.ok() && mode_ == wire::DataMode::kInline && !cut_off_)) {
            release = std::move(pins_);
        }
        if (finished_) {
            return;
        }
        if (!s.ok()) {
            FinishLocked(s);  // later chunks are discarded: io_closed below
            failed_now = true;
        } else if (chunks_left_ == 0) {
            success_now = true;
            on_success = std::move(on_success_);
        }
    }
    if (failed_now || success_now) {
        CloseIo();
    }
    if (success_now) {
        if (on_success) {
            on_success();
        }
        std::lock_guard<std::mutex> lock(mu_);
        if (!finished_) {
            FinishLocked(Status::Ok());
        }
    }
}

void TransferOp::CloseIo() {
    std::unique_lock<std::mutex> io(io_mu);
    io_closed = true;
    io_cv_.wait(io, [&] { return local_active_ == 0; });
}

std::optional<uint64_t> TransferOp::one_sided_epoch() const {
    std::lock_guard<std::mutex> lock(mu_);
    return one_sided_epoch_;
}

void TransferOp::SetLocalWork(std::vector<LocalCopy> work, bool to_remote,
                              std::vector<std::shared_ptr<void>> keep, uint64_t peer_epoch) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        one_sided_epoch_ = peer_epoch;
    }
    std::lock_guard<std::mutex> io(io_mu);
    work_ = std::move(work);
    work_to_remote_ = to_remote;
    keep_ = std::move(keep);
}

void TransferOp::RunLocalWork(std::optional<Clock::time_point> until) {
    for (;;) {
        // A waiter with a deadline helps only until it passes (between chunks): the loop
        // threads copy the rest.
        if (until && Clock::now() >= *until) return;
        size_t i = 0;
        {
            std::lock_guard<std::mutex> io(io_mu);
            if (io_closed || next_work_ >= work_.size()) {
                return;
            }
            i = next_work_++;
            ++local_active_;
        }
        const LocalCopy& w = work_[i];
        IovCursor l, r;
        while (!l.AtEnd(w.local) && !r.AtEnd(w.remote)) {
            size_t n = std::min(l.Contiguous(w.local), r.Contiguous(w.remote));
            if (work_to_remote_) {
                std::memcpy(r.Pointer(w.remote), l.Pointer(w.local), n);
            } else {
                std::memcpy(l.Pointer(w.local), r.Pointer(w.remote), n);
            }
            l.Advance(w.local, n);
            r.Advance(w.remote, n);
        }
        {
            std::lock_guard<std::mutex> io(io_mu);
            if (--local_active_ == 0) {
                io_cv_.notify_all();
            }
        }
        ChunkDone(Status::Ok());
    }
}

void TransferOp::SetCutOff(std::function<void(const Status&)> cut_off) {
    std::lock_guard<std::mutex> lock(mu_);
    cut_off_ = std::move(cut_off);
}

void TransferOp::Fail(const Status& s, bool close_streams) {
    CloseIo();
    std::vector<std::shared_ptr<Connection>> close;
    std::vector<RegionPin> release;
    std::function<void(const Status&)> cut_off;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (finished_) {
            return;
        }
        if (chunks_left_ > 0 && cut_off_) {
            // The backend moves bytes in and out of our memory itself: stop it first.
            finished_ = true;
            status_ = s;
            cut_off = cut_off_;
        } else if (chunks_left_ > 0 && mode_ == wire::DataMode::kCma && close_streams) {
            // The peer copies straight into our memory: cut it off before reporting, so that
            // when Wait returns nothing touches the memory any more.
            finished_ = true;
            status_ = s;
            for (const auto& w : conns_) {
                if (auto c = w.lock()) {
                    close.push_back(std::move(c));
                }
            }
        } else {
            FinishLocked(s);
            if (mode_ == wire::DataMode::kInline) {
                release = std::move(pins_);
            }
        }
    }
    if (cut_off) {
        cut_off(s);
        std::lock_guard<std::mutex> lock(mu_);
        ReportLocked();
        return;
    }
    if (close.empty()) {
        return;
    }
    for (auto& c : close) {
        c->CloseAndWait(UnavailableError("closing shm stream of transfer " + std::to_string(id_) +
                                         " that ended with: " + s.ToString()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    ReportLocked();
}

Result<TransferState> TransferOp::Poll() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!reported_) {
        return TransferState::kPending;
    }
    if (!status_.ok()) {
        return status_;
    }
    return TransferState::kDone;
}

Status TransferOp::Wait(Clock::time_point deadline) {
    RunLocalWork(deadline);  // one-sided chunks nobody has started yet: copy them here
    // Most transfers finish within microseconds of being waited on: spin briefly before paying
    // for a sleep and a wake-up.
    auto spin_until = std::min(deadline, Clock::now() + std::chrono::microseconds(30));
    while (!reported_flag_.load(std::memory_order_acquire) && Clock::now() < spin_until) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return reported_; })) {
        return DeadlineExceededError("transfer " + std::to_string(id_) + " to " + peer_ +
                                     " still pending at the wait deadline");
    }
    return status_;
}

bool TransferOp::UsesLocalRegion(RegionId id) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (RegionId r : local_regions_) {
        if (r == id) {
            return true;
        }
    }
    return false;
}

bool TransferOp::finished() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reported_;
}

std::optional<uint64_t> TransferOp::pull_size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pull_size_;
}

}  // namespace ferry::internal
