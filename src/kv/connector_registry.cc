#include "kv/connector_registry.h"

#include <fmt/core.h>

#include <map>
#include <mutex>

namespace ferry::kv {

namespace {

struct Registry {
    std::mutex mu;
    std::map<std::string, KvConnectorKind, std::less<>> kinds;
};

KvConnectorKind BuiltIn() {
    KvConnectorKind k;
    k.name = kDefaultKvConnector;
    k.description =
        "the transfer engine's: pull (vLLM's NixlConnector protocol) and push (layer-wise) over "
        "shm, tcp or ucx";
    k.parse = [](const nlohmann::json& params,
                 const AgentConnectorConfig& config) -> Result<std::shared_ptr<ConnectorParams>> {
        FERRY_ASSIGN_OR_RETURN(std::shared_ptr<KvTransferParams> p,
                               ParseKvTransferParams(params, config.default_mode));
        return std::shared_ptr<ConnectorParams>(std::move(p));
    };
    k.create = [](const KvConnectorContext& c) -> Result<std::shared_ptr<KvConnector>> {
        FERRY_ASSIGN_OR_RETURN(std::shared_ptr<AgentKvConnector> conn,
                               AgentKvConnector::Create(c.agent, c.config));
        return std::shared_ptr<KvConnector>(std::move(conn));
    };
    return k;
}

Registry& TheRegistry() {
    static Registry* r = [] {
        auto* reg = new Registry();
        KvConnectorKind k = BuiltIn();
        reg->kinds.emplace(k.name, std::move(k));
        return reg;
    }();
    return *r;
}

std::string Names(const Registry& r) {
    std::string out;
    for (const auto& [name, k] : r.kinds) out += (out.empty() ? "" : ", ") + name;
    return out;
}

}  // namespace

Status RegisterKvConnector(KvConnectorKind kind) {
    if (kind.name.empty() || !kind.parse || !kind.create) {
        return InvalidArgumentError("kv connector kinds need a name, parse and create");
    }
    Registry& r = TheRegistry();
    std::lock_guard lock(r.mu);
    if (r.kinds.count(kind.name)) {
        return AlreadyExistsError(fmt::format("kv connector '{}' is registered", kind.name));
    }
    std::string name = kind.name;
    r.kinds.emplace(std::move(name), std::move(kind));
    return Status::Ok();
}

Result<KvConnectorKind> FindKvConnector(std::string_view name) {
    Registry& r = TheRegistry();
    std::lock_guard lock(r.mu);
    auto it = r.kinds.find(name);
    if (it == r.kinds.end()) {
        return NotFoundError(fmt::format("kv connector '{}' is not one of: {}", name, Names(r)));
    }
    return it->second;
}

std::vector<std::string> KvConnectorNames() {
    Registry& r = TheRegistry();
    std::lock_guard lock(r.mu);
    std::vector<std::string> out;
    for (const auto& [name, k] : r.kinds) out.push_back(name);
    return out;
}

}  // namespace ferry::kv
