#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <thread>
#include <tuple>

#include "bench/serve_metrics.h"
#include "bench/transfer_rows.h"
#include "core/child_process.h"
#include "core/fd.h"
#include "core/log.h"
#include "ferry/agent.h"
#include "transfer/backend.h"
#include "transfer/backends/file/file_engine.h"
#include "transfer/region_table.h"

namespace ferry::bench {

namespace {

// Where each batch of a row reads or writes: `batch` block offsets, sequential through the file
// (wrapping) or uniformly random block-aligned.
class OffsetPlan {
  public:
    OffsetPlan(uint64_t file_size, uint64_t block, bool random, uint64_t seed)
        : blocks_(file_size / block), block_(block), random_(random), rng_(seed) {}
    // The next offset; `*wrapped` is set when a sequential pass over the file starts again.
    uint64_t Next(bool* wrapped) {
        if (random_) return (rng_() % blocks_) * block_;
        if (next_ == blocks_) {
            next_ = 0;
            *wrapped = true;
        }
        return next_++ * block_;
    }

  private:
    uint64_t blocks_, block_;
    bool random_;
    std::mt19937_64 rng_;
    uint64_t next_ = 0;
};

void DropFileCache(int fd) {
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
}

// Creates or extends the bench file and fills it with non-zero bytes (sparse holes would read
// without touching the disk).
Status PrepareBenchFile(const std::string& path, uint64_t size) {
    ScopedFd fd(open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (!fd.valid()) {
        return InvalidArgumentError("--file " + path + ": " + std::strerror(errno));
    }
    struct stat st {};
    fstat(fd.get(), &st);
    if (static_cast<uint64_t>(st.st_size) >= size &&
        st.st_blocks * 512 >= static_cast<int64_t>(size)) {
        return Status::Ok();
    }
    std::vector<uint8_t> chunk(8u << 20);
    for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<uint8_t>(i * 131 + 7);
    for (uint64_t off = 0; off < size; off += chunk.size()) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), size - off));
        if (pwrite(fd.get(), chunk.data(), n, static_cast<off_t>(off)) != static_cast<ssize_t>(n)) {
            return InternalError("--file " + path + ": filling it: " + std::strerror(errno));
        }
    }
    fsync(fd.get());
    return Status::Ok();
}

// The reference: the same offsets with plain pread/pwrite, one at a time, on this thread, with
// the same O_DIRECT choice and cache drops.
double FileReference(const std::string& path, bool direct, bool write, uint64_t block,
                     uint64_t file_size, bool random, double duration, double* iops) {
    ScopedFd fd(open(path.c_str(), O_RDWR | O_CLOEXEC | (direct ? O_DIRECT : 0)));
    if (!fd.valid()) return 0;
    auto buf = internal::AlignedBuffer::Allocate(block);
    std::memset(buf->data(), 0x5a, block);
    OffsetPlan plan(file_size, block, random, 99);
    if (!direct) DropFileCache(fd.get());
    uint64_t ios = 0;
    auto t0 = Clock::now();
    auto end = t0 + Seconds(duration);
    while (Clock::now() < end) {
        for (int k = 0; k < 16; ++k) {
            bool wrapped = false;
            uint64_t off = plan.Next(&wrapped);
            if (wrapped && !direct) DropFileCache(fd.get());
            ssize_t n = write ? pwrite(fd.get(), buf->data(), block, static_cast<off_t>(off))
                              : pread(fd.get(), buf->data(), block, static_cast<off_t>(off));
            if (n != static_cast<ssize_t>(block)) return 0;
            ++ios;
        }
    }
    if (write) fdatasync(fd.get());  // what the writes cost includes getting them to the file
    double secs = Seconds(Clock::now() - t0).count();
    *iops = ios / secs;
    return ios * block / secs / 1e9;
}

}  // namespace

