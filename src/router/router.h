// The router: the set of workers a deployment routes to, what it knows of each (requests and
// prompt tokens in flight, outcomes, health, where its KV agent is), and the policy that picks
// one for a request. `ferry proxy` routes prefill and decode workers with it; a decode worker
// that asks prefill workers itself (decode-first) routes those with it.
//
// The router counts a request on the worker it picked from `Route` until its `Ticket` ends, on
// every path (success, error, client gone, another stage's failure): a ticket destroyed without
// `End` ends as kAbandoned, so load is never left counted on a worker.
//
// This library links core, http, the schema layer, discovery, the tokenizer (to tokenize prompts
// as the workers do) and libzmq (KV events): no model math, no KV cache, no engine.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/block_hash.h"
#include "discovery/worker_directory.h"
#include "ferry/status.h"
#include "http/http.h"
#include "router/kv_index.h"
#include "schema/agent_address.h"

namespace ferry::router {

enum class Role { kPrefill, kDecode };
const char* RoleName(Role role);

// Where a prefill worker's transfer agent listens (its GET /v1/kv/agent answer).
struct AgentInfo : schema::AgentAddress {
    int tp_size = 1;
};

// How a routed request ended, as the router counts it.
enum class Outcome {
    kSucceeded,     // the worker answered 200
    kRefused,       // the worker answered 4xx: the request's fault, not the worker's
    kWorkerFailed,  // 5xx, unreachable, timed out: counts against the worker's health
    kClientGone,    // the client left first
    kCancelled,     // another stage of the request failed; this worker is not to blame
    kAbandoned,     // the ticket was dropped without an ending (a bug elsewhere; still counted)
};
const char* OutcomeName(Outcome outcome);

// What a worker last said of its own load: vLLM's gauges on its /metrics
// (vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc), summed over
// their label sets (the KV usage: the highest).
struct ReportedLoad {
    double waiting = 0, running = 0;
    double kv_usage = 0;  // 0..1
};

// What the router knows of one worker.
struct WorkerState {
    http::Endpoint endpoint;
    // In the deployment (from flags, or registered in the store). A worker that left keeps its
    // slot (and index) so that its tickets in flight end on it, but gets no new request.
    bool member = true;
    // Its /metrics answered lately. A worker found in the store is not routed to before it
    // answers once; one that stops answering (3 polls in a row) is avoided like an unhealthy one.
    bool answering = true;
    size_t in_flight = 0;           // requests routed to it whose tickets have not ended
    uint64_t in_flight_tokens = 0;  // their prompt tokens, where the router knew them
    uint64_t routed = 0;
    uint64_t succeeded = 0, refused = 0, failed = 0;  // by Outcome (the others in metrics)
    int consecutive_failures = 0;                     // kWorkerFailed in a row
    // False after `unhealthy_after` consecutive failures, until `probe_after` has passed since
    // the last one (then one request may try it) or a request succeeds.
    bool healthy = true;
    std::optional<AgentInfo> agent;  // where its KV agent is, once known
    // Its last report, while fresh (RouterConfig::report_ttl); none for a worker not polled.
    std::optional<ReportedLoad> reported;
    // Its prefix cache, from its KV events (router/kv_index.h): in step with them (only then
    // does it get prefix credit), and of the request being routed, the leading blocks it holds
    // (set by Route for the policy).
    bool kv_in_sync = false;
    size_t prefix_blocks = 0;
    int unanswered = 0;  // polls in a row its /metrics did not answer

