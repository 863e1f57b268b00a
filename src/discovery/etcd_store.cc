// MetadataStore on etcd v3 through its JSON gateway (/v3/kv/*, /v3/lease/*, /v3/watch).
// Keys and values travel base64-encoded; int64 fields come back as JSON strings. With a
// deployment secret, values are sealed: "FSV1" + HMAC-SHA256(secret, key NUL value) + value, and
// entries that do not verify are ignored (etcd's own access control is users and TLS).
#include <algorithm>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/crypto.h"
#include "core/log.h"
#include "discovery/stores.h"

namespace ferry::discovery {
namespace {

constexpr std::string_view kSealMagic = "FSV1";
constexpr std::string_view kEtcdUser = "ferry";

std::string EtcdPassword(std::string_view secret) {
    Digest d = HmacSha256(secret, "ferry-etcd-password-v1");
    return HexEncode(d.data(), d.size());
}

int64_t Int(const Json& j, const char* name, int64_t dflt = 0) {
    if (!j.is_object() || !j.contains(name)) return dflt;
    const Json& v = j[name];
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_string()) return std::stoll(v.get<std::string>());
    throw std::invalid_argument(std::string("field '") + name + "' is not an integer");
}

std::string RangeEnd(std::string prefix) {
    while (!prefix.empty()) {
        if (static_cast<uint8_t>(prefix.back()) != 0xff) {
            prefix.back() = static_cast<char>(static_cast<uint8_t>(prefix.back()) + 1);
            return prefix;
        }
        prefix.pop_back();
    }
    return std::string(1, '\0');  // every key
}

class EtcdStore final : public MetadataStore {
  public:
    EtcdStore(std::string url, Endpoint ep, StoreOptions options)
        : url_(std::move(url)), ep_(std::move(ep)), options_(std::move(options)) {}

    const std::string& url() const override { return url_; }

    Result<LeaseId> GrantLease(std::chrono::milliseconds ttl) override {
        int64_t secs = std::max<int64_t>(1, (ttl.count() + 999) / 1000);
        return Guarded([&]() -> Result<LeaseId> {
            FERRY_ASSIGN_OR_RETURN(Json r, Call("/v3/lease/grant", {{"TTL", secs}}));
            LeaseId id = Int(r, "ID");
            if (id == 0) return UnavailableError("etcd " + url_ + ": lease grant without an ID");
            return id;
        });
    }

    Status KeepAlive(LeaseId lease) override {
        return Guarded([&]() -> Status {
            FERRY_ASSIGN_OR_RETURN(Json r,
                                   Call("/v3/lease/keepalive", {{"ID", std::to_string(lease)}}));
            const Json& res = r.contains("result") ? r["result"] : r;
            if (Int(res, "TTL") <= 0) {
                return NotFoundError("etcd " + url_ + ": lease " + std::to_string(lease) +
                                     " not found (expired?)");
            }
            return Status::Ok();
        });
    }

    Status RevokeLease(LeaseId lease) override {
        return Call("/v3/lease/revoke", {{"ID", std::to_string(lease)}}).status();
    }

    Result<std::chrono::milliseconds> LeaseTimeLeft(LeaseId lease) override {
        return Guarded([&]() -> Result<std::chrono::milliseconds> {
            FERRY_ASSIGN_OR_RETURN(Json r,
                                   Call("/v3/lease/timetolive", {{"ID", std::to_string(lease)}}));
            int64_t ttl = Int(r, "TTL", -1);
            if (ttl < 0) {
                return NotFoundError("etcd " + url_ + ": lease " + std::to_string(lease) +
                                     " not found (expired?)");
            }
            return std::chrono::milliseconds(ttl * 1000);
        });
    }

    Status Put(std::string_view key, std::string_view value, LeaseId lease) override {
        if (key.empty()) return InvalidArgumentError("Put: empty key");
        Json b{{"key", Base64Encode(key)}, {"value", Base64Encode(Seal(key, value))}};
        if (lease != 0) b["lease"] = std::to_string(lease);
        return Call("/v3/kv/put", b).status();
    }

