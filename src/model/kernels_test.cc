// The matrix products on f32, f16 and bf16 weights against a double-precision reference, on
// every path (the row kernels, sgemm, widened tiles), with 1 to 3 threads.
#include "model/kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <utility>

#include "core/half.h"
#include "testing/testing.h"

namespace ferry::model {
namespace {

Weights RandomWeights(gguf::TensorType type, int rows, int cols, std::vector<double>* exact,
                      uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    Weights w;
    w.type = type;
    w.rows = rows;
    w.cols = cols;
    w.bytes.resize(size_t(rows) * cols * gguf::TensorTypeSize(type));
    exact->resize(size_t(rows) * cols);
    for (size_t i = 0; i < exact->size(); ++i) {
        float v = u(rng);
        if (type == gguf::TensorType::kF32) {
            std::memcpy(&w.bytes[4 * i], &v, 4);
            (*exact)[i] = v;
            continue;
        }
        uint16_t h = type == gguf::TensorType::kF16 ? FloatToF16(v) : FloatToBf16(v);
        std::memcpy(&w.bytes[2 * i], &h, 2);
        (*exact)[i] = type == gguf::TensorType::kF16 ? F16ToFloat(h) : Bf16ToFloat(h);
    }
    return w;
}

// The row kernels' instruction sets this CPU has (each test runs on every one), then the best
// again.
std::vector<KernelIsa> Isas() {
    std::vector<KernelIsa> out;
    for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
        if (static_cast<int>(isa) <= static_cast<int>(BestRowIsa())) out.push_back(isa);
    }
    return out;
}

struct IsaGuard {
    ~IsaGuard() { SetRowIsa(BestRowIsa()); }
};

TEST(Kernels, ProductsMatchAReferenceOnEveryPathAndType) {
    IsaGuard guard;
    for (KernelIsa isa : Isas()) {
        ASSERT_TRUE(SetRowIsa(isa));
        std::mt19937 rng(7);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        AlignedFloats scratch;
        // Under the sanitizers a subset that still takes every path (one and several threads,
        // row counts on both sides of the direct and tiled paths, odd and even widths): the
        // reference's triple loop dominated that build's time.
        const bool all = !testing::kSanitized;
        const auto threads_set = all ? std::vector<int>{1, 2, 3} : std::vector<int>{1, 3};
        const auto m_set =
            all ? std::vector<int>{1, 2, 3, 5, 32, 33, 70} : std::vector<int>{1, 3, 5, 33, 70};
        const auto n_set = all ? std::vector<int>{1, 6, 64, 131} : std::vector<int>{1, 6, 131};
        const auto k_set = all ? std::vector<int>{8, 13, 100, 256} : std::vector<int>{13, 100};
        for (int threads : threads_set) {
            WorkPool pool(threads);
            for (gguf::TensorType type :
                 {gguf::TensorType::kF32, gguf::TensorType::kF16, gguf::TensorType::kBF16}) {
                for (int m : m_set) {
                    for (int n : n_set) {
                        for (int k : k_set) {
                            std::vector<double> exact;
                            Weights w = RandomWeights(type, n, k, &exact, 1000 * m + 10 * n + k);
                            const int lda = k + 3, ldc = n + 5;
                            std::vector<float> a(size_t(m) * lda), c(size_t(m) * ldc, -7.0f);
                            for (float& x : a) x = u(rng);
                            MatMulT(m, a.data(), lda, w, c.data(), ldc, pool, &scratch);
                            // bf16 weights through dot products of bf16 pairs: A rounded
                            // to bf16 first (as llama.cpp does), then exact up to f32 sums.
                            const bool round_a = type == gguf::TensorType::kBF16 &&
                                                 m > kDirectRows && Bf16DotProducts();
                            for (int i = 0; i < m; ++i) {
                                for (int j = 0; j < n; ++j) {
                                    double want = 0, mag = 0;
                                    for (int x = 0; x < k; ++x) {
                                        const float ax = a[size_t(i) * lda + x];
                                        want +=
                                            double(round_a ? Bf16ToFloat(FloatToBf16(ax)) : ax) *
                                            exact[size_t(j) * k + x];
                                        mag += std::fabs(a[size_t(i) * lda + x] *
                                                         exact[size_t(j) * k + x]);
                                    }
                                    ASSERT_NEAR(c[size_t(i) * ldc + j], want, 1e-5 * mag + 1e-6)
                                        << gguf::TensorTypeName(type) << " m " << m << " n " << n
                                        << " k " << k << " threads " << threads << " at " << i
                                        << "," << j << " row kernels " << KernelIsaName(isa);
                                }
                                // Columns past n are not written.
                                for (int j = n; j < ldc; ++j)
                                    ASSERT_EQ(c[size_t(i) * ldc + j], -7.0f);
                            }
                        }
                    }
                }
            }
        }
    }
}

// bf16 prefill products through bf16 pairs over rows long enough that A goes in several panels
// (about 512 KiB each), with a k that leaves a masked tail: every row and column right, and the
// column past n untouched. Where the CPU lacks AVX-512 BF16 this runs the widened sgemm path.
TEST(Kernels, Bf16PairsOverPanelsOfA) {
    const int m = 70, n = 13, k = 8200, lda = k + 5, ldc = n + 1;
    std::vector<double> exact;
    Weights w = RandomWeights(gguf::TensorType::kBF16, n, k, &exact, 11);
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> a(size_t(m) * lda), c(size_t(m) * ldc, -7.0f);
    for (float& x : a) x = u(rng);
    WorkPool pool(2);
    AlignedFloats scratch;
    MatMulT(m, a.data(), lda, w, c.data(), ldc, pool, &scratch);
    const bool pairs = Bf16DotProducts();
    for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
            double want = 0, mag = 0;
            for (int x = 0; x < k; ++x) {
                const float ax = a[size_t(i) * lda + x];
                const double av = pairs ? Bf16ToFloat(FloatToBf16(ax)) : ax;
                want += av * exact[size_t(j) * k + x];
                mag += std::fabs(av * exact[size_t(j) * k + x]);
            }
            ASSERT_NEAR(c[size_t(i) * ldc + j], want, 1e-5 * mag) << i << "," << j;
        }
        ASSERT_EQ(c[size_t(i) * ldc + n], -7.0f) << i;
    }
}

