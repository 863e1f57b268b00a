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
    return j;
}

Result<EcTransferParams> ParseEcTransferParams(const nlohmann::json& params) {
    EcTransferParams p;
    FERRY_ASSIGN_OR_RETURN(static_cast<AgentAddress&>(p), ParseAgentAddress(params, kEcParam));
    const JsonFields f(params, kEcParam);
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> encoder, f.OptString("encoder", 128));
    if (encoder) p.encoder = std::move(*encoder);
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
