#include "transfer/backends/shm/shm_backend.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "core/cpu.h"
#include "core/crypto.h"

namespace ferry {

namespace {

constexpr std::string_view kSeparator = "|";

sockaddr_un AbstractAddress(std::string_view name, socklen_t* len) {
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    size_t n = std::min(name.size(), sizeof(sa.sun_path) - 1);
    sa.sun_path[0] = '\0';  // abstract namespace: no file, gone with the process
    std::memcpy(sa.sun_path + 1, name.data(), n);
    *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
    return sa;
}

}  // namespace

ShmBackend::ShmBackend(const AgentConfig& config, std::string host_id)
    : host_id_(std::move(host_id)),
      streams_(config.shm_streams > 0 ? std::min(config.shm_streams, 16)
                                      : std::clamp(UsableCores(), 1, 4)),
      one_sided_(config.shm_map_peer_regions) {}

Result<std::string> ShmBackend::Listen(ScopedFd* listener) {
    char name[64];
    std::snprintf(name, sizeof(name), "ferry-%d-%016llx", static_cast<int>(getpid()),
                  static_cast<unsigned long long>(SecureRandomU64()));
    socklen_t len = 0;
    sockaddr_un sa = AbstractAddress(name, &len);
    ScopedFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid() || bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), len) != 0 ||
        listen(fd.get(), 512) != 0) {
        return UnavailableError(std::string("shm: listen on @") + name + ": " +
                                std::strerror(errno));
    }
    *listener = std::move(fd);
    return host_id_ + std::string(kSeparator) + name;
}

bool ShmBackend::CanReach(const AgentMetadata& self, const AgentMetadata& peer) const {
    const EndpointInfo* e = peer.FindEndpoint("shm");
    return e != nullptr && !self.host_id.empty() && peer.host_id == self.host_id &&
           e->address.rfind(self.host_id + std::string(kSeparator), 0) == 0;
}

Result<ScopedFd> ShmBackend::Dial(std::string_view address, bool* in_progress) const {
    size_t sep = address.rfind(kSeparator);
    if (sep == std::string_view::npos) {
        return InvalidArgumentError("shm: malformed endpoint '" + std::string(address) + "'");
    }
    std::string_view name = address.substr(sep + 1);
    socklen_t len = 0;
    sockaddr_un sa = AbstractAddress(name, &len);
    ScopedFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) {
        return UnavailableError(std::string("shm: socket: ") + std::strerror(errno));
    }
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), len) == 0) {
        *in_progress = false;
    } else if (errno == EINPROGRESS) {
        *in_progress = true;
    } else {
        return UnavailableError("shm: connect @" + std::string(name) + ": " + std::strerror(errno));
    }
    return fd;
}

BackendCapabilities ShmBackend::capabilities() const {
    BackendCapabilities c;
    c.data_path = DataPath::kStream;
    c.locality = Locality::kSameHost;
    c.one_sided = one_sided_;
    return c;
}

std::unique_ptr<Backend> MakeShmBackend(const BackendContext& ctx) {
    return std::make_unique<ShmBackend>(ctx.config, ctx.host_id);
}

}  // namespace ferry
