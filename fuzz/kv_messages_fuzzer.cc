// The KV connector's peer messages (src/kv/peer_messages.h): the codec on arbitrary bytes, and
// the same bytes delivered to a bound connector as a peer's message. A message that decodes must
// encode and decode again to the same text; the connector must survive anything (it refuses
// with a log line). The first byte picks which of two peers sent it. The same bytes are also a
// client's kv_transfer_params (kv/kv_transfer_params.h): params that parse must print and parse
// again to the same text; any that do not must say why.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ferry/agent.h"
#include "kv/agent_connector.h"
#include "kv/kv_cache.h"
#include "kv/kv_transfer_params.h"
#include "kv/peer_messages.h"

namespace {

struct Bound {
    std::shared_ptr<ferry::Agent> agent;
    std::unique_ptr<ferry::kv::KvCache> cache;
    std::shared_ptr<ferry::kv::AgentKvConnector> conn;
};

ferry::kv::AgentKvConnector& Connector() {
    static Bound* b = [] {
        auto* w = new Bound;
        ferry::AgentConfig ac;
        ac.name = "fuzz-kv";
        ac.backends = {"tcp"};
        auto agent = ferry::Agent::Create(ac);
        if (!agent.ok()) std::abort();
        w->agent = std::move(*agent);
        ferry::kv::KvCacheSpec spec{2, 2, 8, 16, 32, ferry::kv::KvDtype::kF32};
        auto cache = ferry::kv::KvCache::Create(spec);
        if (!cache.ok()) std::abort();
        w->cache = std::move(*cache);
        ferry::kv::AgentConnectorConfig cc;
        cc.model_fingerprint = "fuzz";
        cc.model_kv_heads = 2;
        cc.connect_threads = 1;
        cc.handshake_timeout = std::chrono::milliseconds(50);
        // A hello is answered by dialing back: only this address, where nothing listens.
        cc.trust.allowed_agents = {"127.0.0.1:1"};
        auto conn = ferry::kv::AgentKvConnector::Create(w->agent, cc);
        if (!conn.ok()) std::abort();
        w->conn = std::move(*conn);
        ferry::kv::KvCache* caches[] = {w->cache.get()};
        if (!w->conn->Bind(caches, [] {}).ok()) std::abort();
        return w;
    }();
    return *b->conn;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    std::string_view payload(reinterpret_cast<const char*>(data) + 1, size - 1);
    std::string type;
    auto m = ferry::kv::msg::Decode(payload, &type);
    if (m.ok()) {
        if (type != ferry::kv::msg::TypeOf(*m)) std::abort();
        std::string once = ferry::kv::msg::Encode(*m);
        auto again = ferry::kv::msg::Decode(once);
        if (!again.ok() || ferry::kv::msg::Encode(*again) != once) std::abort();
    } else if (m.status().message().empty()) {
        std::abort();
    }
    Connector().DeliverForTesting(data[0] % 2 ? "peer-a" : "peer-b", payload);
    auto params = ferry::kv::ParseConnectorKvParamsText(payload, ferry::kv::KvTransferMode::kPull);
    if (params.ok() && *params) {
        const std::string once = (*params)->ToJson().dump();
        auto again = ferry::kv::ParseConnectorKvParamsText(once, ferry::kv::KvTransferMode::kPull);
        if (!again.ok() || !*again || (*again)->ToJson().dump() != once) std::abort();
    } else if (!params.ok() && params.status().message().empty()) {
        std::abort();
    }
    return 0;
}
