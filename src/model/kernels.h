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

#include <cstdint>
#include <functional>
#include <vector>

#include "core/huge_page_allocator.h"
#include "gguf/gguf.h"
#include "model/work_pool.h"

namespace ferry::model {

// Activations and scratch the kernels read with 64-byte loads.
using AlignedFloats = std::vector<float, CacheLineAllocator<float>>;

struct Weights {
    gguf::TensorType type = gguf::TensorType::kF32;
    int64_t rows = 0, cols = 0;
    // rows * cols elements of `type`; on huge pages where the system gives them (a decode step
    // streams them all).
    std::vector<uint8_t, HugePageAllocator<uint8_t>> bytes;

    size_t elem() const { return gguf::TensorTypeSize(type); }
    const float* f32() const { return reinterpret_cast<const float*>(bytes.data()); }
    const uint16_t* half() const { return reinterpret_cast<const uint16_t*>(bytes.data()); }
    size_t size_bytes() const { return bytes.size(); }
};

// Tensor `name` of `f`, which must have ggml dims `dims` (dims[0] varies fastest): widened to
// f32, or (2-D, dims {cols, rows}) as Weights in its own type (f16 and bf16 stay 16-bit).
// InvalidArgument naming the file and the tensor if it is missing or of other dims.
Result<std::vector<float>> TensorF32(const gguf::GgufFile& f, const std::string& name,
                                     std::vector<uint64_t> dims);
Result<Weights> TensorWeights(const gguf::GgufFile& f, const std::string& name,
                              std::vector<uint64_t> dims);

// Rows [r0, r1) / columns [c0, c1) of `w`, in its type.
Weights RowsOf(const Weights& w, int64_t r0, int64_t r1);
Weights ColsOf(const Weights& w, int64_t c0, int64_t c1);
// Appends `src`'s rows under `dst`'s (same type and width; an empty `dst` takes `src`'s).
void AppendRows(Weights* dst, const Weights& src);
// Row `r` of `w` as f32.
void WidenRow(const Weights& w, int64_t r, float* out);

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
// bf16 weights on a CPU with AVX-512 BF16 (and row kernels avx512): A rounded to bf16, as
// llama.cpp does, and dot products of bf16 pairs (VDPBF16PS) on the pool's threads; results
// within 2^-8 of the f32 product's magnitude. Bf16DotProducts() says whether that path runs.
void MatMulBulk(int m, const float* a, int lda, const Weights& w, float* c, int ldc, WorkPool& pool,
                AlignedFloats* scratch);
bool Bf16DotProducts();
// Either, by m: the row kernels up to kDirectRows rows.
void MatMulT(int m, const float* a, int lda, const Weights& w, float* c, int ldc, WorkPool& pool,
             AlignedFloats* scratch);

// Softmax of s[0, valid) in place; s[valid, len) set to 0. exp is Cephes' single-precision
// polynomial (within 2 ulp of exp), eight lanes at a time with AVX2.
void Softmax(float* s, int valid, int len);

}  // namespace ferry::model
