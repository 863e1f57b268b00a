// A child process for integration tests: started with a pipe on stdin (closing it asks the
// child to exit) and one on stdout (for its READY line); killed and reaped on destruction.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry::testing {

class ChildProcess {
  public:
    ChildProcess() = default;
    ChildProcess(ChildProcess&& o) noexcept;
    ChildProcess& operator=(ChildProcess&& o) noexcept;
    ~ChildProcess();

    // Starts `argv` and waits up to `timeout` for a stdout line beginning with `ready_prefix`;
    // returns the rest of that line in *ready_line. Its stderr is ours, or appended to
    // `stderr_path` when given.
    static Result<ChildProcess> Start(const std::vector<std::string>& argv,
                                      const std::string& ready_prefix, std::string* ready_line,
                                      std::chrono::milliseconds timeout = std::chrono::seconds(10),
                                      const std::string& stderr_path = "");

    pid_t pid() const { return pid_; }
    void Signal(int sig) const;
    // SIGSTOP, then waits until every thread of the process has stopped (kill() returns before
    // the group stop has reached the other threads, which may still run for a while on a loaded
    // machine). False if that did not happen within `timeout`.
    bool Stop(std::chrono::milliseconds timeout = std::chrono::seconds(10)) const;
    // Kills with SIGKILL and reaps.
    void Kill();
    // Closes the child's stdin (asks it to finish).
    void CloseStdin();
    // Writes one line to the child's stdin.
    Status WriteLine(const std::string& line);
    // The next stdout line starting with `prefix`; lines before it go to *others (if given).
    Result<std::string> ReadLine(const std::string& prefix, std::chrono::milliseconds timeout,
                                 std::vector<std::string>* others = nullptr);

  private:
    // Closes the pipes and ends the child (waiting a moment for it to exit by itself).
    void Release();
    pid_t pid_ = -1;
    int stdin_fd_ = -1;
    int stdout_fd_ = -1;
    std::string pending_;  // read from stdout, not yet returned
};

// One open file descriptor of this process: what /proc says it is (a path, "socket:[inode]",
// "anon_inode:[eventfd]"...), with a TCP/IPv4 socket's ports appended (" local :P peer :Q").
struct OpenFd {
    int fd = -1;
    std::string what;
    int peer_port = -1;  // a connected IPv4 socket's peer port, else -1
};
// This process's open descriptors (the one used to list them not included).
std::vector<OpenFd> OpenFds();

}  // namespace ferry::testing
