// ferry_netns_peer: one agent on one "host" (network namespace) of the fault-injection tests.
//
//   --role target     allocates --region-size bytes, prints "READY <listen address> <region>",
//                     serves until stdin closes.
//   --role initiator  connects to --peer, then runs --transfers transfers of mixed sizes, each
//                     with --timeout-ms: a WRITE of a fresh pattern into a slice of the target's
//                     region, then a READ of it back into another buffer, compared byte for byte.
//                     Prints one line per transfer ("ok", "fail <code> <ms>", "corrupt ...") and
//                     "SUMMARY ok=N failed=N corrupt=N late=N" (late: a failure reported more
//                     than 2 s after its deadline; hangs show up as the test's own timeout).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ferry/agent.h"

namespace {

void Fill(uint8_t* p, size_t n, uint64_t seed) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = static_cast<uint8_t>(x);
    }
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"ferry fault-injection peer"};
    std::string role, peer, listen = "0.0.0.0", backend = "tcp";
    uint64_t region_size = 16u << 20;
    int transfers = 20, timeout_ms = 3000;
    uint64_t remote_region = 0;
    app.add_option("--role", role)->required()->check(CLI::IsMember({"target", "initiator"}));
    app.add_option("--peer", peer);
    app.add_option("--remote-region", remote_region);
    app.add_option("--listen", listen);
    app.add_option("--backend", backend);
    app.add_option("--region-size", region_size);
    app.add_option("--transfers", transfers);
    app.add_option("--timeout-ms", timeout_ms);
    CLI11_PARSE(app, argc, argv);

    ferry::AgentConfig config;
    config.name = role == "target" ? "netns-target" : "netns-initiator";
    // "ucx_rma": ucx with one-sided access (AgentConfig::ucx_rma).
    config.backends = {backend == "ucx_rma" ? std::string("ucx") : backend};
    config.ucx_rma = backend == "ucx_rma";
    config.listen_host = listen;
    config.default_timeout = std::chrono::milliseconds(timeout_ms);
    auto agent = ferry::Agent::Create(config);
    if (!agent.ok()) {
        std::fprintf(stderr, "netns peer: %s\n", agent.status().ToString().c_str());
        return 1;
    }
    if (role == "target") {
        auto region = (*agent)->AllocateRegion(region_size);
        if (!region.ok()) return 1;
        std::printf("READY %s %llu\n", (*agent)->ListenAddress().c_str(),
                    static_cast<unsigned long long>(region->id));
        std::fflush(stdout);
        char c;
        while (read(0, &c, 1) > 0) {
        }
        return 0;
    }

    auto name = (*agent)->Connect(peer, std::chrono::seconds(20));
    if (!name.ok()) {
        std::printf("SUMMARY connect-failed %s\n", name.status().ToString().c_str());
        return 1;
    }
    std::printf("CONNECTED %s\n", name->c_str());
    std::fflush(stdout);
    auto out = (*agent)->AllocateRegion(region_size);
    auto back = (*agent)->AllocateRegion(region_size);
    if (!out.ok() || !back.ok()) return 1;
    auto* src = static_cast<uint8_t*>(out->base);
    auto* dst = static_cast<uint8_t*>(back->base);
    const uint64_t sizes[] = {4096, 65536, 1u << 20, 4u << 20};
    int ok = 0, failed = 0, corrupt = 0, late = 0;
    const auto timeout = std::chrono::milliseconds(timeout_ms);
    for (int i = 0; i < transfers; ++i) {
        uint64_t size = std::min<uint64_t>(sizes[i % 4], region_size);
        uint64_t offset = (static_cast<uint64_t>(i) * 8192) % (region_size - size + 1);
        Fill(src, size, 1000 + i);
        std::memset(dst, 0, size);
        auto t0 = ferry::Clock::now();
        ferry::Status s;
        auto w = (*agent)->PostWrite(std::vector<ferry::Descriptor>{{out->id, 0, size}}, *name,
                                     std::vector<ferry::Descriptor>{{remote_region, offset, size}});
        s = w.ok() ? w->Wait(timeout + std::chrono::seconds(10)) : w.status();
        if (s.ok()) {
            auto r =
                (*agent)->PostRead(std::vector<ferry::Descriptor>{{back->id, 0, size}}, *name,
                                   std::vector<ferry::Descriptor>{{remote_region, offset, size}});
            s = r.ok() ? r->Wait(timeout + std::chrono::seconds(10)) : r.status();
        }
        auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(ferry::Clock::now() - t0).count();
        if (s.ok()) {
            if (std::memcmp(src, dst, size) != 0) {
                ++corrupt;
                std::printf("corrupt %d size %llu\n", i, static_cast<unsigned long long>(size));
            } else {
                ++ok;
                std::printf("ok %d %lld ms\n", i, static_cast<long long>(ms));
            }
        } else {
            ++failed;
            // Two transfers, each with its own deadline, plus slack for a loaded machine.
            if (ms > 2 * timeout_ms + 2000) ++late;
            std::printf("fail %d %lld ms %s\n", i, static_cast<long long>(ms),
                        s.ToString().c_str());
        }
        std::fflush(stdout);
    }
    std::printf("SUMMARY ok=%d failed=%d corrupt=%d late=%d\n", ok, failed, corrupt, late);
    std::fflush(stdout);
    return 0;
}
