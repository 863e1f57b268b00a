#include "router/membership.h"

#include <fmt/core.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "core/host_port.h"
#include "core/log.h"
#include "core/prometheus.h"

namespace ferry::router {

namespace {

using Clock = std::chrono::steady_clock;

Role RoleAt(int r) { return r == 0 ? Role::kPrefill : Role::kDecode; }

std::string_view Trim(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
        s.remove_suffix(1);
    }
    return s;
}

// The sample's value, if `line` is a sample of the metric `name` ("name 3", "name{a="b"} 3",
// optionally followed by a timestamp). nullopt: another metric; an error: no number.
Result<std::optional<double>> SampleOf(std::string_view line, std::string_view name) {
    if (line.substr(0, name.size()) != name) return std::optional<double>();
    std::string_view rest = line.substr(name.size());
    if (rest.empty()) return InvalidArgumentError(fmt::format("{}: no value", name));
    if (rest[0] != '{' && rest[0] != ' ' && rest[0] != '\t') {
        return std::optional<double>();  // a longer name (e.g. name_created)
    }
    if (rest[0] == '{') {
        // Label values may hold '}' inside quotes: skip them.
        size_t i = 1;
        bool quoted = false;
        for (; i < rest.size(); ++i) {
            char c = rest[i];
            if (quoted && c == '\\') {
                ++i;
            } else if (c == '"') {
                quoted = !quoted;
            } else if (!quoted && c == '}') {
                break;
            }
        }
        if (i >= rest.size()) {
            return InvalidArgumentError(fmt::format("{}: unterminated labels", name));
        }
        rest = rest.substr(i + 1);
    }
    rest = Trim(rest);
    std::string_view number = rest.substr(0, rest.find_first_of(" \t"));
    double v = 0;
    auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), v);
    if (ec != std::errc() || end != number.data() + number.size() || number.empty() ||
        !std::isfinite(v) || v < 0) {
        return InvalidArgumentError(fmt::format("{}: value '{}' is not a finite count", name,
                                                std::string(number.substr(0, 40))));
    }
    return std::optional<double>(v);
}

}  // namespace

// A worker's events endpoint as a subscriber dials it: a wildcard host (the worker bound
// tcp://*:P, and its record says 0.0.0.0) becomes the worker's own host.
std::string DialableEndpoint(const std::string& endpoint, const std::string& worker_host) {
    const std::string tcp = "tcp://";
    if (endpoint.rfind(tcp, 0) != 0) return endpoint;
    Result<HostPort> hp = ParseHostPort(endpoint.substr(tcp.size()));
    if (!hp.ok()) return endpoint;
    if (hp->host == "0.0.0.0" || hp->host == "*" || hp->host == "::" || hp->host.empty()) {
        return tcp + FormatHostPort(worker_host, hp->port);
    }
    return endpoint;
}

Result<ReportedLoad> ParseWorkerLoad(std::string_view text) {
    ReportedLoad load;
    bool requests = false;
    while (!text.empty()) {
        size_t nl = text.find('\n');
        std::string_view line = Trim(text.substr(0, nl));
        text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
        if (line.empty() || line[0] == '#' || line.substr(0, 5) != "vllm:") continue;
        struct Gauge {
            std::string_view name;
            double* into;
            bool sum;
        } gauges[] = {{"vllm:num_requests_waiting", &load.waiting, true},
                      {"vllm:num_requests_running", &load.running, true},
                      {"vllm:kv_cache_usage_perc", &load.kv_usage, false}};
        for (const Gauge& g : gauges) {
            FERRY_ASSIGN_OR_RETURN(std::optional<double> v, SampleOf(line, g.name));
            if (!v) continue;
            if (g.sum) {
                *g.into += *v;
                requests = true;
            } else {
                *g.into = std::max(*g.into, std::min(*v, 1.0));
            }
            break;
        }
    }
    if (!requests) {
        return NotFoundError("no vllm:num_requests_waiting or vllm:num_requests_running gauge");
    }
    return load;
}

