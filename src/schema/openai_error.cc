#include "schema/openai_error.h"

#include <fmt/core.h>

#include "core/json_depth.h"
#include "core/json_fields.h"

namespace ferry::schema {

const char* OpenAiErrorType(int status) {
    return status == 400 || status == 413 ? "invalid_request_error"
           : status == 401                ? "authentication_error"
           : status == 403                ? "permission_error"
           : status == 404                ? "not_found_error"
           : status == 409                ? "conflict_error"
           : status == 429                ? "rate_limit_error"
           : status == 503                ? "service_unavailable"
           : status < 500                 ? "invalid_request_error"
                                          : "server_error";
}

nlohmann::json OpenAiErrorJson(int status, const OpenAiError& error,
                               const std::string& request_id) {
    using Json = nlohmann::json;
    Json err = {{"message", error.message},
                {"type", OpenAiErrorType(status)},
                {"param", error.param.empty() ? Json() : Json(error.param)},
                {"code", error.code.empty() ? Json(status) : Json(error.code)}};
    if (!request_id.empty()) err["request_id"] = request_id;
    return {{"error", err}};
}

Result<ParsedOpenAiError> ParseOpenAiError(std::string_view body) {
    if (!JsonDepthWithin(body, 8)) return InvalidArgumentError("error body: nests too deep");
    const nlohmann::json j = nlohmann::json::parse(body.begin(), body.end(), nullptr, false);
    if (j.is_discarded()) return InvalidArgumentError("error body: not JSON");
    FERRY_ASSIGN_OR_RETURN(JsonFields e, JsonFields(j, "").Object("error"));
    ParsedOpenAiError out;
    FERRY_ASSIGN_OR_RETURN(out.message, e.String("message", 1 << 20));
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> type, e.OptString("type", 256));
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> param, e.OptString("param", 256));
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> id, e.OptString("request_id", 256));
    out.type = type.value_or("");
    out.param = param.value_or("");
    out.request_id = id.value_or("");
    if (const nlohmann::json* code = e.Given("code")) {
        if (code->is_number_integer()) {
            out.code = std::to_string(JsonFields::ClampedInt(*code));
        } else {
            FERRY_ASSIGN_OR_RETURN(std::optional<std::string> c, e.OptString("code", 256));
            out.code = c.value_or("");
        }
    }
    return out;
}

}  // namespace ferry::schema