int RunFileBench(const TransferBenchOptions& o) {
    const std::string path = o.file_path.empty() ? "ferry-bench-file.bin" : o.file_path;
    uint64_t max_block = *std::max_element(o.block_sizes.begin(), o.block_sizes.end());
    if (o.file_size < max_block) {
        fmt::print(stderr, "ferry bench: --file-size {} is smaller than a block\n", o.file_size);
        return 1;
    }
    Status prep = PrepareBenchFile(path, o.file_size);
    if (!prep.ok()) {
        fmt::print(stderr, "ferry bench: {}\n", prep.ToString());
        return 1;
    }
    AgentConfig c;
    c.name = "bench-file";
    c.default_timeout = std::chrono::seconds(120);
    c.file_io = o.file_io;
    c.file_queue_depth = o.queue_depth;
    auto agent = Agent::Create(c);
    if (!agent.ok()) {
        fmt::print(stderr, "ferry bench: {}\n", agent.status().ToString());
        return 1;
    }
    auto file = (*agent)->RegisterFile(path, 0, o.file_size, {.direct = o.direct});
    if (!file.ok()) {
        fmt::print(stderr, "ferry bench: {}\n", file.status().ToString());
        return 1;
    }
    auto mem = (*agent)->AllocateRegion(RegionBytes(o) * std::max(1, o.inflight));
    if (!mem.ok()) {
        fmt::print(stderr, "ferry bench: {}\n", mem.status().ToString());
        return 1;
    }
    ScopedFd drop_fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
    const bool random = o.pattern == "random";
    if (!o.json) {
        fmt::print(
            "# file {} ({}), {}, {} offsets, io via {}; reference: pread/pwrite of the same "
            "offsets, one at a time; medians of {} alternating rounds\n",
            path, FormatSize(o.file_size),
            o.direct ? "O_DIRECT" : "buffered, page cache dropped before each pass", o.pattern,
            o.file_io, o.repeat);
        fmt::print("{:<7} {:<6} {:>10} {:>6} {:>9} {:>12} {:>10} {:>10} {:>9} {:>6} {:>6} {:>10}\n",
                   "backend", "op", "block", "batch", "GB/s", "IOPS", "p50 us", "p99 us",
                   "ref GB/s", "ratio", "paired", "ref IOPS");
    }
    int rc = 0;
    for (const std::string& op : o.ops) {
        for (uint64_t block : o.block_sizes) {
            for (uint64_t batch : o.batches) {
                Row row;
                row.backend = "file";
                row.op = op;
                row.block = block;
                row.batch = batch;
                row.inflight = std::max(1, o.inflight);
                const bool write = op == "write";
                OffsetPlan plan(o.file_size, block, random, 99);
                std::vector<double> lat_us;
                uint64_t batches_done = 0;
                auto post = [&](int slot) -> Result<Transfer> {
                    std::vector<Descriptor> local, remote;
                    for (uint64_t i = 0; i < batch; ++i) {
                        bool wrapped = false;
                        uint64_t off = plan.Next(&wrapped);
                        if (wrapped && !o.direct) DropFileCache(drop_fd.get());
                        local.push_back({mem->id, (slot * batch + i) * block, block});
                        remote.push_back({file->id, off, block});
                    }
                    return write ? (*agent)->PostWrite(local, c.name, remote)
                                 : (*agent)->PostRead(local, c.name, remote);
                };
                auto run = [&](double seconds, bool record) -> Status {
                    auto end = Clock::now() + Seconds(seconds);
                    std::deque<std::tuple<Transfer, Clock::time_point, int>> window;
                    int next_slot = 0;
                    while (true) {
                        while (Clock::now() < end &&
                               window.size() < static_cast<size_t>(row.inflight)) {
                            int slot = next_slot++ % row.inflight;
                            auto t = post(slot);
                            if (!t.ok()) return t.status();
                            window.emplace_back(std::move(*t), Clock::now(), slot);
                        }
                        if (window.empty()) return Status::Ok();
                        Status s = std::get<0>(window.front()).Wait(std::chrono::seconds(120));
                        if (!s.ok()) return s;
                        if (record) {
                            lat_us.push_back(std::chrono::duration<double, std::micro>(
                                                 Clock::now() - std::get<1>(window.front()))
                                                 .count());
                            ++batches_done;
                        }
                        window.pop_front();
                    }
                };
                // Rounds alternate ferry and the reference, so that both see the same disk
                // (this one's speed drifts); each figure is the median of its rounds.
                if (!o.direct) DropFileCache(drop_fd.get());
                Status s = run(o.warmup, false);
                std::vector<double> gbps, iops, ref_gbps, ref_iops_v;
                for (int round = 0; round < o.repeat && s.ok(); ++round) {
                    if (!o.direct) DropFileCache(drop_fd.get());
                    uint64_t before = batches_done;
                    auto t0 = Clock::now();
                    s = run(o.duration, true);
                    if (s.ok() && write) fdatasync(drop_fd.get());
                    double secs = Seconds(Clock::now() - t0).count();
                    double n = static_cast<double>(batches_done - before) * batch;
                    gbps.push_back(n * block / secs / 1e9);
                    iops.push_back(n / secs);
                    if (s.ok() && !o.no_reference) {
                        double ri = 0;
                        ref_gbps.push_back(FileReference(path, o.direct, write, block, o.file_size,
                                                         random, o.duration, &ri));
                        ref_iops_v.push_back(ri);
                    }
                }
                double ref_iops = 0;
                if (!s.ok()) {
                    row.error = s.ToString();
                    rc = 1;
                } else {
                    row.gbps = Median(gbps);
                    row.descs_per_s = Median(iops);
                    row.p50_us = Percentile(lat_us, 50);
                    row.p99_us = Percentile(lat_us, 99);
                    row.reference_gbps = Median(ref_gbps);
                    ref_iops = Median(ref_iops_v);
                    row.rounds_gbps = gbps;
                    row.rounds_reference_gbps = ref_gbps;
                }
                if (o.json || !row.error.empty()) {
                    PrintRow(row, o.json);
                    continue;
                }
                fmt::print(
                    "{:<7} {:<6} {:>10} {:>6} {:>9.3f} {:>12.0f} {:>10.1f} {:>10.1f} {:>9.3f} "
                    "{:>6.2f} {:>6.2f} {:>10.0f}\n",
                    row.backend, row.op, FormatSize(row.block), row.batch, row.gbps,
                    row.descs_per_s, row.p50_us, row.p99_us, row.reference_gbps,
                    row.reference_gbps > 0 ? row.gbps / row.reference_gbps : 0, row.PairedRatio(),
                    ref_iops);
                std::fflush(stdout);
            }
        }
    }
    return rc;
}

}  // namespace ferry::bench
