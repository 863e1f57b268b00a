// Weight matrices kept in their file's precision (f32, f16, bf16) and the products that read
// them: C = A * W^T with W [rows][cols] row-major (a weight stored [out][in]).
//
// - Up to kDirectRows rows of A (decode steps, small batches), every type: row kernels that
//   stream each weight row once in its stored precision, widening 16-bit weights in registers
//   (AVX2 + F16C where the CPU has them, a scalar loop otherwise), so an f16 decode step streams
//   half the bytes of f32. Their output rows are shared out over a WorkPool.
// - More rows (prefill), f32: OpenBLAS's sgemm.
// - More rows, f16 / bf16: tiles of W widened into a scratch buffer, each multiplied by sgemm;
//   the widening is small beside the tile's arithmetic.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/huge_page_allocator.h"
#include "model/gguf.h"

namespace ferry::model {

struct Weights {
    TensorType type = TensorType::kF32;
    int64_t rows = 0, cols = 0;
    // rows * cols elements of `type`; on huge pages where the system gives them (a decode step
    // streams them all).
    std::vector<uint8_t, HugePageAllocator<uint8_t>> bytes;

    size_t elem() const { return TensorTypeSize(type); }
    const float* f32() const { return reinterpret_cast<const float*>(bytes.data()); }
    const uint16_t* half() const { return reinterpret_cast<const uint16_t*>(bytes.data()); }
    size_t size_bytes() const { return bytes.size(); }
};

// Rows [r0, r1) / columns [c0, c1) of `w`, in its type.
Weights RowsOf(const Weights& w, int64_t r0, int64_t r1);
Weights ColsOf(const Weights& w, int64_t c0, int64_t c1);
// Appends `src`'s rows under `dst`'s (same type and width; an empty `dst` takes `src`'s).
void AppendRows(Weights* dst, const Weights& src);
// Row `r` of `w` as f32.
void WidenRow(const Weights& w, int64_t r, float* out);

// A fixed set of threads that run the parts of one loop; the caller runs a part too.
class WorkPool {
  public:
    explicit WorkPool(int threads);  // threads >= 1, the caller included
    ~WorkPool();
    WorkPool(const WorkPool&) = delete;
    WorkPool& operator=(const WorkPool&) = delete;
    int threads() const { return n_; }
    // fn(part) for part in [0, parts), spread over the threads; returns when all are done.
    // Afterwards the threads spin a little for the next Run (decode steps run ~50 products
    // back to back), unless `then_spin` is false: before OpenBLAS runs on the same cores,
    // spinning threads would take them from its threads.
    void Run(int parts, const std::function<void(int)>& fn, bool then_spin = true);

  private:
    void Loop();
    void Work(bool from_back);
    int n_;
    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable cv_, done_cv_;
    const std::function<void(int)>* fn_ = nullptr;
    int front_ = 0;  // parts [front_, back_) are still to hand out (under mu_)
    int back_ = 0;
    int running_ = 0;  // parts handed out and not finished
    uint64_t generation_ = 0;
    bool stop_ = false;
    // Copies of generation_ and of "every part done", read without the lock by threads that
    // spin a little before they sleep: a decode step runs ~50 products of well under a
    // millisecond each, and a wake-up through the condition variable costs tens of
    // microseconds.
    std::atomic<uint64_t> published_{0};
    std::atomic<bool> all_done_{false};
    bool then_spin_ = true;  // under mu_
};

// The instruction set the row kernels run on: the best this CPU has (AVX-512 F/BW/VL/DQ, else
// AVX2 + FMA + F16C, else scalar), unless FERRY_ROW_KERNELS (scalar, avx2, avx512) asks for
// less. Each sums in its own fixed order, so one process uses one; SetRowIsa is for tests and
// benchmarks (false, and nothing changed, for one the CPU lacks).
enum class KernelIsa { kScalar, kAvx2, kAvx512 };
const char* KernelIsaName(KernelIsa isa);
KernelIsa BestRowIsa();
KernelIsa RowIsa();
bool SetRowIsa(KernelIsa isa);

// Up to this many rows of A, products go through the row kernels; beyond, through sgemm.
inline constexpr int kDirectRows = 32;

// C[m][w.rows] = A[m][w.cols] * W^T by the row kernels, for any m: each output is summed in
// one order whatever m is (the engine uses them for decode steps and the output head, so that a
// sequence's tokens do not depend on the batch it is in).
void MatMulRows(int m, const float* a, int lda, const Weights& w, float* c, int ldc,
                WorkPool& pool);
// The same through sgemm (f32) or widened tiles and sgemm (f16, bf16): prefill chunks.
// `scratch` is grown as needed (the widened tiles).
void MatMulBulk(int m, const float* a, int lda, const Weights& w, float* c, int ldc,
                std::vector<float>* scratch);
// Either, by m: the row kernels up to kDirectRows rows.
void MatMulT(int m, const float* a, int lda, const Weights& w, float* c, int ldc, WorkPool& pool,
             std::vector<float>* scratch);

// Softmax of s[0, valid) in place; s[valid, len) set to 0. exp is Cephes' single-precision
// polynomial (within 2 ulp of exp), eight lanes at a time with AVX2.
void Softmax(float* s, int valid, int len);

}  // namespace ferry::model
