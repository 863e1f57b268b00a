// ferry transfer engine: agents, registered memory, batched one-sided READ/WRITE, notifications
// and named objects, over shared memory (same host) and TCP (any host).
//
// Link `ferry::transfer` and include this header; nothing else is needed to move bytes between
// processes. Semantics are specified in docs/transfer-engine.md; the wire format in
// docs/wire-protocol.md.
//
// Quick tour:
//
//   auto agent = ferry::Agent::Create({.name = "decode-0"}).value();
//   auto region = agent->AllocateRegion(64 << 20).value();         // pre-faulted, owned
//   std::string peer = agent->Connect("10.0.0.7:7301").value();     // fetches peer metadata
//   ferry::Descriptor local{region.id, 0, 4096};
//   ferry::Descriptor remote{remote_region_id, 0, 4096};
//   auto xfer = agent->PostRead({&local, 1}, peer, {&remote, 1}).value();
//   ferry::Status s = xfer.Wait(std::chrono::seconds(5));
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"

namespace ferry {

using RegionId = uint64_t;
using Clock = std::chrono::steady_clock;

// What kind of memory a region is: host memory, or a range of a file (Agent::RegisterFile; its
// bytes are read and written through the file backend, io_uring). GPU memory follows.
enum class MemoryKind : uint8_t { kHost = 0, kFile = 1, kCuda = 2 };

// A range of registered memory: `count` runs of `length` bytes, `stride` bytes apart, starting at
// `offset` inside region `region`. With count == 1 (the default) it is one contiguous run and
// `stride` is ignored. The strided form names, say, one head slice across many KV blocks in a
// single descriptor.
struct Descriptor {
    RegionId region = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
    uint64_t stride = 0;
    uint64_t count = 1;

