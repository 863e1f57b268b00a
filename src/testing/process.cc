#include "testing/process.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

extern char** environ;

namespace ferry::testing {

std::vector<OpenFd> OpenFds() {
    std::vector<OpenFd> fds;
    DIR* d = opendir("/proc/self/fd");
    if (d == nullptr) return fds;
    const int self = dirfd(d);
    while (dirent* e = readdir(d)) {
        if (e->d_name[0] == '.') continue;
        OpenFd f;
        f.fd = atoi(e->d_name);
        if (f.fd == self) continue;
        char target[256] = {0};
        ssize_t n = readlink((std::string("/proc/self/fd/") + e->d_name).c_str(), target,
                             sizeof target - 1);
        f.what = n > 0 ? std::string(target, n) : "?";
        sockaddr_in local{}, peer{};
        socklen_t len = sizeof local;
        if (getsockname(f.fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
            local.sin_family == AF_INET) {
            f.what += " local :" + std::to_string(ntohs(local.sin_port));
            len = sizeof peer;
            if (getpeername(f.fd, reinterpret_cast<sockaddr*>(&peer), &len) == 0) {
                f.peer_port = ntohs(peer.sin_port);
                f.what += " peer :" + std::to_string(f.peer_port);
            }
        }
        fds.push_back(std::move(f));
    }
    closedir(d);
    return fds;
}

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
    if (pid_ > 0) {
        // Give it a moment to exit on its own (stdin closed), then insist.
        for (int i = 0; i < 40; ++i) {
            if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
                pid_ = -1;
                break;
            }
            usleep(25000);
        }
        if (pid_ > 0) Kill();
    }
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

void ChildProcess::Kill() {
    if (pid_ > 0) {
        kill(pid_, SIGCONT);
        kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
        pid_ = -1;
    }
}

Result<ChildProcess> ChildProcess::Start(const std::vector<std::string>& argv,
                                         const std::string& ready_prefix, std::string* ready_line,
                                         std::chrono::milliseconds timeout,
                                         const std::string& stderr_path) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
        return InternalError(std::string("pipe: ") + std::strerror(errno));
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    if (!stderr_path.empty()) {
        posix_spawn_file_actions_addopen(&fa, 2, stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND,
                                         0644);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ChildProcess child;
    int rc = posix_spawn(&child.pid_, argv[0].c_str(), &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
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

}  // namespace ferry::testing

namespace ferry::testing {

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

}  // namespace ferry::testing
