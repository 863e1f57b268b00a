// Where a worker's transfer agent is: its name (vLLM's remote_engine_id, the name it registers
// and proves in its handshake) and its listener. One type for every place that says so: the
// router's view of a prefill worker (router::AgentInfo), an encode worker's ec_transfer_params
// (serve::EcSource), a worker's record in the store (discovery::WorkerRecord) and
// kv_transfer_params' remote_* fields (kv::KvTransferParams::remote_agent).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>

#include "core/host_port.h"

namespace ferry {

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
inline nlohmann::json AgentAddressJson(const AgentAddress& a) {
    return {{"engine_id", a.engine_id}, {"host", a.host}, {"port", a.port}};
}

}  // namespace ferry
