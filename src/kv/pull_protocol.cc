#include "kv/pull_protocol.h"

namespace ferry::kv {

using namespace connector_parts;  // NOLINT(build/namespaces): the connector's own parts

int PullProtocol::HoldCap() const {
    int cap = m_.cfg.max_client_hold_blocks;
    if (cap < 0) cap = m_.layouts.empty() ? 0 : std::max(1, m_.layouts[0].spec.num_blocks / 4);
    return cap;
}

Status PullProtocol::HoldShareLeft(const std::string& requester, std::span<const BlockId> blocks,
                                   int unknown_blocks) const {
    const int cap = HoldCap();
    if (cap <= 0) return Status::Ok();
    // Blocks count once however many holds share them (a prompt's cached prefix held for
    // several requests): the cap bounds the memory a client pins, not its requests.
    std::unordered_set<BlockId> used;
    for (const auto& [id, h] : holds_) {
        if (h.requester == requester && !h.claimed) used.insert(h.blocks.begin(), h.blocks.end());
    }
    int more = unknown_blocks;
    for (BlockId b : blocks) more += used.count(b) ? 0 : 1;
    const int have = static_cast<int>(used.size());
    if (have + more <= cap) return Status::Ok();
    return ResourceExhaustedError(fmt::format(
        "kv: client {} already has {} KV blocks held unclaimed for remote decoders (at most "
        "{}); this prompt needs {} more: retry once they are claimed or their lease lapses",
        Esc(requester), have, cap, more));
}

Status PullProtocol::PlanAllRanks(const Peer& p, const KvMove& move, std::vector<Descriptor>* local,
                                  std::vector<Descriptor>* remote, uint64_t* bytes) const {
    for (const auto& [r, i] : m_.RankPairs(p.ranks, true)) {
        // The heads both hold (head_end < 0): straight from the peer rank's blocks into a
        // slice of ours, strided, no staging copy.
        FERRY_ASSIGN_OR_RETURN(KvPlan plan, PlanKvMove(m_.layouts[r], p.ranks[i].layout, move));
        for (size_t k = 0; k < plan.local.size(); ++k) {
            const KvSpan& l = plan.local[k];
            const KvSpan& m = plan.remote[k];
            local->push_back({m_.regions[r], l.offset, l.length, l.stride, l.count});
            remote->push_back({p.ranks[i].region, m.offset, m.length, m.stride, m.count});
        }
        *bytes += plan.bytes;
    }
    return Status::Ok();
}

Hold* PullProtocol::FindHold(const std::string& from, const std::string& rid,
                             const std::string& nonce, bool* exists) {
    auto it = holds_.find(rid);
    *exists = it != holds_.end() && SecretEqual(it->second.nonce, nonce);
    if (!*exists) return nullptr;
    Hold& h = it->second;
    return !h.claimed || h.claimer == from ? &h : nullptr;
}

Status PullProtocol::On(const std::string& from, msg::Claim& m) {
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
            "no KV is held for request '{}' (its lease expired, or it was released)", Esc(m.rid));
    } else if (!h) {
        error = fmt::format("the KV of request '{}' is claimed by another decoder", Esc(m.rid));
    } else if (h->prompt_digest != m.prompt) {
        error = fmt::format("request '{}' held KV for another prompt", Esc(m.rid));
    } else if (m.blocks != h->blocks) {
        error =
            fmt::format("the claim names blocks that are not those request '{}' holds", Esc(m.rid));
    } else if (m.verify) {
        // --kv-verify: our checksums of what the reader will read (the blocks stay as they
        // are while held).
        auto sums = m_.SumsFor(*m.verify, h->blocks);
        if (sums.ok()) {
            ack.sums = std::move(*sums);
        } else {
            error = sums.status().message();
        }
    }
    if (error.empty()) {
        h->claimed = true;
        h->claimer = from;
        h->deadline = SteadyClock::now() + m_.cfg.transfer_timeout + std::chrono::seconds(1);
        ack.ok = true;
        ack.first = h->first;
    }
    if (!ack.ok) {
        ack.error = error;
        ack.code = code;
        FERRY_LOG(kWarn, "kv: claim of '{}' by '{}' refused: {}", Esc(m.rid), Esc(from), error);
    }
    (void)m_.Send(from, ack);
    return Status::Ok();
}

Status PullProtocol::On(const std::string& from, msg::HoldEnd& m) {
    bool exists = false;
    if (!FindHold(from, m.rid, m.nonce, &exists)) {
        return NotFoundError(fmt::format("no hold '{}'", Esc(m.rid)));
    }
    const bool read = m.kind == msg::HoldEnd::Kind::kReadDone;
    if (read) {
        ++m_.stats.succeeded;
    } else {
        m_.CountFailure(CancelledError(""), "released");
    }
    holds_.erase(m.rid);
    FERRY_LOG(kInfo, "kv: request {} released by '{}' ({})", Esc(m.rid), Esc(from),
              read ? "read-done" : "release");
    m_.Emit({ConnectorEvent::Kind::kReleased, m.rid, Status::Ok(), std::nullopt});
    return Status::Ok();
}

