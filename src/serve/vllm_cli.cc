#include "serve/vllm_cli.h"

#include <fmt/core.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "core/json_depth.h"
#include "core/json_fields.h"

namespace ferry::serve {

namespace {

using Json = nlohmann::json;

// vLLM's flags with no meaning on ferry (a CPU engine on GGUF files), with and without a value.
constexpr std::string_view kIgnoredWithValue[] = {"--gpu-memory-utilization",
                                                  "--swap-space",
                                                  "--cpu-offload-gb",
                                                  "--dtype",
                                                  "--seed",
                                                  "--download-dir",
                                                  "--load-format",
                                                  "--max-logprobs",
                                                  "--distributed-executor-backend",
                                                  "--uvicorn-log-level",
                                                  "--max-seq-len-to-capture"};
constexpr std::string_view kIgnoredFlags[] = {"--enforce-eager",
                                              "--trust-remote-code",
                                              "--disable-log-requests",
                                              "--disable-log-stats",
                                              "--disable-custom-all-reduce",
                                              "--enable-log-requests",
                                              "--disable-frontend-multiprocessing",
                                              "--enable-request-id-headers"};

// vLLM's connectors that move KV between instances, and ferry's protocol for each.
struct Connector {
    std::string_view name;
    std::string_view transfer;  // pull | push
};
constexpr Connector kConnectors[] = {{"NixlConnector", "pull"},
                                     {"DynamoNixlConnector", "pull"},
                                     {"MooncakeConnector", "push"},
                                     {"P2pNcclConnector", "push"}};

// KVTransferConfig's fields that ferry takes, and those it has no use for.
constexpr std::string_view kTakenFields[] = {"kv_connector", "kv_role", "engine_id",
                                             "kv_connector_extra_config", "kv_load_failure_policy"};
constexpr std::string_view kUnusedFields[] = {"kv_buffer_device",
                                              "kv_buffer_size",
                                              "kv_rank",
                                              "kv_parallel_size",
                                              "kv_ip",
                                              "kv_port",
                                              "kv_connector_module_path",
                                              "enable_permute_local_kv",
                                              "kv_load_failure_policy"};

template <size_t N>
bool In(const std::string_view (&set)[N], std::string_view s) {
    return std::find(std::begin(set), std::end(set), s) != std::end(set);
}

std::optional<bool> BoolWord(std::string_view s) {
    if (s == "true" || s == "True" || s == "1" || s == "yes") return true;
    if (s == "false" || s == "False" || s == "0" || s == "no") return false;
    return std::nullopt;
}

// One of vLLM's config objects given on the command line (--kv-transfer-config,
// --ec-transfer-config): JSON nesting at most 8 deep, an object, each field either one ferry takes
// (`taken`), one it has no use for (`unused`: noted), or refused by name. `kind` names the vLLM
// class in errors.
template <size_t T, size_t U>
Result<Json> ReadConfigObject(std::string_view flag, std::string_view kind, std::string_view text,
                              const std::string_view (&taken)[T],
                              const std::string_view (&unused)[U],
                              std::vector<std::string>* notes) {
    if (!JsonDepthWithin(text, 8)) {
        return InvalidArgumentError(fmt::format("{}: nests too deep", flag));
    }
    Json j = Json::parse(text.begin(), text.end(), nullptr, false);
    if (!j.is_object()) {
        return InvalidArgumentError(
            fmt::format("{}: must be a JSON object (vLLM's {})", flag, kind));
    }
    for (const auto& [key, value] : j.items()) {
        if (In(taken, key)) continue;
        if (In(unused, key)) {
            notes->push_back(fmt::format("{}: {} has no meaning on ferry; ignored", flag, key));
            continue;
        }
        std::string names;
        for (std::string_view t : taken) names += fmt::format("{}, ", t);
        return InvalidArgumentError(fmt::format("{}: unknown field '{}' ({} has {}...)", flag,
                                                key.substr(0, 64), kind, names));
    }
    return j;
}

// What --kv-transfer-config asks of the command.
struct KvTransfer {
    std::string load_failure;  // kv_load_failure_policy: fail | recompute ("": not given)
    std::string transfer;      // pull | push
    std::string role;          // prefill | decode
    std::string agent_name;
    std::string backend;  // "" | tcp | ucx | shm
};

Result<KvTransfer> ParseKvTransferConfig(std::string_view text, std::vector<std::string>* notes) {
    constexpr char kFlag[] = "--kv-transfer-config";
    FERRY_ASSIGN_OR_RETURN(const Json j, ReadConfigObject(kFlag, "KVTransferConfig", text,
                                                          kTakenFields, kUnusedFields, notes));
    const JsonFields f(j, "kv-transfer-config");
    KvTransfer kt;
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> connector, f.OptString("kv_connector", 128));
    if (!connector) {
        return InvalidArgumentError(fmt::format("{}: kv_connector is required", kFlag));
    }
    for (const Connector& c : kConnectors) {
        if (*connector == c.name) kt.transfer = std::string(c.transfer);
    }
    if (kt.transfer.empty()) {
        return InvalidArgumentError(
            fmt::format("{}: kv_connector '{}' has no equivalent on ferry (NixlConnector and "
                        "DynamoNixlConnector map to its pull protocol, MooncakeConnector and "
                        "P2pNcclConnector to push)",
                        kFlag, connector->substr(0, 64)));
    }
    notes->push_back(fmt::format("{}: {} is ferry's transfer engine, protocol {}", kFlag,
                                 *connector, kt.transfer));
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> role, f.OptString("kv_role", 32));
    if (role) {
        if (*role == "kv_producer") {
            kt.role = "prefill";
        } else if (*role == "kv_consumer" || *role == "kv_both") {
            kt.role = "decode";  // a decode worker also holds KV for others (kv_both)
        } else {
            return f.Bad("kv_role", "must be kv_producer, kv_consumer or kv_both");
        }
    }
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> engine_id, f.OptString("engine_id", 256));
    if (engine_id) kt.agent_name = *engine_id;
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> policy,
                           f.OptString("kv_load_failure_policy", 64));
    if (policy) {
        if (*policy != "fail" && *policy != "recompute") {
            return f.Bad("kv_load_failure_policy", "must be fail or recompute");
        }
        kt.load_failure = *policy;
    }
    if (const Json* extra = f.Given("kv_connector_extra_config")) {
        if (!extra->is_object()) return f.Bad("kv_connector_extra_config", "must be an object");
        const JsonFields e(*extra, "kv-transfer-config.kv_connector_extra_config");
        for (const auto& [key, value] : extra->items()) {
            if (key == "skip_sampling") {
                FERRY_ASSIGN_OR_RETURN(std::optional<bool> skip, e.OptBool("skip_sampling"));
                if (skip && *skip && kt.role.empty()) kt.role = "prefill";
                notes->push_back(fmt::format(
                    "{}: skip_sampling: a prefill worker; it samples the first token and sends it "
                    "with the KV, so the decoder computes no prompt token",
                    kFlag));
            } else if (key == "backends") {
                FERRY_ASSIGN_OR_RETURN(const Json* list, e.Array("backends", 8));
                if (list->size() != 1 || !(*list)[0].is_string()) {
                    return e.Bad("backends", "must name one backend (UCX, TCP or SHM)");
                }
                std::string b = (*list)[0].get<std::string>();
                std::transform(b.begin(), b.end(), b.begin(), ::tolower);
                if (b != "ucx" && b != "tcp" && b != "shm") {
                    return e.Bad("backends", "must name UCX, TCP or SHM");
                }
                kt.backend = b;
            } else {
                notes->push_back(
                    fmt::format("{}: kv_connector_extra_config.{} has no meaning on ferry; ignored",
                                kFlag, key.substr(0, 64)));
            }
        }
    }
    return kt;
}

