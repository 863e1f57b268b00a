#include "router/router.h"

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <random>

#include "core/host_port.h"
#include "core/prometheus.h"

namespace ferry::router {

const char* RoleName(Role role) { return role == Role::kPrefill ? "prefill" : "decode"; }

const char* OutcomeName(Outcome outcome) {
    switch (outcome) {
        case Outcome::kSucceeded:
            return "succeeded";
        case Outcome::kRefused:
            return "refused";
        case Outcome::kWorkerFailed:
            return "worker_failed";
        case Outcome::kClientGone:
            return "client_gone";
        case Outcome::kCancelled:
            return "cancelled";
        case Outcome::kAbandoned:
            return "abandoned";
    }
    return "unknown";
}

namespace {

using Clock = std::chrono::steady_clock;

// Least-loaded's order: Load(), then prompt tokens in flight, then reported KV usage.
bool LessLoaded(const WorkerState& a, const WorkerState& b) {
    if (a.Load() != b.Load()) return a.Load() < b.Load();
    if (a.in_flight_tokens != b.in_flight_tokens) return a.in_flight_tokens < b.in_flight_tokens;
    double ka = a.reported ? a.reported->kv_usage : 0, kb = b.reported ? b.reported->kv_usage : 0;
    return ka < kb;
}

class RoundRobin : public RoutingPolicy {
  public:
    const char* name() const override { return "round-robin"; }
    size_t Pick(Role role, const RouteRequest&, std::span<const WorkerState>,
                std::span<const size_t> c) override {
        size_t& next = next_[role == Role::kPrefill ? 0 : 1];
        return c[next++ % c.size()];
    }

  private:
    size_t next_[2] = {0, 0};
};

class LeastLoaded : public RoutingPolicy {
  public:
    const char* name() const override { return "least-loaded"; }
    size_t Pick(Role role, const RouteRequest&, std::span<const WorkerState> w,
                std::span<const size_t> c) override {
        size_t& next = next_[role == Role::kPrefill ? 0 : 1];
        size_t best = c[next % c.size()];  // ties go round in turn
        for (size_t i = 1; i < c.size(); ++i) {
            size_t k = c[(next + i) % c.size()];
            if (LessLoaded(w[k], w[best])) best = k;
        }
        ++next;
        return best;
    }

  private:
    size_t next_[2] = {0, 0};
};

class PowerOfTwo : public RoutingPolicy {
  public:
    explicit PowerOfTwo(uint64_t seed) : rng_(seed ? seed : std::random_device{}()) {}
    const char* name() const override { return "power-of-two"; }
    size_t Pick(Role, const RouteRequest&, std::span<const WorkerState> w,
                std::span<const size_t> c) override {
        if (c.size() == 1) return c[0];
        size_t a = std::uniform_int_distribution<size_t>(0, c.size() - 1)(rng_);
        size_t b = std::uniform_int_distribution<size_t>(0, c.size() - 2)(rng_);
        if (b >= a) ++b;  // two distinct candidates
        return LessLoaded(w[c[b]], w[c[a]]) ? c[b] : c[a];
    }

  private:
    std::mt19937_64 rng_;
};

class CacheAware : public RoutingPolicy {
  public:
    explicit CacheAware(CacheAwareWeights w) : w_(w) {}
    const char* name() const override { return "cache-aware"; }
    size_t Pick(Role role, const RouteRequest& request, std::span<const WorkerState> w,
                std::span<const size_t> c) override {
        size_t& next = next_[role == Role::kPrefill ? 0 : 1];
        double max_load = 0;
        for (size_t k : c) max_load = std::max(max_load, w[k].Load());
        const double blocks = double(request.block_hashes.size());
        auto score = [&](const WorkerState& s) {
            double prefix = blocks > 0 ? double(s.prefix_blocks) / blocks : 0;
            double queue = max_load > 0 ? s.Load() / max_load : 0;
            double kv = s.reported ? s.reported->kv_usage : 0;
            return w_.prefix * prefix - w_.queue * queue - w_.kv * kv;
        };
        size_t best = c[next % c.size()];  // ties go round in turn
        double best_score = score(w[best]);
        for (size_t i = 1; i < c.size(); ++i) {
            size_t k = c[(next + i) % c.size()];
            double sc = score(w[k]);
            if (sc > best_score || (sc == best_score && LessLoaded(w[k], w[best]))) {
                best = k;
                best_score = sc;
            }
        }
        ++next;
        return best;
    }

