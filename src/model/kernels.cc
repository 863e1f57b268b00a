#include "model/kernels.h"

#include <cblas.h>
#include <fmt/core.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/half.h"

namespace ferry::model {

// --- Weights ------------------------------------------------------------------------------------

Result<std::vector<float>> TensorF32(const gguf::GgufFile& f, const std::string& name,
                                     std::vector<uint64_t> dims) {
    const gguf::GgufTensor* t = f.FindTensor(name);
    if (!t) return InvalidArgumentError(fmt::format("{}: tensor {} is missing", f.path(), name));
    if (t->dims != dims) {
        auto show = [](const std::vector<uint64_t>& d) {
            std::string s;
            for (uint64_t v : d) s += (s.empty() ? "" : ", ") + std::to_string(v);
            return "[" + s + "]";
        };
        return InvalidArgumentError(fmt::format("{}: tensor {} has dims {}, expected {}", f.path(),
                                                name, show(t->dims), show(dims)));
    }
    std::vector<float> out(t->elements());
    switch (t->type) {
        case gguf::TensorType::kF32:
            std::memcpy(out.data(), t->data, out.size() * 4);
            break;
        case gguf::TensorType::kF16:
            for (size_t i = 0; i < out.size(); ++i) {
                uint16_t h;
                std::memcpy(&h, t->data + 2 * i, 2);
                out[i] = F16ToFloat(h);
            }
            break;
        case gguf::TensorType::kBF16:
            for (size_t i = 0; i < out.size(); ++i) {
                uint16_t h;
                std::memcpy(&h, t->data + 2 * i, 2);
                out[i] = Bf16ToFloat(h);
            }
            break;
    }
    return out;
}

Result<Weights> TensorWeights(const gguf::GgufFile& f, const std::string& name,
                              std::vector<uint64_t> dims) {
    const gguf::GgufTensor* t = f.FindTensor(name);
    if (!t) return InvalidArgumentError(fmt::format("{}: tensor {} is missing", f.path(), name));
    if (t->dims != dims) {
        FERRY_RETURN_IF_ERROR(TensorF32(f, name, dims).status());  // names both shapes
    }
    Weights w;
    w.type = t->type;
    w.cols = static_cast<int64_t>(dims[0]);
    w.rows = static_cast<int64_t>(dims[1]);
    w.bytes.assign(t->data, t->data + t->bytes);
    return w;
}

Weights RowsOf(const Weights& w, int64_t r0, int64_t r1) {
    Weights out;
    out.type = w.type;
    out.rows = r1 - r0;
    out.cols = w.cols;
    const size_t row = static_cast<size_t>(w.cols) * w.elem();
    out.bytes.assign(w.bytes.begin() + static_cast<std::ptrdiff_t>(r0 * row),
                     w.bytes.begin() + static_cast<std::ptrdiff_t>(r1 * row));
    return out;
}

Weights ColsOf(const Weights& w, int64_t c0, int64_t c1) {
    Weights out;
    out.type = w.type;
    out.rows = w.rows;
    out.cols = c1 - c0;
    const size_t e = w.elem();
    out.bytes.resize(static_cast<size_t>(out.rows * out.cols) * e);
    for (int64_t r = 0; r < w.rows; ++r) {
        std::memcpy(&out.bytes[static_cast<size_t>(r * out.cols) * e],
                    &w.bytes[static_cast<size_t>(r * w.cols + c0) * e],
                    static_cast<size_t>(out.cols) * e);
    }
    return out;
}

void AppendRows(Weights* dst, const Weights& src) {
    if (dst->bytes.empty()) {
        *dst = src;
        return;
    }
    dst->bytes.insert(dst->bytes.end(), src.bytes.begin(), src.bytes.end());
    dst->rows += src.rows;
}

namespace {

// A region of functions compiled for instruction set T (a target attribute on each): GCC's
// push_options / target, or clang's attribute push (clang ignores #pragma GCC target).
#define FERRY_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define FERRY_TARGET_BEGIN(T) \
    FERRY_PRAGMA(clang attribute push(__attribute__((target(T))), apply_to = function))
#define FERRY_TARGET_END FERRY_PRAGMA(clang attribute pop)
#else
#define FERRY_TARGET_BEGIN(T) FERRY_PRAGMA(GCC push_options) FERRY_PRAGMA(GCC target(T))
#define FERRY_TARGET_END FERRY_PRAGMA(GCC pop_options)
#endif

// --- AVX2 + F16C kernels -----------------------------------------------------------------------

#define FERRY_AVX2 __attribute__((target("avx2,fma,f16c")))

template <bool kBf16>
FERRY_AVX2 inline __m256 Load8(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (kBf16) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
        return _mm256_cvtph_ps(h);
    }
}

FERRY_AVX2 inline float Sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The row kernels (row_kernels.inc), for AVX2 + F16C and for AVX-512.
namespace avx2 {
FERRY_TARGET_BEGIN("avx2,fma,f16c")
#define FERRY_V __m256
#define FERRY_LANES 8
#define FERRY_ZERO() _mm256_setzero_ps()
#define FERRY_LOAD(p) _mm256_loadu_ps(p)
#define FERRY_STORE(p, v) _mm256_storeu_ps(p, v)
#define FERRY_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define FERRY_ADD(a, b) _mm256_add_ps(a, b)
#define FERRY_SUM(v) Sum8(v)
#define FERRY_HALF(p) Load8<false>(p)
#define FERRY_BF16(p) Load8<true>(p)
#define FERRY_PREFETCH(p) (void)(p)  // prefetching slowed these kernels on the EPYC measured
#define FERRY_GROUP 2                // 8 accumulators of 16 registers
#include "model/row_kernels.inc"
#undef FERRY_V
#undef FERRY_LANES
#undef FERRY_ZERO
#undef FERRY_LOAD
#undef FERRY_STORE
#undef FERRY_FMA
#undef FERRY_ADD
#undef FERRY_SUM
#undef FERRY_HALF
#undef FERRY_BF16
#undef FERRY_PREFETCH
#undef FERRY_GROUP
FERRY_TARGET_END
}  // namespace avx2

namespace avx512 {
FERRY_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12 warns of the _mm512_undefined_* operand inside its own widening intrinsics.
#pragma GCC diagnostic push
#ifndef __clang__  // a GCC warning clang does not know
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
inline __m512 LoadBf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#define FERRY_V __m512
#define FERRY_LANES 16
#define FERRY_ZERO() _mm512_setzero_ps()
#define FERRY_LOAD(p) _mm512_loadu_ps(p)
#define FERRY_STORE(p, v) _mm512_storeu_ps(p, v)
#define FERRY_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define FERRY_ADD(a, b) _mm512_add_ps(a, b)
#define FERRY_SUM(v) _mm512_reduce_add_ps(v)
#define FERRY_HALF(p) LoadF16(p)
#define FERRY_BF16(p) LoadBf16(p)
// Every weight line 4 KiB ahead: on the Xeon measured (Emerald Rapids) decode products read
// 1.05-1.10x faster than with the hardware prefetchers alone (f16 gained most: 1 KiB ahead was
// not enough for it).
#define FERRY_PREFETCH(p) _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0)
#define FERRY_GROUP 4  // 16 accumulators of 32 registers
#include "model/row_kernels.inc"
#undef FERRY_V
#undef FERRY_LANES
#undef FERRY_ZERO
#undef FERRY_LOAD
#undef FERRY_STORE
#undef FERRY_FMA
#undef FERRY_ADD
#undef FERRY_SUM
#undef FERRY_HALF
#undef FERRY_BF16
#undef FERRY_PREFETCH
#undef FERRY_GROUP
#pragma GCC diagnostic pop
FERRY_TARGET_END
}  // namespace avx512

// exp(x) for x <= 0 (softmax after subtracting the maximum): Cephes' single-precision
// polynomial, within 2 ulp. The vector form below computes the same operations lane by lane.
inline float ExpNonPositive(float x) {
    x = std::max(x, -87.0f);
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r -= n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return y * scale;
}

FERRY_AVX2 inline __m256 ExpNonPositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                    5.0000001201e-1f}) {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    }
    const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
                                   _mm256_set1_ps(1.0f));
    const __m256i bits =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

