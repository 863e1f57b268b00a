#include "bench/transfer_references.h"

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
#include "core/host_port.h"
#include "core/log.h"
#include "ferry/agent.h"
#include "transfer/backend.h"
#include "transfer/backends/file/file_engine.h"
#include "transfer/region_table.h"

namespace ferry::bench {

using Seconds = std::chrono::duration<double>;

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

RawSink::~RawSink() {
    if (!thread_.joinable()) return;
    stopping_ = true;
    shutdown(fd_.get(), SHUT_RDWR);  // accept4 returns
    const int c = conn_.load();
    if (c >= 0) shutdown(c, SHUT_RDWR);  // recv returns
    thread_.join();
}

bool RawSink::Start(const std::string& host) {
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
    address_ = FormatHostPort(host, ntohs(sa.sin_port));
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

}  // namespace ferry::bench
