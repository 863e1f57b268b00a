#include "discovery/worker_directory.h"

#include <fmt/core.h>

#include <optional>

#include "core/block_hash.h"
#include "core/json_fields.h"
#include "core/log.h"

namespace ferry {

namespace {
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
}  // namespace

std::string EncodeWorkerRecord(const WorkerRecord& r) {
    Json j{{"url", r.url},
           {"role", r.role},
           {"model", r.model},
           {"tp_size", r.tp_size},
           {"engine_id", r.agent.engine_id},
           {"agent_host", r.agent.host},
           {"agent_port", r.agent.port}};
    if (r.block_size > 0) {
        j["block_hash"] = {{"version", kBlockHashSpecVersion},
                           {"algorithm", kBlockHashAlgorithm},
                           {"seed", r.hash_seed},
                           {"block_size", r.block_size},
                           {"extra_keys", "none"}};
    }
    if (!r.kv_events.empty()) j["kv_events"] = r.kv_events;
    if (!r.kv_events_replay.empty()) j["kv_events_replay"] = r.kv_events_replay;
    return j.dump();
}

Result<WorkerRecord> DecodeWorkerRecord(std::string_view json) {
    Json j = Json::parse(json.begin(), json.end(), nullptr, false);
    if (!j.is_object()) return InvalidArgumentError("a worker record must be a JSON object");
    JsonFields f(j);
    WorkerRecord r;
    FERRY_ASSIGN_OR_RETURN(r.url, f.String("url", 300));
    FERRY_ASSIGN_OR_RETURN(r.role, f.String("role", 32));
    FERRY_ASSIGN_OR_RETURN(r.model, f.String("model", 1024));
    FERRY_ASSIGN_OR_RETURN(int64_t tp, f.Int("tp_size", 1, 1024));
    r.tp_size = static_cast<int>(tp);
    FERRY_ASSIGN_OR_RETURN(r.agent.engine_id, f.String("engine_id", 128));
    FERRY_ASSIGN_OR_RETURN(r.agent.host, f.String("agent_host", 256));
    FERRY_ASSIGN_OR_RETURN(int64_t port, f.Int("agent_port", 0, 65535));
    r.agent.port = static_cast<int>(port);
    if (j.contains("block_hash")) {
        const Json& bh = j["block_hash"];
        if (!bh.is_object()) return InvalidArgumentError("'block_hash' must be an object");
        JsonFields b(bh);
        FERRY_ASSIGN_OR_RETURN(int64_t version, b.Int("version", 1, 1000));
        FERRY_ASSIGN_OR_RETURN(std::string algorithm, b.String("algorithm", 64));
        if (version != kBlockHashSpecVersion || algorithm != kBlockHashAlgorithm) {
            r.block_hash_unknown = fmt::format(
                "'block_hash' is version {} of '{}'; this router knows version {} of '{}'", version,
                algorithm.substr(0, 64), kBlockHashSpecVersion, kBlockHashAlgorithm);
        } else {
            FERRY_ASSIGN_OR_RETURN(r.hash_seed, b.String("seed", 256));
            FERRY_ASSIGN_OR_RETURN(int64_t bs, b.Int("block_size", 1, 1 << 16));
            r.block_size = static_cast<int>(bs);
        }
    }
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> events, f.OptString("kv_events", 300));
    if (events) r.kv_events = *events;
    FERRY_ASSIGN_OR_RETURN(std::optional<std::string> replay, f.OptString("kv_events_replay", 300));
    if (replay) r.kv_events_replay = *replay;
    return r;
}

Result<std::unique_ptr<WorkerRegistration>> WorkerRegistration::Start(
    std::string store_url, StoreOptions options, WorkerRecord record,
    std::chrono::milliseconds ttl) {
    std::unique_ptr<WorkerRegistration> w(new WorkerRegistration());
    FERRY_ASSIGN_OR_RETURN(w->store_, MetadataStore::Open(store_url, options));
    w->record_ = std::move(record);
    w->ttl_ = ttl;
    FERRY_ASSIGN_OR_RETURN(w->lease_, w->store_->GrantLease(ttl));
    FERRY_RETURN_IF_ERROR(w->store_->Put(std::string(kWorkerPrefix) + w->record_.url,
                                         EncodeWorkerRecord(w->record_), w->lease_));
    w->thread_ = std::thread([p = w.get()] { p->Loop(); });
    return w;
}

void WorkerRegistration::Loop() {
    const std::string key = std::string(kWorkerPrefix) + record_.url;
    std::unique_lock lock(mu_);
    while (!cv_.wait_for(lock, ttl_ / 3, [&] { return stop_; })) {
        lock.unlock();
        Status s = store_->KeepAlive(lease_);
        if (!s.ok()) {
            // The store lost the lease (a restart, a long pause): register again.
            auto lease = store_->GrantLease(ttl_);
            s = lease.ok() ? store_->Put(key, EncodeWorkerRecord(record_), *lease) : lease.status();
            if (lease.ok()) lease_ = *lease;
            if (!s.ok()) {
                FERRY_LOG(kWarn, "worker {}: discovery store: {} (retrying)", record_.url,
                          s.ToString());
            }
        }
        lock.lock();
    }
}