    uint64_t TotalBytes() const { return length * count; }
};

// A registered region as the owner sees it. `key` is unguessable (64 random bits) and is what
// peers must present to touch the region; it travels in this agent's metadata. A file region has
// no `base` (nullptr): its bytes live in the file.
struct RegionInfo {
    RegionId id = 0;
    void* base = nullptr;
    uint64_t length = 0;
    uint64_t key = 0;
    MemoryKind kind = MemoryKind::kHost;
};

// How Agent::RegisterFile opens and sizes a file.
struct FileRegionOptions {
    // Create the file if it does not exist, and extend it (sparse) to offset + length if it is
    // shorter. Without it, the file must exist and hold the whole range.
    bool create = false;
    // Open with O_DIRECT: transfers bypass the page cache. Every transfer touching the region must
    // then be aligned to 4096 bytes: the file offset, the length of each piece, and the memory
    // address on the other side (checked when posted, InvalidArgument otherwise). Peers' requests
    // are staged through aligned buffers, so only offsets and lengths matter for them.
    bool direct = false;
    // Open read-only: WRITEs into the region fail with PermissionDenied.
    bool read_only = false;
};

// Every member has a default, so designated initializers may name any subset:
// `Agent::Create({.name = "decode-0", .secret = key})`.
struct AgentConfig {
    // Unique within the deployment; 1..128 bytes of [A-Za-z0-9._:-].
    std::string name{};
    // Address of the side-channel / tcp listener. Loopback by default: binding another
    // interface is an explicit choice (docs/security.md).
    std::string listen_host = "127.0.0.1";
    uint16_t listen_port = 0;  // 0 = pick a free port
    // Backends this agent offers and may use: any of AvailableBackends() ("shm", "tcp", "ucx").
    // For each peer the agent picks the first of them, in a fixed ranking by capability
    // (same-host first, then a backend with its own data path, then one-sided, then by name:
    // shm, ucx, tcp), that can reach it.
    std::vector<std::string> backends = {"shm", "tcp"};
    // Use this backend for every peer instead of choosing by locality ("" = choose).
    std::string force_backend{};
    // Deployment secret. When set, every connection in either direction must prove knowledge of
    // it (HMAC-SHA256 challenge-response); the secret itself never crosses the wire.
    std::string secret{};
    // Deadline applied to a transfer that does not set its own.
    std::chrono::milliseconds default_timeout{30000};
    // A frame from a peer that stays incomplete this long (a header whose body stops coming,
    // a payload that stops arriving) closes that connection and drops what it held.
    std::chrono::milliseconds stalled_frame_timeout{10000};
    // Parallel connections per tcp peer; 0 = sized to the machine (number of cores, 2..8).
    int tcp_streams = 0;
    // Parallel connections per shm peer; 0 = sized to the machine (cores, 1..4).
    int shm_streams = 0;
    // Network I/O threads; 0 = sized to the machine (cores, 1..8).
    int io_threads = 0;
    // shm: map a peer's agent-allocated regions (after the peer checked the region key) and copy
    // in and out of them in this process, one-sided, with no round trip per transfer. false: the
    // peer copies every transfer after checking it. Either way the peer's registered (not
    // allocated) memory is copied by the peer.
    bool shm_map_peer_regions = true;
    // ucx: one-sided access (RMA). Peers may ask for a grant of this agent's host-memory regions
    // (key checked; the region is mapped with ucp_mem_map and its packed rkey handed over) and
    // then move bytes with ucp_put_nbx / ucp_get_nbx, without this agent's CPU on RDMA
    // transports; Deregister revokes every grant before it returns. This agent also uses the
    // grants of peers that offer them. Off: every transfer is an active message the target
    // checks. Over UCX_TLS=tcp, where UCX emulates RMA in software, the two move 4 MiB blocks
    // equally fast (docs/benchmarks.md). On: this agent's UCX worker also runs UCX's software
    // put/get handler, which over tcp writes wherever a peer says, under any rkey; so turn it on
    // only among agents that trust each other (docs/security.md). Off, UCX's RMA feature is not
    // enabled at all. docs/transfer-engine.md, "ucx".
    bool ucx_rma = false;
    // The file backend (file regions, Agent::RegisterFile): "io_uring", or "pread" (pread/pwrite
    // on one thread). io_uring falls back to pread, with a warning, where the kernel refuses it
    // (a container's seccomp profile, say).
    std::string file_io = "io_uring";
    // ios the file backend keeps in the kernel at once (1..1024).
    unsigned file_queue_depth = 64;
    // Discovery store ("" = none): "http://host:port" (the embedded store, `ferry discovery`) or
    // "etcd://host:port". The agent registers its metadata there under its name (key
    // "ferry/agents/<name>") with a lease of `store_ttl`, renews it, registers again if the store
    // lost it, keeps it current as regions change, and removes it on clean shutdown: a killed
    // agent's entry is gone within `store_ttl`. Peers that re-register under a new epoch or leave
    // are noticed through a watch. The deployment secret, when set, authenticates every call.
    std::string store{};
    std::chrono::milliseconds store_ttl{5000};
};

// Counters since the agent started (Agent::Stats).
struct AgentStats {
    uint64_t transfers_posted = 0;     // READs and WRITEs accepted by PostRead/PostWrite
    uint64_t one_sided_transfers = 0;  // of those, copied in this process (shm mapping)
    uint64_t bytes_posted = 0;
    // Resource bounds (docs/security.md). Accepted connections still in their handshake now,
    // and those refused for being over the limit per source (64) or in all (1024).
    uint64_t handshakes_pending = 0;
    uint64_t handshakes_refused = 0;
    // Connections closed because a frame stayed incomplete for 10 s.
    uint64_t stalled_frames_dropped = 0;
    // Bytes of frame bodies held beyond the base read buffers (at most 256 MiB per agent), and
    // how often a connection paused reading because that budget was spent.
    uint64_t receive_budget_used = 0;
    uint64_t receive_budget_waits = 0;
    // Control messages on the wire after the connections' handshakes: requests, responses and
    // notifications (frames on tcp and shm, active messages on ucx), not the bulk data they
    // carry. A PullByKey is one sent and one received on each side.
    uint64_t messages_sent = 0;
    uint64_t messages_received = 0;
};

struct TransferOptions {
    // Delivered to the peer (TakeNotifications) only after every byte of the transfer is in
    // place there. Not sent if the transfer fails.
    std::optional<std::string> notification{};
    // 0 = the agent's default_timeout.
    std::chrono::milliseconds timeout{0};
    // Force a backend for this transfer ("" = the one chosen for the peer).
    std::string backend{};
};

enum class TransferState { kPending, kDone };

namespace internal {
class TransferOp;
class AgentCore;
}  // namespace internal

// Handle of one posted READ or WRITE. Move-only. Thread-safe: Poll, Wait and Cancel may be called
// from any thread. Destroying the handle of a pending transfer cancels it (blocking until no
// backend touches its local memory any more). A handle stays valid after its Agent is destroyed;
// a transfer still pending then has failed with Cancelled.
class Transfer {
  public:
    Transfer() = default;
    Transfer(Transfer&&) noexcept;
    Transfer& operator=(Transfer&&) noexcept;
    Transfer(const Transfer&) = delete;
    Transfer& operator=(const Transfer&) = delete;
    ~Transfer();