    Result<StoreEntry> Get(std::string_view key) override {
        return Guarded([&]() -> Result<StoreEntry> {
            FERRY_ASSIGN_OR_RETURN(Json r, Call("/v3/kv/range", {{"key", Base64Encode(key)}}));
            if (!r.contains("kvs") || r["kvs"].empty()) {
                return NotFoundError("etcd " + url_ + ": no key '" + std::string(key) + "'");
            }
            return ToEntry(r["kvs"][0]);
        });
    }

    Result<std::vector<StoreEntry>> List(std::string_view prefix, uint64_t* revision) override {
        return Guarded([&]() -> Result<std::vector<StoreEntry>> {
            FERRY_ASSIGN_OR_RETURN(
                Json r,
                Call("/v3/kv/range", {{"key", Base64Encode(prefix.empty() ? std::string(1, '\0')
                                                                          : std::string(prefix))},
                                      {"range_end", Base64Encode(RangeEnd(std::string(prefix)))}}));
            std::vector<StoreEntry> out;
            if (r.contains("kvs")) {
                for (const Json& kv : r["kvs"]) {
                    Result<StoreEntry> e = ToEntry(kv);
                    if (e.ok()) {
                        out.push_back(std::move(*e));
                    } else if (e.status().code() != Code::kPermissionDenied) {
                        return e.status();
                    }
                }
            }
            if (revision) *revision = static_cast<uint64_t>(Int(r["header"], "revision"));
            return out;
        });
    }

    Status Delete(std::string_view key) override {
        return Guarded([&]() -> Status {
            FERRY_ASSIGN_OR_RETURN(Json r,
                                   Call("/v3/kv/deleterange", {{"key", Base64Encode(key)}}));
            if (Int(r, "deleted") == 0) {
                return NotFoundError("etcd " + url_ + ": no key '" + std::string(key) + "'");
            }
            return Status::Ok();
        });
    }

    Result<WatchResult> Watch(std::string_view prefix, uint64_t after,
                              std::chrono::milliseconds timeout) override {
        // One watch stream per call: created, then events from `after + 1` (history first), read
        // until the first batch of events or the timeout.
        Json create{
            {"key", Base64Encode(prefix.empty() ? std::string(1, '\0') : std::string(prefix))},
            {"range_end", Base64Encode(RangeEnd(std::string(prefix)))},
            {"start_revision", std::to_string(after + 1)}};
        std::string body = Json{{"create_request", create}}.dump();
        std::string buf;
        WatchResult out;
        out.revision = after;
        Status failure;
        bool done = false;
        auto on_data = [&](std::string_view data) {
            buf.append(data);
            size_t start = 0;
            for (;;) {
                size_t end = CompleteObject(buf, start);
                if (end == std::string::npos) break;
                Json msg = Json::parse(buf.substr(start, end - start), nullptr, false);
                start = end;
                if (msg.is_discarded()) {
                    failure = UnavailableError("etcd " + url_ + ": malformed watch message");
                    done = true;
                    break;
                }
                try {
                    Absorb(msg.contains("result") ? msg["result"] : msg, &out, &done, &failure);
                } catch (const std::exception& e) {
                    failure =
                        UnavailableError("etcd " + url_ + ": malformed watch message: " + e.what());
                    done = true;
                }
                if (done) break;
            }
            buf.erase(0, start);
            return !done;
        };
        if (!options_.secret.empty()) {
            FERRY_RETURN_IF_ERROR(
                Call("/v3/kv/range", {{"key", Base64Encode("ferry/")}, {"limit", 1}})
                    .status());  // authenticated, with a fresh token if needed
        }
        Result<RawReply> r =
            RawPost(ep_, "/v3/watch", body, options_.timeout,
                    std::max(timeout, std::chrono::milliseconds(1)), on_data, Token());
        if (!r.ok()) return r.status();
        if (!failure.ok()) return failure;
        if (r->status != 200) {
            return UnavailableError("etcd " + url_ + ": watch answered HTTP " +
                                    std::to_string(r->status));
        }
        return out;
    }

