// Backend: how an agent reaches peers over one kind of link, and (for a backend with a data path
// of its own) how the bytes move. docs/transfer-engine.md, "Writing a backend".
//
// Two kinds of backend sit behind this one interface:
//   - stream backends (tcp, shm) give sockets: the agent's shared stream machinery (framing,
//     handshake, requests, the target's checks) runs over them, and the backend says how payload
//     bytes travel (on the stream, or copied by the target across address spaces);
//   - backends with their own data path (ucx) move bytes themselves: the agent hands them chunks
//     of a transfer, notifications and pulls, and they serve their peers' requests through the
//     TargetServices the agent gives them at Start (the same checks every backend's target runs).
// The agent core knows no backend by name: it ranks the enabled backends by their capabilities
// (RankBackends) and picks, for each peer, the first one that can reach it.
//
// Backends are added with one ferry_add_backend() call in CMakeLists.txt, which generates the
// registry (backends/registry.cc includes it).
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/fd.h"
#include "ferry/agent.h"
#include "transfer/metadata.h"
#include "transfer/planner.h"
#include "transfer/region_table.h"
#include "transfer/wire.h"

namespace ferry {

namespace internal {
class TransferOp;
struct FileStaging;
class FileEngine;
}  // namespace internal

// Which peers a backend can reach at all.
enum class Locality : uint8_t {
    kSelf,      // none: it moves bytes between the agent's own regions (a transfer to itself)
    kSameHost,  // same boot, network and pid namespace (shared memory, cross-memory attach)
    kAnyHost,   // over a network
};

// Who moves a transfer's bytes.
enum class DataPath : uint8_t {
    kStream,  // the agent's stream machinery over the backend's sockets
    kOwn,     // the backend itself (Post, Notify, Pull below)
};

struct BackendCapabilities {
    DataPath data_path = DataPath::kStream;
    Locality locality = Locality::kAnyHost;
    // Moves bytes without the target's CPU in the path where the peer allows it (shm mappings,
    // ucx RMA): counted in AgentStats.one_sided_transfers.
    bool one_sided = false;
    bool notifications = true;
    bool pull_by_key = true;
    // The memory kinds of the peer's regions it can READ and WRITE (a bit per MemoryKind).
    uint32_t memory_kinds = MemoryKindBit(MemoryKind::kHost) | MemoryKindBit(MemoryKind::kFile);
    // Can carry the side channel (metadata for Agent::Connect): a stream backend that reaches any
    // host. The agent always runs one, enabled or not.
    bool side_channel = false;

    static constexpr uint32_t MemoryKindBit(MemoryKind k) { return 1u << static_cast<unsigned>(k); }
    bool touches(MemoryKind k) const { return (memory_kinds & MemoryKindBit(k)) != 0; }
};

// "host", "file", "cuda".
std::string MemoryKindName(MemoryKind k);

// The agent's preference order for `names` (deterministic): same-host backends first (a
// narrower reach buys a shorter path), then those with their own data path (they exist to be
// faster than the shared stream path: fabrics, GPU-direct), then one-sided ones, then by name.
std::vector<std::string> RankBackends(
    std::vector<std::pair<std::string, BackendCapabilities>> backends);

// Where one peer's endpoint for a backend is.
struct PeerRef {
    std::string name;
    uint64_t epoch = 0;
    std::string address;  // what the peer published for this backend
};

// The target side, implemented once by the agent and used by every backend with its own data
// path to serve its peers' requests: the same checks the stream machinery runs.
class TargetServices {
  public:
    virtual ~TargetServices() = default;
    // Pins and resolves target segments for a peer: key and bounds checked. Segments in file
    // regions point into `staging`'s buffer; MoveStaged moves those bytes from the file before a
    // READ is answered, and to the file after a WRITE's payload arrived (synchronously).
    virtual Status PinSegments(const std::vector<wire::Segment>& segs, bool write,
                               std::vector<RegionPin>* pins, std::vector<iovec>* iov,
                               internal::FileStaging* staging) = 0;
    virtual Status MoveStaged(internal::FileStaging& staging, bool to_file) = 0;
    // Pins and resolves a published object.
    virtual Status ResolveObject(std::string_view key, std::vector<RegionPin>* pins,
                                 std::vector<iovec>* iov, uint64_t* size) = 0;
    virtual void DeliverNotification(std::string peer, std::string payload) = 0;
    // For a one-sided grant: checks region `id`'s key, that it exists and is host memory, and
    // says where it is.
    virtual Status GrantRegion(RegionId id, uint64_t key, void** base, uint64_t* length) = 0;

    // For a backend between the agent's own regions (Locality::kSelf): region `id` (null if
    // there is none), pinned or not, and the agent's file engine (made on first use).
    virtual std::shared_ptr<RegionEntry> OwnRegion(RegionId id) = 0;
    virtual Result<RegionPin> PinOwnRegion(RegionId id) = 0;
    virtual Result<internal::FileEngine*> Files() = 0;
};

// A transfer between the agent's own regions as a kSelf backend planned it: checked, nothing
// started yet (PlanSelf, then StartSelf).
class SelfTransfer {
  public:
    virtual ~SelfTransfer() = default;
    virtual uint64_t bytes() const = 0;
};

class Backend {
  public:
    virtual ~Backend() = default;

    virtual std::string_view name() const = 0;
    virtual BackendCapabilities capabilities() const = 0;
    // Binds the listener (non-blocking; a backend with its own data path may leave it empty and
    // listen itself) and returns the address to publish in metadata.
    virtual Result<std::string> Listen(ScopedFd* listener) = 0;
    // Whether this agent can use the backend for `peer` (which must publish an endpoint for it).
    virtual bool CanReach(const AgentMetadata& self, const AgentMetadata& peer) const = 0;