    // kPending, kDone, or the error the transfer failed with. Never blocks.
    Result<TransferState> Poll() const;
    // Blocks until the transfer is done, failed, or `deadline` passes (then DeadlineExceeded is
    // returned but the transfer keeps running until its own deadline; Cancel it to stop it).
    Status Wait(Clock::time_point deadline) const;
    Status Wait(std::chrono::milliseconds timeout) const { return Wait(Clock::now() + timeout); }
    // Stops the transfer: it fails with Cancelled (unless already finished). When Cancel returns,
    // no backend writes into the local memory of this transfer any more. A cancelled WRITE may
    // have written part of the remote range.
    Status Cancel();
    // Calls `f` once when the transfer has finished (done, failed or cancelled: then Poll no
    // longer says kPending), at once if it already has. It runs on whichever thread finishes the
    // transfer, with internal locks held: it must return quickly and must not block or call into
    // the Agent or this transfer (wake a thread of your own instead). At most one per transfer;
    // a later call replaces an earlier one not yet run.
    void OnDone(std::function<void()> f);

    uint64_t bytes() const;
    bool valid() const { return op_ != nullptr; }

  private:
    friend class internal::AgentCore;
    explicit Transfer(std::shared_ptr<internal::TransferOp> op);
    std::shared_ptr<internal::TransferOp> op_;
};

struct Notification {
    std::string peer;  // sender's agent name
    std::string payload;
};

// Result of PullByKey.
struct PullResult {
    // Size of the published object in bytes.
    uint64_t object_size = 0;
    // True if the object was copied into the local buffer; false if the buffer was too small
    // (nothing was written; allocate object_size bytes and pull again).
    bool copied = false;
};

// Who this agent talks to and how. Thread-safe: every method may be called from any thread.
// Methods that post work never block on the network; Connect, PullByKey and Deregister block for
// bounded times as documented. The Agent owns regions it allocated; memory passed to
// RegisterMemory stays the caller's and must outlive its registration.
// The backends this build has, in registration order: "shm", "tcp", and "ucx" where it was built
// with libucx.
std::vector<std::string> AvailableBackends();

class Agent {
  public:
    // Starts the listener and I/O threads. Fails with InvalidArgument for a bad config and
    // Unavailable if the listen address cannot be bound.
    static Result<std::unique_ptr<Agent>> Create(AgentConfig config);

    // Fails every pending transfer (Cancelled), closes every connection, frees owned regions.
    ~Agent();
    Agent(const Agent&) = delete;
    Agent& operator=(const Agent&) = delete;

    const std::string& name() const;
    // Random per process start: a restarted agent with the same name has a new epoch.
    uint64_t epoch() const;
    // "host:port" of the side-channel listener (the tcp endpoint).
    std::string ListenAddress() const;

    // --- Memory -------------------------------------------------------------------------------
    // Registers caller-owned memory. It is pre-faulted (without changing its contents).
    Result<RegionInfo> RegisterMemory(void* ptr, size_t length);
    // Allocates `length` bytes of agent-owned, zeroed, pre-faulted memory (a shared mapping).
    Result<RegionInfo> AllocateRegion(size_t length);
    // Registers bytes [offset, offset + length) of the file at `path` as a region (kind kFile).
    // It is used like memory: peers READ and WRITE it over any backend (the "remote NVMe" path;
    // this agent stages the bytes through memory), and this agent moves bytes between it and its
    // memory regions by posting a transfer to itself: PostRead(memory, name(), file) reads the
    // file, PostWrite(memory, name(), file) writes it, through io_uring with batched submission.
    // The file stays open until Deregister. Errors name the file and what failed: NotFound (no
    // such file, without `create`), PermissionDenied, InvalidArgument (range beyond the end of
    // the file, a misaligned direct range, a file system without O_DIRECT).
    Result<RegionInfo> RegisterFile(const std::string& path, uint64_t offset, uint64_t length,
                                    FileRegionOptions options = {});
    // As RegisterFile, for an open file descriptor: the agent keeps its own duplicate. `direct`
    // and `read_only` must match how `fd` was opened (O_DIRECT, O_RDONLY); `create` extends it.
    Result<RegionInfo> RegisterFileDescriptor(int fd, uint64_t offset, uint64_t length,
                                              FileRegionOptions options = {});
    // Removes a region. Pending local transfers using it fail with Cancelled; peers' requests
    // for it fail with NotFound. Blocks until no backend touches the memory (at most a few
    // seconds: a stalled connection holding it is closed). NotFound for an unknown id.
    Status Deregister(RegionId id);
    std::vector<RegionInfo> Regions() const;

