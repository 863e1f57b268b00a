#include "transfer/agent_core.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/core.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>
#include <unordered_set>

#include "core/cpu.h"
#include "core/crypto.h"
#include "core/log.h"
#include "transfer/iov_cursor.h"
#include "transfer/planner.h"

namespace ferry::internal {

namespace {

constexpr auto kTickPeriod = std::chrono::milliseconds(10);
constexpr auto kHandshakeTimeout = std::chrono::seconds(10);
constexpr int kStallCheckEveryTicks = 25;  // 250 ms
// Connections in their handshake (not yet authenticated), from one source and in all.
constexpr size_t kMaxHandshakingPerSource = 64;
constexpr size_t kMaxHandshaking = 1024;
// Frame bodies beyond the connections' base buffers, for the whole agent.
constexpr size_t kReceiveBudget = 256u << 20;
constexpr auto kDeregisterGrace = std::chrono::seconds(2);
// How long the first one-sided transfer to a region waits for the peer to grant its mapping
// before the peer copies it instead.
constexpr auto kMapWait = std::chrono::seconds(1);
constexpr uint64_t kMinChunk = 64 * 1024;
constexpr uint64_t kMaxChunk = 4u << 20;
constexpr size_t kMaxQueuedNotificationBytes = 256u << 20;

// Copies between our iovecs and the peer's with as few process_vm calls as possible.
// `to_peer`: ours -> theirs (process_vm_writev); otherwise theirs -> ours.
Status CmaCopy(pid_t pid, const std::vector<iovec>& ours, const std::vector<iovec>& theirs,
               bool to_peer) {
    constexpr size_t kIovMax = IOV_MAX;
    IovCursor o, t;
    iovec lw[kIovMax];
    iovec rw[kIovMax];
    while (!o.AtEnd(ours) && !t.AtEnd(theirs)) {
        size_t ln = 0, rn = 0;
        uint64_t lbytes = 0, rbytes = 0;
        for (size_t i = o.index, off = o.offset; i < ours.size() && ln < kIovMax; ++i, off = 0) {
            lw[ln++] = iovec{static_cast<char*>(ours[i].iov_base) + off, ours[i].iov_len - off};
            lbytes += ours[i].iov_len - off;
        }
        for (size_t i = t.index, off = t.offset; i < theirs.size() && rn < kIovMax; ++i, off = 0) {
            rw[rn++] = iovec{static_cast<char*>(theirs[i].iov_base) + off, theirs[i].iov_len - off};
            rbytes += theirs[i].iov_len - off;
        }
        uint64_t want = std::min(lbytes, rbytes);
        ssize_t r = to_peer ? process_vm_writev(pid, lw, ln, rw, rn, 0)
                            : process_vm_readv(pid, lw, ln, rw, rn, 0);
        if (r < 0) {
            return Status(errno == EFAULT ? Code::kInvalidArgument : Code::kUnavailable,
                          std::string("shm: ") +
                              (to_peer ? "process_vm_writev" : "process_vm_readv") + " to pid " +
                              std::to_string(pid) + ": " + std::strerror(errno));
        }
        if (static_cast<uint64_t>(r) != want) {
            return InvalidArgumentError("shm: partial copy (" + std::to_string(r) + " of " +
                                        std::to_string(want) +
                                        " bytes): the initiator's buffer is not mapped");
        }
        o.Advance(ours, want);
        t.Advance(theirs, want);
    }
    return Status::Ok();
}

int DefaultIoThreads() { return std::clamp(UsableCores(), 1, 8); }

}  // namespace

// Accepts connections on one listener (loop 0) and hands them out round-robin.
class AgentCore::Acceptor final : public EventHandler {
  public:
    Acceptor(AgentCore* core, Backend* backend, int fd) : core_(core), backend_(backend), fd_(fd) {}
    void OnEvents(uint32_t) override {
        for (int i = 0; i < 64; ++i) {
            int fd = accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0) {
                if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                    FERRY_LOG(kWarn, "{}: accept: {}", backend_->name(), std::strerror(errno));
                }
                return;
            }
            core_->Accept(backend_, ScopedFd(fd));
        }
    }

  private:
    AgentCore* core_;
    Backend* backend_;
    int fd_;
};

AgentCore::AgentCore(AgentConfig config)
    : config_(std::move(config)),
      epoch_(SecureRandomU64() | 1),
      host_id_(LocalHostId()),
      cma_probe_(std::make_unique<uint64_t>(SecureRandomU64())),
      receive_budget_(std::make_shared<ReceiveBudget>(kReceiveBudget)) {}

Result<std::shared_ptr<AgentCore>> AgentCore::Create(AgentConfig config) {
    FERRY_RETURN_IF_ERROR(ValidateAgentName(config.name).WithContext("AgentConfig.name"));
    if (config.backends.empty()) {
        return InvalidArgumentError("AgentConfig.backends: no backend enabled");
    }
    if (config.stalled_frame_timeout.count() <= 0) {
        return InvalidArgumentError("AgentConfig.stalled_frame_timeout: must be positive");
    }
    for (const std::string& b : config.backends) {
        auto known = KnownBackends();
        if (std::find(known.begin(), known.end(), b) == known.end()) {
            std::string names;
            for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
            return InvalidArgumentError("AgentConfig.backends: unknown backend '" + b +
                                        "' (known in this build: " + names + ")");
        }
    }
    if (!config.force_backend.empty() && std::find(config.backends.begin(), config.backends.end(),
                                                   config.force_backend) == config.backends.end()) {
        return InvalidArgumentError("AgentConfig.force_backend '" + config.force_backend +
                                    "' is not among the enabled backends");
    }
    if (config.default_timeout.count() <= 0) {
        return InvalidArgumentError("AgentConfig.default_timeout must be positive");
    }
    if (config.file_io != "io_uring" && config.file_io != "pread") {
        return InvalidArgumentError("AgentConfig.file_io '" + config.file_io +
                                    "' is neither io_uring nor pread");
    }
    if (config.file_queue_depth == 0 || config.file_queue_depth > 1024) {
        return InvalidArgumentError("AgentConfig.file_queue_depth must be 1..1024, not " +
                                    std::to_string(config.file_queue_depth));
    }
    std::shared_ptr<AgentCore> core(new AgentCore(std::move(config)));
    Status s = core->Start();
    if (!s.ok()) {
        core->Shutdown();
        return s;
    }
    return core;
}

Status AgentCore::Start() {
    int threads = config_.io_threads > 0 ? std::min(config_.io_threads, 64) : DefaultIoThreads();
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
        if (enabled) offered.emplace_back(n, caps);
        if (caps.data_path == DataPath::kOwn) {
            FERRY_RETURN_IF_ERROR(backend->Start(this).WithContext("backend " + n));
            own_path_.push_back(backend.get());
            endpoints_[n] = address;
            backends_.emplace(n, std::move(backend));
            continue;
        }
        Backend* raw = backend.get();
        auto acceptor = std::make_shared<Acceptor>(this, raw, listener.get());
        int fd = listener.get();
        Status watched;
        loops_[0]->RunSync([&] { watched = loops_[0]->Watch(fd, EPOLLIN, acceptor); });
        FERRY_RETURN_IF_ERROR(watched);
        if (n == side_channel_) {
            side_channel_address_ = address;
        }
        if (enabled) {
            endpoints_[n] = address;
        }
        listeners_.push_back(std::move(listener));
        acceptors_.push_back(std::move(acceptor));
        backends_.emplace(n, std::move(backend));
    }
    enabled_ = RankBackends(std::move(offered));
    loops_[0]->SetTick(kTickPeriod, [this] { Tick(); });
    FERRY_LOG(kInfo, "agent {} epoch {:016x} listening on {}", config_.name, epoch_,
              side_channel_address_);
    if (!config_.store.empty()) {
        FERRY_RETURN_IF_ERROR(Register().WithContext("AgentConfig.store " + config_.store));
        registry_ = std::thread([this] { RegistryLoop(); });
    }
    return Status::Ok();
}

// --- Discovery --------------------------------------------------------------------------------

Status AgentCore::Register() {
    if (!store_) {
        StoreOptions options;
        options.secret = config_.secret;
        options.timeout = std::chrono::seconds(5);
        FERRY_ASSIGN_OR_RETURN(store_, MetadataStore::Open(config_.store, options));
    }
    FERRY_ASSIGN_OR_RETURN(LeaseId lease, store_->GrantLease(config_.store_ttl));
    Status s = store_->Put(AgentKey(config_.name), Metadata(), lease);
    if (!s.ok()) {
        (void)store_->RevokeLease(lease);
        return s;
    }
    lease_ = lease;
    FERRY_LOG(kInfo, "agent {} registered at {} (lease {}, ttl {} ms)", config_.name, config_.store,
              lease, config_.store_ttl.count());
    return Status::Ok();
}

