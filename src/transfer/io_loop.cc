#include "transfer/io_loop.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>

#include "core/log.h"

namespace ferry {

namespace {
constexpr uint64_t kWakeToken = 0;
}

Result<std::unique_ptr<IoLoop>> IoLoop::Create(std::string name) {
    std::unique_ptr<IoLoop> loop(new IoLoop(std::move(name)));
    loop->epoll_fd_.Reset(epoll_create1(EPOLL_CLOEXEC));
    loop->wake_fd_.Reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!loop->epoll_fd_.valid() || !loop->wake_fd_.valid()) {
        return ResourceExhaustedError(std::string("io loop: epoll/eventfd: ") +
                                      std::strerror(errno));
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kWakeToken;
    if (epoll_ctl(loop->epoll_fd_.get(), EPOLL_CTL_ADD, loop->wake_fd_.get(), &ev) != 0) {
        return InternalError(std::string("io loop: epoll_ctl: ") + std::strerror(errno));
    }
    IoLoop* raw = loop.get();
    loop->thread_ = std::thread([raw] { raw->Run(); });
    return loop;
}

IoLoop::~IoLoop() { Stop(); }

void IoLoop::Stop() {
    {
        std::lock_guard<std::mutex> lock(tasks_mu_);
        if (stopped_) {
            return;
        }
        stopped_ = true;
    }
    stopping_.store(true);
    Wake();
    if (thread_.joinable()) {
        thread_.join();
    }
    std::vector<std::function<void()>> dropped;
    {
        std::lock_guard<std::mutex> lock(tasks_mu_);
        dropped.swap(tasks_);
    }
    dropped.clear();
    by_fd_.clear();
    by_token_.clear();
    tick_ = nullptr;
}

void IoLoop::Wake() {
    uint64_t one = 1;
    ssize_t r = write(wake_fd_.get(), &one, sizeof(one));
    (void)r;  // EAGAIN means a wake-up is already pending
}

void IoLoop::Post(std::function<void()> fn) {
    bool was_empty = false;
    {
        std::lock_guard<std::mutex> lock(tasks_mu_);
        if (stopped_) {
            return;
        }
        was_empty = tasks_.empty();
        tasks_.push_back(std::move(fn));
    }
    if (was_empty) {
        Wake();
    }
}

bool IoLoop::RunSync(const std::function<void()>& fn) {
    if (InLoopThread()) {
        fn();
        return true;
    }
    struct SyncState {
        std::mutex mu;
        std::condition_variable cv;
        bool finished = false;
        bool ran = false;
    };
    // Signals `finished` when the task is destroyed, whether it ran or was dropped by Stop().
    struct Signal {
        std::shared_ptr<SyncState> st;
        ~Signal() {
            std::lock_guard<std::mutex> lock(st->mu);
            st->finished = true;
            st->cv.notify_all();
        }
    };
    auto st = std::make_shared<SyncState>();
    auto sig = std::make_shared<Signal>();
    sig->st = st;
    Post([&fn, st, sig = std::move(sig)] {
        fn();
        std::lock_guard<std::mutex> lock(st->mu);
        st->ran = true;
    });
    std::unique_lock<std::mutex> lock(st->mu);
    st->cv.wait(lock, [&] { return st->finished; });
    return st->ran;
}

Status IoLoop::Watch(int fd, uint32_t events, std::shared_ptr<EventHandler> handler) {
    uint64_t token = next_token_++;
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = token;
    if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
        return InternalError(std::string("epoll_ctl add: ") + std::strerror(errno));
    }
    by_token_[token] = handler;
    by_fd_[fd] = Watched{token, std::move(handler)};
    return Status::Ok();
}

void IoLoop::Modify(int fd, uint32_t events) {
    auto it = by_fd_.find(fd);
    if (it == by_fd_.end()) {
        return;
    }
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = it->second.token;
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, fd, &ev);
}

void IoLoop::Unwatch(int fd) {
    auto it = by_fd_.find(fd);
    if (it == by_fd_.end()) {
        return;
    }
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd, nullptr);
    by_token_.erase(it->second.token);
    by_fd_.erase(it);
}

void IoLoop::SetTick(std::chrono::milliseconds period, std::function<void()> fn) {
    Post([this, period, fn = std::move(fn)]() mutable {
        tick_period_ = period;
        tick_ = std::move(fn);
        next_tick_ = std::chrono::steady_clock::now() + period;
    });
}

void IoLoop::RunTasks() {
    std::vector<std::function<void()>> tasks;
    {
        std::lock_guard<std::mutex> lock(tasks_mu_);
        tasks.swap(tasks_);
    }
    for (auto& t : tasks) {
        t();
    }
}

void IoLoop::Run() {
    thread_id_.store(std::this_thread::get_id());
    pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
    constexpr int kMaxEvents = 64;
    epoll_event events[kMaxEvents];
    while (!stopping_.load()) {
        int timeout_ms = 100;
        if (tick_) {
            // Rounded up: truncating would poll with a zero timeout through the last
            // millisecond before every tick (a busy spin, 10 % of a core at a 10 ms tick).
            auto left = std::chrono::ceil<std::chrono::milliseconds>(
                next_tick_ - std::chrono::steady_clock::now());
            timeout_ms =
                static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(100, left.count())));
        }
        int n = epoll_wait(epoll_fd_.get(), events, kMaxEvents, timeout_ms);
        wakeups_.fetch_add(1, std::memory_order_relaxed);
        if (n < 0 && errno != EINTR) {
            FERRY_LOG(kError, "io loop {}: epoll_wait: {}", name_, std::strerror(errno));
            break;
        }
        for (int i = 0; i < n; ++i) {
            uint64_t token = events[i].data.u64;
            if (token == kWakeToken) {
                uint64_t v = 0;
                ssize_t r = read(wake_fd_.get(), &v, sizeof(v));
                (void)r;
                continue;
            }
            auto it = by_token_.find(token);
            if (it == by_token_.end()) {
                continue;  // unwatched earlier in this batch
            }
            std::shared_ptr<EventHandler> h = it->second;  // keep alive across the call
            h->OnEvents(events[i].events);
        }
        RunTasks();
        if (tick_ && std::chrono::steady_clock::now() >= next_tick_) {
            next_tick_ = std::chrono::steady_clock::now() + tick_period_;
            tick_();
        }
    }
    thread_id_.store(std::thread::id());
}

}  // namespace ferry
