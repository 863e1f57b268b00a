#include "discovery/http_guard.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

#include "core/log.h"
#include "core/tsan.h"

namespace ferry::discovery {
namespace {

std::string Key(const std::string& addr, int port) { return addr + "|" + std::to_string(port); }

}  // namespace

std::string AcceptedPeer(int fd, uint16_t local_port) {
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return {};
    sockaddr_storage peer{}, local{};
    socklen_t pl = sizeof peer, ll = sizeof local;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0) {
        return {};
    }
    char buf[INET6_ADDRSTRLEN] = {};
    int pport = 0, lport = 0;
    if (peer.ss_family == AF_INET) {
        auto* p = reinterpret_cast<sockaddr_in*>(&peer);
        inet_ntop(AF_INET, &p->sin_addr, buf, sizeof buf);
        pport = ntohs(p->sin_port);
        lport = ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port);
    } else if (peer.ss_family == AF_INET6) {
        auto* p = reinterpret_cast<sockaddr_in6*>(&peer);
        inet_ntop(AF_INET6, &p->sin6_addr, buf, sizeof buf);
        pport = ntohs(p->sin6_port);
        lport = ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port);
    } else {
        return {};
    }
    if (lport != local_port) return {};
    return Key(buf, pport);
}

void HttpGuard::Start(uint16_t port) {
    thread_ = std::thread([this, port] { Loop(port); });
}

void HttpGuard::Stop() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
        cv_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
}

void HttpGuard::RequestStarted(const std::string& addr, int port) {
    std::lock_guard<std::mutex> lock(mu_);
    Conn& c = conns_[Key(addr, port)];
    c.in_handler = true;
}

void HttpGuard::ResponseDone(const std::string& addr, int port) {
    std::lock_guard<std::mutex> lock(mu_);
    Conn& c = conns_[Key(addr, port)];
    c.in_handler = false;
    c.since = std::chrono::steady_clock::now();
}

void HttpGuard::Loop(uint16_t port) {
    auto period = std::min<std::chrono::milliseconds>(deadline_ / 4, std::chrono::seconds(1));
    period = std::max<std::chrono::milliseconds>(period, std::chrono::milliseconds(50));
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
        cv_.wait_for(lock, period, [&] { return stop_; });
        if (stop_) break;
        lock.unlock();
        Scan(port);
        lock.lock();
    }
}

void HttpGuard::Scan(uint16_t port) {
    // Looking at every descriptor of the process (fstat, getpeername) races, in ThreadSanitizer's
    // model, with the threads that own them; the calls are read-only and the one that acts
    // (shutdown) checks again that the descriptor is still the same connection.
    FERRY_TSAN_IGNORE_READS_BEGIN();
    ScanUnannotated(port);
    FERRY_TSAN_IGNORE_READS_END();
}

void HttpGuard::ScanUnannotated(uint16_t port) {
    std::vector<std::pair<int, std::string>> sockets;
    if (DIR* d = opendir("/proc/self/fd")) {
        while (dirent* e = readdir(d)) {
            int fd = atoi(e->d_name);
            if (fd <= 2) continue;
            std::string peer = AcceptedPeer(fd, port);
            if (!peer.empty()) sockets.emplace_back(fd, std::move(peer));
        }
        closedir(d);
    }
    auto now = std::chrono::steady_clock::now();
    std::vector<std::pair<int, std::string>> late;
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& [k, c] : conns_) c.seen = false;
        for (const auto& [fd, peer] : sockets) {
            auto [it, added] = conns_.try_emplace(peer);
            Conn& c = it->second;
            c.seen = true;
            // Bytes the server has not read yet: the client delivered and the server is behind
            // (the connection waits for a free thread). Its deadline starts when they are read.
            int unread = 0;
            if (added || (ioctl(fd, FIONREAD, &unread) == 0 && unread > 0)) c.since = now;
            if (!c.in_handler && now - c.since > deadline_) late.emplace_back(fd, peer);
        }
        for (auto it = conns_.begin(); it != conns_.end();) {
            it = it->second.seen ? std::next(it) : conns_.erase(it);
        }
    }
    for (const auto& [fd, peer] : late) {
        // The fd may have been closed and reused since the scan: only the same connection goes.
        if (AcceptedPeer(fd, port) != peer) continue;
        shutdown(fd, SHUT_RDWR);  // the server's read fails and it closes the socket itself
        closed_.fetch_add(1);
        FERRY_LOG(kWarn, "http :{}: closed connection from {}: no complete request within {} ms",
                  port, peer, deadline_.count());
        std::lock_guard<std::mutex> lock(mu_);
        conns_.erase(peer);
    }
}

}  // namespace ferry::discovery
