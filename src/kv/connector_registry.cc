#include "kv/connector_registry.h"

#include "core/named_registry.h"

namespace ferry::kv {

namespace {

KvConnectorKind BuiltIn() {
    KvConnectorKind k;
    k.name = kDefaultKvConnector;
    k.description =
        "the transfer engine's: pull (vLLM's NixlConnector protocol) and push (layer-wise) over "
        "shm, tcp or ucx";
    k.check_options = [](const nlohmann::json& options) {
        return ParseAgentConnectorOptions(options).status();
    };
    k.parse = [](const nlohmann::json& params,
                 const nlohmann::json& options) -> Result<std::shared_ptr<ConnectorParams>> {
        FERRY_ASSIGN_OR_RETURN(AgentConnectorOptions o, ParseAgentConnectorOptions(options));
        FERRY_ASSIGN_OR_RETURN(std::shared_ptr<KvTransferParams> p,
                               ParseConnectorKvParams(params, o.default_mode));
        return std::shared_ptr<ConnectorParams>(std::move(p));
    };
    k.create = [](const KvConnectorContext& c) -> Result<std::shared_ptr<KvConnector>> {
        FERRY_ASSIGN_OR_RETURN(AgentConnectorConfig config, AgentConnectorConfigOf(c));
        FERRY_ASSIGN_OR_RETURN(std::shared_ptr<AgentKvConnector> conn,
                               AgentKvConnector::Create(c.agent, config));
        return std::shared_ptr<KvConnector>(std::move(conn));
    };
    return k;
}

NamedRegistry<KvConnectorKind>& TheRegistry() {
    static auto* r = [] {
        auto* reg = new NamedRegistry<KvConnectorKind>("kv connector");
        (void)reg->Add(BuiltIn());
        return reg;
    }();
    return *r;
}

}  // namespace

Result<AgentConnectorConfig> AgentConnectorConfigOf(const KvConnectorContext& context) {
    FERRY_ASSIGN_OR_RETURN(AgentConnectorOptions options,
                           ParseAgentConnectorOptions(context.options));
    AgentConnectorConfig c;
    static_cast<AgentConnectorOptions&>(c) = std::move(options);
    c.model_fingerprint = context.model_fingerprint;
    c.model_kv_heads = context.model_kv_heads;
    c.model_tp = context.model_tp;
    c.trust = context.trust;
    return c;
}

Status RegisterKvConnector(KvConnectorKind kind) {
    if (kind.name.empty() || !kind.parse || !kind.create) {
        return InvalidArgumentError("kv connector kinds need a name, parse and create");
    }
    return TheRegistry().Add(std::move(kind));
}

Result<KvConnectorKind> FindKvConnector(std::string_view name) { return TheRegistry().Find(name); }

std::vector<std::string> KvConnectorNames() { return TheRegistry().Names(); }

}  // namespace ferry::kv
