#include "kv/push_protocol.h"

#include <algorithm>

namespace ferry::kv {

using namespace connector_parts;  // NOLINT(build/namespaces): the connector's own parts

Status PushProtocol::SendPushFailed(const std::string& peer, const std::string& xid,
                                    const std::string& lid, std::string error) {
    return m_.Send(
        peer, msg::PushEnd{msg::PushEnd::Kind::kFailed, xid, lid, std::nullopt, std::move(error)});
}

bool PushProtocol::BindTarget(const std::string& id, Push& ps, Target t, bool* mismatch) {
    *mismatch = false;
    if (t.prompt_digest != ps.prompt_digest || t.len != ps.prompt_len) {
        Status st = FailedPreconditionError(fmt::format(
            "kv push {}: the decoder's prompt ({} tokens) is not this prefill's ({} tokens)",
            Esc(ps.xid), t.len, ps.prompt_len));
        (void)SendPushFailed(t.peer, ps.xid, t.lid, st.message());
        FERRY_LOG(kWarn, "kv: request {}: a target from '{}' refused: {}", Esc(id), Esc(t.peer),
                  st.message());
        *mismatch = true;
        return false;
    }
    // The decoder's blocks are of its own size (the handshake said which).
    auto peer = m_.peers.find(t.peer);
    const int dbt = peer != m_.peers.end() && peer->second.state == Peer::State::kReady
                        ? peer->second.ranks[0].layout.spec.block_tokens
                        : m_.bt();
    const int need = (ps.prompt_len + dbt - 1) / dbt;
    if (static_cast<int>(t.blocks.size()) < need || t.from < 0 || t.from % dbt != 0 ||
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
    ps.verify = std::move(t.verify);
    // The first push-alive one interval from now: a request that finishes sooner sends none.
    ps.renew_at = SteadyClock::now() + m_.cfg.hold_renew_interval;
    FERRY_LOG(kInfo, "kv: request {} has its target: '{}' from token {} (transfer {})", Esc(id),
              Esc(ps.peer), ps.next_send, Esc(ps.xid));
    return true;
}

void PushProtocol::EndPush(const std::string& id, bool ok, const Status& err) {
    auto it = pushes_.find(id);
    if (it == pushes_.end()) return;
    Push& ps = it->second;
    for (Transfer& x : ps.transfers) (void)x.Cancel();
    Status failed = err;
    msg::PushEnd done{msg::PushEnd::Kind::kDone, ps.xid, ps.lid, ps.first, "", {}};
    if (ok && ps.verify) {
        // --kv-verify: our checksums of what we wrote (our blocks are held until the push ends).
        auto sums = m_.SumsFor(*ps.verify, ps.blocks);
        if (sums.ok()) {
            done.sums = std::move(*sums);
        } else {
            ok = false;
            failed = sums.status().WithContext(fmt::format("kv push {}", Esc(ps.xid)));
        }
    }
    if (ok) {
        (void)m_.Send(ps.peer, done);
        ++m_.stats.succeeded;
        m_.stats.bytes_written += ps.bytes;
        if (ps.timing) {
            m_.RecordTime(ps.started);
            m_.stats.transfer_exposed_seconds_sum +=
                std::chrono::duration<double>(SteadyClock::now() - ps.computed).count();
            ++m_.stats.transfer_exposed_count;
        }
        FERRY_LOG(kInfo, "kv: request {} pushed {} bytes to '{}'", Esc(id), ps.bytes, Esc(ps.peer));
    } else {
        if (!ps.peer.empty()) {
            (void)SendPushFailed(ps.peer, ps.xid, ps.lid, failed.message());
        }
        m_.CountFailure(failed);
        FERRY_LOG(kInfo, "kv: request {} push failed: {}", Esc(id), failed.ToString());
    }
    push_by_xid_.erase(ps.xid);
    pushes_.erase(it);
}

Status PushProtocol::On(const std::string& from, msg::PushTarget& m) {
    Target tg;
    tg.peer = from;
    tg.lid = m.lid;
    tg.blocks = std::move(m.blocks);
    tg.from = m.from;
    tg.len = m.len;
    tg.prompt_digest = m.prompt;
    tg.verify = std::move(m.verify);
    auto pit = m_.peers.find(from);
    if (pit == m_.peers.end() || pit->second.state != Peer::State::kReady) {
        (void)SendPushFailed(from, m.xid, tg.lid, "no kv handshake with this prefill worker");
        return FailedPreconditionError("push-target before the handshake");
    }
    auto bx = push_by_xid_.find(m.xid);
    if (bx == push_by_xid_.end()) {
        // The prefill request has not arrived yet: keep the target for it (this peer's latest;
        // several peers' side by side, the prompt decides which is the request's).
        tg.deadline = SteadyClock::now() + m_.cfg.bootstrap_timeout;
        auto it = targets_.find(m.xid);
        if (it == targets_.end()) {
            if (targets_.size() >= 65536) return ResourceExhaustedError("too many targets");
            it = targets_.emplace(m.xid, std::vector<Target>{}).first;
        }
        std::vector<Target>& early = it->second;
        auto same = std::find_if(early.begin(), early.end(),
                                 [&](const Target& t) { return t.peer == from; });
        if (same != early.end()) {
            *same = std::move(tg);
        } else if (early.size() < kMaxEarlyTargets) {
            early.push_back(std::move(tg));
        } else {
            (void)SendPushFailed(from, m.xid, tg.lid, "too many decoders named this transfer id");
            return ResourceExhaustedError(
                fmt::format("transfer '{}': too many targets", Esc(m.xid)));
        }
        return Status::Ok();
    }
    const std::string id = bx->second;
    Push& ps = pushes_[id];
    if (ps.state != Push::State::kBootstrapping) {
        (void)SendPushFailed(from, m.xid, tg.lid, "transfer id already has a decoder");
        return AlreadyExistsError(fmt::format("transfer '{}' already bound", Esc(m.xid)));
    }
    bool mismatch = false;
    if (BindTarget(id, ps, std::move(tg), &mismatch)) {
        m_.Emit({ConnectorEvent::Kind::kReady, id, Status::Ok(), std::nullopt});
    } else if (mismatch) {
        return FailedPreconditionError(
            fmt::format("transfer '{}': a target for another prompt", Esc(m.xid)));
    } else {
        Status err = ps.error;
        push_by_xid_.erase(ps.xid);
        pushes_.erase(id);
        m_.CountFailure(err);
        m_.Emit({ConnectorEvent::Kind::kFailed, id, err, std::nullopt});
    }
    return Status::Ok();
}

Status PushProtocol::On(const std::string& from, msg::PushCancel& m) {
    // Only the peer's own early target goes; the request itself fails at once only when no
    // other decoder's target waits for it.
    if (auto it = targets_.find(m.xid); it != targets_.end()) {
        std::vector<Target>& early = it->second;
        const size_t before = early.size();
        early.erase(std::remove_if(early.begin(), early.end(),
                                   [&](const Target& t) { return t.peer == from; }),
                    early.end());
        if (early.empty()) {
            targets_.erase(it);
            if (before != 0 && cancelled_xids_.size() < 65536) {
                cancelled_xids_[m.xid] = SteadyClock::now() + m_.cfg.bootstrap_timeout;
            }
        }
    }
    auto bx = push_by_xid_.find(m.xid);
    if (bx != push_by_xid_.end()) {
        Push& ps = pushes_[bx->second];
        if (ps.peer == from) {
            for (Transfer& x : ps.transfers) (void)x.Cancel();
            ps.cancelled = true;
            ps.error =
                CancelledError(fmt::format("kv push {}: the decoder cancelled it", Esc(m.xid)));
        }
    }
    (void)m_.Send(from,
                  msg::PushEnd{msg::PushEnd::Kind::kCancelled, m.xid, m.lid, std::nullopt, ""});
    return Status::Ok();
}

// The decode side: the prefill worker still has our blocks bound to its request (queued or
// computing): wait `lease_ms` more from now, at most the whole first wait, and never past
// kMaxPushWait from the start. A renewal may shorten the first wait: a prefill worker that then
// stops renewing (stopped, wedged) has our blocks freed that soon after.
Status PushProtocol::On(const std::string& from, msg::PushAlive& m) {
    auto it = m_.loads.find(m.lid);
    if (it == m_.loads.end() || it->second.peer != from ||
        it->second.params.mode != KvTransferMode::kPush || it->second.params.transfer_id != m.xid) {
        return NotFoundError(fmt::format("no push load '{}' from this peer", Esc(m.lid)));
    }
    Load& ld = it->second;
    if (ld.state != Load::State::kWaitingForInput) return Status::Ok();
    const auto whole = m_.cfg.bootstrap_timeout + m_.cfg.transfer_timeout;
    ld.deadline = std::min(SteadyClock::now() + std::min<std::chrono::milliseconds>(
                                                    std::chrono::milliseconds(m.lease_ms), whole),
                           ld.started + kMaxPushWait);
    ++m_.stats.pushes_renewed;
    return Status::Ok();
}

// The prefill side: every push bound to its decoder's blocks and not ended, and every request
// queued here whose decoder's target came already, tells the decoder to go on waiting, each
// interval, for three intervals. Runs on the connector's pump thread, so a
// busy engine still renews and a stopped process does not.
void PushProtocol::RenewBound(SteadyClock::time_point now) {
    const auto every = m_.cfg.hold_renew_interval;
    if (every.count() <= 0) return;
    const int lease = static_cast<int>(std::min<int64_t>(3 * every.count(), 600000));
    for (auto& [id, ps] : pushes_) {
        if (ps.state == Push::State::kBootstrapping || ps.cancelled || ps.peer.empty() ||
            now < ps.renew_at) {
            continue;
        }
        ps.renew_at = now + every;
        if (m_.Send(ps.peer, msg::PushAlive{ps.xid, ps.lid, lease}).ok()) {
            ++m_.stats.push_renewals_sent;
        }
    }
    // Requests still in the engine's queue (not yet scheduled, so no push yet): the decoders
    // whose targets already came for them.
    for (auto& [id, a] : m_.admitted) {
        if (a.push_xid.empty() || now < a.renew_at) continue;
        if (push_by_xid_.count(a.push_xid)) {
            a.push_xid.clear();  // scheduled: renewed as a push from here
            continue;
        }
        auto early = targets_.find(a.push_xid);
        if (early == targets_.end()) continue;
        a.renew_at = now + every;
        for (const Target& t : early->second) {
            if (m_.Send(t.peer, msg::PushAlive{a.push_xid, t.lid, lease}).ok()) {
                ++m_.stats.push_renewals_sent;
            }
        }
    }
}

Status PushProtocol::On(const std::string& from, msg::PushEnd& m) {
    auto it = m_.loads.find(m.lid);
    if (it == m_.loads.end() || it->second.peer != from ||
        it->second.params.mode != KvTransferMode::kPush) {
        return NotFoundError(fmt::format("no push load '{}' from this peer", Esc(m.lid)));
    }
    Load& ld = it->second;
    if (ld.state == Load::State::kCancelling) {
        m_.Emit({ConnectorEvent::Kind::kFailed, m.lid, ld.Cause(), std::nullopt});
        m_.loads.erase(it);
        return Status::Ok();
    }
    if (m.kind != msg::PushEnd::Kind::kDone) {
        m_.CountFailure(UnavailableError(""), "remote_failed");
        m_.Emit({ConnectorEvent::Kind::kFailed, m.lid,
                 UnavailableError(
                     fmt::format("prefill worker '{}' failed the transfer: {}", Esc(from),
                                 m.error.empty() ? std::string("no reason") : Esc(m.error))),
                 std::nullopt});
        m_.loads.erase(it);
        return Status::Ok();
    }
    ld.sums = std::move(m.sums);
    m_.CompleteLoad(m.lid, std::move(m.first));
    return Status::Ok();
}

void PushProtocol::OnLayerStored(int rank, int layer) {
    for (PlannedWrite& w : step_writes_[rank][layer]) {
        Result<Transfer> x =
            m_.agent->PostWrite(w.local, w.peer, w.remote,
                                {.timeout = m_.cfg.transfer_timeout, .backend = m_.cfg.backend});
        step_posted_[rank].push_back({w.id, std::move(x), w.bytes, w.local.size()});
    }
}

// push, prefill side: a request runs once the decoder's blocks are known (its target may have
// come first); until then it is parked.
bool PushProtocol::ReadyToSchedule(const ConnectorRequest& r, const KvTransferParams& p) {
    auto it = pushes_.find(r.id);
    if (it != pushes_.end()) return it->second.state != Push::State::kBootstrapping;
    Push& ps = pushes_[r.id];
    ps.xid = p.transfer_id;
    ps.prompt_digest = PromptDigest(r.prompt, r.mm);
    ps.prompt_len = static_cast<int>(r.prompt.size());
    ps.deadline = SteadyClock::now() + m_.cfg.bootstrap_timeout;
    auto fail = [&](Status st) {
        pushes_.erase(r.id);
        m_.CountFailure(st);
        m_.Emit({ConnectorEvent::Kind::kFailed, r.id, std::move(st), std::nullopt});
        return false;
    };
    if (p.transfer_id.empty()) {
        return fail(InvalidArgumentError("kv_transfer_params: push needs a transfer_id"));
    }
    if (push_by_xid_.count(p.transfer_id)) {
        return fail(AlreadyExistsError(
            fmt::format("kv_transfer_params: transfer_id '{}' is in use by another request",
                        Esc(p.transfer_id))));
    }
    if (cancelled_xids_.erase(p.transfer_id)) {
        return fail(CancelledError(fmt::format(
            "kv push {}: the decoder cancelled it before this request came", Esc(p.transfer_id))));
    }
    push_by_xid_[p.transfer_id] = r.id;
    auto t = targets_.find(p.transfer_id);
    if (t == targets_.end()) {
        FERRY_LOG(kInfo, "kv: request {} bootstrapping (transfer {})", Esc(r.id),
                  Esc(p.transfer_id));
        return false;
    }
    std::vector<Target> early = std::move(t->second);
    targets_.erase(t);
    for (Target& tg : early) {
        bool mismatch = false;
        if (BindTarget(r.id, ps, std::move(tg), &mismatch)) return true;
        if (!mismatch) {
            Status err = ps.error;
            push_by_xid_.erase(p.transfer_id);
            return fail(err);
        }
    }
    FERRY_LOG(kInfo, "kv: request {} bootstrapping (transfer {}; no early target was its own)",
              Esc(r.id), Esc(p.transfer_id));
    return false;
}

LayerHook* PushProtocol::BeginStep(std::span<const StepChunk> chunks) {
    std::lock_guard lock(m_.mu);
    if (!m_.bound) return nullptr;
    bool any = false;
    for (const StepChunk& c : chunks) {
        const KvTransferParams& cp = AsKvTransferParams(*c.params);
        if (!cp.do_remote_decode || cp.mode != KvTransferMode::kPush) continue;
        auto it = pushes_.find(*c.id);
        if (it == pushes_.end()) continue;
        Push& ps = it->second;
        if (ps.state != Push::State::kReady || ps.cancelled || !ps.error.ok()) continue;
        const int end = c.start_pos + c.num_tokens;
        if (end <= ps.next_send) continue;
        auto pit = m_.peers.find(ps.peer);
        if (pit == m_.peers.end() || pit->second.state != Peer::State::kReady) {
            ps.error = UnavailableError(
                fmt::format("kv push {}: no handshake with '{}'", Esc(ps.xid), Esc(ps.peer)));
            continue;
        }
        if (!ps.timing) {
            ps.timing = true;
            ps.started = SteadyClock::now();
        }
        // Each of our ranks writes its heads to every peer rank that holds some of them, layer
        // by layer as that rank computes them.
        for (const auto& [r, pr] : m_.RankPairs(pit->second.ranks, false)) {
            for (int l = 0; l < m_.layouts[r].spec.num_layers && ps.error.ok(); ++l) {
                KvMove move{c.block_table, ps.target, ps.next_send, end, l, l + 1};
                auto plan = PlanKvMove(m_.layouts[r], pit->second.ranks[pr].layout, move);
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
                    w.local.push_back({m_.regions[r], a.offset, a.length, a.stride, a.count});
                    w.remote.push_back(
                        {pit->second.ranks[pr].region, b.offset, b.length, b.stride, b.count});
                }
                w.bytes = plan->bytes;
                if (!w.local.empty()) {
                    step_writes_[r][l].push_back(std::move(w));
                    any = true;
                }
            }
        }
        step_advance_.emplace_back(*c.id, end);
    }
    return any ? this : nullptr;
}

void PushProtocol::EndStep() {
    std::lock_guard lock(m_.mu);
    for (int r = 0; r < m_.tp; ++r) {
        for (Posted& p : step_posted_[r]) {
            m_.CountPosted(p.descriptors);
            auto it = pushes_.find(p.id);
            if (it == pushes_.end()) {
                if (p.xfer.ok()) (void)p.xfer->Cancel();
                continue;
            }
            if (!p.xfer.ok()) {
                if (it->second.error.ok()) it->second.error = p.xfer.status();
                continue;
            }
            it->second.bytes += p.bytes;
            m_.WakeOnDone(*p.xfer);
            it->second.transfers.push_back(std::move(*p.xfer));
        }
        step_posted_[r].clear();
        for (auto& layer : step_writes_[r]) layer.clear();
    }
    for (auto& [id, end] : step_advance_) {
        auto it = pushes_.find(id);
        if (it != pushes_.end()) it->second.next_send = end;
    }
    step_advance_.clear();
    // Drop handles of writes already done, so a long prompt does not pile them up.
    for (auto& entry : pushes_) {
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

// Pushes finished or failed, deadlines passed; targets and cancelled transfer ids nobody came
// for.
void PushProtocol::Pump(SteadyClock::time_point now) {
    // Sending side: pushes finished or failed, deadlines.
    std::vector<std::tuple<std::string, bool, Status>> ended;
    for (auto& [id, ps] : pushes_) {
        if (ps.state == Push::State::kBootstrapping) {
            if (now > ps.deadline) {
                ended.emplace_back(id, false,
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
                               DeadlineExceededError(
                                   fmt::format("kv push {} did not finish in time", Esc(ps.xid))));
        }
    }
    RenewBound(now);
    for (auto& [id, ok, st] : ended) {
        const bool was_bootstrapping =
            pushes_.count(id) && pushes_[id].state == Push::State::kBootstrapping;
        EndPush(id, ok, st);
        m_.Emit(
            {was_bootstrapping ? ConnectorEvent::Kind::kFailed : ConnectorEvent::Kind::kReleased,
             id, st, std::nullopt});
    }
    for (auto it = targets_.begin(); it != targets_.end();) {
        std::vector<Target>& early = it->second;
        early.erase(std::remove_if(early.begin(), early.end(),
                                   [&](const Target& t) { return now > t.deadline; }),
                    early.end());
        it = early.empty() ? targets_.erase(it) : std::next(it);
    }
    for (auto it = cancelled_xids_.begin(); it != cancelled_xids_.end();) {
        it = now > it->second ? cancelled_xids_.erase(it) : std::next(it);
    }
}

// push, decode side: name our blocks to the prefill worker under the transfer id, then wait for
// its writes.
void PushProtocol::Proceed(const std::string& id, Load& ld, Peer&) {
    ld.state = Load::State::kWaitingForInput;
    ld.deadline = ld.started + m_.cfg.bootstrap_timeout + m_.cfg.transfer_timeout;
    ld.verify = m_.VerifyRequestFor(ld.num_computed, ld.prompt_len);
    Status sent =
        m_.Send(ld.peer, msg::PushTarget{ld.params.transfer_id, id, ld.blocks, ld.num_computed,
                                         ld.prompt_len, ld.prompt_digest, ld.verify});
    if (!sent.ok()) {
        m_.FailLoad(id, UnavailableError(
                            fmt::format("kv: prefill worker '{}' is not reachable", Esc(ld.peer))));
        return;
    }
    FERRY_LOG(kInfo, "kv: request {} waiting for input from '{}' (transfer {})", Esc(id),
              Esc(ld.peer), Esc(ld.params.transfer_id));
}

// push, prefill side: the request ended. If it went well the push finishes (its last writes
// land, then the decoder hears of it) and the blocks stay until then; else it fails now.
FinishAction PushProtocol::Finished(const ConnectorRequest& r, std::span<const BlockId> blocks,
                                    bool ok, const FirstToken* first) {
    FinishAction a;
    auto it = pushes_.find(r.id);
    if (it == pushes_.end()) return a;
    Push& ps = it->second;
    if (!ok || !first || ps.state != Push::State::kReady || ps.cancelled) {
        Status err = !ps.error.ok() ? ps.error : CancelledError("the prefill request ended");
        EndPush(r.id, false, err);  // cancels its writes first: nothing reads the blocks
        return a;
    }
    ps.first = *first;
    ps.blocks.assign(blocks.begin(), blocks.end());
    ps.state = Push::State::kFinishing;
    ps.computed = SteadyClock::now();
    ps.deadline = (ps.timing ? ps.started : SteadyClock::now()) + m_.cfg.transfer_timeout;
    a.hold_blocks = true;
    m_.waker->Kick();
    return a;
}

void PushProtocol::Bind(int tp, int layers) {
    step_writes_.assign(tp, std::vector<std::vector<PlannedWrite>>(layers));
    step_posted_.clear();
    step_posted_.resize(tp);
}

void PushProtocol::CancelAll() {
    for (auto& [id, ps] : pushes_) {
        for (Transfer& x : ps.transfers) (void)x.Cancel();
    }
}

void PushProtocol::Clear() {
    pushes_.clear();
    push_by_xid_.clear();
    targets_.clear();
    cancelled_xids_.clear();
}

void PushProtocol::Count(int* bootstrapping, int* transferring) const {
    for (const auto& [id, ps] : pushes_) {
        ++*(ps.state == Push::State::kBootstrapping ? bootstrapping : transferring);
    }
}

}  // namespace ferry::kv
