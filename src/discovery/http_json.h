// HTTP+JSON plumbing shared by the discovery stores: the Ferry-HMAC request signature,
// and a client call with deadline, retries and error mapping.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/base64.h"
#include "core/host_port.h"
#include "ferry/status.h"

namespace ferry::discovery {

using Json = nlohmann::json;

// `Authorization: Ferry-HMAC t=<unix ms>,n=<hex nonce>,m=<hex HMAC-SHA256>` over
// "ferry-store-v1\n<method>\n<path>\n<t>\n<n>\n<body>".
std::string SignRequest(std::string_view secret, std::string_view method, std::string_view path,
                        std::string_view body);
// Checks a header made by SignRequest: the MAC, and a timestamp within `skew` of now. Returns
// the nonce (for the caller's replay cache) or PermissionDenied with the reason.
Result<std::string> VerifyRequest(std::string_view secret, std::string_view header,
                                  std::string_view method, std::string_view path,
                                  std::string_view body, std::chrono::milliseconds skew);

// What VerifyRequest checks without the body (the scheme, the parameters' form, the
// timestamp): for refusing a request before reading its body.
Status PrecheckRequest(std::string_view header, std::chrono::milliseconds skew);

using Endpoint = ::ferry::HostPort;
// "host:port" (IPv4, a name, or [IPv6]), port 1..65535.
Result<Endpoint> ParseHostPort(std::string_view s);

struct HttpReply {
    int status = 0;
    Json body;
};

// POSTs `body` as JSON, signing it when `secret` is set. Connection failures and 5xx answers are
// retried with backoff until `timeout` has passed (Unavailable then); `read_timeout` bounds one
// attempt (long polls pass their poll time plus a margin). 4xx answers are returned, not retried.
Result<HttpReply> PostJson(const Endpoint& ep, const std::string& path, const Json& body,
                           const std::string& secret, std::chrono::milliseconds timeout,
                           std::chrono::milliseconds read_timeout);

// A plain HTTP/1.0 POST on a fresh connection, read to its end (no chunked encoding, no
// trailers: etcd's gateway sends gRPC trailers on HTTP/1.1 that general clients choke on).
// `on_data` sees the body as it arrives and may return false to stop early (a watch stream);
// the call then returns what it has. `read_timeout` bounds the silence between reads; hitting
// it after the headers ends the call normally (a long poll with no news).
struct RawReply {
    int status = 0;
    std::string body;  // empty when on_data consumed it
};
Result<RawReply> RawPost(const Endpoint& ep, const std::string& path, const std::string& body,
                         std::chrono::milliseconds connect_timeout,
                         std::chrono::milliseconds read_timeout,
                         const std::function<bool(std::string_view)>& on_data = nullptr,
                         const std::string& authorization = "");

// An error reply ({"error": {"message": ...}} or etcd's {"error": ..., "message": ...}) as a
// Status: 400 InvalidArgument, 401/403 PermissionDenied, 404 NotFound, 413 and 429
// ResourceExhausted or InvalidArgument, else Unavailable.
Status ReplyError(const HttpReply& r, std::string_view what);

}  // namespace ferry::discovery