void AgentCore::MarkMetadataChanged() {
    if (config_.store.empty()) return;
    std::lock_guard<std::mutex> lock(registry_mu_);
    metadata_changed_ = true;
    registry_cv_.notify_all();
}

void AgentCore::RegistryLoop() {
    const auto renew_every = std::max(config_.store_ttl / 3, std::chrono::milliseconds(100));
    const auto poll = std::min(renew_every, std::chrono::milliseconds(500));
    auto next_renew = Clock::now() + renew_every;
    uint64_t after = 0;
    bool listed = false;
    bool warned = false;
    for (;;) {
        bool changed = false;
        {
            std::unique_lock<std::mutex> lock(registry_mu_);
            if (registry_stop_) return;
            changed = std::exchange(metadata_changed_, false);
        }
        Status s;
        if (lease_ == 0) {
            s = Register();  // the store lost us (or never had us since it came back)
        } else if (changed) {
            s = store_->Put(AgentKey(config_.name), Metadata(), lease_);
            if (s.code() == Code::kNotFound) {
                lease_ = 0;  // lease gone: register afresh
                s = Register();
            }
        }
        if (s.ok() && lease_ != 0 && Clock::now() >= next_renew) {
            s = store_->KeepAlive(lease_);
            if (s.code() == Code::kNotFound) {
                FERRY_LOG(kWarn, "agent {}: the store lost lease {}; registering again",
                          config_.name, lease_);
                lease_ = 0;
                s = Register();
            }
            next_renew = Clock::now() + renew_every;
        }
        if (!s.ok()) {
            if (!warned) {
                FERRY_LOG(kWarn, "agent {}: discovery store {}: {} (retrying)", config_.name,
                          config_.store, s.ToString());
                warned = true;
            }
            std::unique_lock<std::mutex> lock(registry_mu_);
            registry_cv_.wait_for(lock, poll, [&] { return registry_stop_; });
            continue;
        }
        if (warned) {
            FERRY_LOG(kInfo, "agent {}: discovery store {} reachable again", config_.name,
                      config_.store);
            warned = false;
        }
        // Watch the other agents until the next renewal is due.
        if (!listed) {
            uint64_t rev = 0;
            if (store_->List(kAgentPrefix, &rev).ok()) {
                after = rev;
                listed = true;
            }
            continue;
        }
        auto wait = std::clamp(
            std::chrono::duration_cast<std::chrono::milliseconds>(next_renew - Clock::now()),
            std::chrono::milliseconds(1), poll);
        Result<WatchResult> w = store_->Watch(kAgentPrefix, after, wait);
        if (!w.ok()) {
            // Logged by the next store call that fails; no busy loop while the store is down.
            std::unique_lock<std::mutex> lock(registry_mu_);
            registry_cv_.wait_for(lock, wait, [&] { return registry_stop_; });
            continue;
        }
        if (w->compacted || w->revision < after) {
            listed = false;  // history gone, or a new store: start over from a listing
            continue;
        }
        for (const StoreEvent& e : w->events) {
            OnStoreEvent(e);
        }
        after = std::max(after, w->revision);
    }
}

void AgentCore::OnStoreEvent(const StoreEvent& e) {
    std::string name = e.key.substr(kAgentPrefix.size());
    if (name == config_.name) {
        if (e.type == StoreEvent::Type::kDelete && !shut_down_.load()) {
            MarkMetadataChanged();  // someone removed us: put the entry back
        } else if (e.type == StoreEvent::Type::kPut) {
            Result<AgentMetadata> md = DecodeMetadata(e.value);
            if (md.ok() && md->epoch != epoch_) {
                FERRY_LOG(kWarn,
                          "agent {}: another process registered under this name "
                          "(epoch {:016x}); names must be unique",
                          config_.name, md->epoch);
            }
        }
        return;
    }
    std::shared_ptr<Peer> peer = FindPeer(name);
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
    if (!store_) {
        return FailedPreconditionError("ConnectByName: agent " + config_.name +
                                       " has no discovery store (AgentConfig.store)");
    }
    Result<StoreEntry> e = store_->Get(AgentKey(name));
    if (!e.ok()) {
        if (e.status().code() == Code::kNotFound) {
            return NotFoundError("ConnectByName: no agent '" + std::string(name) +
                                 "' registered at " + config_.store);
        }
        return e.status().WithContext("ConnectByName " + std::string(name));
    }
    // The entry says where the agent listens; its side channel says what it holds right now
    // (the entry follows region changes, but a moment behind).
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

AgentCore::~AgentCore() { Shutdown(); }

void AgentCore::Shutdown() {
    if (shut_down_.exchange(true)) {
        return;
    }
    if (registry_.joinable()) {
        {
            std::lock_guard<std::mutex> lock(registry_mu_);
            registry_stop_ = true;
            registry_cv_.notify_all();
        }
        registry_.join();
    }
    if (store_ && lease_ != 0) {
        // Clean shutdown: leave at once instead of at the end of the lease.
        Status s = store_->Delete(AgentKey(config_.name));
        Status r = store_->RevokeLease(lease_);
        if (!s.ok() && s.code() != Code::kNotFound) {
            FERRY_LOG(kWarn, "agent {}: could not remove its discovery entry: {}", config_.name,
                      s.ToString());
        }
        (void)r;
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
    for (auto& op : ops) {
        op->Fail(CancelledError("agent " + config_.name + " is shutting down"),
                 /*close_streams=*/false);
    }
    std::set<std::shared_ptr<Connection>> conns;
    {
        std::lock_guard<std::mutex> lock(conns_mu_);
        conns.swap(conns_);
    }
    for (const auto& c : conns) {
        c->CloseAndWait(CancelledError("agent " + config_.name + " is shutting down"));
    }
    for (auto& loop : loops_) {
        loop->Stop();
    }
    {
        std::lock_guard<std::mutex> lock(peers_mu_);
        peers_.clear();
    }
    acceptors_.clear();
    listeners_.clear();
    {
        std::lock_guard<std::mutex> lock(notes_mu_);
        notes_cv_.notify_all();
    }
}

IoLoop* AgentCore::NextLoop() { return loops_[next_loop_.fetch_add(1) % loops_.size()].get(); }

Backend* AgentCore::FindBackend(std::string_view name) const {
    auto it = backends_.find(name);
    return it == backends_.end() ? nullptr : it->second.get();
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
    {
        // The engine exists before the first file region does.
        std::lock_guard<std::mutex> lock(files_mu_);
        if (!files_) {
            FERRY_ASSIGN_OR_RETURN(files_, FileEngine::Create(FileOptions()));
            FERRY_LOG(kInfo, "agent {}: file backend started ({})", config_.name, files_->mode());
        }
    }
    Result<RegionInfo> r = regions_.RegisterFile(path, fd, offset, length, options);
    if (r.ok()) MarkMetadataChanged();
    return r;
}

FileEngine::Options AgentCore::FileOptions() const {
    return FileEngine::Options{config_.file_queue_depth, config_.file_io == "io_uring"};
}

FileEngine* AgentCore::Files() const {
    std::lock_guard<std::mutex> lock(files_mu_);
    return files_.get();
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
        std::vector<std::shared_ptr<Connection>> conns;
        {
            std::lock_guard<std::mutex> lock(conns_mu_);
            conns.assign(conns_.begin(), conns_.end());
        }
        for (auto& c : conns) {
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
    for (const RegionInfo& r : regions_.List()) {
        md.regions.push_back(RemoteRegion{r.id, r.length, r.key, r.kind});
    }
    std::sort(md.regions.begin(), md.regions.end(),
              [](const RemoteRegion& a, const RemoteRegion& b) { return a.id < b.id; });
    return md;
}

std::string AgentCore::Metadata() const { return EncodeMetadata(SelfMetadata()); }

Result<std::string> AgentCore::ChooseBackend(const AgentMetadata& peer) const {
    AgentMetadata self = SelfMetadata();
    if (!config_.force_backend.empty()) {
        Backend* b = FindBackend(config_.force_backend);
        if (b == nullptr || !b->CanReach(self, peer)) {
            return FailedPreconditionError("forced backend " + config_.force_backend +
                                           " cannot reach peer " + peer.name);
        }
        return config_.force_backend;
    }
    for (const std::string& n : enabled_) {
        if (FindBackend(n)->CanReach(self, peer)) {
            return n;
        }
    }
    return FailedPreconditionError("no common backend with peer " + peer.name);
}

Result<std::string> AgentCore::AddPeer(std::string_view blob) {
    FERRY_ASSIGN_OR_RETURN(AgentMetadata md, DecodeMetadata(blob));
    if (md.name == config_.name) {
        return AlreadyExistsError("AddPeer: metadata of this agent itself (" + md.name + ")");
    }
    FERRY_ASSIGN_OR_RETURN(std::string backend, ChooseBackend(md));
    std::shared_ptr<Peer> old;
    std::string name = md.name;
    {
        std::lock_guard<std::mutex> lock(peers_mu_);
        auto it = peers_.find(name);
        if (it != peers_.end()) {
            std::lock_guard<std::mutex> plock(it->second->mu);
            if (it->second->md.epoch == md.epoch) {
                it->second->md = std::move(md);  // refreshed regions, same process
                return name;
            }
            old = it->second;
        }
        auto peer = std::make_shared<Peer>();
        peer->md = std::move(md);
        peer->backend = backend;
        peers_[name] = std::move(peer);
    }
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
    std::shared_ptr<Peer> peer;
    {
        std::lock_guard<std::mutex> lock(peers_mu_);
        auto it = peers_.find(name);
        if (it == peers_.end()) {
            return NotFoundError("RemovePeer: unknown peer " + std::string(name));
        }
        peer = std::move(it->second);
        peers_.erase(it);
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
    st.handshakes_refused = handshakes_refused_.load();
    st.stalled_frames_dropped = stalled_frames_dropped_.load();
    st.receive_budget_used = receive_budget_->used.load();
    st.receive_budget_waits = receive_budget_->waits.load();
    {
        std::lock_guard<std::mutex> lock(conns_mu_);
        st.handshakes_pending = handshaking_.size();
    }
    return st;
}

Result<std::string> AgentCore::PeerBackend(std::string_view name) const {
    auto peer = FindPeer(name);
    if (!peer) {
        return NotFoundError("unknown peer " + std::string(name));
    }
    return peer->backend;
}

std::shared_ptr<AgentCore::Peer> AgentCore::FindPeer(std::string_view name) const {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(name);
    return it == peers_.end() ? nullptr : it->second;
}

void AgentCore::TrackConnection(const std::shared_ptr<Connection>& c) {
    std::lock_guard<std::mutex> lock(conns_mu_);
    if (!shut_down_.load()) {
        conns_.insert(c);
    }
}

Result<std::shared_ptr<Connection>> AgentCore::Dial(Backend& backend, std::string_view address,
                                                    const std::string& label, wire::Purpose purpose,
                                                    uint64_t expect_epoch) {
    if (shut_down_.load()) {
        return CancelledError("agent " + config_.name + " is shutting down");
    }
    bool in_progress = false;
    FERRY_ASSIGN_OR_RETURN(ScopedFd fd, backend.Dial(address, &in_progress));
    HandshakeConfig hc;
    hc.backend = std::string(backend.name());
    hc.name = config_.name;
    hc.epoch = epoch_;
    hc.secret = config_.secret;
    hc.purpose = purpose;
    hc.budget = receive_budget_;
    hc.expect_epoch = expect_epoch;
    if (backend.data_mode() == wire::DataMode::kCma) {
        hc.probe_addr = reinterpret_cast<uint64_t>(cma_probe_.get());
        hc.probe_value = *cma_probe_;
    }
    auto conn = Connection::Create(NextLoop(), std::move(fd), Connection::Role::kClient,
                                   std::move(hc), this, label, in_progress);
    TrackConnection(conn);
    conn->Start();
    return conn;
}

namespace {

// Where an accepted socket comes from: the peer's IP, or the process at the other end of a
// Unix socket.
std::string SourceOf(int fd) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
        char buf[INET6_ADDRSTRLEN] = {};
        if (addr.ss_family == AF_INET) {
            inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&addr)->sin_addr, buf, sizeof(buf));
            return buf;
        }
        if (addr.ss_family == AF_INET6) {
            inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr, buf,
                      sizeof(buf));
            return buf;
        }
    }
    ucred cred{};
    socklen_t clen = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) == 0 && cred.pid > 0) {
        return "pid " + std::to_string(cred.pid);
    }
    return "unknown";
}

}  // namespace

