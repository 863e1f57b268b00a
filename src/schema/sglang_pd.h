// SGLang's PD protocol, as its mini_lb and router speak it (sglang/srt/disaggregation/mini_lb.py):
// the balancer sends the same request to a prefill and a decode worker at once, adding
//   "bootstrap_host": the prefill worker's host (IPv6 in brackets),
//   "bootstrap_port": its bootstrap server's port (null: the decode worker's default, 8998),
//   "bootstrap_room": a random integer in 0..2^63-1 naming this request on both sides,
// each a list with one entry per prompt for a batch. The decode worker asks the prefill worker's
// bootstrap server (GET /route) where its KV comes from, and the two meet under the room. On
// ferry the room becomes a push transfer id (schema/kv_transfer_params.h): the decode worker
// names its blocks and its prompt's digest under it, so a room is not a capability (a target for
// another prompt is refused, kv/push_protocol.h). docs/coming-from.md has the deployment.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ferry/status.h"
#include "schema/agent_address.h"

namespace ferry::schema {

// SGLang's --disaggregation-bootstrap-port default.
inline constexpr int kSglangDefaultBootstrapPort = 8998;

struct SglangBootstrap {
    std::string host;  // bare (brackets of an IPv6 host removed)
    int port = 0;      // 0: none given (the decode worker's default applies)
    uint64_t room = 0;
};

// The bootstrap fields of a request body; nullopt when it carries none (no bootstrap_room, or
// null). `batch` is 0 for one prompt (each field a scalar) or the batch's size (each field a
// scalar given to every prompt, or a list of that many). InvalidArgument naming the field: a
// room outside 0..2^63-1 or not an integer, a host that is empty or over 255 characters, a port
// outside 1..65535, a list of the wrong length.
Result<std::optional<std::vector<SglangBootstrap>>> ParseSglangBootstrap(const nlohmann::json& body,
                                                                         size_t batch);

// The push transfer id a room becomes on both workers.
std::string SglangTransferId(uint64_t room);

// What a prefill worker's bootstrap server says of it.
struct SglangPrefillInfo {
    int tp_size = 1;
    int page_size = 0;  // tokens per KV block
    std::string kv_cache_dtype;
    int http_port = 0;   // its OpenAI / SGLang server
    AgentAddress agent;  // its transfer agent
};

// GET /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1: SGLang's
// PrefillServerInfo fields (attn_tp_size, attn_cp_size, dp_size, pp_size, page_size,
// kv_cache_dtype, follow_bootstrap_room, enable_dsa_cache_layer_split, prefill_http_port) and
// "ferry_agent" {engine_id, host, port}.
nlohmann::json SglangPrefillInfoJson(const SglangPrefillInfo& info);
// GET /route for one rank: SGLang's PrefillRankInfo (rank_ip, rank_port: the agent's listener;
// attn_dp_rank, attn_cp_rank, attn_tp_rank, pp_rank) and "agent_name".
nlohmann::json SglangRankInfoJson(const SglangPrefillInfo& info, int tp_rank);
// The first read back (a decode worker's view of the prefill worker); errors name the field.
Result<SglangPrefillInfo> ParseSglangPrefillInfo(const nlohmann::json& j);

}  // namespace ferry::schema