void WorkerRegistration::Stop() {
    {
        std::lock_guard lock(mu_);
        if (stop_) return;
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    if (store_ && lease_) (void)store_->RevokeLease(lease_);  // the entry goes with it
}

WorkerRegistration::~WorkerRegistration() { Stop(); }

Result<std::unique_ptr<WorkerDirectory>> WorkerDirectory::Start(std::string store_url,
                                                                StoreOptions options) {
    std::unique_ptr<WorkerDirectory> d(new WorkerDirectory());
    FERRY_ASSIGN_OR_RETURN(d->store_, MetadataStore::Open(store_url, options));
    d->thread_ = std::thread([p = d.get()] { p->Loop(); });
    // What the store holds now is there when Start returns (a router started after its workers
    // finds them at once); a store that does not answer delays it by its timeout at most.
    {
        std::unique_lock lock(d->mu_);
        d->cv_.wait_for(lock, options.timeout, [&] { return d->listed_; });
    }
    return d;
}

void WorkerDirectory::Loop() {
    uint64_t after = 0;
    bool listed = false;
    const auto poll = std::chrono::milliseconds(1000);
    // A record as the store holds it, or nullopt (logged) when it is not one for its key.
    auto decode = [](const std::string& url, const std::string& value) {
        Result<WorkerRecord> r = DecodeWorkerRecord(value);
        if (!r.ok() || r->url != url) {
            FERRY_LOG(kWarn, "discovery: worker record '{}' ignored: {}", url.substr(0, 200),
                      r.ok() ? std::string("its url is another worker's") : r.status().ToString());
            return std::optional<WorkerRecord>();
        }
        return std::optional<WorkerRecord>(std::move(*r));
    };
    auto apply = [&](const std::string& key, const std::string* value) {
        const std::string url = key.substr(kWorkerPrefix.size());
        std::optional<WorkerRecord> r = value ? decode(url, *value) : std::nullopt;
        std::lock_guard lock(mu_);
        ++changes_;
        cv_.notify_all();
        if (!r) {
            records_.erase(url);
            return;
        }
        records_[url] = std::move(*r);
    };
    for (;;) {
        {
            std::lock_guard lock(mu_);
            if (stop_) return;
        }
        if (!listed) {
            uint64_t rev = 0;
            auto entries = store_->List(kWorkerPrefix, &rev);
            if (!entries.ok()) {
                std::unique_lock lock(mu_);
                cv_.wait_for(lock, poll, [&] { return stop_; });
                continue;
            }
            // Swapped in whole: a reader never sees the directory empty while it is listed.
            std::map<std::string, WorkerRecord> fresh;
            for (const StoreEntry& e : *entries) {
                const std::string url = e.key.substr(kWorkerPrefix.size());
                if (auto r = decode(url, e.value)) fresh[url] = std::move(*r);
            }
            {
                std::lock_guard lock(mu_);
                records_.swap(fresh);
                ++changes_;
            }
            cv_.notify_all();
            after = rev;
            listed = true;
            {
                std::lock_guard lock(mu_);
                listed_ = true;
            }
            cv_.notify_all();
            continue;
        }
        Result<WatchResult> w = store_->Watch(kWorkerPrefix, after, poll);
        if (!w.ok()) {
            // The store may come back as a new one (restarted without its data): its revisions
            // start again, and a watch from our old revision would miss what was put before
            // the new store reached it. List again once it answers.
            listed = false;
            std::unique_lock lock(mu_);
            cv_.wait_for(lock, poll, [&] { return stop_; });
            continue;
        }
        if (w->compacted || w->revision < after) {
            listed = false;
            continue;
        }
        for (const StoreEvent& e : w->events) {
            apply(e.key, e.type == StoreEvent::Type::kPut ? &e.value : nullptr);
        }
        after = std::max(after, w->revision);
    }
}

std::optional<WorkerRecord> WorkerDirectory::Find(const std::string& url) const {
    std::lock_guard lock(mu_);
    auto it = records_.find(url);
    if (it == records_.end()) return std::nullopt;
    return it->second;
}

std::vector<WorkerRecord> WorkerDirectory::List() const {
    std::lock_guard lock(mu_);
    std::vector<WorkerRecord> out;
    out.reserve(records_.size());
    for (const auto& [url, r] : records_) out.push_back(r);
    return out;
}

uint64_t WorkerDirectory::WaitForChange(uint64_t seen, std::chrono::milliseconds timeout) const {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return changes_ != seen || stop_; });
    return changes_;
}

size_t WorkerDirectory::size() const {
    std::lock_guard lock(mu_);
    return records_.size();
}

WorkerDirectory::~WorkerDirectory() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();  // a Watch in flight returns within `poll`
}

}  // namespace ferry
