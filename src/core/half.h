// IEEE half (f16) and bfloat16 conversions, round to nearest even, NaN and infinity kept. Used by
// the GGUF loader (F16/BF16 weights) and the KV cache (f16/bf16 storage).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ferry {

inline uint32_t FloatBits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float BitsFloat(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBf16(float f) {
    uint32_t u = FloatBits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float F16ToFloat(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (mant << 13));  // inf / NaN
    if (exp == 0) {
        if (mant == 0) return BitsFloat(sign);
        // Subnormal: value = mant * 2^-24.
        float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

inline uint16_t FloatToF16(float f) {
    uint32_t u = FloatBits(f);
    uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
    if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to or beyond infinity
    if (abs < 0x38800000u) {                        // below the smallest normal: subnormal or 0
        if (abs < 0x33000000u) return sign;         // rounds to zero
        uint32_t exp = abs >> 23;
        uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - exp;  // 14 .. 24
        uint32_t half = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u))) ++half;
        return sign | static_cast<uint16_t>(half);
    }
    uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);
    return sign | static_cast<uint16_t>(r >> 13);
}

// n values widened to f32, eight at a time with F16C / AVX2 where the CPU has them (the same
// values as the scalar conversions above: widening is exact).
void F16ToFloat(const uint16_t* h, size_t n, float* out);
void Bf16ToFloat(const uint16_t* h, size_t n, float* out);

// Whether the CPU has AVX2, FMA and F16C (the vectorized kernels' target), from CPUID.
bool CpuHasAvx2F16c();

}  // namespace ferry
