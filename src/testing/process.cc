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

}  // namespace ferry::testing
