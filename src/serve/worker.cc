#include "serve/worker.h"

#include <fmt/core.h>
#include <unistd.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/crypto.h"
#include "core/host_port.h"
#include "core/prometheus.h"

namespace ferry::serve {

const char* WorkerRoleName(WorkerRole role) {
    switch (role) {
        case WorkerRole::kColocated:
            return "colocated";
        case WorkerRole::kPrefill:
            return "prefill";
        case WorkerRole::kDecode:
            return "decode";
        case WorkerRole::kEncode:
            return "encode";
    }
    return "unknown";
}

namespace {

// Where a consumer of image embeddings looks for an image whose request names no encode worker:
// the agents the operator listed (--kv-peers), else the encode workers in the store's records.
// Strangers are never asked: without either, such images are encoded here.
std::function<std::vector<EcSource>()> EncodeWorkersOf(
    const PeerTrust& trust, const std::shared_ptr<WorkerDirectory>& directory) {
    if (!trust.allowed_agents.empty()) {
        std::vector<EcSource> listed;
        for (const std::string& a : trust.allowed_agents) {
            Result<HostPort> hp = ParseHostPort(a);
            if (!hp.ok()) continue;  // the flag's parser refused these already
            EcSource s;
            s.host = hp->host;
            s.port = hp->port;
            listed.push_back(std::move(s));
        }
        return [listed] { return listed; };
    }
    if (!directory) return {};
    return [directory] {
        std::vector<EcSource> out;
        for (const WorkerRecord& r : directory->List()) {
            if (r.role != WorkerRoleName(WorkerRole::kEncode) || r.agent.empty()) continue;
            EcSource s;
            static_cast<schema::AgentAddress&>(s) = r.agent;
            out.push_back(std::move(s));
        }
        return out;
    };
}

}  // namespace

Result<WorkerRole> ParseWorkerRole(std::string_view name) {
    for (WorkerRole r :
         {WorkerRole::kColocated, WorkerRole::kPrefill, WorkerRole::kDecode, WorkerRole::kEncode}) {
        if (name == WorkerRoleName(r)) return r;
    }
    return InvalidArgumentError(
        fmt::format("worker role '{}' is not one of colocated, prefill, decode, encode", name));
}

Result<std::unique_ptr<Worker>> Worker::Start(WorkerConfig c) {
    if (!c.model) return InvalidArgumentError("worker: no model");
    if (!c.server.remote_prefill.empty() && c.role != WorkerRole::kDecode) {
        return InvalidArgumentError("--remote-prefill needs --role decode");
    }
    FERRY_ASSIGN_OR_RETURN(kv::KvConnectorKind kind, kv::FindKvConnector(c.kv_connector));
    const bool kv_role = c.role == WorkerRole::kPrefill || c.role == WorkerRole::kDecode;
    if (c.role == WorkerRole::kEncode && (!c.server.vision || c.ec.kind.empty())) {
        return InvalidArgumentError(
            "--role encode needs --mmproj (the vision encoder) and --ec-connector (where the "
            "embeddings go)");
    }
    if (!c.ec.kind.empty() && !c.server.vision) {
        return InvalidArgumentError("--ec-connector needs --mmproj (it moves image embeddings)");
    }
    std::unique_ptr<Worker> w(new Worker());
    w->role_ = c.role;
    if (!c.agent.secret.empty()) c.server.router_token = RouterToken(c.agent.secret);
    if (kind.check_options) {
        Status options = kind.check_options(c.kv_connector_options);
        if (!options.ok()) {
            return options.WithContext(fmt::format("--kv-connector {}", c.kv_connector));
        }
    }
    // Which peers this worker trusts, for KV and image embeddings alike.
    const PeerTrust trust{.authenticated = !c.agent.secret.empty(),
                          .by_store = !c.agent.store.empty(),
                          .allowed_agents = c.allowed_agents};
    bool ec_needs_agent = false;
    if (!c.ec.kind.empty()) {
        Result<EcConnectorKind> ec_kind = FindEcConnector(c.ec.kind);
        if (!ec_kind.ok()) return InvalidArgumentError(ec_kind.status().message());
        ec_needs_agent = ec_kind->needs_agent;
    }
    if (kv_role || ec_needs_agent) {
        if (c.agent.name.empty()) {
            c.agent.name = fmt::format("ferry-{}-{}", WorkerRoleName(c.role), getpid());
        }
        c.server.router_token = RouterToken(c.agent.secret);
        auto agent = Agent::Create(c.agent);
        if (!agent.ok()) return agent.status().WithContext("agent");
        w->agent_ = std::shared_ptr<Agent>(std::move(agent).value());
    }
    // The store's worker records: a decode-first decoder finds its prefill workers' agents in
    // them, and a consumer of image embeddings moved by transfer its encode workers.
    const bool ec_consumer = ec_needs_agent && c.role != WorkerRole::kEncode;
    if (trust.by_store && ((c.role == WorkerRole::kDecode && kv_role) || ec_consumer)) {
        StoreOptions so;
        so.secret = c.agent.secret;
        auto dir = WorkerDirectory::Start(c.agent.store, so);
        if (!dir.ok()) return dir.status().WithContext("worker records in the store");
        w->directory_ = std::move(dir).value();
    }
    if (!c.ec.kind.empty()) {
        const model::VisionConfig& vc = c.server.vision->config();
        if (ec_consumer) c.ec.producers = EncodeWorkersOf(trust, w->directory_);
        c.ec.producer = c.role == WorkerRole::kEncode;
        c.ec.agent = w->agent_;
        c.ec.entry_floats = size_t(vc.tokens_per_image()) * size_t(vc.out_dim);
        c.ec.width = size_t(vc.out_dim);
        c.ec.encoder = c.server.vision->fingerprint();
        c.ec.trust = trust;
        auto ec = MakeEcConnector(c.ec);
        if (!ec.ok()) return ec.status().WithContext("encoder-cache connector");
        w->ec_connector_ = *ec;
        c.server.ec_connector = w->ec_connector_;
        c.server.encode_only = c.role == WorkerRole::kEncode;
    }
    if (!kv_role) {
        // No connector: malformed params are named the default kind's way, then refused.
        c.server.parse_kv_params =
            [parse = kind.parse, options = c.kv_connector_options](const nlohmann::json& params) {
                return parse(params, options);
            };
    } else {
        kv::KvConnectorContext context;
        context.agent = w->agent_;
        // The model's identity at the KV handshake: its weights, and for a worker that takes
        // images its vision encoder's too (KV computed from one projector's embeddings means
        // nothing to a worker with another).
        context.model_fingerprint =
            c.server.vision ? c.model->fingerprint() + "+mmproj:" + c.server.vision->fingerprint()
                            : c.model->fingerprint();
        context.model_kv_heads = c.model->config().num_kv_heads;
        context.model_tp = c.model->tp();
        context.trust = trust;
        context.options = c.kv_connector_options;
        auto conn = kind.create(context);
        if (!conn.ok()) return conn.status().WithContext("kv connector");
        w->connector_ = *conn;
        c.engine.connector = w->connector_;
        c.engine.allocator = kv::AgentKvAllocator(w->agent_);
        c.server.parse_kv_params = [conn = w->connector_](const nlohmann::json& params) {
            return conn->ParseParams(params);
        };
        c.server.kv_agent_info = [agent = w->agent_, tp = c.model->tp()] {
            nlohmann::json j =
                schema::AgentAddressJson(schema::AgentAt(agent->name(), agent->ListenAddress()));
            j["tp_size"] = tp;
            return j.dump();
        };
        c.server.extra_metrics = [conn = w->connector_] { return conn->RenderMetrics(); };
        // SGLang's PD protocol: the role, and what the prefill worker's bootstrap server says.
        c.server.pd_role = WorkerRoleName(c.role);
        c.server.sglang_prefill_info = [agent = w->agent_, tp = c.model->tp(),
                                        bt = c.engine.block_tokens, dt = c.engine.kv_dtype] {
            schema::SglangPrefillInfo info;
            info.tp_size = tp;
            info.page_size = bt;
            info.kv_cache_dtype = std::string(kv::KvDtypeName(dt));
            info.agent = schema::AgentAt(agent->name(), agent->ListenAddress());
            return info;
        };
        if (c.role == WorkerRole::kDecode && w->directory_) {
            // Decode-first finds its prefill workers' agents in their store records.
            c.server.remote_prefill_agents = router::AgentsFromDirectory(w->directory_);
        }
    }
    if (!c.kv_events.endpoint.empty()) {
        c.kv_events.block_size = c.engine.block_tokens;
        auto pub = KvEventPublisher::Start(c.kv_events);
        if (!pub.ok()) return pub.status();
        w->kv_events_ = std::move(pub).value();
        c.engine.on_kv_events = [pub = w->kv_events_](std::vector<schema::KvCacheEvent> events) {
            pub->Publish(std::move(events));
        };
        auto extra = std::move(c.server.extra_metrics);
        c.server.extra_metrics = [extra, pub = w->kv_events_] {
            const KvEventsStats st = pub->Stats();
            PrometheusWriter m;
            m.Counter("ferry_kv_events_batches_total", "KV event batches published.",
                      double(st.batches));
            m.Counter("ferry_kv_events_total", "KV events published.", double(st.events));
            m.Counter("ferry_kv_events_dropped_total",
                      "KV event batches dropped for a full queue (a gap subscribers see).",
                      double(st.dropped));
            m.Counter("ferry_kv_events_replays_total", "Replay requests answered.",
                      double(st.replays));
            m.Counter("ferry_kv_events_replays_refused_total",
                      "Replay requests beyond the budget (--kv-events-replays-per-second).",
                      double(st.replays_refused));
            std::string out = m.Take();
            if (extra) out += extra();
            return out;
        };
    }
    auto engine = engine::Engine::Create(c.model, c.engine);
    if (!engine.ok()) return engine.status();
    w->engine_ = std::shared_ptr<engine::Engine>(std::move(engine).value());
    if (c.serve_http) {
        auto server = OpenAiServer::Start(w->engine_, c.server);
        if (!server.ok()) return server.status();
        w->server_ = std::move(server).value();
        if (w->agent_ && !c.agent.store.empty()) {
            WorkerRecord r;
            r.url = FormatHostPort(c.server.host, w->server_->port());
            r.role = WorkerRoleName(c.role);
            r.model = w->server_->model_name();
            r.tp_size = c.model->tp();
            r.agent = schema::AgentAt(w->agent_->name(), w->agent_->ListenAddress());
            r.block_size = c.engine.block_tokens;
            r.hash_seed = c.engine.prefix_hash_seed;
            if (w->kv_events_) {
                r.kv_events = w->kv_events_->endpoint();
                r.kv_events_replay = w->kv_events_->replay_endpoint();
            }
            StoreOptions so;
            so.secret = c.agent.secret;
            auto reg =
                WorkerRegistration::Start(c.agent.store, so, std::move(r), c.registration_ttl);
            if (!reg.ok()) return reg.status().WithContext("worker record in the store");
            w->registration_ = std::move(reg).value();
        }
    }
    return w;
}

int Worker::port() const { return server_ ? server_->port() : 0; }

size_t Worker::InFlight() const {
    engine::EngineStats s = engine_->Stats();
    return size_t(s.running + s.waiting + s.kv_parked + s.kv_loading + s.kv_held);
}

Worker::DrainResult Worker::Drain(std::chrono::milliseconds timeout,
                                  std::chrono::milliseconds quiet,
                                  const std::function<bool()>& interrupted) {
    using Clock = std::chrono::steady_clock;
    const Clock::time_point start = Clock::now(), deadline = start + timeout;
    if (registration_) registration_->Stop();  // the record goes: routers stop sending here
    if (server_) server_->SetDraining();
    DrainResult r;
    Clock::time_point idle_since = start;
    for (;;) {
        const Clock::time_point now = Clock::now();
        r.in_flight = InFlight();
        if (r.in_flight != 0) idle_since = now;
        if (r.in_flight == 0 && now - idle_since >= quiet) {
            r.drained = true;
            break;
        }
        if (now >= deadline || (interrupted && interrupted())) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    r.took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    return r;
}

void Worker::Stop() {
    if (registration_) registration_->Stop();  // routers stop sending here first
    if (server_) server_->Stop();
}

Worker::~Worker() {
    Stop();
    registration_.reset();
    server_.reset();
    engine_.reset();  // the engine unbinds the connector before the agent goes
    connector_.reset();
    ec_connector_.reset();
    agent_.reset();
}

}  // namespace ferry::serve
