// The embedded store: an in-memory key-value store with leases, revisions and long-poll watches,
// served over HTTP+JSON (StoreServer; its client is discovery/http_store.cc). Protocol:
// docs/discovery.md.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/crypto.h"
#include "core/host_port.h"
#include "core/json_depth.h"
#include "core/json_fields.h"
#include "core/log.h"
#include "discovery/http_json.h"
#include "discovery/stores.h"
#include "ferry/discovery.h"
#include "http/http.h"

namespace ferry {

using discovery::Json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kMaxKeyBytes = 1024;
constexpr auto kClockSkew = std::chrono::seconds(30);
constexpr std::chrono::milliseconds kMaxLeaseTtl = std::chrono::hours(24);
constexpr int kMaxJsonDepth = 16;  // the protocol's bodies are flat objects

// A client error: the HTTP status and the message of the JSON error object.
struct HttpError {
    int status;
    std::string message;
};

Json ErrorBody(const HttpError& e) {
    return Json{{"error", {{"code", e.status}, {"message", e.message}}}};
}

// Field accessors that say which field is wrong (JsonFields' words), as an HTTP error.
std::string StringField(const Json& body, const char* name, size_t max, bool required = true) {
    JsonFields f(body);
    if (!required && !f.Has(name)) return {};
    Result<std::string> v = f.String(name, SIZE_MAX);
    if (!v.ok()) throw HttpError{400, v.status().message()};
    if (v->size() > max) {
        throw HttpError{413, f.Bad(name, fmt::format("is longer than {} bytes", max)).message()};
    }
    return std::move(v).value();
}

int64_t IntField(const Json& body, const char* name, bool required = true) {
    JsonFields f(body);
    if (!required && !f.Has(name)) return 0;
    Result<int64_t> v = f.Int(name, INT64_MIN, INT64_MAX);
    if (!v.ok()) throw HttpError{400, v.status().message()};
    return *v;
}

std::string KeyField(const Json& body, const char* name = "key", bool allow_empty = false) {
    std::string k = StringField(body, name, kMaxKeyBytes);
    if (k.empty() && !allow_empty) {
        throw HttpError{400, JsonFields(body).Bad(name, "must not be empty").message()};
    }
    return k;
}

}  // namespace

// --- Server -----------------------------------------------------------------------------------

class StoreServer::Impl {
  public:
    explicit Impl(StoreServerConfig config) : config_(std::move(config)) {}

    Status Start() {
        routes_["/v1/lease/grant"] = {{"ttl_ms"}, [this](const Json& b) { return Grant(b); }};
        routes_["/v1/lease/keepalive"] = {{"lease"},
                                          [this](const Json& b) { return KeepAlive(b); }};
        routes_["/v1/lease/revoke"] = {{"lease"}, [this](const Json& b) { return Revoke(b); }};
        routes_["/v1/lease/ttl"] = {{"lease"}, [this](const Json& b) { return TimeLeft(b); }};
        routes_["/v1/kv/put"] = {{"key", "value", "lease"},
                                 [this](const Json& b) { return Put(b); }};
        routes_["/v1/kv/get"] = {{"key"}, [this](const Json& b) { return Get(b); }};
        routes_["/v1/kv/list"] = {{"prefix"}, [this](const Json& b) { return List(b); }};
        routes_["/v1/kv/delete"] = {{"key"}, [this](const Json& b) { return Delete(b); }};
        // A watch answers at once only when it has news (ServeForTesting); over HTTP it waits.
        routes_["/v1/watch"] = {{"prefix", "after", "timeout_ms"}, [this](const Json& b) {
                                    std::lock_guard<std::mutex> lock(mu_);
                                    return WatchNowLocked(ParseWatch(b), /*final=*/true).value();
                                }};

        http::ServerConfig sc;
        sc.name = "discovery";
        sc.host = config_.listen_host;
        sc.port = config_.listen_port;
        sc.io_threads = 2;
        sc.max_body_bytes = config_.max_value_bytes * 4 / 3 + 64 * 1024;
        sc.request_deadline = config_.request_deadline;
        if (!config_.secret.empty()) sc.first_request_deadline = config_.auth_grace;
        sc.max_inflight_body_bytes = config_.max_inflight_body_bytes;
        sc.error_reply = [](int status, const std::string& message) {
            return JsonReply(status, ErrorBody(HttpError{status, message}));
        };
        std::vector<http::Route> routes;
        routes.push_back({"GET", "/health", [](std::shared_ptr<http::Exchange> ex) {
                              ex->Reply(JsonReply(200, Json{{"status", "ok"}}));
                          }});
        for (const auto& entry : routes_) {
            const std::string path = entry.first;
            http::Route r;
            r.method = "POST";
            r.path = path;
            r.handler = [this, path](std::shared_ptr<http::Exchange> ex) { Handle(path, ex); };
            r.admit = [this](const http::Request& head) { return Admit(head); };
            routes.push_back(std::move(r));
        }
        auto server = http::Server::Start(std::move(sc), std::move(routes));
        if (!server.ok()) {
            return UnavailableError("discovery: " + server.status().message());
        }
        server_ = std::move(*server);
        port_ = static_cast<uint16_t>(server_->port());
        reaper_ = std::thread([this] { Reap(); });
        return Status::Ok();
    }

