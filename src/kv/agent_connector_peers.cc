// Peers: where to dial, the handshake and what must match, peers ready, failed or gone.
#include <cstring>

#include "core/host_port.h"
#include "kv/agent_connector_parts.h"

namespace ferry::kv {

using namespace connector_parts;  // NOLINT(build/namespaces): the connector's own parts

bool AgentKvConnector::Impl::DeploymentPeers() const { return cfg.trust.deployment_only(); }

bool AgentKvConnector::Impl::Allowed(const std::string& address) const {
    return cfg.trust.Listed(address);
}

Result<std::string> AgentKvConnector::Impl::DialAddress(const KvTransferParams& kp) const {
    const schema::AgentAddress remote = kp.remote_agent();
    const std::string address = remote.host.empty() ? "" : remote.HostPort();
    if (!cfg.trust.allowed_agents.empty()) {
        if (!Allowed(address)) {
            return PermissionDeniedError(
                fmt::format("kv_transfer_params: the agent at '{}' is not one this worker may dial "
                            "(--kv-peers)",
                            Esc(address)));
        }
        return address;
    }
    if (cfg.trust.by_store) return std::string();
    return address;
}

msg::Compat AgentKvConnector::Impl::Compat() const {
    const KvCacheSpec& s = layouts[0].spec;
    msg::Compat c;
    c.model = cfg.model_fingerprint;
    c.attention = s.latent ? "mla" : "gqa";
    c.layers = s.num_layers;
    c.kv_heads = cfg.model_kv_heads;
    c.head_dim = s.head_dim;
    c.dtype = DtypeName(s);
    c.block_tokens = s.block_tokens;
    c.tp = tp;
    return c;
}

msg::Hello AgentKvConnector::Impl::Hello(bool ack) const {
    msg::Hello h;
    h.ack = ack;
    h.compat = Compat();
    for (int r = 0; r < tp; ++r) {
        h.ranks.push_back({regions[r], layouts[r].spec.num_blocks,
                           r < static_cast<int>(canaries.size()) ? canaries[r].id : 0});
    }
    h.addr = agent->ListenAddress();
    return h;
}

Status AgentKvConnector::Impl::CheckCompat(const std::string& peer,
                                           const msg::Compat& theirs) const {
    auto d = msg::FirstDifference(Compat(), theirs);
    if (!d) return Status::Ok();
    std::string what = d->field == "model" ? "model (weights fingerprint)" : d->field;
    return FailedPreconditionError(
        fmt::format("kv handshake with '{}': {} differs (this worker {}, '{}' {})", Esc(peer), what,
                    Esc(d->ours), Esc(peer), Esc(d->theirs)));
}

Result<std::vector<PeerRank>> AgentKvConnector::Impl::ParseRanks(
    const msg::Compat& theirs, const std::vector<msg::RankInfo>& ranks) const {
    const int their_tp = static_cast<int>(ranks.size());
    if (their_tp < 1 || their_tp != theirs.tp) {
        return InvalidArgumentError(
            fmt::format("field 'ranks' lists {} ranks for tp {}", their_tp, theirs.tp));
    }
    // Rank i of a TP-t peer holds the model's kv heads [i * H / t, (i + 1) * H / t), or with
    // more ranks than heads the one head i / (t / H) (kv_layout.h).
    const int heads = cfg.model_kv_heads;
    if (!TpSplitsHeads(their_tp, heads)) {
        return FailedPreconditionError(fmt::format(
            "tp differs (this worker {}, the peer {}) and the peer's {} neither divides nor is a "
            "multiple of the model's {} kv heads",
            tp, their_tp, their_tp, heads));
    }
    if (theirs.block_tokens < 1 || theirs.block_tokens > (1 << 16)) {
        return InvalidArgumentError(
            fmt::format("field 'block_tokens' is {}: not a block size", theirs.block_tokens));
    }
    std::vector<PeerRank> out;
    for (int i = 0; i < their_tp; ++i) {
        PeerRank pr;
        pr.region = ranks[i].region;
        pr.layout.spec = layouts[0].spec;
        pr.layout.spec.block_tokens = theirs.block_tokens;
        pr.layout.spec.kv_heads = RankKvHeads(their_tp, heads);
        pr.layout.spec.num_blocks = ranks[i].blocks;
        pr.layout.head_begin =
            RankHeadBegin(i, their_tp, heads) + cfg.fault_head_offset_for_testing;
        pr.canary = ranks[i].canary;
        out.push_back(pr);
    }
    return out;
}

std::vector<std::pair<int, int>> AgentKvConnector::Impl::RankPairs(
    const std::vector<PeerRank>& ranks, bool peer_sends) const {
    // Each of this worker's ranks with each peer rank that holds some of the same heads: one
    // pair per rank when the TP sizes are equal; the receiving side of TP d gets only its own
    // heads, from the one or more sending ranks that hold them. A head the sending side
    // replicates (more ranks than kv heads) comes from one of its copies only: for receiving
    // rank k, copy k mod (copies), so that the copies share the work and no head moves twice to
    // one rank.
    auto shared = [](const KvLayout& a, const KvLayout& b) {
        return std::max(a.head_begin, b.head_begin) <
               std::min(a.head_begin + a.spec.kv_heads, b.head_begin + b.spec.kv_heads);
    };
    const int theirs = static_cast<int>(ranks.size());
    // Which copy of its head a sending rank is, and how many copies there are.
    auto copy_of = [&](bool peer_side, int rank, int* copies) {
        const int n = peer_side ? theirs : tp;
        const KvLayout& me = peer_side ? ranks[rank].layout : layouts[rank];
        int index = 0, count = 0;
        for (int j = 0; j < n; ++j) {
            const KvLayout& x = peer_side ? ranks[j].layout : layouts[j];
            if (x.head_begin == me.head_begin && x.spec.kv_heads == me.spec.kv_heads) {
                if (j < rank) ++index;
                ++count;
            }
        }
        *copies = count;
        return index;
    };
    std::vector<std::pair<int, int>> out;
    for (int r = 0; r < tp; ++r) {
        for (int i = 0; i < theirs; ++i) {
            if (!shared(layouts[r], ranks[i].layout)) continue;
            int copies = 1;
            const int copy = peer_sends ? copy_of(true, i, &copies) : copy_of(false, r, &copies);
            const int receiver = peer_sends ? r : i;
            if (copy == receiver % copies) out.emplace_back(r, i);
        }
    }
    return out;
}

void AgentKvConnector::Impl::PeerReady(const std::string& name, std::vector<PeerRank> ranks,
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

void AgentKvConnector::Impl::PeerFailed(const std::string& name, const Status& st) {
    auto it = peers.find(name);
    if (it == peers.end()) return;
    std::vector<std::string> waiting = std::move(it->second.waiting);
    peers.erase(it);  // the next request tries again
    FERRY_LOG(kWarn, "kv: peer '{}': {}", Esc(name), st.ToString());
    for (const std::string& id : waiting) FailLoad(id, st, "handshake");
}

void AgentKvConnector::Impl::PeerGone(const std::string& name, const Status& st) {
    std::vector<std::string> ids;
    for (auto& [id, ld] : loads) {
        if (ld.peer == name) ids.push_back(id);
    }
    // First: a load retried below handshakes afresh.
    peers.erase(name);
    for (const std::string& id : ids) {
        auto it = loads.find(id);
        if (it != loads.end() && it->second.state == Load::State::kCancelling) {
            Emit({ConnectorEvent::Kind::kFailed, id, it->second.Cause(), std::nullopt});
            loads.erase(it);
            continue;
        }
        FailLoad(id, st, "peer_failed");
    }
}

void AgentKvConnector::Impl::EnsurePeer(const std::string& id, const KvTransferParams& kp) {
    const std::string& name = kp.remote_engine_id;
    Result<std::string> address = DialAddress(kp);
    if (!address.ok()) {
        FailLoad(id, address.status());
        return;
    }
    auto it = peers.find(name);
    if (it != peers.end() && it->second.state == Peer::State::kReady) {
        if (!address->empty() && !it->second.address.empty() && it->second.address != *address) {
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

Status AgentKvConnector::Impl::On(const std::string& from, msg::Hello& m) {
    if (m.ack) return OnHelloAck(from, m);
    // Answering needs a connection back: to an agent this worker may dial only.
    if (!cfg.trust.allowed_agents.empty() && !Allowed(m.addr)) {
        return PermissionDeniedError(
            fmt::format("hello from an agent at '{}', which this worker may not dial (--kv-peers)",
                        Esc(m.addr)));
    }
    std::string addr = cfg.trust.by_store ? "" : m.addr;  // by name through the store, if so
    connect_jobs.push_back({true, from, std::move(addr), std::move(m)});
    connect_cv.notify_one();
    return Status::Ok();
}

Status AgentKvConnector::Impl::OnHelloAck(const std::string& from, const msg::Hello& m) {
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
        PeerFailed(from, FailedPreconditionError(
                             m.error.empty() ? "kv handshake refused by the peer" : Esc(m.error)));
        return Status::Ok();
    }
    auto ranks = ParseRanks(m.compat, m.ranks);
    if (!ranks.ok()) {
        PeerFailed(from, ranks.status().WithContext("kv handshake"));
        return Status::Ok();
    }
    StartCanary(from, std::move(*ranks), it->second.address, false);
    return Status::Ok();
}

void AgentKvConnector::Impl::AcceptHello(const std::string& name, std::vector<PeerRank> ranks,
                                         const std::string& address) {
    auto it = peers.find(name);
    if (it == peers.end() || it->second.state != Peer::State::kConnecting ||
        !it->second.hello_sent) {
        // Not our own handshake in flight: the peer is ready for us now. (If ours is in
        // flight, its ack finishes it.)
        if (it == peers.end() || it->second.state != Peer::State::kConnecting) {
            PeerReady(name, std::move(ranks), address);
        } else {
            it->second.ranks = std::move(ranks);
        }
    }
    msg::Hello ack = Hello(true);
    ack.ok = true;
    (void)Send(name, ack);
}

void AgentKvConnector::Impl::StartCanary(const std::string& name, std::vector<PeerRank> ranks,
                                         const std::string& address, bool inbound) {
    const bool offered =
        std::all_of(ranks.begin(), ranks.end(), [](const PeerRank& r) { return r.canary != 0; });
    auto settle = [&](std::vector<PeerRank> rs) {
        if (inbound) {
            AcceptHello(name, std::move(rs), address);
        } else {
            PeerReady(name, std::move(rs), peers[name].address);
        }
    };
    if (!cfg.canary || canaries.empty() || !offered) {
        if (cfg.canary && !offered) {
            FERRY_LOG(kInfo, "kv: '{}' offers no handshake canary: its mapping is not checked",
                      Esc(name));
        }
        settle(std::move(ranks));
        return;
    }
    auto key = std::make_pair(name, inbound);
    if (canary_checks.count(key)) return;  // the same hello (or ack) again: one check runs
    auto fail = [&](const Status& st) {
        CanaryCheck c;
        c.name = name;
        c.address = address;
        c.inbound = inbound;
        canary_checks[key] = std::move(c);
        EndCanary(key, st);
    };
    const size_t per_rank = canary_layouts[0].spec.TotalBytes();
    auto scratch = agent->AllocateRegion(per_rank * tp);
    if (!scratch.ok()) return fail(scratch.status().WithContext("kv canary"));
    std::memset(scratch->base, 0, scratch->length);
    CanaryCheck& c = canary_checks[key];
    c.name = name;
    c.address = address;
    c.inbound = inbound;
    c.scratch = *scratch;
    c.deadline = SteadyClock::now() + cfg.handshake_timeout;
    std::vector<Descriptor> local, remote;
    for (const auto& [r, i] : RankPairs(ranks, true)) {
        KvLayout theirs = ranks[i].layout;
        theirs.spec = CanarySpec(theirs.spec);
        const std::vector<BlockId> ours_table = CanaryTable(canary_layouts[r].spec);
        const std::vector<BlockId> their_table = CanaryTable(theirs.spec);
        auto plan = PlanKvMove(canary_layouts[r], theirs,
                               KvMove{ours_table, their_table, 0, kCanaryTokens});
        if (!plan.ok()) return fail(plan.status().WithContext("kv canary"));
        for (size_t k = 0; k < plan->local.size(); ++k) {
            const KvSpan& a = plan->local[k];
            const KvSpan& b = plan->remote[k];
            local.push_back({c.scratch.id, r * per_rank + a.offset, a.length, a.stride, a.count});
            remote.push_back({ranks[i].canary, b.offset, b.length, b.stride, b.count});
        }
    }
    c.ranks = std::move(ranks);
    auto x = agent->PostRead(local, name, remote,
                             {.timeout = cfg.handshake_timeout, .backend = cfg.backend});
    if (!x.ok()) return EndCanary(key, x.status().WithContext("kv canary read"));
    c.xfer = std::move(*x);
    WakeOnDone(c.xfer);
}

void AgentKvConnector::Impl::PumpCanaries(SteadyClock::time_point now) {
    std::vector<std::pair<std::pair<std::string, bool>, Status>> ended;
    const size_t per_rank = canary_layouts.empty() ? 0 : canary_layouts[0].spec.TotalBytes();
    for (auto& [key, c] : canary_checks) {
        auto s = c.xfer.valid() ? c.xfer.Poll() : Result<TransferState>(TransferState::kPending);
        if (!s.ok()) {
            ended.emplace_back(key, s.status().WithContext("kv canary read"));
        } else if (*s == TransferState::kDone) {
            Status st;
            for (int r = 0; r < tp && st.ok(); ++r) {
                const auto* base = static_cast<const std::byte*>(c.scratch.base) + r * per_rank;
                st = CheckCanary(canary_layouts[r], {base, per_rank}, cfg.model_kv_heads);
            }
            ended.emplace_back(key, st);
        } else if (now > c.deadline) {
            ended.emplace_back(key, DeadlineExceededError("kv canary read did not finish in time"));
        }
    }
    for (auto& [key, st] : ended) EndCanary(key, st);
}

void AgentKvConnector::Impl::EndCanary(const std::pair<std::string, bool>& key, const Status& st) {
    auto it = canary_checks.find(key);
    if (it == canary_checks.end()) return;
    CanaryCheck c = std::move(it->second);
    canary_checks.erase(it);
    if (c.xfer.valid()) (void)c.xfer.Cancel();
    if (c.scratch.id) (void)agent->Deregister(c.scratch.id);
    ++stats.canaries;
    if (!st.ok()) ++stats.canary_failures;
    Status err = st.ok() ? st
                         : Status(st.code(), fmt::format("kv handshake with '{}': {}", Esc(c.name),
                                                         st.message()));
    if (!c.inbound) {
        auto p = peers.find(c.name);
        if (p == peers.end() || p->second.state != Peer::State::kConnecting) return;
        if (err.ok()) {
            PeerReady(c.name, std::move(c.ranks), p->second.address);
        } else {
            PeerFailed(c.name, err);
        }
        return;
    }
    if (err.ok()) {
        AcceptHello(c.name, std::move(c.ranks), c.address);
        return;
    }
    FERRY_LOG(kWarn, "kv: hello from '{}' refused: {}", Esc(c.name), err.ToString());
    msg::Hello ack = Hello(true);
    ack.ok = false;
    ack.error = err.message();
    (void)Send(c.name, ack);
}

void AgentKvConnector::Impl::ConnectLoop() {
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
                fmt::format("remote_engine_id is '{}' but the agent at {} is '{}'", Esc(job.name),
                            Esc(job.address), Esc(*name)));
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
            auto r = ParseRanks(job.hello.compat, job.hello.ranks);
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
        // The ack goes once the peer's canary arrived right (AcceptHello).
        StartCanary(job.name, std::move(ranks), job.address, true);
    }
}

// Handshakes that got no answer; the liveness of peers that loads wait on.
void AgentKvConnector::Impl::PumpPeers(SteadyClock::time_point now) {
    PumpCanaries(now);
    // Handshakes that got no answer.
    std::vector<std::string> stale;
    for (auto& [name, p] : peers) {
        if (p.state == Peer::State::kConnecting && p.hello_sent && now > p.deadline) {
            stale.push_back(name);
        }
    }
    for (const std::string& name : stale) {
        PeerFailed(name, DeadlineExceededError(
                             fmt::format("kv handshake with '{}' got no answer", Esc(name))));
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
                    name, UnavailableError(fmt::format("prefill worker '{}' is gone: {}", Esc(name),
                                                       s.status().ToString())));
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
                    name, UnavailableError(fmt::format("prefill worker '{}' is gone: {}", Esc(name),
                                                       x.status().ToString())));
            }
            p.next_probe = now + cfg.liveness_interval;
        }
    }
    for (auto& [name, st] : gone) PeerGone(name, st);
}

}  // namespace ferry::kv
