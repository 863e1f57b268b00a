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
#include "bench/transfer_references.h"
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
