// Keeps a Router's workers current: who is in the deployment (the workers' records in the
// discovery store, beside any given as flags) and how loaded each says it is (its /metrics,
// polled).
//
// Membership. Each record under ferry/workers/ of role prefill or decode, serving the
// deployment's model, makes its worker a member; a record that goes (the worker stopped or
// drained, or its lease lapsed) takes it out. A worker found in the store takes requests once
// its /metrics has answered (within a poll of its registering); one that restarts under the same
// address comes back with nothing of its old state (its agent is read again from its new record).
// Records of role encode (EPD encode workers) serving the model are kept in
// MembershipConfig::encoders for the driver's encode step; they take no prefill or decode
// requests and are not polled. Records of another model, of another role, or that name no
// address are logged once, counted and ignored. Workers given as flags stay members whatever
// the store says.
//
// Load. Every `poll`, each member's GET /metrics is read (a call at a time per worker, bounded by
// `poll_timeout`) and vLLM's gauges there (vllm:num_requests_waiting, vllm:num_requests_running,
// vllm:kv_cache_usage_perc) are the worker's report (Router::ReportAnswered), which the router
// reconciles with its own count (WorkerState::Load). Any vLLM-compatible worker reports the same
// way. Three unanswered polls in a row and the worker is avoided until it answers again.
//
// One thread of its own and an HTTP client of its own; Stop (or the destructor) ends both, after
// which no callback runs.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "discovery/worker_directory.h"
#include "ferry/status.h"
#include "http/http.h"
#include "router/kv_index.h"
#include "router/router.h"

namespace ferry::router {

// vLLM's load gauges in a Prometheus text exposition (a worker's /metrics): waiting and running
// summed over their label sets, the KV cache usage their highest. NotFound if neither request
// gauge is there; InvalidArgument naming the line if one of the three has no number.
Result<ReportedLoad> ParseWorkerLoad(std::string_view metrics_text);

struct MembershipConfig {
    // The workers' records; null: only the router's static workers (their load is still polled).
    std::shared_ptr<const WorkerDirectory> directory;
    // The model every member serves: records of another are ignored. "": the model of the first
    // record taken (logged).
    std::string model;
    std::chrono::milliseconds poll{250};
    std::chrono::milliseconds poll_timeout{2000};
    // Follow the KV events of workers that publish them (their records name where) into this
    // index, the router's (RouterConfig::kv_index); null: not followed.
    std::shared_ptr<KvIndex> kv_index{};
    // Where the store's encode workers go (sorted by address); null: their records are ignored.
    std::shared_ptr<EncoderSet> encoders{};
};

struct MembershipStats {
    uint64_t joined = 0, left = 0;  // workers that became members from the store, or left
    uint64_t encoders = 0;          // encode workers in the store now
    uint64_t polls_answered = 0, polls_unanswered = 0;
    std::map<std::string, uint64_t> records_ignored;  // by reason: model, role, address
};

class Membership {
  public:
    // Reads the directory's records once before returning (a router started after its workers
    // has them at once; they take requests when their first poll answers).
    static std::unique_ptr<Membership> Start(MembershipConfig config,
                                             std::shared_ptr<Router> router);
    ~Membership();
    void Stop();
    MembershipStats Stats() const;
    // The KV event follower's (zero without one).
    KvFollowerStats KvStats() const;
    // Prometheus text: ferry_router_membership_* (joins, leaves, polls, records ignored).
    std::string RenderMetrics() const;
    // The model members serve ("" until one is known).
    std::string model() const;

  private:
    Membership() = default;
    void Loop();
    void Sync(const std::vector<WorkerRecord>& records);
    void PollAll();

    MembershipConfig config_;
    std::shared_ptr<Router> router_;
    std::unique_ptr<http::Client> client_;
    std::thread thread_;
    // The directory's change count read before the first listing was synced: a change after it
    // (a record that came in while the listing was read) is synced by the loop, not missed.
    uint64_t synced_changes_ = 0;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;
    std::string model_;
    MembershipStats stats_;
    // Workers this membership added from the store, by role and "host:port".
    std::set<std::string> from_store_[2];
    std::set<std::string> encoders_;            // the store's encode workers ("host:port")
    std::set<std::string> logged_;              // ignored records already logged ("url reason")
    std::set<std::pair<int, size_t>> polling_;  // (role, worker) with a poll in flight
    std::string hash_seed_;  // the block hash spec adopted (block_size 0: none yet)
    int hash_block_size_ = 0;
    std::unique_ptr<KvEventFollower> follower_;
};

}  // namespace ferry::router