// A sequence's result does not depend on the batch it is in (the row kernels sum each row in
// one order), in every weight type: the engine's batched-versus-single exactness rests on it.
TEST(Kernels, RowsGiveTheSameBitsAloneAndInABatch) {
    IsaGuard guard;
    for (KernelIsa isa : Isas()) {
        ASSERT_TRUE(SetRowIsa(isa));
        for (gguf::TensorType type :
             {gguf::TensorType::kF32, gguf::TensorType::kF16, gguf::TensorType::kBF16}) {
            std::vector<double> exact;
            Weights w = RandomWeights(type, 100, 264, &exact, 3);
            std::mt19937 rng(9);
            std::uniform_real_distribution<float> u(-1.0f, 1.0f);
            for (int m : {2, 5, kDirectRows, 70}) {
                std::vector<float> a(size_t(m) * 264), batch(size_t(m) * 100), one(100);
                AlignedFloats scratch;
                for (float& x : a) x = u(rng);
                WorkPool pool(2);
                MatMulRows(m, a.data(), 264, w, batch.data(), 100, pool);
                for (int i = 0; i < m; ++i) {
                    MatMulT(1, a.data() + size_t(i) * 264, 264, w, one.data(), 100, pool, &scratch);
                    for (int j = 0; j < 100; ++j) {
                        ASSERT_EQ(one[j], batch[size_t(i) * 100 + j])
                            << gguf::TensorTypeName(type) << " m " << m << " at " << i << "," << j
                            << " row kernels " << KernelIsaName(isa);
                    }
                }
            }
        }
    }
}

