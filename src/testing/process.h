// Process helpers for integration tests: the child launcher (core/child_process.h) and this
// process's open descriptors.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "core/child_process.h"
#include "ferry/status.h"

namespace ferry::testing {

// The launcher lives in core (`ferry bench` uses it too); tests name it as before.
using ::ferry::ChildOptions;
using ::ferry::ChildProcess;

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
