#include "transfer/backends/tcp/tcp_backend.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "core/cpu.h"

namespace ferry {

namespace {

int DefaultStreams() {
    int cores = UsableCores();
    return std::clamp(cores, 2, 8);
}

// The first non-loopback IPv4 address, to publish when listening on the wildcard address.
std::string PrimaryAddress() {
    ifaddrs* list = nullptr;
    std::string out = "127.0.0.1";
    if (getifaddrs(&list) != 0) {
        return out;
    }
    for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
        if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
        auto* sin = reinterpret_cast<sockaddr_in*>(a->ifa_addr);
        if (ntohl(sin->sin_addr.s_addr) >> 24 == 127) continue;
        char buf[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf));
        out = buf;
        break;
    }
    freeifaddrs(list);
    return out;
}

Result<addrinfo*> Resolve(const std::string& host, uint16_t port, bool passive) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
    addrinfo* res = nullptr;
    std::string service = std::to_string(port);
    int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
    if (rc != 0) {
        return UnavailableError("tcp: resolve '" + host + "': " + gai_strerror(rc));
    }
    return res;
}

}  // namespace

TcpBackend::TcpBackend(const AgentConfig& config)
    : host_(config.listen_host),
      port_(config.listen_port),
      streams_(config.tcp_streams > 0 ? std::min(config.tcp_streams, 64) : DefaultStreams()) {}

Result<std::string> TcpBackend::Listen(ScopedFd* listener) {
    FERRY_ASSIGN_OR_RETURN(addrinfo * res, Resolve(host_, port_, true));
    Status last = UnavailableError("tcp: no address for '" + host_ + "'");
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
        ScopedFd fd(socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        if (!fd.valid()) continue;
        int one = 1;
        setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || listen(fd.get(), 512) != 0) {
            last = UnavailableError("tcp: listen on " + host_ + ":" + std::to_string(port_) + ": " +
                                    std::strerror(errno));
            continue;
        }
        sockaddr_storage ss{};
        socklen_t len = sizeof(ss);
        getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
        uint16_t port = ss.ss_family == AF_INET
                            ? ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port)
                            : ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
        freeaddrinfo(res);
        *listener = std::move(fd);
        std::string host = host_;
        if (host == "0.0.0.0" || host == "::" || host.empty()) {
            host = PrimaryAddress();
        }
        if (host.find(':') != std::string::npos) {
            host = "[" + host + "]";
        }
        return host + ":" + std::to_string(port);
    }
    freeaddrinfo(res);
    return last;
}

bool TcpBackend::CanReach(const AgentMetadata& /*self*/, const AgentMetadata& peer) const {
    return peer.FindEndpoint("tcp") != nullptr;
}

Result<ScopedFd> TcpBackend::Dial(std::string_view address, bool* in_progress) const {
    std::string host;
    uint16_t port = 0;
    FERRY_RETURN_IF_ERROR(SplitHostPort(address, &host, &port).WithContext("tcp"));
    FERRY_ASSIGN_OR_RETURN(addrinfo * res, Resolve(host, port, false));
    Status last = UnavailableError("tcp: no address for " + std::string(address));
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
        ScopedFd fd(socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        if (!fd.valid()) continue;
        Configure(fd.get());
        if (connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0) {
            *in_progress = false;
        } else if (errno == EINPROGRESS) {
            *in_progress = true;
        } else {
            last = UnavailableError("tcp: connect " + std::string(address) + ": " +
                                    std::strerror(errno));
            continue;
        }
        freeaddrinfo(res);
        return fd;
    }
    freeaddrinfo(res);
    return last;
}

void TcpBackend::Configure(int fd) const {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    int idle = 5, interval = 2, count = 3;
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
    unsigned user_timeout_ms = 15000;  // unacknowledged data this long: the peer is gone
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

BackendCapabilities TcpBackend::capabilities() const {
    BackendCapabilities c;
    c.data_path = DataPath::kStream;
    c.locality = Locality::kAnyHost;
    c.side_channel = true;
    return c;
}

std::unique_ptr<Backend> MakeTcpBackend(const BackendContext& ctx) {
    return std::make_unique<TcpBackend>(ctx.config);
}

}  // namespace ferry