  private:
    template <typename F>
    auto Guarded(F f) -> decltype(f()) {
        try {
            return f();
        } catch (const std::exception& e) {
            return UnavailableError("etcd " + url_ + ": malformed reply: " + e.what());
        }
    }

    // End (exclusive) of the first complete top-level JSON object at or after `from`, or npos.
    static size_t CompleteObject(const std::string& s, size_t from) {
        int depth = 0;
        bool in_string = false, escape = false, started = false;
        for (size_t i = from; i < s.size(); ++i) {
            char c = s[i];
            if (in_string) {
                if (escape)
                    escape = false;
                else if (c == '\\')
                    escape = true;
                else if (c == '"')
                    in_string = false;
                continue;
            }
            if (c == '"')
                in_string = true;
            else if (c == '{') {
                ++depth;
                started = true;
            } else if (c == '}' && --depth == 0 && started)
                return i + 1;
        }
        return std::string::npos;
    }

    void Absorb(const Json& res, WatchResult* out, bool* done, Status* failure) {
        if (res.contains("header")) {
            out->revision = std::max<uint64_t>(
                out->revision, static_cast<uint64_t>(Int(res["header"], "revision")));
        }
        if (Int(res, "compact_revision") > 0 || res.value("canceled", false)) {
            out->compacted = Int(res, "compact_revision") > 0;
            if (!out->compacted) {
                *failure = UnavailableError("etcd " + url_ + ": watch canceled: " +
                                            res.value("cancel_reason", std::string("no reason")));
            }
            out->events.clear();
            *done = true;
            return;
        }
        if (!res.contains("events")) return;  // the "created" message
        uint64_t last = out->revision;
        for (const Json& e : res["events"]) {
            const Json& kv = e.at("kv");
            StoreEvent ev;
            ev.type = e.value("type", std::string("PUT")) == "DELETE" ? StoreEvent::Type::kDelete
                                                                      : StoreEvent::Type::kPut;
            Result<std::string> key = Base64Decode(kv.at("key").get<std::string>());
            if (!key.ok()) continue;
            ev.key = *key;
            ev.revision = static_cast<uint64_t>(Int(kv, "mod_revision"));
            last = std::max(last, ev.revision);
            if (ev.type == StoreEvent::Type::kPut) {
                Result<std::string> v = Base64Decode(kv.value("value", std::string()));
                if (!v.ok()) continue;
                Result<std::string> opened = Open(ev.key, *v);
                if (!opened.ok()) {
                    FERRY_LOG(kWarn, "etcd {}: ignoring key {}: {}", url_, ev.key,
                              opened.status().message());
                    continue;
                }
                ev.value = std::move(*opened);
            }
            out->events.push_back(std::move(ev));
        }
        out->revision = std::max(out->revision, last);
        *done = !out->events.empty();
    }

    std::string Seal(std::string_view key, std::string_view value) const {
        if (options_.secret.empty()) return std::string(value);
        std::string text(key);
        text.push_back('\0');
        text.append(value);
        Digest mac = HmacSha256(options_.secret, text);
        std::string out(kSealMagic);
        out.append(reinterpret_cast<const char*>(mac.data()), mac.size());
        out.append(value);
        return out;
    }

    Result<std::string> Open(std::string_view key, std::string_view stored) const {
        if (options_.secret.empty()) return std::string(stored);
        if (stored.size() < kSealMagic.size() + 32 ||
            stored.substr(0, kSealMagic.size()) != kSealMagic) {
            return PermissionDeniedError("entry '" + std::string(key) +
                                         "' is not sealed with the deployment secret");
        }
        Digest got;
        std::memcpy(got.data(), stored.data() + kSealMagic.size(), got.size());
        std::string_view value = stored.substr(kSealMagic.size() + 32);
        std::string text(key);
        text.push_back('\0');
        text.append(value);
        if (!DigestEqual(got, HmacSha256(options_.secret, text))) {
            return PermissionDeniedError("entry '" + std::string(key) +
                                         "' was sealed with another secret");
        }
        return std::string(value);
    }

