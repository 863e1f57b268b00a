// A row of `ferry bench transfer`'s report and what the network and file benchmarks share to
// make one: the region sizes, the row, its table line or JSON object.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/serve_metrics.h"
#include "bench/transfer_bench.h"

namespace ferry::bench {

using Seconds = std::chrono::duration<double>;

// The bytes of each side's region: the largest batch, or the working set.
uint64_t RegionBytes(const TransferBenchOptions& o);
// How many batches of `bytes` the working set holds (batch n uses slot n % slots).
uint64_t Slots(const TransferBenchOptions& o, uint64_t bytes);

struct Row {
    std::string backend, op;
    uint64_t block = 0, batch = 0;
    double gbps = 0, descs_per_s = 0, p50_us = 0, p99_us = 0, reference_gbps = 0;
    int inflight = 1;
    // Each round's figure (the medians above are over these).
    std::vector<double> rounds_gbps, rounds_reference_gbps;
    // The median over rounds of (ferry round / the reference measured right after it): steadier
    // than the ratio of medians on a machine whose speed drifts within a minute.
    double PairedRatio() const {
        std::vector<double> r;
        for (size_t i = 0; i < rounds_gbps.size() && i < rounds_reference_gbps.size(); ++i) {
            if (rounds_reference_gbps[i] > 0)
                r.push_back(rounds_gbps[i] / rounds_reference_gbps[i]);
        }
        return Median(r);
    }
    std::string error;
};

void PrintRow(const Row& r, bool json);

// `--backend file`: every row through the agent's file backend against a plain pread/pwrite
// loop on the same file. Returns the exit code.
int RunFileBench(const TransferBenchOptions& o);

}  // namespace ferry::bench
