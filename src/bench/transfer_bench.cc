#include "bench/transfer_bench.h"

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
#include "core/child_process.h"
#include "core/fd.h"
#include "core/log.h"
#include "ferry/agent.h"
#include "transfer/backend.h"
#include "transfer/backends/file/file_engine.h"
#include "transfer/region_table.h"

namespace ferry::bench {

namespace {

using Seconds = std::chrono::duration<double>;

uint64_t RegionBytes(const TransferBenchOptions& o) {
    uint64_t max_block = *std::max_element(o.block_sizes.begin(), o.block_sizes.end());
    uint64_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
    return std::max(max_block * max_batch, o.working_set);
}

// How many batches of `bytes` the working set holds (batch n uses slot n % slots).
uint64_t Slots(const TransferBenchOptions& o, uint64_t bytes) {
    return std::max<uint64_t>(1, o.working_set / std::max<uint64_t>(1, bytes));
}

// --- references -------------------------------------------------------------------------------

// memcpy between two pre-faulted buffers, the same bytes per iteration as one batch.
// The buffers are fresh pre-populated mappings, like agent regions: heap memory reused after an
// earlier free copies 2-3x slower here, which would make every later row's reference unfair.
double MemcpyReferenceGbps(uint64_t block, uint64_t batch, double duration, uint64_t slots) {
    uint64_t bytes = block * batch;
    const uint64_t span = bytes * slots;
    struct Buffer {
        explicit Buffer(size_t n) : size(n) {
            void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
            data = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
        }
        ~Buffer() {
            if (data != nullptr) munmap(data, size);
        }
        uint8_t* data;
        size_t size;
    };
    Buffer src(span), dst(span);
    if (src.data == nullptr || dst.data == nullptr) return 0;
    std::memset(src.data, 1, span);
    std::memset(dst.data, 0, span);
    uint64_t moved = 0;
    uint64_t n = 0;
    auto t0 = std::chrono::steady_clock::now();
    auto end = t0 + Seconds(duration);
    do {
        const uint64_t base = (n++ % slots) * bytes;
        for (uint64_t i = 0; i < batch; ++i) {
            std::memcpy(dst.data + base + i * block, src.data + base + i * block, block);
        }
        moved += bytes;
    } while (std::chrono::steady_clock::now() < end);
    double s = Seconds(std::chrono::steady_clock::now() - t0).count();
    return moved / s / 1e9;
}

// A plain TCP stream to the target's raw sink: one connection, send() of `block` bytes.
double TcpReferenceGbps(const std::string& address, uint64_t block, double duration) {
    std::string host;
    uint16_t port = 0;
    if (!SplitHostPort(address, &host, &port).ok()) return 0;
    ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    inet_pton(AF_INET, host.c_str(), &sa.sin_addr);
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) return 0;
    int one = 1;
    setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::vector<uint8_t> buf(block, 7);
    PrefaultMemory(buf.data(), buf.size());
    uint64_t moved = 0;
    auto t0 = std::chrono::steady_clock::now();
    auto end = t0 + Seconds(duration);
    while (std::chrono::steady_clock::now() < end) {
        size_t off = 0;
        while (off < block) {
            ssize_t n = send(fd.get(), buf.data() + off, block - off, MSG_NOSIGNAL);
            if (n <= 0) return 0;
            off += static_cast<size_t>(n);
        }
        moved += block;
    }
    shutdown(fd.get(), SHUT_WR);
    char c;
    while (recv(fd.get(), &c, 1, 0) > 0) {
    }  // the sink closes once it has read everything: count only delivered bytes
    double s = Seconds(std::chrono::steady_clock::now() - t0).count();
    return moved / s / 1e9;
}

// UCX's own benchmark on the same transports (UCX_TLS as set for this process): `ucx_perftest
// -t tag_bw` with the block size, over loopback, as ../shared/tools/ucx-reference runs it, with
// endpoints created as the ucx backend creates them: with peer error handling (`-e`), which
// UCX 1.13 pays for over tcp by giving up zero-copy rendezvous (about half the bandwidth here).
// `error_handling` = false measures without it. 0 when ucx_perftest is not installed.
double UcxPerftestReferenceGbps(uint64_t block, double duration, bool error_handling) {
    uint64_t iters = std::clamp<uint64_t>(static_cast<uint64_t>(3e9 * duration / block), 20, 4000);
    // A free port for its server.
    int port = 0;
    {
        ScopedFd s(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof a;
        if (bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
            getsockname(s.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
            return 0;
        }
        port = ntohs(a.sin_port);
    }
    // Both ends through the one launcher, over loopback unless UCX_NET_DEVICES says otherwise.
    // The server says it listens ("Waiting for connection...") only with a line-buffered
    // stdout, which coreutils' stdbuf gives it; the client's last line holds the figures.
    auto perftest = FindProgram("ucx_perftest");
    auto stdbuf = FindProgram("stdbuf");
    if (!perftest.ok() || !stdbuf.ok()) return 0;
    ChildOptions options;
    if (std::getenv("UCX_NET_DEVICES") == nullptr) options.env.push_back("UCX_NET_DEVICES=lo");
    options.stderr_path = "/dev/null";
    std::vector<std::string> server = {*stdbuf, "-oL", *perftest, "-p", std::to_string(port)};
    std::vector<std::string> client = {*perftest, "127.0.0.1", "-p", std::to_string(port)};
    if (error_handling) {
        server.push_back("-e");
        client.push_back("-e");
    }
    client.insert(client.end(), {"-t", "tag_bw", "-w", "20", "-f", "-s", std::to_string(block),
                                 "-n", std::to_string(iters)});
    std::string ready;
    auto server_process = ChildProcess::Start(server, "Waiting for connection", &ready,
                                              std::chrono::seconds(10), options);
    if (!server_process.ok()) return 0;
    std::string first;
    auto client_process =
        ChildProcess::Start(client, "", &first, std::chrono::seconds(30), options);
    if (!client_process.ok()) return 0;
    // Every line until the client exits (a prefix no line has), within UCX's own 120 s.
    std::vector<std::string> lines = {first};
    (void)client_process->ReadLine("\x01", std::chrono::seconds(120), &lines);
    const std::string last = lines.back();
    // Columns: iterations, latency p50/avg/overall, bandwidth avg/overall (MiB/s), rate
    // avg/overall.
    std::vector<double> cols;
    const char* p = last.c_str();
    char* end = nullptr;
    for (double v = strtod(p, &end); end != p; v = strtod(p, &end)) {
        cols.push_back(v);
        p = end;
    }
    if (cols.size() < 8) return 0;
    return cols[cols.size() - 3] * 1048576.0 / 1e9;
}

// Target side of the TCP reference: reads and drops everything, then closes. Its thread is
// joined before the sink goes (a detached one read the listening socket's member after it was
// destroyed: TSan, 2026-12-07).
class RawSink {
  public:
    ~RawSink() {
        if (!thread_.joinable()) return;
        stopping_ = true;
        shutdown(fd_.get(), SHUT_RDWR);  // accept4 returns
        const int c = conn_.load();
        if (c >= 0) shutdown(c, SHUT_RDWR);  // recv returns
        thread_.join();
    }
    bool Start(const std::string& host) {
        fd_.Reset(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_in sa{};
        sa.sin_family = AF_INET;
        sa.sin_port = 0;
        inet_pton(AF_INET, host.c_str(), &sa.sin_addr);
        if (bind(fd_.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
            listen(fd_.get(), 16) != 0) {
            return false;
        }
        socklen_t len = sizeof(sa);
        getsockname(fd_.get(), reinterpret_cast<sockaddr*>(&sa), &len);
        address_ = host + ":" + std::to_string(ntohs(sa.sin_port));
        thread_ = std::thread([this, listening = fd_.get()] {
            std::vector<uint8_t> buf(4u << 20);
            PrefaultMemory(buf.data(), buf.size());
            while (!stopping_) {
                const int c = accept4(listening, nullptr, nullptr, SOCK_CLOEXEC);
                if (c < 0) return;
                conn_ = c;
                if (stopping_) shutdown(c, SHUT_RDWR);
                while (recv(c, buf.data(), buf.size(), 0) > 0) {
                }
                conn_ = -1;
                close(c);
            }
        });
        return true;
    }
    const std::string& address() const { return address_; }

  private:
    ScopedFd fd_;
    std::string address_;
    std::atomic<bool> stopping_{false};
    std::atomic<int> conn_{-1};
    std::thread thread_;
};

// --- child process ----------------------------------------------------------------------------

bool SpawnTarget(const TransferBenchOptions& o, const std::string& backend, ChildProcess* child,
                 std::string* agent_address, std::string* raw_address) {
    std::vector<std::string> args = {"/proc/self/exe", "bench", "transfer", "--role", "target",
                                     "--backend",      backend, "--listen", o.listen};
    std::string blocks, batches;
    for (uint64_t b : o.block_sizes) blocks += (blocks.empty() ? "" : ",") + std::to_string(b);
    for (uint64_t b : o.batches) batches += (batches.empty() ? "" : ",") + std::to_string(b);
    args.insert(args.end(), {"--block-size", blocks, "--batch", batches});
    if (o.streams > 0) args.insert(args.end(), {"--streams", std::to_string(o.streams)});
    if (o.io_threads > 0) {
        args.insert(args.end(), {"--io-threads", std::to_string(o.io_threads)});
    }
    if (!o.secret.empty()) args.insert(args.end(), {"--secret", o.secret});
    if (o.working_set > 0) {
        args.insert(args.end(), {"--working-set", std::to_string(o.working_set)});
    }
    // The target exits when its stdin closes (the ChildProcess going).
    std::string line;
    auto c = ChildProcess::Start(args, "FERRY-BENCH-TARGET ", &line, std::chrono::seconds(60));
    if (!c.ok()) return false;
    *child = std::move(c).value();
    char agent[512], raw[512];
    if (sscanf(line.c_str(), "agent=%511s raw=%511s", agent, raw) != 2) return false;
    *agent_address = agent;
    *raw_address = raw;
    return true;
}

AgentConfig BenchConfig(const std::string& name, const std::string& backend,
                        const TransferBenchOptions& o) {
    AgentConfig c;
    c.name = name;
    c.backends = {backend};
    c.secret = o.secret;
    c.tcp_streams = o.streams;
    c.shm_streams = o.streams;
    c.io_threads = o.io_threads;
    c.ucx_rma = o.ucx_rma;
    c.default_timeout = std::chrono::seconds(60);
    std::string host;
    uint16_t port = 0;
    if (SplitHostPort(o.listen, &host, &port).ok()) {
        c.listen_host = host;
        c.listen_port = port;
    }
    return c;
}

int RunTarget(const TransferBenchOptions& o) {
    std::string backend = o.backends.at(0);
    auto agent = Agent::Create(BenchConfig("bench-target", backend, o));
    if (!agent.ok()) {
        fmt::print(stderr, "ferry bench: target: {}\n", agent.status().ToString());
        return 1;
    }
    auto region = (*agent)->AllocateRegion(RegionBytes(o));
    if (!region.ok()) {
        fmt::print(stderr, "ferry bench: target: {}\n", region.status().ToString());
        return 1;
    }
    RawSink sink;
    std::string host;
    uint16_t port = 0;
    (void)SplitHostPort((*agent)->ListenAddress(), &host, &port);
    if (!sink.Start(host)) {
        fmt::print(stderr, "ferry bench: target: raw tcp sink: {}\n", std::strerror(errno));
        return 1;
    }
    fmt::print("FERRY-BENCH-TARGET agent={} raw={} region={}\n", (*agent)->ListenAddress(),
               sink.address(), region->id);
    std::fflush(stdout);
    // Serve until stdin closes (spawned by an initiator) or a signal ends the process.
    char buf[256];
    while (read(0, buf, sizeof(buf)) > 0) {
    }
    return 0;
}

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

// One round of a network row; its per-batch latencies are appended to `lat_us`.
Row RunRow(Agent& agent, const std::string& peer, RegionId local, RegionId remote,
           const std::string& backend, const std::string& op, uint64_t block, uint64_t batch,
           const TransferBenchOptions& o, std::vector<double>& lat_us) {
    Row row;
    row.backend = backend;
    row.op = op;
    row.block = block;
    row.batch = batch;
    row.inflight = std::max(1, o.inflight);
    std::vector<Descriptor> ldesc, rdesc;
    const uint64_t slots = Slots(o, block * batch);
    uint64_t posted = 0;
    bool read = op == "read";
    auto post = [&]() {
        const uint64_t base = (posted++ % slots) * block * batch;
        ldesc.clear();
        rdesc.clear();
        for (uint64_t i = 0; i < batch; ++i) {
            ldesc.push_back({local, base + i * block, block});
            rdesc.push_back({remote, base + i * block, block});
        }
        return read ? agent.PostRead(ldesc, peer, rdesc) : agent.PostWrite(ldesc, peer, rdesc);
    };
    uint64_t batches_done = 0;
    auto run = [&](double seconds, bool record) -> Status {
        auto end = Clock::now() + Seconds(seconds);
        std::vector<std::pair<Transfer, Clock::time_point>> window;
        while (true) {
            bool more = Clock::now() < end;
            while (more && window.size() < static_cast<size_t>(std::max(1, o.inflight))) {
                auto t = post();
                if (!t.ok()) return t.status();
                window.emplace_back(std::move(*t), Clock::now());
            }
            if (window.empty()) return Status::Ok();
            Status s = window.front().first.Wait(std::chrono::seconds(60));
            if (!s.ok()) return s;
            if (record) {
                lat_us.push_back(
                    std::chrono::duration<double, std::micro>(Clock::now() - window.front().second)
                        .count());
                ++batches_done;
            }
            window.erase(window.begin());
        }
    };
    Status s = run(o.warmup, false);
    auto t0 = Clock::now();
    if (s.ok()) s = run(o.duration, true);
    double secs = Seconds(Clock::now() - t0).count();
    if (!s.ok()) {
        row.error = s.ToString();
        return row;
    }
    double bytes = static_cast<double>(batches_done) * block * batch;
    row.gbps = bytes / secs / 1e9;
    row.descs_per_s = batches_done * batch / secs;
    return row;
}

// The reference for a network row, measured right after a round of it.
double NetworkReferenceGbps(const std::string& backend, const std::string& raw_addr, uint64_t block,
                            uint64_t batch, const TransferBenchOptions& o) {
    if (backend == "shm") {
        return MemcpyReferenceGbps(block, batch, o.duration / 2, Slots(o, block * batch));
    }
    if (backend == "ucx") {
        return UcxPerftestReferenceGbps(block, o.duration / 2, !o.ucx_reference_no_eh);
    }
    return raw_addr.empty() ? 0 : TcpReferenceGbps(raw_addr, block, o.duration / 2);
}

// A network row: `o.repeat` rounds, each followed by its reference (so that both see the same
// machine: this one's speed drifts by 2x within a minute); figures are medians of the rounds,
// latency percentiles are over every batch of every round.
Row RunNetworkRow(Agent& agent, const std::string& peer, RegionId local, RegionId remote,
                  const std::string& backend, const std::string& raw_addr, const std::string& op,
                  uint64_t block, uint64_t batch, const TransferBenchOptions& o) {
    std::vector<double> lat_us, gbps, descs, reference;
    Row row;
    for (int round = 0; round < std::max(1, o.repeat); ++round) {
        row = RunRow(agent, peer, local, remote, backend, op, block, batch, o, lat_us);
        if (!row.error.empty()) return row;
        gbps.push_back(row.gbps);
        descs.push_back(row.descs_per_s);
        if (!o.no_reference) {
            reference.push_back(NetworkReferenceGbps(backend, raw_addr, block, batch, o));
        }
    }
    row.gbps = Median(gbps);
    row.descs_per_s = Median(descs);
    row.reference_gbps = Median(reference);
    row.rounds_gbps = std::move(gbps);
    row.rounds_reference_gbps = std::move(reference);
    row.p50_us = Percentile(lat_us, 50);
    row.p99_us = Percentile(lat_us, 99);
    return row;
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

// --- file backend ---------------------------------------------------------------------------

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

int RunInitiator(const TransferBenchOptions& o) {
    bool network = std::any_of(o.backends.begin(), o.backends.end(),
                               [](const std::string& b) { return b != "file"; });
    if (!o.json && network) {
        fmt::print(
            "# medians of {} rounds, each followed by its reference; ratio: of the medians; "
            "paired: median of each round's ratio\n",
            std::max(1, o.repeat));
        fmt::print("{:<7} {:<6} {:>10} {:>6} {:>9} {:>12} {:>10} {:>10} {:>9} {:>6} {:>6}\n",
                   "backend", "op", "block", "batch", "GB/s", "descs/s", "p50 us", "p99 us",
                   "ref GB/s", "ratio", "paired");
    }
    int rc = 0;
    for (const std::string& backend : o.backends) {
        if (backend == "file") {
            rc |= RunFileBench(o);
            continue;
        }
        ChildProcess child;
        std::string agent_addr = o.peer, raw_addr;
        RegionId remote = 1;  // the target's only region
        if (o.role == "both") {
            if (!SpawnTarget(o, backend, &child, &agent_addr, &raw_addr)) {
                fmt::print(stderr, "ferry bench: could not start the target process\n");
                return 1;
            }
        }
        auto agent = Agent::Create(BenchConfig("bench-initiator", backend, o));
        if (!agent.ok()) {
            fmt::print(stderr, "ferry bench: {}\n", agent.status().ToString());
            return 1;
        }
        auto peer = (*agent)->Connect(agent_addr, std::chrono::seconds(10));
        if (!peer.ok()) {
            fmt::print(stderr, "ferry bench: {}\n", peer.status().ToString());
            return 1;
        }
        auto chosen = (*agent)->PeerBackend(*peer);
        if (!chosen.ok() || *chosen != backend) {
            fmt::print(stderr, "ferry bench: backend {} cannot reach {} (chosen: {})\n", backend,
                       agent_addr, chosen.ok() ? *chosen : chosen.status().ToString());
            rc = 1;
            continue;
        }
        auto local = (*agent)->AllocateRegion(RegionBytes(o));
        if (!local.ok()) {
            fmt::print(stderr, "ferry bench: {}\n", local.status().ToString());
            return 1;
        }
        for (const std::string& op : o.ops) {
            for (uint64_t block : o.block_sizes) {
                for (uint64_t batch : o.batches) {
                    Row row = RunNetworkRow(**agent, *peer, local->id, remote, backend, raw_addr,
                                            op, block, batch, o);
                    if (!row.error.empty()) rc = 1;
                    PrintRow(row, o.json);
                }
            }
        }
    }
    return rc;
}

}  // namespace

bool ParseSize(const std::string& text, uint64_t* bytes) {
    if (text.empty()) return false;
    size_t pos = 0;
    uint64_t v = 0;
    while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) {
        if (v > (UINT64_MAX - 9) / 10) return false;
        v = v * 10 + (text[pos++] - '0');
    }
    if (pos == 0) return false;
    std::string unit = text.substr(pos);
    uint64_t mult = 1;
    if (unit.empty() || unit == "B")
        mult = 1;
    else if (unit == "K" || unit == "KiB" || unit == "k")
        mult = 1ull << 10;
    else if (unit == "M" || unit == "MiB")
        mult = 1ull << 20;
    else if (unit == "G" || unit == "GiB")
        mult = 1ull << 30;
    else
        return false;
    if (v == 0 || v > (1ull << 40) / mult) return false;
    *bytes = v * mult;
    return true;
}

std::string FormatSize(uint64_t b) {
    if (b % (1ull << 30) == 0) return std::to_string(b >> 30) + "GiB";
    if (b % (1ull << 20) == 0) return std::to_string(b >> 20) + "MiB";
    if (b % (1ull << 10) == 0) return std::to_string(b >> 10) + "KiB";
    return std::to_string(b) + "B";
}

int RunTransferBench(const TransferBenchOptions& o) {
    if (o.role == "target") {
        return RunTarget(o);
    }
    return RunInitiator(o);
}

}  // namespace ferry::bench
