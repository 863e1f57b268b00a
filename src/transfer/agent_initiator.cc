// The initiator side of AgentCore: transfers (over a backend's own data path, over streams, or
// between this agent's own regions through the file engine), notifications and pulls by key.
#include <algorithm>
#include <unordered_map>

#include "transfer/agent_core.h"

namespace ferry::internal {

namespace {

constexpr uint64_t kMinChunk = 64 * 1024;
constexpr uint64_t kMaxChunk = 4u << 20;

}  // namespace

Result<Transfer> AgentCore::Post(TransferOp::Kind kind, std::span<const Descriptor> local,
                                 std::string_view peer_name, std::span<const Descriptor> remote,
                                 const TransferOptions& options) {
    if (shut_down_.load()) {
        return CancelledError("agent " + config_.name + " is shutting down");
    }
    if (peer_name == config_.name) {
        return PostLocal(kind, local, remote, options);
    }
    std::shared_ptr<Peer> peer = peers_.Find(peer_name);
    if (!peer) {
        return NotFoundError("unknown peer " + std::string(peer_name) +
                             " (AddPeer or Connect first)");
    }
    if (options.notification && options.notification->size() > wire::kMaxNotificationLen) {
        return InvalidArgumentError(
            "notification of " + std::to_string(options.notification->size()) +
            " bytes exceeds the limit of " + std::to_string(wire::kMaxNotificationLen));
    }
    std::string backend_name = options.backend.empty() ? peer->backend : options.backend;
    Backend* backend = FindBackend(backend_name);
    if (backend == nullptr ||
        std::find(enabled_.begin(), enabled_.end(), backend_name) == enabled_.end()) {
        return InvalidArgumentError("backend '" + backend_name + "' is not enabled on agent " +
                                    config_.name);
    }

    // Local side: resolve, check bounds, pin.
    std::unordered_map<RegionId, std::shared_ptr<RegionEntry>> local_entries;
    std::unordered_map<RegionId, RegionView> local_views;
    auto find_local = [&](RegionId id) -> const RegionView* {
        auto it = local_views.find(id);
        if (it != local_views.end()) return &it->second;
        auto e = regions_.Find(id);
        if (!e) return nullptr;
        local_entries[id] = e;
        return &(local_views[id] = RegionView{e->base, e->length, e->key});
    };
    std::vector<Run> local_runs;
    FERRY_RETURN_IF_ERROR(ExpandDescriptors(local, find_local, "local", &local_runs));
    for (const auto& [id, e] : local_entries) {
        if (e->kind == MemoryKind::kFile) {
            return InvalidArgumentError(
                "local region " + std::to_string(id) +
                " is a file region: a transfer with a peer moves bytes between memory regions "
                "here and the peer's memory or file regions; read the file into memory first "
                "(a transfer to this agent itself), or let the peer read it");
        }
    }

    // Remote side: against the peer's published regions (the target checks again).
    std::unordered_map<RegionId, RegionView> remote_views;
    std::unordered_map<RegionId, MemoryKind> remote_kinds;
    const BackendCapabilities caps = backend->capabilities();
    {
        std::lock_guard<std::mutex> lock(peer->mu);
        for (const RemoteRegion& r : peer->md.regions) {
            remote_views[r.id] = RegionView{nullptr, r.length, r.key};
            remote_kinds[r.id] = r.kind;
        }
    }
    auto find_remote = [&](RegionId id) -> const RegionView* {
        auto it = remote_views.find(id);
        return it == remote_views.end() ? nullptr : &it->second;
    };
    std::vector<Run> remote_runs;
    FERRY_RETURN_IF_ERROR(ExpandDescriptors(remote, find_remote, "remote", &remote_runs)
                              .WithContext("peer " + std::string(peer_name)));
    FERRY_ASSIGN_OR_RETURN(auto segments, PairRuns(local_runs, remote_runs));
    bool all_host = true;
    for (const Run& r : remote_runs) {
        const MemoryKind k = remote_kinds[r.region];
        if (!caps.touches(k)) {
            return FailedPreconditionError(
                "backend " + backend_name + " cannot reach region " + std::to_string(r.region) +
                " of peer " + std::string(peer_name) + " (" + MemoryKindName(k) + " memory)");
        }
        all_host = all_host && k == MemoryKind::kHost;
    }

    std::vector<RegionPin> pins;
    for (auto& [id, e] : local_entries) {
        FERRY_ASSIGN_OR_RETURN(RegionPin p, regions_.PinLocal(id));
        pins.push_back(std::move(p));
    }

    auto timeout = options.timeout.count() > 0 ? options.timeout : config_.default_timeout;
    const Clock::time_point deadline = Clock::now() + timeout;
    if (caps.data_path == DataPath::kOwn) {
        return PostOwnPath(kind, peer, *backend, std::move(segments), std::move(pins), all_host,
                           deadline, options);
    }
    return PostStreams(kind, peer, *backend, std::move(segments), std::move(pins), deadline,
                       options);
}

Result<Transfer> AgentCore::PostOwnPath(TransferOp::Kind kind, const std::shared_ptr<Peer>& peer,
                                        Backend& backend_ref, std::vector<PlannedSegment> segments,
                                        std::vector<RegionPin> pins, bool all_host,
                                        Clock::time_point deadline,
                                        const TransferOptions& options) {
    Backend* backend = &backend_ref;
    uint64_t total = 0;
    for (const auto& s : segments) total += s.remote.length;
    std::vector<Chunk> chunks =
        MakeChunks(segments, backend->chunk_bytes(), backend->max_segments());
    transfers_posted_.fetch_add(1, std::memory_order_relaxed);
    bytes_posted_.fetch_add(total, std::memory_order_relaxed);
    PeerRef ref = RefFor(*peer, *backend);
    auto op = std::make_shared<TransferOp>(next_op_id_.fetch_add(1), kind, total, deadline,
                                           ref.name, wire::DataMode::kInline);
    op->SetCutOff([backend, id = op->id()](const Status& s) { backend->CutOff(id, s); });
    std::function<void()> on_success;
    if (options.notification) {
        on_success = [backend, ref, payload = *options.notification, self = config_.name] {
            (void)backend->Notify(ref, payload, self);
        };
    }
    op->Arm(static_cast<uint32_t>(chunks.size()), std::move(pins), std::move(on_success));
    TrackOp(op);
    // One-sided only where every remote region is host memory (files are staged by the target).
    backend->Post(op, ref, kind == TransferOp::Kind::kWrite, std::move(chunks), all_host);
    return Transfer(op);
}

Result<Transfer> AgentCore::PostStreams(TransferOp::Kind kind, const std::shared_ptr<Peer>& peer,
                                        Backend& backend_ref, std::vector<PlannedSegment> segments,
                                        std::vector<RegionPin> pins, Clock::time_point deadline,
                                        const TransferOptions& options) {
    Backend* backend = &backend_ref;
    FERRY_ASSIGN_OR_RETURN(auto streams, Streams(*peer, *backend));
    uint64_t total = 0;
    for (const auto& s : segments) total += s.remote.length;
    uint64_t per_stream = (total + streams.size() - 1) / streams.size();
    uint64_t chunk_bytes = std::clamp<uint64_t>(per_stream, kMinChunk, kMaxChunk);
    std::vector<Chunk> chunks = MakeChunks(segments, chunk_bytes, wire::kMaxSegmentsPerFrame);

    wire::DataMode mode = backend->data_mode();
    transfers_posted_.fetch_add(1, std::memory_order_relaxed);
    bytes_posted_.fetch_add(total, std::memory_order_relaxed);

    // One-sided shm: every remote byte lies in a region of the peer mapped here. The first
    // transfer to a region waits (one round trip, at most kMapWait) for the peer's grant.
    std::vector<TransferOp::LocalCopy> work;
    std::vector<std::shared_ptr<void>> keep;
    const bool one_sided = mode == wire::DataMode::kCma && config_.shm_map_peer_regions &&
                           PlanOneSided(peer, chunks, streams[0], deadline, &work, &keep);
    if (one_sided) {
        mode = wire::DataMode::kInline;  // nothing of ours is exposed to the peer
    }

    auto op = std::make_shared<TransferOp>(next_op_id_.fetch_add(1), kind, total, deadline,
                                           peer->name, mode);
    std::function<void()> on_success;
    if (options.notification) {
        std::shared_ptr<Connection> control = streams[0];
        std::string payload = *options.notification;
        on_success = [control, payload = std::move(payload)] {
            OutFrame n;
            n.head = wire::MakeFrame(wire::FrameType::kNotify, 0, payload);
            control->Send(std::move(n));
        };
    }
    op->Arm(static_cast<uint32_t>(chunks.size()), std::move(pins), std::move(on_success));
    TrackOp(op);
    if (one_sided) {
        one_sided_transfers_.fetch_add(1, std::memory_order_relaxed);
        size_t runners = std::min(work.size(), loops_.size());
        uint64_t epoch = 0;
        {
            std::lock_guard<std::mutex> lock(peer->mu);
            epoch = peer->md.epoch;
        }
        op->SetLocalWork(std::move(work), kind == TransferOp::Kind::kWrite, std::move(keep), epoch);
        for (size_t i = 0; i < runners; ++i) {
            NextLoop()->Post([op] { op->RunLocalWork(); });
        }
        return Transfer(op);
    }
    size_t first = static_cast<size_t>(peer->next_stream.fetch_add(1));
    for (size_t i = 0; i < chunks.size(); ++i) {
        Chunk& c = chunks[i];
        const auto& conn = streams[(first + i) % streams.size()];
        op->AddConnection(conn);
        wire::DataRequest req;
        req.mode = mode;
        req.segments = std::move(c.remote);
        if (mode == wire::DataMode::kCma) {
            req.initiator_iov = c.local;
            req.shares = SharesFor(regions_, c.local_regions);
        }
        OutFrame f;
        f.request_id = NextRequestId();
        f.expects_response = true;
        f.expect.op = op;
        f.expect.cma = (mode == wire::DataMode::kCma);
        bool inline_write = kind == TransferOp::Kind::kWrite && mode == wire::DataMode::kInline;
        f.head = wire::MakeFrame(
            kind == TransferOp::Kind::kWrite ? wire::FrameType::kWrite : wire::FrameType::kRead,
            f.request_id, wire::EncodeDataRequest(req), inline_write ? c.bytes : 0);
        if (inline_write) {
            f.payload = std::move(c.local);
            f.op = op;
        } else if (kind == TransferOp::Kind::kRead && mode == wire::DataMode::kInline) {
            f.expect.local = std::move(c.local);
            f.expect.local_bytes = c.bytes;
        }
        conn->Send(std::move(f));
    }
    return Transfer(op);
}

Result<Transfer> AgentCore::PostLocal(TransferOp::Kind kind, std::span<const Descriptor> local,
                                      std::span<const Descriptor> remote,
                                      const TransferOptions& options) {
    const std::string self = config_.name;
    const std::string backend(self_path_->name());
    if (options.notification) {
        return InvalidArgumentError("a transfer to this agent itself (" + self +
                                    ") carries no notification: wait on its handle");
    }
    if (!options.backend.empty() && options.backend != backend) {
        return InvalidArgumentError("a transfer to this agent itself (" + self +
                                    ") goes through the " + backend + " backend, not '" +
                                    options.backend + "'");
    }
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<SelfTransfer> plan,
                           self_path_->PlanSelf(kind == TransferOp::Kind::kWrite, local, remote));
    const uint64_t total = plan->bytes();
    auto timeout = options.timeout.count() > 0 ? options.timeout : config_.default_timeout;
    auto op = std::make_shared<TransferOp>(next_op_id_.fetch_add(1), kind, total,
                                           Clock::now() + timeout, self, wire::DataMode::kInline);
    self_path_->StartSelf(op, std::move(plan));
    transfers_posted_.fetch_add(1, std::memory_order_relaxed);
    bytes_posted_.fetch_add(total, std::memory_order_relaxed);
    TrackOp(op);  // only now can a cancel, a deadline or a Deregister reach it
    return Transfer(op);
}

