#include "transfer/agent_core.h"

#include <algorithm>
#include <cstring>

#include "core/crypto.h"
#include "core/log.h"
#include "transfer/agent_config.h"

namespace ferry::internal {

namespace {

constexpr auto kTickPeriod = std::chrono::milliseconds(10);

}  // namespace

AgentCore::AgentCore(AgentConfig config)
    : config_(std::move(config)),
      epoch_(SecureRandomU64() | 1),
      host_id_(LocalHostId()),
      cma_probe_(std::make_unique<uint64_t>(SecureRandomU64())),
      objects_(regions_),
      files_(FileEngine::Options{config_.file_queue_depth, config_.file_io == "io_uring"}),
      target_(config_.name, regions_, objects_, notes_, files_),
      links_(
          StreamLinks::Identity{config_.name, epoch_, config_.secret, cma_probe_.get()},
          [this] { return NextLoop(); }, this),
      stream_target_(target_, regions_, peer_memory_, files_, shut_down_) {}

Result<std::shared_ptr<AgentCore>> AgentCore::Create(AgentConfig config) {
    FERRY_RETURN_IF_ERROR(ValidateAgentConfig(config));
    std::shared_ptr<AgentCore> core(new AgentCore(std::move(config)));
    Status s = core->Start();
    if (!s.ok()) {
        core->Shutdown();
        return s;
    }
    return core;
}

Status AgentCore::Start() {
    const int threads = IoThreadsFor(config_);
    for (int i = 0; i < threads; ++i) {
        FERRY_ASSIGN_OR_RETURN(auto loop, IoLoop::Create("ferry-io" + std::to_string(i)));
        loops_.push_back(std::move(loop));
    }
    // The side channel that serves metadata is always there: the first enabled backend that can
    // carry it, else the first in the registry that can (enabled for that alone).
    std::vector<std::unique_ptr<Backend>> created;
    for (const std::string& n : config_.backends) {
        FERRY_ASSIGN_OR_RETURN(auto backend, CreateBackend(n, config_, host_id_));
        if (side_channel_.empty() && backend->capabilities().side_channel) side_channel_ = n;
        created.push_back(std::move(backend));
    }
    for (const std::string& n : KnownBackends()) {
        if (!side_channel_.empty()) break;
        FERRY_ASSIGN_OR_RETURN(auto backend, CreateBackend(n, config_, host_id_));
        if (backend->capabilities().side_channel) {
            side_channel_ = n;
            created.push_back(std::move(backend));
        }
    }
    if (side_channel_.empty()) {
        return InternalError("no backend in this build can carry the side channel");
    }
    std::vector<std::pair<std::string, BackendCapabilities>> offered;
    for (auto& backend : created) {
        const std::string n(backend->name());
        ScopedFd listener;
        FERRY_ASSIGN_OR_RETURN(std::string address, backend->Listen(&listener));
        const BackendCapabilities caps = backend->capabilities();
        const bool enabled = std::find(config_.backends.begin(), config_.backends.end(), n) !=
                             config_.backends.end();
        if (enabled) {
            offered.emplace_back(n, caps);
            endpoints_[n] = address;
        }
        if (caps.data_path == DataPath::kOwn) {
            FERRY_RETURN_IF_ERROR(backend->Start(&target_).WithContext("backend " + n));
            own_path_.push_back(backend.get());
        } else {
            FERRY_RETURN_IF_ERROR(
                links_.Listen(backend.get(), std::move(listener), loops_[0].get()));
            if (n == side_channel_) side_channel_address_ = address;
        }
        backends_.emplace(n, std::move(backend));
    }
    enabled_ = RankBackends(std::move(offered));
    // Transfers to the agent itself (its memory and file regions) have a backend of their own.
    FERRY_ASSIGN_OR_RETURN(self_path_, CreateSelfBackend(config_, host_id_));
    FERRY_RETURN_IF_ERROR(
        self_path_->Start(&target_).WithContext("backend " + std::string(self_path_->name())));
    loops_[0]->SetTick(kTickPeriod, [this] { Tick(); });
    FERRY_LOG(kInfo, "agent {} epoch {:016x} listening on {}", config_.name, epoch_,
              side_channel_address_);
    if (!config_.store.empty()) {
        registrar_ = std::make_unique<Registrar>(
            config_, epoch_,
            Registrar::Callbacks{
                [this] { return Metadata(); },
                [this](const std::string& name, const StoreEvent& e) { OnPeerEntry(name, e); }});
        FERRY_RETURN_IF_ERROR(
            registrar_->Start().WithContext("AgentConfig.store " + config_.store));
    }
    return Status::Ok();
}

AgentCore::~AgentCore() {
    Shutdown();
    files_.Reset();  // its callbacks reach what the members below hold
}

void AgentCore::Shutdown() {
    if (shut_down_.exchange(true)) {
        return;
    }
    if (registrar_) {
        registrar_->Stop();  // leaves discovery at once instead of at the end of the lease
    }
    std::vector<std::shared_ptr<TransferOp>> ops;
    {
        std::lock_guard<std::mutex> lock(ops_mu_);
        for (auto& [id, w] : ops_) {
            if (auto op = w.lock()) ops.push_back(std::move(op));
        }
        ops_.clear();
    }
    for (Backend* b : own_path_) {
        b->Stop();  // their transfers fail with Cancelled once the backend let go of their memory
    }
    if (self_path_) self_path_->Stop();
    const Status why = CancelledError("agent " + config_.name + " is shutting down");
    for (auto& op : ops) {
        op->Fail(why, /*close_streams=*/false);
    }
    links_.CloseAll(why);
    for (auto& loop : loops_) {
        loop->Stop();
    }
    peers_.Clear();
    links_.ReleaseListeners();
    notes_.Close();
}

IoLoop* AgentCore::NextLoop() { return loops_[next_loop_.fetch_add(1) % loops_.size()].get(); }

Backend* AgentCore::FindBackend(std::string_view name) const {
    auto it = backends_.find(name);
    return it == backends_.end() ? nullptr : it->second.get();
}

void AgentCore::TrackOp(const std::shared_ptr<TransferOp>& op) {
    std::lock_guard<std::mutex> lock(ops_mu_);
    ops_[op->id()] = op;
}

// --- Discovery --------------------------------------------------------------------------------

void AgentCore::MarkMetadataChanged() {
    // At once: a peer without a side channel (shm only) knows this agent's regions only from
    // the store entry, so it must be current before the region is used.
    if (registrar_) registrar_->PublishNow();
}

void AgentCore::OnPeerEntry(const std::string& name, const StoreEvent& e) {
    std::shared_ptr<Peer> peer = peers_.Find(name);
    if (!peer) {
        return;  // only peers this agent uses are followed
    }
    if (e.type == StoreEvent::Type::kDelete) {
        // Its lease lapsed (dead or cut off) or it shut down: fail what is pending on it now
        // rather than at each transfer's deadline. It stays a peer, in case it comes back.
        ClosePeerStreams(*peer, UnavailableError("peer " + name + " left discovery"));
        return;
    }
    Result<std::string> added = AddPeer(e.value);  // a new epoch replaces the old process
    if (!added.ok()) {
        FERRY_LOG(kWarn, "agent {}: ignoring the discovery entry of {}: {}", config_.name, name,
                  added.status().ToString());
    }
}

Result<std::string> AgentCore::ConnectByName(std::string_view name) {
    MetadataStore* store = registrar_ ? registrar_->store() : nullptr;
    if (store == nullptr) {
        return FailedPreconditionError("ConnectByName: agent " + config_.name +
                                       " has no discovery store (AgentConfig.store)");
    }
    Result<StoreEntry> e = store->Get(AgentKey(name));
    if (!e.ok()) {
        if (e.status().code() == Code::kNotFound) {
            return NotFoundError("ConnectByName: no agent '" + std::string(name) +
                                 "' registered at " + config_.store);
        }
        return e.status().WithContext("ConnectByName " + std::string(name));
    }
    // The entry says where the agent listens and what it holds (put again before a region
    // registration returns); its side channel, where it has one, answers for itself.
    Result<AgentMetadata> md = DecodeMetadata(e->value);
    if (!md.ok()) {
        return md.status().WithContext("ConnectByName " + std::string(name) + ": store entry");
    }
    Result<std::string> r = InvalidArgumentError("no side channel endpoint");
    if (const EndpointInfo* side = md->FindEndpoint(side_channel_)) {
        r = Connect(side->address, std::chrono::seconds(5));
    } else {
        r = AddPeer(e->value);
    }
    if (!r.ok()) {
        return r.status().WithContext("ConnectByName " + std::string(name));
    }
    std::string added = *r;
    if (added != name) {
        return InvalidArgumentError("ConnectByName: the entry for '" + std::string(name) +
                                    "' holds the metadata of '" + added + "'");
    }
    return added;
}

// --- Memory ---------------------------------------------------------------------------------

Result<RegionInfo> AgentCore::RegisterMemory(void* ptr, size_t length) {
    Result<RegionInfo> r = regions_.Register(ptr, length);
    if (r.ok()) MarkMetadataChanged();
    return r;
}

Result<RegionInfo> AgentCore::AllocateRegion(size_t length) {
    Result<RegionInfo> r = regions_.Allocate(length);
    if (r.ok()) MarkMetadataChanged();
    return r;
}

Result<RegionInfo> AgentCore::RegisterFile(const std::string& path, int fd, uint64_t offset,
                                           uint64_t length, const FileRegionOptions& options) {
    // The engine exists before the first file region does.
    FERRY_RETURN_IF_ERROR(files_.Ensure(config_.name).status());
    Result<RegionInfo> r = regions_.RegisterFile(path, fd, offset, length, options);
    if (r.ok()) MarkMetadataChanged();
    return r;
}

Status AgentCore::Deregister(RegionId id) {
    std::shared_ptr<RegionEntry> entry = regions_.Find(id);
    if (!entry) {
        return NotFoundError("Deregister: no region " + std::to_string(id));
    }
    const uint64_t share_id = entry->share_id;
    entry.reset();  // our reference must not keep an owned mapping alive past Deregister
    // Local transfers using it fail first, so their pins drop.
    std::vector<std::shared_ptr<TransferOp>> users;
    {
        std::lock_guard<std::mutex> lock(ops_mu_);
        for (auto& [oid, w] : ops_) {
            auto op = w.lock();
            if (op && !op->finished() && op->UsesLocalRegion(id)) users.push_back(std::move(op));
        }
    }
    for (auto& op : users) {
        op->Fail(CancelledError("local region " + std::to_string(id) + " was deregistered"));
    }
    // Peers holding a one-sided grant of it let go first (no new grants from now on).
    for (Backend* b : own_path_) b->RevokeRegion(id, kDeregisterGrace);
    Status s = regions_.Deregister(id, kDeregisterGrace, [this](RegionId rid) {
        for (auto& c : links_.Snapshot()) {
            bool holds = false;
            c->loop()->RunSync([&] { holds = !c->closed() && c->HoldsRegion(rid); });
            if (holds) {
                c->CloseAndWait(UnavailableError("region " + std::to_string(rid) +
                                                 " deregistered while this stream was stalled"));
            }
        }
    });
    if (s.ok()) {
        MarkMetadataChanged();
    }
    for (Backend* b : own_path_) b->RegionGone(id);
    if (s.ok() && share_id != 0) {
        RevokeGrants(share_id, id);  // initiators copying one-sided stop before we return
        BroadcastUnshare(share_id);  // targets drop their mappings of it
    }
    return s;
}

// --- Peers ----------------------------------------------------------------------------------

AgentMetadata AgentCore::SelfMetadata() const {
    AgentMetadata md;
    md.name = config_.name;
    md.epoch = epoch_;
    md.host_id = host_id_;
    for (const std::string& b : enabled_) {
        md.endpoints.push_back(EndpointInfo{b, endpoints_.at(b)});
    }
    for (const RegionInfo& r : regions_.List(&md.revision)) {
        md.regions.push_back(RemoteRegion{r.id, r.length, r.key, r.kind});
    }
    std::sort(md.regions.begin(), md.regions.end(),
              [](const RemoteRegion& a, const RemoteRegion& b) { return a.id < b.id; });
    return md;
}

std::string AgentCore::Metadata() const { return EncodeMetadata(SelfMetadata()); }

Result<std::string> AgentCore::AddPeer(std::string_view blob) {
    FERRY_ASSIGN_OR_RETURN(AgentMetadata md, DecodeMetadata(blob));
    if (md.name == config_.name) {
        return AlreadyExistsError("AddPeer: metadata of this agent itself (" + md.name + ")");
    }
    FERRY_ASSIGN_OR_RETURN(std::string backend,
                           SelectBackend(
                               enabled_, [this](std::string_view n) { return FindBackend(n); },
                               config_.force_backend, SelfMetadata(), md));
    std::string name = md.name;
    std::shared_ptr<Peer> old;
    peers_.Upsert(std::move(md), std::move(backend), &old);
    if (old) {
        FERRY_LOG(kInfo, "peer {} restarted: dropping the old epoch", name);
        ClosePeerStreams(*old, UnavailableError("peer " + name + " restarted with a new epoch"));
    }
    return name;
}

void AgentCore::ClosePeerStreams(Peer& peer, const Status& why) {
    std::vector<std::shared_ptr<Connection>> conns;
    {
        std::lock_guard<std::mutex> lock(peer.mu);
        for (Backend* b : own_path_) b->PeerLost(peer.md.name, peer.md.epoch, why);
        for (auto& [b, v] : peer.streams) {
            for (auto& c : v) {
                if (c) conns.push_back(c);
            }
        }
        peer.streams.clear();
    }
    for (auto& c : conns) {
        c->Close(why);
    }
}

Status AgentCore::RemovePeer(std::string_view name) {
    std::shared_ptr<Peer> peer = peers_.Remove(name);
    if (!peer) {
        return NotFoundError("RemovePeer: unknown peer " + std::string(name));
    }
    ClosePeerStreams(*peer, UnavailableError("peer " + std::string(name) + " was removed"));
    return Status::Ok();
}

AgentStats AgentCore::Stats() const {
    uint64_t one_sided = one_sided_transfers_.load();
    for (Backend* b : own_path_) one_sided += b->one_sided_transfers();
    AgentStats st;
    st.transfers_posted = transfers_posted_.load();
    st.one_sided_transfers = one_sided;
    st.bytes_posted = bytes_posted_.load();
    st.handshakes_refused = links_.handshakes_refused();
    st.stalled_frames_dropped = links_.stalled_frames_dropped();
    st.receive_budget_used = links_.receive_budget().used.load();
    st.receive_budget_waits = links_.receive_budget().waits.load();
    st.handshakes_pending = links_.handshakes_pending();
    st.messages_sent = links_.wire_counters().sent.load();
    st.messages_received = links_.wire_counters().received.load();
    for (Backend* b : own_path_) {
        st.messages_sent += b->messages_sent();
        st.messages_received += b->messages_received();
    }
    return st;
}

Result<std::string> AgentCore::PeerBackend(std::string_view name) const {
    auto peer = peers_.Find(name);
    if (!peer) {
        return NotFoundError("unknown peer " + std::string(name));
    }
    return peer->backend;
}

PeerRef AgentCore::RefFor(Peer& peer, const Backend& backend) const {
    std::lock_guard<std::mutex> lock(peer.mu);
    const EndpointInfo* e = peer.md.FindEndpoint(backend.name());
    return PeerRef{peer.md.name, peer.md.epoch, e != nullptr ? e->address : ""};
}

Result<std::shared_ptr<Connection>> AgentCore::Dial(Backend& backend, std::string_view address,
                                                    const std::string& label, wire::Purpose purpose,
                                                    uint64_t expect_epoch) {
    if (shut_down_.load()) {
        return CancelledError("agent " + config_.name + " is shutting down");
    }
    return links_.Dial(backend, address, label, purpose, expect_epoch);
}

Result<std::vector<std::shared_ptr<Connection>>> AgentCore::Streams(Peer& peer, Backend& backend) {
    std::lock_guard<std::mutex> lock(peer.mu);
    const EndpointInfo* ep = peer.md.FindEndpoint(backend.name());
    if (ep == nullptr) {
        return FailedPreconditionError("peer " + peer.md.name + " offers no " +
                                       std::string(backend.name()) + " endpoint");
    }
    auto& v = peer.streams[std::string(backend.name())];
    v.resize(static_cast<size_t>(backend.streams()));
    for (size_t i = 0; i < v.size(); ++i) {
        if (!v[i] || v[i]->closed()) {
            FERRY_ASSIGN_OR_RETURN(v[i], Dial(backend, ep->address,
                                              peer.md.name + " (" + std::string(backend.name()) +
                                                  " stream " + std::to_string(i) + ")",
                                              wire::Purpose::kData, peer.md.epoch));
        }
    }
    return v;
}

Result<std::string> AgentCore::Connect(std::string_view host_port,
                                       std::chrono::milliseconds timeout) {
    Backend* side = FindBackend(side_channel_);
    struct Fetch {
        std::mutex mu;
        std::condition_variable cv;
        bool done = false;
        Status status;
        std::string blob;
    };
    auto fetch = std::make_shared<Fetch>();
    FERRY_ASSIGN_OR_RETURN(auto conn,
                           Dial(*side, host_port, "side channel " + std::string(host_port),
                                wire::Purpose::kSideChannel, 0));
    OutFrame f;
    f.request_id = NextRequestId();
    f.head = wire::MakeFrame(wire::FrameType::kGetMetadata, f.request_id, {});
    f.expects_response = true;
    f.expect.callback = [fetch](const Status& s, std::string_view body) {
        std::lock_guard<std::mutex> lock(fetch->mu);
        if (fetch->done) return;
        fetch->done = true;
        fetch->status = s;
        fetch->blob = std::string(body);
        fetch->cv.notify_all();
    };
    conn->Send(std::move(f));
    std::unique_lock<std::mutex> lock(fetch->mu);
    bool done = fetch->cv.wait_for(lock, timeout, [&] { return fetch->done; });
    lock.unlock();
    conn->Close(CancelledError("metadata fetched"));
    if (!done) {
        return DeadlineExceededError("Connect " + std::string(host_port) + ": no metadata within " +
                                     std::to_string(timeout.count()) + " ms");
    }
    if (!fetch->status.ok()) {
        return fetch->status.WithContext("Connect " + std::string(host_port));
    }
    return AddPeer(fetch->blob);
}

// --- Stream connections -----------------------------------------------------------------------

void AgentCore::OnRequest(Connection& conn, const wire::FrameHeader& h, std::string_view body) {
    switch (h.type) {
        case wire::FrameType::kNotify:
            if (body.size() > wire::kMaxNotificationLen) {
                conn.Close(InvalidArgumentError("notification over the size limit"));
                return;
            }
            notes_.Push(conn.peer_name(), std::string(body));
            return;
        case wire::FrameType::kGetMetadata: {
            OutFrame f;
            f.head = wire::MakeFrame(wire::FrameType::kMetadata, h.request_id, Metadata());
            conn.SendNow(std::move(f));
            return;
        }
        case wire::FrameType::kPull:
            stream_target_.ServePull(conn, h, body);
            return;
        case wire::FrameType::kUnshare:
            HandleUnshare(conn, h, body);
            return;
        case wire::FrameType::kMapRegion:
            stream_target_.ServeMapRegion(conn, h, body);
            return;
        case wire::FrameType::kWrite:
        case wire::FrameType::kRead:
            stream_target_.ServeData(conn, h, body);
            return;
        default:
            conn.Close(InvalidArgumentError("unexpected request type"));
    }
}

void AgentCore::OnClosed(Connection& conn, const Status& why) {
    const bool still_connected = links_.Closed(conn, why);
    if (conn.peer_pid() != 0 && !still_connected) {
        PeerProcessGone(conn, why);
    }
}

void AgentCore::Tick() {
    const auto now = Clock::now();
    std::vector<std::shared_ptr<TransferOp>> expired;
    {
        std::lock_guard<std::mutex> lock(ops_mu_);
        for (auto it = ops_.begin(); it != ops_.end();) {
            auto op = it->second.lock();
            if (!op || op->finished()) {
                it = ops_.erase(it);
                continue;
            }
            if (now >= op->deadline()) {
                expired.push_back(std::move(op));
            }
            ++it;
        }
    }
    for (auto& op : expired) {
        op->Fail(DeadlineExceededError("transfer " + std::to_string(op->id()) + " to " +
                                       op->peer() + " (" + std::to_string(op->bytes()) +
                                       " bytes) missed its deadline"));
    }
    links_.Tick(now, config_.stalled_frame_timeout);
}

}  // namespace ferry::internal