    Result<StoreEntry> ToEntry(const Json& kv) const {
        StoreEntry e;
        FERRY_ASSIGN_OR_RETURN(e.key, Base64Decode(kv.at("key").get<std::string>()));
        FERRY_ASSIGN_OR_RETURN(std::string stored, Base64Decode(kv.value("value", std::string())));
        FERRY_ASSIGN_OR_RETURN(e.value, Open(e.key, stored));
        e.lease = Int(kv, "lease");
        e.revision = static_cast<uint64_t>(Int(kv, "mod_revision"));
        return e;
    }

    // With a secret: etcd's own authentication as user "ferry" with a password derived from
    // the secret (never the secret itself). An etcd without authentication enabled answers
    // that it is off; then only the sealing protects the entries.
    Status Authenticate() {
        Json b{{"name", kEtcdUser}, {"password", EtcdPassword(options_.secret)}};
        Result<Json> r = CallOnce("/v3/auth/authenticate", b, "");
        std::lock_guard<std::mutex> lock(auth_mu_);
        if (r.ok()) {
            token_ = r->value("token", std::string());
            auth_off_ = false;
            return token_.empty() ? UnavailableError("etcd " + url_ + ": no token") : Status::Ok();
        }
        if (r.status().message().find("authentication is not enabled") != std::string::npos) {
            auth_off_ = true;
            return Status::Ok();
        }
        return r.status().code() == Code::kUnavailable
                   ? r.status()
                   : PermissionDeniedError("etcd " + url_ + ": authentication as '" +
                                           std::string(kEtcdUser) +
                                           "' refused (wrong deployment "
                                           "secret, or etcd not set up: ferry discovery "
                                           "etcd-setup): " +
                                           r.status().message());
    }

    std::string Token() {
        std::lock_guard<std::mutex> lock(auth_mu_);
        return token_;
    }

    Result<Json> Call(const std::string& path, const Json& body) {
        if (options_.secret.empty()) {
            return CallOnce(path, body, "");
        }
        bool need_auth = false;
        {
            std::lock_guard<std::mutex> lock(auth_mu_);
            need_auth = token_.empty() && !auth_off_;
        }
        if (need_auth) {
            FERRY_RETURN_IF_ERROR(Authenticate());
        }
        Result<Json> r = CallOnce(path, body, Token());
        if (!r.ok() && r.status().code() == Code::kPermissionDenied &&
            (r.status().message().find("token") != std::string::npos ||
             r.status().message().find("user name is empty") != std::string::npos)) {
            // The token expired (etcd's simple tokens live 5 minutes) or etcd restarted.
            FERRY_RETURN_IF_ERROR(Authenticate());
            r = CallOnce(path, body, Token());
        }
        return r;
    }

