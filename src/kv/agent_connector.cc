#include "kv/agent_connector.h"

#include <set>

#include "kv/agent_connector_parts.h"
#include "kv/pull_protocol.h"
#include "kv/push_protocol.h"

namespace ferry::kv {

using namespace connector_parts;  // NOLINT(build/namespaces): the connector's own parts

void AgentKvConnector::Impl::WakeOnDone(Transfer& x) {
    x.OnDone([w = waker] { w->Kick(); });
}

void AgentKvConnector::Impl::Emit(ConnectorEvent ev) {
    events.push_back(std::move(ev));
    if (wake) wake();
}

Status AgentKvConnector::Impl::Send(const std::string& peer, const msg::PeerMessage& m) {
    Status s = agent->Notify(peer, msg::Encode(m));
    if (!s.ok()) {
        FERRY_LOG(kWarn, "kv: message to '{}' not sent: {}", Esc(peer), s.ToString());
    }
    return s;
}

void AgentKvConnector::Impl::OnMessage(const std::string& from, const std::string& payload) {
    std::string type;
    Result<msg::PeerMessage> m = msg::Decode(payload, &type);
    if (!m.ok()) {
        FERRY_LOG(kWarn, "kv: '{}' message from '{}' dropped: {}", Esc(type), Esc(from),
                  m.status().ToString());
        if (type == "hello-ack") {
            // Our handshake would wait for an answer that came: it fails now instead.
            std::lock_guard lock(mu);
            auto it = peers.find(from);
            if (bound && it != peers.end() && it->second.state == Peer::State::kConnecting) {
                PeerFailed(from, m.status().WithContext("kv handshake"));
            }
        }
        return;
    }
    std::unique_lock lock(mu);
    // Each message to the part that owns what it is about: a protocol's to it, the rest (the
    // handshake) here.
    auto route = [&](auto& x) -> Status {
        if constexpr (requires { pull->On(from, x); }) {
            return pull->On(from, x);
        } else if constexpr (requires { push->On(from, x); }) {
            return push->On(from, x);
        } else {
            return On(from, x);
        }
    };
    Status st = bound ? std::visit(route, *m) : FailedPreconditionError("not bound");
    if (!st.ok()) {
        ++stats.messages_refused;
        FERRY_LOG(kWarn, "kv: '{}' message from '{}' refused: {}", Esc(type), Esc(from),
                  st.ToString());
    }
}

void AgentKvConnector::Impl::NotifyLoop() {
    for (;;) {
        {
            std::lock_guard lock(mu);
            if (stop) return;
        }
        auto batch = agent->WaitNotifications(SteadyClock::now() + std::chrono::milliseconds(100));
        for (Notification& n : batch) OnMessage(n.peer, n.payload);
    }
}

void AgentKvConnector::Impl::PumpLoop() {
    std::unique_lock lock(mu);
    while (!stop) {
        const auto now = SteadyClock::now();
        PumpLoads(now);
        PumpPeers(now);
        push->Pump(now);
        pull->Pump(now);
        pull->RenewWaiting(now);
        // Sleep until a transfer finishes or there is new work (Waker); the timers above
        // (deadlines, leases, liveness probes) are coarse: a tick of 20 ms serves them.
        lock.unlock();
        (void)waker->sem.try_acquire_for(std::chrono::milliseconds(20));
        while (waker->sem.try_acquire()) {
        }
        lock.lock();
    }
}

TransferProtocol& AgentKvConnector::Impl::ProtocolOf(KvTransferMode mode) {
    if (mode == KvTransferMode::kPush) return *push;
    return *pull;
}

// --- AgentKvConnector ------------------------------------------------------------------------

AgentKvConnector::AgentKvConnector(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::shared_ptr<AgentKvConnector>> AgentKvConnector::Create(std::shared_ptr<Agent> agent,
                                                                   AgentConnectorConfig config) {
    if (!agent) return InvalidArgumentError("kv connector: no agent");
    if (config.model_fingerprint.empty() || config.model_kv_heads <= 0) {
        return InvalidArgumentError("kv connector: the model fingerprint and kv heads are needed");
    }
    auto impl = std::make_unique<Impl>();
    impl->pull = std::make_unique<PullProtocol>(*impl);
    impl->push = std::make_unique<PushProtocol>(*impl);
    impl->agent = std::move(agent);
    impl->cfg = std::move(config);
    impl->stats.transfer_seconds_buckets.assign(std::size(kTransferSecondsBuckets) + 1, 0);
    return std::shared_ptr<AgentKvConnector>(new AgentKvConnector(std::move(impl)));
}

AgentKvConnector::~AgentKvConnector() { Unbind(); }

Agent& AgentKvConnector::agent() const { return *impl_->agent; }

void AgentKvConnector::DeliverForTesting(const std::string& from, std::string_view payload) {
    impl_->OnMessage(from, std::string(payload));
}

Status AgentKvConnector::Bind(std::span<KvCache* const> caches, std::function<void()> wake) {
    Impl& m = *impl_;
    if (caches.empty()) return InvalidArgumentError("kv connector: no caches");
    if (m.bound) return FailedPreconditionError("kv connector: already bound");
    const int tp = static_cast<int>(caches.size());
    if (!TpSplitsHeads(tp, m.cfg.model_kv_heads) ||
        caches[0]->spec().kv_heads != RankKvHeads(tp, m.cfg.model_kv_heads)) {
        return InvalidArgumentError(
            fmt::format("kv connector: {} caches of {} kv heads for a model with {}", tp,
                        caches[0]->spec().kv_heads, m.cfg.model_kv_heads));
    }
    std::vector<RegionInfo> existing = m.agent->Regions();
    for (int r = 0; r < tp; ++r) {
        KvCache* c = caches[r];
        KvLayout l;
        l.spec = c->spec();
        l.head_begin = RankHeadBegin(r, tp, m.cfg.model_kv_heads);
        std::span<std::byte> mem = c->memory();
        // A cache the agent allocated (the fast shm path: peers map it) is already a region.
        auto it = std::find_if(existing.begin(), existing.end(), [&](const RegionInfo& ri) {
            return ri.base == mem.data() && ri.length >= mem.size();
        });
        RegionId id;
        if (it != existing.end()) {
            id = it->id;
        } else {
            auto reg = m.agent->RegisterMemory(mem.data(), mem.size());
            if (!reg.ok()) {
                for (RegionId x : m.registered) (void)m.agent->Deregister(x);
                m.registered.clear();
                return reg.status().WithContext(fmt::format("kv connector: rank {} cache", r));
            }
            id = reg->id;
            m.registered.push_back(id);
        }
        m.caches.push_back(c);
        m.layouts.push_back(l);
        m.regions.push_back(id);
    }
    auto scratch = m.agent->AllocateRegion(kProbeBytes * kProbeSlots);
    if (!scratch.ok()) return scratch.status().WithContext("kv connector: scratch");
    m.scratch = *scratch;
    // Each rank's handshake canary: peers read it through the mapping their requests use.
    m.canaries.clear();
    m.canary_layouts.clear();
    for (int r = 0; r < tp && m.cfg.canary; ++r) {
        KvLayout cl{CanarySpec(m.layouts[r].spec), m.layouts[r].head_begin};
        auto region = m.agent->AllocateRegion(cl.spec.TotalBytes());
        if (!region.ok()) return region.status().WithContext("kv connector: canary");
        FillCanary(cl, {static_cast<std::byte*>(region->base), cl.spec.TotalBytes()});
        m.canaries.push_back(*region);
        m.canary_layouts.push_back(cl);
    }
    m.tp = tp;
    m.wake = std::move(wake);
    m.push->Bind(tp, m.layouts[0].spec.num_layers);
    {
        std::lock_guard lock(m.mu);
        m.bound = true;
        m.stop = false;
    }
    m.notify_thread = std::thread([&m] { m.NotifyLoop(); });
    m.pump_thread = std::thread([&m] { m.PumpLoop(); });
    for (int i = 0; i < std::max(1, m.cfg.connect_threads); ++i) {
        m.connect_threads.emplace_back([&m] { m.ConnectLoop(); });
    }
    return Status::Ok();
}

void AgentKvConnector::Unbind() {
    Impl& m = *impl_;
    {
        std::lock_guard lock(m.mu);
        if (!m.bound) return;
        m.stop = true;
        m.bound = false;
    }
    m.waker->Kick();
    m.connect_cv.notify_all();
    if (m.notify_thread.joinable()) m.notify_thread.join();
    if (m.pump_thread.joinable()) m.pump_thread.join();
    for (std::thread& t : m.connect_threads) t.join();
    m.connect_threads.clear();
    std::lock_guard lock(m.mu);
    // Nothing may touch the caches after this: stop every transfer, then drop the regions.
    for (auto& [id, ld] : m.loads) {
        if (ld.xfer.valid()) (void)ld.xfer.Cancel();
    }
    m.push->CancelAll();
    for (auto& [name, p] : m.peers) {
        if (p.probe.valid()) (void)p.probe.Cancel();
    }
    for (auto& [key, c] : m.canary_checks) {
        if (c.xfer.valid()) (void)c.xfer.Cancel();
        if (c.scratch.id) (void)m.agent->Deregister(c.scratch.id);
    }
    m.canary_checks.clear();
    for (const RegionInfo& c : m.canaries) (void)m.agent->Deregister(c.id);
    m.canaries.clear();
    m.loads.clear();
    m.push->Clear();
    m.pull->Clear();
    m.peers.clear();
    m.connect_jobs.clear();
    for (RegionId id : m.registered) (void)m.agent->Deregister(id);
    m.registered.clear();
    if (m.scratch.id) (void)m.agent->Deregister(m.scratch.id);
    m.scratch = {};
    m.wake = nullptr;
}

Result<std::shared_ptr<ConnectorParams>> AgentKvConnector::ParseParams(
    const nlohmann::json& params) const {
    FERRY_ASSIGN_OR_RETURN(std::shared_ptr<KvTransferParams> p,
                           ParseConnectorKvParams(params, impl_->cfg.default_mode));
    return std::shared_ptr<ConnectorParams>(std::move(p));
}

bool AgentKvConnector::ReadyToSchedule(const ConnectorRequest& r) {
    Impl& m = *impl_;
    const KvTransferParams& p = AsKvTransferParams(r.params);
    if (!p.do_remote_decode) return true;
    std::lock_guard lock(m.mu);
    if (!m.bound) return true;
    return m.ProtocolOf(p.mode).ReadyToSchedule(r, p);
}

int AgentKvConnector::ExternalTokens(const ConnectorRequest& r, int num_computed) {
    const KvTransferParams& p = AsKvTransferParams(r.params);
    if (!p.do_remote_prefill) return 0;
    // No lock: it reads only the layouts, fixed between Bind and Unbind.
    return impl_->ProtocolOf(p.mode).ExternalTokens(p, static_cast<int>(r.prompt.size()),
                                                    num_computed);
}

void AgentKvConnector::StartLoad(const ConnectorRequest& r, std::span<const BlockId> blocks,
                                 int num_computed, int num_external) {
    Impl& m = *impl_;
    std::lock_guard lock(m.mu);
    Load& ld = m.loads[r.id];
    // Its hold is renewed from here on only while the load waits to claim it.
    if (auto a = m.admitted.find(r.id); a != m.admitted.end()) a->second.load_started = true;
    const KvTransferParams& params = AsKvTransferParams(r.params);
    ld.params = params;
    ld.peer = params.remote_engine_id;
    ld.blocks.assign(blocks.begin(), blocks.end());
    ld.num_computed = num_computed;
    ld.num_external = num_external;
    ld.prompt_len = static_cast<int>(r.prompt.size());
    ld.prompt_digest = PromptDigest(r.prompt, r.mm);
    ld.started = SteadyClock::now();
    ld.deadline = ld.started + m.cfg.handshake_timeout + m.cfg.transfer_timeout;
    if (!m.bound) {
        m.FailLoad(r.id, UnavailableError("kv connector: shutting down"));
        return;
    }
    if (ld.peer.empty()) {
        m.FailLoad(r.id, InvalidArgumentError("kv_transfer_params: remote_engine_id is missing"));
        return;
    }
    if (ld.peer == m.agent->name()) {
        m.FailLoad(r.id, InvalidArgumentError(
                             "kv_transfer_params: remote_engine_id names this worker itself"));
        return;
    }
    if (params.mode == KvTransferMode::kPush && params.transfer_id.empty()) {
        m.FailLoad(r.id, InvalidArgumentError("kv_transfer_params: push needs a transfer_id"));
        return;
    }
    FERRY_LOG(kInfo, "kv: request {} bootstrapping with '{}' ({} tokens to load)", Esc(r.id),
              Esc(ld.peer), num_external);
    m.EnsurePeer(r.id, params);
}

FinishAction AgentKvConnector::RequestFinished(const ConnectorRequest& r,
                                               std::span<const BlockId> blocks, bool ok,
                                               const FirstToken* first) {
    Impl& m = *impl_;
    const KvTransferParams& p = AsKvTransferParams(r.params);
    FinishAction a;
    if (!p.do_remote_decode) return a;
    std::lock_guard lock(m.mu);
    if (!m.bound) return a;
    return m.ProtocolOf(p.mode).Finished(r, blocks, ok, first);
}

void AgentKvConnector::Abort(const std::string& id) {
    Impl& m = *impl_;
    std::lock_guard lock(m.mu);
    auto it = m.loads.find(id);
    if (it == m.loads.end()) return;
    if (it->second.state == Load::State::kBootstrapping) {
        auto p = m.peers.find(it->second.peer);
        if (p != m.peers.end()) std::erase(p->second.waiting, id);
    }
    m.FailLoad(id, CancelledError("the client went away"), "aborted");
}

Status AgentKvConnector::Admit(const ConnectorRequest& r) {
    Impl& m = *impl_;
    const KvTransferParams& p = AsKvTransferParams(r.params);
    if (!p.do_remote_decode && !p.do_remote_prefill) return Status::Ok();
    std::lock_guard lock(m.mu);
    if (m.admitted.count(r.id)) {
        return AlreadyExistsError(fmt::format("request id '{}' is in use", Esc(r.id)));
    }
    // The router, and a program that submits to the engine itself (no requester), are not
    // capped per client.
    const bool router = p.requester == kRouterRequester || p.requester.empty();
    const std::string who = p.requester.empty() ? std::string("(unknown)") : p.requester;
    Admission a;
    a.requester = p.requester;
    if (p.do_remote_decode) {
        const int bt = m.layouts.empty() ? 1 : m.bt();
        const int blocks = static_cast<int>((r.prompt.size() + bt - 1) / bt);
        if (!router && p.mode == KvTransferMode::kPull) {
            // Early, before any compute: the client's unclaimed holds already fill its share,
            // or the prompt alone is larger than it. Which of its blocks the client's holds
            // already pin (a shared prefix) is known only when the hold would be made, where
            // RequestFinished checks again.
            Status st = m.pull->HoldShareLeft(p.requester, {}, 1);
            if (st.ok() && blocks > m.pull->HoldCap() && m.pull->HoldCap() > 0) {
                st = ResourceExhaustedError(fmt::format(
                    "kv: a prompt of {} KV blocks is more than a client may hold for remote "
                    "decoders ({} blocks)",
                    blocks, m.pull->HoldCap()));
            }
            if (!st.ok()) return st;
        }
        if (p.mode == KvTransferMode::kPush) {
            a.push_xid = p.transfer_id;
            a.renew_at = SteadyClock::now() + m.cfg.hold_renew_interval;
        }
    } else {
        a.load = true;
        a.peer = p.remote_engine_id;
        if (p.mode == KvTransferMode::kPull) {
            a.hold_rid = p.remote_request_id;
            a.hold_nonce = p.hold_nonce;
            a.renew_at = SteadyClock::now();  // at once: the first lease may be nearly over
        }
        int loads = 0, on_peer = 0;
        auto peer_ready = [&](const std::string& name) {
            auto it = m.peers.find(name);
            return it != m.peers.end() && it->second.state == Peer::State::kReady;
        };
        // The peers this client's loads wait to handshake with: each holds a connect thread
        // for up to the handshake timeout.
        std::set<std::string> dialing;
        for (const auto& [id, x] : m.admitted) {
            if (!x.load) continue;
            if (x.peer == a.peer) ++on_peer;
            if (x.requester != p.requester) continue;
            ++loads;
            if (!peer_ready(x.peer)) dialing.insert(x.peer);
        }
        const int dials = static_cast<int>(dialing.size());
        if (!router && m.cfg.max_client_loads > 0 && loads >= m.cfg.max_client_loads) {
            return ResourceExhaustedError(
                fmt::format("kv: client {} has {} KV loads in flight (at most {})", Esc(who), loads,
                            m.cfg.max_client_loads));
        }
        if (!router && m.cfg.max_client_dials > 0 && !peer_ready(a.peer) &&
            !dialing.count(a.peer) && dials >= m.cfg.max_client_dials) {
            return ResourceExhaustedError(
                fmt::format("kv: client {} has {} KV loads waiting for a handshake (at most {})",
                            Esc(who), dials, m.cfg.max_client_dials));
        }
        if (m.cfg.max_peer_loads > 0 && on_peer >= m.cfg.max_peer_loads) {
            return UnavailableError(
                fmt::format("kv: {} KV loads already wait on prefill worker '{}' (at most {})",
                            on_peer, Esc(a.peer), m.cfg.max_peer_loads));
        }
    }
    m.admitted[r.id] = std::move(a);
    return Status::Ok();
}

void AgentKvConnector::Retire(const std::string& id) {
    Impl& m = *impl_;
    std::lock_guard lock(m.mu);
    m.admitted.erase(id);
}

std::vector<ConnectorEvent> AgentKvConnector::TakeEvents() {
    Impl& m = *impl_;
    std::lock_guard lock(m.mu);
    std::vector<ConnectorEvent> out;
    out.swap(m.events);
    return out;
}

KvAllocator AgentKvAllocator(std::shared_ptr<Agent> agent) {
    KvAllocator a;
    a.allocate = [agent](size_t bytes) -> Result<std::span<std::byte>> {
        FERRY_ASSIGN_OR_RETURN(RegionInfo r, agent->AllocateRegion(bytes));
        return std::span(static_cast<std::byte*>(r.base), r.length);
    };
    a.release = [agent](std::span<std::byte> mem) {
        for (const RegionInfo& r : agent->Regions()) {
            if (r.base == mem.data()) (void)agent->Deregister(r.id);
        }
    };
    return a;
}

LayerHook* AgentKvConnector::BeginStep(std::span<const StepChunk> chunks) {
    return impl_->push->BeginStep(chunks);
}

void AgentKvConnector::EndStep() { impl_->push->EndStep(); }

}  // namespace ferry::kv