Status PullProtocol::On(const std::string& from, msg::HoldRenew& m) {
    bool exists = false;
    Hold* h = FindHold(from, m.rid, m.nonce, &exists);
    if (!h) return NotFoundError(fmt::format("no hold '{}' to renew", Esc(m.rid)));
    if (h->claimed) return Status::Ok();  // the claim's own deadline runs
    // From now, for what the decoder asked and at most the whole lease: a renewal may shorten
    // the first lease (a decoder that then dies frees the blocks sooner).
    h->deadline =
        SteadyClock::now() + std::min<std::chrono::milliseconds>(
                                 std::chrono::milliseconds(m.lease_ms), m_.cfg.hold_lease);
    ++m_.stats.holds_renewed;
    return Status::Ok();
}

void PullProtocol::RenewWaiting(SteadyClock::time_point now) {
    const auto every = m_.cfg.hold_renew_interval;
    if (every.count() <= 0) return;
    for (auto& [id, a] : m_.admitted) {
        if (a.hold_rid.empty() || now < a.renew_at) continue;
        // Claimed (the claim's deadline runs from here), or the load is over (read, or
        // failed): nothing more to renew. Before StartLoad (queued) there is no load yet.
        auto ld = m_.loads.find(id);
        if (a.load_started &&
            (ld == m_.loads.end() || ld->second.state != Load::State::kBootstrapping)) {
            a.hold_rid.clear();
            continue;
        }
        auto p = m_.peers.find(a.peer);
        if (p == m_.peers.end() || p->second.state != Peer::State::kReady) continue;
        a.renew_at = now + every;
        const int lease = static_cast<int>(std::min<int64_t>(3 * every.count(), 600000));
        if (m_.Send(a.peer, msg::HoldRenew{a.hold_rid, a.hold_nonce, lease}).ok()) {
            ++m_.stats.holds_renewals_sent;
        }
    }
}

Status PullProtocol::On(const std::string& from, msg::ClaimAck& m) {
    auto it = m_.loads.find(m.lid);
    if (it == m_.loads.end() || it->second.peer != from ||
        it->second.params.mode != KvTransferMode::kPull) {
        return NotFoundError(fmt::format("no load '{}' from this peer", Esc(m.lid)));
    }
    if (!m.ok) {
        std::string text =
            fmt::format("prefill worker '{}': {}", Esc(from),
                        m.error.empty() ? std::string("claim refused") : Esc(m.error));
        // A hold that is gone (its lease lapsed) can be had again by retrying the request
        // (503); a claim that does not match its hold is the params' fault (409).
        m_.FailLoad(m.lid,
                    m.code == "gone" ? UnavailableError(std::move(text))
                                     : FailedPreconditionError(std::move(text)),
                    "claim_refused");
        return Status::Ok();
    }
    it->second.claim_acked = true;
    it->second.acked_first = std::move(m.first);
    it->second.sums = std::move(m.sums);
    if (it->second.read_done) m_.CompleteLoad(m.lid, m_.FirstOf(it->second));
    return Status::Ok();
}

// Holds whose lease lapsed: their blocks go back to the engine.
void PullProtocol::Pump(SteadyClock::time_point now) {
    // Holds whose lease lapsed; targets nobody came for.
    std::vector<std::string> lapsed;
    for (auto& [rid, h] : holds_) {
        if (now > h.deadline) lapsed.push_back(rid);
    }
    for (const std::string& rid : lapsed) {
        holds_.erase(rid);
        m_.CountFailure(DeadlineExceededError(""), "lease_expired");
        FERRY_LOG(kInfo, "kv: request {}: hold lease expired, blocks freed", Esc(rid));
        m_.Emit({ConnectorEvent::Kind::kReleased, rid, Status::Ok(), std::nullopt});
    }
}

