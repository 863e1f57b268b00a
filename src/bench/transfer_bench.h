// `ferry bench transfer`: moves batches of blocks between an initiator and a target process
// through the Agent API and prints throughput, descriptor rate and per-batch latency next to a
// reference measured in the same run (memcpy for shm, a plain TCP stream for tcp, ucx_perftest
// for ucx, a plain pread/pwrite loop on the same file for file).
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
    // ucx: measure the ucx_perftest reference without peer error handling (the backend always
    // uses it; by default the reference does too).
    bool ucx_reference_no_eh = false;
    bool ucx_rma = false;  // AgentConfig.ucx_rma on both agents
    // --backend file: transfers between memory and a file region of the same agent.
    std::string file_path;             // "" = ferry-bench-file.bin in the working directory
    uint64_t file_size = 1ull << 30;   // created and filled when shorter
    bool direct = false;               // O_DIRECT (else buffered, page cache dropped per pass)
    std::string pattern = "seq";       // seq, random
    std::string file_io = "io_uring";  // AgentConfig.file_io
    unsigned queue_depth = 64;         // AgentConfig.file_queue_depth
    int repeat = 3;                    // alternating ferry / reference rounds per row
    // Memory the transfers of a row walk through, batch after batch, on both sides (0: one
    // batch, the same bytes every time). Larger than the last-level cache, each batch and each
    // reference copy moves bytes from memory rather than from the cache, as a KV load does.
    uint64_t working_set = 0;
};

// Returns a process exit code.
int RunTransferBench(const TransferBenchOptions& options);

// "4K", "64KiB", "4M", "1G", "4096" -> bytes; false on a malformed size.
bool ParseSize(const std::string& text, uint64_t* bytes);
std::string FormatSize(uint64_t bytes);

}  // namespace ferry::bench
