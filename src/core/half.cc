#include "core/half.h"

#include <cpuid.h>
#include <immintrin.h>

namespace ferry {

namespace {

#define FERRY_AVX2 __attribute__((target("avx2,fma,f16c")))

FERRY_AVX2 void F16ToFloatAvx2(const uint16_t* h, size_t n, float* out) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(out + i,
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    }
    for (; i < n; ++i) out[i] = F16ToFloat(h[i]);
}

FERRY_AVX2 void Bf16ToFloatAvx2(const uint16_t* h, size_t n, float* out) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i));
        _mm256_storeu_ps(out + i,
                         _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
    }
    for (; i < n; ++i) out[i] = Bf16ToFloat(h[i]);
}

bool DetectAvx2F16c() {
    __builtin_cpu_init();
    // F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports does not know it.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

bool CpuHasAvx2F16c() {
    static const bool v = DetectAvx2F16c();
    return v;
}

void F16ToFloat(const uint16_t* h, size_t n, float* out) {
    if (CpuHasAvx2F16c()) return F16ToFloatAvx2(h, n, out);
    for (size_t i = 0; i < n; ++i) out[i] = F16ToFloat(h[i]);
}

void Bf16ToFloat(const uint16_t* h, size_t n, float* out) {
    if (CpuHasAvx2F16c()) return Bf16ToFloatAvx2(h, n, out);
    for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(h[i]);
}

}  // namespace ferry