// What --ec-transfer-config (vLLM's ECTransferConfig) asks of the command.
struct EcTransfer {
    bool producer = false;  // ec_producer: an encode worker
    std::string dir;        // the shared directory
};

constexpr std::string_view kEcTakenFields[] = {"ec_connector", "ec_role",
                                               "ec_connector_extra_config"};
constexpr std::string_view kEcUnusedFields[] = {
    "engine_id", "ec_buffer_device", "ec_buffer_size",          "ec_rank", "ec_parallel_size",
    "ec_ip",     "ec_port",          "ec_connector_module_path"};

Result<EcTransfer> ParseEcTransferConfig(std::string_view text, std::vector<std::string>* notes) {
    constexpr char kFlag[] = "--ec-transfer-config";
    FERRY_ASSIGN_OR_RETURN(const Json j, ReadConfigObject(kFlag, "ECTransferConfig", text,
                                                          kEcTakenFields, kEcUnusedFields, notes));
    const JsonFields f(j, "ec-transfer-config");
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> connector, f.OptString("ec_connector", 128));
    if (!connector) return InvalidArgumentError(fmt::format("{}: ec_connector is required", kFlag));
    if (*connector != "ECExampleConnector" && *connector != "ECSharedStorageConnector") {
        return InvalidArgumentError(fmt::format(
            "{}: ec_connector '{}' has no equivalent on ferry (ECExampleConnector and "
            "ECSharedStorageConnector map to its disk connector; ferry's own is --ec-connector "
            "transfer)",
            kFlag, connector->substr(0, 64)));
    }
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> role, f.OptString("ec_role", 32));
    if (!role) {
        return InvalidArgumentError(
            fmt::format("{}: ec_role is required with ec_connector (as vLLM's)", kFlag));
    }
    EcTransfer ec;
    if (*role == "ec_producer") {
        ec.producer = true;
    } else if (*role == "ec_both") {
        notes->push_back(fmt::format(
            "{}: ec_both: this worker loads embeddings from the directory; what it encodes "
            "itself stays in its own encoder cache",
            kFlag));
    } else if (*role != "ec_consumer") {
        return f.Bad("ec_role", "must be ec_producer, ec_consumer or ec_both");
    }
    FERRY_ASSIGN_OR_RETURN(JsonFields extra, f.Object("ec_connector_extra_config"));
    FERRY_ASSIGN_OR_RETURN(ec.dir, extra.String("shared_storage_path", 4096));
    if (ec.dir.empty()) return extra.Bad("shared_storage_path", "must not be empty");
    notes->push_back(
        fmt::format("{}: {} is ferry's disk connector on {}", kFlag, *connector, ec.dir));
    return ec;
}

