// What `ferry bench transfer` compares each row with, measured right after it on the same
// machine: memcpy between pre-faulted buffers (shm), one plain TCP stream (tcp), and UCX's own
// ucx_perftest (ucx). Each returns GB/s, 0 when it cannot run.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

#include "core/fd.h"

namespace ferry::bench {

double MemcpyReferenceGbps(uint64_t block, uint64_t batch, double duration, uint64_t slots);
double TcpReferenceGbps(const std::string& address, uint64_t block, double duration);
double UcxPerftestReferenceGbps(uint64_t block, double duration, bool error_handling);

// Target side of the TCP reference: reads and drops everything, then closes. Its thread is
// joined before the sink goes (a detached one read the listening socket's member after it was
// destroyed: TSan, 2026-12-07).
class RawSink {
  public:
    ~RawSink();
    // Listens on `host` port 0 and reads on one thread. False if it cannot listen.
    bool Start(const std::string& host);
    const std::string& address() const { return address_; }

  private:
    ScopedFd fd_;
    std::string address_;
    std::atomic<bool> stopping_{false};
    std::atomic<int> conn_{-1};
    std::thread thread_;
};

}  // namespace ferry::bench
