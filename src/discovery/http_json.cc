#include "discovery/http_json.h"

#include <algorithm>
#include <charconv>
#include <thread>

#include "core/crypto.h"
#include "http/http.h"

namespace ferry::discovery {
namespace {

bool Unhex(std::string_view s, uint8_t* out, size_t n) {
    if (s.size() != 2 * n) return false;
    auto val = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        return -1;
    };
    for (size_t i = 0; i < n; ++i) {
        int hi = val(s[2 * i]), lo = val(s[2 * i + 1]);
        if (hi < 0 || lo < 0) return false;
        out[i] = static_cast<uint8_t>(hi << 4 | lo);
    }
    return true;
}

std::string SignedText(std::string_view method, std::string_view path, std::string_view t,
                       std::string_view n, std::string_view body) {
    std::string s = "ferry-store-v1\n";
    s.append(method).append("\n").append(path).append("\n").append(t).append("\n").append(n);
    s.append("\n").append(body);
    return s;
}

int64_t NowMs() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}

}  // namespace

std::string SignRequest(std::string_view secret, std::string_view method, std::string_view path,
                        std::string_view body) {
    std::string t = std::to_string(NowMs());
    uint8_t nonce[16];
    SecureRandom(nonce, sizeof(nonce));
    std::string n = HexEncode(nonce, sizeof(nonce));
    Digest mac = HmacSha256(secret, SignedText(method, path, t, n, body));
    return "Ferry-HMAC t=" + t + ",n=" + n + ",m=" + HexEncode(mac.data(), mac.size());
}

namespace {

Result<std::string> CheckAuthorization(std::string_view secret, std::string_view header,
                                       std::string_view method, std::string_view path,
                                       std::string_view body, std::chrono::milliseconds skew,
                                       bool check_mac) {
    constexpr std::string_view kScheme = "Ferry-HMAC ";
    if (header.empty()) {
        return PermissionDeniedError(
            "this store requires the deployment secret: no "
            "Authorization header");
    }
    if (header.substr(0, kScheme.size()) != kScheme) {
        return PermissionDeniedError("Authorization: expected the Ferry-HMAC scheme");
    }
    std::string_view rest = header.substr(kScheme.size());
    std::string_view t, n, m;
    while (!rest.empty()) {
        size_t comma = rest.find(',');
        std::string_view part = rest.substr(0, comma);
        rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
        if (part.size() < 2 || part[1] != '=') {
            return PermissionDeniedError("Authorization: malformed Ferry-HMAC parameters");
        }
        std::string_view v = part.substr(2);
        switch (part[0]) {
            case 't':
                t = v;
                break;
            case 'n':
                n = v;
                break;
            case 'm':
                m = v;
                break;
            default:
                return PermissionDeniedError("Authorization: unknown Ferry-HMAC parameter");
        }
    }
    Digest got{};
    if (t.empty() || t.size() > 19 || n.size() != 32 || !Unhex(m, got.data(), got.size()) ||
        !std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        return PermissionDeniedError("Authorization: malformed Ferry-HMAC parameters");
    }
    uint8_t nonce_bytes[16];
    if (!Unhex(n, nonce_bytes, sizeof(nonce_bytes))) {
        return PermissionDeniedError("Authorization: malformed Ferry-HMAC nonce");
    }
    if (check_mac) {
        Digest want = HmacSha256(secret, SignedText(method, path, t, n, body));
        if (!DigestEqual(got, want)) {
            return PermissionDeniedError("Authorization: wrong deployment secret (HMAC mismatch)");
        }
    }
    // At most 19 digits, but still more than an int64 holds ("9999999999999999999"): parsed
    // without throwing, an overflow is simply outside the window.
    int64_t ts = 0;
    auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), ts);
    if (ec != std::errc() || end != t.data() + t.size() || std::abs(NowMs() - ts) > skew.count()) {
        return PermissionDeniedError("Authorization: timestamp outside the allowed clock skew");
    }
    return std::string(n);
}

}  // namespace

