#include "transfer/stream_links.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "core/log.h"

namespace ferry::internal {

namespace {

// Where an accepted socket comes from: the peer's IP, or the process at the other end of a
// Unix socket.
std::string SourceOf(int fd) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
        char buf[INET6_ADDRSTRLEN] = {};
        if (addr.ss_family == AF_INET) {
            inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&addr)->sin_addr, buf, sizeof(buf));
            return buf;
        }
        if (addr.ss_family == AF_INET6) {
            inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr, buf,
                      sizeof(buf));
            return buf;
        }
    }
    ucred cred{};
    socklen_t clen = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) == 0 && cred.pid > 0) {
        return "pid " + std::to_string(cred.pid);
    }
    return "unknown";
}

}  // namespace

// Accepts connections on one listener (loop 0) and hands them out round-robin.
class StreamLinks::Acceptor final : public EventHandler {
  public:
    Acceptor(StreamLinks* links, Backend* backend, int fd)
        : links_(links), backend_(backend), fd_(fd) {}
    void OnEvents(uint32_t) override {
        for (int i = 0; i < 64; ++i) {
            int fd = accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0) {
                if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                    FERRY_LOG(kWarn, "{}: accept: {}", backend_->name(), std::strerror(errno));
                }
                return;
            }
            links_->Accept(backend_, ScopedFd(fd));
        }
    }

  private:
    StreamLinks* links_;
    Backend* backend_;
    int fd_;
};

StreamLinks::StreamLinks(Identity identity, std::function<IoLoop*()> next_loop,
                         ConnectionOwner* owner)
    : id_(std::move(identity)),
      next_loop_(std::move(next_loop)),
      owner_(owner),
      receive_budget_(std::make_shared<ReceiveBudget>(kReceiveBudget)) {}

StreamLinks::~StreamLinks() = default;

Status StreamLinks::Listen(Backend* backend, ScopedFd listener, IoLoop* loop) {
    auto acceptor = std::make_shared<Acceptor>(this, backend, listener.get());
    int fd = listener.get();
    Status watched;
    loop->RunSync([&] { watched = loop->Watch(fd, EPOLLIN, acceptor); });
    FERRY_RETURN_IF_ERROR(watched);
    listeners_.push_back(std::move(listener));
    acceptors_.push_back(std::move(acceptor));
    return Status::Ok();
}

void StreamLinks::Track(const std::shared_ptr<Connection>& c) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed_) {
        conns_.insert(c);
    }
}

Result<std::shared_ptr<Connection>> StreamLinks::Dial(Backend& backend, std::string_view address,
                                                      const std::string& label,
                                                      wire::Purpose purpose,
                                                      uint64_t expect_epoch) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (closed_) return CancelledError("agent " + id_.name + " is shutting down");
    }
    bool in_progress = false;
    FERRY_ASSIGN_OR_RETURN(ScopedFd fd, backend.Dial(address, &in_progress));
    HandshakeConfig hc;
    hc.backend = std::string(backend.name());
    hc.name = id_.name;
    hc.epoch = id_.epoch;
    hc.secret = id_.secret;
    hc.purpose = purpose;
    hc.budget = receive_budget_;
    hc.counters = wire_counters_;
    hc.expect_epoch = expect_epoch;
    if (backend.data_mode() == wire::DataMode::kCma && id_.cma_probe != nullptr) {
        hc.probe_addr = reinterpret_cast<uint64_t>(id_.cma_probe);
        hc.probe_value = *id_.cma_probe;
    }
    auto conn = Connection::Create(next_loop_(), std::move(fd), Connection::Role::kClient,
                                   std::move(hc), owner_, label, in_progress);
    Track(conn);
    conn->Start();
    return conn;
}

