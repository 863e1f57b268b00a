#include "model/work_pool.h"

#include <algorithm>

namespace ferry::model {

namespace {
// Spins of about 10-40 ns each before a thread sleeps: some tens of microseconds.
constexpr int kSpin = 2000;
inline void Pause() { __builtin_ia32_pause(); }
}  // namespace

WorkPool::WorkPool(int threads) : n_(std::max(1, threads)) {
    for (int t = 1; t < n_; ++t) threads_.emplace_back([this] { Loop(); });
}

WorkPool::~WorkPool() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
}

void WorkPool::Run(int parts, const std::function<void(int)>& fn, bool then_spin) {
    RunRanges(
        parts, 1,
        [&](int begin, int end) {
            for (int p = begin; p < end; ++p) fn(p);
        },
        then_spin);
}

void WorkPool::RunRanges(int n, int grain, const std::function<void(int, int)>& fn,
                         bool then_spin) {
    if (n <= 0) return;
    grain = std::max(1, grain);
    if (n_ == 1 || n <= grain) return fn(0, n);
    constexpr int kMax = 1 << (kBits - 1);
    if (n > kMax) {  // more than the packed word holds: in pieces
        for (int b = 0; b < n; b += kMax) {
            const int e = std::min(n, b + kMax);
            RunRanges(
                e - b, grain, [&](int lo, int hi) { fn(b + lo, b + hi); }, then_spin);
        }
        return;
    }
    fn_.store(&fn, std::memory_order_relaxed);
    grain_.store(grain, std::memory_order_relaxed);
    then_spin_.store(then_spin, std::memory_order_relaxed);
    pending_.store(n, std::memory_order_relaxed);
    gen_ = (gen_ + 1) & 0xffff;
    work_.store(Pack(gen_, 0, static_cast<uint64_t>(n)), std::memory_order_release);
    {
        std::lock_guard lock(mu_);  // so that a thread about to sleep sees the new generation
    }
    cv_.notify_all();
    Work(/*from_back=*/false, gen_);
    for (int i = 0; i < kSpin && pending_.load(std::memory_order_acquire) != 0; ++i) Pause();
    if (pending_.load(std::memory_order_acquire) != 0) {
        std::unique_lock lock(mu_);
        done_cv_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    }
}

// Takes ranges of generation `gen` until none is left: the caller from the front, the pool's
// threads from the back (the hardware prefetchers restart at every jump).
void WorkPool::Work(bool from_back, uint64_t gen) {
    for (;;) {
        uint64_t w = work_.load(std::memory_order_acquire);
        int lo = 0, hi = 0;
        for (;;) {
            const int front = static_cast<int>(w & kMask);
            const int back = static_cast<int>((w >> kBits) & kMask);
            if ((w >> (2 * kBits)) != gen || front >= back) return;
            const int left = back - front;
            const int take =
                std::min(left, std::max(grain_.load(std::memory_order_relaxed), left / (2 * n_)));
            lo = from_back ? back - take : front;
            hi = lo + take;
            const uint64_t next =
                from_back ? Pack(gen, front, back - take) : Pack(gen, front + take, back);
            if (work_.compare_exchange_weak(w, next, std::memory_order_acq_rel,
                                            std::memory_order_acquire)) {
                break;
            }
        }
        // Holding an unfinished range of `gen`, so the Run that set fn_ is still waiting.
        (*fn_.load(std::memory_order_relaxed))(lo, hi);
        if (pending_.fetch_sub(hi - lo, std::memory_order_acq_rel) == hi - lo && from_back) {
            {
                std::lock_guard lock(mu_);  // the caller checks pending_ under it before sleeping
            }
            done_cv_.notify_one();
        }
    }
}

void WorkPool::Loop() {
    uint64_t seen = 0;
    bool spin = false;
    auto generation = [&] { return work_.load(std::memory_order_acquire) >> (2 * kBits); };
    for (;;) {
        for (int i = 0; spin && i < kSpin && generation() == seen; ++i) Pause();
        if (generation() == seen) {
            std::unique_lock lock(mu_);
            cv_.wait(lock, [&] { return stop_ || generation() != seen; });
            if (stop_) return;
        }
        seen = generation();
        spin = then_spin_.load(std::memory_order_relaxed);
        Work(/*from_back=*/true, seen);
    }
}

}  // namespace ferry::model
