// The inside of AgentKvConnector (agent_connector.h), shared by its files, one job each:
//
//   agent_connector.cc          the facade (the KvConnector the engine calls), messages, threads
//   agent_connector_peers.cc    peers: dialing, the handshake and what must match, liveness
//   agent_connector_loads.cc    the receiving side's life cycle, both protocols
//   pull_protocol.{h,cc}        pull: the holds and claims it owns, the READ
//   push_protocol.{h,cc}        push: the pushes, targets and step writes it owns, the decoder's
//                               target, layer-wise WRITEs, the end of a push
//   agent_connector_metrics.cc  counters and their Prometheus text
//   peer_messages.{h,cc}        the messages between peers, one codec
//
// Internal: included by those files only. Everything here is guarded by Impl::mu unless it says
// otherwise. The parts' types are in connector_parts (the .cc files name them unqualified).
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <semaphore>
#include <span>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "core/crypto.h"
#include "core/host_port.h"
#include "core/log.h"
#include "kv/agent_connector.h"
#include "kv/kv_layout.h"
#include "kv/peer_messages.h"

namespace ferry::kv {
namespace connector_parts {

using SteadyClock = std::chrono::steady_clock;
constexpr size_t kProbeBytes = 64;
constexpr size_t kProbeSlots = 1024;

// A peer's words in a log line: printable ASCII only, bounded.
inline std::string Esc(std::string_view s) {
    std::string out;
    for (char c : s.substr(0, 200)) {
        auto u = static_cast<unsigned char>(c);
        if (u >= 0x20 && u < 0x7f && c != '\\') {
            out += c;
        } else {
            out += fmt::format("\\x{:02x}", u);
        }
    }
    if (s.size() > 200) out += "...";
    return out;
}

// The prompt's identity in messages: SHA-256 over its token ids (int32, little-endian) and, for
// a prompt with images, each image's place and mm_hash (its placeholder tokens are the same
// for every image), hex. Cryptographic, so that no other prompt can pass for it.
inline std::string PromptDigest(std::span<const int32_t> prompt, std::span<const MmSpan> mm = {}) {
    std::string bytes(reinterpret_cast<const char*>(prompt.data()),
                      prompt.size() * sizeof(int32_t));
    for (const MmSpan& m : mm) {
        bytes += fmt::format("|mm {} {} {}", m.offset, m.length, m.hash);
    }
    Digest d = Sha256(bytes);
    return HexEncode(d.data(), d.size());
}

struct PeerRank {
    RegionId region = 0;
    KvLayout layout;
    RegionId canary = 0;  // its handshake canary (0: none offered)
};

struct Peer {
    enum class State { kConnecting, kReady, kFailed } state = State::kConnecting;
    Status error;
    std::string address;  // where it was dialed ("": found by name in the store)
    std::vector<PeerRank> ranks;
    std::vector<std::string> waiting;  // loads (by id) to go on with once ready
    SteadyClock::time_point deadline;
    bool hello_sent = false;
    // Liveness (push decoders waiting for this peer).
    size_t probe_slot = 0;
    Transfer probe;
    SteadyClock::time_point next_probe;
};

// The receiving side of one request.
struct Load {
    KvTransferParams params;
    std::string peer;
    std::vector<BlockId> blocks;
    int num_computed = 0, num_external = 0, prompt_len = 0;
    std::string prompt_digest;
    // The peer was ready from an earlier request: if it turns out gone (a restart), the load
    // is retried once after a fresh handshake.
    bool cached_peer = false, retried = false;
    enum class State {
        kBootstrapping,
        kWaitingForInput,
        kTransferring,
        kCancelling
    } state = State::kBootstrapping;
    Transfer xfer;  // pull
    bool read_done = false, claim_acked = false;
    // pull: the first token as the prefill worker's claim-ack gives it (the params' copy is
    // the client's to change; this one is the holder's).
    std::optional<FirstToken> acked_first;
    // --kv-verify: what was asked of the sender, and its answer.
    std::optional<msg::VerifyRequest> verify;
    std::vector<uint64_t> sums;
    uint64_t bytes = 0;
    SteadyClock::time_point started, deadline;
    // kCancelling: why the load failed (what the request is told once the sender stopped).
    Status cause;
    Status Cause() const { return cause.ok() ? CancelledError("kv transfer cancelled") : cause; }
};

// pull: a finished prefill request's blocks, held for a reader.
struct Hold {
    std::string nonce;
    std::string prompt_digest;
    std::vector<BlockId> blocks;  // what a claim must name
    std::string requester;        // whose cap it counts against
    FirstToken first;             // sampled by the prefill: the claim-ack carries it
    bool claimed = false;
    std::string claimer;
    SteadyClock::time_point deadline;
};

// push: the sending side of one request.
struct Push {
    std::string xid;
    std::string prompt_digest;
    int prompt_len = 0;
    enum class State { kBootstrapping, kReady, kFinishing } state = State::kBootstrapping;
    std::string lid;  // the decoder's request id, echoed in our messages
    std::string peer;
    std::vector<BlockId> target;
    int next_send = 0;
    std::vector<Transfer> transfers;
    Status error;
    bool cancelled = false;
    std::optional<FirstToken> first;
    // --kv-verify (the decoder's): checksummed over our own blocks once the writes are done.
    std::optional<msg::VerifyRequest> verify;
    std::vector<BlockId> blocks;  // ours, from when the request finished
    uint64_t bytes = 0;
    bool timing = false;
    SteadyClock::time_point started, deadline, computed;
    // From binding on: when the decoder is next told to go on waiting (push-alive).
    SteadyClock::time_point renew_at;
};

// push: a decoder's block list that came before its prefill request.
struct Target {
    std::string peer, lid;
    std::vector<BlockId> blocks;
    int from = 0, len = 0;
    std::string prompt_digest;
    std::optional<msg::VerifyRequest> verify;
    SteadyClock::time_point deadline;
};

// A peer's handshake canary being read (kv_verify.h): into `scratch`, each of our ranks'
// canary-shaped copy one after the other.
struct CanaryCheck {
    std::string name, address;
    bool inbound = false;  // answering its hello: the ack goes once the canary is checked
    std::vector<PeerRank> ranks;
    RegionInfo scratch;
    Transfer xfer;
    SteadyClock::time_point deadline;
};

// A request let in by Admit, until Retire.
struct Admission {
    std::string requester;
    bool load = false;  // decode: it loads from `peer`
    std::string peer;
    // pull, decode: the hold it will claim, renewed from `renew_at` on until it is claimed
    // (AgentConnectorOptions::hold_renew_interval).
    std::string hold_rid, hold_nonce;
    SteadyClock::time_point renew_at;
    bool load_started = false;  // StartLoad ran: the load (while it is there) says more
    // push, prefill: the transfer id its decoder's blocks come under. While the request waits in
    // the engine's queue, the decoders whose targets came for it are told to go on waiting
    // (push-alive), from `renew_at` on.
    std::string push_xid;
};

struct PlannedWrite {
    std::string id, peer;
    std::vector<Descriptor> local, remote;
    uint64_t bytes = 0;
};

struct Posted {
    std::string id;
    Result<Transfer> xfer;
    uint64_t bytes = 0;
    size_t descriptors = 0;
};

struct ConnectJob {
    bool inbound = false;  // a peer's hello to answer (connect back first)
    std::string name, address;
    msg::Hello hello;
};

// Wakes the pump thread: a transfer finished (Transfer::OnDone, on an I/O thread that must not
// block, so no lock of ours), or there is new work. Shared with the callbacks, which may run after
// the connector is gone.
struct Waker {
    std::counting_semaphore<> sem{0};
    void Kick() { sem.release(); }
};

inline std::string DtypeName(const KvCacheSpec& s) { return std::string(KvDtypeName(s.dtype)); }

}  // namespace connector_parts

class TransferProtocol;
class PullProtocol;
class PushProtocol;

struct AgentKvConnector::Impl {
    using SteadyClock = connector_parts::SteadyClock;
    using Peer = connector_parts::Peer;
    using PeerRank = connector_parts::PeerRank;
    using Load = connector_parts::Load;
    using CanaryCheck = connector_parts::CanaryCheck;
    using Admission = connector_parts::Admission;
    using ConnectJob = connector_parts::ConnectJob;
    using Waker = connector_parts::Waker;

