// ferry_soak: transfers among several agent processes while agents are killed and restarted.
//
// The orchestrator (default role) starts an embedded discovery store and --agents agent
// processes (this binary, --role agent). Each agent owns one region with a slice for every other
// agent, finds its peers by name in the store, and loops: pick a peer, a size (4 KiB-1 MiB) and
// an operation mix, WRITE a fresh pattern (with a header: writer, counter, checksum) into its
// slice on the peer, READ it back, and classify the result:
//   completed  the bytes came back exactly;
//   failed     a transfer failed with an error (the peer died, restarted or was slow);
//   lost       the read-back found a fresh (zeroed) slice: the peer restarted in between;
//   corrupted  anything else (must be 0).
// Every --kill-every-ms the orchestrator SIGKILLs a random agent and starts it again under the
// same name. At the end every agent stops, drops its peers, waits for its connections to close,
// and reports its leaks: registered regions beyond its own, open file descriptors beyond those
// it had before it met any peer, transfers still pending. The orchestrator prints the totals and
// every agent's peak RSS, and exits 1 on any corruption or leak.
//
//   ferry_soak --transfers 1000000          the nightly run (`make soak`)
//   ferry_soak --duration-s 20              the short run in CI
#include <fmt/core.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ferry/agent.h"
#include "ferry/discovery.h"
#include "testing/process.h"
#include "testing/testing.h"

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr uint64_t kSlice = 1u << 20;
constexpr uint64_t kHeader = 24;  // u64 writer, u64 counter, u64 checksum

uint64_t Mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

void Fill(uint8_t* p, uint64_t n, uint64_t writer, uint64_t counter) {
    uint64_t sum = 0;
    for (uint64_t i = kHeader; i < n; ++i) {
        p[i] = static_cast<uint8_t>(Mix(counter * 1315423911u + i) >> 11);
        sum = sum * 31 + p[i];
    }
    std::memcpy(p, &writer, 8);
    std::memcpy(p + 8, &counter, 8);
    std::memcpy(p + 16, &sum, 8);
}

// Open file descriptors and what each is, not counting connections to the discovery store (its
// watch is a long poll on a fresh connection each time, so their number changes from moment to
// moment) nor UCX's async timer (its async thread opens one timerfd for the whole process when
// the first endpoint with keepalive appears, and keeps it until exit; ferry opens no timerfd).
std::map<int, std::string> OpenFds(uint16_t store_port) {
    std::map<int, std::string> fds;
    for (ferry::testing::OpenFd& f : ferry::testing::OpenFds()) {
        if (f.peer_port == store_port || f.what == "anon_inode:[timerfd]") continue;
        fds[f.fd] = std::move(f.what);
    }
    return fds;
}

// --- agent ------------------------------------------------------------------------------------

