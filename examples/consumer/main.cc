// Two agents in one process move 1 MiB through the installed ferry::transfer, and check it.
#include <cstdio>
#include <cstring>
#include <vector>

#include "ferry/agent.h"

int main() {
    auto a = ferry::Agent::Create({.name = "consumer-a"});
    auto b = ferry::Agent::Create({.name = "consumer-b"});
    if (!a.ok() || !b.ok()) {
        std::fprintf(stderr, "consumer: %s\n",
                     (a.ok() ? b.status() : a.status()).ToString().c_str());
        return 1;
    }
    std::vector<char> src(1 << 20, 'x'), dst(1 << 20, 0);
    auto rs = (*b)->RegisterMemory(src.data(), src.size());
    auto rd = (*a)->RegisterMemory(dst.data(), dst.size());
    auto peer = (*a)->AddPeer((*b)->Metadata());
    if (!rs.ok() || !rd.ok() || !peer.ok()) return 1;
    ferry::Descriptor local{rd->id, 0, dst.size()}, remote{rs->id, 0, src.size()};
    auto t = (*a)->PostRead({&local, 1}, *peer, {&remote, 1});
    if (!t.ok() || !t->Wait(std::chrono::seconds(10)).ok()) return 1;
    if (std::memcmp(src.data(), dst.data(), src.size()) != 0) return 1;
    std::printf("consumer: moved %zu bytes through the installed ferry::transfer\n", dst.size());
    return 0;
}