  private:
    CacheAwareWeights w_;
    size_t next_[2] = {0, 0};
};

}  // namespace

double WorkerState::Load() const {
    double own = double(in_flight);
    return reported ? std::max(own, reported->waiting + reported->running) : own;
}

std::unique_ptr<RoutingPolicy> MakeRoundRobin() { return std::make_unique<RoundRobin>(); }
std::unique_ptr<RoutingPolicy> MakeLeastLoaded() { return std::make_unique<LeastLoaded>(); }
std::unique_ptr<RoutingPolicy> MakePowerOfTwo(uint64_t seed) {
    return std::make_unique<PowerOfTwo>(seed);
}

std::unique_ptr<RoutingPolicy> MakeCacheAware(CacheAwareWeights weights) {
    return std::make_unique<CacheAware>(weights);
}

const char* PolicyNames() { return "round-robin, least-loaded, power-of-two, cache-aware"; }

Result<std::unique_ptr<RoutingPolicy>> MakePolicy(std::string_view name,
                                                  CacheAwareWeights weights) {
    if (name == "round-robin") return MakeRoundRobin();
    if (name == "least-loaded") return MakeLeastLoaded();
    if (name == "power-of-two") return MakePowerOfTwo();
    if (name == "cache-aware") return MakeCacheAware(weights);
    return InvalidArgumentError(
        fmt::format("routing policy '{}' is not one of {}", name, PolicyNames()));
}

struct Ticket::State {
    mutable std::mutex mu;
    RouterConfig config;
    std::vector<WorkerState> workers[2];
    std::vector<Clock::time_point> last_failure[2], reported_at[2];
    std::vector<uint64_t> abandoned[2], client_gone[2], cancelled[2];
    uint64_t agents_from_store = 0, agents_from_worker = 0;
    std::optional<BlockHash> hash_root;
    int hash_block_size = 0;

    static int Index(Role role) { return role == Role::kPrefill ? 0 : 1; }
    RoutingPolicy& Policy(int r) {
        return r == 1 && config.decode_policy ? *config.decode_policy : *config.policy;
    }

    // Health as of now (a worker past its probe time gets one more try); stale reports dropped.
    void RefreshHealth(int r, Clock::time_point now) {
        for (size_t i = 0; i < workers[r].size(); ++i) {
            WorkerState& w = workers[r][i];
            w.healthy = w.consecutive_failures < config.unhealthy_after ||
                        now - last_failure[r][i] >= config.probe_after;
            if (w.reported && now - reported_at[r][i] > config.report_ttl) w.reported.reset();
        }
    }

    // The workers a policy may pick from (RoutingPolicy::Pick); empty without members.
    // The routable workers, else the members that answer, else every member; never one of
    // `avoid` (those that failed this request already).
    std::vector<size_t> Candidates(int r, std::span<const size_t> avoid) const {
        std::vector<size_t> c;
        const auto& ws = workers[r];
        auto take = [&](auto&& eligible) {
            for (size_t i = 0; i < ws.size(); ++i) {
                if (eligible(ws[i]) && std::find(avoid.begin(), avoid.end(), i) == avoid.end()) {
                    c.push_back(i);
                }
            }
        };
        take([](const WorkerState& w) { return w.Routable(); });
        if (c.empty()) take([](const WorkerState& w) { return w.member && w.answering; });
        if (c.empty()) take([](const WorkerState& w) { return w.member; });
        return c;
    }

