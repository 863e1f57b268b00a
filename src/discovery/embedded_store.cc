// The embedded store: an in-memory key-value store with leases, revisions and long-poll watches,
// served over HTTP+JSON (StoreServer), and its client (HttpStore). Protocol: docs/discovery.md.
#include <httplib.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/crypto.h"
#include "core/log.h"
#include "discovery/http_guard.h"
#include "discovery/http_json.h"
#include "discovery/stores.h"
#include "ferry/discovery.h"

namespace ferry {

using discovery::Json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kMaxKeyBytes = 1024;
constexpr auto kClockSkew = std::chrono::seconds(30);
constexpr std::chrono::milliseconds kMaxWatchPoll = std::chrono::seconds(60);
constexpr std::chrono::milliseconds kMaxLeaseTtl = std::chrono::hours(24);

// A client error: the HTTP status and the message of the JSON error object.
struct HttpError {
    int status;
    std::string message;
};

Json ErrorBody(const HttpError& e) {
    return Json{{"error", {{"code", e.status}, {"message", e.message}}}};
}

// Keys and messages may echo a client's bytes: invalid UTF-8 is replaced, not thrown on.
std::string Dump(const Json& body) {
    return body.dump(-1, ' ', false, Json::error_handler_t::replace);
}

void Reply(httplib::Response& res, int status, const Json& body) {
    res.status = status;
    res.set_content(Dump(body), "application/json");
}

void ReplyError(httplib::Response& res, const HttpError& e) { Reply(res, e.status, ErrorBody(e)); }

// Field accessors that say which field is wrong.
std::string StringField(const Json& body, const char* name, size_t max, bool required = true) {
    if (!body.contains(name)) {
        if (!required) return {};
        throw HttpError{400, std::string("missing field '") + name + "'"};
    }
    if (!body[name].is_string()) {
        throw HttpError{400, std::string("field '") + name + "' must be a string"};
    }
    std::string v = body[name].get<std::string>();
    if (v.size() > max) {
        throw HttpError{413, std::string("field '") + name + "' is longer than " +
                                 std::to_string(max) + " bytes"};
    }
    return v;
}

int64_t IntField(const Json& body, const char* name, bool required = true) {
    if (!body.contains(name)) {
        if (!required) return 0;
        throw HttpError{400, std::string("missing field '") + name + "'"};
    }
    if (!body[name].is_number_integer()) {
        throw HttpError{400, std::string("field '") + name + "' must be an integer"};
    }
    return body[name].get<int64_t>();
}

std::string KeyField(const Json& body, const char* name = "key", bool allow_empty = false) {
    std::string k = StringField(body, name, kMaxKeyBytes);
    if (k.empty() && !allow_empty) {
        throw HttpError{400, std::string("field '") + name + "' must not be empty"};
    }
    return k;
}

}  // namespace

// --- Server -----------------------------------------------------------------------------------

class StoreServer::Impl {
  public:
    explicit Impl(StoreServerConfig config)
        : config_(std::move(config)), guard_(config_.request_deadline) {}