void AgentCore::Accept(Backend* backend, ScopedFd fd) {
    std::string source = SourceOf(fd.get());
    {
        std::lock_guard<std::mutex> lock(conns_mu_);
        auto it = handshaking_by_source_.find(source);
        size_t from_source = it == handshaking_by_source_.end() ? 0 : it->second;
        if (from_source >= kMaxHandshakingPerSource || handshaking_.size() >= kMaxHandshaking) {
            uint64_t n = handshakes_refused_.fetch_add(1) + 1;
            if ((n & (n - 1)) == 0) {  // 1, 2, 4, 8, ...: a flood is not a log flood
                FERRY_LOG(kWarn,
                          "{}: refused a connection from {}: {} handshakes pending from it, {} in "
                          "all (at most {} and {}; {} refused so far)",
                          backend->name(), source, from_source, handshaking_.size(),
                          kMaxHandshakingPerSource, kMaxHandshaking, n);
            }
            return;  // fd closes
        }
    }
    backend->Configure(fd.get());
    HandshakeConfig hc;
    hc.backend = std::string(backend->name());
    hc.name = config_.name;
    hc.epoch = epoch_;
    hc.secret = config_.secret;
    hc.verify_cma = backend->verify_cma();
    hc.budget = receive_budget_;
    hc.source = source;
    auto conn =
        Connection::Create(NextLoop(), std::move(fd), Connection::Role::kServer, std::move(hc),
                           this, std::string(backend->name()) + " client from " + source, false);
    {
        std::lock_guard<std::mutex> lock(conns_mu_);
        handshaking_[conn.get()] = source;
        ++handshaking_by_source_[source];
    }
    TrackConnection(conn);
    conn->Start();
}

void AgentCore::HandshakeOver(const Connection& conn) {
    std::lock_guard<std::mutex> lock(conns_mu_);
    auto it = handshaking_.find(&conn);
    if (it == handshaking_.end()) return;
    auto src = handshaking_by_source_.find(it->second);
    if (src != handshaking_by_source_.end() && --src->second == 0) {
        handshaking_by_source_.erase(src);
    }
    handshaking_.erase(it);
}

void AgentCore::OnReady(Connection& conn) { HandshakeOver(conn); }

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

// --- Transfers ------------------------------------------------------------------------------