std::unique_ptr<Membership> Membership::Start(MembershipConfig config,
                                              std::shared_ptr<Router> router) {
    std::unique_ptr<Membership> m(new Membership());
    m->config_ = std::move(config);
    m->router_ = std::move(router);
    m->model_ = m->config_.model;
    m->client_ = http::Client::Create(1);
    if (m->config_.kv_index) {
        std::weak_ptr<Router> weak = m->router_;
        m->follower_ = KvEventFollower::Start(m->config_.kv_index,
                                              [weak](const std::string& worker, bool in_sync) {
                                                  if (auto r = weak.lock())
                                                      r->SetKvInSync(worker, in_sync);
                                              });
    }
    if (m->config_.directory) {
        // The count first, then the listing: a record that arrives in between bumps the count
        // past it, so the loop syncs again (read after the listing, that record waited for the
        // next change in the store, seen under a loaded sanitizer run).
        m->synced_changes_ =
            m->config_.directory->WaitForChange(~uint64_t{0}, std::chrono::milliseconds(0));
        m->Sync(m->config_.directory->List());
    }
    m->thread_ = std::thread([p = m.get()] { p->Loop(); });
    return m;
}

Membership::~Membership() { Stop(); }

void Membership::Stop() {
    {
        std::lock_guard lock(mu_);
        if (stop_) return;
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    client_.reset();  // its callbacks not run by now never run
    follower_.reset();
}

KvFollowerStats Membership::KvStats() const {
    return follower_ ? follower_->Stats() : KvFollowerStats{};
}

void Membership::Loop() {
    const std::shared_ptr<const WorkerDirectory>& dir = config_.directory;
    uint64_t seen = synced_changes_;
    Clock::time_point next_poll = Clock::now();
    for (;;) {
        {
            std::lock_guard lock(mu_);
            if (stop_) return;
        }
        Clock::time_point now = Clock::now();
        if (now >= next_poll) {
            PollAll();
            next_poll = now + config_.poll;
        }
        auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_poll - now);
        wait = std::clamp(wait, std::chrono::milliseconds(1), std::chrono::milliseconds(100));
        if (dir) {
            // A store event wakes this at once: a new worker is polled (and routable) within
            // milliseconds of registering, a leaving one out as soon as its record goes.
            uint64_t c = dir->WaitForChange(seen, wait);
            if (c != seen) {
                seen = c;
                Sync(dir->List());
                PollAll();
            }
        } else {
            std::unique_lock lock(mu_);
            cv_.wait_for(lock, wait, [&] { return stop_; });
        }
    }
}

