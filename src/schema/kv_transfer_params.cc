#include "schema/kv_transfer_params.h"

#include <fmt/core.h>

#include <cfloat>
#include <climits>

#include "core/json_depth.h"
#include "core/json_fields.h"

namespace ferry::schema {

namespace {

using Json = nlohmann::json;

constexpr char kParam[] = "kv_transfer_params";

}  // namespace

nlohmann::json KvTransferParamsJson(const KvTransferParams& p) {
    Json j = {{"do_remote_decode", p.do_remote_decode},
              {"do_remote_prefill", p.do_remote_prefill},
              {"remote_engine_id", p.remote_engine_id},
              {"remote_block_ids", p.remote_block_ids},
              {"remote_host", p.remote_host},
              {"remote_port", p.remote_port},
              {"remote_request_id", p.remote_request_id},
              {"tp_size", p.tp_size},
              {"transfer_mode", p.mode == KvTransferMode::kPush ? "push" : "pull"}};
    if (!p.transfer_id.empty()) j["transfer_id"] = p.transfer_id;
    if (!p.hold_nonce.empty()) j["ferry_hold_nonce"] = p.hold_nonce;
    if (p.first_token) {
        Json top = Json::array();
        for (auto [t, lp] : p.first_token->top) top.push_back({t, lp});
        j["ferry_first_token"] = {
            {"token", p.first_token->token}, {"logprob", p.first_token->logprob}, {"top", top}};
    }
    return j;
}

Result<KvTransferParams> ParseKvTransferParamsText(std::string_view json,
                                                   KvTransferMode default_mode) {
    if (!JsonDepthWithin(json, 8)) {
        return InvalidArgumentError(fmt::format("'{}' nests too deep", kParam));
    }
    const Json v = Json::parse(json.begin(), json.end(), nullptr, false);
    if (v.is_discarded()) {
        return InvalidArgumentError(fmt::format("'{}' must be an object, not valid JSON", kParam));
    }
    return ParseKvTransferParams(v, default_mode);
}

Result<KvTransferParams> ParseKvTransferParams(const Json& v, KvTransferMode default_mode) {
    if (!v.is_object()) {
        return InvalidArgumentError(
            fmt::format("'{}' must be an object, not {}", kParam, JsonFields::KindOf(v)));
    }
    KvTransferParams p;
    Status error;
    // Typed reads through JsonFields; the errors keep the wording clients already match.
    const JsonFields f(v, kParam);
    auto bad = [&](const char* key, const char* want) {
        if (error.ok()) {
            error = InvalidArgumentError(fmt::format("'{}.{}' must be {}", kParam, key, want));
        }
    };
    auto get = [&](const char* key) { return f.Given(key); };
    auto boolean = [&](const char* key, bool* dst) {
        auto x = f.OptBool(key);
        if (!x.ok()) return bad(key, "a boolean");
        if (*x) *dst = **x;
    };
    auto string = [&](const char* key, std::string* dst) {
        auto x = f.OptString(key, 1024);
        if (!x.ok()) return bad(key, "a string of at most 1024 bytes");
        if (*x) *dst = std::move(**x);
    };
    auto integer = [&](const char* key, int* dst, int64_t lo, int64_t hi) {
        auto x = f.OptInt(key, lo, hi);
        if (!x.ok()) return bad(key, "an integer in range");
        if (*x) *dst = static_cast<int>(**x);
    };
    boolean("do_remote_decode", &p.do_remote_decode);
    boolean("do_remote_prefill", &p.do_remote_prefill);
    string("remote_engine_id", &p.remote_engine_id);
    string("remote_host", &p.remote_host);
    integer("remote_port", &p.remote_port, 0, 65535);
    string("remote_request_id", &p.remote_request_id);
    integer("tp_size", &p.tp_size, 1, 1024);
    string("transfer_id", &p.transfer_id);
    p.mode = default_mode;
    if (get("transfer_mode")) {
        std::string mode;
        string("transfer_mode", &mode);
        if (mode == "push") {
            p.mode = KvTransferMode::kPush;
        } else if (mode == "pull") {
            p.mode = KvTransferMode::kPull;
        } else {
            bad("transfer_mode", "\"pull\" or \"push\"");
        }
    }
    if (get("remote_block_ids")) {
        auto ids = f.IntArray<int32_t>("remote_block_ids", 0, INT32_MAX, 1u << 24);
        if (ids.ok()) {
            p.remote_block_ids = std::move(*ids);
        } else {
            bad("remote_block_ids", "an array of block ids");
        }
    }
    if (const Json* n = get("ferry_hold_nonce")) {
        if (!n->is_string() || n->get_ref<const std::string&>().size() != 32 ||
            n->get_ref<const std::string&>().find_first_not_of("0123456789abcdef") !=
                std::string::npos) {
            bad("ferry_hold_nonce", "32 hex characters, as the prefill worker gave it");
        } else {
            p.hold_nonce = n->get<std::string>();
        }
    }
    if (const Json* t = get("ferry_first_token")) {
        FirstToken ft;
        // A log-probability is a float: a number beyond its range would become infinite.
        auto logprob = [](const Json& v, float* out) {
            if (!v.is_number()) return false;
            const double d = v.get<double>();
            if (!(d >= -FLT_MAX && d <= FLT_MAX)) return false;
            *out = static_cast<float>(d);
            return true;
        };
        auto tok = t->is_object() ? t->find("token") : Json::const_iterator();
        if (!t->is_object() || tok == t->end() || !tok->is_number_integer() ||
            JsonFields::ClampedInt(*tok) < 0 || JsonFields::ClampedInt(*tok) > INT32_MAX ||
            !t->contains("logprob") || !logprob((*t)["logprob"], &ft.logprob)) {
            bad("ferry_first_token", "an object with an integer token and a finite logprob");
        } else {
            ft.token = static_cast<int32_t>(JsonFields::ClampedInt(*tok));
            if (t->contains("top")) {
                const Json& top = (*t)["top"];
                if (!top.is_array() || top.size() > 1024) {
                    bad("ferry_first_token", "valid");
                } else {
                    for (const Json& e : top) {
                        float lp = 0;
                        if (!e.is_array() || e.size() != 2 || !e[0].is_number_integer() ||
                            !logprob(e[1], &lp) || JsonFields::ClampedInt(e[0]) < 0 ||
                            JsonFields::ClampedInt(e[0]) > INT32_MAX) {
                            bad("ferry_first_token", "valid (top: [[token, logprob], ...])");
                            break;
                        }
                        ft.top.emplace_back(static_cast<int32_t>(JsonFields::ClampedInt(e[0])), lp);
                    }
                }
            }
            p.first_token = std::move(ft);
        }
    }
    if (!error.ok()) return error;
    if (p.do_remote_prefill && p.mode == KvTransferMode::kPull && p.hold_nonce.empty()) {
        return InvalidArgumentError(
            fmt::format("'{}.ferry_hold_nonce' must be present: a pull decode request carries the "
                        "kv_transfer_params of a ferry prefill worker's answer, unchanged",
                        kParam));
    }
    if (p.do_remote_decode && p.do_remote_prefill) {
        return InvalidArgumentError(
            "kv_transfer_params: do_remote_decode and do_remote_prefill are both true");
    }
    return p;
}

Json PullPrefillRequestParams() {
    return {{"do_remote_decode", true},    {"do_remote_prefill", false},
            {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
            {"remote_host", nullptr},      {"remote_port", nullptr}};
}

Json PushPrefillRequestParams(const std::string& transfer_id) {
    KvTransferParams p;
    p.mode = KvTransferMode::kPush;
    p.do_remote_decode = true;
    p.transfer_id = transfer_id;
    return KvTransferParamsJson(p);
}

Json PushDecodeRequestParams(const std::string& transfer_id, const AgentAddress& prefill_agent,
                             int tp_size) {
    KvTransferParams p;
    p.mode = KvTransferMode::kPush;
    p.do_remote_prefill = true;
    p.transfer_id = transfer_id;
    p.set_remote_agent(prefill_agent);
    p.tp_size = tp_size;
    return KvTransferParamsJson(p);
}

}  // namespace ferry::schema