FERRY_AVX2 void SoftmaxAvx2(float* s, int valid, int len) {
    __m256 mx8 = _mm256_set1_ps(-INFINITY);
    int k = 0;
    for (; k + 8 <= valid; k += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(s + k));
    float mx = s[0];
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx8);
    for (float v : lanes) mx = std::max(mx, v);
    for (; k < valid; ++k) mx = std::max(mx, s[k]);
    const __m256 m8 = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    k = 0;
    for (; k + 8 <= valid; k += 8) {
        const __m256 e = ExpNonPositive8(_mm256_sub_ps(_mm256_loadu_ps(s + k), m8));
        _mm256_storeu_ps(s + k, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = Sum8(sum8);
    for (; k < valid; ++k) {
        s[k] = ExpNonPositive(s[k] - mx);
        sum += s[k];
    }
    const __m256 inv8 = _mm256_set1_ps(1.0f / sum);
    k = 0;
    for (; k + 8 <= valid; k += 8)
        _mm256_storeu_ps(s + k, _mm256_mul_ps(_mm256_loadu_ps(s + k), inv8));
    const float inv = 1.0f / sum;
    for (; k < valid; ++k) s[k] *= inv;
    std::fill(s + valid, s + len, 0.0f);
}

// The same without SIMD, for CPUs without AVX2/F16C.
void RowsScalar(const Weights& w, const float* a, int lda, int m, float* c, int ldc, int j0,
                int j1) {
    const int k = static_cast<int>(w.cols);
    std::vector<float> row(static_cast<size_t>(k));
    for (int j = j0; j < j1; ++j) {
        WidenRow(w, j, row.data());
        for (int i = 0; i < m; ++i) {
            const float* ai = a + static_cast<size_t>(i) * lda;
            float s = 0;
            for (int x = 0; x < k; ++x) s += ai[x] * row[x];
            c[static_cast<size_t>(i) * ldc + j] = s;
        }
    }
}

void Widen(gguf::TensorType type, const uint16_t* h, size_t n, float* out) {
    if (type == gguf::TensorType::kBF16) {
        Bf16ToFloat(h, n, out);
    } else {
        F16ToFloat(h, n, out);
    }
}

KernelIsa ParseIsaEnv(KernelIsa best) {
    const char* env = std::getenv("FERRY_ROW_KERNELS");
    if (!env || !*env) return best;
    for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
        if (std::strcmp(env, KernelIsaName(isa)) != 0) continue;
        if (static_cast<int>(isa) <= static_cast<int>(best)) return isa;
        std::fprintf(stderr, "ferry: FERRY_ROW_KERNELS=%s: this CPU lacks it; using %s\n", env,
                     KernelIsaName(best));
        return best;
    }
    std::fprintf(stderr,
                 "ferry: FERRY_ROW_KERNELS=%s is not one of scalar, avx2, avx512; using %s\n", env,
                 KernelIsaName(best));
    return best;
}

