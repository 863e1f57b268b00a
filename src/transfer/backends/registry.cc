// The one place the agent learns which backends exist.
#include "transfer/backend.h"
#include "transfer/backends/shm/shm_backend.h"
#include "transfer/backends/tcp/tcp_backend.h"

namespace ferry {

Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, const AgentConfig& config,
                                               const std::string& host_id) {
    if (name == "tcp") return std::unique_ptr<Backend>(new TcpBackend(config));
    if (name == "shm") return std::unique_ptr<Backend>(new ShmBackend(config, host_id));
    return NotFoundError("unknown backend '" + std::string(name) + "' (known: shm, tcp)");
}

std::vector<std::string> KnownBackends() { return {"shm", "tcp"}; }

}  // namespace ferry