void Membership::Sync(const std::vector<WorkerRecord>& records) {
    std::set<std::string> present[2];
    std::map<std::string, KvEventSource> sources;
    auto ignore = [&](const WorkerRecord& r, const char* reason, const std::string& why) {
        std::lock_guard lock(mu_);
        if (!logged_.insert(r.url + " " + reason).second) return;
        ++stats_.records_ignored[reason];
        FERRY_LOG(kWarn, "router: worker record '{}' ignored: {}", r.url.substr(0, 200), why);
    };
    std::set<std::string> encoders;
    for (const WorkerRecord& rec : records) {
        int r = rec.role == "prefill" ? 0 : rec.role == "decode" ? 1 : -1;
        if (r < 0 && rec.role == "encode" && config_.encoders) r = 2;
        if (r < 0) {
            ignore(rec, "role",
                   fmt::format("role '{}' is neither prefill nor decode", rec.role.substr(0, 40)));
            continue;
        }
        Result<HostPort> ep = ParseHostPort(rec.url);
        if (!ep.ok()) {
            ignore(rec, "address", ep.status().message());
            continue;
        }
        {
            std::lock_guard lock(mu_);
            if (model_.empty()) {
                model_ = rec.model;
                FERRY_LOG(kInfo, "router: serving model '{}' (that of {}, the first worker found)",
                          model_, rec.url);
            }
        }
        if (rec.model != model()) {
            ignore(rec, "model",
                   fmt::format("it serves model '{}', the deployment '{}'",
                               rec.model.substr(0, 100), model()));
            continue;
        }
        if (r == 2) {
            encoders.insert(rec.url);
            continue;
        }
        present[r].insert(rec.url);
        const Role role = RoleAt(r);
        if (!rec.block_hash_unknown.empty()) {
            std::lock_guard lock(mu_);
            if (logged_.insert(rec.url + " block_hash").second) {
                FERRY_LOG(kWarn, "router: worker {}: no prefix credit: {}", rec.url.substr(0, 200),
                          rec.block_hash_unknown);
            }
        }
        if (rec.block_size > 0 && hash_block_size_ == 0) {
            hash_seed_ = rec.hash_seed;
            hash_block_size_ = rec.block_size;
            router_->SetBlockHashSpec(hash_seed_, hash_block_size_);
            FERRY_LOG(kInfo,
                      "router: block hashes sha256_cbor, seed '{}', block size {} (those "
                      "of {})",
                      hash_seed_, hash_block_size_, rec.url);
        }
        // Only a worker that hashes as the router does gets prefix credit.
        if (follower_ && !rec.kv_events.empty() && rec.block_size == hash_block_size_ &&
            rec.hash_seed == hash_seed_) {
            sources[rec.url] = {DialableEndpoint(rec.kv_events, ep->host),
                                rec.kv_events_replay.empty()
                                    ? std::string()
                                    : DialableEndpoint(rec.kv_events_replay, ep->host)};
        }
        std::vector<WorkerState> before = router_->Workers(role);
        bool was_member = std::any_of(before.begin(), before.end(), [&](const WorkerState& w) {
            return w.member && w.endpoint.host == ep->host && w.endpoint.port == ep->port;
        });
        bool is_static = false;
        {
            std::lock_guard lock(mu_);
            is_static = was_member && !from_store_[r].count(rec.url);
        }
        if (is_static) continue;  // a worker given as a flag: the store changes nothing of it
        size_t i = router_->AddWorker(role, *ep, /*answering=*/false);
        if (!was_member) {
            std::lock_guard lock(mu_);
            from_store_[r].insert(rec.url);
            ++stats_.joined;
            FERRY_LOG(kInfo, "router: {} worker {} joined", RoleName(role), rec.url);
        }
        if (!rec.agent.empty() && rec.agent.port > 0) {
            AgentInfo a{rec.agent, rec.tp_size};
            std::optional<AgentInfo> known = router_->Agent(role, i);
            if (!known || known->engine_id != a.engine_id || known->host != a.host ||
                known->port != a.port || known->tp_size != a.tp_size) {
                router_->SetAgent(role, i, a);  // a restart under the same address: its new agent
            }
        }
    }
    if (follower_) follower_->SetWorkers(std::move(sources));
    if (config_.encoders) {
        // The store's encode workers (EPD): the driver picks among them and any given as flags.
        std::vector<http::Endpoint> eps;
        for (const std::string& url : encoders) eps.push_back(*ParseHostPort(url));  // checked
        std::lock_guard lock(mu_);
        for (const std::string& url : encoders) {
            if (!encoders_.count(url)) {
                ++stats_.joined;
                FERRY_LOG(kInfo, "router: encode worker {} joined", url);
            }
        }
        for (const std::string& url : encoders_) {
            if (!encoders.count(url)) {
                ++stats_.left;
                FERRY_LOG(kInfo, "router: encode worker {} left", url);
            }
        }
        encoders_ = std::move(encoders);
        stats_.encoders = eps.size();
        config_.encoders->Set(std::move(eps));
    }
    for (int r = 0; r < 2; ++r) {
        std::vector<std::string> gone;
        {
            std::lock_guard lock(mu_);
            for (const std::string& url : from_store_[r]) {
                if (!present[r].count(url)) gone.push_back(url);
            }
            for (const std::string& url : gone) from_store_[r].erase(url);
        }
        for (const std::string& url : gone) {
            Result<HostPort> ep = ParseHostPort(url);
            if (ep.ok() && router_->RemoveWorker(RoleAt(r), *ep)) {
                std::lock_guard lock(mu_);
                ++stats_.left;
                FERRY_LOG(kInfo, "router: {} worker {} left", RoleName(RoleAt(r)), url);
            }
        }
    }
}