std::atomic<KernelIsa>& RowIsaSetting() {
    static std::atomic<KernelIsa> isa{ParseIsaEnv(BestRowIsa())};
    return isa;
}

// Output rows [j0, j1) of C = A W^T for m rows of A, by the row kernels.
void Rows(const Weights& w, const float* a, int lda, int m, float* c, int ldc, int j0, int j1) {
    const int k = static_cast<int>(w.cols);
    switch (RowIsa()) {
        case KernelIsa::kScalar:
            return RowsScalar(w, a, lda, m, c, ldc, j0, j1);
        case KernelIsa::kAvx2:
            switch (w.type) {
                case gguf::TensorType::kF32:
                    return avx2::F32Rows(w.f32(), k, a, lda, m, c, ldc, j0, j1);
                case gguf::TensorType::kBF16:
                    return avx2::HalfRows<true>(w.half(), k, a, lda, m, c, ldc, j0, j1);
                default:
                    return avx2::HalfRows<false>(w.half(), k, a, lda, m, c, ldc, j0, j1);
            }
        case KernelIsa::kAvx512:
            switch (w.type) {
                case gguf::TensorType::kF32:
                    return avx512::F32Rows(w.f32(), k, a, lda, m, c, ldc, j0, j1);
                case gguf::TensorType::kBF16:
                    return avx512::HalfRows<true>(w.half(), k, a, lda, m, c, ldc, j0, j1);
                default:
                    return avx512::HalfRows<false>(w.half(), k, a, lda, m, c, ldc, j0, j1);
            }
    }
}

// --- bf16 weights, many rows of A, on CPUs with AVX-512 BF16: dot products of bf16 pairs ------
// A is rounded to bf16 (nearest even) once, as llama.cpp does for bf16 weights, and each
// VDPBF16PS multiplies 32 pairs into 16 f32 sums: twice the products of an f32 FMA, on the
// weights as they are stored (no widened tile). Tiles of 4 rows of A by 6 weight rows keep 24
// sums in registers; A in panels of about 512 KiB stays in L2 while the weight rows pass.
namespace bf16dp {
FERRY_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
// GCC 12 warns of the _mm512_undefined_* operand inside its own reduction intrinsics.
#pragma GCC diagnostic push
#ifndef __clang__  // a GCC warning clang does not know
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"

constexpr int kMr = 4, kNr = 6;

// Rows of A rounded to bf16 into out (rows of kp values, zeros past k).
void PackA(int m, const float* a, int lda, int k, int kp, uint16_t* out) {
    for (int i = 0; i < m; ++i) {
        const float* ai = a + static_cast<size_t>(i) * lda;
        uint16_t* oi = out + static_cast<size_t>(i) * kp;
        for (int x = 0; x < kp; x += 32) {
            const int left = std::max(0, k - x);
            const __mmask16 lo = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
            const int left_hi = std::max(0, left - 16);
            const __mmask16 hi =
                left_hi >= 16 ? 0xffff : static_cast<__mmask16>((1u << left_hi) - 1);
            const __m512 vlo = _mm512_maskz_loadu_ps(lo, ai + x);
            const __m512 vhi = _mm512_maskz_loadu_ps(hi, ai + x + 16);
            _mm512_storeu_si512(oi + x, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(vhi, vlo)));
        }
    }
}

