// The one-sided shm protocol of AgentCore: an initiator maps a same-host peer's agent-allocated
// regions (granted over the stream, kMapRegion) and copies into or out of them itself; the
// target revokes those grants on Deregister (kUnshare), and a peer process that goes away takes
// its mappings and its one-sided transfers with it.
#include <algorithm>
#include <condition_variable>
#include <cstring>

#include "core/log.h"
#include "transfer/agent_core.h"

namespace ferry::internal {

namespace {

// How long the first one-sided transfer to a region waits for the peer to grant its mapping
// before the peer copies it instead.
constexpr auto kMapWait = std::chrono::seconds(1);

}  // namespace

bool AgentCore::PlanOneSided(const std::shared_ptr<Peer>& peer, const std::vector<Chunk>& chunks,
                             const std::shared_ptr<Connection>& control, Clock::time_point deadline,
                             std::vector<TransferOp::LocalCopy>* work,
                             std::vector<std::shared_ptr<void>>* keep) {
    std::vector<RegionId> pending;
    LocalPlan plan = PlanLocalCopies(peer, chunks, control, work, keep, &pending);
    if (plan == LocalPlan::kPending) {
        {
            std::unique_lock<std::mutex> lock(peer->mu);
            peer->mapped_cv.wait_until(lock, std::min(deadline, Clock::now() + kMapWait), [&] {
                return std::none_of(pending.begin(), pending.end(), [&](RegionId r) {
                    auto it = peer->mapped.find(r);
                    return it != peer->mapped.end() &&
                           it->second.state == RemoteMapping::State::kPending;
                });
            });
        }
        pending.clear();
        plan = PlanLocalCopies(peer, chunks, control, work, keep, &pending);
    }
    return plan == LocalPlan::kReady;
}

AgentCore::LocalPlan AgentCore::PlanLocalCopies(const std::shared_ptr<Peer>& peer,
                                                const std::vector<Chunk>& chunks,
                                                const std::shared_ptr<Connection>& control,
                                                std::vector<TransferOp::LocalCopy>* work,
                                                std::vector<std::shared_ptr<void>>* keep,
                                                std::vector<RegionId>* pending) {
    std::vector<std::pair<RegionId, uint64_t>> request;
    bool ok = true;
    {
        std::lock_guard<std::mutex> lock(peer->mu);
        work->reserve(chunks.size());
        const RemoteMapping* last = nullptr;
        RegionId last_id = 0;
        for (const Chunk& c : chunks) {
            TransferOp::LocalCopy copy;
            copy.local = c.local;
            copy.remote.reserve(c.remote.size());
            for (const wire::Segment& seg : c.remote) {
                if (last == nullptr || last_id != seg.region) {
                    auto it = peer->mapped.find(seg.region);
                    if (it == peer->mapped.end()) {
                        peer->mapped[seg.region] =
                            RemoteMapping{RemoteMapping::State::kPending, seg.key, 0, nullptr};
                        request.emplace_back(seg.region, seg.key);
                        pending->push_back(seg.region);
                        ok = false;
                        break;
                    }
                    last = &it->second;
                    last_id = seg.region;
                    if (last->state == RemoteMapping::State::kPending) {
                        pending->push_back(seg.region);
                    }
                    if (last->state != RemoteMapping::State::kGranted) {
                        ok = false;
                        break;
                    }
                    keep->push_back(last->map);
                }
                // The key the peer checked, and the bounds of what it granted: never our copy of
                // its metadata (which a stale or forged blob could have changed). Anything else
                // goes to the peer, which refuses it with the right code.
                if (seg.key != last->key || seg.offset > last->map->length ||
                    seg.length > last->map->length - seg.offset) {
                    ok = false;
                    break;
                }
                copy.remote.push_back(iovec{last->map->base + seg.offset, seg.length});
            }
            if (!ok) {
                break;
            }
            work->push_back(std::move(copy));
        }
    }
    for (const auto& [region, key] : request) {
        RequestMapping(peer, control, region, key);
    }
    if (!ok) {
        work->clear();
        keep->clear();
        return pending->empty() ? LocalPlan::kRefused : LocalPlan::kPending;
    }
    return LocalPlan::kReady;
}

void AgentCore::RequestMapping(const std::shared_ptr<Peer>& peer,
                               const std::shared_ptr<Connection>& control, RegionId region,
                               uint64_t key) {
    OutFrame f;
    f.request_id = NextRequestId();
    f.head = wire::MakeFrame(wire::FrameType::kMapRegion, f.request_id,
                             wire::EncodeMapRequest({region, key}));
    f.expects_response = true;
    std::weak_ptr<Peer> weak_peer = peer;
    std::weak_ptr<Connection> weak_conn = control;
    f.expect.callback = [this, weak_peer, weak_conn, region](const Status& s,
                                                             std::string_view body) {
        std::shared_ptr<Peer> p = weak_peer.lock();
        if (!p) {
            return;
        }
        std::shared_ptr<PeerMapping> map;
        uint64_t share_id = 0;
        Status why = s;
        if (s.ok()) {
            Result<wire::SharedRegion> grant = wire::DecodeRegionGrant(body);
            std::shared_ptr<Connection> c = weak_conn.lock();
            if (!grant.ok()) {
                why = grant.status();
            } else if (!c || c->peer_pid() == 0) {
                why = UnavailableError("stream closed");
            } else {
                share_id = grant->share_id;
                map = peer_memory_.Map(c->peer_pid(), *grant);
                if (!map) {
                    why = FailedPreconditionError("cannot map the granted memfd");
                }
            }
        }
        std::lock_guard<std::mutex> lock(p->mu);
        p->mapped_cv.notify_all();
        auto it = p->mapped.find(region);
        if (it == p->mapped.end() || it->second.state != RemoteMapping::State::kPending) {
            return;
        }
        if (map) {
            it->second.state = RemoteMapping::State::kGranted;
            it->second.share_id = share_id;
            it->second.map = std::move(map);
        } else if (why.code() == Code::kUnavailable || why.code() == Code::kCancelled) {
            p->mapped.erase(it);  // the stream went away: ask again next time
        } else {
            // Not mappable (registered user memory, a wrong key, ...): the peer copies.
            FERRY_LOG(kDebug, "peer {} region {}: copied by the peer ({})", p->md.name, region,
                      why.ToString());
            it->second.state = RemoteMapping::State::kRefused;
        }
    };
    control->Send(std::move(f));
}

void AgentCore::HandleUnshare(Connection& conn, const wire::FrameHeader& h, std::string_view body) {
    uint64_t share_id = 0;
    if (body.size() != sizeof(share_id) || conn.peer_pid() == 0) {
        conn.Close(InvalidArgumentError("malformed unshare frame"));
        return;
    }
    std::memcpy(&share_id, body.data(), sizeof(share_id));
    peer_memory_.Forget(conn.peer_pid(), share_id);
    if (conn.role() == Connection::Role::kClient) {
        // A target deregistered a region we may copy into ourselves: forget the mapping and the
        // region, so that later transfers to it fail here with NotFound.
        if (std::shared_ptr<Peer> peer = peers_.Find(conn.peer_name())) {
            std::lock_guard<std::mutex> lock(peer->mu);
            if (peer->md.epoch == conn.peer_epoch()) {
                for (auto it = peer->mapped.begin(); it != peer->mapped.end();) {
                    if (it->second.share_id == share_id) {
                        RegionId gone = it->first;
                        std::erase_if(peer->md.regions,
                                      [gone](const RemoteRegion& r) { return r.id == gone; });
                        it = peer->mapped.erase(it);
                    } else {
                        ++it;
                    }
                }
            }
        }
    }
    if (h.request_id != 0) {
        StreamTarget::Respond(conn, h.request_id, Status::Ok());
    }
}

void AgentCore::RevokeGrants(uint64_t share_id, RegionId id) {
    std::vector<std::shared_ptr<Connection>> conns = peer_memory_.TakeGrants(share_id);
    if (conns.empty()) {
        return;
    }
    struct Acks {
        std::mutex mu;
        std::condition_variable cv;
        size_t left = 0;
    };
    auto acks = std::make_shared<Acks>();
    acks->left = conns.size();
    std::string body(sizeof(share_id), '\0');
    std::memcpy(body.data(), &share_id, sizeof(share_id));
    std::vector<std::shared_ptr<bool>> answered;
    for (auto& c : conns) {
        auto done = std::make_shared<bool>(false);
        answered.push_back(done);
        OutFrame f;
        f.request_id = NextRequestId();
        f.head = wire::MakeFrame(wire::FrameType::kUnshare, f.request_id, body);
        f.expects_response = true;
        f.expect.callback = [acks, done](const Status&, std::string_view) {
            std::lock_guard<std::mutex> lock(acks->mu);
            *done = true;  // an answer, or the stream closed: either way the peer stopped
            --acks->left;
            acks->cv.notify_all();
        };
        c->Send(std::move(f));
    }
    std::unique_lock<std::mutex> lock(acks->mu);
    acks->cv.wait_for(lock, kDeregisterGrace, [&] { return acks->left == 0; });
    for (size_t i = 0; i < conns.size(); ++i) {
        if (!*answered[i]) {
            lock.unlock();
            conns[i]->CloseAndWait(UnavailableError("peer did not release its mapping of region " +
                                                    std::to_string(id) + " in time"));
            lock.lock();
        }
    }
}

void AgentCore::BroadcastUnshare(uint64_t share_id) {
    std::vector<std::shared_ptr<Connection>> conns;
    for (auto& c : links_.Snapshot()) {
        const Backend* b = FindBackend(c->backend());
        if (c->role() == Connection::Role::kClient && b != nullptr &&
            b->data_mode() == wire::DataMode::kCma && !c->closed()) {
            conns.push_back(std::move(c));
        }
    }
    std::string body(sizeof(share_id), '\0');
    std::memcpy(body.data(), &share_id, sizeof(share_id));
    for (auto& c : conns) {
        OutFrame f;
        f.head = wire::MakeFrame(wire::FrameType::kUnshare, 0, body);
        c->Send(std::move(f));
    }
}

void AgentCore::PeerProcessGone(Connection& conn, const Status& why) {
    if (conn.role() == Connection::Role::kClient) {
        // The last stream to the peer process closed. One-sided transfers have no request on it
        // to fail with it: the process they copy into may be gone, so they fail as its other
        // transfers do.
        std::vector<std::shared_ptr<TransferOp>> orphans;
        {
            std::lock_guard<std::mutex> lock(ops_mu_);
            for (auto& [id, w] : ops_) {
                auto op = w.lock();
                if (op && op->peer() == conn.peer_name() &&
                    op->one_sided_epoch() == conn.peer_epoch() && !op->finished()) {
                    orphans.push_back(std::move(op));
                }
            }
        }
        for (auto& op : orphans) {
            op->Fail(
                UnavailableError("streams to " + conn.peer_name() + " closed: " + why.message()));
        }
    }
    // The peer process is gone (or idle): release what we mapped of it, so that a dead peer's
    // memory is not kept alive here.
    peer_memory_.ForgetProcess(conn.peer_pid());
    if (conn.role() == Connection::Role::kClient) {
        if (std::shared_ptr<Peer> peer = peers_.Find(conn.peer_name())) {
            std::lock_guard<std::mutex> lock(peer->mu);
            if (peer->md.epoch == conn.peer_epoch()) {
                peer->mapped.clear();
            }
        }
    }
}

}  // namespace ferry::internal
