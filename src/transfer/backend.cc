#include "transfer/backend.h"

#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <tuple>

#include "core/host_port.h"
#include "transfer/transfer_op.h"

namespace ferry {

std::string MemoryKindName(MemoryKind k) {
    switch (k) {
        case MemoryKind::kHost:
            return "host";
        case MemoryKind::kFile:
            return "file";
        case MemoryKind::kCuda:
            return "cuda";
    }
    return "kind " + std::to_string(static_cast<int>(k));
}

std::vector<std::string> RankBackends(
    std::vector<std::pair<std::string, BackendCapabilities>> backends) {
    auto key = [](const std::pair<std::string, BackendCapabilities>& b) {
        const BackendCapabilities& c = b.second;
        return std::make_tuple(c.locality != Locality::kSameHost, c.data_path != DataPath::kOwn,
                               !c.one_sided, std::string_view(b.first));
    };
    std::stable_sort(backends.begin(), backends.end(),
                     [&](const auto& a, const auto& b) { return key(a) < key(b); });
    std::vector<std::string> names;
    for (auto& b : backends) names.push_back(std::move(b.first));
    return names;
}

Result<ScopedFd> Backend::Dial(std::string_view address, bool* in_progress) const {
    (void)address;
    (void)in_progress;
    return UnimplementedError("backend " + std::string(name()) + " has no sockets to dial");
}

void Backend::Post(const std::shared_ptr<internal::TransferOp>& op, const PeerRef& peer, bool write,
                   std::vector<Chunk> chunks, bool all_host) {
    (void)peer;
    (void)write;
    (void)all_host;
    Status s = UnimplementedError("backend " + std::string(name()) + " moves no bytes itself");
    for (size_t i = 0; i < chunks.size(); ++i) op->ChunkDone(s);
}

Status Backend::Notify(const PeerRef& peer, std::string payload, std::string sender) {
    (void)peer;
    (void)payload;
    (void)sender;
    return UnimplementedError("backend " + std::string(name()) + " sends no notifications itself");
}

void Backend::Pull(const std::shared_ptr<internal::TransferOp>& op, const PeerRef& peer,
                   std::string key, std::vector<iovec> local, uint64_t capacity) {
    (void)peer;
    (void)key;
    (void)local;
    (void)capacity;
    op->ChunkDone(UnimplementedError("backend " + std::string(name()) + " pulls nothing itself"));
}

Result<std::unique_ptr<SelfTransfer>> Backend::PlanSelf(bool write,
                                                        std::span<const Descriptor> local,
                                                        std::span<const Descriptor> remote) {
    (void)write;
    (void)local;
    (void)remote;
    return UnimplementedError("backend " + std::string(name()) +
                              " moves no bytes between an agent's own regions");
}

void Backend::StartSelf(const std::shared_ptr<internal::TransferOp>& op,
                        std::unique_ptr<SelfTransfer> plan) {
    (void)plan;
    op->Arm(1, {}, nullptr);
    op->ChunkDone(UnimplementedError("backend " + std::string(name()) +
                                     " moves no bytes between an agent's own regions"));
}

std::string LocalHostId() {
    std::string boot;
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::getline(in, boot);
    auto ns = [](const char* path) -> std::string {
        struct stat st {};
        if (stat(path, &st) != 0) {
            return "?";
        }
        return std::to_string(st.st_ino);
    };
    return boot + "/net:" + ns("/proc/self/ns/net") + "/pid:" + ns("/proc/self/ns/pid");
}

Status SplitHostPort(std::string_view address, std::string* host, uint16_t* port) {
    FERRY_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address, 0));
    *host = std::move(hp.host);
    *port = hp.port;
    return Status::Ok();
}

}  // namespace ferry