// --- Notifications and pulls ------------------------------------------------------------------

Status AgentCore::Notify(std::string_view peer_name, std::string_view payload) {
    if (payload.size() > wire::kMaxNotificationLen) {
        return InvalidArgumentError("notification of " + std::to_string(payload.size()) +
                                    " bytes exceeds the limit of " +
                                    std::to_string(wire::kMaxNotificationLen));
    }
    std::shared_ptr<Peer> peer = peers_.Find(peer_name);
    if (!peer) {
        return NotFoundError("unknown peer " + std::string(peer_name));
    }
    Backend* backend = FindBackend(peer->backend);
    const BackendCapabilities caps = backend->capabilities();
    if (!caps.notifications) {
        return UnimplementedError("Notify: backend " + peer->backend + " (chosen for peer " +
                                  peer->md.name + ") carries no notifications");
    }
    if (caps.data_path == DataPath::kOwn) {
        return backend->Notify(RefFor(*peer, *backend), std::string(payload), config_.name);
    }
    FERRY_ASSIGN_OR_RETURN(auto streams, Streams(*peer, *backend));
    OutFrame f;
    f.head = wire::MakeFrame(wire::FrameType::kNotify, 0, payload);
    streams[0]->Send(std::move(f));
    return Status::Ok();
}

Result<PullResult> AgentCore::PullByKey(std::string_view peer_name, std::string_view key,
                                        const Descriptor& local,
                                        std::chrono::milliseconds timeout) {
    if (key.empty() || key.size() > wire::kMaxKeyLen) {
        return InvalidArgumentError("PullByKey: key must be 1.." +
                                    std::to_string(wire::kMaxKeyLen) + " bytes");
    }
    std::shared_ptr<Peer> peer = peers_.Find(peer_name);
    if (!peer) {
        return NotFoundError("unknown peer " + std::string(peer_name));
    }
    std::shared_ptr<RegionEntry> entry = regions_.Find(local.region);
    if (!entry) {
        return NotFoundError("PullByKey: no local region " + std::to_string(local.region));
    }
    RegionView view{entry->base, entry->length, entry->key};
    std::vector<Run> runs;
    FERRY_RETURN_IF_ERROR(ExpandDescriptors(
        std::span<const Descriptor>(&local, 1),
        [&](RegionId id) -> const RegionView* { return id == local.region ? &view : nullptr; },
        "PullByKey local", &runs));
    std::vector<iovec> iov;
    uint64_t capacity = 0;
    for (const Run& r : runs) {
        iov.push_back(iovec{r.base + r.offset, r.length});
        capacity += r.length;
    }
    capacity = std::min<uint64_t>(capacity, wire::kMaxPayload);
    FERRY_ASSIGN_OR_RETURN(RegionPin pin, regions_.PinLocal(local.region));
    Backend* backend = FindBackend(peer->backend);
    const BackendCapabilities caps = backend->capabilities();
    if (!caps.pull_by_key) {
        return UnimplementedError("PullByKey: backend " + peer->backend + " (chosen for peer " +
                                  peer->md.name + ") cannot pull by key");
    }
    if (caps.data_path == DataPath::kOwn) {
        auto op = std::make_shared<TransferOp>(next_op_id_.fetch_add(1), TransferOp::Kind::kPull,
                                               capacity, Clock::now() + timeout,
                                               std::string(peer_name), wire::DataMode::kInline);
        op->SetCutOff([backend, id = op->id()](const Status& s) { backend->CutOff(id, s); });
        std::vector<RegionPin> pins;
        pins.push_back(std::move(pin));
        op->Arm(1, std::move(pins), nullptr);
        TrackOp(op);
        backend->Pull(op, RefFor(*peer, *backend), std::string(key), std::move(iov), capacity);
        Transfer handle(op);
        Status s = op->Wait(op->deadline() + std::chrono::seconds(5));
        if (!s.ok()) {
            return s;
        }
        uint64_t size = op->pull_size().value_or(0);
        return PullResult{size, size <= capacity};
    }
    FERRY_ASSIGN_OR_RETURN(auto streams, Streams(*peer, *backend));
    wire::DataMode mode = backend->data_mode();
    auto op = std::make_shared<TransferOp>(next_op_id_.fetch_add(1), TransferOp::Kind::kPull,
                                           capacity, Clock::now() + timeout, peer->name, mode);
    std::vector<RegionPin> pins;
    pins.push_back(std::move(pin));
    op->Arm(1, std::move(pins), nullptr);
    op->AddConnection(streams[0]);
    TrackOp(op);
    wire::PullRequest req;
    req.key = std::string(key);
    req.capacity = capacity;
    req.mode = mode;
    OutFrame f;
    f.request_id = NextRequestId();
    f.expects_response = true;
    f.expect.op = op;
    f.expect.cma = mode == wire::DataMode::kCma;
    if (mode == wire::DataMode::kCma) {
        req.initiator_iov = iov;
        req.shares = SharesFor(regions_, {local.region});
    } else {
        f.expect.local = iov;
        f.expect.local_bytes = capacity;
    }
    f.head = wire::MakeFrame(wire::FrameType::kPull, f.request_id, wire::EncodePullRequest(req));
    streams[0]->Send(std::move(f));
    Transfer handle(op);  // cancels on scope exit if still pending
    Status s = op->Wait(op->deadline() + std::chrono::seconds(5));
    if (!s.ok()) {
        return s;
    }
    uint64_t size = op->pull_size().value_or(0);
    return PullResult{size, size <= capacity};
}

}  // namespace ferry::internal
