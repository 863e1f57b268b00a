#include "kv/agent_connector.h"

#include <fmt/core.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <semaphore>
#include <set>
#include <thread>

#include "core/crypto.h"
#include "core/log.h"
#include "kv/kv_layout.h"
#include "kv/peer_messages.h"

namespace ferry::kv {

namespace {

using SteadyClock = std::chrono::steady_clock;
constexpr size_t kProbeBytes = 64;
constexpr size_t kProbeSlots = 1024;

// A peer's words in a log line: printable ASCII only, bounded.
std::string Esc(std::string_view s) {
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

// The prompt's identity in messages: SHA-256 over its token ids (int32, little-endian), hex.
// Cryptographic, so that no other prompt can pass for it.
std::string PromptDigest(std::span<const int32_t> prompt) {
    Digest d = Sha256(std::string_view(reinterpret_cast<const char*>(prompt.data()),
                                       prompt.size() * sizeof(int32_t)));
    return HexEncode(d.data(), d.size());
}

struct PeerRank {
    RegionId region = 0;
    KvLayout layout;
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
    uint64_t bytes = 0;
    SteadyClock::time_point started, deadline;
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
    uint64_t bytes = 0;
    bool timing = false;
    SteadyClock::time_point started, deadline, computed;
};

// push: a decoder's block list that came before its prefill request.
struct Target {
    std::string peer, lid;
    std::vector<BlockId> blocks;
    int from = 0, len = 0;
    std::string prompt_digest;
    SteadyClock::time_point deadline;
};

// A request let in by Admit, until Retire.
struct Admission {
    std::string requester;
    bool load = false;  // decode: it loads from `peer`
    std::string peer;
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

std::string DtypeName(const KvCacheSpec& s) { return std::string(KvDtypeName(s.dtype)); }

}  // namespace

struct AgentKvConnector::Impl : LayerHook {
    std::shared_ptr<Agent> agent;
    AgentConnectorConfig cfg;

    // Bound caches (immutable between Bind and Unbind).
    std::vector<KvCache*> caches;
    std::vector<KvLayout> layouts;
    std::vector<RegionId> regions;
    std::vector<RegionId> registered;  // the ones Bind registered (Unbind deregisters)
    RegionInfo scratch;
    std::function<void()> wake;
    int tp = 0;

    mutable std::mutex mu;
    std::condition_variable connect_cv;
    std::shared_ptr<Waker> waker = std::make_shared<Waker>();
    bool stop = false, bound = false;
    std::map<std::string, Peer> peers;
    std::map<std::string, Load> loads;
    std::map<std::string, Hold> holds;
    std::map<std::string, Push> pushes;
    std::map<std::string, std::string> push_by_xid;
    std::map<std::string, Target> targets;
    // push: transfer ids a decoder cancelled before its prefill request came, until the
    // bootstrap timeout (the request then fails at once instead of waiting for it).
    std::map<std::string, SteadyClock::time_point> cancelled_xids;
    std::vector<ConnectorEvent> events;
    std::deque<ConnectJob> connect_jobs;
    std::map<std::string, Admission> admitted;
    KvConnectorStats stats;
    size_t next_probe_slot = 0;

    // One step's writes (push): planned on the step thread, posted on the rank threads.
    std::vector<std::vector<std::vector<PlannedWrite>>> step_writes;  // [rank][layer]
    std::vector<std::vector<Posted>> step_posted;                     // [rank]
    std::vector<std::pair<std::string, int>> step_advance;

    std::thread notify_thread, pump_thread;
    std::vector<std::thread> connect_threads;

    // --- helpers (mu held) -----------------------------------------------------------------

    int bt() const { return layouts[0].spec.block_tokens; }

    // A client's share of blocks held for remote decoders (unclaimed pull holds: those pin the
    // cache; an honest router's are claimed within milliseconds).
    int HoldCap() const {
        int cap = cfg.max_client_hold_blocks;
        if (cap < 0) cap = layouts.empty() ? 0 : std::max(1, layouts[0].spec.num_blocks / 4);
        return cap;
    }
    Status HoldShareLeft(const std::string& requester, int more) const {
        const int cap = HoldCap();
        if (cap <= 0) return Status::Ok();
        int used = 0;
        for (const auto& [id, h] : holds) {
            if (h.requester == requester && !h.claimed) used += static_cast<int>(h.blocks.size());
        }
        if (used + more <= cap) return Status::Ok();
        return ResourceExhaustedError(fmt::format(
            "kv: client {} already has {} KV blocks held unclaimed for remote decoders (at most "
            "{}); this prompt needs {} more: retry once they are claimed or their lease lapses",
            Esc(requester), used, cap, more));
    }

    // Whether every peer is the deployment's (then what it confirms may be cached).
    bool DeploymentPeers() const {
        return cfg.authenticated || cfg.by_store || !cfg.allowed_agents.empty();
    }

    bool Allowed(const std::string& address) const {
        return std::find(cfg.allowed_agents.begin(), cfg.allowed_agents.end(), address) !=
               cfg.allowed_agents.end();
    }

    // Where to dial the prefill worker params name: "host:port", or "" for by name through the
    // store. PermissionDenied for an agent this worker may not dial.
    Result<std::string> DialAddress(const KvTransferParams& kp) const {
        const std::string address =
            kp.remote_host.empty() ? "" : fmt::format("{}:{}", kp.remote_host, kp.remote_port);
        if (!cfg.allowed_agents.empty()) {
            if (!Allowed(address)) {
                return PermissionDeniedError(fmt::format(
                    "kv_transfer_params: the agent at '{}' is not one this worker may dial "
                    "(--kv-peers)",
                    Esc(address)));
            }
            return address;
        }
        if (cfg.by_store) return std::string();
        return address;
    }

    msg::Compat Compat() const {
        const KvCacheSpec& s = layouts[0].spec;
        msg::Compat c;
        c.model = cfg.model_fingerprint;
        c.layers = s.num_layers;
        c.kv_heads = cfg.model_kv_heads;
        c.head_dim = s.head_dim;
        c.dtype = DtypeName(s);
        c.block_tokens = s.block_tokens;
        c.tp = tp;
        return c;
    }
    msg::Hello Hello(bool ack) const {
        msg::Hello h;
        h.ack = ack;
        h.compat = Compat();
        for (int r = 0; r < tp; ++r) h.ranks.push_back({regions[r], layouts[r].spec.num_blocks});
        h.addr = agent->ListenAddress();
        return h;
    }

    // Checks a peer's compat against ours; the error names the field and both values.
    Status CheckCompat(const std::string& peer, const msg::Compat& theirs) const {
        auto d = msg::FirstDifference(Compat(), theirs);
        if (!d) return Status::Ok();
        std::string what = d->field == "model" ? "model (weights fingerprint)" : d->field;
        return FailedPreconditionError(
            fmt::format("kv handshake with '{}': {} differs (this worker {}, '{}' {})", Esc(peer),
                        what, Esc(d->ours), Esc(peer), Esc(d->theirs)));
    }

    // The peer's ranks from its hello or ack.
    Result<std::vector<PeerRank>> ParseRanks(const std::vector<msg::RankInfo>& ranks) const {
        if (static_cast<int>(ranks.size()) != tp) {
            return InvalidArgumentError(fmt::format("field 'ranks' must list {} ranks", tp));
        }
        std::vector<PeerRank> out;
        for (int r = 0; r < tp; ++r) {
            PeerRank pr;
            pr.region = ranks[r].region;
            pr.layout = layouts[r];
            pr.layout.spec.num_blocks = ranks[r].blocks;
            out.push_back(pr);
        }
        return out;
    }

    // Transfers wake the pump when they finish: it sleeps otherwise.
    void WakeOnDone(Transfer& x) {
        x.OnDone([w = waker] { w->Kick(); });
    }

    void Emit(ConnectorEvent ev) {
        events.push_back(std::move(ev));
        if (wake) wake();
    }

    Status Send(const std::string& peer, const msg::PeerMessage& m) {
        Status s = agent->Notify(peer, msg::Encode(m));
        if (!s.ok()) {
            FERRY_LOG(kWarn, "kv: message to '{}' not sent: {}", Esc(peer), s.ToString());
        }
        return s;
    }

    Status SendPushFailed(const std::string& peer, const std::string& xid, const std::string& lid,
                          std::string error) {
        return Send(peer, msg::PushEnd{msg::PushEnd::Kind::kFailed, xid, lid, std::nullopt,
                                       std::move(error)});
    }

    void CountFailure(const Status& s, const std::string& reason = "") {
        ++stats.failed;
        ++stats.failures[reason.empty() ? std::string(CodeName(s.code())) : reason];
    }

    void RecordTime(SteadyClock::time_point started) {
        double sec = std::chrono::duration<double>(SteadyClock::now() - started).count();
        ++stats.transfer_seconds_count;
        stats.transfer_seconds_sum += sec;
        size_t i = 0;
        while (i < std::size(kTransferSecondsBuckets) && sec > kTransferSecondsBuckets[i]) ++i;
        for (size_t k = i; k < stats.transfer_seconds_buckets.size(); ++k) {
            ++stats.transfer_seconds_buckets[k];
        }
    }

    void CountPosted(size_t descriptors) {
        ++stats.transfers;
        stats.descriptors += descriptors;
        stats.max_descriptors = std::max<uint64_t>(stats.max_descriptors, descriptors);
    }

    // Builds descriptor lists for moving `move` of every rank (local rank r <-> peer rank r).
    Status PlanAllRanks(const Peer& p, const KvMove& move, std::vector<Descriptor>* local,
                        std::vector<Descriptor>* remote, uint64_t* bytes) const {
        for (int r = 0; r < tp; ++r) {
            FERRY_ASSIGN_OR_RETURN(KvPlan plan, PlanKvMove(layouts[r], p.ranks[r].layout, move));
            for (size_t i = 0; i < plan.local.size(); ++i) {
                const KvSpan& l = plan.local[i];
                const KvSpan& m = plan.remote[i];
                local->push_back({regions[r], l.offset, l.length, l.stride, l.count});
                remote->push_back({p.ranks[r].region, m.offset, m.length, m.stride, m.count});
            }
            *bytes += plan.bytes;
        }
        return Status::Ok();
    }

    // --- receiving side --------------------------------------------------------------------

    // A load whose peer was cached from an earlier request and is gone now (it restarted): a
    // fresh handshake (re-resolved through the params or the store), then the load once more.
    bool RetryLoad(const std::string& id, const Status& st, const std::string& reason) {
        auto it = loads.find(id);
        if (it == loads.end()) return false;
        Load& ld = it->second;
        if (!ld.cached_peer || ld.retried || st.code() != Code::kUnavailable ||
            (reason != "" && reason != "peer_failed") || ld.state == Load::State::kCancelling) {
            return false;
        }
        if (ld.xfer.valid()) (void)ld.xfer.Cancel();
        ld.xfer = Transfer();
        ld.retried = true;
        ld.cached_peer = false;
        ld.read_done = ld.claim_acked = false;
        ld.acked_first.reset();
        ld.bytes = 0;
        ld.state = Load::State::kBootstrapping;
        ld.started = SteadyClock::now();
        ld.deadline = ld.started + cfg.handshake_timeout + cfg.transfer_timeout;
        auto p = peers.find(ld.peer);
        if (p != peers.end() && p->second.state == Peer::State::kReady) peers.erase(p);
        FERRY_LOG(kInfo, "kv: request {}: peer '{}' is gone ({}); handshake again and retry",
                  Esc(id), Esc(ld.peer), st.ToString());
        EnsurePeer(id, ld.params);
        return true;
    }

    // A load ends badly; its blocks are free for the engine once this emits kFailed.
    void FailLoad(const std::string& id, Status st, const std::string& reason = "") {
        auto it = loads.find(id);
        if (it == loads.end()) return;
        Load& ld = it->second;
        // Already stopping: it ends when the sender confirms (or is gone, or out of time).
        if (ld.state == Load::State::kCancelling) return;
        if (RetryLoad(id, st, reason)) return;
        if (ld.xfer.valid()) (void)ld.xfer.Cancel();  // no byte lands in our blocks after this
        auto pit = peers.find(ld.peer);
        const bool peer_ready = pit != peers.end() && pit->second.state == Peer::State::kReady;
        if (peer_ready && ld.params.mode == KvTransferMode::kPull && reason != "claim_refused") {
            (void)Send(ld.peer, msg::HoldEnd{msg::HoldEnd::Kind::kRelease,
                                             ld.params.remote_request_id, ld.params.hold_nonce});
        }
        if (peer_ready && ld.params.mode == KvTransferMode::kPush &&
            ld.state != Load::State::kBootstrapping && ld.state != Load::State::kCancelling &&
            reason != "peer_failed") {
            // The prefill worker may still be writing into our blocks: ask it to stop, and
            // release them once it says it has (or is gone, or cannot be writing any more).
            (void)Send(ld.peer, msg::PushCancel{ld.params.transfer_id, id});
            ld.state = Load::State::kCancelling;
            ld.deadline = SteadyClock::now() + cfg.transfer_timeout + std::chrono::seconds(1);
            FERRY_LOG(kInfo, "kv: request {} cancelling: {}", Esc(id), st.ToString());
            CountFailure(st, reason);
            return;
        }
        CountFailure(st, reason);
        FERRY_LOG(kInfo, "kv: request {} failed: {}", Esc(id), st.ToString());
        Emit({ConnectorEvent::Kind::kFailed, id, std::move(st), std::nullopt});
        loads.erase(it);
    }

    // pull: continue from the first token only if the params said the prefill sampled one
    // (else the decoder computes the last prompt token itself), and then the holder's own.
    static std::optional<FirstToken> FirstOf(const Load& ld) {
        if (!ld.params.first_token) return std::nullopt;
        return ld.acked_first;
    }

    void CompleteLoad(const std::string& id, std::optional<FirstToken> first) {
        auto it = loads.find(id);
        if (it == loads.end()) return;
        Load& ld = it->second;
        if (ld.params.mode == KvTransferMode::kPull) {
            (void)Send(ld.peer, msg::HoldEnd{msg::HoldEnd::Kind::kReadDone,
                                             ld.params.remote_request_id, ld.params.hold_nonce});
            stats.bytes_read += ld.bytes;
        }
        ++stats.succeeded;
        RecordTime(ld.started);
        // The sender confirmed the prompt (the hold's digest and blocks, or the prefill's);
        // cached only if the sender is one of the deployment's agents.
        const bool cacheable = DeploymentPeers();
        FERRY_LOG(kInfo, "kv: request {} loaded {} tokens from '{}'{}", Esc(id), ld.num_external,
                  Esc(ld.peer), cacheable ? "" : " (not cached: the peer is not known)");
        ConnectorEvent ev{ConnectorEvent::Kind::kLoaded, id, Status::Ok(), std::move(first)};
        ev.cacheable = cacheable;
        Emit(std::move(ev));
        loads.erase(it);
    }

    // The peer is ready: start moving.
    void ProceedLoad(const std::string& id) {
        auto it = loads.find(id);
        if (it == loads.end()) return;
        Load& ld = it->second;
        Peer& p = peers[ld.peer];
        ld.started = SteadyClock::now();
        if (ld.params.mode == KvTransferMode::kPush) {
            ld.state = Load::State::kWaitingForInput;
            ld.deadline = ld.started + cfg.bootstrap_timeout + cfg.transfer_timeout;
            Status sent =
                Send(ld.peer, msg::PushTarget{ld.params.transfer_id, id, ld.blocks, ld.num_computed,
                                              ld.prompt_len, ld.prompt_digest});
            if (!sent.ok()) {
                FailLoad(id, UnavailableError(fmt::format(
                                 "kv: prefill worker '{}' is not reachable", Esc(ld.peer))));
                return;
            }
            FERRY_LOG(kInfo, "kv: request {} waiting for input from '{}' (transfer {})", Esc(id),
                      Esc(ld.peer), Esc(ld.params.transfer_id));
            return;
        }
        // pull: claim the hold, and read at once (the data counts only once the claim is acked).
        const int end = std::min<int>((ld.num_computed + ld.num_external + bt() - 1) / bt() * bt(),
                                      static_cast<int>(ld.params.remote_block_ids.size()) * bt());
        std::vector<Descriptor> local, remote;
        KvMove move{ld.blocks, ld.params.remote_block_ids, ld.num_computed, end};
        Status st = PlanAllRanks(p, move, &local, &remote, &ld.bytes);
        if (!st.ok()) {
            FailLoad(id, st.WithContext("kv_transfer_params"));
            return;
        }
        // The claim names exactly the blocks the read touches (all the params named): the
        // prefill worker refuses it unless they are its hold's, for this prompt.
        Status sent = Send(ld.peer, msg::Claim{ld.params.remote_request_id, ld.params.hold_nonce,
                                               id, ld.prompt_digest, ld.params.remote_block_ids});
        if (!sent.ok()) {
            FailLoad(id, UnavailableError(fmt::format("kv: prefill worker '{}' is not reachable",
                                                      Esc(ld.peer))));
            return;
        }
        ld.state = Load::State::kTransferring;
        ld.deadline = ld.started + cfg.transfer_timeout;
        Result<Transfer> x = agent->PostRead(
            local, ld.peer, remote, {.timeout = cfg.transfer_timeout, .backend = cfg.backend});
        CountPosted(local.size());
        if (!x.ok()) {
            FailLoad(id, x.status().WithContext(
                             fmt::format("kv read from prefill worker '{}'", Esc(ld.peer))));
            return;
        }
        ld.xfer = std::move(*x);
        WakeOnDone(ld.xfer);
        FERRY_LOG(kInfo, "kv: request {} transferring {} bytes from '{}' in {} descriptors",
                  Esc(id), ld.bytes, Esc(ld.peer), local.size());
    }

    void PeerReady(const std::string& name, std::vector<PeerRank> ranks,
                   const std::string& address) {
        Peer& p = peers[name];
        p.state = Peer::State::kReady;
        p.address = address;
        p.ranks = std::move(ranks);
        p.probe_slot = next_probe_slot++ % kProbeSlots;
        ++stats.handshakes;
        FERRY_LOG(kInfo, "kv: handshake with '{}' done", Esc(name));
        std::vector<std::string> waiting = std::move(p.waiting);
        for (const std::string& id : waiting) ProceedLoad(id);
    }

    void PeerFailed(const std::string& name, const Status& st) {
        auto it = peers.find(name);
        if (it == peers.end()) return;
        std::vector<std::string> waiting = std::move(it->second.waiting);
        peers.erase(it);  // the next request tries again
        FERRY_LOG(kWarn, "kv: peer '{}': {}", Esc(name), st.ToString());
        for (const std::string& id : waiting) FailLoad(id, st, "handshake");
    }

    // A peer that stopped answering: everything waiting on it fails now.
    void PeerGone(const std::string& name, const Status& st) {
        std::vector<std::string> ids;
        for (auto& [id, ld] : loads) {
            if (ld.peer == name) ids.push_back(id);
        }
        // First: a load retried below handshakes afresh.
        peers.erase(name);
        for (const std::string& id : ids) {
            auto it = loads.find(id);
            if (it != loads.end() && it->second.state == Load::State::kCancelling) {
                Emit({ConnectorEvent::Kind::kFailed, id, CancelledError("kv transfer cancelled"),
                      std::nullopt});
                loads.erase(it);
                continue;
            }
            FailLoad(id, st, "peer_failed");
        }
    }

    void EnsurePeer(const std::string& id, const KvTransferParams& kp) {
        const std::string& name = kp.remote_engine_id;
        Result<std::string> address = DialAddress(kp);
        if (!address.ok()) {
            FailLoad(id, address.status());
            return;
        }
        auto it = peers.find(name);
        if (it != peers.end() && it->second.state == Peer::State::kReady) {
            if (!address->empty() && !it->second.address.empty() &&
                it->second.address != *address) {
                // The params name another address for this agent: it restarted elsewhere.
                FERRY_LOG(kInfo, "kv: '{}' moved from {} to {}: handshake again", Esc(name),
                          Esc(it->second.address), Esc(*address));
                peers.erase(it);
                it = peers.end();
            } else {
                auto ld = loads.find(id);
                if (ld != loads.end()) ld->second.cached_peer = true;
                ProceedLoad(id);
                return;
            }
        }
        if (it == peers.end()) {
            Peer& p = peers[name];
            p.deadline = SteadyClock::now() + cfg.handshake_timeout;
            p.waiting.push_back(id);
            p.address = *address;
            connect_jobs.push_back({false, name, *address, {}});
            connect_cv.notify_one();
            return;
        }
        it->second.waiting.push_back(id);
    }

    // --- sending side, push ----------------------------------------------------------------

    // Binds a decoder's block list to a prefill request. Returns false if they do not belong
    // together (the request then fails).
    bool BindTarget(const std::string& id, Push& ps, Target t) {
        if (t.prompt_digest != ps.prompt_digest || t.len != ps.prompt_len) {
            Status st = FailedPreconditionError(fmt::format(
                "kv push {}: the decoder's prompt ({} tokens) is not this prefill's ({} tokens)",
                Esc(ps.xid), t.len, ps.prompt_len));
            (void)SendPushFailed(t.peer, ps.xid, t.lid, st.message());
            ps.error = st;
            return false;
        }
        const int need = (ps.prompt_len + bt() - 1) / bt();
        if (static_cast<int>(t.blocks.size()) < need || t.from < 0 || t.from % bt() != 0 ||
            t.from >= ps.prompt_len) {
            Status st = InvalidArgumentError(
                fmt::format("kv push {}: the decoder sent {} blocks from token {} for {} tokens",
                            Esc(ps.xid), t.blocks.size(), t.from, ps.prompt_len));
            (void)SendPushFailed(t.peer, ps.xid, t.lid, st.message());
            ps.error = st;
            return false;
        }
        ps.state = Push::State::kReady;
        ps.peer = t.peer;
        ps.lid = t.lid;
        ps.target = std::move(t.blocks);
        ps.next_send = t.from;
        FERRY_LOG(kInfo, "kv: request {} has its target: '{}' from token {} (transfer {})", Esc(id),
                  Esc(ps.peer), ps.next_send, Esc(ps.xid));
        return true;
    }

    // A finished push: tell the decoder, free the blocks.
    void EndPush(const std::string& id, bool ok, const Status& err) {
        auto it = pushes.find(id);
        if (it == pushes.end()) return;
        Push& ps = it->second;
        for (Transfer& x : ps.transfers) (void)x.Cancel();
        if (ok) {
            (void)Send(ps.peer,
                       msg::PushEnd{msg::PushEnd::Kind::kDone, ps.xid, ps.lid, ps.first, ""});
            ++stats.succeeded;
            stats.bytes_written += ps.bytes;
            if (ps.timing) {
                RecordTime(ps.started);
                stats.transfer_exposed_seconds_sum +=
                    std::chrono::duration<double>(SteadyClock::now() - ps.computed).count();
                ++stats.transfer_exposed_count;
            }
            FERRY_LOG(kInfo, "kv: request {} pushed {} bytes to '{}'", Esc(id), ps.bytes,
                      Esc(ps.peer));
        } else {
            if (!ps.peer.empty()) {
                (void)SendPushFailed(ps.peer, ps.xid, ps.lid, err.message());
            }
            CountFailure(err);
            FERRY_LOG(kInfo, "kv: request {} push failed: {}", Esc(id), err.ToString());
        }
        push_by_xid.erase(ps.xid);
        pushes.erase(it);
    }

    // --- messages --------------------------------------------------------------------------

    void OnMessage(const std::string& from, const std::string& payload) {
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
        Status st = bound ? std::visit([&](auto& x) { return On(from, x); }, *m)
                          : FailedPreconditionError("not bound");
        if (!st.ok()) {
            FERRY_LOG(kWarn, "kv: '{}' message from '{}' refused: {}", Esc(type), Esc(from),
                      st.ToString());
        }
    }

    // Each message's handler (mu held).
    Status On(const std::string& from, msg::Hello& m) {
        if (m.ack) return OnHelloAck(from, m);
        // Answering needs a connection back: to an agent this worker may dial only.
        if (!cfg.allowed_agents.empty() && !Allowed(m.addr)) {
            return PermissionDeniedError(fmt::format(
                "hello from an agent at '{}', which this worker may not dial (--kv-peers)",
                Esc(m.addr)));
        }
        std::string addr = cfg.by_store ? "" : m.addr;  // by name through the store, if so
        connect_jobs.push_back({true, from, std::move(addr), std::move(m)});
        connect_cv.notify_one();
        return Status::Ok();
    }

    Status OnHelloAck(const std::string& from, const msg::Hello& m) {
        auto it = peers.find(from);
        if (it == peers.end() || it->second.state != Peer::State::kConnecting) {
            return FailedPreconditionError("no handshake in progress");
        }
        // Our own view of a mismatch first (it names this worker and the peer the right way
        // round), then the peer's reason.
        Status c = CheckCompat(from, m.compat);
        if (!c.ok()) {
            PeerFailed(from, c);
            return Status::Ok();
        }
        if (!m.ok) {
            PeerFailed(from,
                       FailedPreconditionError(m.error.empty() ? "kv handshake refused by the peer"
                                                               : Esc(m.error)));
            return Status::Ok();
        }
        auto ranks = ParseRanks(m.ranks);
        if (!ranks.ok()) {
            PeerFailed(from, ranks.status().WithContext("kv handshake"));
            return Status::Ok();
        }
        PeerReady(from, std::move(*ranks), it->second.address);
        return Status::Ok();
    }

    // pull, holder: a hold that exists under this nonce and is not another decoder's.
    Hold* FindHold(const std::string& from, const std::string& rid, const std::string& nonce,
                   bool* exists) {
        auto it = holds.find(rid);
        *exists = it != holds.end() && SecretEqual(it->second.nonce, nonce);
        if (!*exists) return nullptr;
        Hold& h = it->second;
        return !h.claimed || h.claimer == from ? &h : nullptr;
    }

    Status On(const std::string& from, msg::Claim& m) {
        bool exists = false;
        Hold* h = FindHold(from, m.rid, m.nonce, &exists);
        // A claim reads exactly the hold's blocks, for the hold's prompt, by the first agent
        // that claimed it: anything else would read another request's KV.
        msg::ClaimAck ack;
        ack.lid = m.lid;
        std::string error, code = "conflict";
        if (!exists) {
            code = "gone";
            error = fmt::format(
                "no KV is held for request '{}' (its lease expired, or it was released)",
                Esc(m.rid));
        } else if (!h) {
            error = fmt::format("the KV of request '{}' is claimed by another decoder", Esc(m.rid));
        } else if (h->prompt_digest != m.prompt) {
            error = fmt::format("request '{}' held KV for another prompt", Esc(m.rid));
        } else if (m.blocks != h->blocks) {
            error = fmt::format("the claim names blocks that are not those request '{}' holds",
                                Esc(m.rid));
        } else {
            h->claimed = true;
            h->claimer = from;
            h->deadline = SteadyClock::now() + cfg.transfer_timeout + std::chrono::seconds(1);
            ack.ok = true;
            ack.first = h->first;
        }
        if (!ack.ok) {
            ack.error = error;
            ack.code = code;
            FERRY_LOG(kWarn, "kv: claim of '{}' by '{}' refused: {}", Esc(m.rid), Esc(from), error);
        }
        (void)Send(from, ack);
        return Status::Ok();
    }

    Status On(const std::string& from, msg::HoldEnd& m) {
        bool exists = false;
        if (!FindHold(from, m.rid, m.nonce, &exists)) {
            return NotFoundError(fmt::format("no hold '{}'", Esc(m.rid)));
        }
        const bool read = m.kind == msg::HoldEnd::Kind::kReadDone;
        if (read) {
            ++stats.succeeded;
        } else {
            CountFailure(CancelledError(""), "released");
        }
        holds.erase(m.rid);
        FERRY_LOG(kInfo, "kv: request {} released by '{}' ({})", Esc(m.rid), Esc(from),
                  read ? "read-done" : "release");
        Emit({ConnectorEvent::Kind::kReleased, m.rid, Status::Ok(), std::nullopt});
        return Status::Ok();
    }

    Status On(const std::string& from, msg::ClaimAck& m) {
        auto it = loads.find(m.lid);
        if (it == loads.end() || it->second.peer != from ||
            it->second.params.mode != KvTransferMode::kPull) {
            return NotFoundError(fmt::format("no load '{}' from this peer", Esc(m.lid)));
        }
        if (!m.ok) {
            std::string text =
                fmt::format("prefill worker '{}': {}", Esc(from),
                            m.error.empty() ? std::string("claim refused") : Esc(m.error));
            // A hold that is gone (its lease lapsed) can be had again by retrying the request
            // (503); a claim that does not match its hold is the params' fault (409).
            FailLoad(m.lid,
                     m.code == "gone" ? UnavailableError(std::move(text))
                                      : FailedPreconditionError(std::move(text)),
                     "claim_refused");
            return Status::Ok();
        }
        it->second.claim_acked = true;
        it->second.acked_first = std::move(m.first);
        if (it->second.read_done) CompleteLoad(m.lid, FirstOf(it->second));
        return Status::Ok();
    }

    Status On(const std::string& from, msg::PushTarget& m) {
        Target tg;
        tg.peer = from;
        tg.lid = m.lid;
        tg.blocks = std::move(m.blocks);
        tg.from = m.from;
        tg.len = m.len;
        tg.prompt_digest = m.prompt;
        auto pit = peers.find(from);
        if (pit == peers.end() || pit->second.state != Peer::State::kReady) {
            (void)SendPushFailed(from, m.xid, tg.lid, "no kv handshake with this prefill worker");
            return FailedPreconditionError("push-target before the handshake");
        }
        auto bx = push_by_xid.find(m.xid);
        if (bx == push_by_xid.end()) {
            // The prefill request has not arrived yet: keep the target for it.
            tg.deadline = SteadyClock::now() + cfg.bootstrap_timeout;
            if (targets.size() >= 65536) return ResourceExhaustedError("too many targets");
            targets[m.xid] = std::move(tg);
            return Status::Ok();
        }
        const std::string id = bx->second;
        Push& ps = pushes[id];
        if (ps.state != Push::State::kBootstrapping) {
            (void)SendPushFailed(from, m.xid, tg.lid, "transfer id already has a decoder");
            return AlreadyExistsError(fmt::format("transfer '{}' already bound", Esc(m.xid)));
        }
        if (BindTarget(id, ps, std::move(tg))) {
            Emit({ConnectorEvent::Kind::kReady, id, Status::Ok(), std::nullopt});
        } else {
            Status err = ps.error;
            push_by_xid.erase(ps.xid);
            pushes.erase(id);
            CountFailure(err);
            Emit({ConnectorEvent::Kind::kFailed, id, err, std::nullopt});
        }
        return Status::Ok();
    }

    Status On(const std::string& from, msg::PushCancel& m) {
        if (targets.erase(m.xid) && cancelled_xids.size() < 65536) {
            cancelled_xids[m.xid] = SteadyClock::now() + cfg.bootstrap_timeout;
        }
        auto bx = push_by_xid.find(m.xid);
        if (bx != push_by_xid.end()) {
            Push& ps = pushes[bx->second];
            if (ps.peer == from) {
                for (Transfer& x : ps.transfers) (void)x.Cancel();
                ps.cancelled = true;
                ps.error =
                    CancelledError(fmt::format("kv push {}: the decoder cancelled it", Esc(m.xid)));
            }
        }
        (void)Send(from,
                   msg::PushEnd{msg::PushEnd::Kind::kCancelled, m.xid, m.lid, std::nullopt, ""});
        return Status::Ok();
    }

    Status On(const std::string& from, msg::PushEnd& m) {
        auto it = loads.find(m.lid);
        if (it == loads.end() || it->second.peer != from ||
            it->second.params.mode != KvTransferMode::kPush) {
            return NotFoundError(fmt::format("no push load '{}' from this peer", Esc(m.lid)));
        }
        Load& ld = it->second;
        if (ld.state == Load::State::kCancelling) {
            Emit({ConnectorEvent::Kind::kFailed, m.lid, CancelledError("kv transfer cancelled"),
                  std::nullopt});
            loads.erase(it);
            return Status::Ok();
        }
        if (m.kind != msg::PushEnd::Kind::kDone) {
            CountFailure(UnavailableError(""), "remote_failed");
            Emit({ConnectorEvent::Kind::kFailed, m.lid,
                  UnavailableError(
                      fmt::format("prefill worker '{}' failed the transfer: {}", Esc(from),
                                  m.error.empty() ? std::string("no reason") : Esc(m.error))),
                  std::nullopt});
            loads.erase(it);
            return Status::Ok();
        }
        CompleteLoad(m.lid, std::move(m.first));
        return Status::Ok();
    }

    // --- threads ---------------------------------------------------------------------------

    void NotifyLoop() {
        for (;;) {
            {
                std::lock_guard lock(mu);
                if (stop) return;
            }
            auto batch =
                agent->WaitNotifications(SteadyClock::now() + std::chrono::milliseconds(100));
            for (Notification& n : batch) OnMessage(n.peer, n.payload);
        }
    }

    void ConnectLoop() {
        for (;;) {
            ConnectJob job;
            {
                std::unique_lock lock(mu);
                connect_cv.wait(lock, [&] { return stop || !connect_jobs.empty(); });
                if (stop) return;
                job = std::move(connect_jobs.front());
                connect_jobs.pop_front();
            }
            Result<std::string> name = job.address.empty()
                                           ? agent->ConnectByName(job.name)
                                           : agent->Connect(job.address, cfg.handshake_timeout);
            std::unique_lock lock(mu);
            if (!bound) continue;
            Status st = name.status();
            if (!st.ok()) {
                // The details go to the log only: what a stranger at that address answered is
                // never echoed to the client that named it.
                FERRY_LOG(kWarn, "kv: connect to '{}' at {}: {}", Esc(job.name),
                          job.address.empty() ? std::string("(the store)") : Esc(job.address),
                          Esc(st.ToString()));
                st = UnavailableError(
                    job.address.empty()
                        ? fmt::format("kv: agent '{}' could not be reached through the store",
                                      Esc(job.name))
                        : fmt::format("kv: no agent '{}' could be reached at {}", Esc(job.name),
                                      Esc(job.address)));
            } else if (*name != job.name) {
                st = InvalidArgumentError(
                    fmt::format("remote_engine_id is '{}' but the agent at {} is '{}'",
                                Esc(job.name), Esc(job.address), Esc(*name)));
            }
            if (!job.inbound) {
                if (!st.ok()) {
                    PeerFailed(job.name, st);
                    continue;
                }
                auto it = peers.find(job.name);
                if (it == peers.end()) continue;
                it->second.hello_sent = true;
                it->second.deadline = SteadyClock::now() + cfg.handshake_timeout;
                (void)Send(job.name, Hello(false));
                continue;
            }
            // A peer's hello: answer it once we can reach it.
            msg::Hello ack = Hello(true);
            std::vector<PeerRank> ranks;
            if (st.ok()) st = CheckCompat(job.name, job.hello.compat);
            if (st.ok()) {
                auto r = ParseRanks(job.hello.ranks);
                if (r.ok()) {
                    ranks = std::move(*r);
                } else {
                    st = r.status().WithContext("kv handshake");
                }
            }
            if (!st.ok()) {
                FERRY_LOG(kWarn, "kv: hello from '{}' refused: {}", Esc(job.name), st.ToString());
                if (name.ok() && *name == job.name) {
                    ack.ok = false;
                    ack.error = st.message();
                    (void)Send(job.name, ack);
                }
                continue;
            }
            ack.ok = true;
            auto it = peers.find(job.name);
            if (it == peers.end() || it->second.state != Peer::State::kConnecting ||
                !it->second.hello_sent) {
                // Not our own handshake in flight: the peer is ready for us now. (If ours is in
                // flight, its ack finishes it.)
                if (it == peers.end() || it->second.state != Peer::State::kConnecting) {
                    PeerReady(job.name, ranks, job.address);
                } else {
                    it->second.ranks = ranks;
                }
            }
            (void)Send(job.name, ack);
        }
    }

    void PumpLoop() {
        std::unique_lock lock(mu);
        while (!stop) {
            const auto now = SteadyClock::now();
            std::vector<std::pair<std::string, Status>> fail;
            // Receiving side: reads done or failed, deadlines.
            for (auto& [id, ld] : loads) {
                if (ld.xfer.valid() && !ld.read_done) {
                    auto s = ld.xfer.Poll();
                    if (!s.ok()) {
                        fail.emplace_back(id, s.status().WithContext(
                                                  fmt::format("kv read from '{}'", Esc(ld.peer))));
                        continue;
                    }
                    if (*s == TransferState::kDone) ld.read_done = true;
                }
                if (ld.deadline != SteadyClock::time_point{} && now > ld.deadline) {
                    fail.emplace_back(
                        id, DeadlineExceededError(fmt::format(
                                "kv transfer from '{}' did not finish in time", Esc(ld.peer))));
                }
            }
            for (auto& [id, st] : fail) {
                auto it = loads.find(id);
                if (it == loads.end()) continue;
                if (it->second.state == Load::State::kCancelling) {
                    Emit({ConnectorEvent::Kind::kFailed, id,
                          CancelledError("kv transfer cancelled"), std::nullopt});
                    loads.erase(it);
                    continue;
                }
                FailLoad(id, st);
            }
            std::vector<std::string> complete;
            for (auto& [id, ld] : loads) {
                if (ld.read_done && ld.claim_acked) complete.push_back(id);
            }
            for (const std::string& id : complete) CompleteLoad(id, FirstOf(loads[id]));
            // Handshakes that got no answer.
            std::vector<std::string> stale;
            for (auto& [name, p] : peers) {
                if (p.state == Peer::State::kConnecting && p.hello_sent && now > p.deadline) {
                    stale.push_back(name);
                }
            }
            for (const std::string& name : stale) {
                PeerFailed(name, DeadlineExceededError(fmt::format(
                                     "kv handshake with '{}' got no answer", Esc(name))));
            }
            // Liveness of peers that push decoders wait on.
            std::vector<std::pair<std::string, Status>> gone;
            for (auto& [name, p] : peers) {
                if (p.state != Peer::State::kReady) continue;
                bool waited_on = false;
                for (auto& [id, ld] : loads) {
                    // push: waiting for the writes; pull: waiting for the claim's answer (a
                    // one-sided shm read completes whether or not the peer lives).
                    if (ld.peer == name && ld.state != Load::State::kBootstrapping) {
                        waited_on = true;
                    }
                }
                if (p.probe.valid()) {
                    auto s = p.probe.Poll();
                    if (!s.ok()) {
                        gone.emplace_back(
                            name, UnavailableError(fmt::format("prefill worker '{}' is gone: {}",
                                                               Esc(name), s.status().ToString())));
                        continue;
                    }
                    if (*s == TransferState::kDone) p.probe = Transfer();
                    continue;
                }
                if (waited_on && now >= p.next_probe) {
                    Descriptor l{scratch.id, p.probe_slot * kProbeBytes, kProbeBytes};
                    Descriptor r{p.ranks[0].region, 0, kProbeBytes};
                    auto x = agent->PostRead({&l, 1}, name, {&r, 1},
                                             {.timeout = std::chrono::milliseconds(1500)});
                    if (x.ok()) {
                        p.probe = std::move(*x);
                        WakeOnDone(p.probe);
                    } else {
                        gone.emplace_back(
                            name, UnavailableError(fmt::format("prefill worker '{}' is gone: {}",
                                                               Esc(name), x.status().ToString())));
                    }
                    p.next_probe = now + cfg.liveness_interval;
                }
            }
            for (auto& [name, st] : gone) PeerGone(name, st);
            // Sending side: pushes finished or failed, deadlines.
            std::vector<std::tuple<std::string, bool, Status>> ended;
            for (auto& [id, ps] : pushes) {
                if (ps.state == Push::State::kBootstrapping) {
                    if (now > ps.deadline) {
                        ended.emplace_back(
                            id, false,
                            DeadlineExceededError(fmt::format(
                                "kv push {}: no decoder sent its blocks", Esc(ps.xid))));
                    }
                    continue;
                }
                if (ps.state != Push::State::kFinishing) continue;
                bool pending = false;
                Status err = ps.error;
                for (Transfer& x : ps.transfers) {
                    auto s = x.Poll();
                    if (!s.ok()) {
                        if (err.ok()) err = s.status();
                    } else if (*s == TransferState::kPending) {
                        pending = true;
                    }
                }
                if (!err.ok()) {
                    ended.emplace_back(id, false, err);
                } else if (!pending) {
                    ended.emplace_back(id, true, Status::Ok());
                } else if (now > ps.deadline) {
                    ended.emplace_back(id, false,
                                       DeadlineExceededError(fmt::format(
                                           "kv push {} did not finish in time", Esc(ps.xid))));
                }
            }
            for (auto& [id, ok, st] : ended) {
                const bool was_bootstrapping =
                    pushes.count(id) && pushes[id].state == Push::State::kBootstrapping;
                EndPush(id, ok, st);
                Emit({was_bootstrapping ? ConnectorEvent::Kind::kFailed
                                        : ConnectorEvent::Kind::kReleased,
                      id, st, std::nullopt});
            }
            // Holds whose lease lapsed; targets nobody came for.
            std::vector<std::string> lapsed;
            for (auto& [rid, h] : holds) {
                if (now > h.deadline) lapsed.push_back(rid);
            }
            for (const std::string& rid : lapsed) {
                holds.erase(rid);
                CountFailure(DeadlineExceededError(""), "lease_expired");
                FERRY_LOG(kInfo, "kv: request {}: hold lease expired, blocks freed", Esc(rid));
                Emit({ConnectorEvent::Kind::kReleased, rid, Status::Ok(), std::nullopt});
            }
            for (auto it = targets.begin(); it != targets.end();) {
                it = now > it->second.deadline ? targets.erase(it) : std::next(it);
            }
            for (auto it = cancelled_xids.begin(); it != cancelled_xids.end();) {
                it = now > it->second ? cancelled_xids.erase(it) : std::next(it);
            }
            // Sleep until a transfer finishes or there is new work (Waker); the timers above
            // (deadlines, leases, liveness probes) are coarse: a tick of 20 ms serves them.
            lock.unlock();
            (void)waker->sem.try_acquire_for(std::chrono::milliseconds(20));
            while (waker->sem.try_acquire()) {
            }
            lock.lock();
        }
    }

    // --- LayerHook (rank threads) ----------------------------------------------------------

    void OnLayerStored(int rank, int layer) override {
        for (PlannedWrite& w : step_writes[rank][layer]) {
            Result<Transfer> x =
                agent->PostWrite(w.local, w.peer, w.remote,
                                 {.timeout = cfg.transfer_timeout, .backend = cfg.backend});
            step_posted[rank].push_back({w.id, std::move(x), w.bytes, w.local.size()});
        }
    }
};

// --- AgentKvConnector ------------------------------------------------------------------------

AgentKvConnector::AgentKvConnector(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::shared_ptr<AgentKvConnector>> AgentKvConnector::Create(std::shared_ptr<Agent> agent,
                                                                   AgentConnectorConfig config) {
    if (!agent) return InvalidArgumentError("kv connector: no agent");
    if (config.model_fingerprint.empty() || config.model_kv_heads <= 0) {
        return InvalidArgumentError("kv connector: the model fingerprint and kv heads are needed");
    }
    auto impl = std::make_unique<Impl>();
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

KvConnectorStats AgentKvConnector::Stats() const {
    Impl& m = *impl_;
    std::lock_guard lock(m.mu);
    KvConnectorStats s = m.stats;
    for (auto& [id, ld] : m.loads) {
        switch (ld.state) {
            case Load::State::kBootstrapping:
                ++s.bootstrapping;
                break;
            case Load::State::kWaitingForInput:
                ++s.waiting_for_input;
                break;
            case Load::State::kTransferring:
            case Load::State::kCancelling:
                ++s.transferring;
                break;
        }
    }
    for (auto& [id, ps] : m.pushes) {
        (ps.state == Push::State::kBootstrapping ? s.bootstrapping : s.transferring)++;
    }
    s.holding = static_cast<int>(m.holds.size());
    return s;
}

Status AgentKvConnector::Bind(std::span<KvCache* const> caches, std::function<void()> wake) {
    Impl& m = *impl_;
    if (caches.empty()) return InvalidArgumentError("kv connector: no caches");
    if (m.bound) return FailedPreconditionError("kv connector: already bound");
    const int tp = static_cast<int>(caches.size());
    if (m.cfg.model_kv_heads % tp != 0 || caches[0]->spec().kv_heads * tp != m.cfg.model_kv_heads) {
        return InvalidArgumentError(
            fmt::format("kv connector: {} caches of {} kv heads for a model with {}", tp,
                        caches[0]->spec().kv_heads, m.cfg.model_kv_heads));
    }
    std::vector<RegionInfo> existing = m.agent->Regions();
    for (int r = 0; r < tp; ++r) {
        KvCache* c = caches[r];
        KvLayout l;
        l.spec = c->spec();
        l.head_begin = r * l.spec.kv_heads;
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
    m.tp = tp;
    m.wake = std::move(wake);
    m.step_writes.assign(tp, std::vector<std::vector<PlannedWrite>>(m.layouts[0].spec.num_layers));
    m.step_posted.clear();
    m.step_posted.resize(tp);
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
    for (auto& [id, ps] : m.pushes) {
        for (Transfer& x : ps.transfers) (void)x.Cancel();
    }
    for (auto& [name, p] : m.peers) {
        if (p.probe.valid()) (void)p.probe.Cancel();
    }
    m.loads.clear();
    m.pushes.clear();
    m.push_by_xid.clear();
    m.holds.clear();
    m.peers.clear();
    m.connect_jobs.clear();
    for (RegionId id : m.registered) (void)m.agent->Deregister(id);
    m.registered.clear();
    if (m.scratch.id) (void)m.agent->Deregister(m.scratch.id);
    m.scratch = {};
    m.wake = nullptr;
}

bool AgentKvConnector::ReadyToSchedule(const ConnectorRequest& r) {
    Impl& m = *impl_;
    const KvTransferParams& p = r.params;
    if (!p.do_remote_decode || p.mode != KvTransferMode::kPush) return true;
    std::lock_guard lock(m.mu);
    if (!m.bound) return true;
    auto it = m.pushes.find(r.id);
    if (it != m.pushes.end()) return it->second.state != Push::State::kBootstrapping;
    Push& ps = m.pushes[r.id];
    ps.xid = p.transfer_id;
    ps.prompt_digest = PromptDigest(r.prompt);
    ps.prompt_len = static_cast<int>(r.prompt.size());
    ps.deadline = SteadyClock::now() + m.cfg.bootstrap_timeout;
    auto fail = [&](Status st) {
        m.pushes.erase(r.id);
        m.CountFailure(st);
        m.Emit({ConnectorEvent::Kind::kFailed, r.id, std::move(st), std::nullopt});
        return false;
    };
    if (p.transfer_id.empty()) {
        return fail(InvalidArgumentError("kv_transfer_params: push needs a transfer_id"));
    }
    if (m.push_by_xid.count(p.transfer_id)) {
        return fail(AlreadyExistsError(
            fmt::format("kv_transfer_params: transfer_id '{}' is in use by another request",
                        Esc(p.transfer_id))));
    }
    if (m.cancelled_xids.erase(p.transfer_id)) {
        return fail(CancelledError(fmt::format(
            "kv push {}: the decoder cancelled it before this request came", Esc(p.transfer_id))));
    }
    m.push_by_xid[p.transfer_id] = r.id;
    auto t = m.targets.find(p.transfer_id);
    if (t == m.targets.end()) {
        FERRY_LOG(kInfo, "kv: request {} bootstrapping (transfer {})", Esc(r.id),
                  Esc(p.transfer_id));
        return false;
    }
    Target tg = std::move(t->second);
    m.targets.erase(t);
    if (!m.BindTarget(r.id, ps, std::move(tg))) {
        Status err = ps.error;
        m.push_by_xid.erase(p.transfer_id);
        return fail(err);
    }
    return true;
}

int AgentKvConnector::ExternalTokens(const ConnectorRequest& r, int num_computed) {
    const KvTransferParams& p = r.params;
    if (!p.do_remote_prefill) return 0;
    const int len = static_cast<int>(r.prompt.size());
    if (p.mode == KvTransferMode::kPush) return len - num_computed;
    // pull: what the held blocks cover; without the first token the last prompt token is
    // computed here, for its logits.
    Impl& m = *impl_;
    const int bt = m.layouts.empty() ? 1 : m.bt();
    int covered = std::min<int>(len, static_cast<int>(p.remote_block_ids.size()) * bt);
    if (!p.first_token || covered < len) covered = std::min(covered, len - 1);
    return std::max(0, covered - num_computed);
}

void AgentKvConnector::StartLoad(const ConnectorRequest& r, std::span<const BlockId> blocks,
                                 int num_computed, int num_external) {
    Impl& m = *impl_;
    std::lock_guard lock(m.mu);
    Load& ld = m.loads[r.id];
    ld.params = r.params;
    ld.peer = r.params.remote_engine_id;
    ld.blocks.assign(blocks.begin(), blocks.end());
    ld.num_computed = num_computed;
    ld.num_external = num_external;
    ld.prompt_len = static_cast<int>(r.prompt.size());
    ld.prompt_digest = PromptDigest(r.prompt);
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
    if (r.params.mode == KvTransferMode::kPush && r.params.transfer_id.empty()) {
        m.FailLoad(r.id, InvalidArgumentError("kv_transfer_params: push needs a transfer_id"));
        return;
    }
    FERRY_LOG(kInfo, "kv: request {} bootstrapping with '{}' ({} tokens to load)", Esc(r.id),
              Esc(ld.peer), num_external);
    m.EnsurePeer(r.id, r.params);
}

FinishAction AgentKvConnector::RequestFinished(const ConnectorRequest& r,
                                               std::span<const BlockId> blocks, bool ok,
                                               const FirstToken* first) {
    Impl& m = *impl_;
    const KvTransferParams& p = r.params;
    FinishAction a;
    if (!p.do_remote_decode) return a;
    std::lock_guard lock(m.mu);
    if (!m.bound) return a;
    if (p.mode == KvTransferMode::kPush) {
        auto it = m.pushes.find(r.id);
        if (it == m.pushes.end()) return a;
        Push& ps = it->second;
        if (!ok || !first || ps.state != Push::State::kReady || ps.cancelled) {
            Status err = !ps.error.ok() ? ps.error : CancelledError("the prefill request ended");
            m.EndPush(r.id, false, err);  // cancels its writes first: nothing reads the blocks
            return a;
        }
        ps.first = *first;
        ps.state = Push::State::kFinishing;
        ps.computed = SteadyClock::now();
        ps.deadline = (ps.timing ? ps.started : SteadyClock::now()) + m.cfg.transfer_timeout;
        a.hold_blocks = true;
        m.waker->Kick();
        return a;
    }
    if (!ok || !first) return a;
    // pull: hold the blocks for the reader and say where they are.
    const int bt = m.bt();
    const size_t nblocks = std::min(blocks.size(), (r.prompt.size() + bt - 1) / bt);
    if (!p.requester.empty() && p.requester != kRouterRequester) {
        a.refused = m.HoldShareLeft(p.requester, static_cast<int>(nblocks));
        if (!a.refused.ok()) {
            m.CountFailure(a.refused, "client_cap");
            return a;
        }
    }
    Hold& h = m.holds[r.id];
    h.nonce = RandomId128();
    h.prompt_digest = PromptDigest(r.prompt);
    h.blocks.assign(blocks.begin(), blocks.begin() + nblocks);
    h.requester = p.requester;
    h.first = *first;
    h.deadline = SteadyClock::now() + m.cfg.hold_lease;
    auto out = std::make_shared<KvTransferParams>();
    out->mode = KvTransferMode::kPull;
    out->do_remote_prefill = true;
    out->do_remote_decode = false;
    out->remote_engine_id = m.agent->name();
    std::string addr = m.agent->ListenAddress();
    size_t colon = addr.rfind(':');
    out->remote_host = addr.substr(0, colon);
    out->remote_port = std::atoi(addr.c_str() + colon + 1);
    out->remote_block_ids.assign(blocks.begin(), blocks.begin() + nblocks);
    out->remote_request_id = r.id;
    out->tp_size = m.tp;
    out->first_token = *first;
    out->hold_nonce = h.nonce;
    a.hold_blocks = true;
    a.params = std::move(out);
    FERRY_LOG(kInfo, "kv: request {} holding {} blocks for a reader", Esc(r.id), nblocks);
    return a;
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
    const KvTransferParams& p = r.params;
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
            // Early, before any compute: the client's unclaimed holds already fill its share
            // (RequestFinished checks again when the hold would be made).
            Status st = m.HoldShareLeft(p.requester, blocks);
            if (!st.ok()) return st;
        }
    } else {
        a.load = true;
        a.peer = p.remote_engine_id;
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

LayerHook* AgentKvConnector::BeginStep(std::span<const StepChunk> chunks) {
    Impl& m = *impl_;
    std::lock_guard lock(m.mu);
    if (!m.bound) return nullptr;
    bool any = false;
    for (const StepChunk& c : chunks) {
        if (!c.params->do_remote_decode || c.params->mode != KvTransferMode::kPush) continue;
        auto it = m.pushes.find(*c.id);
        if (it == m.pushes.end()) continue;
        Push& ps = it->second;
        if (ps.state != Push::State::kReady || ps.cancelled || !ps.error.ok()) continue;
        const int end = c.start_pos + c.num_tokens;
        if (end <= ps.next_send) continue;
        auto pit = m.peers.find(ps.peer);
        if (pit == m.peers.end() || pit->second.state != Peer::State::kReady) {
            ps.error = UnavailableError(
                fmt::format("kv push {}: no handshake with '{}'", Esc(ps.xid), Esc(ps.peer)));
            continue;
        }
        if (!ps.timing) {
            ps.timing = true;
            ps.started = SteadyClock::now();
        }
        for (int r = 0; r < m.tp; ++r) {
            for (int l = 0; l < m.layouts[r].spec.num_layers; ++l) {
                KvMove move{c.block_table, ps.target, ps.next_send, end, l, l + 1};
                auto plan = PlanKvMove(m.layouts[r], pit->second.ranks[r].layout, move);
                if (!plan.ok()) {
                    ps.error = plan.status().WithContext(fmt::format("kv push {}", Esc(ps.xid)));
                    break;
                }
                PlannedWrite w;
                w.id = *c.id;
                w.peer = ps.peer;
                for (size_t i = 0; i < plan->local.size(); ++i) {
                    const KvSpan& a = plan->local[i];
                    const KvSpan& b = plan->remote[i];
                    w.local.push_back({m.regions[r], a.offset, a.length, a.stride, a.count});
                    w.remote.push_back(
                        {pit->second.ranks[r].region, b.offset, b.length, b.stride, b.count});
                }
                w.bytes = plan->bytes;
                if (!w.local.empty()) {
                    m.step_writes[r][l].push_back(std::move(w));
                    any = true;
                }
            }
        }
        m.step_advance.emplace_back(*c.id, end);
    }
    return any ? &m : nullptr;
}

void AgentKvConnector::EndStep() {
    Impl& m = *impl_;
    std::lock_guard lock(m.mu);
    for (int r = 0; r < m.tp; ++r) {
        for (Posted& p : m.step_posted[r]) {
            m.CountPosted(p.descriptors);
            auto it = m.pushes.find(p.id);
            if (it == m.pushes.end()) {
                if (p.xfer.ok()) (void)p.xfer->Cancel();
                continue;
            }
            if (!p.xfer.ok()) {
                if (it->second.error.ok()) it->second.error = p.xfer.status();
                continue;
            }
            it->second.bytes += p.bytes;
            m.WakeOnDone(*p.xfer);
            it->second.transfers.push_back(std::move(*p.xfer));
        }
        m.step_posted[r].clear();
        for (auto& layer : m.step_writes[r]) layer.clear();
    }
    for (auto& [id, end] : m.step_advance) {
        auto it = m.pushes.find(id);
        if (it != m.pushes.end()) it->second.next_send = end;
    }
    m.step_advance.clear();
    // Drop handles of writes already done, so a long prompt does not pile them up.
    for (auto& entry : m.pushes) {
        Push& ps = entry.second;
        std::erase_if(ps.transfers, [&ps](Transfer& x) {
            auto s = x.Poll();
            if (!s.ok()) {
                if (ps.error.ok()) ps.error = s.status();
                return true;
            }
            return *s == TransferState::kDone;
        });
    }
}

std::string RenderKvConnectorMetrics(const KvConnectorStats& s) {
    std::string out;
    out +=
        "# HELP ferry_kv_connector_requests Requests in each KV transfer state.\n"
        "# TYPE ferry_kv_connector_requests gauge\n";
    for (auto [state, n] : {std::pair{"bootstrapping", s.bootstrapping},
                            {"waiting_for_input", s.waiting_for_input},
                            {"transferring", s.transferring},
                            {"holding", s.holding}}) {
        out += fmt::format("ferry_kv_connector_requests{{state=\"{}\"}} {}\n", state, n);
    }
    auto counter = [&](const char* name, const char* help, double v) {
        out += fmt::format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, v);
    };
    counter("ferry_kv_connector_succeeded_total", "KV transfers that completed.",
            double(s.succeeded));
    out +=
        "# HELP ferry_kv_connector_failed_total KV transfers that failed, by reason.\n"
        "# TYPE ferry_kv_connector_failed_total counter\n";
    for (const auto& [reason, n] : s.failures) {
        out += fmt::format("ferry_kv_connector_failed_total{{reason=\"{}\"}} {}\n", reason, n);
    }
    counter("ferry_kv_connector_bytes_read_total", "KV bytes READ from other workers.",
            double(s.bytes_read));
    counter("ferry_kv_connector_bytes_written_total", "KV bytes WRITTEN to other workers.",
            double(s.bytes_written));
    counter("ferry_kv_connector_transfers_total", "READs and WRITEs posted.", double(s.transfers));
    counter("ferry_kv_connector_descriptors_total", "Local descriptors over all transfers.",
            double(s.descriptors));
    out += fmt::format(
        "# HELP ferry_kv_connector_descriptors_max Most descriptors in one transfer.\n"
        "# TYPE ferry_kv_connector_descriptors_max gauge\nferry_kv_connector_descriptors_max "
        "{}\n",
        s.max_descriptors);
    counter("ferry_kv_connector_handshakes_total", "Peer handshakes completed.",
            double(s.handshakes));
    counter("ferry_kv_connector_transfer_exposed_seconds_sum",
            "push: transfer time after the prefill's compute ended (not hidden by it).",
            s.transfer_exposed_seconds_sum);
    counter("ferry_kv_connector_transfer_exposed_seconds_count", "push: requests timed so.",
            double(s.transfer_exposed_count));
    out +=
        "# HELP ferry_kv_connector_transfer_seconds KV transfer time per request.\n"
        "# TYPE ferry_kv_connector_transfer_seconds histogram\n";
    for (size_t i = 0; i < std::size(kTransferSecondsBuckets); ++i) {
        out +=
            fmt::format("ferry_kv_connector_transfer_seconds_bucket{{le=\"{}\"}} {}\n",
                        kTransferSecondsBuckets[i],
                        i < s.transfer_seconds_buckets.size() ? s.transfer_seconds_buckets[i] : 0);
    }
    out += fmt::format(
        "ferry_kv_connector_transfer_seconds_bucket{{le=\"+Inf\"}} {}\n"
        "ferry_kv_connector_transfer_seconds_sum {}\nferry_kv_connector_transfer_seconds_count "
        "{}\n",
        s.transfer_seconds_count, s.transfer_seconds_sum, s.transfer_seconds_count);
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

}  // namespace ferry::kv