Result<Transfer> AgentCore::Post(TransferOp::Kind kind, std::span<const Descriptor> local,
                                 std::string_view peer_name, std::span<const Descriptor> remote,
                                 const TransferOptions& options) {
    if (shut_down_.load()) {
        return CancelledError("agent " + config_.name + " is shutting down");
    }
    if (peer_name == config_.name) {
        return PostLocal(kind, local, remote, options);
    }
    std::shared_ptr<Peer> peer = FindPeer(peer_name);
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
        uint64_t total = 0;
        for (const auto& s : segments) total += s.remote.length;
        std::vector<Chunk> chunks =
            MakeChunks(segments, backend->chunk_bytes(), backend->max_segments());
        transfers_posted_.fetch_add(1, std::memory_order_relaxed);
        bytes_posted_.fetch_add(total, std::memory_order_relaxed);
        auto op = std::make_shared<TransferOp>(next_op_id_.fetch_add(1), kind, total, deadline,
                                               std::string(peer_name), wire::DataMode::kInline);
        PeerRef ref = RefFor(*peer, *backend);
        op->SetCutOff([backend, id = op->id()](const Status& s) { backend->CutOff(id, s); });
        std::function<void()> on_success;
        if (options.notification) {
            on_success = [backend, ref, payload = *options.notification, self = config_.name] {
                (void)backend->Notify(ref, payload, self);
            };
        }
        op->Arm(static_cast<uint32_t>(chunks.size()), std::move(pins), std::move(on_success));
        {
            std::lock_guard<std::mutex> lock(ops_mu_);
            ops_[op->id()] = op;
        }
        // One-sided only where every remote region is host memory (files are staged by the
        // target).
        backend->Post(op, ref, kind == TransferOp::Kind::kWrite, std::move(chunks), all_host);
        return Transfer(op);
    }
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
    bool one_sided = false;
    if (mode == wire::DataMode::kCma && config_.shm_map_peer_regions) {
        std::vector<RegionId> pending;
        LocalPlan plan = PlanLocalCopies(peer, chunks, streams[0], &work, &keep, &pending);
        if (plan == LocalPlan::kPending) {
            {
                std::unique_lock<std::mutex> lock(peer->mu);
                peer->mapped_cv.wait_until(lock, std::min(deadline, Clock::now() + kMapWait), [&] {
                    return std::none_of(pending.begin(), pending.end(), [&](RegionId r) {
                        auto it = peer->mapped.find(r);
                        return it != peer->mapped.end() &&
                               it->second.state == RemoteMapping::State::kPending;
                    });
                });
            }
            pending.clear();
            plan = PlanLocalCopies(peer, chunks, streams[0], &work, &keep, &pending);
        }
        one_sided = plan == LocalPlan::kReady;
    }
    if (one_sided) {
        mode = wire::DataMode::kInline;  // nothing of ours is exposed to the peer
    }

    auto op = std::make_shared<TransferOp>(next_op_id_.fetch_add(1), kind, total, deadline,
                                           std::string(peer_name), mode);
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
    {
        std::lock_guard<std::mutex> lock(ops_mu_);
        ops_[op->id()] = op;
    }
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
            req.shares = SharesFor(c.local_regions);
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
    if (options.notification) {
        return InvalidArgumentError("a transfer to this agent itself (" + self +
                                    ") carries no notification: wait on its handle");
    }
    if (!options.backend.empty() && options.backend != "file") {
        return InvalidArgumentError("a transfer to this agent itself (" + self +
                                    ") goes through the file backend, not '" + options.backend +
                                    "'");
    }
    std::unordered_map<RegionId, std::shared_ptr<RegionEntry>> entries;
    std::unordered_map<RegionId, RegionView> views;
    auto find = [&](RegionId id) -> const RegionView* {
        auto it = views.find(id);
        if (it != views.end()) return &it->second;
        auto e = regions_.Find(id);
        if (!e) return nullptr;
        entries[id] = e;
        return &(views[id] = RegionView{e->base, e->length, e->key});
    };
    std::vector<Run> local_runs, remote_runs;
    FERRY_RETURN_IF_ERROR(ExpandDescriptors(local, find, "local", &local_runs));
    FERRY_RETURN_IF_ERROR(ExpandDescriptors(remote, find, "remote", &remote_runs));
    uint64_t local_total = 0, remote_total = 0;
    for (const Run& r : local_runs) local_total += r.length;
    for (const Run& r : remote_runs) remote_total += r.length;
    if (local_total != remote_total) {
        return InvalidArgumentError("local descriptors cover " + std::to_string(local_total) +
                                    " bytes, remote descriptors " + std::to_string(remote_total));
    }

    // Pair the runs into pieces, source -> destination by the direction.
    const bool to_remote = kind == TransferOp::Kind::kWrite;
    std::vector<FileIo> ios;
    size_t i = 0, j = 0;
    uint64_t in_i = 0, in_j = 0;
    while (i < local_runs.size() && j < remote_runs.size()) {
        const Run& l = local_runs[i];
        const Run& r = remote_runs[j];
        uint64_t n = std::min(l.length - in_i, r.length - in_j);
        const RegionEntry& le = *entries[l.region];
        const RegionEntry& re = *entries[r.region];
        const RegionEntry& src = to_remote ? le : re;
        const RegionEntry& dst = to_remote ? re : le;
        uint64_t src_off = to_remote ? l.offset + in_i : r.offset + in_j;
        uint64_t dst_off = to_remote ? r.offset + in_j : l.offset + in_i;
        FileIo io;
        io.length = n;
        if (src.kind == MemoryKind::kFile && dst.kind == MemoryKind::kFile) {
            return InvalidArgumentError("regions " + std::to_string(src.id) + " and " +
                                        std::to_string(dst.id) +
                                        " are both file regions: file to file copies are not "
                                        "supported; stage them through a memory region");
        }
        const RegionEntry* file = nullptr;
        if (dst.kind == MemoryKind::kFile) {
            file = &dst;
            io.fd = dst.file_fd;
            io.file_offset = dst.file_offset + dst_off;
            io.mem = src.base + src_off;
            io.to_file = true;
            if (dst.read_only) {
                return PermissionDeniedError("region " + std::to_string(dst.id) +
                                             " is a read-only file region (" + dst.path + ")");
            }
        } else if (src.kind == MemoryKind::kFile) {
            file = &src;
            io.fd = src.file_fd;
            io.file_offset = src.file_offset + src_off;
            io.mem = dst.base + dst_off;
        } else {
            io.mem = dst.base + dst_off;
            io.from = src.base + src_off;
        }
        if (file != nullptr) {
            io.region = file->id;
            if (file->direct &&
                (io.file_offset % kDirectAlignment != 0 || n % kDirectAlignment != 0 ||
                 reinterpret_cast<uintptr_t>(io.mem) % kDirectAlignment != 0)) {
                return InvalidArgumentError(
                    "region " + std::to_string(file->id) + " is a file opened with O_DIRECT: " +
                    std::to_string(n) + " bytes at file offset " + std::to_string(io.file_offset) +
                    " with memory at " + fmt::format("{}", static_cast<const void*>(io.mem)) +
                    " are not all aligned to " + std::to_string(kDirectAlignment) + " bytes");
            }
        }
        // Pieces that continue the previous one on both sides become one io.
        FileIo* prev = ios.empty() ? nullptr : &ios.back();
        if (prev != nullptr && prev->fd == io.fd && prev->to_file == io.to_file &&
            prev->mem + prev->length == io.mem &&
            (io.fd >= 0 ? prev->file_offset + prev->length == io.file_offset
                        : prev->from + prev->length == io.from)) {
            prev->length += n;
        } else {
            ios.push_back(io);
        }
        in_i += n;
        in_j += n;
        if (in_i == l.length) {
            ++i;
            in_i = 0;
        }
        if (in_j == r.length) {
            ++j;
            in_j = 0;
        }
    }
    FileEngine* files = Files();
    if (files == nullptr) {
        // No file region was ever registered: memory copies still go through an engine.
        std::lock_guard<std::mutex> lock(files_mu_);
        if (!files_) {
            FERRY_ASSIGN_OR_RETURN(files_, FileEngine::Create(FileOptions()));
        }
        files = files_.get();
    }
    std::vector<RegionPin> pins;
    for (auto& [id, e] : entries) {
        FERRY_ASSIGN_OR_RETURN(RegionPin p, regions_.PinLocal(id));
        pins.push_back(std::move(p));
    }
    auto timeout = options.timeout.count() > 0 ? options.timeout : config_.default_timeout;
    auto op = std::make_shared<TransferOp>(next_op_id_.fetch_add(1), kind, local_total,
                                           Clock::now() + timeout, self, wire::DataMode::kInline);
    // Cancel, a deadline or a Deregister stop the batch and return once the kernel is done with
    // its memory. Nothing can call it before `*batch` is set: the op is published (ops_, the
    // handle) only after Submit.
    auto batch = std::make_shared<std::shared_ptr<FileEngine::Batch>>();
    op->SetCutOff([files, batch](const Status& s) { files->Cancel(*batch, s); });
    op->Arm(1, std::move(pins), nullptr);
    std::weak_ptr<TransferOp> weak = op;
    *batch = files->Submit(std::move(ios), [weak](const Status& s) {
        if (auto o = weak.lock()) o->ChunkDone(s);
    });
    transfers_posted_.fetch_add(1, std::memory_order_relaxed);
    bytes_posted_.fetch_add(local_total, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> lock(ops_mu_);
        ops_[op->id()] = op;
    }
    return Transfer(op);
}

// --- Notifications ----------------------------------------------------------------------------