int RunAgent(int index, int agents, const std::string& store, uint64_t seed,
             const std::string& backend) {
    ferry::AgentConfig config;
    config.name = "soak-" + std::to_string(index);
    config.store = store;
    config.store_ttl = milliseconds(2000);
    config.default_timeout = seconds(5);
    if (backend != "auto") config.backends = {backend};
    auto agent = ferry::Agent::Create(config);
    if (!agent.ok()) {
        fmt::print(stderr, "soak agent {}: {}\n", index, agent.status().ToString());
        return 1;
    }
    auto region = (*agent)->AllocateRegion(kSlice * agents);  // slice i: written by agent i
    auto scratch = (*agent)->AllocateRegion(2 * kSlice);      // [out | back]
    if (!region.ok() || !scratch.ok()) return 1;
    const uint16_t store_port = ferry::testing::PortAfter(store);
    const std::map<int, std::string> fds_at_start = OpenFds(store_port);
    const int fds_before = static_cast<int>(fds_at_start.size());
    fmt::print("READY {}\n", fds_before);
    std::fflush(stdout);

    std::atomic<bool> stop{false};
    std::thread stdin_watch([&] {
        char c;
        while (read(0, &c, 1) > 0) {
        }
        stop = true;
    });
    std::mt19937_64 rng(seed);
    auto* out = static_cast<uint8_t*>(scratch->base);
    auto* back = out + kSlice;
    uint64_t completed = 0, failed = 0, lost = 0, corrupted = 0, counter = 0;
    std::vector<std::string> connected(agents);
    auto last_report = Clock::now();
    while (!stop) {
        int p = static_cast<int>(rng() % agents);
        if (p == index) continue;
        std::string name = "soak-" + std::to_string(p);
        if (connected[p].empty()) {
            auto c = (*agent)->ConnectByName(name);
            if (!c.ok()) {
                std::this_thread::sleep_for(milliseconds(20));
                continue;
            }
            connected[p] = *c;
        }
        // The peer's region id: the first region it registered.
        uint64_t size = kHeader + (4096u << (rng() % 9));  // 4 KiB .. 1 MiB (+ header)
        size = std::min(size, kSlice);
        Fill(out, size, index, ++counter);
        std::memset(back, 0xA5, size);
        const ferry::RegionId remote = 1;
        const uint64_t at = kSlice * index;
        auto w = (*agent)->PostWrite(std::vector<ferry::Descriptor>{{scratch->id, 0, size}}, name,
                                     std::vector<ferry::Descriptor>{{remote, at, size}});
        ferry::Status s = w.ok() ? w->Wait(seconds(30)) : w.status();
        if (s.ok()) {
            auto r = (*agent)->PostRead(std::vector<ferry::Descriptor>{{scratch->id, kSlice, size}},
                                        name, std::vector<ferry::Descriptor>{{remote, at, size}});
            s = r.ok() ? r->Wait(seconds(30)) : r.status();
        }
        if (!s.ok()) {
            ++failed;
            if (s.code() == ferry::Code::kUnavailable || s.code() == ferry::Code::kNotFound) {
                (void)(*agent)->RemovePeer(name);
                connected[p].clear();  // find it again (it may have restarted)
            }
        } else if (std::memcmp(out, back, size) == 0) {
            ++completed;
        } else {
            bool zero = true;
            for (uint64_t i = 0; i < size && zero; ++i) zero = back[i] == 0;
            if (zero) {
                ++lost;  // a new process of the peer: a fresh region
            } else {
                ++corrupted;
                fmt::print(stderr, "soak agent {}: corrupted read-back from {} ({} bytes)\n", index,
                           name, size);
            }
        }
        if (Clock::now() - last_report > milliseconds(500)) {
            fmt::print("STATS {} {} {} {}\n", completed, failed, lost, corrupted);
            std::fflush(stdout);
            last_report = Clock::now();
        }
    }
    stdin_watch.join();
    // Quiesce: drop every peer and give their connections (both ways) time to close.
    for (int p = 0; p < agents; ++p) {
        if (!connected[p].empty()) (void)(*agent)->RemovePeer(connected[p]);
    }
    // Connections close asynchronously (and slowly under a sanitizer): wait up to 15 s.
    std::map<int, std::string> open = OpenFds(store_port);
    for (auto end = Clock::now() + seconds(15);
         static_cast<int>(open.size()) > fds_before && Clock::now() < end;) {
        std::this_thread::sleep_for(milliseconds(100));
        open = OpenFds(store_port);
    }
    const int fds = static_cast<int>(open.size());
    if (fds > fds_before) {  // name what was left open, for whoever chases the leak
        for (const auto& [fd, what] : open) {
            auto was = fds_at_start.find(fd);
            if (was == fds_at_start.end() || was->second != what) {
                fmt::print(stderr, "soak agent {}: fd {} still open: {}\n", index, fd, what);
            }
        }
    }
    int regions = static_cast<int>((*agent)->Regions().size());
    fmt::print("FINAL {} {} {} {} regions={} fds={} fds_before={}\n", completed, failed, lost,
               corrupted, regions, fds, fds_before);
    std::fflush(stdout);
    return 0;
}

// --- orchestrator -----------------------------------------------------------------------------

struct Running {
    ferry::testing::ChildProcess process;
    uint64_t completed = 0, failed = 0, lost = 0, corrupted = 0;
};

