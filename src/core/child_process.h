// A child process with a pipe on its stdin (closing it asks the child to exit) and one on its
// stdout (read line by line: its readiness line, then whatever else it prints); ended and reaped
// when the object goes. The one launcher: the tests' worker and store processes, `ferry bench
// serve`'s server and `ferry bench transfer`'s target all start through it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry {

struct ChildOptions {
    // Appends the child's stderr here ("" = it shares ours).
    std::string stderr_path;
    // The kernel sends the child SIGTERM when this process dies, even by SIGKILL (a benchmark
    // killed mid-run leaves no server behind).
    bool die_with_parent = false;
    // "NAME=value" entries set in the child's environment, over this process's (which the child
    // otherwise inherits unchanged).
    std::vector<std::string> env;
};

// The path of program `name` as the shell would run it: `name` itself if it holds a '/', else
// the first executable file of that name in a PATH directory. NotFound naming it otherwise.
Result<std::string> FindProgram(const std::string& name);

class ChildProcess {
  public:
    ChildProcess() = default;
    ChildProcess(ChildProcess&& o) noexcept;
    ChildProcess& operator=(ChildProcess&& o) noexcept;
    ~ChildProcess();

    // Starts `argv` (argv[0] is the path) and waits up to `timeout` for a stdout line beginning
    // with `ready_prefix`; returns the rest of that line in *ready_line. Unavailable if it exits
    // first, DeadlineExceeded if the line does not come in time.
    static Result<ChildProcess> Start(const std::vector<std::string>& argv,
                                      const std::string& ready_prefix, std::string* ready_line,
                                      std::chrono::milliseconds timeout, ChildOptions options);
    static Result<ChildProcess> Start(const std::vector<std::string>& argv,
                                      const std::string& ready_prefix, std::string* ready_line,
                                      std::chrono::milliseconds timeout = std::chrono::seconds(10),
                                      const std::string& stderr_path = "") {
        ChildOptions options;
        options.stderr_path = stderr_path;
        return Start(argv, ready_prefix, ready_line, timeout, options);
    }

    pid_t pid() const { return pid_; }
    void Signal(int sig) const;
    // SIGSTOP, then waits until every thread of the process has stopped (kill() returns before
    // the group stop has reached the other threads, which may still run for a while on a loaded
    // machine). False if that did not happen within `timeout`.
    bool Stop(std::chrono::milliseconds timeout = std::chrono::seconds(10)) const;
    // Kills with SIGKILL and reaps.
    void Kill();
    // SIGTERM (a clean shutdown), SIGKILL if it has not exited after `grace`; reaps.
    void Terminate(std::chrono::milliseconds grace);
    // Waits up to `wait` for the child to exit by itself and reaps it: its exit code (128 + the
    // signal's number if a signal ended it); nullopt while it runs (or if it was reaped before).
    std::optional<int> WaitExit(std::chrono::milliseconds wait);
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
    // Reaps the child if it exited within `wait`; true if it did.
    bool Reaped(std::chrono::milliseconds wait);
    pid_t pid_ = -1;
    int stdin_fd_ = -1;
    int stdout_fd_ = -1;
    std::string pending_;  // read from stdout, not yet returned
};

}  // namespace ferry
