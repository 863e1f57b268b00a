// ferry_impair_bridge: a userspace netem for the fault-injection tests (this kernel has no
// sch_netem). Runs in a "router" network namespace between two veth ends, forwards every
// Ethernet frame from one to the other through AF_PACKET sockets, and on the way delays (with
// jitter), drops and reorders them, or drops everything (a cut link). PACKET_VNET_HDR keeps the
// kernel's segmentation offload working: a 64 KiB TCP super-frame is forwarded as one and cut
// into packets on the way out, so loss and reordering hit whole bursts, as on a real NIC.
//
//   ferry_impair_bridge IF_A IF_B     prints "READY", then reads settings from stdin, one line
//                                     each: "delay_ms jitter_ms loss reorder cut", e.g.
//                                     "20 5 0.02 0.1 0"; EOF ends it.
#include <arpa/inet.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <queue>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// struct virtio_net_hdr (linux/virtio_net.h is not valid C++): what PACKET_VNET_HDR puts before
// every frame. Forwarded as it came.
constexpr size_t kVnetHdrLen = 10;

int OpenPort(const char* ifname) {
    int fd = socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL));
    if (fd < 0) {
        std::perror("impair: socket(AF_PACKET)");
        return -1;
    }
    int one = 1;
    if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) != 0) {
        std::perror("impair: PACKET_VNET_HDR");
        return -1;
    }
    sockaddr_ll addr{};
    addr.sll_family = AF_PACKET;
    addr.sll_protocol = htons(ETH_P_ALL);
    addr.sll_ifindex = static_cast<int>(if_nametoindex(ifname));
    if (addr.sll_ifindex == 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        std::fprintf(stderr, "impair: cannot bind to %s: %s\n", ifname, std::strerror(errno));
        return -1;
    }
    packet_mreq mr{};
    mr.mr_ifindex = addr.sll_ifindex;
    mr.mr_type = PACKET_MR_PROMISC;
    setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mr, sizeof mr);
    return fd;
}

struct Settings {
    double delay_ms = 0, jitter_ms = 0, loss = 0, reorder = 0;
    bool cut = false;
};

struct Held {
    Clock::time_point due;
    uint64_t seq;
    int out;
    std::string frame;  // vnet header + Ethernet frame
    bool operator>(const Held& o) const { return due != o.due ? due > o.due : seq > o.seq; }
};

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: ferry_impair_bridge IF_A IF_B\n");
        return 2;
    }
    int ports[2] = {OpenPort(argv[1]), OpenPort(argv[2])};
    if (ports[0] < 0 || ports[1] < 0) return 1;
    std::printf("READY\n");
    std::fflush(stdout);

    Settings s;
    std::mt19937_64 rng(42);
    std::uniform_real_distribution<double> uni(0, 1);
    std::priority_queue<Held, std::vector<Held>, std::greater<>> held;
    uint64_t seq = 0;
    std::vector<char> buf(kVnetHdrLen + 70000);
    std::string line;
    for (;;) {
        int timeout = -1;
        if (!held.empty()) {
            auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(held.top().due -
                                                                              Clock::now());
            timeout = std::max<int>(0, static_cast<int>(wait.count()));
        }
        pollfd p[3] = {{ports[0], POLLIN, 0}, {ports[1], POLLIN, 0}, {0, POLLIN, 0}};
        poll(p, 3, timeout);
        if (p[2].revents & (POLLIN | POLLHUP)) {
            char c[256];
            ssize_t n = read(0, c, sizeof c);
            if (n <= 0) return 0;
            line.append(c, static_cast<size_t>(n));
            size_t nl;
            while ((nl = line.find('\n')) != std::string::npos) {
                std::istringstream in(line.substr(0, nl));
                line.erase(0, nl + 1);
                Settings next;
                int cut = 0;
                if (in >> next.delay_ms >> next.jitter_ms >> next.loss >> next.reorder >> cut) {
                    next.cut = cut != 0;
                    s = next;
                    if (s.cut) held = {};  // frames on the wire are lost with the link
                    std::printf("SET\n");
                    std::fflush(stdout);
                }
            }
        }
        for (int i = 0; i < 2; ++i) {
            if (!(p[i].revents & POLLIN)) continue;
            for (;;) {
                sockaddr_ll from{};
                socklen_t fl = sizeof from;
                ssize_t n = recvfrom(ports[i], buf.data(), buf.size(), MSG_DONTWAIT,
                                     reinterpret_cast<sockaddr*>(&from), &fl);
                if (n <= 0) break;
                if (from.sll_pkttype == PACKET_OUTGOING) continue;  // our own sends
                if (s.cut || uni(rng) < s.loss) continue;
                double ms = s.delay_ms + (s.jitter_ms > 0 ? (uni(rng) * 2 - 1) * s.jitter_ms : 0);
                if (uni(rng) < s.reorder) ms += std::max(1.0, s.delay_ms);  // overtaken by later
                auto due = Clock::now() + std::chrono::microseconds(
                                              static_cast<int64_t>(std::max(0.0, ms) * 1000));
                held.push(Held{due, seq++, ports[1 - i], std::string(buf.data(), n)});
            }
        }
        auto now = Clock::now();
        while (!held.empty() && held.top().due <= now) {
            const Held& h = held.top();
            if (send(h.out, h.frame.data(), h.frame.size(), 0) < 0 && errno != ENOBUFS) {
                std::fprintf(stderr, "impair: send: %s\n", std::strerror(errno));
            }
            held.pop();
        }
    }
}
