#include "schema/ec_transfer_params.h"

#include <fmt/core.h>

#include "core/json_depth.h"
#include "core/json_fields.h"

namespace ferry::schema {

namespace {

constexpr char kEcParam[] = "ec_transfer_params";

}  // namespace

nlohmann::json EcTransferParamsJson(const EcTransferParams& p) {
    nlohmann::json j = AgentAddressJson(p);
    j["encoder"] = p.encoder;
    if (!p.mm_hashes.empty()) j["mm_hashes"] = p.mm_hashes;
    return j;
}

Result<EcTransferParams> ParseEcTransferParams(const nlohmann::json& params) {
    EcTransferParams p;
    FERRY_ASSIGN_OR_RETURN(static_cast<AgentAddress&>(p), ParseAgentAddress(params, kEcParam));
    const JsonFields f(params, kEcParam);
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> encoder, f.OptString("encoder", 128));
    if (encoder) p.encoder = std::move(*encoder);
    if (f.Has("mm_hashes")) {
        FERRY_ASSIGN_OR_RETURN(const nlohmann::json* a, f.Array("mm_hashes", kMaxEcHashes));
        for (size_t i = 0; i < a->size(); ++i) {
            const nlohmann::json& h = (*a)[i];
            if (!h.is_string() || h.get_ref<const std::string&>().size() != 64 ||
                h.get_ref<const std::string&>().find_first_not_of("0123456789abcdef") !=
                    std::string::npos) {
                return InvalidArgumentError(fmt::format(
                    "field '{}.mm_hashes[{}]' must be 64 lowercase hex digits", kEcParam, i));
            }
            p.mm_hashes.push_back(h.get<std::string>());
        }
    }
    return p;
}

Result<EcTransferParams> ParseEcTransferParamsText(std::string_view json) {
    if (!JsonDepthWithin(json, 8)) {
        return InvalidArgumentError(fmt::format("'{}' nests too deep", kEcParam));
    }
    const nlohmann::json v = nlohmann::json::parse(json.begin(), json.end(), nullptr, false);
    if (v.is_discarded()) {
        return InvalidArgumentError(
            fmt::format("'{}' must be an object, not valid JSON", kEcParam));
    }
    return ParseEcTransferParams(v);
}

}  // namespace ferry::schema
