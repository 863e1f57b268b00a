// Serving workers in the discovery store: a worker started with --store puts a record of itself
// (its HTTP address, role, model, TP size and its transfer agent) under "ferry/workers/<host:port>"
// with a lease it keeps alive, and a router reads them, so that it finds a prefill worker's
// agent without asking the worker (and, with the XpYd issue, the workers themselves).
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "ferry/discovery.h"
#include "ferry/status.h"
#include "schema/agent_address.h"

namespace ferry {

inline constexpr std::string_view kWorkerPrefix = "ferry/workers/";

struct WorkerRecord {
    std::string url;   // its OpenAI server, "host:port" (the key's last part)
    std::string role;  // "prefill", "decode", ...
    std::string model;
    int tp_size = 1;
    // Its transfer agent (none: empty).
    schema::AgentAddress agent;
    // Its prefix cache's block hashes, so that a router recomputes them (core/block_hash.h):
    // "block_hash": {"version", "algorithm", "seed", "block_size", "extra_keys"}; absent in
    // records of older workers (block_size 0).
    int block_size = 0;
    std::string hash_seed{};
    // Where its KV events are published and replayed (serve/kv_events.h); "" = not published.
    std::string kv_events{}, kv_events_replay{};
    // A "block_hash" of a version or algorithm this router does not know (a newer worker): the
    // record still stands (the worker is routed to), its blocks get no prefix credit
    // (block_size 0), and this says why.
    std::string block_hash_unknown{};
};

std::string EncodeWorkerRecord(const WorkerRecord& r);
// InvalidArgument naming the field that is missing or wrong.
Result<WorkerRecord> DecodeWorkerRecord(std::string_view json);

// Keeps one worker's record in the store while it lives: put under a lease, renewed at a third
// of its TTL, put again if the store lost it, deleted at Stop. One thread of its own.
class WorkerRegistration {
  public:
    // Opens the store and puts the record (an error names what failed), then keeps it.
    static Result<std::unique_ptr<WorkerRegistration>> Start(std::string store_url,
                                                             StoreOptions options,
                                                             WorkerRecord record,
                                                             std::chrono::milliseconds ttl);
    ~WorkerRegistration();  // Stop()
    void Stop();

  private:
    WorkerRegistration() = default;
    void Loop();
    std::unique_ptr<MetadataStore> store_;
    WorkerRecord record_;
    std::chrono::milliseconds ttl_{0};
    LeaseId lease_ = 0;
    std::thread thread_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;
};

// The workers' records as the store has them, followed by a watch on one thread of its own.
// Lookups never block on the store.
class WorkerDirectory {
  public:
    // Returns once the store's records are in (or after options.timeout if it does not answer;
    // they come in later then).
    static Result<std::unique_ptr<WorkerDirectory>> Start(std::string store_url,
                                                          StoreOptions options);
    ~WorkerDirectory();
    // The record of the worker at `url` ("host:port"), if the store has one.
    std::optional<WorkerRecord> Find(const std::string& url) const;
    std::vector<WorkerRecord> List() const;
    size_t size() const;
    // Counts changes to the records (a put, a delete, a fresh listing). Returns the count once it
    // differs from `seen`, or after `timeout` (unchanged then).
    uint64_t WaitForChange(uint64_t seen, std::chrono::milliseconds timeout) const;

  private:
    WorkerDirectory() = default;
    void Loop();
    std::unique_ptr<MetadataStore> store_;
    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
    std::map<std::string, WorkerRecord> records_;
    uint64_t changes_ = 0;
    bool listed_ = false;  // the first listing is in records_
    bool stop_ = false;
    std::thread thread_;
};

}  // namespace ferry
