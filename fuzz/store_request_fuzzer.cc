// Request bodies of the embedded discovery store (`ferry discovery`), served in process as an
// authorized HTTP request would be. The first byte picks the endpoint; the rest is the body.
// Every answer must be JSON with a known status, an error object for anything but 200.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ferry/discovery.h"

namespace {

ferry::StoreServer& Server() {
    static std::unique_ptr<ferry::StoreServer> server = [] {
        ferry::StoreServerConfig config;
        config.listen_host = "127.0.0.1";
        config.max_value_bytes = 64 * 1024;
        auto s = ferry::StoreServer::Start(config);
        if (!s.ok()) std::abort();
        return std::move(*s);
    }();
    return *server;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    static const char* paths[] = {
        "/v1/lease/grant", "/v1/lease/keepalive", "/v1/lease/revoke", "/v1/lease/ttl", "/v1/kv/put",
        "/v1/kv/get",      "/v1/kv/list",         "/v1/kv/delete",    "/v1/watch",     "/v1/nope"};
    std::string path = paths[data[0] % (sizeof paths / sizeof paths[0])];
    std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
    if (path == "/v1/watch") {
        // A watch is a long poll: keep the fuzzer fast by bounding how long it may wait.
        auto j = nlohmann::json::parse(body, nullptr, false);
        if (j.is_object() && j.contains("timeout_ms")) {
            const auto& t = j["timeout_ms"];
            if (!t.is_number() || t.get<double>() > 5) return 0;
        }
    }
    auto [status, reply] = Server().ServeForTesting(path, body);
    auto j = nlohmann::json::parse(reply, nullptr, false);
    if (j.is_discarded() || !j.is_object()) std::abort();  // always a JSON object
    if (status == 200) return 0;
    if (status != 400 && status != 404 && status != 413) std::abort();
    if (!j.contains("error") || !j["error"].contains("message")) std::abort();
    return 0;
}
