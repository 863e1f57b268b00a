// `ferry bench transfer`: moves batches of blocks between an initiator and a target process
// through the Agent API and prints throughput, descriptor rate and per-batch latency next to a
// reference measured in the same run (memcpy for shm, a plain TCP stream for tcp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ferry::bench {

struct TransferBenchOptions {
    std::string role = "both";  // both (spawns the target), initiator, target
    std::string peer;           // initiator: the target's host:port
    std::string listen = "127.0.0.1:0";
    std::vector<std::string> backends = {"shm", "tcp"};
    std::vector<std::string> ops = {"write", "read"};
    std::vector<uint64_t> block_sizes = {4u << 20};
    std::vector<uint64_t> batches = {1};
    int streams = 0;        // 0 = the backend's default
    int inflight = 1;       // batches in flight at once
    int io_threads = 0;     // 0 = the agent's default
    double duration = 2.0;  // seconds per row
    double warmup = 0.3;
    bool json = false;
    bool no_reference = false;
    std::string secret;
};

// Returns a process exit code.
int RunTransferBench(const TransferBenchOptions& options);

// "4K", "64KiB", "4M", "1G", "4096" -> bytes; false on a malformed size.
bool ParseSize(const std::string& text, uint64_t* bytes);
std::string FormatSize(uint64_t bytes);

}  // namespace ferry::bench
