// ferry_test_peer: an agent in its own process for integration tests. Allocates one region
// filled with a pattern, prints "READY <listen address> <region id>", then obeys commands that
// arrive as notifications until its stdin closes:
//   connect <host:port>                -> "connected <peer>"
//   copy-from <peer> <region> <bytes>  -> reads the peer's region into its own, "copied <hash>"
#include <poll.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <sstream>

#include "ferry/agent.h"

namespace {

uint64_t Fnv1a(const uint8_t* p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"ferry integration-test peer"};
    ferry::AgentConfig config;
    std::string backend = "tcp";
    uint64_t region_size = 1 << 20, seed = 1;
    app.add_option("--name", config.name)->required();
    app.add_option("--backend", backend);
    app.add_option("--secret", config.secret);
    app.add_option("--region-size", region_size);
    app.add_option("--seed", seed);
    int skip_regions = 0;
    app.add_option("--skip-regions", skip_regions,
                   "register and drop this many regions first, so the region's id differs");
    app.add_flag("--ucx-rma", config.ucx_rma, "ucx: take grants and move bytes one-sided");
    int64_t store_ttl_ms = 0, stalled_frame_ms = 0;
    app.add_option("--stalled-frame-ms", stalled_frame_ms);
    app.add_option("--store", config.store);
    app.add_option("--store-ttl-ms", store_ttl_ms);
    CLI11_PARSE(app, argc, argv);
    config.backends = {backend};
    if (store_ttl_ms > 0) config.store_ttl = std::chrono::milliseconds(store_ttl_ms);
    if (stalled_frame_ms > 0)
        config.stalled_frame_timeout = std::chrono::milliseconds(stalled_frame_ms);
    auto agent = ferry::Agent::Create(config);
    if (!agent.ok()) {
        std::fprintf(stderr, "test peer: %s\n", agent.status().ToString().c_str());
        return 1;
    }
    for (int i = 0; i < skip_regions; ++i) {
        auto r = (*agent)->AllocateRegion(4096);
        if (!r.ok() || !(*agent)->Deregister(r->id).ok()) return 1;
    }
    auto region = (*agent)->AllocateRegion(region_size);
    if (!region.ok()) return 1;
    auto* base = static_cast<uint8_t*>(region->base);
    for (uint64_t i = 0; i < region_size; ++i)
        base[i] = static_cast<uint8_t>((i * seed + seed) >> 3);
    // Publish the pattern to the I/O threads (they take the region table's lock before serving a
    // request; so does this call). Peers learn of it through READY, an edge no tool can see.
    (void)(*agent)->Regions();
    std::printf("READY %s %llu\n", (*agent)->ListenAddress().c_str(),
                static_cast<unsigned long long>(region->id));
    std::fflush(stdout);
    while (true) {
        pollfd p{0, POLLIN, 0};
        if (poll(&p, 1, 0) > 0) {
            char c;
            if (read(0, &c, 1) <= 0) break;  // the test is gone
        }
        auto notes =
            (*agent)->WaitNotifications(ferry::Clock::now() + std::chrono::milliseconds(50));
        for (const auto& n : notes) {
            std::istringstream in(n.payload);
            std::string cmd;
            in >> cmd;
            std::string reply;
            if (cmd == "connect") {
                std::string addr;
                in >> addr;
                auto peer = (*agent)->Connect(addr);
                reply = peer.ok() ? "connected " + *peer : "error " + peer.status().ToString();
            } else if (cmd == "copy-from") {
                std::string peer;
                uint64_t remote = 0, bytes = 0;
                in >> peer >> remote >> bytes;
                auto x =
                    (*agent)->PostRead(std::vector<ferry::Descriptor>{{region->id, 0, bytes}}, peer,
                                       std::vector<ferry::Descriptor>{{remote, 0, bytes}});
                ferry::Status s = x.ok() ? x->Wait(std::chrono::seconds(30)) : x.status();
                reply = s.ok() ? "copied " + std::to_string(Fnv1a(base, bytes))
                               : "error " + s.ToString();
            } else {
                reply = "error unknown command '" + cmd + "'";
            }
            (void)(*agent)->Notify(n.peer, reply);
        }
    }
    return 0;
}