    // --- Stream backends (DataPath::kStream) ---
    virtual wire::DataMode data_mode() const { return wire::DataMode::kInline; }
    // Parallel connections per peer.
    virtual int streams() const { return 1; }
    // Starts a non-blocking connect to a published address. `*in_progress` tells whether the
    // connect completes later (the socket becomes writable).
    virtual Result<ScopedFd> Dial(std::string_view address, bool* in_progress) const;
    // Socket options for a connected or accepted socket.
    virtual void Configure(int fd) const { (void)fd; }
    // The server side of this backend checks cross-memory access in the handshake.
    virtual bool verify_cma() const { return false; }

    // --- Backends with their own data path (DataPath::kOwn) ---
    // The contracts (docs/transfer-engine.md, "Writing a backend"): the agent pins the local
    // memory of an op and arms it with the number of chunks; the backend completes each chunk
    // once (TransferOp::ChunkDone), from any thread, and touches the op's memory no more after
    // CutOff returned. Peers' requests are served only through `services`.
    //
    // Starts serving peers (after Listen). `services` outlives the backend's Stop.
    virtual Status Start(TargetServices* services) {
        (void)services;
        return Status::Ok();
    }
    // Fails everything in flight (Cancelled) once the backend has let go of its memory.
    virtual void Stop() {}
    // How the agent cuts a transfer into chunks for Post.
    virtual uint64_t chunk_bytes() const { return 4u << 20; }
    virtual uint32_t max_segments() const { return wire::kMaxSegmentsPerFrame; }
    // Sends `chunks` of `op` to `peer`. `all_host`: every remote segment lies in host memory, so
    // a one-sided path may be used where the backend and the peer allow it.
    virtual void Post(const std::shared_ptr<internal::TransferOp>& op, const PeerRef& peer,
                      bool write, std::vector<Chunk> chunks, bool all_host);
    // Queues a notification (ordered with earlier ones to the same peer).
    virtual Status Notify(const PeerRef& peer, std::string payload, std::string sender);
    // Asks `peer` for object `key` into `local` (op armed with one chunk).
    virtual void Pull(const std::shared_ptr<internal::TransferOp>& op, const PeerRef& peer,
                      std::string key, std::vector<iovec> local, uint64_t capacity);
    // Returns once the backend touches no local memory of op `op_id` any more.
    virtual void CutOff(uint64_t op_id, const Status& why) {
        (void)op_id;
        (void)why;
    }
    // The peer (of `epoch`, 0 = any) is gone or restarted: fail its transfers with `why`.
    virtual void PeerLost(const std::string& peer, uint64_t epoch, const Status& why) {
        (void)peer;
        (void)epoch;
        (void)why;
    }
    // Deregister of region `id`: returns once no peer can reach it through this backend any more
    // (one-sided grants revoked, or after `grace` their holders disconnected).
    virtual void RevokeRegion(RegionId id, std::chrono::milliseconds grace) {
        (void)id;
        (void)grace;
    }
    // After Deregister: forgets `id` (ids are never reused).
    virtual void RegionGone(RegionId id) { (void)id; }
    // Transfers moved one-sided by the backend itself so far.
    virtual uint64_t one_sided_transfers() const { return 0; }
    // Backends with their own data path: control messages sent and received so far (ucx:
    // active messages). Stream backends' frames are counted by the agent.
    virtual uint64_t messages_sent() const { return 0; }
    virtual uint64_t messages_received() const { return 0; }

    // --- The backend between the agent's own regions (Locality::kSelf) ---
    // A transfer whose peer is the agent itself: `local` to `remote` for a write, back for a
    // read, both the agent's regions (memory or file). Checks everything (regions, bounds,
    // lengths, directions, alignment) before anything moves; an error says what was wrong.
    virtual Result<std::unique_ptr<SelfTransfer>> PlanSelf(bool write,
                                                           std::span<const Descriptor> local,
                                                           std::span<const Descriptor> remote);
    // Starts `plan` as `op` (made for plan->bytes(); not yet visible to anyone): arms it with
    // one chunk and sets its cut-off.
    virtual void StartSelf(const std::shared_ptr<internal::TransferOp>& op,
                           std::unique_ptr<SelfTransfer> plan);
};

// What a backend's factory gets.
struct BackendContext {
    const AgentConfig& config;
    const std::string& host_id;
};

// Creates the backend called `name`, or NotFound listing the known ones.
Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, const AgentConfig& config,
                                               const std::string& host_id);
// The backends this build has for peers, in registration order.
std::vector<std::string> KnownBackends();
// The backend for transfers to the agent itself (ferry_add_backend(... SELF)), or NotFound.
Result<std::unique_ptr<Backend>> CreateSelfBackend(const AgentConfig& config,
                                                   const std::string& host_id);

// For tests (testing/faulty_backend.h): while a guard lives, CreateBackend(name) hands the backend
// it made to `wrap` and returns what that returns (the wrapper keeps the name).
using BackendWrap = std::function<std::unique_ptr<Backend>(std::unique_ptr<Backend>)>;
class BackendWrapGuard {
  public:
    BackendWrapGuard(std::string name, BackendWrap wrap);
    ~BackendWrapGuard();
    BackendWrapGuard(const BackendWrapGuard&) = delete;
    BackendWrapGuard& operator=(const BackendWrapGuard&) = delete;

  private:
    std::string name_;
};

// "<boot id>/net:<netns inode>/pid:<pidns inode>": equal on two agents iff they share memory.
std::string LocalHostId();

// Parses "host:port" / "[v6]:port".
Status SplitHostPort(std::string_view address, std::string* host, uint16_t* port);

}  // namespace ferry
