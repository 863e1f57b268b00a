#include "schema/sglang_pd.h"

#include <fmt/core.h>

#include "core/json_fields.h"

namespace ferry::schema {

using Json = nlohmann::json;

namespace {

Result<uint64_t> Room(const Json& v, const std::string& name) {
    const bool ok = v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t(INT64_MAX)
                                           : v.is_number_integer() && v.get<int64_t>() >= 0;
    if (!ok) {
        return InvalidArgumentError(
            fmt::format("'{}' must be an integer in 0..9223372036854775807, not {}", name,
                        v.is_number_integer() ? v.dump() : std::string(JsonFields::KindOf(v))));
    }
    return v.get<uint64_t>();
}

Result<std::string> Host(const Json& v, const std::string& name) {
    if (!v.is_string()) {
        return InvalidArgumentError(
            fmt::format("'{}' must be a string, not {}", name, JsonFields::KindOf(v)));
    }
    std::string h = v.get<std::string>();
    if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
    if (h.empty() || h.size() > 255) {
        return InvalidArgumentError(fmt::format("'{}' must be a host of 1..255 characters", name));
    }
    return h;
}

Result<int> Port(const Json& v, const std::string& name) {
    if (v.is_null()) return 0;
    if (!v.is_number_integer() || JsonFields::ClampedInt(v) < 1 ||
        JsonFields::ClampedInt(v) > 65535) {
        return InvalidArgumentError(
            fmt::format("'{}' must be an integer in 1..65535 or null, not {}", name,
                        v.is_number_integer() ? v.dump() : std::string(JsonFields::KindOf(v))));
    }
    return static_cast<int>(v.get<int64_t>());
}

// Field `key` for prompt i of n (n 0: one prompt): the scalar, or the list's entry.
Result<const Json*> Entry(const Json& body, const char* key, size_t i, size_t n,
                          std::string* name) {
    const Json& v = body[key];
    *name = key;
    if (!v.is_array()) return &v;
    if (n == 0 || v.size() != n) {
        return InvalidArgumentError(
            fmt::format("'{}' is a list of {} for {}", key, v.size(),
                        n == 0 ? std::string("one prompt") : fmt::format("a batch of {}", n)));
    }
    *name = fmt::format("{}[{}]", key, i);
    return &v[i];
}

}  // namespace

Result<std::optional<std::vector<SglangBootstrap>>> ParseSglangBootstrap(const Json& body,
                                                                         size_t batch) {
    if (!body.is_object() || !body.contains("bootstrap_room") || body["bootstrap_room"].is_null()) {
        return std::optional<std::vector<SglangBootstrap>>();
    }
    if (!body.contains("bootstrap_host") || body["bootstrap_host"].is_null()) {
        return InvalidArgumentError("'bootstrap_room' needs 'bootstrap_host' (the prefill worker)");
    }
    const size_t n = batch == 0 ? 1 : batch;
    std::vector<SglangBootstrap> out(n);
    for (size_t i = 0; i < n; ++i) {
        std::string name;
        FERRY_ASSIGN_OR_RETURN(const Json* room, Entry(body, "bootstrap_room", i, batch, &name));
        FERRY_ASSIGN_OR_RETURN(out[i].room, Room(*room, name));
        FERRY_ASSIGN_OR_RETURN(const Json* host, Entry(body, "bootstrap_host", i, batch, &name));
        FERRY_ASSIGN_OR_RETURN(out[i].host, Host(*host, name));
        if (body.contains("bootstrap_port")) {
            FERRY_ASSIGN_OR_RETURN(const Json* port,
                                   Entry(body, "bootstrap_port", i, batch, &name));
            FERRY_ASSIGN_OR_RETURN(out[i].port, Port(*port, name));
        }
    }
    return std::optional<std::vector<SglangBootstrap>>(std::move(out));
}

std::string SglangTransferId(uint64_t room) { return fmt::format("sglang-room-{}", room); }

Json SglangPrefillInfoJson(const SglangPrefillInfo& info) {
    return {{"attn_tp_size", info.tp_size},
            {"attn_cp_size", 1},
            {"dp_size", 1},
            {"pp_size", 1},
            {"page_size", info.page_size},
            {"kv_cache_dtype", info.kv_cache_dtype},
            {"follow_bootstrap_room", true},
            {"enable_dsa_cache_layer_split", false},
            {"prefill_http_port", info.http_port},
            {"ferry_agent", AgentAddressJson(info.agent)}};
}

Json SglangRankInfoJson(const SglangPrefillInfo& info, int tp_rank) {
    return {{"rank_ip", info.agent.host},
            {"rank_port", info.agent.port},
            {"attn_dp_rank", 0},
            {"attn_cp_rank", 0},
            {"attn_tp_rank", tp_rank},
            {"pp_rank", 0},
            {"agent_name", info.agent.engine_id}};
}

Result<SglangPrefillInfo> ParseSglangPrefillInfo(const Json& j) {
    if (!j.is_object()) {
        return InvalidArgumentError(fmt::format(
            "the bootstrap server's answer must be an object, not {}", JsonFields::KindOf(j)));
    }
    const JsonFields f(j);
    SglangPrefillInfo info;
    FERRY_ASSIGN_OR_RETURN(int64_t tp, f.Int("attn_tp_size", 1, 1024));
    info.tp_size = static_cast<int>(tp);
    if (f.Given("page_size")) {
        FERRY_ASSIGN_OR_RETURN(int64_t page, f.Int("page_size", 1, 1 << 20));
        info.page_size = static_cast<int>(page);
    }
    if (f.Given("prefill_http_port")) {
        FERRY_ASSIGN_OR_RETURN(int64_t port, f.Int("prefill_http_port", 0, 65535));
        info.http_port = static_cast<int>(port);
    }
    if (!j.contains("ferry_agent")) {
        return InvalidArgumentError(
            "the bootstrap server's answer has no 'ferry_agent': not a ferry prefill worker (an "
            "SGLang prefill worker moves KV with its own engines, which ferry does not speak)");
    }
    FERRY_ASSIGN_OR_RETURN(info.agent, ParseAgentAddress(j["ferry_agent"], "ferry_agent"));
    return info;
}

}  // namespace ferry::schema