constexpr std::string_view kEventsTakenFields[] = {"enable_kv_cache_events", "publisher",
                                                   "endpoint", "replay_endpoint", "topic"};
constexpr std::string_view kEventsUnusedFields[] = {"buffer_steps", "hwm", "max_queue_size"};

// --kv-events-config (vLLM's KVEventsConfig) as ferry's --kv-events-* flags, appended to `a`.
Status TranslateKvEventsConfig(std::string_view text, std::vector<std::string>* a,
                               std::vector<std::string>* notes) {
    constexpr char kFlag[] = "--kv-events-config";
    FERRY_ASSIGN_OR_RETURN(const Json j,
                           ReadConfigObject(kFlag, "KVEventsConfig", text, kEventsTakenFields,
                                            kEventsUnusedFields, notes));
    const JsonFields f(j, "kv-events-config");
    FERRY_ASSIGN_OR_RETURN(std::optional<bool> enabled, f.OptBool("enable_kv_cache_events"));
    // vLLM's publisher defaults to zmq when events are enabled, null otherwise.
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> publisher, f.OptString("publisher", 16));
    if (publisher && *publisher != "zmq" && *publisher != "null") {
        return f.Bad("publisher", "must be \"zmq\" or \"null\"");
    }
    if (!enabled.value_or(false) || publisher.value_or("zmq") == "null") {
        notes->push_back(fmt::format("{}: events off", kFlag));
        return Status::Ok();
    }
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> endpoint, f.OptString("endpoint", 256));
    a->insert(a->end(), {"--kv-events-endpoint", endpoint.value_or("tcp://*:5557")});
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> replay, f.OptString("replay_endpoint", 256));
    if (replay) a->insert(a->end(), {"--kv-events-replay-endpoint", *replay});
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> topic, f.OptString("topic", 256));
    if (topic) a->insert(a->end(), {"--kv-events-topic", *topic});
    return Status::Ok();
}

}  // namespace