    std::shared_ptr<Agent> agent;
    AgentConnectorConfig cfg;

    // Bound caches (immutable between Bind and Unbind).
    std::vector<KvCache*> caches;
    std::vector<KvLayout> layouts;
    std::vector<RegionId> regions;
    std::vector<RegionId> registered;  // the ones Bind registered (Unbind deregisters)
    RegionInfo scratch;
    // Each rank's handshake canary, and its layout (kv_verify.h).
    std::vector<RegionInfo> canaries;
    std::vector<KvLayout> canary_layouts;
    std::mt19937_64 rng{std::random_device{}()};
    std::function<void()> wake;
    int tp = 0;

    mutable std::mutex mu;
    std::condition_variable connect_cv;
    std::shared_ptr<Waker> waker = std::make_shared<Waker>();
    bool stop = false, bound = false;
    std::map<std::string, Peer> peers;
    std::map<std::string, Load> loads;
    std::map<std::pair<std::string, bool>, CanaryCheck> canary_checks;  // by (peer, inbound)
    std::vector<ConnectorEvent> events;
    std::deque<ConnectJob> connect_jobs;
    std::map<std::string, Admission> admitted;
    KvConnectorStats stats;
    size_t next_probe_slot = 0;

    // The two protocols, each owning its state (pull: holds; push: pushes, targets, a step's
    // writes), both behind TransferProtocol.
    std::unique_ptr<PullProtocol> pull;
    std::unique_ptr<PushProtocol> push;
    TransferProtocol& ProtocolOf(KvTransferMode mode);

