// The smallest complete use of the transfer engine: links ferry::transfer and nothing else.
//
//   move_bytes serve                 # prints its address, serves a 64 MiB region until Ctrl-C
//   move_bytes read HOST:PORT        # reads that region and checks it
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/agent.h"

namespace {

constexpr uint64_t kBytes = 64 << 20;

int Serve() {
    auto agent = ferry::Agent::Create({.name = "example-server"});
    if (!agent.ok()) {
        std::fprintf(stderr, "%s\n", agent.status().ToString().c_str());
        return 1;
    }
    ferry::RegionInfo region = (*agent)->AllocateRegion(kBytes).value();
    std::memset(region.base, 0x42, kBytes);
    std::printf("serving region %llu (%llu bytes) at %s\n",
                static_cast<unsigned long long>(region.id), static_cast<unsigned long long>(kBytes),
                (*agent)->ListenAddress().c_str());
    std::fflush(stdout);
    pause();  // until a signal ends the process
    return 0;
}

int Read(const std::string& address) {
    auto agent = ferry::Agent::Create({.name = "example-client"});
    if (!agent.ok()) {
        std::fprintf(stderr, "%s\n", agent.status().ToString().c_str());
        return 1;
    }
    auto peer = (*agent)->Connect(address);
    if (!peer.ok()) {
        std::fprintf(stderr, "%s\n", peer.status().ToString().c_str());
        return 1;
    }
    ferry::RegionInfo buffer = (*agent)->AllocateRegion(kBytes).value();
    // The server's first (only) region has id 1. Read it as 64 blocks of 1 MiB.
    std::vector<ferry::Descriptor> local = {{buffer.id, 0, kBytes}};
    std::vector<ferry::Descriptor> remote;
    for (uint64_t i = 0; i < 64; ++i) remote.push_back({1, i << 20, 1 << 20});
    auto start = std::chrono::steady_clock::now();
    auto transfer = (*agent)->PostRead(local, *peer, remote, {.notification = "read done"});
    ferry::Status s = transfer.ok() ? transfer->Wait(std::chrono::seconds(10)) : transfer.status();
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (!s.ok()) {
        std::fprintf(stderr, "read failed: %s\n", s.ToString().c_str());
        return 1;
    }
    const auto* b = static_cast<const uint8_t*>(buffer.base);
    for (uint64_t i = 0; i < kBytes; ++i) {
        if (b[i] != 0x42) {
            std::fprintf(stderr, "byte %llu is wrong\n", static_cast<unsigned long long>(i));
            return 1;
        }
    }
    std::printf("read %llu bytes from %s over %s in %.2f ms\n",
                static_cast<unsigned long long>(kBytes), peer->c_str(),
                (*agent)->PeerBackend(*peer).value().c_str(), ms);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc == 2 && std::string(argv[1]) == "serve") return Serve();
    if (argc == 3 && std::string(argv[1]) == "read") return Read(argv[2]);
    std::fprintf(stderr, "usage: %s serve | %s read HOST:PORT\n", argv[0], argv[0]);
    return 2;
}