    // The load policies compare: the router's own count of requests in flight, reconciled with
    // the worker's report. The router's count is current but sees only what this router sent;
    // the report sees every request (other routers, direct clients) but is up to a poll old.
    // The larger of the two never undercounts either: max(in_flight, waiting + running).
    double Load() const;
    // Eligible for a new request when any is: a member, healthy and answering.
    bool Routable() const { return member && healthy && answering; }
};

// A request as the policy sees it.
struct RouteRequest {
    std::string_view request_id;
    size_t prompt_tokens = 0;  // 0: not known (no token ids and no tokenizer)
    // Its prompt's full blocks' hashes (core/block_hash.h), when its tokens are known.
    std::span<const BlockHash> block_hashes{};
    // Workers not to pick (a retry: those that failed this request already).
    std::span<const size_t> avoid{};
};

// Picks a worker of one role for a request. Called with the router's lock held (never
// concurrently, never re-entrant): keep it short; it must not call back into the router.
class RoutingPolicy {
  public:
    virtual ~RoutingPolicy() = default;
    virtual const char* name() const = 0;
    // One of `candidates` (indices into `workers`; never empty): the routable workers, or when
    // none is, the members that answer, or else every member. The router refuses any other pick.
    virtual size_t Pick(Role role, const RouteRequest& request,
                        std::span<const WorkerState> workers,
                        std::span<const size_t> candidates) = 0;
    // How a request this policy routed ended (after the state is updated).
    virtual void OnEnd(Role /*role*/, size_t /*worker*/, const RouteRequest& /*request*/,
                       Outcome /*outcome*/) {}
};

// The candidates in turn.
std::unique_ptr<RoutingPolicy> MakeRoundRobin();
// The candidate with the lowest Load(), then the fewest prompt tokens in flight, then the lowest
// reported KV usage, then the next in turn.
std::unique_ptr<RoutingPolicy> MakeLeastLoaded();
// Two candidates drawn at random, the less loaded of them (compared as least-loaded does): near
// least-loaded's balance without every router herding onto the same worker.
std::unique_ptr<RoutingPolicy> MakePowerOfTwo(uint64_t seed = 0);  // 0: a random seed
// Prefix cache aware: the candidate with the highest
//   score = prefix * (prompt blocks it holds / prompt blocks)
//         - queue * (its Load() / the highest Load() among the candidates)
//         - kv * (its reported KV usage)
// each term in 0..1 (llm-d's weights by default: prefix 2, queue 1, KV usage 1); ties in turn.
// A worker out of step with its events scores no prefix; without hashes (a text prompt) this is
// least-loaded by another name.
struct CacheAwareWeights {
    double prefix = 2, queue = 1, kv = 1;
};
std::unique_ptr<RoutingPolicy> MakeCacheAware(CacheAwareWeights weights = {});
// The policies' names, for flags and errors: "round-robin, least-loaded, power-of-two,
// cache-aware".
const char* PolicyNames();
// One of PolicyNames(); InvalidArgument naming the choices otherwise.
Result<std::unique_ptr<RoutingPolicy>> MakePolicy(std::string_view name,
                                                  CacheAwareWeights weights = {});

struct RouterConfig {
    std::unique_ptr<RoutingPolicy> policy;  // prefill workers' (null: round robin)
    // Where a worker's agent is, from the discovery store (WorkerDirectory), before asking the
    // worker (GET /v1/kv/agent). Must not block. Null: ask the worker.
    std::function<std::optional<AgentInfo>(const http::Endpoint& worker)> agent_directory{};
    int unhealthy_after = 3;  // consecutive worker failures
    std::chrono::milliseconds probe_after{5000};
    std::unique_ptr<RoutingPolicy> decode_policy{};  // decode workers' (null: the same as policy)
    // A worker's report older than this is dropped (its load is the router's count alone).
    std::chrono::milliseconds report_ttl{3000};
    // The workers' prefix caches (router/kv_index.h), by "host:port"; null: no prefix credit.
    std::shared_ptr<const KvIndex> kv_index{};
};

// An agent_directory over the workers' records in the store (the record of the worker at that
// address, if it names an agent). The directory is kept alive by the function.
std::function<std::optional<AgentInfo>(const http::Endpoint&)> AgentsFromDirectory(
    std::shared_ptr<const WorkerDirectory> directory);

class Router;

// One routed request on one worker. Move-only; ends once (End, or its destructor as kAbandoned).
// End may be called from several threads at once (the first one counts); moving is not
// thread-safe.
class Ticket {
  public:
    Ticket() = default;
    Ticket(Ticket&& other) noexcept;
    Ticket& operator=(Ticket&& other) noexcept;
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket();

