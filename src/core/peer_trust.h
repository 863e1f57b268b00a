// Which transfer agents a worker dials, and whether what arrives from them may be shared
// (docs/security.md): one setting for the KV connector (kv::AgentConnectorConfig) and the
// encoder-cache connector (serve::EcConnectorConfig), made once by the worker assembly.
#pragma once

#include <string>
#include <vector>

namespace ferry {

struct PeerTrust {
    // The peers are the deployment's when the agent has the deployment secret (`authenticated`:
    // every peer proved it in the agent handshake), when peers are found by name in the
    // deployment's store (`by_store`: an address in params is not used), or when only the
    // `allowed_agents` ("host:port") are dialed. With none of these (vLLM's open behaviour) any
    // address the params name is dialed, and what arrives from it serves its own request only:
    // it never enters a cache other requests read.
    bool authenticated = false;
    bool by_store = false;
    std::vector<std::string> allowed_agents = {};

    // Whether what arrives may be cached for other requests.
    bool deployment_only() const { return authenticated || by_store || !allowed_agents.empty(); }
    // Whether `address` ("host:port") is one of allowed_agents.
    bool Listed(const std::string& address) const {
        for (const std::string& a : allowed_agents) {
            if (a == address) return true;
        }
        return false;
    }
};

}  // namespace ferry
