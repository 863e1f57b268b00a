// Helpers shared by every ferry test: status matchers, data patterns, agent pairs, and a
// "black hole" peer that accepts connections and never answers (a stalled process).
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/fd.h"
#include "core/sanitizers.h"
#include "ferry/agent.h"
#include "ferry/status.h"
#include "transfer/backend.h"

namespace ferry::testing {

// Builds under ASan or TSan run every step several times slower. There, matrices whose cases
// share one code path (TP pairs, tokenizer families, transports of one protocol) run a
// representative subset that still takes every branch; release builds run them all.
#if defined(FERRY_SANITIZED)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

MATCHER_P(StatusIs, code, "has status code " + std::string(::ferry::CodeName(code))) {
    const auto& s = [&]() -> const ::ferry::Status& {
        if constexpr (std::is_same_v<std::decay_t<decltype(arg)>, ::ferry::Status>) {
            return arg;
        } else {
            return arg.status();
        }
    }();
    *result_listener << "status is " << s.ToString();
    return s.code() == code;
}

// The code and a substring of the message: StatusHas(Code::kInvalidArgument, "token id 7").
MATCHER_P2(StatusHas, code, text,
           "has status code " + std::string(::ferry::CodeName(code)) + " and a message with \"" +
               std::string(text) + "\"") {
    const auto& s = [&]() -> const ::ferry::Status& {
        if constexpr (std::is_same_v<std::decay_t<decltype(arg)>, ::ferry::Status>) {
            return arg;
        } else {
            return arg.status();
        }
    }();
    *result_listener << "status is " << s.ToString();
    return s.code() == code && s.message().find(text) != std::string::npos;
}

#define FERRY_ASSERT_OK(expr)                              \
    do {                                                   \
        const ::ferry::Status ferry_s_ = (expr);           \
        ASSERT_TRUE(ferry_s_.ok()) << ferry_s_.ToString(); \
    } while (0)
#define FERRY_EXPECT_OK(expr)                              \
    do {                                                   \
        const ::ferry::Status ferry_s_ = (expr);           \
        EXPECT_TRUE(ferry_s_.ok()) << ferry_s_.ToString(); \
    } while (0)

// Unwraps a Result in a test, failing the test (and aborting it) on error.
template <typename T>
T ValueOrDie(Result<T> r, const char* what = "result") {
    if (!r.ok()) {
        ADD_FAILURE() << what << ": " << r.status().ToString();
        std::abort();
    }
    return std::move(r).value();
}

// Deterministic bytes: byte i of stream `seed` is a function of (seed, i).
void FillPattern(void* p, size_t len, uint64_t seed);
// Index of the first byte that differs from the pattern, or -1.
int64_t FirstMismatch(const void* p, size_t len, uint64_t seed);

// Waits until `n` reaches `want` or `limit` passes; true if it got there. A bounded wait, so
// that a failure shows as a failed expectation, not a hang.
inline bool WaitForCount(const std::atomic<int>& n, int want,
                         std::chrono::milliseconds limit = std::chrono::seconds(20)) {
    auto until = std::chrono::steady_clock::now() + limit;
    while (n.load() < want && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return n.load() >= want;
}

// Waits until `pred` holds or `limit` passes (bounded, as WaitForCount); true if it held.
inline bool WaitUntil(const std::function<bool()>& pred,
                      std::chrono::milliseconds limit = std::chrono::seconds(20)) {
    auto until = std::chrono::steady_clock::now() + limit;
    while (!pred() && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return pred();
}

// Runs `fn` on a thread and waits for it up to `limit`: true if it returned in time. A deadline
// wait instead of timing a call and comparing afterwards (the call still runs to its end; this
// returns after it did, so nothing outlives the test).
inline bool FinishesWithin(std::chrono::milliseconds limit, const std::function<void()>& fn) {
    std::promise<void> done;
    std::future<void> f = done.get_future();
    std::thread t([&] {
        fn();
        done.set_value();
    });
    const bool in_time = f.wait_for(limit) == std::future_status::ready;
    t.join();
    return in_time;
}

// Backend variants of the conformance suites: "tcp", "shm" (one-sided copies through mapped
// peer regions where possible), "shm_copy" (shm with the peer copying every transfer), "ucx",
// "ucx_rma" (ucx with one-sided grants: AgentConfig::ucx_rma).
std::string BackendName(const std::string& variant);
// Every backend variant of this build for the conformance suites: shm, shm_copy (the target
// copies), tcp, and ucx and ucx_rma where ucx is built.
std::vector<std::string> ConformanceVariants();
// `first` followed by tcp and, where built, ucx and ucx_rma.
std::vector<std::string> NetworkBackends(std::vector<std::string> first = {});
AgentConfig TestConfig(const std::string& name, const std::string& variant);

// Two agents that know each other.
struct AgentPair {
    std::unique_ptr<Agent> a;
    std::unique_ptr<Agent> b;
};
AgentPair MakePair(const std::string& backend, const std::string& secret = "");

// Metadata of `agent` with one field changed, to play a peer that lies.
std::string TamperRegion(const std::string& metadata, RegionId id, uint64_t new_length,
                         uint64_t new_key);
std::string AddFakeRegion(const std::string& metadata, RegionId id, uint64_t length);
// Metadata claiming name `name` whose endpoint for `backend` is a black hole.
std::string BlackholeMetadata(const std::string& name, const std::string& backend,
                              const std::string& address, RegionId region, uint64_t length,
                              uint64_t key);

// Accepts connections and never reads or writes: a stalled peer.
// An IPv4 address of this machine that is not loopback ("" if it has none), and whether a TCP
// connection to it succeeds: a service bound to loopback only must refuse it.
std::string NonLoopbackAddress();
bool CanConnect(const std::string& ipv4, uint16_t port);

// A blocking TCP connection to 127.0.0.1:`port` (invalid if refused).
ScopedFd DialLoopback(uint16_t port);
// Sends all of `bytes` (false if the connection broke).
bool SendAll(int fd, std::string_view bytes);
// True if the peer closes `fd` within `timeout` (what it sends first is read and dropped;
// *got, if given, receives it).
bool ClosedWithin(int fd, std::chrono::milliseconds timeout, std::string* got = nullptr);
// The port of the address that follows `marker` in `line` (a process's readiness line such as
// "ferry serve: listening on http://127.0.0.1:8000"): "host:port" or "http://host:port[/...]",
// up to the next space. 0 when there is none.
uint16_t PortAfter(std::string_view line, std::string_view marker = "");
// Resident memory of process `pid` (VmRSS), in bytes; 0 if unknown.
size_t RssBytes(int pid);
// Threads of process `pid` (/proc/PID/status), -1 if unknown.
int ThreadCount(int pid);
// Raises this process's open-file limit to its hard limit (tests that hold thousands of
// sockets); returns the soft limit now in force.
size_t RaiseFdLimit();

// `n` connections to 127.0.0.1:`port` that each start an HTTP request and then send one more
// header byte every `drip` (a slowloris), until destroyed.
class SlowLoris {
  public:
    SlowLoris(uint16_t port, int n, std::chrono::milliseconds drip);
    ~SlowLoris();
    int connected() const { return static_cast<int>(fds_.size()); }
    // How many of the connections the server has closed, waiting up to `timeout` for all.
    int WaitClosed(std::chrono::milliseconds timeout);

  private:
    std::vector<ScopedFd> fds_;
    std::vector<bool> closed_;
    std::mutex mu_;
    std::thread thread_;
    std::atomic<bool> stop_{false};
};

class Blackhole {
  public:
    explicit Blackhole(const std::string& backend);
    ~Blackhole();
    std::string address() const { return address_; }

  private:
    // Kept alive: a ucx blackhole is a UCX worker nobody progresses.
    std::unique_ptr<Backend> backend_;
    ScopedFd listener_;
    std::string address_;
    std::vector<ScopedFd> accepted_;
    std::thread thread_;
    std::atomic<bool> stop_{false};
};

}  // namespace ferry::testing