// c[i][r] = sum over k of a[i] * w[r], i < MR, r < NR. a: packed rows of kp values; w: rows of
// k values (the loads past k masked off: what lies there may not be a number).
template <int MR, int NR>
void Tile(int k, int kp, const uint16_t* a, const uint16_t* w, float* c, int ldc) {
    __m512 acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
    }
    const int full = k & ~31;
    auto step = [&](int x, __mmask32 mask) {
        __m512bh av[MR];
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            av[i] =
                reinterpret_cast<__m512bh>(_mm512_loadu_si512(a + static_cast<size_t>(i) * kp + x));
        }
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
            const __m512bh wv = reinterpret_cast<__m512bh>(
                _mm512_maskz_loadu_epi16(mask, w + static_cast<size_t>(r) * k + x));
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], av[i], wv);
        }
    };
    int x = 0;
    for (; x < full; x += 32) step(x, ~__mmask32{0});
    if (x < k) step(x, static_cast<__mmask32>((uint64_t{1} << (k - x)) - 1));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
            c[static_cast<size_t>(i) * ldc + r] = _mm512_reduce_add_ps(acc[i][r]);
        }
    }
}

using TileFn = void (*)(int, int, const uint16_t*, const uint16_t*, float*, int);

template <int MR, int... NR>
constexpr std::array<TileFn, sizeof...(NR)> Row(std::integer_sequence<int, NR...>) {
    return {&Tile<MR, NR + 1>...};
}
template <int... MR>
constexpr std::array<std::array<TileFn, kNr>, sizeof...(MR)> Table(
    std::integer_sequence<int, MR...>) {
    return {Row<MR + 1>(std::make_integer_sequence<int, kNr>())...};
}
constexpr auto kTiles = Table(std::make_integer_sequence<int, kMr>());

// c[i][j] for i in [0, m), j in [j0, j1).
void Rows(int m, int k, int kp, const uint16_t* a, const uint16_t* w, float* c, int ldc, int j0,
          int j1) {
    const int panel =
        std::max(kMr, static_cast<int>((512 << 10) / (static_cast<size_t>(kp) * 2)) / kMr * kMr);
    for (int i0 = 0; i0 < m; i0 += panel) {
        const int i1 = std::min(m, i0 + panel);
        for (int j = j0; j < j1; j += kNr) {
            const int nr = std::min(kNr, j1 - j);
            const uint16_t* wj = w + static_cast<size_t>(j) * k;
            for (int i = i0; i < i1; i += kMr) {
                const int mr = std::min(kMr, i1 - i);
                kTiles[mr - 1][nr - 1](k, kp, a + static_cast<size_t>(i) * kp, wj,
                                       c + static_cast<size_t>(i) * ldc + j, ldc);
            }
        }
    }
}

#pragma GCC diagnostic pop
FERRY_TARGET_END
}  // namespace bf16dp

bool CpuHasAvx512Bf16() {
    static const bool has = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512bf16");
    }();
    return has;
}

// Rows of W per widened tile: about 16 MiB of f32, a multiple of 16 rows (smaller tiles cost
// sgemm more than the scratch saves: it packs A again for each).
int64_t TileRows(int64_t cols) { return std::max<int64_t>(16, ((1 << 22) / cols) & ~15); }

}  // namespace

const char* KernelIsaName(KernelIsa isa) {
    switch (isa) {
        case KernelIsa::kScalar:
            return "scalar";
        case KernelIsa::kAvx2:
            return "avx2";
        case KernelIsa::kAvx512:
            return "avx512";
    }
    return "?";
}

KernelIsa BestRowIsa() {
    static const KernelIsa best = [] {
        if (!CpuHasAvx2F16c()) return KernelIsa::kScalar;
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
            return KernelIsa::kAvx512;
        }
        return KernelIsa::kAvx2;
    }();
    return best;
}

KernelIsa RowIsa() { return RowIsaSetting().load(std::memory_order_relaxed); }

