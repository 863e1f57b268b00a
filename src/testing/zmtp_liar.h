// A ZeroMQ peer that lies, for tests: it speaks ZMTP 3.0's NULL handshake as a socket of type
// `socket_type` (the type the other side expects: SUB for a PUB, DEALER for a ROUTER, PUB for a
// SUB), then declares one message frame of `declared` bytes and streams up to `send` bytes of
// it as fast as the other side reads them. A ZeroMQ socket without ZMQ_MAXMSGSIZE allocates the
// declared size and keeps what arrives; one with it drops the connection on the header.
//
// POSIX sockets only (the router's unit test links nothing else). Blocking calls, each bounded
// by a 5 s socket timeout.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace ferry::testing {

struct ZmtpLie {
    bool handshake = false;  // the greetings were exchanged
    uint64_t accepted = 0;   // bytes of the lying frame the other side took
    bool cut = false;        // it closed the connection
};

namespace zmtp_liar_detail {

inline void Timeouts(int fd) {
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

inline bool SendAll(int fd, const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
        const ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
        if (k <= 0) return false;
        c += k;
        n -= size_t(k);
    }
    return true;
}

// The greeting both ways, then our READY naming `socket_type`, then the lie.
inline ZmtpLie Lie(int fd, std::string_view socket_type, uint64_t declared, uint64_t send_bytes) {
    ZmtpLie out;
    Timeouts(fd);
    unsigned char greeting[64] = {0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0};
    std::memcpy(greeting + 12, "NULL", 4);
    if (!SendAll(fd, greeting, sizeof greeting)) return out;
    unsigned char theirs[64];
    size_t got = 0;
    while (got < sizeof theirs) {
        const ssize_t k = recv(fd, theirs + got, sizeof theirs - got, 0);
        if (k <= 0) return out;
        got += size_t(k);
    }
    out.handshake = true;
    std::string ready = "\x05READY";
    ready += char(11);
    ready += "Socket-Type";
    const uint32_t len = htonl(uint32_t(socket_type.size()));
    ready.append(reinterpret_cast<const char*>(&len), 4);
    ready += socket_type;
    std::string command = {char(0x04), char(ready.size())};
    command += ready;
    if (!SendAll(fd, command.data(), command.size())) return out;
    unsigned char header[9] = {0x02};  // a long message frame, the last of its message
    for (int i = 0; i < 8; ++i) header[1 + i] = uint8_t(declared >> (56 - 8 * i));
    if (!SendAll(fd, header, sizeof header)) return out;
    std::vector<char> chunk(1 << 20, 'x');
    while (out.accepted < send_bytes) {
        const ssize_t k = send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL);
        if (k <= 0) {
            out.cut = k < 0 && errno != EAGAIN && errno != EWOULDBLOCK;
            break;
        }
        out.accepted += uint64_t(k);
    }
    if (!out.cut) {
        // Whether it hung up on us after all (the last chunks may have sat in our buffer).
        pollfd p{fd, POLLIN, 0};
        char c;
        out.cut = poll(&p, 1, 1000) > 0 && recv(fd, &c, 1, MSG_DONTWAIT) <= 0;
    }
    return out;
}

}  // namespace zmtp_liar_detail

// As a client of 127.0.0.1:`port`.
inline ZmtpLie LieToZmtpServer(int port, std::string_view socket_type, uint64_t declared,
                               uint64_t send_bytes) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return {};
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ZmtpLie out;
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
        out = zmtp_liar_detail::Lie(fd, socket_type, declared, send_bytes);
    }
    close(fd);
    return out;
}

// As a server on 127.0.0.1 (port() to connect to): lies to the first peer that connects, on a
// thread of its own; result() once Join() returned.
class LyingZmtpServer {
  public:
    LyingZmtpServer(std::string socket_type, uint64_t declared, uint64_t send_bytes) {
        listener_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t n = sizeof a;
        if (bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
            listen(listener_, 4) == 0 &&
            getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &n) == 0) {
            port_ = ntohs(a.sin_port);
        }
        thread_ = std::thread([this, socket_type, declared, send_bytes] {
            pollfd p{listener_, POLLIN, 0};
            if (poll(&p, 1, 20000) <= 0) return;
            const int fd = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
            if (fd < 0) return;
            result_ = zmtp_liar_detail::Lie(fd, socket_type, declared, send_bytes);
            close(fd);
        });
    }
    ~LyingZmtpServer() {
        Join();
        close(listener_);
    }
    int port() const { return port_; }
    void Join() {
        if (thread_.joinable()) thread_.join();
    }
    const ZmtpLie& result() const { return result_; }

  private:
    int listener_ = -1;
    int port_ = 0;
    std::thread thread_;
    ZmtpLie result_;
};

}  // namespace ferry::testing