    // --- Peers --------------------------------------------------------------------------------
    // This agent's metadata: a versioned binary blob (name, epoch, host identity, endpoints per
    // backend, regions). Contains region keys: hand it only to peers you trust.
    std::string Metadata() const;
    // Adds or refreshes a peer from its metadata blob; returns the peer's name. A blob with the
    // same name but a new epoch replaces the peer: transfers to the old one fail Unavailable.
    // InvalidArgument for a malformed blob, AlreadyExists for this agent's own name.
    Result<std::string> AddPeer(std::string_view metadata);
    // Fetches a peer's metadata from its listener ("host:port"), then AddPeer. Blocks up to
    // `timeout`. Unavailable if unreachable, PermissionDenied on a secret mismatch.
    Result<std::string> Connect(std::string_view host_port,
                                std::chrono::milliseconds timeout = std::chrono::seconds(5));
    // Looks `name` up in the discovery store (AgentConfig.store) and adds it as a peer. NotFound
    // if it is not registered, FailedPrecondition without a store.
    Result<std::string> ConnectByName(std::string_view name);
    // Drops a peer: its connections close, pending transfers to it fail with Unavailable.
    Status RemovePeer(std::string_view name);
    // The backend chosen for the peer (one of AgentConfig::backends), NotFound for an unknown
    // peer.
    Result<std::string> PeerBackend(std::string_view name) const;
    AgentStats Stats() const;

    // --- Transfers ----------------------------------------------------------------------------
    // One-sided READ (remote -> local) or WRITE (local -> remote). `local` descriptors name this
    // agent's memory regions, `remote` descriptors the peer's (memory or file regions); the two
    // lists may have any lengths
    // (1..100k each) but must cover the same number of bytes (gather/scatter). Adjacent
    // descriptors are coalesced. Errors found before posting (unknown peer or region, bounds,
    // length mismatch) are returned here; the rest through the handle, with the code the target
    // gave (PermissionDenied for a wrong key, OutOfRange for bounds, NotFound for an unknown
    // region), Unavailable if the peer died, DeadlineExceeded past the deadline.
    // Transfers in flight at the same time must not write overlapping bytes (nor write bytes
    // another reads): like two memcpy calls on two threads, the result is unspecified, and
    // ThreadSanitizer reports it when both ends live in one process.
    // `peer` may be this agent's own name: the transfer then moves bytes between its own regions
    // (memory <-> file through the file backend, memory <-> memory by copying; file <-> file is
    // refused). Such a transfer has no notification (InvalidArgument) and no stream: it is
    // batched into io_uring, and Cancel and deadlines stop it as for any other.
    Result<Transfer> PostRead(std::span<const Descriptor> local, std::string_view peer,
                              std::span<const Descriptor> remote, TransferOptions options = {});
    Result<Transfer> PostWrite(std::span<const Descriptor> local, std::string_view peer,
                               std::span<const Descriptor> remote, TransferOptions options = {});

    // --- Notifications ------------------------------------------------------------------------
    // Sends a short message (at most 1 MiB). Notifications from one agent to another arrive in
    // the order sent. Fire and forget: NotFound for an unknown peer, otherwise OK (a peer that
    // dies before receiving it never sees it).
    Status Notify(std::string_view peer, std::string_view payload);
    // Returns and clears the notifications received so far, oldest first.
    std::vector<Notification> TakeNotifications();
    // Blocks until at least one notification is queued or the deadline passes; then as
    // TakeNotifications (possibly empty).
    std::vector<Notification> WaitNotifications(Clock::time_point deadline);

    // --- Named objects ------------------------------------------------------------------------
    // Publishes `key` (1..4096 bytes) as the concatenation of `descriptors` (this agent's
    // regions). Replaces an existing object under the same key.
    Status Publish(std::string key, std::vector<Descriptor> descriptors);
    // NotFound if the key is not published.
    Status Unpublish(std::string_view key);
    // Copies the peer's object `key` into `local` in one round trip. NotFound if absent; if
    // `local` is smaller than the object, nothing is copied and the result says the size.
    Result<PullResult> PullByKey(std::string_view peer, std::string_view key,
                                 const Descriptor& local,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(30));

  private:
    explicit Agent(std::shared_ptr<internal::AgentCore> core);
    std::shared_ptr<internal::AgentCore> core_;
};

}  // namespace ferry