Status AgentCore::Notify(std::string_view peer_name, std::string_view payload) {
    if (payload.size() > wire::kMaxNotificationLen) {
        return InvalidArgumentError("notification of " + std::to_string(payload.size()) +
                                    " bytes exceeds the limit of " +
                                    std::to_string(wire::kMaxNotificationLen));
    }
    std::shared_ptr<Peer> peer = FindPeer(peer_name);
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

std::vector<Notification> AgentCore::TakeNotifications() {
    std::lock_guard<std::mutex> lock(notes_mu_);
    std::vector<Notification> out(std::make_move_iterator(notes_.begin()),
                                  std::make_move_iterator(notes_.end()));
    notes_.clear();
    notes_bytes_ = 0;
    return out;
}

std::vector<Notification> AgentCore::WaitNotifications(Clock::time_point deadline) {
    {
        std::unique_lock<std::mutex> lock(notes_mu_);
        notes_cv_.wait_until(lock, deadline, [&] { return !notes_.empty() || shut_down_.load(); });
    }
    return TakeNotifications();
}

// --- Named objects ----------------------------------------------------------------------------

Status AgentCore::Publish(std::string key, std::vector<Descriptor> descriptors) {
    if (key.empty() || key.size() > wire::kMaxKeyLen) {
        return InvalidArgumentError("Publish: key must be 1.." + std::to_string(wire::kMaxKeyLen) +
                                    " bytes");
    }
    std::vector<Run> runs;
    std::unordered_map<RegionId, RegionView> views;
    RegionId file_region = 0;
    FERRY_RETURN_IF_ERROR(ExpandDescriptors(
        descriptors,
        [&](RegionId id) -> const RegionView* {
            auto e = regions_.Find(id);
            if (!e) return nullptr;
            if (e->kind == MemoryKind::kFile) file_region = id;
            return &(views[id] = RegionView{e->base, e->length, e->key});
        },
        "Publish", &runs));
    if (file_region != 0) {
        return InvalidArgumentError("Publish: region " + std::to_string(file_region) +
                                    " is a file region; objects must lie in memory regions (read "
                                    "the file into one first)");
    }
    uint64_t total = 0;
    for (const Run& r : runs) total += r.length;
    if (total > wire::kMaxPayload) {
        return InvalidArgumentError("Publish: object of " + std::to_string(total) +
                                    " bytes exceeds the limit of " +
                                    std::to_string(wire::kMaxPayload));
    }
    std::lock_guard<std::mutex> lock(objects_mu_);
    objects_[std::move(key)] = std::move(descriptors);
    return Status::Ok();
}

Status AgentCore::Unpublish(std::string_view key) {
    std::lock_guard<std::mutex> lock(objects_mu_);
    auto it = objects_.find(key);
    if (it == objects_.end()) {
        return NotFoundError("Unpublish: no object '" + std::string(key) + "'");
    }
    objects_.erase(it);
    return Status::Ok();
}

Result<PullResult> AgentCore::PullByKey(std::string_view peer_name, std::string_view key,
                                        const Descriptor& local,
                                        std::chrono::milliseconds timeout) {
    if (key.empty() || key.size() > wire::kMaxKeyLen) {
        return InvalidArgumentError("PullByKey: key must be 1.." +
                                    std::to_string(wire::kMaxKeyLen) + " bytes");
    }
    std::shared_ptr<Peer> peer = FindPeer(peer_name);
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
        {
            std::lock_guard<std::mutex> lock(ops_mu_);
            ops_[op->id()] = op;
        }
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
    auto op =
        std::make_shared<TransferOp>(next_op_id_.fetch_add(1), TransferOp::Kind::kPull, capacity,
                                     Clock::now() + timeout, std::string(peer_name), mode);
    std::vector<RegionPin> pins;
    pins.push_back(std::move(pin));
    op->Arm(1, std::move(pins), nullptr);
    op->AddConnection(streams[0]);
    {
        std::lock_guard<std::mutex> lock(ops_mu_);
        ops_[op->id()] = op;
    }
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
        req.shares = SharesFor({local.region});
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

// --- Target side ------------------------------------------------------------------------------

namespace {
OutFrame ResponseFrame(uint64_t request_id, const Status& s, uint64_t value = 0) {
    OutFrame f;
    f.head = wire::MakeFrame(wire::FrameType::kResponse, request_id,
                             wire::EncodeResponse({s.code(), s.message(), value}));
    return f;
}
}  // namespace

void AgentCore::Respond(Connection& conn, uint64_t request_id, const Status& s, uint64_t value) {
    conn.SendNow(ResponseFrame(request_id, s, value));
}

Status AgentCore::PinSegments(const std::vector<wire::Segment>& segs, bool write,
                              std::vector<RegionPin>* pins, std::vector<iovec>* iov,
                              FileStaging* staging) {
    iov->reserve(segs.size());
    RegionId last = 0;
    uint64_t staged = 0;  // bytes of file segments, each rounded up to the O_DIRECT alignment
    for (const wire::Segment& s : segs) {
        FERRY_ASSIGN_OR_RETURN(RegionPin p,
                               regions_.PinRemote(s.region, s.key, s.offset, s.length));
        const RegionEntry& e = *p.entry();
        if (e.kind == MemoryKind::kFile) {
            if (staging == nullptr) {
                return FailedPreconditionError("region " + std::to_string(s.region) +
                                               " is a file region; this request cannot reach it");
            }
            if (write && e.read_only) {
                return PermissionDeniedError("region " + std::to_string(s.region) +
                                             " is a read-only file region (" + e.path + ")");
            }
            if (e.direct && ((e.file_offset + s.offset) % kDirectAlignment != 0 ||
                             s.length % kDirectAlignment != 0)) {
                return InvalidArgumentError(
                    "region " + std::to_string(s.region) + " is a file opened with O_DIRECT: [" +
                    std::to_string(s.offset) + ", +" + std::to_string(s.length) +
                    ") is not aligned to " + std::to_string(kDirectAlignment) + " bytes");
            }
            FileIo io;
            io.fd = e.file_fd;
            io.file_offset = e.file_offset + s.offset;
            io.length = s.length;
            io.to_file = write;
            io.region = e.id;
            io.mem = reinterpret_cast<uint8_t*>(staged);  // an offset until the buffer exists
            staging->ios.push_back(io);
            staged += (s.length + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment;
            iov->push_back(iovec{nullptr, s.length});
        } else {
            iov->push_back(iovec{e.base + s.offset, s.length});
        }
        // One pin per distinct region is enough; consecutive segments usually share one.
        if (pins->empty() || last != s.region) {
            last = s.region;
            pins->push_back(std::move(p));
        }
    }
    if (staged == 0) {
        return Status::Ok();
    }
    staging->buffer = AlignedBuffer::Allocate(staged);
    if (!staging->buffer) {
        return ResourceExhaustedError("staging " + std::to_string(staged) +
                                      " bytes of file regions: out of memory");
    }
    size_t k = 0;
    for (iovec& v : *iov) {
        if (v.iov_base != nullptr) continue;
        FileIo& io = staging->ios[k++];
        io.mem = staging->buffer->data() + reinterpret_cast<uintptr_t>(io.mem);
        v.iov_base = io.mem;
    }
    return Status::Ok();
}

Status AgentCore::MoveStaged(FileStaging& staging, bool to_file) {
    FileEngine* files = Files();
    if (files == nullptr) {
        return FailedPreconditionError("no file engine");  // cannot happen: file regions exist
    }
    for (FileIo& io : staging.ios) io.to_file = to_file;
    return files->Run(staging.ios);
}

void AgentCore::OnRequest(Connection& conn, const wire::FrameHeader& h, std::string_view body) {
    switch (h.type) {
        case wire::FrameType::kNotify: {
            if (body.size() > wire::kMaxNotificationLen) {
                conn.Close(InvalidArgumentError("notification over the size limit"));
                return;
            }
            std::lock_guard<std::mutex> lock(notes_mu_);
            if (notes_bytes_ + body.size() > kMaxQueuedNotificationBytes) {
                FERRY_LOG(kWarn,
                          "dropping a notification from {}: {} bytes already queued "
                          "(call TakeNotifications)",
                          conn.peer_name(), notes_bytes_);
                return;
            }
            notes_bytes_ += body.size();
            notes_.push_back(Notification{conn.peer_name(), std::string(body)});
            notes_cv_.notify_all();
            return;
        }
        case wire::FrameType::kGetMetadata: {
            OutFrame f;
            f.head = wire::MakeFrame(wire::FrameType::kMetadata, h.request_id, Metadata());
            conn.SendNow(std::move(f));
            return;
        }
        case wire::FrameType::kPull:
            ServePull(conn, h, body);
            return;
        case wire::FrameType::kUnshare:
            HandleUnshare(conn, h, body);
            return;
        case wire::FrameType::kMapRegion:
            ServeMapRegion(conn, h, body);
            return;
        case wire::FrameType::kWrite:
        case wire::FrameType::kRead:
            ServeData(conn, h, body);
            return;
        default:
            conn.Close(InvalidArgumentError("unexpected request type"));
    }
}

void AgentCore::ServeData(Connection& conn, const wire::FrameHeader& h, std::string_view body) {
    bool write = h.type == wire::FrameType::kWrite;
    Result<wire::DataRequest> req = wire::DecodeDataRequest(body);
    if (!req.ok()) {
        conn.Close(InvalidArgumentError("malformed " + std::string(write ? "write" : "read") +
                                        " request from " + conn.peer_name() + ": " +
                                        req.status().message()));
        return;
    }
    bool inline_mode = req->mode == wire::DataMode::kInline;
    uint64_t expected_payload = write && inline_mode ? req->TotalLength() : 0;
    if (h.payload_len != expected_payload) {
        conn.Close(InvalidArgumentError(
            "request from " + conn.peer_name() + " carries " + std::to_string(h.payload_len) +
            " payload bytes for segments of " + std::to_string(expected_payload)));
        return;
    }
    std::vector<RegionPin> pins;
    std::vector<iovec> iov;
    FileStaging staging;
    Status s = PinSegments(req->segments, write, &pins, &iov, &staging);
    uint64_t id = h.request_id;
    if (!s.ok()) {
        FERRY_LOG(kInfo, "refusing {} from {}: {}", write ? "write" : "read", conn.peer_name(),
                  s.ToString());
    }
    if (!inline_mode) {
        if (shut_down_.load()) {
            return;  // the stream is about to close; the initiator sees Unavailable
        }
        if (s.ok() && conn.cma_pid() == 0) {
            s = FailedPreconditionError("cma transfer on a stream without a verified peer");
        }
        if (s.ok() && !conn.PeerStillThere()) {
            return;  // the initiator hung up (cancelled): do not touch its memory
        }
        // File bytes are staged: read before the copy to the initiator, written after the copy
        // from it (on this loop thread, like the copy itself).
        if (s.ok() && !write && !staging.empty()) {
            s = MoveStaged(staging, /*to_file=*/false);
        }
        if (s.ok()) {
            s = CopyWithPeer(conn, iov, req->initiator_iov, req->shares, /*to_peer=*/!write);
        }
        if (s.ok() && write && !staging.empty()) {
            s = MoveStaged(staging, /*to_file=*/true);
        }
        pins.clear();
        Respond(conn, id, s);
        return;
    }
    if (s.ok() && !staging.empty()) {
        ServeStaged(conn, id, *req, write, std::move(pins), std::move(iov), std::move(staging));
        return;
    }
    if (write) {
        PayloadSink sink;
        if (s.ok()) {
            sink.iov = std::move(iov);
            sink.pins = std::move(pins);
        }
        std::weak_ptr<Connection> weak = conn.shared_from_this();
        sink.done = [this, weak, id, s](const Status& st) {
            auto c = weak.lock();
            if (c && st.ok()) Respond(*c, id, s);
        };
        conn.SetPayloadSink(std::move(sink));
        return;
    }
    // Inline read: the response carries the bytes straight from the region.
    if (!s.ok()) {
        Respond(conn, id, s);
        return;
    }
    OutFrame f;
    f.head = wire::MakeFrame(wire::FrameType::kResponse, id, wire::EncodeResponse({}),
                             req->TotalLength());
    f.if_revoked = wire::MakeFrame(
        wire::FrameType::kResponse, id,
        wire::EncodeResponse({Code::kNotFound, "region deregistered during the read", 0}));
    f.payload = std::move(iov);
    f.pins = std::move(pins);
    conn.SendNow(std::move(f));
}

void AgentCore::ServeStaged(Connection& conn, uint64_t request_id, const wire::DataRequest& req,
                            bool write, std::vector<RegionPin> pins, std::vector<iovec> iov,
                            FileStaging staging) {
    FileEngine* files = Files();
    std::weak_ptr<Connection> weak = conn.shared_from_this();
    // The pins stay with the file I/O: a Deregister of the file region waits for it.
    struct State {
        std::vector<RegionPin> pins;
        std::vector<iovec> iov;
        FileStaging staging;
    };
    auto st = std::make_shared<State>();
    st->staging = std::move(staging);
    st->iov = iov;
    if (write) {
        // The payload lands in the staging buffer (and in memory regions); then the file write.
        PayloadSink sink;
        sink.iov = std::move(iov);
        sink.pins = std::move(pins);  // for Deregister's check of stalled streams
        for (const RegionPin& p : sink.pins) {
            if (p.entry()->kind == MemoryKind::kFile) {
                Result<RegionPin> again = regions_.PinLocal(p.entry()->id);
                if (again.ok()) st->pins.push_back(std::move(*again));
            }
        }
        sink.done = [files, weak, request_id, st](const Status& received) {
            if (!received.ok()) return;  // the stream closed: no one to answer
            for (FileIo& io : st->staging.ios) io.to_file = true;
            files->Submit(st->staging.ios, [weak, request_id, st](const Status& s) {
                st->pins.clear();
                if (auto c = weak.lock()) c->Send(ResponseFrame(request_id, s));
            });
        };
        conn.SetPayloadSink(std::move(sink));
        return;
    }
    st->pins = std::move(pins);
    const uint64_t total = req.TotalLength();
    files->Submit(st->staging.ios, [weak, request_id, st, total](const Status& s) {
        auto c = weak.lock();
        if (!c) return;
        if (!s.ok()) {
            st->pins.clear();
            c->Send(ResponseFrame(request_id, s));
            return;
        }
        OutFrame f;
        f.head = wire::MakeFrame(wire::FrameType::kResponse, request_id, wire::EncodeResponse({}),
                                 total);
        f.if_revoked = wire::MakeFrame(
            wire::FrameType::kResponse, request_id,
            wire::EncodeResponse({Code::kNotFound, "region deregistered during the read", 0}));
        f.payload = st->iov;
        f.pins = std::move(st->pins);
        f.keep = st->staging.buffer;
        c->Send(std::move(f));
    });
}

Status AgentCore::ResolveObject(std::string_view key, std::vector<RegionPin>* pins,
                                std::vector<iovec>* iov, uint64_t* size) {
    std::vector<Descriptor> descs;
    {
        std::lock_guard<std::mutex> lock(objects_mu_);
        auto it = objects_.find(key);
        if (it == objects_.end()) {
            return NotFoundError("no object '" + std::string(key) + "'");
        }
        descs = it->second;
    }
    std::vector<Run> runs;
    std::unordered_map<RegionId, RegionView> views;
    Status s = ExpandDescriptors(
        descs,
        [&](RegionId id) -> const RegionView* {
            auto e = regions_.Find(id);
            if (!e || e->kind == MemoryKind::kFile) return nullptr;
            return &(views[id] = RegionView{e->base, e->length, e->key});
        },
        "object '" + std::string(key) + "'", &runs);
    if (!s.ok()) {
        return s.code() == Code::kNotFound ? NotFoundError(s.message()) : s;
    }
    *size = 0;
    for (const Run& r : runs) {
        *size += r.length;
        iov->push_back(iovec{r.base + r.offset, r.length});
    }
    for (auto& [id, v] : views) {
        Result<RegionPin> p = regions_.PinLocal(id);
        if (!p.ok()) {
            return p.status().code() == Code::kNotFound ? NotFoundError(p.status().message())
                                                        : p.status();
        }
        pins->push_back(std::move(*p));
    }
    return Status::Ok();
}

void AgentCore::DeliverNotification(std::string peer, std::string payload) {
    std::lock_guard<std::mutex> lock(notes_mu_);
    if (notes_bytes_ + payload.size() > kMaxQueuedNotificationBytes) {
        FERRY_LOG(kWarn,
                  "dropping a notification from {}: {} bytes already queued "
                  "(call TakeNotifications)",
                  peer, notes_bytes_);
        return;
    }
    notes_bytes_ += payload.size();
    notes_.push_back(Notification{std::move(peer), std::move(payload)});
    notes_cv_.notify_all();
}

Status AgentCore::GrantRegion(RegionId id, uint64_t key, void** base, uint64_t* length) {
    FERRY_ASSIGN_OR_RETURN(RegionPin pin, regions_.PinRemote(id, key, 0, 0));
    const RegionEntry& e = *pin.entry();
    if (e.kind != MemoryKind::kHost) {
        return FailedPreconditionError("region " + std::to_string(id) +
                                       " is not host memory: no one-sided access");
    }
    *base = e.base;
    *length = e.length;
    return Status::Ok();
}

PeerRef AgentCore::RefFor(Peer& peer, const Backend& backend) const {
    std::lock_guard<std::mutex> lock(peer.mu);
    const EndpointInfo* e = peer.md.FindEndpoint(backend.name());
    return PeerRef{peer.md.name, peer.md.epoch, e != nullptr ? e->address : ""};
}

void AgentCore::ServePull(Connection& conn, const wire::FrameHeader& h, std::string_view body) {
    Result<wire::PullRequest> req = wire::DecodePullRequest(body);
    if (!req.ok()) {
        conn.Close(InvalidArgumentError("malformed pull request from " + conn.peer_name() + ": " +
                                        req.status().message()));
        return;
    }
    std::vector<RegionPin> pins;
    std::vector<iovec> iov;
    uint64_t size = 0;
    Status s = ResolveObject(req->key, &pins, &iov, &size);
    if (!s.ok()) {
        Respond(conn, h.request_id, s);
        return;
    }
    if (size > req->capacity) {
        Respond(conn, h.request_id, Status::Ok(), size);  // too small: just the size
        return;
    }
    if (req->mode == wire::DataMode::kCma) {
        if (conn.cma_pid() == 0) {
            s = FailedPreconditionError("cma pull on a stream without a verified peer");
        } else if (!conn.PeerStillThere()) {
            return;
        } else {
            s = CopyWithPeer(conn, iov, req->initiator_iov, req->shares, /*to_peer=*/true);
        }
        Respond(conn, h.request_id, s, size);
        return;
    }
    OutFrame f;
    f.head = wire::MakeFrame(wire::FrameType::kResponse, h.request_id,
                             wire::EncodeResponse({Code::kOk, "", size}), size);
    f.if_revoked = wire::MakeFrame(
        wire::FrameType::kResponse, h.request_id,
        wire::EncodeResponse({Code::kNotFound, "object's region deregistered during the pull", 0}));
    f.payload = std::move(iov);
    f.pins = std::move(pins);
    conn.SendNow(std::move(f));
}

void AgentCore::OnClosed(Connection& conn, const Status& why) {
    HandshakeOver(conn);
    if (why.code() == Code::kDeadlineExceeded && conn.ready()) {
        stalled_frames_dropped_.fetch_add(1);
    }
    std::shared_ptr<Connection> self = conn.shared_from_this();
    pid_t pid = conn.peer_pid();
    bool pid_still_connected = false;
    {
        std::lock_guard<std::mutex> lock(conns_mu_);
        conns_.erase(self);
        for (const auto& c : conns_) {
            pid_still_connected |= pid != 0 && c->peer_pid() == pid && !c->closed();
        }
    }
    if (pid != 0 && !pid_still_connected && conn.role() == Connection::Role::kClient) {
        // The last stream to the peer process closed. One-sided transfers have no request on it
        // to fail with it: the process they copy into may be gone, so they fail as its other
        // transfers do.
        std::vector<std::shared_ptr<TransferOp>> orphans;
        {
            std::lock_guard<std::mutex> lock(ops_mu_);
            for (auto& [id, w] : ops_) {
                auto op = w.lock();
                if (op && op->peer() == conn.peer_name() &&
                    op->one_sided_epoch() == conn.peer_epoch() && !op->finished()) {
                    orphans.push_back(std::move(op));
                }
            }
        }
        for (auto& op : orphans) {
            op->Fail(
                UnavailableError("streams to " + conn.peer_name() + " closed: " + why.message()));
        }
    }
    if (pid != 0 && !pid_still_connected) {
        // The peer process is gone (or idle): release what we mapped of it, so that a dead
        // peer's memory is not kept alive here.
        {
            std::lock_guard<std::mutex> lock(maps_mu_);
            for (auto it = maps_.lower_bound({pid, 0});
                 it != maps_.end() && it->first.first == pid;) {
                it = maps_.erase(it);
            }
        }
        if (conn.role() == Connection::Role::kClient) {
            if (std::shared_ptr<Peer> peer = FindPeer(conn.peer_name())) {
                std::lock_guard<std::mutex> lock(peer->mu);
                if (peer->md.epoch == conn.peer_epoch()) {
                    peer->mapped.clear();
                }
            }
        }
    }
}

AgentCore::Mapping::~Mapping() {
    if (base != nullptr) {
        munmap(base, length);
    }
}

// How a peer finds an agent-allocated (memfd) region of ours to map it.
static wire::SharedRegion ShareOf(const RegionEntry& e) {
    return wire::SharedRegion{e.share_id, static_cast<uint32_t>(e.memfd), e.inode,
                              reinterpret_cast<uint64_t>(e.base), e.length};
}

std::vector<wire::SharedRegion> AgentCore::SharesFor(const std::vector<RegionId>& regions) const {
    std::vector<wire::SharedRegion> out;
    for (RegionId id : regions) {
        if (out.size() >= wire::kMaxSharesPerFrame) break;
        std::shared_ptr<RegionEntry> e = regions_.Find(id);
        if (e && e->memfd >= 0) {
            out.push_back(ShareOf(*e));
        }
    }
    return out;
}

std::shared_ptr<AgentCore::Mapping> AgentCore::MapPeerRegion(pid_t pid,
                                                             const wire::SharedRegion& share) {
    std::lock_guard<std::mutex> lock(maps_mu_);
    auto key = std::make_pair(pid, share.share_id);
    auto it = maps_.find(key);
    if (it != maps_.end()) {
        return it->second->length == share.length ? it->second : nullptr;
    }
    // Opening another process's fd needs the same ptrace access the handshake probe proved.
    std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(share.fd);
    ScopedFd fd(open(path.c_str(), O_RDWR | O_CLOEXEC));
    struct stat st {};
    if (!fd.valid() || fstat(fd.get(), &st) != 0 || st.st_ino != share.inode ||
        static_cast<uint64_t>(st.st_size) < share.length || share.length == 0) {
        return nullptr;  // not what the initiator claims: fall back to cross-memory attach
    }
    void* p =
        mmap(nullptr, share.length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
    if (p == MAP_FAILED) {
        return nullptr;
    }
    auto m = std::make_shared<Mapping>();
    m->base = static_cast<uint8_t*>(p);
    m->length = share.length;
    maps_[key] = m;
    return m;
}

Status AgentCore::CopyWithPeer(Connection& conn, const std::vector<iovec>& ours,
                               const std::vector<iovec>& theirs,
                               const std::vector<wire::SharedRegion>& shares, bool to_peer) {
    // Translate every initiator buffer into our mapping of its region.
    std::vector<std::shared_ptr<Mapping>> maps;
    std::vector<iovec> local_theirs;
    bool mapped = !shares.empty();
    if (mapped) {
        for (const wire::SharedRegion& sh : shares) {
            maps.push_back(MapPeerRegion(conn.cma_pid(), sh));
        }
        local_theirs.reserve(theirs.size());
        for (const iovec& v : theirs) {
            uint64_t addr = reinterpret_cast<uint64_t>(v.iov_base);
            bool found = false;
            for (size_t i = 0; i < shares.size() && !found; ++i) {
                const wire::SharedRegion& sh = shares[i];
                if (maps[i] && addr >= sh.base && v.iov_len <= sh.length &&
                    addr - sh.base <= sh.length - v.iov_len) {
                    local_theirs.push_back(iovec{maps[i]->base + (addr - sh.base), v.iov_len});
                    found = true;
                }
            }
            if (!found) {
                mapped = false;
                break;
            }
        }
    }
    if (!mapped) {
        return CmaCopy(conn.cma_pid(), ours, theirs, to_peer);
    }
    IovCursor o, t;
    while (!o.AtEnd(ours) && !t.AtEnd(local_theirs)) {
        size_t n = std::min(o.Contiguous(ours), t.Contiguous(local_theirs));
        if (to_peer) {
            std::memcpy(t.Pointer(local_theirs), o.Pointer(ours), n);
        } else {
            std::memcpy(o.Pointer(ours), t.Pointer(local_theirs), n);
        }
        o.Advance(ours, n);
        t.Advance(local_theirs, n);
    }
    return Status::Ok();
}

void AgentCore::BroadcastUnshare(uint64_t share_id) {
    std::vector<std::shared_ptr<Connection>> conns;
    {
        std::lock_guard<std::mutex> lock(conns_mu_);
        for (const auto& c : conns_) {
            const Backend* b = FindBackend(c->backend());
            if (c->role() == Connection::Role::kClient && b != nullptr &&
                b->data_mode() == wire::DataMode::kCma && !c->closed()) {
                conns.push_back(c);
            }
        }
    }
    std::string body(sizeof(share_id), '\0');
    std::memcpy(body.data(), &share_id, sizeof(share_id));
    for (auto& c : conns) {
        OutFrame f;
        f.head = wire::MakeFrame(wire::FrameType::kUnshare, 0, body);
        c->Send(std::move(f));
    }
}

// --- One-sided shm ----------------------------------------------------------------------------

AgentCore::LocalPlan AgentCore::PlanLocalCopies(const std::shared_ptr<Peer>& peer,
                                                const std::vector<Chunk>& chunks,
                                                const std::shared_ptr<Connection>& control,
                                                std::vector<TransferOp::LocalCopy>* work,
                                                std::vector<std::shared_ptr<void>>* keep,
                                                std::vector<RegionId>* pending) {
    std::vector<std::pair<RegionId, uint64_t>> request;
    bool ok = true;
    {
        std::lock_guard<std::mutex> lock(peer->mu);
        work->reserve(chunks.size());
        const RemoteMapping* last = nullptr;
        RegionId last_id = 0;
        for (const Chunk& c : chunks) {
            TransferOp::LocalCopy copy;
            copy.local = c.local;
            copy.remote.reserve(c.remote.size());
            for (const wire::Segment& seg : c.remote) {
                if (last == nullptr || last_id != seg.region) {
                    auto it = peer->mapped.find(seg.region);
                    if (it == peer->mapped.end()) {
                        peer->mapped[seg.region] =
                            RemoteMapping{RemoteMapping::State::kPending, seg.key, 0, nullptr};
                        request.emplace_back(seg.region, seg.key);
                        pending->push_back(seg.region);
                        ok = false;
                        break;
                    }
                    last = &it->second;
                    last_id = seg.region;
                    if (last->state == RemoteMapping::State::kPending) {
                        pending->push_back(seg.region);
                    }
                    if (last->state != RemoteMapping::State::kGranted) {
                        ok = false;
                        break;
                    }
                    keep->push_back(last->map);
                }
                // The key the peer checked, and the bounds of what it granted: never our copy of
                // its metadata (which a stale or forged blob could have changed). Anything else
                // goes to the peer, which refuses it with the right code.
                if (seg.key != last->key || seg.offset > last->map->length ||
                    seg.length > last->map->length - seg.offset) {
                    ok = false;
                    break;
                }
                copy.remote.push_back(iovec{last->map->base + seg.offset, seg.length});
            }
            if (!ok) {
                break;
            }
            work->push_back(std::move(copy));
        }
    }
    for (const auto& [region, key] : request) {
        RequestMapping(peer, control, region, key);
    }
    if (!ok) {
        work->clear();
        keep->clear();
        return pending->empty() ? LocalPlan::kRefused : LocalPlan::kPending;
    }
    return LocalPlan::kReady;
}

void AgentCore::RequestMapping(const std::shared_ptr<Peer>& peer,
                               const std::shared_ptr<Connection>& control, RegionId region,
                               uint64_t key) {
    OutFrame f;
    f.request_id = NextRequestId();
    f.head = wire::MakeFrame(wire::FrameType::kMapRegion, f.request_id,
                             wire::EncodeMapRequest({region, key}));
    f.expects_response = true;
    std::weak_ptr<Peer> weak_peer = peer;
    std::weak_ptr<Connection> weak_conn = control;
    f.expect.callback = [this, weak_peer, weak_conn, region](const Status& s,
                                                             std::string_view body) {
        std::shared_ptr<Peer> p = weak_peer.lock();
        if (!p) {
            return;
        }
        std::shared_ptr<Mapping> map;
        uint64_t share_id = 0;
        Status why = s;
        if (s.ok()) {
            Result<wire::SharedRegion> grant = wire::DecodeRegionGrant(body);
            std::shared_ptr<Connection> c = weak_conn.lock();
            if (!grant.ok()) {
                why = grant.status();
            } else if (!c || c->peer_pid() == 0) {
                why = UnavailableError("stream closed");
            } else {
                share_id = grant->share_id;
                map = MapPeerRegion(c->peer_pid(), *grant);
                if (!map) {
                    why = FailedPreconditionError("cannot map the granted memfd");
                }
            }
        }
        std::lock_guard<std::mutex> lock(p->mu);
        p->mapped_cv.notify_all();
        auto it = p->mapped.find(region);
        if (it == p->mapped.end() || it->second.state != RemoteMapping::State::kPending) {
            return;
        }
        if (map) {
            it->second.state = RemoteMapping::State::kGranted;
            it->second.share_id = share_id;
            it->second.map = std::move(map);
        } else if (why.code() == Code::kUnavailable || why.code() == Code::kCancelled) {
            p->mapped.erase(it);  // the stream went away: ask again next time
        } else {
            // Not mappable (registered user memory, a wrong key, ...): the peer copies.
            FERRY_LOG(kDebug, "peer {} region {}: copied by the peer ({})", p->md.name, region,
                      why.ToString());
            it->second.state = RemoteMapping::State::kRefused;
        }
    };
    control->Send(std::move(f));
}

void AgentCore::ServeMapRegion(Connection& conn, const wire::FrameHeader& h,
                               std::string_view body) {
    Result<wire::MapRequest> req = wire::DecodeMapRequest(body);
    if (!req.ok()) {
        conn.Close(InvalidArgumentError("malformed map-region request from " + conn.peer_name() +
                                        ": " + req.status().message()));
        return;
    }
    if (conn.cma_pid() == 0) {
        Respond(conn, h.request_id,
                FailedPreconditionError("map-region needs a verified shm stream"));
        return;
    }
    Result<RegionPin> pin = regions_.PinRemote(req->region, req->key, 0, 0);
    if (!pin.ok()) {
        Respond(conn, h.request_id, pin.status());
        return;
    }
    const RegionEntry& e = *pin->entry();
    if (e.memfd < 0) {
        Respond(conn, h.request_id,
                FailedPreconditionError("region " + std::to_string(e.id) +
                                        " is registered memory, not shareable: the target copies"));
        return;
    }
    {
        // Recorded while pinned: a Deregister waits for the pin, then revokes this grant too.
        std::lock_guard<std::mutex> lock(maps_mu_);
        auto& conns = grants_[e.share_id];
        std::erase_if(conns, [](const std::weak_ptr<Connection>& w) { return w.expired(); });
        conns.push_back(conn.shared_from_this());
    }
    OutFrame f;
    f.head = wire::MakeFrame(wire::FrameType::kRegionGrant, h.request_id,
                             wire::EncodeRegionGrant(ShareOf(e)));
    conn.SendNow(std::move(f));
}

void AgentCore::HandleUnshare(Connection& conn, const wire::FrameHeader& h, std::string_view body) {
    uint64_t share_id = 0;
    if (body.size() != sizeof(share_id) || conn.peer_pid() == 0) {
        conn.Close(InvalidArgumentError("malformed unshare frame"));
        return;
    }
    std::memcpy(&share_id, body.data(), sizeof(share_id));
    {
        std::lock_guard<std::mutex> lock(maps_mu_);
        maps_.erase({conn.peer_pid(), share_id});
    }
    if (conn.role() == Connection::Role::kClient) {
        // A target deregistered a region we may copy into ourselves: forget the mapping and the
        // region, so that later transfers to it fail here with NotFound.
        if (std::shared_ptr<Peer> peer = FindPeer(conn.peer_name())) {
            std::lock_guard<std::mutex> lock(peer->mu);
            if (peer->md.epoch == conn.peer_epoch()) {
                for (auto it = peer->mapped.begin(); it != peer->mapped.end();) {
                    if (it->second.share_id == share_id) {
                        RegionId gone = it->first;
                        std::erase_if(peer->md.regions,
                                      [gone](const RemoteRegion& r) { return r.id == gone; });
                        it = peer->mapped.erase(it);
                    } else {
                        ++it;
                    }
                }
            }
        }
    }
    if (h.request_id != 0) {
        Respond(conn, h.request_id, Status::Ok());
    }
}

void AgentCore::RevokeGrants(uint64_t share_id, RegionId id) {
    std::vector<std::shared_ptr<Connection>> conns;
    {
        std::lock_guard<std::mutex> lock(maps_mu_);
        auto it = grants_.find(share_id);
        if (it == grants_.end()) {
            return;
        }
        for (const auto& w : it->second) {
            if (auto c = w.lock(); c && !c->closed()) conns.push_back(std::move(c));
        }
        grants_.erase(it);
    }
    struct Acks {
        std::mutex mu;
        std::condition_variable cv;
        size_t left = 0;
    };
    auto acks = std::make_shared<Acks>();
    acks->left = conns.size();
    std::string body(sizeof(share_id), '\0');
    std::memcpy(body.data(), &share_id, sizeof(share_id));
    std::vector<std::shared_ptr<bool>> answered;
    for (auto& c : conns) {
        auto done = std::make_shared<bool>(false);
        answered.push_back(done);
        OutFrame f;
        f.request_id = NextRequestId();
        f.head = wire::MakeFrame(wire::FrameType::kUnshare, f.request_id, body);
        f.expects_response = true;
        f.expect.callback = [acks, done](const Status&, std::string_view) {
            std::lock_guard<std::mutex> lock(acks->mu);
            *done = true;  // an answer, or the stream closed: either way the peer stopped
            --acks->left;
            acks->cv.notify_all();
        };
        c->Send(std::move(f));
    }
    std::unique_lock<std::mutex> lock(acks->mu);
    acks->cv.wait_for(lock, kDeregisterGrace, [&] { return acks->left == 0; });
    for (size_t i = 0; i < conns.size(); ++i) {
        if (!*answered[i]) {
            lock.unlock();
            conns[i]->CloseAndWait(UnavailableError("peer did not release its mapping of region " +
                                                    std::to_string(id) + " in time"));
            lock.lock();
        }
    }
}

void AgentCore::Tick() {
    auto now = Clock::now();
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
    std::vector<std::shared_ptr<Connection>> stale;
    {
        std::lock_guard<std::mutex> lock(conns_mu_);
        for (const auto& c : conns_) {
            if (!c->ready() && !c->closed() && now - c->created() > kHandshakeTimeout) {
                stale.push_back(c);
            }
        }
    }
    for (auto& c : stale) {
        c->Close(DeadlineExceededError("handshake not completed within 10 s"));
    }
    if (++ticks_ % kStallCheckEveryTicks == 0) {
        // Each connection is checked on its own loop thread.
        std::map<IoLoop*, std::vector<std::shared_ptr<Connection>>> by_loop;
        {
            std::lock_guard<std::mutex> lock(conns_mu_);
            for (const auto& c : conns_) {
                if (c->ready() && !c->closed()) by_loop[c->loop()].push_back(c);
            }
        }
        for (auto& entry : by_loop) {
            entry.first->Post(
                [conns = std::move(entry.second), now, deadline = config_.stalled_frame_timeout] {
                    for (const auto& c : conns) c->CheckStalled(now, deadline);
                });
        }
    }
}

}  // namespace ferry::internal
