#include "schema/agent_address.h"

#include "core/json_fields.h"

namespace ferry::schema {

nlohmann::json AgentAddressJson(const AgentAddress& a) {
    return {{"engine_id", a.engine_id}, {"host", a.host}, {"port", a.port}};
}

Result<AgentAddress> ParseAgentAddress(const nlohmann::json& j, std::string_view path,
                                       std::string_view default_host) {
    if (!j.is_object()) {
        return InvalidArgumentError(
            fmt::format("{}: must be an object, not {}", path, JsonFields::KindOf(j)));
    }
    const JsonFields f(j, std::string(path));
    AgentAddress a;
    FERRY_ASSIGN_OR_RETURN(a.engine_id, f.String("engine_id", 256));
    if (a.engine_id.empty()) return f.Bad("engine_id", "must not be empty");
    if (f.Given("host") || default_host.empty()) {
        FERRY_ASSIGN_OR_RETURN(a.host, f.String("host", 255));
        if (a.host.empty()) return f.Bad("host", "must not be empty");
    } else {
        a.host = std::string(default_host);
    }
    FERRY_ASSIGN_OR_RETURN(int64_t port, f.Int("port", 1, 65535));
    a.port = static_cast<int>(port);
    return a;
}

}  // namespace ferry::schema
