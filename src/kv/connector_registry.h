// KV connectors by name (`ferry serve --kv-connector NAME`), as vLLM's KVConnectorFactory has
// them: a connector kind is registered once, with how it parses kv_transfer_params and how it is
// created, so that a new kind (an encoder-cache connector, one aware of speculative decoding) is
// added without touching the engine or the server.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/agent.h"
#include "ferry/status.h"
#include "kv/agent_connector.h"
#include "kv/connector.h"

namespace ferry::kv {

// What a connector is made from: the worker's transfer agent and the connector settings of
// `ferry serve` (trust, timeouts, caps, the default protocol).
struct KvConnectorContext {
    std::shared_ptr<Agent> agent;
    AgentConnectorConfig config;
};

struct KvConnectorKind {
    std::string name;
    std::string description;  // one line, for --help
    // Parses kv_transfer_params as this kind does, with no connector at hand (a worker without
    // one still names a malformed field before it refuses the params). As KvConnector::ParseParams.
    std::function<Result<std::shared_ptr<ConnectorParams>>(const nlohmann::json& params,
                                                           const AgentConnectorConfig& config)>
        parse;
    std::function<Result<std::shared_ptr<KvConnector>>(const KvConnectorContext& context)> create;
};

// The kind every worker uses unless told otherwise: the transfer engine's (AgentKvConnector).
inline constexpr char kDefaultKvConnector[] = "ferry";

// Adds a kind. InvalidArgument without a name, parse or create; AlreadyExists for a known name.
// Thread-safe.
Status RegisterKvConnector(KvConnectorKind kind);
// NotFound naming the known kinds.
Result<KvConnectorKind> FindKvConnector(std::string_view name);
// The registered names, sorted.
std::vector<std::string> KvConnectorNames();

}  // namespace ferry::kv