Result<TranslatedArgs> TranslateVllmServeArgs(const std::vector<std::string>& in) {
    TranslatedArgs out;
    std::vector<std::string>& a = out.args;
    std::optional<KvTransfer> kv;
    std::optional<EcTransfer> ec;
    std::string role_given;
    bool model_given = false, name_given = false;
    std::string positional_model;
    for (const std::string& s : in) {
        model_given = model_given || s == "--model" || s.rfind("--model=", 0) == 0;
        name_given = name_given || s.rfind("--served-model-name", 0) == 0 ||
                     s.rfind("--served_model_name", 0) == 0;
    }
    for (size_t i = 0; i < in.size(); ++i) {
        std::string arg = in[i];
        std::optional<std::string> inline_value;
        if (arg.rfind("--", 0) == 0) {
            const size_t eq = arg.find('=');
            if (eq != std::string::npos) {
                inline_value = arg.substr(eq + 1);
                arg.resize(eq);
            }
            std::replace(arg.begin() + 2, arg.end(), '_', '-');
        } else if (i == 0 && !arg.empty() && arg[0] != '-' && !model_given) {
            a.push_back("--model");  // vllm serve MODEL
            a.push_back(arg);
            positional_model = arg;
            continue;
        }
        // The value of a flag that takes one: given inline or the next argument.
        auto value = [&]() -> Result<std::string> {
            if (inline_value) return *inline_value;
            if (i + 1 >= in.size()) {
                return InvalidArgumentError(fmt::format("{} needs a value", arg));
            }
            return in[++i];
        };
        auto pass = [&](const std::string& name) {
            a.push_back(inline_value ? name + "=" + *inline_value : name);
        };
        if (arg == "--tensor-parallel-size" || arg == "-tp") {
            FERRY_ASSIGN_OR_RETURN(std::string v, value());
            a.insert(a.end(), {"--tp", v});
        } else if (arg == "--pipeline-parallel-size" || arg == "-pp" ||
                   arg == "--data-parallel-size" || arg == "-dp") {
            FERRY_ASSIGN_OR_RETURN(std::string v, value());
            if (v != "1") {
                return InvalidArgumentError(
                    fmt::format("{} {}: ferry has tensor parallelism only (--tp)", arg, v));
            }
            out.notes.push_back(fmt::format("{} 1: ferry's default; ignored", arg));
        } else if (arg == "--enable-chunked-prefill" || arg == "--enable-prefix-caching") {
            // vLLM takes a bare flag or a boolean word after it ("--enable-chunked-prefill
            // false").
            bool on = true;
            if (inline_value) {
                std::optional<bool> b = BoolWord(*inline_value);
                if (!b) return InvalidArgumentError(fmt::format("{}: true or false", arg));
                on = *b;
            } else if (i + 1 < in.size() && BoolWord(in[i + 1])) {
                on = *BoolWord(in[++i]);
            }
            if (!on) {
                a.push_back(arg == "--enable-chunked-prefill" ? "--no-chunked-prefill"
                                                              : "--no-prefix-caching");
            }
        } else if (arg == "--no-enable-chunked-prefill") {
            a.push_back("--no-chunked-prefill");
        } else if (arg == "--no-enable-prefix-caching") {
            a.push_back("--no-prefix-caching");
        } else if (arg == "--kv-transfer-config") {
            FERRY_ASSIGN_OR_RETURN(std::string v, value());
            FERRY_ASSIGN_OR_RETURN(kv, ParseKvTransferConfig(v, &out.notes));
        } else if (arg == "--kv-events-config") {
            FERRY_ASSIGN_OR_RETURN(std::string v, value());
            FERRY_RETURN_IF_ERROR(TranslateKvEventsConfig(v, &a, &out.notes));
        } else if (arg == "--ec-transfer-config") {
            FERRY_ASSIGN_OR_RETURN(std::string v, value());
            FERRY_ASSIGN_OR_RETURN(ec, ParseEcTransferConfig(v, &out.notes));
        } else if (In(kIgnoredWithValue, arg)) {
            FERRY_ASSIGN_OR_RETURN(std::string v, value());
            out.notes.push_back(fmt::format("{} {}: no meaning on ferry; ignored", arg, v));
        } else if (In(kIgnoredFlags, arg)) {
            out.notes.push_back(fmt::format("{}: no meaning on ferry; ignored", arg));
        } else if (arg == "--role") {
            FERRY_ASSIGN_OR_RETURN(role_given, value());
            a.insert(a.end(), {"--role", role_given});
        } else {
            pass(arg);
        }
    }
    if (!positional_model.empty() && !name_given) {
        // vLLM serves the model under the name it was given on the command line.
        a.insert(a.end(), {"--served-model-name", positional_model});
        out.notes.push_back(
            fmt::format("serve MODEL: served as '{}', as vLLM names it", positional_model));
    }
    if (ec) {
        if (ec->producer && kv) {
            return InvalidArgumentError(
                "--ec-transfer-config ec_producer is an encode worker: it takes no "
                "--kv-transfer-config");
        }
        if (ec->producer && !role_given.empty() && role_given != "encode") {
            return InvalidArgumentError(fmt::format(
                "--ec-transfer-config asks for an encode worker, --role for a {} one", role_given));
        }
        if (ec->producer && role_given.empty()) a.insert(a.end(), {"--role", "encode"});
        a.insert(a.end(), {"--ec-connector", "disk", "--ec-dir", ec->dir});
    }
    if (kv) {
        if (!role_given.empty() && !kv->role.empty() && role_given != kv->role) {
            return InvalidArgumentError(
                fmt::format("--kv-transfer-config asks for a {} worker, --role for a {} one",
                            kv->role, role_given));
        }
        if (role_given.empty())
            a.insert(a.end(), {"--role", kv->role.empty() ? "decode" : kv->role});
        a.insert(a.end(), {"--kv-transfer", kv->transfer});
        if (!kv->agent_name.empty()) a.insert(a.end(), {"--agent-name", kv->agent_name});
        if (!kv->backend.empty()) a.insert(a.end(), {"--kv-backend", kv->backend});
        if (!kv->load_failure.empty()) {
            a.insert(a.end(), {"--kv-load-failure", kv->load_failure});
        }
    }
    return out;
}

}  // namespace ferry::serve
