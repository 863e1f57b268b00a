// A `ferry serve` or `ferry proxy` process for multi-process tests: started with its flags,
// ready once /health answers, its /metrics read by name, killed (SIGKILL) and restarted with the
// same flags (and ports, so peers find it again).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ferry/status.h"
#include "testing/process.h"

namespace ferry::testing {

// A deployment secret in a file of its own (for --secret-file), removed when it goes.
class SecretFile {
  public:
    explicit SecretFile(const std::string& tag, const std::string& secret = "");
    ~SecretFile();
    SecretFile(const SecretFile&) = delete;
    SecretFile& operator=(const SecretFile&) = delete;
    const std::string& path() const { return path_; }
    const std::string& secret() const { return secret_; }
    // What the deployment's router presents: "Authorization: Bearer <router_token()>".
    std::string router_token() const;

  private:
    std::string path_, secret_;
};

class ServerProcess {
  public:
    // Starts `binary` with `args` (e.g. {"serve", "--model", path, ...}); the HTTP port is taken
    // from its "listening on http://HOST:PORT" line, and it is ready when GET /health is 200.
    // Its stderr (the log) is the test's, or appended to `log_path` when given.
    static Result<std::unique_ptr<ServerProcess>> Start(
        std::string binary, std::vector<std::string> args,
        std::chrono::milliseconds timeout = std::chrono::seconds(60), std::string log_path = "");
    ~ServerProcess();

    int port() const { return port_; }
    // The address its HTTP server listens on (127.0.0.1 unless it was given another).
    const std::string& host() const { return host_; }
    // The agent line of a worker ("NAME at HOST:PORT"), empty for a colocated worker or a proxy.
    const std::string& agent() const { return agent_; }
    // What it printed up to its listening line.
    const std::vector<std::string>& startup_lines() const { return startup_; }
    pid_t pid() const { return child_.pid(); }
    void Kill() { child_.Kill(); }
    bool Stop() const { return child_.Stop(); }  // SIGSTOP, all threads stopped
    void Signal(int sig) const { child_.Signal(sig); }
    // Its exit code once it exited by itself within `wait` (core/child_process.h).
    std::optional<int> WaitExit(std::chrono::milliseconds wait) { return child_.WaitExit(wait); }
    // The next line it prints that starts with `prefix` (after the listening line).
    Result<std::string> ReadLine(const std::string& prefix, std::chrono::milliseconds timeout) {
        return child_.ReadLine(prefix, timeout);
    }
    // Starts it again with the same arguments, on the same HTTP port.
    Status Restart();

    // A sample of /metrics: `name` exactly, or `name{labels}`; -1 when absent or unreachable.
    double Metric(const std::string& name_and_labels) const;
    // Waits (bounded) until Metric(name) == value.
    bool WaitMetric(const std::string& name, double value,
                    std::chrono::milliseconds limit = std::chrono::seconds(20)) const;

  private:
    ServerProcess() = default;
    Status Launch(std::chrono::milliseconds timeout);
    std::string binary_;
    std::vector<std::string> args_;
    std::string log_path_;
    ChildProcess child_;
    int port_ = 0;
    std::string agent_;
    std::vector<std::string> startup_;
    std::string host_ = "127.0.0.1";
};

}  // namespace ferry::testing
