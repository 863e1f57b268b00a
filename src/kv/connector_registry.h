// KV connectors by name (`ferry serve --kv-connector NAME`), as vLLM's KVConnectorFactory has
// them: a connector kind is registered once, with how it parses kv_transfer_params and how it is
// created, so that a new kind (an encoder-cache connector, one aware of speculative decoding) is
// added without touching the engine or the server.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/peer_trust.h"
#include "ferry/agent.h"
#include "ferry/status.h"
#include "kv/agent_connector.h"
#include "kv/connector.h"

namespace ferry::kv {

// What a connector is made from: what the worker knows that any kind may need (its transfer
// agent, the model's identity at a KV handshake, which peers it trusts) and the kind's own
// options, a JSON object that only the kind reads (vLLM's kv_connector_extra_config; `ferry serve
// --kv-connector-config`; for the built-in kind also its --kv-* flags, AgentConnectorOptions).
struct KvConnectorContext {
    std::shared_ptr<Agent> agent;  // null for a worker without one
    // The model's weights' fingerprint (and its vision encoder's, for a worker that takes
    // images), its total KV heads and its TP size.
    std::string model_fingerprint;
    int model_kv_heads = 0;
    int model_tp = 0;
    PeerTrust trust = {};
    nlohmann::json options = nlohmann::json::object();
};

struct KvConnectorKind {
    std::string name;
    std::string description;  // one line, for --help
    // Checks the kind's options before anything starts (a worker refuses to start on a bad
    // one, naming it). Optional: a kind without it takes any options.
    std::function<Status(const nlohmann::json& options)> check_options = {};
    // Parses kv_transfer_params as this kind does under its options, with no connector at hand
    // (a worker without one still names a malformed field before it refuses the params). As
    // KvConnector::ParseParams.
    std::function<Result<std::shared_ptr<ConnectorParams>>(const nlohmann::json& params,
                                                           const nlohmann::json& options)>
        parse;
    std::function<Result<std::shared_ptr<KvConnector>>(const KvConnectorContext& context)> create;
};

// The built-in kind's config from a context: its options (ParseAgentConnectorOptions) with the
// context's model and trust. For kinds that wrap the built-in one.
Result<AgentConnectorConfig> AgentConnectorConfigOf(const KvConnectorContext& context);

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
