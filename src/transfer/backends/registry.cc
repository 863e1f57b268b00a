// The one place the agent learns which backends exist.
#include "transfer/backend.h"
#include "transfer/backends/shm/shm_backend.h"
#include "transfer/backends/tcp/tcp_backend.h"
#ifdef FERRY_HAVE_UCX
#include "transfer/backends/ucx/ucx_backend.h"
#endif

namespace ferry {

Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, const AgentConfig& config,
                                               const std::string& host_id) {
    if (name == "tcp") return std::unique_ptr<Backend>(new TcpBackend(config));
    if (name == "shm") return std::unique_ptr<Backend>(new ShmBackend(config, host_id));
#ifdef FERRY_HAVE_UCX
    if (name == "ucx") return std::unique_ptr<Backend>(new UcxBackend(config));
#endif
    std::string known;
    for (const std::string& k : KnownBackends()) known += (known.empty() ? "" : ", ") + k;
    return NotFoundError("unknown backend '" + std::string(name) +
                         "' (known in this build: " + known + ")");
}

std::vector<std::string> KnownBackends() {
#ifdef FERRY_HAVE_UCX
    return {"shm", "tcp", "ucx"};
#else
    return {"shm", "tcp"};
#endif
}

}  // namespace ferry