    void Stop() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (stopped_) return;
            stopped_ = true;
            // Blocked watches return (with what they have).
            for (auto& [id, w] : watchers_) {
                w.ex->Reply(JsonReply(200, *WatchNowLocked(w.spec, /*final=*/true)));
            }
            watchers_.clear();
            watches_by_client_.clear();
        }
        reap_cv_.notify_all();
        if (server_) server_->Stop();
        if (reaper_.joinable()) reaper_.join();
    }

    uint16_t port() const { return port_; }
    const StoreServerConfig& config() const { return config_; }

    StoreServerStats Stats() const {
        StoreServerStats st;
        {
            std::lock_guard<std::mutex> lock(mu_);
            st.keys = kv_.size();
            st.history_events = history_.size();
            st.history_bytes = history_bytes_;
            st.watches = watchers_.size();
            st.watches_refused = watches_refused_;
            st.unauthorized = unauthorized_;
        }
        if (server_) {
            http::ServerStats hs = server_->Stats();
            st.connections_open = hs.connections_open;
            st.connections_timed_out = hs.timed_out;
        }
        return st;
    }

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
    struct HistoryEvent {
        StoreEvent event;
        // A later event of the same key made this one moot (a put overwritten, a key deleted):
        // its value is released and watchers skip it, since they get the later one.
        bool superseded = false;
    };
    struct WatchSpec {
        std::string prefix;
        uint64_t after = 0;
        std::chrono::milliseconds timeout{0};
    };
    struct Watcher {
        WatchSpec spec;
        Clock::time_point deadline;
        std::shared_ptr<http::Exchange> ex;
        std::string client;
    };

    static http::Reply JsonReply(int status, const Json& body) {
        http::Reply r;
        r.status = status;
        r.body = DumpJson(body);
        return r;
    }

    // The client a watch counts against: the address without the port.
    static std::string ClientOf(const std::string& remote) { return HostOf(remote); }

    // Before the body is read: a store with a secret reads bodies only of requests that carry
    // a well-formed, fresh Authorization (the MAC itself covers the body, checked after).
    std::optional<http::Reply> Admit(const http::Request& head) {
        if (config_.secret.empty()) return std::nullopt;
        const std::string* auth = head.Find("Authorization");
        Status ok = discovery::PrecheckRequest(auth ? *auth : std::string(), kClockSkew);
        if (ok.ok()) return std::nullopt;
        return Unauthorized(head, ok.message());
    }

    http::Reply Unauthorized(const http::Request& req, const std::string& why) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            ++unauthorized_;
        }
        FERRY_LOG(kWarn, "discovery: refused {} {} from {}: {}", req.method, req.path.substr(0, 64),
                  req.remote, why);
        http::Reply r = JsonReply(401, ErrorBody(HttpError{401, why}));
        r.headers.push_back({"Connection", "close"});  // an unauthenticated client goes
        return r;
    }

    void Handle(const std::string& path, const std::shared_ptr<http::Exchange>& ex) {
        const http::Request& req = ex->request();
        if (!config_.secret.empty()) {
            Status ok = Authorize(req);
            if (!ok.ok()) return ex->Reply(Unauthorized(req, ok.message()));
        }
        if (path != "/v1/watch") {
            auto [status, body] = Serve(path, req.body);
            return ex->Reply(JsonReply(status, body));
        }
        // A long poll: answered now if there is news, else parked until there is, its
        // timeout, or the store stops. No thread waits for it.
        auto parsed = Parse(path, req.body);
        if (parsed.first != 200) return ex->Reply(JsonReply(parsed.first, parsed.second));
        WatchSpec spec;
        try {
            spec = ParseWatch(parsed.second);
        } catch (const HttpError& e) {
            return ex->Reply(JsonReply(e.status, ErrorBody(e)));
        }
        std::string client = ClientOf(req.remote);
        std::unique_lock<std::mutex> lock(mu_);
        if (auto now = WatchNowLocked(spec, spec.timeout.count() == 0 || stopped_)) {
            return ex->Reply(JsonReply(200, *now));
        }
        size_t& mine = watches_by_client_[client];
        if (mine >= config_.max_watches_per_client) {
            ++watches_refused_;
            if (mine == 0) watches_by_client_.erase(client);
            return ex->Reply(JsonReply(
                429, ErrorBody(HttpError{429, "client " + client + " already has " +
                                                  std::to_string(mine) + " watches open (at most " +
                                                  std::to_string(config_.max_watches_per_client) +
                                                  ")"})));
        }
        ++mine;
        uint64_t id = ++next_watch_id_;
        watchers_[id] = Watcher{spec, Clock::now() + spec.timeout, ex, client};
        lock.unlock();  // OnClose runs its function at once if the client is already gone
        ex->OnClose([this, id] {
            std::lock_guard<std::mutex> lock(mu_);
            DropWatcherLocked(id);
        });
    }

    void DropWatcherLocked(uint64_t id) {
        auto it = watchers_.find(id);
        if (it == watchers_.end()) return;
        auto c = watches_by_client_.find(it->second.client);
        if (c != watches_by_client_.end() && --c->second == 0) watches_by_client_.erase(c);
        watchers_.erase(it);
    }

  public:
    // One request as the HTTP handler serves it, after authorization: the status and the JSON
    // answer (an error object for anything but 200).
    std::pair<int, Json> Serve(const std::string& path, std::string_view text) {
        auto parsed = Parse(path, text);
        if (parsed.first != 200) return parsed;
        auto route = routes_.find(path);
        try {
            return {200, route->second.handler(parsed.second)};
        } catch (const HttpError& e) {
            return Error(e);
        } catch (const Json::exception& e) {
            return Error(HttpError{400, std::string("bad request: ") + e.what()});
        }
    }

  private:
    // The body as a JSON object with only the route's fields, or the error to answer.
    std::pair<int, Json> Parse(const std::string& path, std::string_view text) {
        auto route = routes_.find(path);
        if (route == routes_.end()) {
            return Error(HttpError{404, "no such endpoint: " + path.substr(0, 64)});
        }
        // Depth first: a body of 15 MiB of '[' must not become a tree of 15 million arrays.
        if (!JsonDepthWithin(text, kMaxJsonDepth)) {
            return Error(HttpError{400, "request body nests deeper than " +
                                            std::to_string(kMaxJsonDepth) + " levels"});
        }
        Json body = Json::parse(text, nullptr, /*allow_exceptions=*/false);
        if (body.is_discarded() || !body.is_object()) {
            return Error(HttpError{400, "request body is not a JSON object"});
        }
        const std::vector<std::string>& fields = route->second.fields;
        for (const auto& item : body.items()) {
            if (std::find(fields.begin(), fields.end(), item.key()) == fields.end()) {
                return Error(HttpError{400, "unknown field '" + item.key().substr(0, 64) + "'"});
            }
        }
        return {200, std::move(body)};
    }

    static std::pair<int, Json> Error(const HttpError& e) { return {e.status, ErrorBody(e)}; }

    struct RouteEntry {
        std::vector<std::string> fields;
        std::function<Json(const Json&)> handler;
    };
    std::map<std::string, RouteEntry> routes_;  // set up in Start, read-only after

    Status Authorize(const http::Request& req) {
        const std::string* header = req.Find("Authorization");
        auto nonce = discovery::VerifyRequest(config_.secret, header ? *header : std::string(),
                                              req.method, req.path, req.body, kClockSkew);
        if (!nonce.ok()) return nonce.status();
        std::lock_guard<std::mutex> lock(mu_);
        auto now = Clock::now();
        while (!nonce_order_.empty() && nonce_order_.front().first < now - 2 * kClockSkew) {
            nonces_.erase(nonce_order_.front().second);
            nonce_order_.pop_front();
        }
        if (!nonces_.insert(*nonce).second) {
            return PermissionDeniedError("Authorization: replayed request");
        }
        nonce_order_.emplace_back(now, *nonce);
        return Status::Ok();
    }

    static size_t EventBytes(const StoreEvent& e) { return e.key.size() + e.value.size() + 64; }

    // Under mu_. Appends the event, bumps the revision, supersedes the key's previous event,
    // trims the history to its bounds (events and bytes), answers the watches it concerns.
    uint64_t Record(StoreEvent::Type type, const std::string& key, const std::string& value) {
        ++revision_;
        auto last = last_event_.find(key);
        if (last != last_event_.end() && !history_.empty() &&
            last->second >= history_.front().event.revision) {
            HistoryEvent& old = history_[last->second - history_.front().event.revision];
            if (!old.superseded) {
                old.superseded = true;
                history_bytes_ -= old.event.value.size();
                std::string().swap(old.event.value);
            }
        }
        history_.push_back(HistoryEvent{StoreEvent{type, key, value, revision_}, false});
        history_bytes_ += EventBytes(history_.back().event);
        last_event_[key] = revision_;
        while (!history_.empty() &&
               (history_.size() > config_.history ||
                (history_bytes_ > config_.history_bytes && history_.size() > 1))) {
            HistoryEvent& front = history_.front();
            history_bytes_ -= front.superseded ? EventBytes(front.event) - front.event.value.size()
                                               : EventBytes(front.event);
            auto it = last_event_.find(front.event.key);
            if (it != last_event_.end() && it->second == front.event.revision) {
                last_event_.erase(it);
            }
            history_.pop_front();
        }
        // Wake the watches this event concerns.
        for (auto it = watchers_.begin(); it != watchers_.end();) {
            const Watcher& w = it->second;
            if (key.compare(0, w.spec.prefix.size(), w.spec.prefix) == 0 ||
                (!history_.empty() && w.spec.after + 1 < history_.front().event.revision)) {
                if (auto answer = WatchNowLocked(w.spec, /*final=*/false)) {
                    w.ex->Reply(JsonReply(200, *answer));
                    auto next = std::next(it);
                    DropWatcherLocked(it->first);
                    it = next;
                    continue;
                }
            }
            ++it;
        }
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

    // Expires leases and answers watches whose time is up.
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
            for (auto it = watchers_.begin(); it != watchers_.end();) {
                auto next = std::next(it);
                if (it->second.deadline <= now) {
                    it->second.ex->Reply(
                        JsonReply(200, *WatchNowLocked(it->second.spec, /*final=*/true)));
                    DropWatcherLocked(it->first);
                }
                it = next;
            }
            reap_cv_.wait_for(lock, std::chrono::milliseconds(20));
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
        Result<std::string> value = Base64Decode(b64);
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
                    {"value", Base64Encode(e.value)},
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

    static WatchSpec ParseWatch(const Json& b) {
        WatchSpec w;
        w.prefix = KeyField(b, "prefix", /*allow_empty=*/true);
        int64_t after = IntField(b, "after");
        int64_t timeout = IntField(b, "timeout_ms");
        if (after < 0 || timeout < 0 || timeout > discovery::kMaxWatchPoll.count()) {
            throw HttpError{400, "fields 'after' >= 0 and 'timeout_ms' 0.." +
                                     std::to_string(discovery::kMaxWatchPoll.count()) +
                                     " required"};
        }
        w.after = static_cast<uint64_t>(after);
        w.timeout = std::chrono::milliseconds(timeout);
        return w;
    }

    // Under mu_. The answer to a watch now: its events after `after` (superseded ones skipped),
    // or that the history no longer reaches back that far; nullopt when there is no news and
    // the watch is not `final` (it waits on).
    std::optional<Json> WatchNowLocked(const WatchSpec& w, bool final) {
        if (!history_.empty() && w.after + 1 < history_.front().event.revision) {
            return Json{{"revision", revision_}, {"events", Json::array()}, {"compacted", true}};
        }
        Json events = Json::array();
        if (!history_.empty()) {
            // Revisions in the history are consecutive: start right after `after`.
            uint64_t first = history_.front().event.revision;
            size_t start = w.after + 1 > first ? static_cast<size_t>(w.after + 1 - first) : 0;
            for (size_t i = start; i < history_.size(); ++i) {
                const HistoryEvent& h = history_[i];
                const StoreEvent& e = h.event;
                if (h.superseded || e.key.compare(0, w.prefix.size(), w.prefix) != 0) continue;
                Json j{{"type", e.type == StoreEvent::Type::kPut ? "put" : "delete"},
                       {"key", e.key},
                       {"revision", e.revision}};
                if (e.type == StoreEvent::Type::kPut) j["value"] = Base64Encode(e.value);
                events.push_back(std::move(j));
            }
        }
        if (events.empty() && !final) return std::nullopt;
        return Json{{"revision", revision_}, {"events", std::move(events)}, {"compacted", false}};
    }

    const StoreServerConfig config_;
    std::unique_ptr<http::Server> server_;
    std::thread reaper_;
    uint16_t port_ = 0;

    mutable std::mutex mu_;
    std::condition_variable reap_cv_;
    bool stopped_ = false;
    std::map<std::string, Entry> kv_;
    std::map<LeaseId, Lease> leases_;
    uint64_t revision_ = 0;
    std::deque<HistoryEvent> history_;
    size_t history_bytes_ = 0;
    std::map<std::string, uint64_t> last_event_;  // key -> revision of its newest event kept
    std::map<uint64_t, Watcher> watchers_;
    std::map<std::string, size_t> watches_by_client_;
    uint64_t next_watch_id_ = 0;
    uint64_t watches_refused_ = 0;
    uint64_t unauthorized_ = 0;
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
StoreServerStats StoreServer::Stats() const { return impl_->Stats(); }
std::pair<int, std::string> StoreServer::ServeForTesting(const std::string& path,
                                                         std::string_view body) {
    auto [status, reply] = impl_->Serve(path, body);
    return {status, DumpJson(reply)};
}

std::string StoreServer::url() const {
    return "http://" + FormatHostPort(impl_->config().listen_host, impl_->port());
}
void StoreServer::Stop() { impl_->Stop(); }

}  // namespace ferry
