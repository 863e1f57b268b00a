#include "router/router.h"

#include <fmt/core.h>

#include <atomic>
#include <mutex>

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

class RoundRobin : public RoutingPolicy {
  public:
    const char* name() const override { return "round-robin"; }
    size_t Pick(Role role, const RouteRequest&, std::span<const WorkerState> w) override {
        size_t& next = next_[role == Role::kPrefill ? 0 : 1];
        for (size_t i = 0; i < w.size(); ++i) {
            size_t k = (next + i) % w.size();
            if (w[k].healthy) {
                next = k + 1;
                return k;
            }
        }
        return next++ % w.size();
    }

  private:
    size_t next_[2] = {0, 0};
};

class LeastLoaded : public RoutingPolicy {
  public:
    const char* name() const override { return "least-loaded"; }
    size_t Pick(Role role, const RouteRequest&, std::span<const WorkerState> w) override {
        size_t& next = next_[role == Role::kPrefill ? 0 : 1];
        bool any_healthy = false;
        for (const WorkerState& s : w) any_healthy = any_healthy || s.healthy;
        size_t best = w.size();
        for (size_t i = 0; i < w.size(); ++i) {
            size_t k = (next + i) % w.size();  // ties go round in turn
            if (any_healthy && !w[k].healthy) continue;
            if (best == w.size() || w[k].in_flight < w[best].in_flight ||
                (w[k].in_flight == w[best].in_flight &&
                 w[k].in_flight_tokens < w[best].in_flight_tokens)) {
                best = k;
            }
        }
        next = best + 1;
        return best;
    }

  private:
    size_t next_[2] = {0, 0};
};

}  // namespace

std::unique_ptr<RoutingPolicy> MakeRoundRobin() { return std::make_unique<RoundRobin>(); }
std::unique_ptr<RoutingPolicy> MakeLeastLoaded() { return std::make_unique<LeastLoaded>(); }

Result<std::unique_ptr<RoutingPolicy>> MakePolicy(std::string_view name) {
    if (name == "round-robin") return MakeRoundRobin();
    if (name == "least-loaded") return MakeLeastLoaded();
    return InvalidArgumentError(
        fmt::format("routing policy '{}' is not one of round-robin, least-loaded", name));
}

struct Ticket::State {
    mutable std::mutex mu;
    RouterConfig config;
    std::vector<WorkerState> workers[2];
    std::vector<Clock::time_point> last_failure[2];
    std::vector<uint64_t> abandoned[2], client_gone[2], cancelled[2];
    uint64_t agents_from_store = 0, agents_from_worker = 0;

    static int Index(Role role) { return role == Role::kPrefill ? 0 : 1; }

    // Health as of now (a worker past its probe time gets one more try).
    void RefreshHealth(int r, Clock::time_point now) {
        for (size_t i = 0; i < workers[r].size(); ++i) {
            WorkerState& w = workers[r][i];
            w.healthy = w.consecutive_failures < config.unhealthy_after ||
                        now - last_failure[r][i] >= config.probe_after;
        }
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
        config.policy->OnEnd(role, worker, RouteRequest{request_id, tokens}, outcome);
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

size_t Router::AddWorker(Role role, http::Endpoint endpoint) {
    std::lock_guard lock(state_->mu);
    const int r = Ticket::State::Index(role);
    auto& ws = state_->workers[r];
    for (size_t i = 0; i < ws.size(); ++i) {
        if (ws[i].endpoint.host == endpoint.host && ws[i].endpoint.port == endpoint.port) return i;
    }
    WorkerState w;
    w.endpoint = std::move(endpoint);
    ws.push_back(std::move(w));
    state_->last_failure[r].push_back(Clock::time_point{});
    state_->abandoned[r].push_back(0);
    state_->client_gone[r].push_back(0);
    state_->cancelled[r].push_back(0);
    return ws.size() - 1;
}

size_t Router::size(Role role) const {
    std::lock_guard lock(state_->mu);
    return state_->workers[Ticket::State::Index(role)].size();
}

std::vector<WorkerState> Router::Workers(Role role) const {
    std::lock_guard lock(state_->mu);
    const int r = Ticket::State::Index(role);
    state_->RefreshHealth(r, Clock::now());
    return state_->workers[r];
}

const char* Router::policy_name() const { return state_->config.policy->name(); }

Result<Ticket> Router::Route(Role role, const RouteRequest& request) {
    std::lock_guard lock(state_->mu);
    const int r = Ticket::State::Index(role);
    auto& ws = state_->workers[r];
    if (ws.empty()) {
        return UnavailableError(fmt::format("router: no {} worker", RoleName(role)));
    }
    state_->RefreshHealth(r, Clock::now());
    size_t k = state_->config.policy->Pick(role, request, ws);
    if (k >= ws.size()) {
        return InternalError(fmt::format("router: policy {} picked {} {} of {}",
                                         state_->config.policy->name(), RoleName(role), k,
                                         ws.size()));
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
    t.request_id_ = std::string(request.request_id);
    t.endpoint_ = w.endpoint;
    return t;
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
    ++state_->agents_from_store;
    state_->workers[Ticket::State::Index(role)][worker].agent = *a;
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
            const std::string worker = fmt::format("{}:{}", ws.endpoint.host, ws.endpoint.port);
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
    w.Family("ferry_router_worker_requests_total", "counter",
             "Requests routed to the worker, by how they ended.");
    each([&](int r, size_t i) {
        const WorkerState& ws = state_->workers[r][i];
        const std::string worker = fmt::format("{}:{}", ws.endpoint.host, ws.endpoint.port);
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
        if (!r || r->engine_id.empty() || r->agent_port <= 0) return std::nullopt;
        return AgentInfo{r->engine_id, r->agent_host, r->agent_port, r->tp_size};
    };
}

}  // namespace ferry::router
