// ferry discovery: where agents publish their metadata under their name and find each other.
//
// One interface, two stores:
//   http://HOST:PORT  the embedded store (StoreServer): runs inside the proxy, or alone as
//                     `ferry discovery --listen 127.0.0.1:PORT`. Zero set-up.
//   etcd://HOST:PORT  an etcd v3 server (its JSON gateway), for clusters that already run one.
//
// Keys are strings (1..1024 bytes), values bytes (up to 16 MiB). A value put with a lease lives
// as long as the lease is kept alive: a process that dies stops renewing it, and its entries are
// gone within the lease's TTL. With a deployment secret every call carries an HMAC proof of it
// (never the secret itself); a store that was given the secret refuses calls without one.
//
// Thread-safe: one MetadataStore may be used from several threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/status.h"

namespace ferry {

using LeaseId = int64_t;  // 0 = no lease

struct StoreOptions {
    // Deployment secret ("" = none). Embedded store: every request carries
    // `Authorization: Ferry-HMAC ...` (see docs/discovery.md). etcd: values are sealed with an
    // HMAC tag and entries that do not verify are ignored; access to etcd itself is etcd's
    // (users, TLS).
    std::string secret{};
    // Per call, including retries. Transient failures (connection refused, 5xx) are retried
    // with backoff until it runs out; a Watch waits for at most its own timeout on top.
    std::chrono::milliseconds timeout{5000};
};

struct StoreEntry {
    std::string key;
    std::string value;
    LeaseId lease = 0;
    uint64_t revision = 0;  // the store revision of the entry's last change
};

struct StoreEvent {
    enum class Type { kPut, kDelete };
    Type type = Type::kPut;
    std::string key;
    std::string value;  // kPut only
    uint64_t revision = 0;
};

struct WatchResult {
    std::vector<StoreEvent> events;  // in revision order
    // Pass as `after` to the next Watch. If the store compacted the revisions asked for, the
    // events are empty and `compacted` is set: List again, then watch after its revision.
    uint64_t revision = 0;
    bool compacted = false;
};

class MetadataStore {
  public:
    // "http://host:port" or "etcd://host:port". InvalidArgument for anything else.
    static Result<std::unique_ptr<MetadataStore>> Open(std::string_view url,
                                                       StoreOptions options = {});
    virtual ~MetadataStore() = default;

    virtual const std::string& url() const = 0;

    // Leases: entries put with one are deleted when it expires or is revoked.
    virtual Result<LeaseId> GrantLease(std::chrono::milliseconds ttl) = 0;
    // Renews for another TTL. NotFound if the lease has expired (or the store lost it).
    virtual Status KeepAlive(LeaseId lease) = 0;
    virtual Status RevokeLease(LeaseId lease) = 0;
    // Time left before the lease expires; NotFound if it has.
    virtual Result<std::chrono::milliseconds> LeaseTimeLeft(LeaseId lease) = 0;

    virtual Status Put(std::string_view key, std::string_view value, LeaseId lease = 0) = 0;
    // NotFound for a missing key.
    virtual Result<StoreEntry> Get(std::string_view key) = 0;
    // Every entry whose key starts with `prefix`, by key, and the store revision they are at.
    virtual Result<std::vector<StoreEntry>> List(std::string_view prefix,
                                                 uint64_t* revision = nullptr) = 0;
    // NotFound for a missing key.
    virtual Status Delete(std::string_view key) = 0;
    // Changes under `prefix` after revision `after`: returns as soon as there are some, or with
    // none after `timeout` (a long poll).
    virtual Result<WatchResult> Watch(std::string_view prefix, uint64_t after,
                                      std::chrono::milliseconds timeout) = 0;
};

// The embedded store: an HTTP+JSON service on its own threads. Binds loopback by default.
struct StoreServerConfig {
    std::string listen_host = "127.0.0.1";
    uint16_t listen_port = 0;  // 0 = pick a free port
    std::string secret{};      // "" = no authentication
    size_t max_value_bytes = 16u << 20;
    size_t max_keys = 100000;
    size_t history = 10000;  // events kept for Watch
    // ... and their keys and values in bytes at most. A put or delete of a key releases the
    // value of its previous event (watchers get the newer one), so the history of one key
    // holds one value, and a deleted key's value is gone.
    size_t history_bytes = 64u << 20;
    // A connection must deliver a complete request within this long of connecting or of its
    // previous response, else it is closed. Served event-driven: an idle or slow connection
    // costs a socket, never a thread.
    std::chrono::milliseconds request_deadline{10000};
    // With a secret: a fresh connection must deliver its first request within this long, and a
    // request that fails authentication closes its connection.
    std::chrono::milliseconds auth_grace{2000};
    // Long-poll watches open at once per client address (429 beyond).
    size_t max_watches_per_client = 64;
    // Request bodies being read or handled at once, over all connections (503 beyond).
    size_t max_inflight_body_bytes = 128u << 20;
    // Checks a value before it is stored (400 with its message if not OK). `ferry discovery`
    // checks that entries under "ferry/agents/" are metadata blobs of the agent they name.
    std::function<Status(std::string_view key, std::string_view value)> validate{};
};

struct StoreServerStats {
    size_t keys = 0;
    size_t history_events = 0;
    size_t history_bytes = 0;
    size_t watches = 0;
    uint64_t watches_refused = 0;  // over max_watches_per_client
    uint64_t unauthorized = 0;     // requests refused for the secret
    uint64_t connections_open = 0;
    uint64_t connections_timed_out = 0;  // closed for not delivering a request in time
};

class StoreServer {
  public:
    static Result<std::unique_ptr<StoreServer>> Start(StoreServerConfig config);
    ~StoreServer();
    StoreServer(const StoreServer&) = delete;
    StoreServer& operator=(const StoreServer&) = delete;

    uint16_t port() const;
    StoreServerStats Stats() const;
    // "http://host:port", for MetadataStore::Open and AgentConfig.store.
    std::string url() const;
    // Stops serving; idempotent. Blocked watches return.
    void Stop();
    // One request body for `path` ("/v1/kv/put"...) served as an authorized HTTP request would
    // be, without the socket: the HTTP status and the JSON answer. For the fuzzer and tests.
    std::pair<int, std::string> ServeForTesting(const std::string& path, std::string_view body);

    class Impl;

  private:
    explicit StoreServer(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

// Turns on etcd's authentication for a ferry deployment (run once, by an operator): a root user
// with `root_password`, and a user "ferry" whose password is derived from the deployment secret
// (HMAC-SHA256, so the secret never reaches etcd), allowed to read and write "ferry/" only. From
// then on every call of a MetadataStore opened with that secret carries an etcd token, and calls
// without one are refused. Idempotent. `ferry discovery etcd-setup` runs it.
Status SetUpEtcdAuth(std::string_view url, std::string_view secret, std::string_view root_password);

// Where agents register: "ferry/agents/<name>".
std::string AgentKey(std::string_view name);
inline constexpr std::string_view kAgentPrefix = "ferry/agents/";

}  // namespace ferry
