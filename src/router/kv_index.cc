#include "router/kv_index.h"

#include <fmt/core.h>
#include <zmq.h>

#include <cstring>

#include "core/log.h"
#include "core/msgpack.h"
#include "router/zmq_socket.h"

namespace ferry::router {

void KvIndex::Apply(const std::string& worker, const std::vector<schema::KvCacheEvent>& events) {
    std::lock_guard lock(mu_);
    auto& blocks = by_worker_[worker];
    for (const schema::KvCacheEvent& e : events) {
        switch (e.kind) {
            case schema::KvCacheEvent::Kind::kStored:
                for (const BlockHash& h : e.hashes) {
                    if (blocks.size() >= max_blocks_) {
                        // More than any real cache: forget it all rather than grow without
                        // bound (a lying worker gets no credit, not the router's memory).
                        blocks.clear();
                        ++overflows_;
                    }
                    blocks.insert(h);
                }
                break;
            case schema::KvCacheEvent::Kind::kRemoved:
                for (const BlockHash& h : e.hashes) blocks.erase(h);
                break;
            case schema::KvCacheEvent::Kind::kAllCleared:
                blocks.clear();
                break;
        }
    }
}

void KvIndex::Clear(const std::string& worker) {
    std::lock_guard lock(mu_);
    by_worker_.erase(worker);
}

size_t KvIndex::Matched(const std::string& worker, std::span<const BlockHash> hashes) const {
    std::lock_guard lock(mu_);
    auto it = by_worker_.find(worker);
    if (it == by_worker_.end()) return 0;
    size_t n = 0;
    while (n < hashes.size() && it->second.count(hashes[n])) ++n;
    return n;
}

size_t KvIndex::Blocks(const std::string& worker) const {
    std::lock_guard lock(mu_);
    auto it = by_worker_.find(worker);
    return it == by_worker_.end() ? 0 : it->second.size();
}

uint64_t KvIndex::overflows() const {
    std::lock_guard lock(mu_);
    return overflows_;
}

struct KvEventFollower::Worker {
    std::string key;
    KvEventSource source;
    void* sub = nullptr;
    std::optional<uint64_t> last;  // the last batch applied
    // The last replay's span [replay_from, replayed], while no live batch was applied since: a
    // live batch in it is one the replay brought already (not a restart).
    std::optional<uint64_t> replayed;
    uint64_t replay_from = 0;
    bool in_sync = false;
    // A worker's replays take at most a quarter of the follower's time: each may wait up to
    // the replay timeout on this (the only) follower thread, so a worker whose every batch is a
    // gap or a restart (lying, or broken) and whose replays are slow would otherwise stall every
    // other worker's events. After a replay that took d, the next is at least 3d later; a gap
    // before then clears the worker's blocks instead (under-credit, never stale credit).
    std::chrono::steady_clock::time_point next_replay{};
    ~Worker() {
        if (sub) zmq_close(sub);
    }
};

std::unique_ptr<KvEventFollower> KvEventFollower::Start(
    std::shared_ptr<KvIndex> index, std::function<void(const std::string&, bool)> on_sync,
    std::chrono::milliseconds replay_timeout) {
    std::unique_ptr<KvEventFollower> f(new KvEventFollower());
    f->index_ = std::move(index);
    f->on_sync_ = std::move(on_sync);
    f->replay_timeout_ = replay_timeout;
    f->ctx_ = zmq_ctx_new();
    f->thread_ = std::thread([p = f.get()] { p->Loop(); });
    return f;
}

KvEventFollower::~KvEventFollower() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
    workers_.clear();  // closes the sockets
    if (ctx_) zmq_ctx_term(ctx_);
}

void KvEventFollower::SetWorkers(std::map<std::string, KvEventSource> workers) {
    std::lock_guard lock(mu_);
    if (workers == wanted_) return;
    wanted_ = std::move(workers);
    changed_ = true;
}

KvFollowerStats KvEventFollower::Stats() const {
    std::lock_guard lock(mu_);
    return stats_;
}

bool KvEventFollower::Replay(Worker& w, uint64_t from) {
    {
        std::lock_guard lock(mu_);
        ++stats_.replays;
    }
    if (w.source.replay.empty()) return false;
    void* s = zmq_socket(ctx_, ZMQ_DEALER);
    BoundZmqSocket(s, schema::kMaxKvEventBatchBytes);
    if (zmq_connect(s, w.source.replay.c_str()) != 0) {
        zmq_close(s);
        return false;
    }
    const std::string start = schema::KvEventSeqBytes(int64_t(from));
    zmq_send(s, "", 0, ZMQ_SNDMORE);
    zmq_send(s, start.data(), start.size(), 0);
    bool covered = false, first = true, ended = false;
    const auto deadline = std::chrono::steady_clock::now() + replay_timeout_;
    while (!ended && std::chrono::steady_clock::now() < deadline) {
        zmq_pollitem_t item{s, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, 50) <= 0) continue;
        std::vector<std::string> frames = ReceiveZmqFrames(s);
        if (frames.size() != 3 || !frames[0].empty()) break;  // not a replay answer
        std::optional<int64_t> seq = schema::KvEventSeqOf(frames[1]);
        if (!seq) break;
        if (*seq == -1) {
            ended = true;
            break;
        }
        if (first) covered = uint64_t(*seq) <= from;
        first = false;
        if (!w.last || uint64_t(*seq) > *w.last) Apply(w, uint64_t(*seq), frames[2]);
    }
    zmq_close(s);
    if (!ended) return false;
    w.replayed = w.last;
    w.replay_from = from;
    return covered || first;  // an empty buffer covers what it was asked for
}