    Status Start() {
        server_.new_task_queue = [] { return new httplib::ThreadPool(32); };
        // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which would let a second
        // store bind the same port and silently take half the requests.
        server_.set_socket_options([](socket_t sock) {
            int yes = 1;
            setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
        });
        server_.set_read_timeout(std::chrono::seconds(5));  // a slow client cannot hold a thread
        server_.set_write_timeout(std::chrono::seconds(5));
        server_.set_keep_alive_max_count(100);
        server_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response&) {
            guard_.RequestStarted(req.remote_addr, req.remote_port);
            return httplib::Server::HandlerResponse::Unhandled;
        });
        server_.set_logger([this](const httplib::Request& req, const httplib::Response&) {
            guard_.ResponseDone(req.remote_addr, req.remote_port);
        });
        server_.set_payload_max_length(config_.max_value_bytes * 4 / 3 + 64 * 1024);
        server_.Get("/health", [](const httplib::Request&, httplib::Response& res) {
            Reply(res, 200, Json{{"status", "ok"}});
        });
        Route("/v1/lease/grant", {"ttl_ms"}, [this](const Json& b) { return Grant(b); });
        Route("/v1/lease/keepalive", {"lease"}, [this](const Json& b) { return KeepAlive(b); });
        Route("/v1/lease/revoke", {"lease"}, [this](const Json& b) { return Revoke(b); });
        Route("/v1/lease/ttl", {"lease"}, [this](const Json& b) { return TimeLeft(b); });
        Route("/v1/kv/put", {"key", "value", "lease"}, [this](const Json& b) { return Put(b); });
        Route("/v1/kv/get", {"key"}, [this](const Json& b) { return Get(b); });
        Route("/v1/kv/list", {"prefix"}, [this](const Json& b) { return List(b); });
        Route("/v1/kv/delete", {"key"}, [this](const Json& b) { return Delete(b); });
        Route("/v1/watch", {"prefix", "after", "timeout_ms"},
              [this](const Json& b) { return Watch(b); });
        server_.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
            if (res.body.empty()) {
                std::string why = res.status == 404   ? "no such endpoint: " + req.path
                                  : res.status == 413 ? "request body too large"
                                                      : "request refused";
                ReplyError(res, HttpError{res.status, why});
            }
        });
        int port = config_.listen_port;
        if (port == 0) {
            port = server_.bind_to_any_port(config_.listen_host);
            if (port < 0) {
                return UnavailableError("discovery: cannot bind " + config_.listen_host);
            }
        } else if (!server_.bind_to_port(config_.listen_host, port)) {
            return UnavailableError("discovery: cannot bind " + config_.listen_host + ":" +
                                    std::to_string(port) + " (in use?)");
        }
        port_ = static_cast<uint16_t>(port);
        listener_ = std::thread([this] { server_.listen_after_bind(); });
        guard_.Start(port_);
        reaper_ = std::thread([this] { Reap(); });
        // httplib's stop() is a no-op until the listener runs: wait for it, so Stop never hangs.
        auto end = Clock::now() + std::chrono::seconds(5);
        while (!server_.is_running() && Clock::now() < end) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        return Status::Ok();
    }

    void Stop() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (stopped_) return;
            stopped_ = true;
            changed_.notify_all();
        }
        reap_cv_.notify_all();
        guard_.Stop();
        server_.stop();
        if (listener_.joinable()) listener_.join();
        if (reaper_.joinable()) reaper_.join();
    }

    uint16_t port() const { return port_; }
    const StoreServerConfig& config() const { return config_; }

  private:
    struct Entry {
        std::string value;
        LeaseId lease = 0;
        uint64_t revision = 0;
    };
    struct Lease {
        std::chrono::milliseconds ttl{0};
        Clock::time_point expires;
        std::set<std::string> keys;
    };

    template <typename F>
    void Route(const std::string& path, std::vector<std::string> fields, F handler) {
        routes_[path] = RouteEntry{std::move(fields), handler};
        server_.Post(path, [this, path](const httplib::Request& req, httplib::Response& res) {
            // Here, not in a pre-routing handler: the MAC covers the body, read only by now.
            if (!Authorize(req, res)) {
                return;
            }
            auto [status, body] = Serve(path, req.body);
            Reply(res, status, body);
        });
    }

  public:
    // One request as the HTTP handler serves it, after authorization: the status and the JSON
    // answer (an error object for anything but 200).
    std::pair<int, Json> Serve(const std::string& path, std::string_view text) {
        auto route = routes_.find(path);
        if (route == routes_.end()) {
            return Error(HttpError{404, "no such endpoint: " + path.substr(0, 64)});
        }
        Json body = Json::parse(text, nullptr, /*allow_exceptions=*/false);
        if (body.is_discarded() || !body.is_object()) {
            return Error(HttpError{400, "request body is not a JSON object"});
        }
        const std::vector<std::string>& fields = route->second.fields;
        for (const auto& [name, value] : body.items()) {
            if (std::find(fields.begin(), fields.end(), name) == fields.end()) {
                return Error(HttpError{400, "unknown field '" + name.substr(0, 64) + "'"});
            }
        }
        try {
            return {200, route->second.handler(body)};
        } catch (const HttpError& e) {
            return Error(e);
        } catch (const Json::exception& e) {
            return Error(HttpError{400, std::string("bad request: ") + e.what()});
        }
    }

  private:
    static std::pair<int, Json> Error(const HttpError& e) { return {e.status, ErrorBody(e)}; }

    struct RouteEntry {
        std::vector<std::string> fields;
        std::function<Json(const Json&)> handler;
    };
    std::map<std::string, RouteEntry> routes_;  // set up in Start, read-only after

    bool Authorize(const httplib::Request& req, httplib::Response& res) {
        if (config_.secret.empty() || req.path == "/health") {
            return true;
        }
        auto nonce = discovery::VerifyRequest(config_.secret, req.get_header_value("Authorization"),
                                              req.method, req.path, req.body, kClockSkew);
        if (nonce.ok()) {
            std::lock_guard<std::mutex> lock(mu_);
            auto now = Clock::now();
            while (!nonce_order_.empty() && nonce_order_.front().first < now - 2 * kClockSkew) {
                nonces_.erase(nonce_order_.front().second);
                nonce_order_.pop_front();
            }
            if (nonces_.insert(*nonce).second) {
                nonce_order_.emplace_back(now, *nonce);
                return true;
            }
            nonce = PermissionDeniedError("Authorization: replayed request");
        }
        FERRY_LOG(kWarn, "discovery: refused {} {} from {}: {}", req.method, req.path,
                  req.remote_addr, nonce.status().message());
        ReplyError(res, HttpError{401, nonce.status().message()});
        return false;
    }

    // Under mu_. Appends the event, bumps the revision, wakes watchers.
    uint64_t Record(StoreEvent::Type type, const std::string& key, const std::string& value) {
        ++revision_;
        history_.push_back(StoreEvent{type, key, value, revision_});
        while (history_.size() > config_.history) {
            history_.pop_front();
        }
        changed_.notify_all();
        return revision_;
    }

    void EraseLocked(std::map<std::string, Entry>::iterator it) {
        if (it->second.lease != 0) {
            auto l = leases_.find(it->second.lease);
            if (l != leases_.end()) l->second.keys.erase(it->first);
        }
        std::string key = it->first;
        kv_.erase(it);
        Record(StoreEvent::Type::kDelete, key, {});
    }

    void ExpireLocked(std::map<LeaseId, Lease>::iterator l) {
        for (const std::string& key : l->second.keys) {
            auto it = kv_.find(key);
            if (it != kv_.end() && it->second.lease == l->first) {
                it->second.lease = 0;  // already leaving the lease
                kv_.erase(it);
                Record(StoreEvent::Type::kDelete, key, {});
            }
        }
        leases_.erase(l);
    }

    void Reap() {
        std::unique_lock<std::mutex> lock(mu_);
        while (!stopped_) {
            auto now = Clock::now();
            for (auto l = leases_.begin(); l != leases_.end();) {
                if (l->second.expires <= now) {
                    auto next = std::next(l);
                    ExpireLocked(l);
                    l = next;
                } else {
                    ++l;
                }
            }
            reap_cv_.wait_for(lock, std::chrono::milliseconds(50));
        }
    }

    Json Grant(const Json& b) {
        int64_t ttl = IntField(b, "ttl_ms");
        if (ttl <= 0 || ttl > kMaxLeaseTtl.count()) {
            throw HttpError{400,
                            "field 'ttl_ms' must be 1.." + std::to_string(kMaxLeaseTtl.count())};
        }
        std::lock_guard<std::mutex> lock(mu_);
        LeaseId id = 0;
        while (id <= 0 || leases_.count(id)) {
            id = static_cast<LeaseId>(SecureRandomU64() >> 1);
        }
        Lease& l = leases_[id];
        l.ttl = std::chrono::milliseconds(ttl);
        l.expires = Clock::now() + l.ttl;
        return Json{{"lease", id}, {"ttl_ms", ttl}};
    }

    std::map<LeaseId, Lease>::iterator FindLease(const Json& b) {
        LeaseId id = IntField(b, "lease");
        auto l = leases_.find(id);
        if (l == leases_.end() || l->second.expires <= Clock::now()) {
            throw HttpError{404, "lease " + std::to_string(id) + " not found (expired?)"};
        }
        return l;
    }

    Json KeepAlive(const Json& b) {
        std::lock_guard<std::mutex> lock(mu_);
        auto l = FindLease(b);
        l->second.expires = Clock::now() + l->second.ttl;
        return Json{{"ttl_ms", l->second.ttl.count()}};
    }

    Json Revoke(const Json& b) {
        std::lock_guard<std::mutex> lock(mu_);
        ExpireLocked(FindLease(b));
        return Json{{"revision", revision_}};
    }

    Json TimeLeft(const Json& b) {
        std::lock_guard<std::mutex> lock(mu_);
        auto l = FindLease(b);
        auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(l->second.expires - Clock::now());
        return Json{{"ttl_left_ms", left.count()}, {"ttl_ms", l->second.ttl.count()}};
    }

    Json Put(const Json& b) {
        std::string key = KeyField(b);
        std::string b64 = StringField(b, "value", config_.max_value_bytes * 4 / 3 + 4);
        Result<std::string> value = discovery::Base64Decode(b64);
        if (!value.ok()) {
            throw HttpError{400, "field 'value': " + value.status().message()};
        }
        if (value->size() > config_.max_value_bytes) {
            throw HttpError{413, "value of " + std::to_string(value->size()) +
                                     " bytes exceeds the limit of " +
                                     std::to_string(config_.max_value_bytes)};
        }
        LeaseId lease = IntField(b, "lease", /*required=*/false);
        if (config_.validate) {
            Status ok = config_.validate(key, *value);
            if (!ok.ok()) {
                throw HttpError{400, "value of '" + key + "': " + ok.message()};
            }
        }
        std::lock_guard<std::mutex> lock(mu_);
        if (lease != 0) {
            auto l = leases_.find(lease);
            if (l == leases_.end() || l->second.expires <= Clock::now()) {
                throw HttpError{404, "lease " + std::to_string(lease) + " not found (expired?)"};
            }
        }
        auto it = kv_.find(key);
        if (it == kv_.end() && kv_.size() >= config_.max_keys) {
            throw HttpError{413, "the store holds its maximum of " +
                                     std::to_string(config_.max_keys) + " keys"};
        }
        if (it != kv_.end() && it->second.lease != 0 && it->second.lease != lease) {
            auto old = leases_.find(it->second.lease);
            if (old != leases_.end()) old->second.keys.erase(key);
        }
        Entry& e = kv_[key];
        e.value = *value;
        e.lease = lease;
        if (lease != 0) leases_[lease].keys.insert(key);
        e.revision = Record(StoreEvent::Type::kPut, key, *value);
        return Json{{"revision", e.revision}};
    }

    static Json EntryJson(const std::string& key, const Entry& e) {
        return Json{{"key", key},
                    {"value", discovery::Base64Encode(e.value)},
                    {"lease", e.lease},
                    {"revision", e.revision}};
    }

    Json Get(const Json& b) {
        std::string key = KeyField(b);
        std::lock_guard<std::mutex> lock(mu_);
        auto it = kv_.find(key);
        if (it == kv_.end()) {
            throw HttpError{404, "no key '" + key + "'"};
        }
        return EntryJson(key, it->second);
    }

    Json List(const Json& b) {
        std::string prefix = KeyField(b, "prefix", /*allow_empty=*/true);
        std::lock_guard<std::mutex> lock(mu_);
        Json entries = Json::array();
        for (auto it = kv_.lower_bound(prefix);
             it != kv_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
            entries.push_back(EntryJson(it->first, it->second));
        }
        return Json{{"revision", revision_}, {"entries", std::move(entries)}};
    }

    Json Delete(const Json& b) {
        std::string key = KeyField(b);
        std::lock_guard<std::mutex> lock(mu_);
        auto it = kv_.find(key);
        if (it == kv_.end()) {
            throw HttpError{404, "no key '" + key + "'"};
        }
        EraseLocked(it);
        return Json{{"revision", revision_}};
    }

    Json Watch(const Json& b) {
        std::string prefix = KeyField(b, "prefix", /*allow_empty=*/true);
        int64_t after = IntField(b, "after");
        int64_t timeout = IntField(b, "timeout_ms");
        if (after < 0 || timeout < 0 || timeout > kMaxWatchPoll.count()) {
            throw HttpError{400, "fields 'after' >= 0 and 'timeout_ms' 0.." +
                                     std::to_string(kMaxWatchPoll.count()) + " required"};
        }
        auto deadline = Clock::now() + std::chrono::milliseconds(timeout);
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            if (!history_.empty() && static_cast<uint64_t>(after) + 1 < history_.front().revision) {
                return Json{
                    {"revision", revision_}, {"events", Json::array()}, {"compacted", true}};
            }
            Json events = Json::array();
            for (const StoreEvent& e : history_) {
                if (e.revision <= static_cast<uint64_t>(after) ||
                    e.key.compare(0, prefix.size(), prefix) != 0) {
                    continue;
                }
                Json j{{"type", e.type == StoreEvent::Type::kPut ? "put" : "delete"},
                       {"key", e.key},
                       {"revision", e.revision}};
                if (e.type == StoreEvent::Type::kPut) j["value"] = discovery::Base64Encode(e.value);
                events.push_back(std::move(j));
            }
            if (!events.empty() || stopped_ || Clock::now() >= deadline) {
                return Json{
                    {"revision", revision_}, {"events", std::move(events)}, {"compacted", false}};
            }
            changed_.wait_until(lock, deadline);
        }
    }

    const StoreServerConfig config_;
    discovery::HttpGuard guard_;
    httplib::Server server_;
    std::thread listener_;
    std::thread reaper_;
    uint16_t port_ = 0;

    std::mutex mu_;
    std::condition_variable changed_;
    std::condition_variable reap_cv_;
    bool stopped_ = false;
    std::map<std::string, Entry> kv_;
    std::map<LeaseId, Lease> leases_;
    uint64_t revision_ = 0;
    std::deque<StoreEvent> history_;
    std::set<std::string> nonces_;
    std::deque<std::pair<Clock::time_point, std::string>> nonce_order_;
};

Result<std::unique_ptr<StoreServer>> StoreServer::Start(StoreServerConfig config) {
    if (config.history == 0 || config.max_keys == 0 || config.max_value_bytes == 0) {
        return InvalidArgumentError(
            "StoreServerConfig: history, max_keys and max_value_bytes "
            "must be positive");
    }
    auto impl = std::make_unique<Impl>(std::move(config));
    FERRY_RETURN_IF_ERROR(impl->Start());
    return std::unique_ptr<StoreServer>(new StoreServer(std::move(impl)));
}

StoreServer::StoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StoreServer::~StoreServer() { Stop(); }
uint16_t StoreServer::port() const { return impl_->port(); }
std::pair<int, std::string> StoreServer::ServeForTesting(const std::string& path,
                                                         std::string_view body) {
    auto [status, reply] = impl_->Serve(path, body);
    return {status, Dump(reply)};
}

std::string StoreServer::url() const {
    const std::string& h = impl_->config().listen_host;
    std::string host = h.find(':') != std::string::npos ? "[" + h + "]" : h;
    return "http://" + host + ":" + std::to_string(impl_->port());
}
void StoreServer::Stop() { impl_->Stop(); }

// --- Client -----------------------------------------------------------------------------------

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
