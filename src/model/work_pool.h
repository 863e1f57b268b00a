// The rank threads' loop runner: a fixed set of threads that share out the parts of one loop
// (the matrix products' output rows, model/kernels.h; the vision encoder's).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ferry::model {

// A fixed set of threads that run the parts of one loop; the caller runs a part too.
class WorkPool {
  public:
    explicit WorkPool(int threads);  // threads >= 1, the caller included
    ~WorkPool();
    WorkPool(const WorkPool&) = delete;
    WorkPool& operator=(const WorkPool&) = delete;
    int threads() const { return n_; }
    // fn(begin, end) over ranges that cover [0, n) once, spread over the threads; returns when
    // all are done. Ranges are handed out guided (each a share of what is left, never under
    // `grain` unless less is left), the caller taking from the front and the pool's threads
    // from the back, so with two threads each streams one contiguous range and the last pieces
    // are small: a thread that is done early waits for at most one small piece.
    // Afterwards the threads spin a little for the next Run (decode steps run ~50 products
    // back to back), unless `then_spin` is false: before OpenBLAS runs on the same cores,
    // spinning threads would take them from its threads.
    void RunRanges(int n, int grain, const std::function<void(int, int)>& fn,
                   bool then_spin = true);
    // fn(part) for part in [0, parts), as RunRanges with grain 1.
    void Run(int parts, const std::function<void(int)>& fn, bool then_spin = true);

  private:
    // work_ packs the generation (16 bits) with [front, back), the part of [0, n) not yet
    // handed out (24 bits each): one compare-and-swap hands out a range.
    static constexpr int kBits = 24;
    static constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;
    static uint64_t Pack(uint64_t gen, uint64_t front, uint64_t back) {
        return (gen << (2 * kBits)) | (back << kBits) | front;
    }
    void Loop();
    void Work(bool from_back, uint64_t gen);
    int n_;
    std::vector<std::thread> threads_;
    std::atomic<uint64_t> work_{0};
    std::atomic<int64_t> pending_{0};  // of the current Run's n, not yet done
    std::atomic<const std::function<void(int, int)>*> fn_{nullptr};
    std::atomic<int> grain_{1};
    std::atomic<bool> then_spin_{true};
    uint64_t gen_ = 0;  // the caller's (Run is called from one thread at a time)
    // For sleeping: the pool's threads wait on cv_ for a new generation, the caller on done_cv_
    // for pending_ to reach 0, after spinning a little (a wake-up through a condition variable
    // costs tens of microseconds).
    std::mutex mu_;
    std::condition_variable cv_, done_cv_;
    bool stop_ = false;  // under mu_
};

}  // namespace ferry::model
