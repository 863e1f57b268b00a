#include "testing/testing.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/host_port.h"
#include "transfer/backend.h"
#include "transfer/metadata.h"

namespace ferry::testing {

namespace {
inline uint64_t PatternWord(uint64_t seed, uint64_t w) {
    uint64_t x = w * 0x9E3779B97F4A7C15ull ^ seed * 0xC2B2AE3D27D4EB4Full;
    return x ^ (x >> 29);
}
inline uint8_t PatternByte(uint64_t seed, uint64_t i) {
    return static_cast<uint8_t>(PatternWord(seed, i >> 3) >> (8 * (i & 7)));
}
}  // namespace

// A word at a time (the pattern is a function of the 8-byte word and the byte in it, stored
// little-endian): 128 MiB of it is filled and checked in a fraction of a second even under the
// sanitizers, where a byte loop took most of a conformance test's time.
static_assert(std::endian::native == std::endian::little);

void FillPattern(void* p, size_t len, uint64_t seed) {
    auto* b = static_cast<uint8_t*>(p);
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const uint64_t x = PatternWord(seed, i >> 3);
        std::memcpy(b + i, &x, 8);
    }
    for (; i < len; ++i) b[i] = PatternByte(seed, i);
}

int64_t FirstMismatch(const void* p, size_t len, uint64_t seed) {
    const auto* b = static_cast<const uint8_t*>(p);
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t x;
        std::memcpy(&x, b + i, 8);
        if (x != PatternWord(seed, i >> 3)) break;
    }
    for (; i < len; ++i) {
        if (b[i] != PatternByte(seed, i)) return static_cast<int64_t>(i);
    }
    return -1;
}

std::string BackendName(const std::string& variant) {
    if (variant == "shm_copy") return "shm";
    if (variant == "ucx_rma") return "ucx";
    return variant;
}

std::vector<std::string> ConformanceVariants() { return NetworkBackends({"shm", "shm_copy"}); }

std::vector<std::string> NetworkBackends(std::vector<std::string> first) {
    // Each backend of this build (from the registry), then its configuration variants.
    const std::vector<std::string> all = AvailableBackends();
    for (const std::string& b : all) {
        if (b == "shm") continue;  // `first` says which shm variants a suite wants
        first.push_back(b);
        if (b == "ucx") first.push_back("ucx_rma");
    }
    return first;
}

AgentConfig TestConfig(const std::string& name, const std::string& backend) {
    AgentConfig c;
    c.name = name;
    c.backends = {BackendName(backend)};
    c.shm_map_peer_regions = backend != "shm_copy";
    c.ucx_rma = backend == "ucx_rma";
    c.default_timeout = std::chrono::seconds(20);
    return c;
}

AgentPair MakePair(const std::string& backend, const std::string& secret) {
    AgentConfig ca = TestConfig("agent-a", backend);
    AgentConfig cb = TestConfig("agent-b", backend);
    ca.secret = cb.secret = secret;
    AgentPair p;
    p.a = ValueOrDie(Agent::Create(ca), "create a");
    p.b = ValueOrDie(Agent::Create(cb), "create b");
    return p;
}

std::string TamperRegion(const std::string& metadata, RegionId id, uint64_t new_length,
                         uint64_t new_key) {
    AgentMetadata md = DecodeMetadata(metadata).value();
    for (RemoteRegion& r : md.regions) {
        if (r.id == id) {
            r.length = new_length;
            r.key = new_key;
        }
    }
    return EncodeMetadata(md);
}

std::string AddFakeRegion(const std::string& metadata, RegionId id, uint64_t length) {
    AgentMetadata md = DecodeMetadata(metadata).value();
    md.regions.push_back(RemoteRegion{id, length, 12345, MemoryKind::kHost});
    return EncodeMetadata(md);
}

std::string BlackholeMetadata(const std::string& name, const std::string& backend,
                              const std::string& address, RegionId region, uint64_t length,
                              uint64_t key) {
    AgentMetadata md;
    md.name = name;
    md.epoch = 42;
    md.host_id = LocalHostId();
    md.endpoints.push_back(EndpointInfo{backend, address});
    md.regions.push_back(RemoteRegion{region, length, key, MemoryKind::kHost});
    return EncodeMetadata(md);
}

std::string NonLoopbackAddress() {
    ifaddrs* list = nullptr;
    if (getifaddrs(&list) != 0) return {};
    std::string found;
    for (ifaddrs* i = list; i != nullptr && found.empty(); i = i->ifa_next) {
        if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
        auto* a = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
        if ((ntohl(a->sin_addr.s_addr) >> 24) == 127) continue;
        char buf[INET_ADDRSTRLEN] = {};
        inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf);
        found = buf;
    }
    freeifaddrs(list);
    return found;
}

bool CanConnect(const std::string& ipv4, uint16_t port) {
    ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    if (inet_pton(AF_INET, ipv4.c_str(), &a.sin_addr) != 1) return false;
    return connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
}