bool SetRowIsa(KernelIsa isa) {
    if (static_cast<int>(isa) > static_cast<int>(BestRowIsa())) return false;
    RowIsaSetting().store(isa, std::memory_order_relaxed);
    return true;
}

void Softmax(float* s, int valid, int len) {
    if (CpuHasAvx2F16c()) return SoftmaxAvx2(s, valid, len);
    float mx = s[0];
    for (int k = 1; k < valid; ++k) mx = std::max(mx, s[k]);
    float sum = 0;
    for (int k = 0; k < valid; ++k) {
        s[k] = ExpNonPositive(s[k] - mx);
        sum += s[k];
    }
    const float inv = 1.0f / sum;
    for (int k = 0; k < valid; ++k) s[k] *= inv;
    std::fill(s + valid, s + len, 0.0f);
}

void WidenRow(const Weights& w, int64_t r, float* out) {
    if (w.type == gguf::TensorType::kF32) {
        std::memcpy(out, w.f32() + r * w.cols, static_cast<size_t>(w.cols) * 4);
        return;
    }
    Widen(w.type, w.half() + r * w.cols, static_cast<size_t>(w.cols), out);
}

// --- MatMulT ------------------------------------------------------------------------------------

void MatMulRows(int m, const float* a, int lda, const Weights& w, float* c, int ldc,
                WorkPool& pool) {
    const int n = static_cast<int>(w.rows);
    if (m <= 0 || n <= 0) return;
    // Output rows in ranges handed out guided (WorkPool::RunRanges), the smallest about 16 KiB
    // of weights, so a thread done early waits microseconds, not a part of 64 rows (up to half
    // a megabyte: 8% of a decode step idle). (OpenBLAS's sgemv read f32 at about two thirds of
    // this kernel's bandwidth here, and its threads' hand-offs cost more than the pool's.)
    const int grain = std::max<int>(1, (16 << 10) / std::max<size_t>(1, w.cols * w.elem()));
    pool.RunRanges(n, grain, [&](int j0, int j1) { Rows(w, a, lda, m, c, ldc, j0, j1); });
}

bool Bf16DotProducts() { return CpuHasAvx512Bf16() && RowIsa() == KernelIsa::kAvx512; }

void MatMulBulk(int m, const float* a, int lda, const Weights& w, float* c, int ldc, WorkPool& pool,
                AlignedFloats* scratch) {
    const int n = static_cast<int>(w.rows), k = static_cast<int>(w.cols);
    if (m <= 0 || n <= 0) return;
    if (w.type == gguf::TensorType::kBF16 && Bf16DotProducts()) {
        const int kp = (k + 31) & ~31;
        scratch->resize((static_cast<size_t>(m) * kp + 1) / 2 + 16);
        auto* packed = reinterpret_cast<uint16_t*>(scratch->data());
        bf16dp::PackA(m, a, lda, k, kp, packed);
        // The pool's threads over blocks of weight rows (OpenBLAS's stay idle).
        const int blocks = (n + bf16dp::kNr - 1) / bf16dp::kNr;
        pool.RunRanges(
            blocks, 1,
            [&](int b0, int b1) {
                bf16dp::Rows(m, k, kp, packed, w.half(), c, ldc, b0 * bf16dp::kNr,
                             std::min(n, b1 * bf16dp::kNr));
            },
            /*then_spin=*/false);
        return;
    }
    if (w.type == gguf::TensorType::kF32) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a, lda, w.f32(), k,
                    0.0f, c, ldc);
        return;
    }
    const uint16_t* h = w.half();
    const int64_t tile = TileRows(k);
    scratch->resize(static_cast<size_t>(tile * k));
    for (int64_t r0 = 0; r0 < n; r0 += tile) {
        const int64_t rows = std::min<int64_t>(tile, n - r0);
        // Widen the tile here, then one sgemm (OpenBLAS's threads) over it. The widening is a
        // few percent of the tile's arithmetic; spreading it over the pool made prefill slower,
        // its threads fighting OpenBLAS's, which spin a while after each call.
        float* t = scratch->data();
        Widen(w.type, h + r0 * k, static_cast<size_t>(rows * k), t);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, static_cast<int>(rows), k, 1.0f, a,
                    lda, t, k, 0.0f, c + r0, ldc);
    }
}

void MatMulT(int m, const float* a, int lda, const Weights& w, float* c, int ldc, WorkPool& pool,
             AlignedFloats* scratch) {
    if (m <= kDirectRows) return MatMulRows(m, a, lda, w, c, ldc, pool);
    MatMulBulk(m, a, lda, w, c, ldc, pool, scratch);
}

}  // namespace ferry::model
