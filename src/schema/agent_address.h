// Where a worker's transfer agent is: its name (vLLM's remote_engine_id, the name it registers
// and proves in its handshake) and its listener. One type for every place that says so: the
// router's view of a prefill worker (router::AgentInfo), an encode worker's ec_transfer_params
// (serve::EcSource), a worker's record in the store (discovery::WorkerRecord) and
// kv_transfer_params' remote_* fields (schema::KvTransferParams::remote_agent).
//
// The schema layer's rules (src/schema/): each message has one typed struct and one codec here;
// a decoder ignores fields it does not know (a newer peer, or a vLLM router that adds its own,
// passes through an older one), refuses a known field of the wrong type or out of range by its
// name, and bounds what it reads; an encoder writes what its decoder reads.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>

#include "core/host_port.h"
#include "ferry/status.h"

namespace ferry::schema {

struct AgentAddress {
    std::string engine_id;  // "" = none
    std::string host;
    int port = 0;

    bool empty() const { return engine_id.empty(); }
    // "host:port", IPv6 in brackets (core/host_port.h).
    std::string HostPort() const { return FormatHostPort(host, port); }
    bool operator==(const AgentAddress&) const = default;
};

// The agent named `engine_id` listening on `listen` ("host:port" as Agent::ListenAddress gives
// it, IPv6 in brackets); a listen address that does not parse leaves the host "" and port 0.
inline AgentAddress AgentAt(std::string engine_id, std::string_view listen) {
    Result<HostPort> hp = ParseHostPort(listen, 0);
    if (!hp.ok()) return {std::move(engine_id), "", 0};
    return {std::move(engine_id), std::move(hp->host), hp->port};
}

// {"engine_id", "host", "port"}: how GET /v1/kv/agent and ec_transfer_params write it (the
// host without brackets).
nlohmann::json AgentAddressJson(const AgentAddress& a);

// The same read back: engine_id (1..256 characters) and port (1..65535) are required; host
// (1..255 characters) too unless `default_host` is given (GET /v1/kv/agent's answer may leave it
// out: the worker's own host). Errors name the field under `path` ("ec_transfer_params.port").
Result<AgentAddress> ParseAgentAddress(const nlohmann::json& j, std::string_view path,
                                       std::string_view default_host = "");

}  // namespace ferry::schema
