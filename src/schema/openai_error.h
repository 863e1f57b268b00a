// OpenAI's error object, as every ferry server writes it (the workers' OpenAI server, `ferry
// proxy`, the HTTP layer's own refusals through http::ServerConfig::error_reply) and as a client
// of one reads it (`ferry bench serve`):
//   {"error": {"message", "type", "param", "code"[, "request_id"]}}
// `type` follows the status (400/413 invalid_request_error, 401 authentication_error, 403
// permission_error, 404 not_found_error, 409 conflict_error, 429 rate_limit_error, 503
// service_unavailable, other 4xx invalid_request_error, 5xx server_error); `param` is the request
// field at fault or null; `code` a stable string naming the fault, else the HTTP status as a
// number (vLLM's ErrorResponse). The layer's rules: schema/agent_address.h.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ferry/status.h"

namespace ferry::schema {

struct OpenAiError {
    std::string message;
    std::string param = "";
    std::string code = "";
};

// The error's "type" for an HTTP status.
const char* OpenAiErrorType(int status);

// The whole body; `request_id` is written when given.
nlohmann::json OpenAiErrorJson(int status, const OpenAiError& error,
                               const std::string& request_id = "");

// A body read back (a client's view): message required; type, param, code (a string, or the
// status as a number, given back as its digits) and request_id when present. InvalidArgument
// when the text is not such a body (nesting past 8 levels is refused before parsing).
struct ParsedOpenAiError : OpenAiError {
    std::string type = "";
    std::string request_id = "";
};
Result<ParsedOpenAiError> ParseOpenAiError(std::string_view body);

}  // namespace ferry::schema
