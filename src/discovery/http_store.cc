// The embedded store's client (docs/discovery.md): every MetadataStore call as one HTTP+JSON
// request to a StoreServer (discovery/embedded_store.cc), within the store options' deadlines.
#include <chrono>
#include <string>

#include "core/json_fields.h"
#include "core/log.h"
#include "discovery/http_json.h"
#include "discovery/stores.h"
#include "ferry/discovery.h"
#include "http/http.h"

namespace ferry {

using discovery::Json;

namespace discovery {
namespace {

class HttpStore final : public MetadataStore {
  public:
    HttpStore(std::string url, Endpoint ep, StoreOptions options)
        : url_(std::move(url)), ep_(std::move(ep)), options_(std::move(options)) {}

    const std::string& url() const override { return url_; }

    Result<LeaseId> GrantLease(std::chrono::milliseconds ttl) override {
        return Guarded([&]() -> Result<LeaseId> {
            FERRY_ASSIGN_OR_RETURN(Json r, Call("/v1/lease/grant", {{"ttl_ms", ttl.count()}}));
            return r.at("lease").get<LeaseId>();
        });
    }
    Status KeepAlive(LeaseId lease) override {
        return Call("/v1/lease/keepalive", {{"lease", lease}}).status();
    }
    Status RevokeLease(LeaseId lease) override {
        return Call("/v1/lease/revoke", {{"lease", lease}}).status();
    }
    Result<std::chrono::milliseconds> LeaseTimeLeft(LeaseId lease) override {
        return Guarded([&]() -> Result<std::chrono::milliseconds> {
            FERRY_ASSIGN_OR_RETURN(Json r, Call("/v1/lease/ttl", {{"lease", lease}}));
            return std::chrono::milliseconds(r.at("ttl_left_ms").get<int64_t>());
        });
    }
    Status Put(std::string_view key, std::string_view value, LeaseId lease) override {
        Json b{{"key", std::string(key)}, {"value", Base64Encode(value)}};
        if (lease != 0) b["lease"] = lease;
        return Call("/v1/kv/put", b).status();
    }
    Result<StoreEntry> Get(std::string_view key) override {
        return Guarded([&]() -> Result<StoreEntry> {
            FERRY_ASSIGN_OR_RETURN(Json r, Call("/v1/kv/get", {{"key", std::string(key)}}));
            return ToEntry(r);
        });
    }
    Result<std::vector<StoreEntry>> List(std::string_view prefix, uint64_t* revision) override {
        return Guarded([&]() { return ListImpl(prefix, revision); });
    }
    Result<std::vector<StoreEntry>> ListImpl(std::string_view prefix, uint64_t* revision) {
        FERRY_ASSIGN_OR_RETURN(Json r, Call("/v1/kv/list", {{"prefix", std::string(prefix)}}));
        std::vector<StoreEntry> out;
        for (const Json& e : r.at("entries")) {
            FERRY_ASSIGN_OR_RETURN(StoreEntry entry, ToEntry(e));
            out.push_back(std::move(entry));
        }
        if (revision) *revision = r.at("revision").get<uint64_t>();
        return out;
    }
    Status Delete(std::string_view key) override {
        return Call("/v1/kv/delete", {{"key", std::string(key)}}).status();
    }
    Result<WatchResult> Watch(std::string_view prefix, uint64_t after,
                              std::chrono::milliseconds timeout) override {
        return Guarded([&]() { return WatchImpl(prefix, after, timeout); });
    }
    Result<WatchResult> WatchImpl(std::string_view prefix, uint64_t after,
                                  std::chrono::milliseconds timeout) {
        timeout = std::min(timeout, std::chrono::milliseconds(kMaxWatchPoll));
        FERRY_ASSIGN_OR_RETURN(Json r, Call("/v1/watch",
                                            {{"prefix", std::string(prefix)},
                                             {"after", after},
                                             {"timeout_ms", timeout.count()}},
                                            timeout + std::chrono::seconds(5)));
        WatchResult w;
        w.revision = r.at("revision").get<uint64_t>();
        w.compacted = r.value("compacted", false);
        for (const Json& e : r.at("events")) {
            StoreEvent ev;
            ev.type = e.at("type").get<std::string>() == "put" ? StoreEvent::Type::kPut
                                                               : StoreEvent::Type::kDelete;
            ev.key = e.at("key").get<std::string>();
            ev.revision = e.at("revision").get<uint64_t>();
            if (ev.type == StoreEvent::Type::kPut) {
                FERRY_ASSIGN_OR_RETURN(ev.value, Base64Decode(e.at("value").get<std::string>()));
            }
            w.events.push_back(std::move(ev));
        }
        return w;
    }

  private:
    // A reply missing a field or with the wrong type is the store's fault, not a crash.
    template <typename F>
    auto Guarded(F f) -> decltype(f()) {
        try {
            return f();
        } catch (const Json::exception& e) {
            return UnavailableError("discovery " + url_ + ": malformed reply: " + e.what());
        }
    }

    static Result<StoreEntry> ToEntry(const Json& r) {
        StoreEntry e;
        e.key = r.at("key").get<std::string>();
        FERRY_ASSIGN_OR_RETURN(e.value, Base64Decode(r.at("value").get<std::string>()));
        e.lease = r.value("lease", LeaseId{0});
        e.revision = r.value("revision", uint64_t{0});
        return e;
    }

    Result<Json> Call(const std::string& path, const Json& body,
                      std::chrono::milliseconds read_timeout = std::chrono::milliseconds(0)) {
        if (read_timeout.count() == 0) read_timeout = options_.timeout;
        FERRY_ASSIGN_OR_RETURN(HttpReply r, PostJson(ep_, path, body, options_.secret,
                                                     options_.timeout, read_timeout));
        if (r.status != 200) {
            return ReplyError(r, "discovery " + url_ + path);
        }
        if (!r.body.is_object()) {
            return UnavailableError("discovery " + url_ + path + ": reply is not a JSON object");
        }
        return r.body;
    }

    const std::string url_;
    const Endpoint ep_;
    const StoreOptions options_;
};

}  // namespace

std::unique_ptr<MetadataStore> MakeHttpStore(std::string url, Endpoint ep, StoreOptions options) {
    return std::make_unique<HttpStore>(std::move(url), std::move(ep), std::move(options));
}

}  // namespace discovery
}  // namespace ferry