    std::thread notify_thread, pump_thread;
    std::vector<std::thread> connect_threads;

    // --- helpers (mu held) -----------------------------------------------------------------

    int bt() const { return layouts[0].spec.block_tokens; }

    // Our ranks' caches, for checksums.
    std::vector<KvRankView> RankViews() const;
    // --kv-verify, the receiving side: what to ask the sender for tokens [begin, end) (none
    // when off or nothing moves).
    std::optional<msg::VerifyRequest> VerifyRequestFor(int begin, int end);
    // The sending side: checksums of our blocks as `v` asks.
    Result<std::vector<uint64_t>> SumsFor(const msg::VerifyRequest& v,
                                          std::span<const BlockId> blocks);
    // The receiving side, once the KV is in place: OK, or DataLoss naming the first unit that
    // differs.
    Status CheckLoad(const std::string& id, const Load& ld);

    // --- Messages and threads (agent_connector.cc)
    // -------------------------------------------------

    // Transfers wake the pump when they finish: it sleeps otherwise.
    void WakeOnDone(Transfer& x);

    void Emit(ConnectorEvent ev);

    Status Send(const std::string& peer, const msg::PeerMessage& m);

    void OnMessage(const std::string& from, const std::string& payload);

    void NotifyLoop();

    void PumpLoop();
    // One pass of the pump over each part's timers and transfers (each in its part's file).
    void PumpLoads(SteadyClock::time_point now);
    void PumpPeers(SteadyClock::time_point now);

    // --- Peers and the handshake (agent_connector_peers.cc)
    // ----------------------------------------

    // Whether every peer is the deployment's (then what it confirms may be cached).
    bool DeploymentPeers() const;

    bool Allowed(const std::string& address) const;

    // Where to dial the prefill worker params name: "host:port", or "" for by name through the
    // store. PermissionDenied for an agent this worker may not dial.
    Result<std::string> DialAddress(const KvTransferParams& kp) const;

    msg::Compat Compat() const;

    msg::Hello Hello(bool ack) const;

    // Checks a peer's compat against ours; the error names the field and both values.
    Status CheckCompat(const std::string& peer, const msg::Compat& theirs) const;

