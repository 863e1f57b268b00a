// The built-in KV connector's kv_transfer_params: vLLM's NixlConnector fields, field for field,
// plus ferry's own, which a vLLM router copies along unchanged (it copies the whole object from
// the prefill response to the decode request). docs/disaggregation.md has the protocols.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/agent_address.h"
#include "ferry/status.h"
#include "kv/connector.h"

namespace ferry::kv {

enum class KvTransferMode : uint8_t {
    kPull,  // vLLM's NixlConnector protocol: the receiver READs the held blocks
    kPush,  // SGLang / Mooncake style: the sender WRITEs each layer into the receiver's blocks
};

struct KvTransferParams final : ConnectorParams {
    KvTransferMode mode = KvTransferMode::kPull;
    bool do_remote_decode = false;   // this worker prefills; another decodes
    bool do_remote_prefill = false;  // this worker decodes; the prompt's KV is elsewhere
    // Where the other side is (pull: the prefill worker that holds the blocks; push: the
    // prefill worker this decoder sends its block ids to).
    std::string remote_engine_id;  // its agent name
    std::string remote_host;
    int remote_port = 0;  // its agent's listener
    std::vector<BlockId> remote_block_ids;
    std::string remote_request_id;
    int tp_size = 1;
    // ferry: pull, the prefill's sampled token; push, the id both sides were given.
    std::optional<FirstToken> first_token;
    std::string transfer_id;
    // pull: which hold remote_request_id names: 128 random bits (32 hex characters).
    std::string hold_nonce;

    // remote_engine_id, remote_host and remote_port as one (core/agent_address.h).
    AgentAddress remote_agent() const { return {remote_engine_id, remote_host, remote_port}; }
    void set_remote_agent(AgentAddress a) {
        remote_engine_id = std::move(a.engine_id);
        remote_host = std::move(a.host);
        remote_port = a.port;
    }

    bool prefill_only() const override { return do_remote_decode; }
    bool loads_kv() const override { return do_remote_prefill; }
    // vLLM's fields (null-free), "transfer_mode", and ferry's where set.
    nlohmann::json ToJson() const override;
};

// Parses kv_transfer_params (a JSON object; null fields count as absent, as vLLM's proxies send
// them). `default_mode` applies when "transfer_mode" is absent. InvalidArgument naming the field
// ("'kv_transfer_params.remote_port' must be an integer in range"); null when neither
// do_remote_decode nor do_remote_prefill is set.
Result<std::shared_ptr<KvTransferParams>> ParseKvTransferParams(const nlohmann::json& params,
                                                                KvTransferMode default_mode);
// The same from text (a peer's message, a fuzzer's input): nesting past 8 levels and text that
// is not JSON are refused by name first.
Result<std::shared_ptr<KvTransferParams>> ParseKvTransferParamsText(std::string_view json,
                                                                    KvTransferMode default_mode);

// The built-in connector's params behind the seam's type (the connector gets only what its
// ParseParams made, or what a test built as KvTransferParams).
inline const KvTransferParams& AsKvTransferParams(const ConnectorParams& p) {
    return static_cast<const KvTransferParams&>(p);
}

}  // namespace ferry::kv
