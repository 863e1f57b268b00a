#include "core/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

extern char** environ;

namespace ferry {

ChildProcess::ChildProcess(ChildProcess&& o) noexcept
    : pid_(o.pid_),
      stdin_fd_(o.stdin_fd_),
      stdout_fd_(o.stdout_fd_),
      pending_(std::move(o.pending_)) {
    o.pid_ = -1;
    o.stdin_fd_ = -1;
    o.stdout_fd_ = -1;
}

ChildProcess& ChildProcess::operator=(ChildProcess&& o) noexcept {
    if (this != &o) {
        Release();  // not ~ChildProcess(): that would end pending_'s lifetime too
        pid_ = std::exchange(o.pid_, -1);
        stdin_fd_ = std::exchange(o.stdin_fd_, -1);
        stdout_fd_ = std::exchange(o.stdout_fd_, -1);
        pending_ = std::move(o.pending_);
    }
    return *this;
}

ChildProcess::~ChildProcess() { Release(); }

void ChildProcess::Release() {
    if (stdin_fd_ >= 0) close(stdin_fd_);
    // Give it a moment to exit on its own (stdin closed), then insist.
    if (pid_ > 0 && !Reaped(std::chrono::seconds(1))) Kill();
    if (stdout_fd_ >= 0) close(stdout_fd_);
    stdin_fd_ = -1;
    stdout_fd_ = -1;
}

void ChildProcess::Signal(int sig) const {
    if (pid_ > 0) kill(pid_, sig);
}

bool ChildProcess::Stop(std::chrono::milliseconds timeout) const {
    if (pid_ <= 0) return false;
    kill(pid_, SIGSTOP);
    auto end = std::chrono::steady_clock::now() + timeout;
    std::string dir = "/proc/" + std::to_string(pid_) + "/task";
    while (std::chrono::steady_clock::now() < end) {
        bool all = true;
        std::error_code ec;
        for (const auto& task : std::filesystem::directory_iterator(dir, ec)) {
            std::ifstream in(task.path() / "stat");
            std::string line;
            std::getline(in, line);
            // "pid (comm) S ...": the state follows the last ')'.
            size_t paren = line.rfind(')');
            if (paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'T') {
                all = false;
                break;
            }
        }
        if (all && !ec) return true;
        usleep(1000);
    }
    return false;
}

bool ChildProcess::Reaped(std::chrono::milliseconds wait) { return WaitExit(wait).has_value(); }

std::optional<int> ChildProcess::WaitExit(std::chrono::milliseconds wait) {
    if (pid_ <= 0) return std::nullopt;
    const auto end = std::chrono::steady_clock::now() + wait;
    for (;;) {
        int status = 0;
        if (waitpid(pid_, &status, WNOHANG) == pid_) {
            pid_ = -1;
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
        if (std::chrono::steady_clock::now() >= end) return std::nullopt;
        usleep(25000);
    }
}

void ChildProcess::Terminate(std::chrono::milliseconds grace) {
    if (pid_ <= 0) return;
    kill(pid_, SIGCONT);
    kill(pid_, SIGTERM);
    if (!Reaped(grace)) Kill();
}

void ChildProcess::Kill() {
    if (pid_ > 0) {
        kill(pid_, SIGCONT);
        kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
        pid_ = -1;
    }
}

namespace {

// fork + exec, for what posix_spawn cannot ask for (the parent-death signal). Between fork and
// exec the child calls only async-signal-safe functions.
int ForkExec(pid_t* pid, const char* path, char* const* args, char* const* envp, int in, int out,
             const std::string& stderr_path) {
    const pid_t parent = getpid();
    const pid_t p = fork();
    if (p < 0) return errno;
    if (p == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(127);  // the parent died before prctl
        dup2(in, 0);
        dup2(out, 1);
        if (!stderr_path.empty()) {
            int fd = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
            if (fd >= 0) dup2(fd, 2);
        }
        execve(path, args, envp);
        _exit(127);
    }
    *pid = p;
    return 0;
}

// This process's environment with `overrides` ("NAME=value") set over it.
std::vector<std::string> ChildEnvironment(const std::vector<std::string>& overrides) {
    std::vector<std::string> env;
    auto name_of = [](std::string_view entry) { return entry.substr(0, entry.find('=')); };
    for (char** e = environ; *e != nullptr; ++e) {
        const std::string_view entry(*e);
        bool replaced = false;
        for (const std::string& o : overrides) replaced |= name_of(o) == name_of(entry);
        if (!replaced) env.emplace_back(entry);
    }
    env.insert(env.end(), overrides.begin(), overrides.end());
    return env;
}

}  // namespace

Result<std::string> FindProgram(const std::string& name) {
    if (name.empty()) return InvalidArgumentError("FindProgram: no name");
    if (name.find('/') != std::string::npos) return name;
    const char* path = std::getenv("PATH");
    std::string_view dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
    while (!dirs.empty()) {
        const size_t colon = dirs.find(':');
        std::string dir(dirs.substr(0, colon));
        dirs = colon == std::string_view::npos ? std::string_view() : dirs.substr(colon + 1);
        const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + name;
        struct stat st {};
        if (stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
            access(candidate.c_str(), X_OK) == 0) {
            return candidate;
        }
    }
    return NotFoundError(name + ": not found in PATH");
}

Result<ChildProcess> ChildProcess::Start(const std::vector<std::string>& argv,
                                         const std::string& ready_prefix, std::string* ready_line,
                                         std::chrono::milliseconds timeout, ChildOptions options) {
    if (argv.empty()) return InvalidArgumentError("ChildProcess::Start: no program");
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
        return InternalError(std::string("pipe: ") + std::strerror(errno));
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const std::vector<std::string> env = ChildEnvironment(options.env);
    std::vector<char*> envp;
    for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    ChildProcess child;
    int rc = 0;
    if (options.die_with_parent) {
        rc = ForkExec(&child.pid_, argv[0].c_str(), args.data(), envp.data(), in[0], out[1],
                      options.stderr_path);
    } else {
        // posix_spawn (clone with CLONE_VFORK): cheap even from a process with a large
        // address space, as a sanitizer build's is.
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_adddup2(&fa, in[0], 0);
        posix_spawn_file_actions_adddup2(&fa, out[1], 1);
        if (!options.stderr_path.empty()) {
            posix_spawn_file_actions_addopen(&fa, 2, options.stderr_path.c_str(),
                                             O_WRONLY | O_CREAT | O_APPEND, 0644);
        }
        rc = posix_spawn(&child.pid_, argv[0].c_str(), &fa, nullptr, args.data(), envp.data());
        posix_spawn_file_actions_destroy(&fa);
    }
    close(in[0]);
    close(out[1]);
    child.stdin_fd_ = in[1];
    child.stdout_fd_ = out[0];
    if (rc != 0) {
        child.pid_ = -1;
        return InternalError("spawn " + argv[0] + ": " + std::strerror(rc));
    }
    std::string buf;
    auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
        pollfd p{child.stdout_fd_, POLLIN, 0};
        if (poll(&p, 1, 50) <= 0) continue;
        char c[256];
        ssize_t n = read(child.stdout_fd_, c, sizeof(c));
        if (n <= 0) return UnavailableError(argv[0] + " exited before it was ready");
        buf.append(c, static_cast<size_t>(n));
        size_t nl;
        while ((nl = buf.find('\n')) != std::string::npos) {
            std::string line = buf.substr(0, nl);
            buf.erase(0, nl + 1);
            if (line.rfind(ready_prefix, 0) == 0) {
                *ready_line = line.substr(ready_prefix.size());
                child.pending_ = std::move(buf);
                return child;
            }
        }
    }
    return DeadlineExceededError(argv[0] + " not ready within the timeout");
}

void ChildProcess::CloseStdin() {
    if (stdin_fd_ >= 0) close(stdin_fd_);
    stdin_fd_ = -1;
}

Status ChildProcess::WriteLine(const std::string& line) {
    std::string l = line + "\n";
    if (write(stdin_fd_, l.data(), l.size()) != static_cast<ssize_t>(l.size())) {
        return UnavailableError("child's stdin is closed");
    }
    return Status::Ok();
}

Result<std::string> ChildProcess::ReadLine(const std::string& prefix,
                                           std::chrono::milliseconds timeout,
                                           std::vector<std::string>* others) {
    auto end = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        size_t nl;
        while ((nl = pending_.find('\n')) != std::string::npos) {
            std::string line = pending_.substr(0, nl);
            pending_.erase(0, nl + 1);
            if (line.rfind(prefix, 0) == 0) return line;
            if (others) others->push_back(std::move(line));
        }
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            end - std::chrono::steady_clock::now());
        if (left.count() <= 0) return DeadlineExceededError("no line '" + prefix + "' in time");
        pollfd p{stdout_fd_, POLLIN, 0};
        if (poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 100))) <= 0) continue;
        char c[4096];
        ssize_t n = read(stdout_fd_, c, sizeof c);
        if (n <= 0) return UnavailableError("child exited before printing '" + prefix + "'");
        pending_.append(c, static_cast<size_t>(n));
    }
}

}  // namespace ferry