Result<std::string> VerifyRequest(std::string_view secret, std::string_view header,
                                  std::string_view method, std::string_view path,
                                  std::string_view body, std::chrono::milliseconds skew) {
    return CheckAuthorization(secret, header, method, path, body, skew, /*check_mac=*/true);
}

Status PrecheckRequest(std::string_view header, std::chrono::milliseconds skew) {
    return CheckAuthorization({}, header, {}, {}, {}, skew, /*check_mac=*/false).status();
}

Result<Endpoint> ParseHostPort(std::string_view s) { return ::ferry::ParseHostPort(s, 1); }

Result<HttpReply> PostJson(const Endpoint& ep, const std::string& path, const Json& body,
                           const std::string& secret, std::chrono::milliseconds timeout,
                           std::chrono::milliseconds read_timeout) {
    const std::string text = body.dump();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto backoff = std::chrono::milliseconds(20);
    std::string last_error;
    for (;;) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        http::ClientRequest req = http::PostRequest(ep, path, text);
        if (!secret.empty()) {
            req.headers.push_back({"Authorization", SignRequest(secret, "POST", path, text)});
        }
        // One attempt: connecting (bounded by what is left, 50 ms..2 s) and the answer.
        auto connect =
            std::clamp(left, std::chrono::milliseconds(50), std::chrono::milliseconds(2000));
        req.timeout = connect + read_timeout;
        Result<http::ClientReply> r = http::Fetch(req);
        if (r.ok()) {
            if (r->status < 500) {
                HttpReply reply;
                reply.status = r->status;
                if (!r->body.empty()) {
                    reply.body = Json::parse(r->body, nullptr, /*allow_exceptions=*/false);
                    if (reply.body.is_discarded()) {
                        return UnavailableError("store at " + ep.host + ":" +
                                                std::to_string(ep.port) + path + " answered HTTP " +
                                                std::to_string(r->status) +
                                                " with a body that is not JSON");
                    }
                }
                return reply;
            }
            last_error = "HTTP " + std::to_string(r->status);
        } else {
            last_error = r.status().message();
        }
        if (std::chrono::steady_clock::now() + backoff >= deadline) {
            return UnavailableError("store at " + ep.host + ":" + std::to_string(ep.port) +
                                    " unreachable for " + path + ": " + last_error);
        }
        std::this_thread::sleep_for(backoff);
        backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
    }
}

Result<RawReply> RawPost(const Endpoint& ep, const std::string& path, const std::string& body,
                         std::chrono::milliseconds connect_timeout,
                         std::chrono::milliseconds read_timeout,
                         const std::function<bool(std::string_view)>& on_data,
                         const std::string& authorization) {
    http::ClientRequest req = http::PostRequest(ep, path, body);
    if (!authorization.empty()) req.headers.push_back({"Authorization", authorization});
    FERRY_ASSIGN_OR_RETURN(
        http::ClientReply r,
        http::FetchStreaming(req, connect_timeout + read_timeout, read_timeout, on_data));
    RawReply reply;
    reply.status = r.status;
    reply.body = std::move(r.body);
    return reply;
}

Status ReplyError(const HttpReply& r, std::string_view what) {
    std::string msg;
    if (r.body.is_object()) {
        const Json& e = r.body.contains("error") ? r.body["error"] : r.body;
        if (e.is_object() && e.contains("message") && e["message"].is_string()) {
            msg = e["message"].get<std::string>();
        } else if (e.is_string()) {
            msg = e.get<std::string>();
        } else if (r.body.contains("message") && r.body["message"].is_string()) {
            msg = r.body["message"].get<std::string>();
        }
    }
    std::string text =
        std::string(what) + ": HTTP " + std::to_string(r.status) + (msg.empty() ? "" : ": " + msg);
    switch (r.status) {
        case 400:
            return InvalidArgumentError(text);
        case 401:
        case 403:
            return PermissionDeniedError(text);
        case 404:
            return NotFoundError(text);
        case 413:
        case 429:
            return ResourceExhaustedError(text);
        default:
            return UnavailableError(text);
    }
}

}  // namespace ferry::discovery
