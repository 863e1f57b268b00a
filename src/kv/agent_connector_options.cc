// The built-in connector's options as JSON (KvConnectorContext::options).
#include <fmt/core.h>

#include "core/json_fields.h"
#include "kv/agent_connector.h"

namespace ferry::kv {

namespace {

using Json = nlohmann::json;
using Ms = std::chrono::milliseconds;

constexpr const char* kKnown[] = {"hold_lease_ms",
                                  "hold_renew_interval_ms",
                                  "transfer_timeout_ms",
                                  "bootstrap_timeout_ms",
                                  "handshake_timeout_ms",
                                  "liveness_interval_ms",
                                  "transfer_mode",
                                  "backend",
                                  "max_client_hold_blocks",
                                  "max_client_loads",
                                  "max_client_dials",
                                  "max_peer_loads",
                                  "connect_threads",
                                  "verify",
                                  "canary"};

}  // namespace

Json AgentConnectorOptionsJson(const AgentConnectorOptions& o) {
    return {{"hold_lease_ms", o.hold_lease.count()},
            {"hold_renew_interval_ms", o.hold_renew_interval.count()},
            {"transfer_timeout_ms", o.transfer_timeout.count()},
            {"bootstrap_timeout_ms", o.bootstrap_timeout.count()},
            {"handshake_timeout_ms", o.handshake_timeout.count()},
            {"liveness_interval_ms", o.liveness_interval.count()},
            {"transfer_mode", o.default_mode == KvTransferMode::kPush ? "push" : "pull"},
            {"backend", o.backend},
            {"max_client_hold_blocks", o.max_client_hold_blocks},
            {"max_client_loads", o.max_client_loads},
            {"max_client_dials", o.max_client_dials},
            {"max_peer_loads", o.max_peer_loads},
            {"connect_threads", o.connect_threads},
            {"verify", std::string(KvVerifyModeName(o.verify))},
            {"canary", o.canary}};
}

Result<AgentConnectorOptions> ParseAgentConnectorOptions(const Json& options) {
    AgentConnectorOptions o;
    if (options.is_null()) return o;
    if (!options.is_object()) {
        return InvalidArgumentError(fmt::format(
            "kv connector options: must be a JSON object, not {}", JsonFields::KindOf(options)));
    }
    for (const auto& [key, value] : options.items()) {
        bool known = false;
        for (const char* k : kKnown) known = known || key == k;
        if (!known) {
            std::string names;
            for (const char* k : kKnown) names += (names.empty() ? "" : ", ") + std::string(k);
            return InvalidArgumentError(
                fmt::format("kv connector options: unknown option '{}' (the built-in kind's: {})",
                            key.substr(0, 64), names));
        }
    }
    const JsonFields f(options, "kv connector options");
    constexpr int64_t kDay = 86'400'000;
    auto ms = [&](const char* key, Ms* dst) -> Status {
        FERRY_ASSIGN_OR_RETURN(std::optional<int64_t> v, f.OptInt(key, 1, kDay));
        if (v) *dst = Ms(*v);
        return Status::Ok();
    };
    auto count = [&](const char* key, int* dst, int64_t lo, int64_t hi) -> Status {
        FERRY_ASSIGN_OR_RETURN(std::optional<int64_t> v, f.OptInt(key, lo, hi));
        if (v) *dst = static_cast<int>(*v);
        return Status::Ok();
    };
    FERRY_RETURN_IF_ERROR(ms("hold_lease_ms", &o.hold_lease));
    {
        // 0 turns renewals off.
        FERRY_ASSIGN_OR_RETURN(std::optional<int64_t> v,
                               f.OptInt("hold_renew_interval_ms", 0, 200000));
        if (v) o.hold_renew_interval = Ms(*v);
    }
    FERRY_RETURN_IF_ERROR(ms("transfer_timeout_ms", &o.transfer_timeout));
    FERRY_RETURN_IF_ERROR(ms("bootstrap_timeout_ms", &o.bootstrap_timeout));
    FERRY_RETURN_IF_ERROR(ms("handshake_timeout_ms", &o.handshake_timeout));
    FERRY_RETURN_IF_ERROR(ms("liveness_interval_ms", &o.liveness_interval));
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> mode, f.OptString("transfer_mode", 16));
    if (mode) {
        if (*mode != "pull" && *mode != "push") {
            return f.Bad("transfer_mode", "must be \"pull\" or \"push\"");
        }
        o.default_mode = *mode == "push" ? KvTransferMode::kPush : KvTransferMode::kPull;
    }
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> backend, f.OptString("backend", 64));
    if (backend) o.backend = *backend;
    FERRY_RETURN_IF_ERROR(
        count("max_client_hold_blocks", &o.max_client_hold_blocks, -1, INT32_MAX));
    FERRY_RETURN_IF_ERROR(count("max_client_loads", &o.max_client_loads, 0, INT32_MAX));
    FERRY_RETURN_IF_ERROR(count("max_client_dials", &o.max_client_dials, 0, INT32_MAX));
    FERRY_RETURN_IF_ERROR(count("max_peer_loads", &o.max_peer_loads, 0, INT32_MAX));
    FERRY_RETURN_IF_ERROR(count("connect_threads", &o.connect_threads, 1, 256));
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> verify, f.OptString("verify", 16));
    if (verify) {
        Result<KvVerifyMode> v = ParseKvVerifyMode(*verify);
        if (!v.ok()) return f.Bad("verify", "must be \"off\", \"sample\" or \"all\"");
        o.verify = *v;
    }
    FERRY_ASSIGN_OR_RETURN(std::optional<bool> canary, f.OptBool("canary"));
    if (canary) o.canary = *canary;
    return o;
}

}  // namespace ferry::kv