    Result<Json> CallOnce(const std::string& path, const Json& body, const std::string& token) {
        const std::string text = body.dump();
        const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
        auto backoff = std::chrono::milliseconds(20);
        HttpReply r;
        for (;;) {
            auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now());
            Result<RawReply> raw = RawPost(
                ep_, path, text,
                std::clamp(left, std::chrono::milliseconds(50), std::chrono::milliseconds(2000)),
                std::max(left, std::chrono::milliseconds(50)), nullptr, token);
            Status why;
            if (raw.ok() && raw->status < 500) {
                r.status = raw->status;
                r.body = Json::parse(raw->body, nullptr, /*allow_exceptions=*/false);
                if (r.body.is_discarded()) {
                    return UnavailableError("etcd " + url_ + path + ": reply is not JSON");
                }
                break;
            }
            why = raw.ok() ? UnavailableError("etcd " + url_ + path + ": HTTP " +
                                              std::to_string(raw->status))
                           : raw.status();
            if (std::chrono::steady_clock::now() + backoff >= deadline) {
                return UnavailableError("etcd " + url_ + " unreachable: " + why.message());
            }
            std::this_thread::sleep_for(backoff);
            backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
        }
        if (r.status != 200) {
            Status e = ReplyError(r, "etcd " + url_ + path);
            // etcd's authentication errors come back as 400s and 500s with these texts.
            for (const char* auth : {"user name is empty", "permission denied",
                                     "invalid auth token", "authentication failed"}) {
                if (e.message().find(auth) != std::string::npos) {
                    return PermissionDeniedError(
                        e.message() + (options_.secret.empty()
                                           ? " (this etcd requires the deployment secret)"
                                           : ""));
                }
            }
            return e;
        }
        if (!r.body.is_object()) {
            return UnavailableError("etcd " + url_ + path + ": reply is not a JSON object");
        }
        return r.body;
    }

    const std::string url_;
    const Endpoint ep_;
    const StoreOptions options_;
    std::mutex auth_mu_;
    std::string token_;      // under auth_mu_
    bool auth_off_ = false;  // under auth_mu_: etcd runs without authentication
};

}  // namespace

Status SetUpEtcdAuthAt(const Endpoint& ep, const std::string& url, std::string_view secret,
                       std::string_view root_password) {
    auto call = [&](const std::string& path, const Json& body,
                    const std::string& token) -> Result<Json> {
        FERRY_ASSIGN_OR_RETURN(RawReply raw, RawPost(ep, path, body.dump(), std::chrono::seconds(2),
                                                     std::chrono::seconds(5), nullptr, token));
        HttpReply r{raw.status, Json::parse(raw.body, nullptr, false)};
        if (r.status != 200) return ReplyError(r, "etcd " + url + path);
        return r.body;
    };
    auto tolerate = [](const Result<Json>& r) {
        return r.ok() || r.status().message().find("already exists") != std::string::npos;
    };
    const std::string prefix(kAgentPrefix.substr(0, kAgentPrefix.find('/') + 1));  // "ferry/"
    std::vector<std::pair<std::string, Json>> steps = {
        {"/v3/auth/user/add", {{"name", "root"}, {"password", std::string(root_password)}}},
        {"/v3/auth/user/grant", {{"user", "root"}, {"role", "root"}}},
        {"/v3/auth/role/add", {{"name", "ferry"}}},
        {"/v3/auth/role/grant",
         {{"name", "ferry"},
          {"perm",
           {{"permType", "READWRITE"},
            {"key", Base64Encode(prefix)},
            {"range_end", Base64Encode(RangeEnd(prefix))}}}}},
        {"/v3/auth/user/add",
         {{"name", std::string(kEtcdUser)}, {"password", EtcdPassword(secret)}}},
        {"/v3/auth/user/grant", {{"user", std::string(kEtcdUser)}, {"role", "ferry"}}},
    };
    // Steps after auth is on need root's token; before, none.
    std::string token;
    Result<Json> enabled = call("/v3/auth/authenticate",
                                {{"name", "root"}, {"password", std::string(root_password)}}, "");
    if (enabled.ok()) token = enabled->value("token", std::string());
    for (const auto& [path, body] : steps) {
        Result<Json> r = call(path, body, token);
        if (!tolerate(r)) return r.status();
    }
    if (token.empty()) {
        Result<Json> r = call("/v3/auth/enable", Json::object(), "");
        if (!r.ok()) return r.status();
    }
    return Status::Ok();
}

std::unique_ptr<MetadataStore> MakeEtcdStore(std::string url, Endpoint ep, StoreOptions options) {
    return std::make_unique<EtcdStore>(std::move(url), std::move(ep), std::move(options));
}

}  // namespace ferry::discovery