void KvEventFollower::Apply(Worker& w, uint64_t seq, std::string_view payload) {
    size_t unknown = 0;
    Result<std::vector<schema::KvCacheEvent>> events =
        schema::DecodeKvEventBatch(payload, &unknown);
    std::lock_guard lock(mu_);
    stats_.unknown_events += unknown;
    if (!events.ok()) {
        ++stats_.malformed;
        FERRY_LOG(kWarn, "router: kv events of {} (batch {}) ignored: {}", w.key, seq,
                  events.status().message());
    } else {
        ++stats_.batches;
        stats_.events += events->size();
        index_->Apply(w.key, *events);
    }
    w.last = seq;
}

void KvEventFollower::Loop() {
    auto set_sync = [&](Worker& w, bool in_sync) {
        if (w.in_sync == in_sync) return;
        w.in_sync = in_sync;
        if (on_sync_) on_sync_(w.key, in_sync);
    };
    // Out of step: clear unless the replay covers what was missed, then in step again.
    auto resync = [&](Worker& w, bool from_start) {
        set_sync(w, false);
        if (from_start) {
            index_->Clear(w.key);
            w.last.reset();
        }
        const uint64_t from = w.last ? *w.last + 1 : 0;
        const auto start = std::chrono::steady_clock::now();
        bool replayed = false;
        if (start >= w.next_replay) {
            replayed = Replay(w, from);
            const auto end = std::chrono::steady_clock::now();
            w.next_replay = end + 3 * (end - start);
        } else {
            std::lock_guard lock(mu_);
            ++stats_.replays_deferred;
        }
        if (!replayed) {
            std::lock_guard lock(mu_);
            ++stats_.cleared;
            index_->Clear(w.key);  // it may have missed removals: forget, under-credit
        }
        set_sync(w, true);
    };
    for (;;) {
        std::map<std::string, KvEventSource> wanted;
        bool changed = false;
        {
            std::lock_guard lock(mu_);
            if (stop_) return;
            if (changed_) {
                wanted = wanted_;
                changed = true;
                changed_ = false;
            }
        }
        if (changed) {
            for (auto it = workers_.begin(); it != workers_.end();) {
                auto want = wanted.find(it->first);
                if (want == wanted.end() || !(want->second == it->second->source)) {
                    set_sync(*it->second, false);
                    index_->Clear(it->first);
                    it = workers_.erase(it);
                } else {
                    ++it;
                }
            }
            for (const auto& [key, source] : wanted) {
                if (workers_.count(key)) continue;
                auto w = std::make_unique<Worker>();
                w->key = key;
                w->source = source;
                w->sub = zmq_socket(ctx_, ZMQ_SUB);
                BoundZmqSocket(w->sub, schema::kMaxKvEventBatchBytes);
                zmq_setsockopt(w->sub, ZMQ_SUBSCRIBE, "", 0);
                if (zmq_connect(w->sub, source.events.c_str()) != 0) {
                    FERRY_LOG(kWarn, "router: kv events of {}: cannot subscribe to '{}': {}", key,
                              source.events.substr(0, 200), zmq_strerror(zmq_errno()));
                    continue;
                }
                Worker& ref = *w;
                workers_[key] = std::move(w);
                resync(ref, true);  // what it announced before we subscribed
            }
        }
        std::vector<zmq_pollitem_t> items;
        std::vector<Worker*> order;
        for (auto& [key, w] : workers_) {
            items.push_back({w->sub, 0, ZMQ_POLLIN, 0});
            order.push_back(w.get());
        }
        if (items.empty()) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            continue;
        }
        if (zmq_poll(items.data(), int(items.size()), 20) <= 0) continue;
        for (size_t i = 0; i < items.size(); ++i) {
            if (!(items[i].revents & ZMQ_POLLIN)) continue;
            Worker& w = *order[i];
            for (int n = 0; n < 256; ++n) {
                std::vector<std::string> frames = ReceiveZmqFrames(w.sub, 4);
                if (frames.empty()) break;
                std::optional<int64_t> seq =
                    frames.size() == 3 ? schema::KvEventSeqOf(frames[1]) : std::nullopt;
                if (!seq || *seq < 0) {
                    std::lock_guard lock(mu_);
                    ++stats_.malformed;
                    continue;
                }
                const uint64_t s = uint64_t(*seq);
                if (w.last && s <= *w.last) {
                    if (w.replayed && s >= w.replay_from && s <= *w.replayed) {
                        continue;  // the replay brought it already
                    }
                    {
                        std::lock_guard lock(mu_);
                        ++stats_.restarts;
                    }
                    FERRY_LOG(kInfo, "router: kv events of {} start again at {}: a restart", w.key,
                              s);
                    resync(w, true);
                    continue;
                }
                if (w.last ? s > *w.last + 1 : s > 0) {
                    {
                        std::lock_guard lock(mu_);
                        ++stats_.gaps;
                    }
                    resync(w, false);
                    if (w.last && s <= *w.last) continue;  // the replay brought it
                }
                Apply(w, s, frames[2]);
                w.replayed.reset();
                set_sync(w, true);
            }
        }
    }
}

}  // namespace ferry::router
