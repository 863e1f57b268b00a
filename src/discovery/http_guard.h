// HttpGuard: closes the connections of an HTTP server that hold a thread without delivering a
// request (slowloris). cpp-httplib's read timeout bounds each read, not the request: a client
// that sends one byte of header every few seconds keeps a worker thread forever, and a few dozen
// such clients starve the server. The guard gives every connection `deadline` to deliver a
// complete request, counted from when the guard first sees it, from its previous response, or
// from the last time it had bytes the server had not read yet (then the server was behind, not
// the client: an honest request queued behind slow ones keeps its chance). A connection inside
// a handler (a long poll, a streamed completion) has no deadline.
//
// The owner calls RequestStarted from a pre-routing handler and ResponseDone from the logger
// (both give the peer's address), and Start once the server listens. Connections are found by
// scanning this process's sockets for ones accepted on the server's port.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace ferry::discovery {

// The peer of `fd` as "addr|port" if it is a TCP connection accepted on `local_port`, else "".
std::string AcceptedPeer(int fd, uint16_t local_port);

class HttpGuard {
  public:
    explicit HttpGuard(std::chrono::milliseconds deadline) : deadline_(deadline) {}
    ~HttpGuard() { Stop(); }
    HttpGuard(const HttpGuard&) = delete;
    HttpGuard& operator=(const HttpGuard&) = delete;

    void Start(uint16_t port);
    void Stop();

    void RequestStarted(const std::string& addr, int port);
    void ResponseDone(const std::string& addr, int port);

    // Connections closed for missing their deadline.
    uint64_t closed() const { return closed_.load(); }

  private:
    struct Conn {
        std::chrono::steady_clock::time_point since;
        bool in_handler = false;
        bool seen = false;  // found in the last scan
    };
    void Loop(uint16_t port);
    void Scan(uint16_t port);
    void ScanUnannotated(uint16_t port);

    const std::chrono::milliseconds deadline_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;
    std::map<std::string, Conn> conns_;  // "addr|port", under mu_
    std::thread thread_;
    std::atomic<uint64_t> closed_{0};
};

}  // namespace ferry::discovery