// pull, decode side: claim the hold and READ at once (the data counts only once the claim is
// acked).
void PullProtocol::Proceed(const std::string& id, Load& ld, Peer& p) {
    // The prefill worker's blocks are of its own size (the handshake said which).
    const int pbt = p.ranks[0].layout.spec.block_tokens;
    const int want = ld.num_computed + ld.num_external;
    const int covered = static_cast<int>(ld.params.remote_block_ids.size()) * pbt;
    if (covered < want) {
        m_.FailLoad(id, InvalidArgumentError(fmt::format(
                            "kv_transfer_params: remote_block_ids names {} blocks of {} tokens, "
                            "fewer than the {} prompt tokens to load",
                            ld.params.remote_block_ids.size(), pbt, want)));
        return;
    }
    // Equal block sizes: read the last block whole (one span per run of blocks, not one per
    // head for its partial tail); its slots past the prompt are overwritten as tokens come.
    const int end =
        pbt == m_.bt() ? std::min((want + m_.bt() - 1) / m_.bt() * m_.bt(), covered) : want;
    ld.verify = m_.VerifyRequestFor(ld.num_computed, want);
    std::vector<Descriptor> local, remote;
    KvMove move{ld.blocks, ld.params.remote_block_ids, ld.num_computed, end};
    Status st = PlanAllRanks(p, move, &local, &remote, &ld.bytes);
    if (!st.ok()) {
        m_.FailLoad(id, st.WithContext("kv_transfer_params"));
        return;
    }
    // The claim names exactly the blocks the read touches (all the params named): the
    // prefill worker refuses it unless they are its hold's, for this prompt.
    Status sent =
        m_.Send(ld.peer, msg::Claim{ld.params.remote_request_id, ld.params.hold_nonce, id,
                                    ld.prompt_digest, ld.params.remote_block_ids, ld.verify});
    if (!sent.ok()) {
        m_.FailLoad(id, UnavailableError(
                            fmt::format("kv: prefill worker '{}' is not reachable", Esc(ld.peer))));
        return;
    }
    ld.state = Load::State::kTransferring;
    ld.deadline = ld.started + m_.cfg.transfer_timeout;
    Result<Transfer> x = m_.agent->PostRead(
        local, ld.peer, remote, {.timeout = m_.cfg.transfer_timeout, .backend = m_.cfg.backend});
    m_.CountPosted(local.size());
    if (!x.ok()) {
        m_.FailLoad(id, x.status().WithContext(
                            fmt::format("kv read from prefill worker '{}'", Esc(ld.peer))));
        return;
    }
    ld.xfer = std::move(*x);
    m_.WakeOnDone(ld.xfer);
    FERRY_LOG(kInfo, "kv: request {} transferring {} bytes from '{}' in {} descriptors", Esc(id),
              ld.bytes, Esc(ld.peer), local.size());
}

// pull, prefill side: hold the finished request's blocks for a reader under a lease and say
// where they are (the params of the answer).
FinishAction PullProtocol::HoldForReader(const ConnectorRequest& r, std::span<const BlockId> blocks,
                                         const FirstToken& first) {
    const KvTransferParams& p = AsKvTransferParams(r.params);
    FinishAction a;
    const int block_tokens = m_.bt();
    const size_t nblocks =
        std::min(blocks.size(), (r.prompt.size() + block_tokens - 1) / block_tokens);
    if (!p.requester.empty() && p.requester != kRouterRequester) {
        a.refused = HoldShareLeft(p.requester, blocks.first(nblocks), 0);
        if (!a.refused.ok()) {
            m_.CountFailure(a.refused, "client_cap");
            return a;
        }
    }
    Hold& h = holds_[r.id];
    h.nonce = RandomId128();
    h.prompt_digest = PromptDigest(r.prompt, r.mm);
    h.blocks.assign(blocks.begin(), blocks.begin() + nblocks);
    h.requester = p.requester;
    h.first = first;
    h.deadline = SteadyClock::now() + m_.cfg.hold_lease;
    auto out = std::make_shared<KvTransferParams>();
    out->mode = KvTransferMode::kPull;
    out->do_remote_prefill = true;
    out->do_remote_decode = false;
    out->set_remote_agent(schema::AgentAt(m_.agent->name(), m_.agent->ListenAddress()));
    out->remote_block_ids.assign(blocks.begin(), blocks.begin() + nblocks);
    out->remote_request_id = r.id;
    out->tp_size = m_.cfg.model_tp > 0 ? m_.cfg.model_tp : m_.tp;
    out->first_token = first;
    out->hold_nonce = h.nonce;
    a.hold_blocks = true;
    a.params = std::move(out);
    FERRY_LOG(kInfo, "kv: request {} holding {} blocks for a reader", Esc(r.id), nblocks);
    return a;
}

FinishAction PullProtocol::Finished(const ConnectorRequest& r, std::span<const BlockId> blocks,
                                    bool ok, const FirstToken* first) {
    if (!ok || !first) return {};
    return HoldForReader(r, blocks, *first);
}

int PullProtocol::ExternalTokens(const KvTransferParams& p, int prompt_len,
                                 int num_computed) const {
    if (p.remote_block_ids.empty()) return 0;
    const int covered = p.first_token ? prompt_len : prompt_len - 1;
    return std::max(0, covered - num_computed);
}

}  // namespace ferry::kv