long PeakRssKb(pid_t pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"ferry soak: transfers among agent processes that are killed and restarted"};
    std::string role = "orchestrator", store, backend = "auto";
    int agents = 3, index = 0;
    uint64_t seed = 1, transfers = 0;
    double duration_s = 20;
    int kill_every_ms = 3000;
    app.add_option("--role", role)->check(CLI::IsMember({"orchestrator", "agent"}));
    app.add_option("--agents", agents, "agent processes (3+)")->check(CLI::Range(3, 64));
    app.add_option("--index", index);
    app.add_option("--store", store);
    app.add_option("--seed", seed);
    app.add_option("--backend", backend, "auto (shm on one host), tcp, shm, ucx");
    app.add_option("--transfers", transfers, "stop after this many completed (0: --duration-s)");
    app.add_option("--duration-s", duration_s, "run this long when --transfers is 0");
    app.add_option("--kill-every-ms", kill_every_ms, "kill and restart a random agent (0: never)");
    CLI11_PARSE(app, argc, argv);
    if (role == "agent") return RunAgent(index, agents, store, seed, backend);

    ferry::StoreServerConfig sc;
    auto server = ferry::StoreServer::Start(sc);
    if (!server.ok()) {
        fmt::print(stderr, "soak: {}\n", server.status().ToString());
        return 1;
    }
    const std::string self = "/proc/self/exe";
    char exe[4096] = {0};
    if (readlink(self.c_str(), exe, sizeof exe - 1) <= 0) return 1;
    auto start = [&](int i, uint64_t s) {
        std::string line;
        return ferry::testing::ChildProcess::Start(
            {exe, "--role", "agent", "--index", std::to_string(i), "--agents",
             std::to_string(agents), "--store", (*server)->url(), "--seed", std::to_string(s),
             "--backend", backend},
            "READY", &line, seconds(60));
    };
    std::vector<Running> running(agents);
    for (int i = 0; i < agents; ++i) {
        auto p = start(i, seed * 100 + i);
        if (!p.ok()) {
            fmt::print(stderr, "soak: start agent {}: {}\n", i, p.status().ToString());
            return 1;
        }
        running[i].process = std::move(*p);
    }
    // Totals of agent processes that were killed (their last STATS line).
    uint64_t done_completed = 0, done_failed = 0, done_lost = 0, done_corrupted = 0;
    auto poll_stats = [&](Running& r) {
        std::vector<std::string> lines;
        (void)r.process.ReadLine("\x01", milliseconds(1), &lines);  // drain what is there
        for (const auto& l : lines) {
            std::istringstream in(l);
            std::string tag;
            in >> tag;
            if (tag == "STATS") in >> r.completed >> r.failed >> r.lost >> r.corrupted;
        }
    };
    std::mt19937_64 rng(seed);
    auto t0 = Clock::now(), next_kill = t0 + milliseconds(kill_every_ms);
    int kills = 0;
    for (;;) {
        uint64_t total = done_completed;
        for (auto& r : running) {
            poll_stats(r);
            total += r.completed;
        }
        bool finished = transfers > 0
                            ? total >= transfers
                            : Clock::now() - t0 > std::chrono::duration<double>(duration_s);
        if (finished) break;
        if (kill_every_ms > 0 && Clock::now() >= next_kill) {
            int victim = static_cast<int>(rng() % agents);
            Running& r = running[victim];
            poll_stats(r);
            done_completed += r.completed;
            done_failed += r.failed;
            done_lost += r.lost;
            done_corrupted += r.corrupted;
            r.process.Kill();
            r = Running{};
            auto p = start(victim, seed * 100 + victim + 1000 * (++kills));
            if (!p.ok()) {
                fmt::print(stderr, "soak: restart agent {}: {}\n", victim, p.status().ToString());
                return 1;
            }
            r.process = std::move(*p);
            next_kill = Clock::now() + milliseconds(kill_every_ms);
        }
        std::this_thread::sleep_for(milliseconds(100));
    }
    // Stop everyone at once (stdin closes), then collect the final lines.
    uint64_t completed = done_completed, failed = done_failed, lost = done_lost,
             corrupted = done_corrupted;
    int leaks = 0;
    long peak_rss = 0;
    std::vector<std::string> finals(agents);
    for (int i = 0; i < agents; ++i) {
        peak_rss = std::max(peak_rss, PeakRssKb(running[i].process.pid()));
        running[i].process.CloseStdin();
    }
    for (int i = 0; i < agents; ++i) {
        auto line = running[i].process.ReadLine("FINAL", seconds(60));
        if (!line.ok()) {
            fmt::print(stderr, "soak: agent {} did not finish: {}\n", i, line.status().ToString());
            ++leaks;
            continue;
        }
        std::istringstream in(line->substr(6));
        uint64_t c = 0, f = 0, l = 0, x = 0;
        in >> c >> f >> l >> x;
        completed += c;
        failed += f;
        lost += l;
        corrupted += x;
        int regions = 0, fds = 0, fds_before = 0;
        std::sscanf(line->c_str(), "%*s %*s %*s %*s %*s regions=%d fds=%d fds_before=%d", &regions,
                    &fds, &fds_before);
        if (regions != 2 || fds > fds_before) {
            ++leaks;
            fmt::print(stderr,
                       "soak: agent {} leaked: {} regions (2 expected), {} fds ({} before)\n", i,
                       regions, fds, fds_before);
        }
        finals[i] = *line;
    }
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    fmt::print("ferry soak: {} agents ({} backend), {:.1f} s, {} kills/restarts\n", agents, backend,
               secs, kills);
    fmt::print("  completed  {:>10}   ({:.0f}/s)\n", completed, completed / secs);
    fmt::print("  failed     {:>10}   (with an error: peer killed, restarting or slow)\n", failed);
    fmt::print("  lost       {:>10}   (read back a restarted peer's fresh region)\n", lost);
    fmt::print("  corrupted  {:>10}   (must be 0)\n", corrupted);
    fmt::print("  leaks      {:>10}   (regions, fds or agents that did not finish; must be 0)\n",
               leaks);
    fmt::print("  peak RSS   {:>10} KiB (largest agent)\n", peak_rss);
    return corrupted == 0 && leaks == 0 ? 0 : 1;
}
