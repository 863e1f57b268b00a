// Elapsed time as the metrics count it.
#pragma once

#include <chrono>
#include <cstdint>

namespace ferry {

// Microseconds on the steady clock since `t0`.
inline uint64_t MicrosSince(std::chrono::steady_clock::time_point t0) {
    return uint64_t(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
            .count());
}

}  // namespace ferry
