// push (layer-wise): the prefill side binds a decoder's block list to its request, WRITEs each
// layer as it is stored, and ends the push; the decode side hears how it ended.
#include "kv/agent_connector_parts.h"

namespace ferry::kv {

Status AgentKvConnector::Impl::SendPushFailed(const std::string& peer, const std::string& xid,
                                              const std::string& lid, std::string error) {
    return Send(
        peer, msg::PushEnd{msg::PushEnd::Kind::kFailed, xid, lid, std::nullopt, std::move(error)});
}

bool AgentKvConnector::Impl::BindTarget(const std::string& id, Push& ps, Target t) {
    if (t.prompt_digest != ps.prompt_digest || t.len != ps.prompt_len) {
        Status st = FailedPreconditionError(fmt::format(
            "kv push {}: the decoder's prompt ({} tokens) is not this prefill's ({} tokens)",
            Esc(ps.xid), t.len, ps.prompt_len));
        (void)SendPushFailed(t.peer, ps.xid, t.lid, st.message());
        ps.error = st;
        return false;
    }
    // The decoder's blocks are of its own size (the handshake said which).
    auto peer = peers.find(t.peer);
    const int dbt = peer != peers.end() && peer->second.state == Peer::State::kReady
                        ? peer->second.ranks[0].layout.spec.block_tokens
                        : bt();
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
    FERRY_LOG(kInfo, "kv: request {} has its target: '{}' from token {} (transfer {})", Esc(id),
              Esc(ps.peer), ps.next_send, Esc(ps.xid));
    return true;
}

void AgentKvConnector::Impl::EndPush(const std::string& id, bool ok, const Status& err) {
    auto it = pushes.find(id);
    if (it == pushes.end()) return;
    Push& ps = it->second;
    for (Transfer& x : ps.transfers) (void)x.Cancel();
    Status failed = err;
    msg::PushEnd done{msg::PushEnd::Kind::kDone, ps.xid, ps.lid, ps.first, "", {}};
    if (ok && ps.verify) {
        // --kv-verify: our checksums of what we wrote (our blocks are held until the push ends).
        auto sums = SumsFor(*ps.verify, ps.blocks);
        if (sums.ok()) {
            done.sums = std::move(*sums);
        } else {
            ok = false;
            failed = sums.status().WithContext(fmt::format("kv push {}", Esc(ps.xid)));
        }
    }
    if (ok) {
        (void)Send(ps.peer, done);
        ++stats.succeeded;
        stats.bytes_written += ps.bytes;
        if (ps.timing) {
            RecordTime(ps.started);
            stats.transfer_exposed_seconds_sum +=
                std::chrono::duration<double>(SteadyClock::now() - ps.computed).count();
            ++stats.transfer_exposed_count;
        }
        FERRY_LOG(kInfo, "kv: request {} pushed {} bytes to '{}'", Esc(id), ps.bytes, Esc(ps.peer));
    } else {
        if (!ps.peer.empty()) {
            (void)SendPushFailed(ps.peer, ps.xid, ps.lid, failed.message());
        }
        CountFailure(failed);
        FERRY_LOG(kInfo, "kv: request {} push failed: {}", Esc(id), failed.ToString());
    }
    push_by_xid.erase(ps.xid);
    pushes.erase(it);
}

Status AgentKvConnector::Impl::On(const std::string& from, msg::PushTarget& m) {
    Target tg;
    tg.peer = from;
    tg.lid = m.lid;
    tg.blocks = std::move(m.blocks);
    tg.from = m.from;
    tg.len = m.len;
    tg.prompt_digest = m.prompt;
    tg.verify = std::move(m.verify);
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

Status AgentKvConnector::Impl::On(const std::string& from, msg::PushCancel& m) {
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
    (void)Send(from, msg::PushEnd{msg::PushEnd::Kind::kCancelled, m.xid, m.lid, std::nullopt, ""});
    return Status::Ok();
}

Status AgentKvConnector::Impl::On(const std::string& from, msg::PushEnd& m) {
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
    ld.sums = std::move(m.sums);
    CompleteLoad(m.lid, std::move(m.first));
    return Status::Ok();
}

void AgentKvConnector::Impl::OnLayerStored(int rank, int layer) {
    for (PlannedWrite& w : step_writes[rank][layer]) {
        Result<Transfer> x = agent->PostWrite(
            w.local, w.peer, w.remote, {.timeout = cfg.transfer_timeout, .backend = cfg.backend});
        step_posted[rank].push_back({w.id, std::move(x), w.bytes, w.local.size()});
    }
}

// push, prefill side: a request runs once the decoder's blocks are known (its target may have
// come first); until then it is parked.
bool AgentKvConnector::Impl::PushReadyToSchedule(const ConnectorRequest& r,
                                                 const KvTransferParams& p) {
    Impl& m = *this;
    auto it = m.pushes.find(r.id);
    if (it != m.pushes.end()) return it->second.state != Push::State::kBootstrapping;
    Push& ps = m.pushes[r.id];
    ps.xid = p.transfer_id;
    ps.prompt_digest = PromptDigest(r.prompt, r.mm);
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

LayerHook* AgentKvConnector::BeginStep(std::span<const StepChunk> chunks) {
    Impl& m = *impl_;
    std::lock_guard lock(m.mu);
    if (!m.bound) return nullptr;
    bool any = false;
    for (const StepChunk& c : chunks) {
        const KvTransferParams& cp = AsKvTransferParams(*c.params);
        if (!cp.do_remote_decode || cp.mode != KvTransferMode::kPush) continue;
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
        // Each of our ranks writes its heads to every peer rank that holds some of them, layer
        // by layer as that rank computes them.
        for (const auto& [r, pr] : m.RankPairs(pit->second.ranks, false)) {
            for (int l = 0; l < m.layouts[r].spec.num_layers && ps.error.ok(); ++l) {
                KvMove move{c.block_table, ps.target, ps.next_send, end, l, l + 1};
                auto plan = PlanKvMove(m.layouts[r], pit->second.ranks[pr].layout, move);
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
                        {pit->second.ranks[pr].region, b.offset, b.length, b.stride, b.count});
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

// Pushes finished or failed, deadlines passed; targets and cancelled transfer ids nobody came
// for.
void AgentKvConnector::Impl::PumpPushes(SteadyClock::time_point now) {
    // Sending side: pushes finished or failed, deadlines.
    std::vector<std::tuple<std::string, bool, Status>> ended;
    for (auto& [id, ps] : pushes) {
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
    for (auto& [id, ok, st] : ended) {
        const bool was_bootstrapping =
            pushes.count(id) && pushes[id].state == Push::State::kBootstrapping;
        EndPush(id, ok, st);
        Emit({was_bootstrapping ? ConnectorEvent::Kind::kFailed : ConnectorEvent::Kind::kReleased,
              id, st, std::nullopt});
    }
    for (auto it = targets.begin(); it != targets.end();) {
        it = now > it->second.deadline ? targets.erase(it) : std::next(it);
    }
    for (auto it = cancelled_xids.begin(); it != cancelled_xids.end();) {
        it = now > it->second ? cancelled_xids.erase(it) : std::next(it);
    }
}

// push, decode side: name our blocks to the prefill worker under the transfer id, then wait for
// its writes.
void AgentKvConnector::Impl::ProceedPush(const std::string& id, Load& ld) {
    ld.state = Load::State::kWaitingForInput;
    ld.deadline = ld.started + cfg.bootstrap_timeout + cfg.transfer_timeout;
    ld.verify = VerifyRequestFor(ld.num_computed, ld.prompt_len);
    Status sent =
        Send(ld.peer, msg::PushTarget{ld.params.transfer_id, id, ld.blocks, ld.num_computed,
                                      ld.prompt_len, ld.prompt_digest, ld.verify});
    if (!sent.ok()) {
        FailLoad(id, UnavailableError(
                         fmt::format("kv: prefill worker '{}' is not reachable", Esc(ld.peer))));
        return;
    }
    FERRY_LOG(kInfo, "kv: request {} waiting for input from '{}' (transfer {})", Esc(id),
              Esc(ld.peer), Esc(ld.params.transfer_id));
}

// push, prefill side: the request ended. If it went well the push finishes (its last writes
// land, then the decoder hears of it) and the blocks stay until then; else it fails now.
FinishAction AgentKvConnector::Impl::FinishPush(const ConnectorRequest& r,
                                                std::span<const BlockId> blocks, bool ok,
                                                const FirstToken* first) {
    FinishAction a;
    auto it = pushes.find(r.id);
    if (it == pushes.end()) return a;
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
    ps.deadline = (ps.timing ? ps.started : SteadyClock::now()) + cfg.transfer_timeout;
    a.hold_blocks = true;
    waker->Kick();
    return a;
}

namespace {

class PushProtocol final : public TransferProtocol {
  public:
    explicit PushProtocol(AgentKvConnector::Impl& m) : m_(m) {}
    bool ReadyToSchedule(const ConnectorRequest& r, const KvTransferParams& p) override {
        return m_.PushReadyToSchedule(r, p);
    }
    FinishAction Finished(const ConnectorRequest& r, std::span<const BlockId> blocks, bool ok,
                          const FirstToken* first) override {
        return m_.FinishPush(r, blocks, ok, first);
    }
    // Every prompt token not already here is written by the prefill worker.
    int ExternalTokens(const KvTransferParams&, int prompt_len, int num_computed) const override {
        return prompt_len - num_computed;
    }
    void Proceed(const std::string& id, Load& ld, Peer&) override { m_.ProceedPush(id, ld); }
    void Pump(SteadyClock::time_point now) override { m_.PumpPushes(now); }

  private:
    AgentKvConnector::Impl& m_;
};

}  // namespace

std::unique_ptr<TransferProtocol> MakePushProtocol(AgentKvConnector::Impl& m) {
    return std::make_unique<PushProtocol>(m);
}

}  // namespace ferry::kv
