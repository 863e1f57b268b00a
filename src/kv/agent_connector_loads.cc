// The receiving side of a request, both protocols: bootstrapping, waiting for input,
// transferring, then loaded or failed (once retried if its cached peer restarted).
#include "kv/agent_connector_parts.h"

namespace ferry::kv {

using namespace connector_parts;  // NOLINT(build/namespaces): the connector's own parts

bool AgentKvConnector::Impl::RetryLoad(const std::string& id, const Status& st,
                                       const std::string& reason) {
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
    FERRY_LOG(kInfo, "kv: request {}: peer '{}' is gone ({}); handshake again and retry", Esc(id),
              Esc(ld.peer), st.ToString());
    EnsurePeer(id, ld.params);
    return true;
}

void AgentKvConnector::Impl::FailLoad(const std::string& id, Status st, const std::string& reason) {
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
        (void)Send(ld.peer, msg::HoldEnd{msg::HoldEnd::Kind::kRelease, ld.params.remote_request_id,
                                         ld.params.hold_nonce});
    }
    if (peer_ready && ld.params.mode == KvTransferMode::kPush &&
        ld.state != Load::State::kBootstrapping && ld.state != Load::State::kCancelling &&
        reason != "peer_failed" && reason != "verify") {  // (verify: the push is over)
        // The prefill worker may still be writing into our blocks: ask it to stop, and
        // release them once it says it has (or is gone, or cannot be writing any more).
        (void)Send(ld.peer, msg::PushCancel{ld.params.transfer_id, id});
        ld.state = Load::State::kCancelling;
        ld.cause = st;
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

std::optional<FirstToken> AgentKvConnector::Impl::FirstOf(const Load& ld) {
    if (!ld.params.first_token) return std::nullopt;
    return ld.acked_first;
}

std::vector<KvRankView> AgentKvConnector::Impl::RankViews() const {
    std::vector<KvRankView> v;
    for (int r = 0; r < tp; ++r) v.push_back({layouts[r], caches[r]->memory().data()});
    return v;
}

std::optional<msg::VerifyRequest> AgentKvConnector::Impl::VerifyRequestFor(int begin, int end) {
    if (cfg.verify == KvVerifyMode::kOff || end <= begin) return std::nullopt;
    msg::VerifyRequest v;
    v.begin = begin;
    v.end = end;
    v.units = ChooseUnits(
        cfg.verify,
        UnitCount(layouts[0].spec.num_layers, cfg.model_kv_heads, layouts[0].spec.Planes()), rng);
    return v;
}

Result<std::vector<uint64_t>> AgentKvConnector::Impl::SumsFor(const msg::VerifyRequest& v,
                                                              std::span<const BlockId> blocks) {
    const auto t0 = SteadyClock::now();
    auto sums = KvUnitSums(RankViews(), blocks, v.begin, v.end, v.units, cfg.model_kv_heads);
    stats.verify_seconds += std::chrono::duration<double>(SteadyClock::now() - t0).count();
    return sums;
}

Status AgentKvConnector::Impl::CheckLoad(const std::string& id, const Load& ld) {
    if (!ld.verify) return Status::Ok();
    const msg::VerifyRequest& v = *ld.verify;
    if (ld.sums.size() != v.units.size()) {
        ++stats.verify_mismatches;
        return DataLossError(fmt::format(
            "kv verify: prefill worker '{}' sent {} checksums for the {} units asked of it",
            Esc(ld.peer), ld.sums.size(), v.units.size()));
    }
    Result<std::vector<uint64_t>> ours = SumsFor(v, ld.blocks);
    if (!ours.ok()) return ours.status();
    ++stats.verified;
    stats.verify_units += v.units.size();
    auto bad = FirstMismatch(*ours, ld.sums);
    if (!bad) return Status::Ok();
    ++stats.verify_mismatches;
    size_t differ = 0;
    for (size_t i = 0; i < ours->size(); ++i) differ += (*ours)[i] != ld.sums[i] ? 1 : 0;
    return DataLossError(fmt::format(
        "kv verify: the KV of request {} that arrived from '{}' is not what it sent: {} over "
        "tokens [{}, {}) differs ({} of {} checked units differ)",
        Esc(id), Esc(ld.peer),
        UnitName(UnitOf(v.units[*bad], cfg.model_kv_heads, layouts[0].spec.Planes())), v.begin,
        v.end, differ, v.units.size()));
}

void AgentKvConnector::Impl::CompleteLoad(const std::string& id, std::optional<FirstToken> first) {
    auto it = loads.find(id);
    if (it == loads.end()) return;
    Load& ld = it->second;
    // Never a wrong answer: KV whose checksums differ from the sender's fails the request.
    if (Status v = CheckLoad(id, ld); !v.ok()) {
        FERRY_LOG(kError, "{}", v.message());
        FailLoad(id, v, "verify");
        return;
    }
    if (ld.params.mode == KvTransferMode::kPull) {
        (void)Send(ld.peer, msg::HoldEnd{msg::HoldEnd::Kind::kReadDone, ld.params.remote_request_id,
                                         ld.params.hold_nonce});
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

void AgentKvConnector::Impl::ProceedLoad(const std::string& id) {
    auto it = loads.find(id);
    if (it == loads.end()) return;
    Load& ld = it->second;
    Peer& p = peers[ld.peer];
    ld.started = SteadyClock::now();
    ProtocolOf(ld.params.mode).Proceed(id, ld, p);
}

// Reads done or failed, deadlines passed; loads that are complete.
void AgentKvConnector::Impl::PumpLoads(SteadyClock::time_point now) {
    std::vector<std::pair<std::string, Status>> fail;
    // Receiving side: reads done or failed, deadlines.
    for (auto& [id, ld] : loads) {
        if (ld.xfer.valid() && !ld.read_done) {
            auto s = ld.xfer.Poll();
            if (!s.ok()) {
                fail.emplace_back(
                    id, s.status().WithContext(fmt::format("kv read from '{}'", Esc(ld.peer))));
                continue;
            }
            if (*s == TransferState::kDone) ld.read_done = true;
        }
        if (ld.deadline != SteadyClock::time_point{} && now > ld.deadline) {
            fail.emplace_back(
                id, DeadlineExceededError(
                        fmt::format("kv transfer from '{}' did not finish in time", Esc(ld.peer))));
        }
    }
    for (auto& [id, st] : fail) {
        auto it = loads.find(id);
        if (it == loads.end()) continue;
        if (it->second.state == Load::State::kCancelling) {
            Emit({ConnectorEvent::Kind::kFailed, id, it->second.Cause(), std::nullopt});
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
}

}  // namespace ferry::kv
