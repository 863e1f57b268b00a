// AgentCore: the implementation behind ferry::Agent, and the one place its parts meet. Each job
// has a class of its own:
//   agent_config.h      the checks a config passes, the sizes derived from it
//   registrar.h         discovery registration (lease, renewals, watching other agents)
//   peer_table.h        the peers, their metadata and streams; the backend chosen for each
//   notification_queue.h, object_directory.h   notifications received, objects published
//   target_service.h    the backend-neutral target side (every check before our memory is
//                       touched), used by the stream target and by backends with their own path
//   stream_links.h      the stream backends' shared connection code (listen, accept, dial,
//                       handshake bounds and timeouts, stall checks)
//   stream_target.h     the stream backends' target side (READ, WRITE, PULL, map-region)
//   peer_memory.h       same-host peers' regions mapped here, cross-memory copies
// AgentCore itself holds the lifecycle (agent_core.cc), the initiator side of transfers,
// notifications and pulls (agent_initiator.cc) and the one-sided shm protocol between peers'
// mappings (agent_one_sided.cc).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ferry/agent.h"
#include "ferry/discovery.h"
#include "transfer/backend.h"
#include "transfer/connection.h"
#include "transfer/io_loop.h"
#include "transfer/metadata.h"
#include "transfer/notification_queue.h"
#include "transfer/object_directory.h"
#include "transfer/peer_memory.h"
#include "transfer/peer_table.h"
#include "transfer/planner.h"
#include "transfer/region_table.h"
#include "transfer/registrar.h"
#include "transfer/stream_links.h"
#include "transfer/stream_target.h"
#include "transfer/target_service.h"
#include "transfer/transfer_op.h"

namespace ferry::internal {

class AgentCore final : public ConnectionOwner, public std::enable_shared_from_this<AgentCore> {
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
    std::vector<Notification> TakeNotifications() { return notes_.Take(); }
    std::vector<Notification> WaitNotifications(Clock::time_point deadline) {
        return notes_.Wait(deadline);
    }

    Status Publish(std::string key, std::vector<Descriptor> descriptors) {
        return objects_.Publish(std::move(key), std::move(descriptors));
    }
    Status Unpublish(std::string_view key) { return objects_.Unpublish(key); }
    Result<PullResult> PullByKey(std::string_view peer, std::string_view key,
                                 const Descriptor& local, std::chrono::milliseconds timeout);

    // ConnectionOwner (loop threads).
    void OnRequest(Connection& conn, const wire::FrameHeader& h, std::string_view body) override;
    void OnClosed(Connection& conn, const Status& why) override;
    void OnReady(Connection& conn) override { links_.HandshakeOver(conn); }

  private:
    // How long a Deregister waits for peers to let go of the region.
    static constexpr std::chrono::milliseconds kDeregisterGrace{2000};

    explicit AgentCore(AgentConfig config);
    Status Start();
    Backend* FindBackend(std::string_view name) const;
    AgentMetadata SelfMetadata() const;
    // The peer's connections over `backend`, dialing the missing or closed ones.
    Result<std::vector<std::shared_ptr<Connection>>> Streams(Peer& peer, Backend& backend);
    Result<std::shared_ptr<Connection>> Dial(Backend& backend, std::string_view address,
                                             const std::string& label, wire::Purpose purpose,
                                             uint64_t expect_epoch);
    IoLoop* NextLoop();
    void Tick();
    void MarkMetadataChanged();
    void OnPeerEntry(const std::string& name, const StoreEvent& e);
    void ClosePeerStreams(Peer& peer, const Status& why);
    uint64_t NextRequestId() { return next_request_id_.fetch_add(1); }
    void TrackOp(const std::shared_ptr<TransferOp>& op);
    // Where the peer's endpoint for `backend` is (name, epoch, address).
    PeerRef RefFor(Peer& peer, const Backend& backend) const;

