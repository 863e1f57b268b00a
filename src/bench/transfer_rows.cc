#include "bench/transfer_rows.h"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>

namespace ferry::bench {

uint64_t RegionBytes(const TransferBenchOptions& o) {
    uint64_t max_block = *std::max_element(o.block_sizes.begin(), o.block_sizes.end());
    uint64_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
    return std::max(max_block * max_batch, o.working_set);
}

uint64_t Slots(const TransferBenchOptions& o, uint64_t bytes) {
    return std::max<uint64_t>(1, o.working_set / std::max<uint64_t>(1, bytes));
}

void PrintRow(const Row& r, bool json) {
    if (json) {
        if (!r.error.empty()) {
            fmt::print(
                "{{\"backend\":\"{}\",\"op\":\"{}\",\"block_size\":{},\"batch\":{},"
                "\"error\":\"{}\"}}\n",
                r.backend, r.op, r.block, r.batch, r.error);
            return;
        }
        fmt::print(
            "{{\"backend\":\"{}\",\"op\":\"{}\",\"block_size\":{},\"batch\":{},"
            "\"gbps\":{:.3f},\"descs_per_s\":{:.0f},\"p50_us\":{:.1f},\"p99_us\":{:.1f},"
            "\"reference_gbps\":{:.3f},\"inflight\":{},\"rounds_gbps\":[{:.3f}],"
            "\"rounds_reference_gbps\":[{:.3f}],\"paired_ratio\":{:.3f}}}\n",
            r.backend, r.op, r.block, r.batch, r.gbps, r.descs_per_s, r.p50_us, r.p99_us,
            r.reference_gbps, r.inflight, fmt::join(r.rounds_gbps, ","),
            fmt::join(r.rounds_reference_gbps, ","), r.PairedRatio());
        std::fflush(stdout);
        return;
    }
    if (!r.error.empty()) {
        fmt::print("{:<7} {:<6} {:>10} {:>6}  error: {}\n", r.backend, r.op, FormatSize(r.block),
                   r.batch, r.error);
        return;
    }
    fmt::print(
        "{:<7} {:<6} {:>10} {:>6} {:>9.2f} {:>12.0f} {:>10.1f} {:>10.1f} {:>9.2f} {:>6.2f} "
        "{:>6.2f}\n",
        r.backend, r.op, FormatSize(r.block), r.batch, r.gbps, r.descs_per_s, r.p50_us, r.p99_us,
        r.reference_gbps, r.reference_gbps > 0 ? r.gbps / r.reference_gbps : 0, r.PairedRatio());
    std::fflush(stdout);
}

}  // namespace ferry::bench
