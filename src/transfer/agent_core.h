// AgentCore: the implementation behind ferry::Agent. Owns the region table, the I/O loops, the
// backends and their listeners, the peers and their connections, the live transfers, the
// received notifications and the published objects. It is also the target: it serves peers'
// requests after checking every descriptor.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ferry/agent.h"
#include "ferry/discovery.h"
#include "transfer/backend.h"
#include "transfer/backends/file/file_engine.h"
#include "transfer/connection.h"
#include "transfer/io_loop.h"
#include "transfer/metadata.h"
#include "transfer/planner.h"
#include "transfer/region_table.h"
#include "transfer/transfer_op.h"

namespace ferry::internal {

class AgentCore final : public ConnectionOwner,
                        public TargetServices,
                        public std::enable_shared_from_this<AgentCore> {
  public:
    static Result<std::shared_ptr<AgentCore>> Create(AgentConfig config);
    ~AgentCore() override;
    void Shutdown();

    const std::string& name() const { return config_.name; }
    uint64_t epoch() const { return epoch_; }
    std::string ListenAddress() const { return side_channel_address_; }

    Result<RegionInfo> RegisterMemory(void* ptr, size_t length);
    Result<RegionInfo> AllocateRegion(size_t length);
    // `fd` < 0: open `path`.
    Result<RegionInfo> RegisterFile(const std::string& path, int fd, uint64_t offset,
                                    uint64_t length, const FileRegionOptions& options);
    Status Deregister(RegionId id);
    std::vector<RegionInfo> Regions() const { return regions_.List(); }

    std::string Metadata() const;
    Result<std::string> AddPeer(std::string_view blob);
    Result<std::string> Connect(std::string_view host_port, std::chrono::milliseconds timeout);
    Status RemovePeer(std::string_view name);
    Result<std::string> ConnectByName(std::string_view name);
    Result<std::string> PeerBackend(std::string_view name) const;
    AgentStats Stats() const;

    Result<Transfer> Post(TransferOp::Kind kind, std::span<const Descriptor> local,
                          std::string_view peer, std::span<const Descriptor> remote,
                          const TransferOptions& options);

    Status Notify(std::string_view peer, std::string_view payload);
    std::vector<Notification> TakeNotifications();
    std::vector<Notification> WaitNotifications(Clock::time_point deadline);

    Status Publish(std::string key, std::vector<Descriptor> descriptors);
    Status Unpublish(std::string_view key);
    Result<PullResult> PullByKey(std::string_view peer, std::string_view key,
                                 const Descriptor& local, std::chrono::milliseconds timeout);

    // ConnectionOwner (loop threads).
    void OnRequest(Connection& conn, const wire::FrameHeader& h, std::string_view body) override;
    void OnClosed(Connection& conn, const Status& why) override;
    void OnReady(Connection& conn) override;
    void HandshakeOver(const Connection& conn);

    // TargetServices (the threads of backends with their own data path).
    Status PinSegments(const std::vector<wire::Segment>& segs, bool write,
                       std::vector<RegionPin>* pins, std::vector<iovec>* iov,
                       FileStaging* staging) override;
    Status MoveStaged(FileStaging& staging, bool to_file) override;
    Status ResolveObject(std::string_view key, std::vector<RegionPin>* pins,
                         std::vector<iovec>* iov, uint64_t* size) override;
    void DeliverNotification(std::string peer, std::string payload) override;
    Status GrantRegion(RegionId id, uint64_t key, void** base, uint64_t* length) override;

  private:
    struct Mapping {
        uint8_t* base = nullptr;
        uint64_t length = 0;
        ~Mapping();
    };

    // One of the peer's regions as this process maps it (shm, one-sided copies).
    struct RemoteMapping {
        enum class State { kPending, kGranted, kRefused };
        State state = State::kPending;
        uint64_t key = 0;  // the key the peer checked when it granted the mapping
        uint64_t share_id = 0;
        std::shared_ptr<Mapping> map;
    };

    struct Peer {
        AgentMetadata md;
        std::string backend;  // chosen for this peer
        std::mutex mu;
        std::map<std::string, std::vector<std::shared_ptr<Connection>>> streams;
        std::atomic<uint64_t> next_stream{0};
        std::unordered_map<RegionId, RemoteMapping> mapped;  // under mu
        std::condition_variable mapped_cv;                   // a mapping left kPending
    };

    class Acceptor;

    explicit AgentCore(AgentConfig config);
    Status Start();
    Backend* FindBackend(std::string_view name) const;
    Result<std::string> ChooseBackend(const AgentMetadata& peer) const;
    AgentMetadata SelfMetadata() const;
    std::shared_ptr<Peer> FindPeer(std::string_view name) const;
    // The peer's connections over `backend`, dialing the missing or closed ones.
    Result<std::vector<std::shared_ptr<Connection>>> Streams(Peer& peer, Backend& backend);
    Result<std::shared_ptr<Connection>> Dial(Backend& backend, std::string_view address,
                                             const std::string& label, wire::Purpose purpose,
                                             uint64_t expect_epoch);
    void Accept(Backend* backend, ScopedFd fd);
    void TrackConnection(const std::shared_ptr<Connection>& c);
    IoLoop* NextLoop();
    void Tick();

    // Discovery (AgentConfig.store): register with a lease, then keep it alive, keep the entry
    // current and watch the other agents, on one thread.
    Status Register();
    void RegistryLoop();
    void OnStoreEvent(const StoreEvent& e);
    void MarkMetadataChanged();
    void ClosePeerStreams(Peer& peer, const Status& why);
    uint64_t NextRequestId() { return next_request_id_.fetch_add(1); }

    // Target side.
    void ServeData(Connection& conn, const wire::FrameHeader& h, std::string_view body);
    void ServePull(Connection& conn, const wire::FrameHeader& h, std::string_view body);
    void Respond(Connection& conn, uint64_t request_id, const Status& s, uint64_t value = 0);
    // A transfer between this agent's own regions (the peer is itself): memory <-> file through
    // the file engine, memory <-> memory by copying.
    Result<Transfer> PostLocal(TransferOp::Kind kind, std::span<const Descriptor> local,
                               std::span<const Descriptor> remote, const TransferOptions& options);
    // Serves a peer's inline READ or WRITE that touches file regions: the file bytes go through
    // `staging` (read before the response is sent, written after the payload arrived).
    void ServeStaged(Connection& conn, uint64_t request_id, const wire::DataRequest& req,
                     bool write, std::vector<RegionPin> pins, std::vector<iovec> iov,
                     FileStaging staging);
    // The file engine (created with the first file region; null before).
    FileEngine* Files() const;
    FileEngine::Options FileOptions() const;
    // Where the peer's endpoint for `backend` is (name, epoch, address).
    PeerRef RefFor(Peer& peer, const Backend& backend) const;
    // Copies between our memory and the initiator's over a cma stream: through mappings of the
    // initiator's shared regions when every buffer lies in one, else by cross-memory attach.
    Status CopyWithPeer(Connection& conn, const std::vector<iovec>& ours,
                        const std::vector<iovec>& theirs,
                        const std::vector<wire::SharedRegion>& shares, bool to_peer);
    std::vector<wire::SharedRegion> SharesFor(const std::vector<RegionId>& regions) const;
    void BroadcastUnshare(uint64_t share_id);
    // Tells every initiator granted a mapping of our region `share_id` to drop it and waits for
    // their answers (up to the deregistration grace; a peer that stays silent is disconnected).
    void RevokeGrants(uint64_t share_id, RegionId id);
    void ServeMapRegion(Connection& conn, const wire::FrameHeader& h, std::string_view body);
    void HandleUnshare(Connection& conn, const wire::FrameHeader& h, std::string_view body);

    // Initiator side of one-sided shm: the copies of `chunks` through our mappings of the
    // peer's regions. kPending: some region's mapping is being requested (on `control`, now if
    // it was never asked for) and its region is in `pending`; kRefused: the peer copies.
    enum class LocalPlan { kReady, kPending, kRefused };
    LocalPlan PlanLocalCopies(const std::shared_ptr<Peer>& peer, const std::vector<Chunk>& chunks,
                              const std::shared_ptr<Connection>& control,
                              std::vector<TransferOp::LocalCopy>* work,
                              std::vector<std::shared_ptr<void>>* keep,
                              std::vector<RegionId>* pending);
    void RequestMapping(const std::shared_ptr<Peer>& peer,
                        const std::shared_ptr<Connection>& control, RegionId region, uint64_t key);

    std::shared_ptr<Mapping> MapPeerRegion(pid_t pid, const wire::SharedRegion& share);

    const AgentConfig config_;
    const uint64_t epoch_;
    const std::string host_id_;
    // Read by the peer in the shm handshake to prove it may attach to this process.
    const std::unique_ptr<uint64_t> cma_probe_;

    RegionTable regions_;
    std::vector<std::unique_ptr<IoLoop>> loops_;
    std::atomic<uint64_t> next_loop_{0};
    std::map<std::string, std::unique_ptr<Backend>, std::less<>>
        backends_;                      // enabled + side channel
    std::vector<std::string> enabled_;  // offered and usable, in preference order (RankBackends)
    std::vector<Backend*> own_path_;    // in backends_: those with their own data path, started
    std::string side_channel_;          // the backend that serves metadata (Connect)
    std::map<std::string, std::string, std::less<>> endpoints_;  // backend -> published address
    std::vector<ScopedFd> listeners_;
    std::vector<std::shared_ptr<EventHandler>> acceptors_;
    std::string side_channel_address_;

    mutable std::mutex peers_mu_;
    std::map<std::string, std::shared_ptr<Peer>, std::less<>> peers_;

    mutable std::mutex conns_mu_;
    std::set<std::shared_ptr<Connection>> conns_;
    // Accepted connections still in their handshake, by source (under conns_mu_): bounded per
    // source and in all, so strangers cannot hold many sockets or buffers.
    std::map<const Connection*, std::string> handshaking_;
    std::map<std::string, size_t, std::less<>> handshaking_by_source_;
    std::atomic<uint64_t> handshakes_refused_{0};
    std::atomic<uint64_t> stalled_frames_dropped_{0};
    std::shared_ptr<ReceiveBudget> receive_budget_;
    uint64_t ticks_ = 0;  // loop 0

    std::mutex ops_mu_;
    std::unordered_map<uint64_t, std::weak_ptr<TransferOp>> ops_;
    std::atomic<uint64_t> next_op_id_{1};
    std::atomic<uint64_t> next_request_id_{1};

    std::mutex notes_mu_;
    std::condition_variable notes_cv_;
    std::deque<Notification> notes_;
    size_t notes_bytes_ = 0;

    mutable std::mutex objects_mu_;
    std::map<std::string, std::vector<Descriptor>, std::less<>> objects_;

    // Peers' regions mapped here, by (pid, share id): initiators' (target side) and targets'
    // (one-sided initiator side).
    std::mutex maps_mu_;
    std::map<std::pair<pid_t, uint64_t>, std::shared_ptr<Mapping>> maps_;
    // Our regions' mappings granted to initiators: share id -> the streams that asked.
    std::map<uint64_t, std::vector<std::weak_ptr<Connection>>> grants_;  // under maps_mu_

    std::atomic<uint64_t> transfers_posted_{0};
    std::atomic<uint64_t> one_sided_transfers_{0};
    std::atomic<uint64_t> bytes_posted_{0};

    std::unique_ptr<MetadataStore> store_;
    LeaseId lease_ = 0;  // registry thread (and Start, before it runs)
    std::thread registry_;
    std::mutex registry_mu_;
    std::condition_variable registry_cv_;
    bool registry_stop_ = false;     // under registry_mu_
    bool metadata_changed_ = false;  // under registry_mu_

    std::atomic<bool> shut_down_{false};

    // Last: destroyed first, while everything its callbacks reach still exists.
    mutable std::mutex files_mu_;
    std::unique_ptr<FileEngine> files_;
};

}  // namespace ferry::internal