void Membership::PollAll() {
    for (int r = 0; r < 2; ++r) {
        const Role role = RoleAt(r);
        std::vector<WorkerState> ws = router_->Workers(role);
        for (size_t i = 0; i < ws.size(); ++i) {
            if (!ws[i].member) continue;
            {
                std::lock_guard lock(mu_);
                if (stop_ || !polling_.insert({r, i}).second) continue;
            }
            http::ClientRequest req = http::GetRequest(ws[i].endpoint.host, ws[i].endpoint.port,
                                                       "/metrics", config_.poll_timeout);
            client_->CallWhole(std::move(req), [this, r, i](Result<http::ClientReply> got) {
                const Role role = RoleAt(r);
                // Any HTTP answer is an answer (a worker without vLLM's gauges reports nothing).
                bool answered = got.ok();
                if (answered) {
                    Result<ReportedLoad> load = got->status == 200
                                                    ? ParseWorkerLoad(got->body)
                                                    : Result<ReportedLoad>(NotFoundError("no"));
                    router_->ReportAnswered(role, i,
                                            load.ok() ? std::optional(*load) : std::nullopt);
                } else {
                    router_->ReportUnanswered(role, i);
                }
                std::lock_guard lock(mu_);
                polling_.erase({r, i});
                ++(answered ? stats_.polls_answered : stats_.polls_unanswered);
            });
        }
    }
}

MembershipStats Membership::Stats() const {
    std::lock_guard lock(mu_);
    return stats_;
}

std::string Membership::model() const {
    std::lock_guard lock(mu_);
    return model_;
}

std::string Membership::RenderMetrics() const {
    MembershipStats s = Stats();
    PrometheusWriter w;
    w.Counter("ferry_router_membership_joined_total", "Workers that joined from the store.",
              double(s.joined));
    w.Counter("ferry_router_membership_left_total", "Workers whose store record went.",
              double(s.left));
    w.Gauge("ferry_router_membership_encoders", "Encode workers found in the store now.",
            double(s.encoders));
    w.Family("ferry_router_membership_polls_total", "counter",
             "Polls of the workers' /metrics, by whether they answered.");
    w.Sample("ferry_router_membership_polls_total", {{"result", "answered"}},
             double(s.polls_answered));
    w.Sample("ferry_router_membership_polls_total", {{"result", "unanswered"}},
             double(s.polls_unanswered));
    w.Family("ferry_router_membership_records_ignored_total", "counter",
             "Worker records in the store not taken, by reason (model, role, address).");
    for (const char* reason : {"model", "role", "address"}) {
        auto it = s.records_ignored.find(reason);
        w.Sample("ferry_router_membership_records_ignored_total", {{"reason", reason}},
                 double(it == s.records_ignored.end() ? 0 : it->second));
    }
    if (follower_) {
        const KvFollowerStats k = follower_->Stats();
        w.Counter("ferry_router_kv_event_batches_total", "KV event batches applied.",
                  double(k.batches));
        w.Family("ferry_router_kv_event_resyncs_total", "counter",
                 "Times the router fell out of step with a worker's KV events, by cause.");
        w.Sample("ferry_router_kv_event_resyncs_total", {{"cause", "gap"}}, double(k.gaps));
        w.Sample("ferry_router_kv_event_resyncs_total", {{"cause", "restart"}}, double(k.restarts));
        w.Counter("ferry_router_kv_event_replays_total", "Replays asked of workers.",
                  double(k.replays));
        w.Counter("ferry_router_kv_event_cleared_total",
                  "Workers whose blocks were forgotten for a replay that could not cover a gap.",
                  double(k.cleared));
        w.Counter("ferry_router_kv_event_replays_deferred_total",
                  "Gaps met too soon after a worker's slow replay: its blocks were forgotten "
                  "instead of replayed (its replays take at most a quarter of the follower).",
                  double(k.replays_deferred));
        w.Counter("ferry_router_kv_event_malformed_total",
                  "KV event messages or batches ignored as malformed.", double(k.malformed));
    }
    return w.Take();
}

}  // namespace ferry::router