void StreamLinks::Accept(Backend* backend, ScopedFd fd) {
    std::string source = SourceOf(fd.get());
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = handshaking_by_source_.find(source);
        size_t from_source = it == handshaking_by_source_.end() ? 0 : it->second;
        if (from_source >= kMaxHandshakingPerSource || handshaking_.size() >= kMaxHandshaking) {
            uint64_t n = handshakes_refused_.fetch_add(1) + 1;
            if ((n & (n - 1)) == 0) {  // 1, 2, 4, 8, ...: a flood is not a log flood
                FERRY_LOG(kWarn,
                          "{}: refused a connection from {}: {} handshakes pending from it, {} in "
                          "all (at most {} and {}; {} refused so far)",
                          backend->name(), source, from_source, handshaking_.size(),
                          kMaxHandshakingPerSource, kMaxHandshaking, n);
            }
            return;  // fd closes
        }
    }
    backend->Configure(fd.get());
    HandshakeConfig hc;
    hc.backend = std::string(backend->name());
    hc.name = id_.name;
    hc.epoch = id_.epoch;
    hc.secret = id_.secret;
    hc.verify_cma = backend->verify_cma();
    hc.budget = receive_budget_;
    hc.counters = wire_counters_;
    hc.source = source;
    auto conn =
        Connection::Create(next_loop_(), std::move(fd), Connection::Role::kServer, std::move(hc),
                           owner_, std::string(backend->name()) + " client from " + source, false);
    {
        std::lock_guard<std::mutex> lock(mu_);
        handshaking_[conn.get()] = source;
        ++handshaking_by_source_[source];
    }
    Track(conn);
    conn->Start();
}

void StreamLinks::HandshakeOver(const Connection& conn) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handshaking_.find(&conn);
    if (it == handshaking_.end()) return;
    auto src = handshaking_by_source_.find(it->second);
    if (src != handshaking_by_source_.end() && --src->second == 0) {
        handshaking_by_source_.erase(src);
    }
    handshaking_.erase(it);
}

bool StreamLinks::Closed(Connection& conn, const Status& why) {
    HandshakeOver(conn);
    if (why.code() == Code::kDeadlineExceeded && conn.ready()) {
        stalled_frames_dropped_.fetch_add(1);
    }
    std::shared_ptr<Connection> self = conn.shared_from_this();
    const pid_t pid = conn.peer_pid();
    bool pid_still_connected = false;
    std::lock_guard<std::mutex> lock(mu_);
    conns_.erase(self);
    for (const auto& c : conns_) {
        pid_still_connected |= pid != 0 && c->peer_pid() == pid && !c->closed();
    }
    return pid_still_connected;
}

std::vector<std::shared_ptr<Connection>> StreamLinks::Snapshot() const {
    std::lock_guard<std::mutex> lock(mu_);
    return {conns_.begin(), conns_.end()};
}

void StreamLinks::CloseAll(const Status& why) {
    std::set<std::shared_ptr<Connection>> conns;
    {
        std::lock_guard<std::mutex> lock(mu_);
        closed_ = true;
        conns.swap(conns_);
    }
    for (const auto& c : conns) {
        c->CloseAndWait(why);
    }
}

void StreamLinks::ReleaseListeners() {
    acceptors_.clear();
    listeners_.clear();
}

void StreamLinks::Tick(Clock::time_point now, std::chrono::milliseconds stalled_frame_timeout) {
    std::vector<std::shared_ptr<Connection>> stale;
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto& c : conns_) {
            if (!c->ready() && !c->closed() && now - c->created() > kHandshakeTimeout) {
                stale.push_back(c);
            }
        }
    }
    for (auto& c : stale) {
        c->Close(DeadlineExceededError("handshake not completed within 10 s"));
    }
    if (++ticks_ % kStallCheckEveryTicks != 0) {
        return;
    }
    // Each connection is checked on its own loop thread.
    std::map<IoLoop*, std::vector<std::shared_ptr<Connection>>> by_loop;
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto& c : conns_) {
            if (c->ready() && !c->closed()) by_loop[c->loop()].push_back(c);
        }
    }
    for (auto& entry : by_loop) {
        entry.first->Post([conns = std::move(entry.second), now, stalled_frame_timeout] {
            for (const auto& c : conns) c->CheckStalled(now, stalled_frame_timeout);
        });
    }
}

size_t StreamLinks::handshakes_pending() const {
    std::lock_guard<std::mutex> lock(mu_);
    return handshaking_.size();
}

}  // namespace ferry::internal