    bool valid() const { return state_ != nullptr && !ended_.load(); }
    Role role() const { return role_; }
    size_t worker() const { return worker_; }
    const http::Endpoint& endpoint() const { return endpoint_; }
    // The request's prompt blocks the worker held when it was picked (its KV events).
    size_t prefix_blocks() const { return prefix_blocks_; }
    void End(Outcome outcome);

  private:
    friend class Router;
    struct State;
    std::shared_ptr<State> state_;
    std::atomic<bool> ended_{false};
    Role role_ = Role::kPrefill;
    size_t worker_ = 0;
    size_t tokens_ = 0;
    size_t prefix_blocks_ = 0;
    std::string request_id_;
    http::Endpoint endpoint_;
};

// Thread-safe; never blocks on the network.
class Router {
  public:
    explicit Router(RouterConfig config = {});
    ~Router();
    Router(const Router&) = delete;
    Router& operator=(const Router&) = delete;

    // Adds a worker (a known endpoint is not added twice); its index, which stays its own. A
    // worker that had left comes back with its health, agent and report forgotten (it may have
    // restarted). `answering` false: not routed to before its first report (ReportAnswered).
    size_t AddWorker(Role role, http::Endpoint endpoint, bool answering = true);
    // The worker leaves: no new request goes to it; its tickets in flight end as usual. False if
    // no member of that role is at that endpoint.
    bool RemoveWorker(Role role, const http::Endpoint& endpoint);
    // Slots, members or not (indices are stable); `members` how many are members.
    size_t size(Role role) const;
    size_t members(Role role) const;
    std::vector<WorkerState> Workers(Role role) const;
    const char* policy_name(Role role = Role::kPrefill) const;

    // What polling a worker's /metrics found: it answered, with its load if it reports one.
    void ReportAnswered(Role role, size_t worker, std::optional<ReportedLoad> load);
    // Its /metrics did not answer (after 3 in a row it is no longer `answering`).
    void ReportUnanswered(Role role, size_t worker);
    // A call to it ran past its deadline (stopped, wedged): no longer `answering` at once, so no
    // new request goes to it until something reports it answering again (a poll of its
    // /metrics, a probe).
    void ReportTimedOut(Role role, size_t worker);

    // Whether the worker at "host:port" (of either role) is in step with its KV events.
    void SetKvInSync(const std::string& worker, bool in_sync);
    // How the workers hash their blocks (their records' spec): the prompt hashes Route scores.
    void SetBlockHashSpec(const std::string& seed, int block_size);
    // The hashes of a prompt's full blocks under that spec (empty without one).
    std::vector<BlockHash> PromptBlockHashes(std::span<const int32_t> tokens) const;
    int block_size() const;  // the spec's (0 without one)

    // Picks a worker for `request` and counts the request on it until the ticket ends.
    // Unavailable if there is no worker of that role.
    Result<Ticket> Route(Role role, const RouteRequest& request);

    // The worker's agent, once known; Forget after the worker may have restarted.
    std::optional<AgentInfo> Agent(Role role, size_t worker) const;
    // Agent, else the directory's (remembered then). Counted by source in the metrics.
    std::optional<AgentInfo> KnownAgent(Role role, size_t worker);
    // An agent learned from the worker itself (SetAgent, counted as such).
    void LearnedFromWorker(Role role, size_t worker, AgentInfo agent);
    void SetAgent(Role role, size_t worker, AgentInfo agent);
    void ForgetAgent(Role role, size_t worker);

    // Prometheus text: per worker, requests in flight, prompt tokens in flight, health,
    // membership, its reported and reconciled load, and requests by outcome (ferry_router_*,
    // labelled role and worker); agent lookups by source.
    std::string RenderMetrics() const;

  private:
    std::shared_ptr<Ticket::State> state_;
};

// The encode workers found in the store, as the membership last saw them (thread-safe).
class EncoderSet {
  public:
    std::vector<http::Endpoint> Get() const {
        std::lock_guard lock(mu_);
        return endpoints_;
    }
    void Set(std::vector<http::Endpoint> endpoints) {
        std::lock_guard lock(mu_);
        endpoints_ = std::move(endpoints);
    }

  private:
    mutable std::mutex mu_;
    std::vector<http::Endpoint> endpoints_;
};

}  // namespace ferry::router