TEST(Kernels, RowIsaIsTheBestTheCpuHasAndRefusesMore) {
    IsaGuard guard;
    if (!std::getenv("FERRY_ROW_KERNELS")) {
        EXPECT_EQ(RowIsa(), BestRowIsa());
    }
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    EXPECT_EQ(BestRowIsa() == KernelIsa::kAvx512, avx512);
    if (BestRowIsa() != KernelIsa::kAvx512) {
        EXPECT_FALSE(SetRowIsa(KernelIsa::kAvx512));
        EXPECT_EQ(RowIsa(), BestRowIsa());
    }
    EXPECT_TRUE(SetRowIsa(KernelIsa::kScalar));
    EXPECT_EQ(RowIsa(), KernelIsa::kScalar);
}

// Weights of any size and the activations start on a cache line: a 64-byte load of a row
// never straddles two (the default operator new aligns to 16).
TEST(Kernels, WeightsAndActivationsStartOnACacheLine) {
    for (size_t bytes :
         {size_t(2), size_t(100), size_t(4096) + 2, size_t(1) << 20, (size_t(2) << 20) + 6}) {
        for (int i = 0; i < 8; ++i) {
            std::vector<uint8_t, HugePageAllocator<uint8_t>> w(bytes);
            EXPECT_EQ(reinterpret_cast<uintptr_t>(w.data()) % kCacheLineBytes, 0u) << bytes;
            AlignedFloats a(bytes / 2 + 1);
            EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % kCacheLineBytes, 0u) << bytes;
        }
    }
}

TEST(Kernels, WorkPoolRunsEveryPartOnce) {
    for (int threads : {1, 2, 4}) {
        WorkPool pool(threads);
        for (int round = 0; round < 200; ++round) {
            const int parts = 1 + round % 37;
            std::vector<std::atomic<int>> hits(parts);
            pool.Run(parts, [&](int p) { hits[p].fetch_add(1); });
            for (int p = 0; p < parts; ++p) ASSERT_EQ(hits[p].load(), 1) << p;
        }
    }
}

// Ranges cover [0, n) once; none is under the grain but the last piece of a Run (the guided
// rule takes max(grain, a share of what is left)); more than the packed word holds goes in
// pieces.
TEST(Kernels, WorkPoolRangesCoverEveryIndexOnce) {
    for (int threads : {1, 2, 4}) {
        WorkPool pool(threads);
        for (int round = 0; round < 300; ++round) {
            const int n = 1 + (round * 37) % 2000, grain = 1 + round % 17;
            std::mutex mu;
            std::vector<std::pair<int, int>> got;
            pool.RunRanges(n, grain, [&](int b, int e) {
                std::lock_guard lock(mu);
                got.emplace_back(b, e);
            });
            std::sort(got.begin(), got.end());
            int at = 0, small = 0;
            for (auto [b, e] : got) {
                ASSERT_EQ(b, at) << "threads " << threads << " n " << n;
                ASSERT_LT(b, e);
                small += e - b < grain;
                at = e;
            }
            ASSERT_EQ(at, n);
            ASSERT_LE(small, 1) << "threads " << threads << " n " << n << " grain " << grain;
        }
    }
    WorkPool pool(2);
    const int n = (1 << 23) + 5;
    std::mutex mu;
    std::vector<std::pair<int, int>> got;
    pool.RunRanges(n, 1 << 18, [&](int b, int e) {
        std::lock_guard lock(mu);
        got.emplace_back(b, e);
    });
    std::sort(got.begin(), got.end());
    int at = 0;
    for (auto [b, e] : got) {
        ASSERT_EQ(b, at);
        at = e;
    }
    ASSERT_EQ(at, n);
}

}  // namespace
}  // namespace ferry::model