    // Initiator side (agent_initiator.cc). A transfer between this agent's own regions (the
    // peer is itself): memory <-> file through the file engine, memory <-> memory by copying.
    Result<Transfer> PostLocal(TransferOp::Kind kind, std::span<const Descriptor> local,
                               std::span<const Descriptor> remote, const TransferOptions& options);
    Result<Transfer> PostOwnPath(TransferOp::Kind kind, const std::shared_ptr<Peer>& peer,
                                 Backend& backend, std::vector<PlannedSegment> segments,
                                 std::vector<RegionPin> pins, bool all_host,
                                 Clock::time_point deadline, const TransferOptions& options);
    Result<Transfer> PostStreams(TransferOp::Kind kind, const std::shared_ptr<Peer>& peer,
                                 Backend& backend, std::vector<PlannedSegment> segments,
                                 std::vector<RegionPin> pins, Clock::time_point deadline,
                                 const TransferOptions& options);

    // One-sided shm between peers' mappings (agent_one_sided.cc). Initiator side: the copies
    // of `chunks` through our mappings of the peer's regions. kPending: some region's mapping
    // is being requested (on `control`, now if it was never asked for) and its region is in
    // `pending`; kRefused: the peer copies.
    enum class LocalPlan { kReady, kPending, kRefused };
    LocalPlan PlanLocalCopies(const std::shared_ptr<Peer>& peer, const std::vector<Chunk>& chunks,
                              const std::shared_ptr<Connection>& control,
                              std::vector<TransferOp::LocalCopy>* work,
                              std::vector<std::shared_ptr<void>>* keep,
                              std::vector<RegionId>* pending);
    // Plans, waiting (at most kMapWait, or to `deadline`) for the grants a first transfer asked.
    bool PlanOneSided(const std::shared_ptr<Peer>& peer, const std::vector<Chunk>& chunks,
                      const std::shared_ptr<Connection>& control, Clock::time_point deadline,
                      std::vector<TransferOp::LocalCopy>* work,
                      std::vector<std::shared_ptr<void>>* keep);
    void RequestMapping(const std::shared_ptr<Peer>& peer,
                        const std::shared_ptr<Connection>& control, RegionId region, uint64_t key);
    // A peer let go of a region of its (or asks us to let go of ours).
    void HandleUnshare(Connection& conn, const wire::FrameHeader& h, std::string_view body);
    // Tells every initiator granted a mapping of our region `share_id` to drop it and waits for
    // their answers (up to the deregistration grace; a peer that stays silent is disconnected).
    void RevokeGrants(uint64_t share_id, RegionId id);
    // Tells the targets we stream to that our region `share_id` is gone.
    void BroadcastUnshare(uint64_t share_id);
    // The last stream to process `pid` closed: one-sided transfers into it fail, its mappings go.
    void PeerProcessGone(Connection& conn, const Status& why);

    const AgentConfig config_;
    const uint64_t epoch_;
    const std::string host_id_;
    // Read by the peer in the shm handshake to prove it may attach to this process.
    const std::unique_ptr<uint64_t> cma_probe_;

    RegionTable regions_;
    NotificationQueue notes_;
    ObjectDirectory objects_;
    FileEngineSlot files_;  // reset at the end of the destructor, before the rest goes
    TargetService target_;
    PeerMemory peer_memory_;
    PeerTable peers_;
    std::atomic<bool> shut_down_{false};

    std::vector<std::unique_ptr<IoLoop>> loops_;
    std::atomic<uint64_t> next_loop_{0};
    StreamLinks links_;
    StreamTarget stream_target_;
    std::map<std::string, std::unique_ptr<Backend>, std::less<>>
        backends_;                        // enabled + side channel
    std::vector<std::string> enabled_;    // offered and usable, in preference order (RankBackends)
    std::vector<Backend*> own_path_;      // in backends_: those with their own data path, started
    std::unique_ptr<Backend> self_path_;  // transfers to the agent itself (Locality::kSelf)
    std::string side_channel_;            // the backend that serves metadata (Connect)
    std::map<std::string, std::string, std::less<>> endpoints_;  // backend -> published address
    std::string side_channel_address_;

    std::mutex ops_mu_;
    std::unordered_map<uint64_t, std::weak_ptr<TransferOp>> ops_;
    std::atomic<uint64_t> next_op_id_{1};
    std::atomic<uint64_t> next_request_id_{1};

    std::atomic<uint64_t> transfers_posted_{0};
    std::atomic<uint64_t> one_sided_transfers_{0};
    std::atomic<uint64_t> bytes_posted_{0};

    std::unique_ptr<Registrar> registrar_;  // with AgentConfig.store
};

}  // namespace ferry::internal
