// kv_transfer_params, the object a request carries between a router and its prefill and decode
// workers: vLLM's NixlConnector fields, field for field, plus ferry's own, which a vLLM router
// copies along unchanged (it copies the whole object from the prefill response to the decode
// request). Both ends are here: what a worker reads and answers (kv::KvTransferParams adds the
// KV connector's seam to this struct) and what a router writes into the requests it sends.
// docs/disaggregation.md has the protocols; schema/agent_address.h the layer's rules.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/status.h"
#include "schema/agent_address.h"

namespace ferry::schema {

enum class KvTransferMode : uint8_t {
    kPull,  // vLLM's NixlConnector protocol: the receiver READs the held blocks
    kPush,  // SGLang / Mooncake style: the sender WRITEs each layer into the receiver's blocks
};

// The first token the sending side sampled, and its log-probabilities: the receiver continues
// from it instead of recomputing the last prompt token.
struct FirstToken {
    int32_t token = 0;
    float logprob = 0;
    std::vector<std::pair<int32_t, float>> top;
};

struct KvTransferParams {
    KvTransferMode mode = KvTransferMode::kPull;
    bool do_remote_decode = false;   // this worker prefills; another decodes
    bool do_remote_prefill = false;  // this worker decodes; the prompt's KV is elsewhere
    // Where the other side is (pull: the prefill worker that holds the blocks; push: the
    // prefill worker this decoder sends its block ids to).
    std::string remote_engine_id;  // its agent name
    std::string remote_host;
    int remote_port = 0;  // its agent's listener
    std::vector<int32_t> remote_block_ids;
    std::string remote_request_id;
    int tp_size = 1;
    // ferry: pull, the prefill's sampled token; push, the id both sides were given.
    std::optional<FirstToken> first_token;
    std::string transfer_id;
    // pull: which hold remote_request_id names: 128 random bits (32 hex characters).
    std::string hold_nonce;

    // remote_engine_id, remote_host and remote_port as one.
    AgentAddress remote_agent() const { return {remote_engine_id, remote_host, remote_port}; }
    void set_remote_agent(AgentAddress a) {
        remote_engine_id = std::move(a.engine_id);
        remote_host = std::move(a.host);
        remote_port = a.port;
    }
};

// vLLM's fields (null-free), "transfer_mode", and ferry's where set ("transfer_id",
// "ferry_hold_nonce", "ferry_first_token").
nlohmann::json KvTransferParamsJson(const KvTransferParams& p);

// Parses kv_transfer_params (a JSON object; null fields count as absent, as vLLM's proxies send
// them). `default_mode` applies when "transfer_mode" is absent. InvalidArgument naming the field
// ("'kv_transfer_params.remote_port' must be an integer in range"), and for a pull decode
// request without the prefill's hold nonce or one that sets both do_remote_* flags.
Result<KvTransferParams> ParseKvTransferParams(const nlohmann::json& params,
                                               KvTransferMode default_mode);
// The same from text (a peer's message, a fuzzer's input): nesting past 8 levels and text that
// is not JSON are refused by name first.
Result<KvTransferParams> ParseKvTransferParamsText(std::string_view json,
                                                   KvTransferMode default_mode);

// What a router writes into the requests it sends (docs/disaggregation.md):
// pull, to the prefill worker: vLLM's proxy's object as it writes it (the remote_* fields null;
// the prefill worker fills them in its answer).
nlohmann::json PullPrefillRequestParams();
// push, to the prefill worker: write the KV to whichever decoder names `transfer_id`.
nlohmann::json PushPrefillRequestParams(const std::string& transfer_id);
// push, to the decode worker: name your blocks to the prefill worker's agent under
// `transfer_id` (its TP size: how its blocks are split).
nlohmann::json PushDecodeRequestParams(const std::string& transfer_id,
                                       const AgentAddress& prefill_agent, int tp_size);

}  // namespace ferry::schema