    void End(Role role, size_t worker, size_t tokens, const std::string& request_id,
             Outcome outcome) {
        std::lock_guard lock(mu);
        const int r = Index(role);
        WorkerState& w = workers[r][worker];
        --w.in_flight;
        w.in_flight_tokens -= tokens;
        switch (outcome) {
            case Outcome::kSucceeded:
                ++w.succeeded;
                w.consecutive_failures = 0;
                break;
            case Outcome::kRefused:
                ++w.refused;
                w.consecutive_failures = 0;
                break;
            case Outcome::kWorkerFailed:
                ++w.failed;
                ++w.consecutive_failures;
                last_failure[r][worker] = Clock::now();
                break;
            case Outcome::kClientGone:
                ++client_gone[r][worker];
                break;
            case Outcome::kCancelled:
                ++cancelled[r][worker];
                break;
            case Outcome::kAbandoned:
                ++abandoned[r][worker];
                break;
        }
        RefreshHealth(r, Clock::now());
        Policy(r).OnEnd(role, worker, RouteRequest{request_id, tokens}, outcome);
    }
};

Ticket::Ticket(Ticket&& o) noexcept { *this = std::move(o); }

Ticket& Ticket::operator=(Ticket&& o) noexcept {
    if (this != &o) {
        End(Outcome::kAbandoned);
        state_ = std::move(o.state_);
        ended_.store(o.ended_.load());
        role_ = o.role_;
        worker_ = o.worker_;
        tokens_ = o.tokens_;
        prefix_blocks_ = o.prefix_blocks_;
        request_id_ = std::move(o.request_id_);
        endpoint_ = std::move(o.endpoint_);
        o.state_.reset();
        o.ended_.store(true);
    }
    return *this;
}

Ticket::~Ticket() { End(Outcome::kAbandoned); }

void Ticket::End(Outcome outcome) {
    if (!state_ || ended_.exchange(true)) return;
    state_->End(role_, worker_, tokens_, request_id_, outcome);
}

Router::Router(RouterConfig config) : state_(std::make_shared<Ticket::State>()) {
    if (!config.policy) config.policy = MakeRoundRobin();
    state_->config = std::move(config);
}

Router::~Router() = default;

size_t Router::AddWorker(Role role, http::Endpoint endpoint, bool answering) {
    std::lock_guard lock(state_->mu);
    const int r = Ticket::State::Index(role);
    auto& ws = state_->workers[r];
    for (size_t i = 0; i < ws.size(); ++i) {
        WorkerState& w = ws[i];
        if (w.endpoint.host != endpoint.host || w.endpoint.port != endpoint.port) continue;
        if (!w.member) {  // back (perhaps restarted): nothing it said before counts
            w.member = true;
            w.answering = answering;
            w.consecutive_failures = 0;
            w.unanswered = 0;
            w.healthy = true;
            w.agent.reset();
            w.reported.reset();
        }
        return i;
    }
    WorkerState w;
    w.endpoint = std::move(endpoint);
    w.answering = answering;
    ws.push_back(std::move(w));
    state_->last_failure[r].push_back(Clock::time_point{});
    state_->reported_at[r].push_back(Clock::time_point{});
    state_->abandoned[r].push_back(0);
    state_->client_gone[r].push_back(0);
    state_->cancelled[r].push_back(0);
    return ws.size() - 1;
}

bool Router::RemoveWorker(Role role, const http::Endpoint& endpoint) {
    std::lock_guard lock(state_->mu);
    for (WorkerState& w : state_->workers[Ticket::State::Index(role)]) {
        if (!w.member || w.endpoint.host != endpoint.host || w.endpoint.port != endpoint.port) {
            continue;
        }
        w.member = false;
        w.agent.reset();
        w.reported.reset();
        return true;
    }
    return false;
}

size_t Router::size(Role role) const {
    std::lock_guard lock(state_->mu);
    return state_->workers[Ticket::State::Index(role)].size();
}

size_t Router::members(Role role) const {
    std::lock_guard lock(state_->mu);
    const auto& ws = state_->workers[Ticket::State::Index(role)];
    return size_t(
        std::count_if(ws.begin(), ws.end(), [](const WorkerState& w) { return w.member; }));
}

std::vector<WorkerState> Router::Workers(Role role) const {
    std::lock_guard lock(state_->mu);
    const int r = Ticket::State::Index(role);
    state_->RefreshHealth(r, Clock::now());
    return state_->workers[r];
}

const char* Router::policy_name(Role role) const {
    return state_->Policy(Ticket::State::Index(role)).name();
}

void Router::ReportAnswered(Role role, size_t worker, std::optional<ReportedLoad> load) {
    std::lock_guard lock(state_->mu);
    const int r = Ticket::State::Index(role);
    auto& ws = state_->workers[r];
    if (worker >= ws.size() || !ws[worker].member) return;
    ws[worker].answering = true;
    ws[worker].unanswered = 0;
    ws[worker].reported = load;
    state_->reported_at[r][worker] = Clock::now();
}

void Router::ReportUnanswered(Role role, size_t worker) {
    std::lock_guard lock(state_->mu);
    auto& ws = state_->workers[Ticket::State::Index(role)];
    if (worker >= ws.size() || !ws[worker].member) return;
    WorkerState& w = ws[worker];
    w.reported.reset();
    if (++w.unanswered >= 3) w.answering = false;
}

void Router::ReportTimedOut(Role role, size_t worker) {
    std::lock_guard lock(state_->mu);
    auto& ws = state_->workers[Ticket::State::Index(role)];
    if (worker >= ws.size() || !ws[worker].member) return;
    WorkerState& w = ws[worker];
    w.reported.reset();
    w.unanswered = std::max(w.unanswered, 3);
    w.answering = false;
}

Result<Ticket> Router::Route(Role role, const RouteRequest& request) {
    std::lock_guard lock(state_->mu);
    const int r = Ticket::State::Index(role);
    auto& ws = state_->workers[r];
    state_->RefreshHealth(r, Clock::now());
    const std::vector<size_t> candidates = state_->Candidates(r, request.avoid);
    if (candidates.empty()) {
        return UnavailableError(fmt::format("router: no {} worker{}", RoleName(role),
                                            request.avoid.empty() ? "" : " left to try"));
    }
    for (size_t i : candidates) {
        WorkerState& c = ws[i];
        c.prefix_blocks = 0;
        if (!request.block_hashes.empty() && c.kv_in_sync && state_->config.kv_index) {
            c.prefix_blocks = state_->config.kv_index->Matched(
                FormatHostPort(c.endpoint.host, c.endpoint.port), request.block_hashes);
        }
    }
    RoutingPolicy& policy = state_->Policy(r);
    size_t k = policy.Pick(role, request, ws, candidates);
    if (std::find(candidates.begin(), candidates.end(), k) == candidates.end()) {
        return InternalError(fmt::format("router: policy {} picked {} {}, not a candidate",
                                         policy.name(), RoleName(role), k));
    }
    WorkerState& w = ws[k];
    ++w.in_flight;
    w.in_flight_tokens += request.prompt_tokens;
    ++w.routed;
    if (!w.healthy) {
        // A probe: one request at a time tries a worker that kept failing.
        state_->last_failure[r][k] = Clock::now();
    }
    Ticket t;
    t.state_ = state_;
    t.role_ = role;
    t.worker_ = k;
    t.tokens_ = request.prompt_tokens;
    t.prefix_blocks_ = w.prefix_blocks;
    t.request_id_ = std::string(request.request_id);
    t.endpoint_ = w.endpoint;
    return t;
}

void Router::SetKvInSync(const std::string& worker, bool in_sync) {
    std::lock_guard lock(state_->mu);
    for (auto& ws : state_->workers) {
        for (WorkerState& w : ws) {
            if (FormatHostPort(w.endpoint.host, w.endpoint.port) == worker) w.kv_in_sync = in_sync;
        }
    }
}

void Router::SetBlockHashSpec(const std::string& seed, int block_size) {
    std::lock_guard lock(state_->mu);
    state_->hash_root = RootBlockHash(seed);
    state_->hash_block_size = block_size;
}

int Router::block_size() const {
    std::lock_guard lock(state_->mu);
    return state_->hash_root ? state_->hash_block_size : 0;
}

std::vector<BlockHash> Router::PromptBlockHashes(std::span<const int32_t> tokens) const {
    BlockHash root;
    int block_size = 0;
    {
        std::lock_guard lock(state_->mu);
        if (!state_->hash_root) return {};
        root = *state_->hash_root;
        block_size = state_->hash_block_size;
    }
    return HashFullBlocks(root, tokens, block_size);
}

std::optional<AgentInfo> Router::Agent(Role role, size_t worker) const {
    std::lock_guard lock(state_->mu);
    const auto& ws = state_->workers[Ticket::State::Index(role)];
    if (worker >= ws.size()) return std::nullopt;
    return ws[worker].agent;
}

std::optional<AgentInfo> Router::KnownAgent(Role role, size_t worker) {
    http::Endpoint ep;
    {
        std::lock_guard lock(state_->mu);
        const auto& ws = state_->workers[Ticket::State::Index(role)];
        if (worker >= ws.size()) return std::nullopt;
        if (ws[worker].agent) return ws[worker].agent;
        if (!state_->config.agent_directory) return std::nullopt;
        ep = ws[worker].endpoint;
    }
    std::optional<AgentInfo> a = state_->config.agent_directory(ep);
    if (!a) return std::nullopt;
    std::lock_guard lock(state_->mu);
    auto& ws = state_->workers[Ticket::State::Index(role)];
    if (worker >= ws.size()) return a;
    // Requests in flight together may each have read the store; the agent is learned once.
    if (ws[worker].agent) return ws[worker].agent;
    ++state_->agents_from_store;
    ws[worker].agent = *a;
    return a;
}

void Router::LearnedFromWorker(Role role, size_t worker, AgentInfo agent) {
    {
        std::lock_guard lock(state_->mu);
        ++state_->agents_from_worker;
    }
    SetAgent(role, worker, std::move(agent));
}

void Router::SetAgent(Role role, size_t worker, AgentInfo agent) {
    std::lock_guard lock(state_->mu);
    auto& ws = state_->workers[Ticket::State::Index(role)];
    if (worker < ws.size()) ws[worker].agent = std::move(agent);
}

void Router::ForgetAgent(Role role, size_t worker) {
    std::lock_guard lock(state_->mu);
    auto& ws = state_->workers[Ticket::State::Index(role)];
    if (worker < ws.size()) ws[worker].agent.reset();
}

std::string Router::RenderMetrics() const {
    std::lock_guard lock(state_->mu);
    PrometheusWriter w;
    auto each = [&](auto fn) {
        for (int r = 0; r < 2; ++r) {
            for (size_t i = 0; i < state_->workers[r].size(); ++i) fn(r, i);
        }
    };
    auto family = [&](const char* name, const char* type, const char* help, auto value) {
        w.Family(name, type, help);
        each([&](int r, size_t i) {
            const WorkerState& ws = state_->workers[r][i];
            const std::string worker = FormatHostPort(ws.endpoint.host, ws.endpoint.port);
            w.Sample(
                name,
                {{"role", RoleName(r == 0 ? Role::kPrefill : Role::kDecode)}, {"worker", worker}},
                double(value(ws)));
        });
    };
    family("ferry_router_worker_requests_in_flight", "gauge",
           "Requests routed to the worker and not yet ended.",
           [](const WorkerState& ws) { return ws.in_flight; });
    family("ferry_router_worker_prompt_tokens_in_flight", "gauge",
           "Prompt tokens of those requests, where known.",
           [](const WorkerState& ws) { return ws.in_flight_tokens; });
    family("ferry_router_worker_healthy", "gauge",
           "1 unless the worker failed its last requests in a row.",
           [](const WorkerState& ws) { return ws.healthy ? 1 : 0; });
    family("ferry_router_worker_member", "gauge",
           "1 while the worker is in the deployment (flags or the store); 0 once it left.",
           [](const WorkerState& ws) { return ws.member ? 1 : 0; });
    family("ferry_router_worker_answering", "gauge", "1 while the worker's /metrics answers.",
           [](const WorkerState& ws) { return ws.answering ? 1 : 0; });
    family("ferry_router_worker_reported_waiting", "gauge",
           "Requests waiting, as the worker last reported (vllm:num_requests_waiting).",
           [](const WorkerState& ws) { return ws.reported ? ws.reported->waiting : 0.0; });
    family("ferry_router_worker_reported_running", "gauge",
           "Requests running, as the worker last reported (vllm:num_requests_running).",
           [](const WorkerState& ws) { return ws.reported ? ws.reported->running : 0.0; });
    family("ferry_router_worker_reported_kv_usage", "gauge",
           "KV cache usage 0..1, as the worker last reported (vllm:kv_cache_usage_perc).",
           [](const WorkerState& ws) { return ws.reported ? ws.reported->kv_usage : 0.0; });
    family("ferry_router_worker_load", "gauge",
           "The load policies compare: max(requests in flight, reported waiting + running).",
           [](const WorkerState& ws) { return ws.Load(); });
    family("ferry_router_worker_kv_in_sync", "gauge",
           "1 while the router is in step with the worker's KV events (prefix credit).",
           [](const WorkerState& ws) { return ws.kv_in_sync ? 1 : 0; });
    const KvIndex* index = state_->config.kv_index.get();
    family(
        "ferry_router_worker_cached_blocks", "gauge",
        "Blocks the worker's KV events say its prefix cache holds.", [&](const WorkerState& ws) {
            return index ? double(index->Blocks(FormatHostPort(ws.endpoint.host, ws.endpoint.port)))
                         : 0.0;
        });
    w.Family("ferry_router_worker_requests_total", "counter",
             "Requests routed to the worker, by how they ended.");
    each([&](int r, size_t i) {
        const WorkerState& ws = state_->workers[r][i];
        const std::string worker = FormatHostPort(ws.endpoint.host, ws.endpoint.port);
        const std::pair<Outcome, uint64_t> counts[] = {
            {Outcome::kSucceeded, ws.succeeded},
            {Outcome::kRefused, ws.refused},
            {Outcome::kWorkerFailed, ws.failed},
            {Outcome::kClientGone, state_->client_gone[r][i]},
            {Outcome::kCancelled, state_->cancelled[r][i]},
            {Outcome::kAbandoned, state_->abandoned[r][i]}};
        for (const auto& [o, n] : counts) {
            w.Sample("ferry_router_worker_requests_total",
                     {{"role", RoleName(r == 0 ? Role::kPrefill : Role::kDecode)},
                      {"worker", worker},
                      {"outcome", OutcomeName(o)}},
                     double(n));
        }
    });
    w.Family("ferry_router_agent_lookups_total", "counter",
             "Prefill workers' agents learned, from the discovery store or asked of the worker.");
    w.Sample("ferry_router_agent_lookups_total", {{"source", "store"}},
             double(state_->agents_from_store));
    w.Sample("ferry_router_agent_lookups_total", {{"source", "worker"}},
             double(state_->agents_from_worker));
    return w.Take();
}

std::function<std::optional<AgentInfo>(const http::Endpoint&)> AgentsFromDirectory(
    std::shared_ptr<const WorkerDirectory> directory) {
    return [d = std::move(directory)](const http::Endpoint& ep) -> std::optional<AgentInfo> {
        std::optional<WorkerRecord> r = d->Find(FormatHostPort(ep.host, ep.port));
        if (!r || r->agent.empty() || r->agent.port <= 0) return std::nullopt;
        return AgentInfo{r->agent, r->tp_size};
    };
}

}  // namespace ferry::router