    // The peer's ranks from its hello or ack: their regions and the kv heads each holds (its
    // TP size may differ from ours).
    Result<std::vector<PeerRank>> ParseRanks(const msg::Compat& theirs,
                                             const std::vector<msg::RankInfo>& ranks) const;
    // (our rank, peer rank) pairs that hold some of the same kv heads: what moves between them
    // when the peer sends (pull, the canary) or we do (push); of a head the sending side
    // replicates, one copy per receiving rank.
    std::vector<std::pair<int, int>> RankPairs(const std::vector<PeerRank>& ranks,
                                               bool peer_sends) const;

    // The handshake canary: read the peer's through the mapping requests use, then check it;
    // the peer is ready (or, inbound, our ack is sent) only if it arrived right.
    void StartCanary(const std::string& name, std::vector<PeerRank> ranks,
                     const std::string& address, bool inbound);
    void PumpCanaries(SteadyClock::time_point now);
    void EndCanary(const std::pair<std::string, bool>& key, const Status& st);
    // The peer's hello was answered well (canary checked, if any): ready, and the ack sent.
    void AcceptHello(const std::string& name, std::vector<PeerRank> ranks,
                     const std::string& address);

    void PeerReady(const std::string& name, std::vector<PeerRank> ranks,
                   const std::string& address);

    void PeerFailed(const std::string& name, const Status& st);

    // A peer that stopped answering: everything waiting on it fails now.
    void PeerGone(const std::string& name, const Status& st);

    void EnsurePeer(const std::string& id, const KvTransferParams& kp);

    // Each message's handler (mu held).
    Status On(const std::string& from, msg::Hello& m);

    Status OnHelloAck(const std::string& from, const msg::Hello& m);

    void ConnectLoop();

    // --- The receiving side: a load from bootstrapping to loaded or failed, both protocols
    // (agent_connector_loads.cc) ---

    // A load whose peer was cached from an earlier request and is gone now (it restarted): a
    // fresh handshake (re-resolved through the params or the store), then the load once more.
    bool RetryLoad(const std::string& id, const Status& st, const std::string& reason);

    // A load ends badly; its blocks are free for the engine once this emits kFailed.
    void FailLoad(const std::string& id, Status st, const std::string& reason = "");

    // pull: continue from the first token only if the params said the prefill sampled one
    // (else the decoder computes the last prompt token itself), and then the holder's own.
    static std::optional<FirstToken> FirstOf(const Load& ld);

    void CompleteLoad(const std::string& id, std::optional<FirstToken> first);

    // The peer is ready: start moving.
    void ProceedLoad(const std::string& id);

    // --- Counters (agent_connector_metrics.cc)
    // -----------------------------------------------------

    void CountFailure(const Status& s, const std::string& reason = "");

    void RecordTime(SteadyClock::time_point started);

    void CountPosted(size_t descriptors);
};

// One protocol's part of the connector, on both sides (pull_protocol.h, push_protocol.h): each
// owns its state and handles its own peer messages. The facade calls the one a request's params
// name, with Impl::mu held; what both share (peers, the load's life cycle, messages, threads)
// stays in Impl.
class TransferProtocol {
  public:
    virtual ~TransferProtocol() = default;
    // Sending side: whether the request may run now (push: once the decoder's blocks are known;
    // false parks it until a kReady or kFailed event).
    virtual bool ReadyToSchedule(const ConnectorRequest& r, const KvTransferParams& p) = 0;
    // Sending side: the request ended with `blocks` holding its KV; what becomes of them.
    virtual FinishAction Finished(const ConnectorRequest& r, std::span<const BlockId> blocks,
                                  bool ok, const FirstToken* first) = 0;
    // Receiving side: how many prompt tokens after `num_computed` arrive from the peer.
    virtual int ExternalTokens(const KvTransferParams& p, int prompt_len,
                               int num_computed) const = 0;
    // Receiving side: the peer is ready; start moving.
    virtual void Proceed(const std::string& id, connector_parts::Load& ld,
                         connector_parts::Peer& p) = 0;
    // This protocol's timers and transfers, once per pump pass.
    virtual void Pump(connector_parts::SteadyClock::time_point now) = 0;
};

}  // namespace ferry::kv