ScopedFd DialLoopback(uint16_t port) {
    ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return ScopedFd();
    return fd;
}

bool SendAll(int fd, std::string_view bytes) {
    while (!bytes.empty()) {
        ssize_t n = send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
        if (n <= 0) {
            if (n < 0 && errno == EINTR) continue;
            return false;
        }
        bytes.remove_prefix(static_cast<size_t>(n));
    }
    return true;
}

bool ClosedWithin(int fd, std::chrono::milliseconds timeout, std::string* got) {
    auto end = std::chrono::steady_clock::now() + timeout;
    char buf[4096];
    while (std::chrono::steady_clock::now() < end) {
        pollfd p{fd, POLLIN, 0};
        if (poll(&p, 1, 20) > 0) {
            ssize_t n = recv(fd, buf, sizeof(buf), 0);
            if (n <= 0) return true;
            if (got) got->append(buf, static_cast<size_t>(n));
        }
    }
    return false;
}

size_t RssBytes(int pid) {
    FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/status").c_str(), "r");
    if (!f) return 0;
    char line[256];
    size_t kb = 0;
    while (std::fgets(line, sizeof line, f)) {
        if (std::strncmp(line, "VmRSS:", 6) == 0) {
            kb = std::strtoull(line + 6, nullptr, 10);
            break;
        }
    }
    std::fclose(f);
    return kb * 1024;
}

int ThreadCount(int pid) {
    FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/status").c_str(), "r");
    if (!f) return -1;
    char line[256];
    int n = -1;
    while (std::fgets(line, sizeof line, f)) {
        if (std::strncmp(line, "Threads:", 8) == 0) {
            n = std::atoi(line + 8);
            break;
        }
    }
    std::fclose(f);
    return n;
}

size_t RaiseFdLimit() {
    rlimit lim{};
    getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
    getrlimit(RLIMIT_NOFILE, &lim);
    return lim.rlim_cur;
}

SlowLoris::SlowLoris(uint16_t port, int n, std::chrono::milliseconds drip) {
    for (int i = 0; i < n; ++i) {
        ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(port);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) continue;
        const char start[] = "POST /v1/kv/get HTTP/1.1\r\nHost: x\r\nX-Slow: ";
        if (send(fd.get(), start, sizeof start - 1, MSG_NOSIGNAL) < 0) continue;
        fds_.push_back(std::move(fd));
    }
    closed_.assign(fds_.size(), false);
    thread_ = std::thread([this, drip] {
        while (!stop_.load()) {
            {
                std::lock_guard<std::mutex> lock(mu_);
                for (size_t i = 0; i < fds_.size(); ++i) {
                    if (!closed_[i] && send(fds_[i].get(), "a", 1, MSG_NOSIGNAL) < 0) {
                        closed_[i] = true;
                    }
                }
            }
            std::this_thread::sleep_for(drip);
        }
    });
}

SlowLoris::~SlowLoris() {
    stop_.store(true);
    thread_.join();
}

int SlowLoris::WaitClosed(std::chrono::milliseconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        int closed = 0;
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (size_t i = 0; i < fds_.size(); ++i) {
                if (!closed_[i]) {
                    pollfd p{fds_[i].get(), POLLIN | POLLRDHUP, 0};
                    char c;
                    if (poll(&p, 1, 0) > 0 && ((p.revents & (POLLHUP | POLLERR | POLLRDHUP)) ||
                                               recv(fds_[i].get(), &c, 1, MSG_DONTWAIT) <= 0)) {
                        closed_[i] = true;
                    }
                }
                closed += closed_[i] ? 1 : 0;
            }
        }
        if (closed == static_cast<int>(fds_.size()) ||
            std::chrono::steady_clock::now() > deadline) {
            return closed;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
}

Blackhole::Blackhole(const std::string& backend) {
    AgentConfig config;
    backend_ = CreateBackend(backend, config, LocalHostId()).value();
    address_ = backend_->Listen(&listener_).value();
    thread_ = std::thread([this] {
        while (!stop_.load()) {
            pollfd p{listener_.get(), POLLIN, 0};
            if (poll(&p, listener_.valid() ? 1 : 0, 20) > 0) {
                int fd = accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
                if (fd >= 0) accepted_.emplace_back(fd);
            }
        }
    });
}

Blackhole::~Blackhole() {
    stop_.store(true);
    thread_.join();
}

uint16_t PortAfter(std::string_view line, std::string_view marker) {
    const size_t at = line.find(marker);
    if (at == std::string_view::npos) return 0;
    std::string_view a = line.substr(at + marker.size());
    a = a.substr(0, a.find_first_of(" \r\n"));
    if (a.substr(0, 7) == "http://") a.remove_prefix(7);
    a = a.substr(0, a.find('/'));
    auto hp = ParseHostPort(a, 1);
    return hp.ok() ? hp->port : 0;
}

}  // namespace ferry::testing
