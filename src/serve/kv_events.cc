#include "serve/kv_events.h"

#include <fmt/core.h>
#include <zmq.h>

#include <chrono>
#include <cstring>

#include "core/log.h"
#include "core/msgpack.h"
#include "router/kv_index.h"

namespace ferry::serve {

namespace {

using Msgpack = MsgpackWriter;

void Hash(Msgpack& m, const BlockHash& h, KvEventsLayout layout) {
    if (layout == KvEventsLayout::kLegacy) {
        m.Uint(BlockHashToInt(h));
    } else {
        m.Bin(h.data(), h.size());
    }
}

void Hashes(Msgpack& m, const std::vector<BlockHash>& hs, KvEventsLayout layout) {
    m.Array(hs.size());
    for (const BlockHash& h : hs) Hash(m, h, layout);
}

void Event(Msgpack& m, const kv::KvCacheEvent& e, KvEventsLayout layout, int block_size) {
    using Kind = kv::KvCacheEvent::Kind;
    const bool legacy = layout == KvEventsLayout::kLegacy;
    auto key = [&](const char* k) {
        if (!legacy) m.Str(k);
    };
    switch (e.kind) {
        case Kind::kStored:
            legacy ? m.Array(7) : m.Map(9);
            key("type");
            m.Str("BlockStored");
            key("block_hashes");
            Hashes(m, e.hashes, layout);
            key("parent_block_hash");
            e.parent ? Hash(m, *e.parent, layout) : m.Nil();
            key("token_ids");
            m.Array(e.tokens.size());
            for (int32_t t : e.tokens) m.Int(t);
            key("block_size");
            m.Int(block_size);
            key("lora_id");
            m.Nil();
            key("medium");
            m.Str("GPU");
            if (!legacy) {
                m.Str("lora_name");
                m.Nil();
                m.Str("group_idx");
                m.Uint(0);
            }
            break;
        case Kind::kRemoved:
            legacy ? m.Array(3) : m.Map(4);
            key("type");
            m.Str("BlockRemoved");
            key("block_hashes");
            Hashes(m, e.hashes, layout);
            key("medium");
            m.Str("GPU");
            if (!legacy) {
                m.Str("group_idx");
                m.Uint(0);
            }
            break;
        case Kind::kAllCleared:
            legacy ? m.Array(1) : m.Map(1);
            key("type");
            m.Str("AllBlocksCleared");
            break;
    }
}

bool Send(void* socket, const std::string& frame, bool more) {
    return zmq_send(socket, frame.data(), frame.size(), more ? ZMQ_SNDMORE : 0) >= 0;
}

std::string LastEndpoint(void* socket) {
    char buf[256];
    size_t n = sizeof buf;
    if (zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, buf, &n) != 0 || n == 0) return "";
    return std::string(buf, strnlen(buf, n));
}

}  // namespace

Result<KvEventsLayout> ParseKvEventsLayout(std::string_view name) {
    if (name == "vllm") return KvEventsLayout::kVllm;
    if (name == "legacy") return KvEventsLayout::kLegacy;
    return InvalidArgumentError(
        fmt::format("kv events layout '{}' is not one of vllm, legacy", name));
}

std::string EncodeKvEventBatch(double ts, std::span<const kv::KvCacheEvent> events,
                               KvEventsLayout layout, int block_size) {
    Msgpack m;
    const bool legacy = layout == KvEventsLayout::kLegacy;
    if (legacy) {
        m.Array(2);
    } else {
        m.Map(3);
        m.Str("ts");
    }
    m.Float(ts);
    if (!legacy) m.Str("events");
    m.Array(events.size());
    for (const kv::KvCacheEvent& e : events) Event(m, e, layout, block_size);
    if (!legacy) {
        m.Str("data_parallel_rank");
        m.Uint(0);
    }
    return m.Take();
}

Result<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Start(KvEventsConfig config) {
    std::unique_ptr<KvEventPublisher> p(new KvEventPublisher());
    p->config_ = std::move(config);
    const KvEventsConfig& c = p->config_;
    p->ctx_ = zmq_ctx_new();
    if (!p->ctx_) return InternalError("kv events: zmq_ctx_new failed");
    p->pub_ = zmq_socket(p->ctx_, ZMQ_PUB);
    int hwm = 100000, linger = 0;
    zmq_setsockopt(p->pub_, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(p->pub_, ZMQ_LINGER, &linger, sizeof linger);
    // vLLM's convention: bind a wildcard or local transport, connect to anything else.
    const std::string& ep = c.endpoint;
    const bool bind = ep.find('*') != std::string::npos || ep.find("::") != std::string::npos ||
                      ep.rfind("ipc://", 0) == 0 || ep.rfind("inproc://", 0) == 0;
    if (!bind && ep.size() > 2 && ep.compare(ep.size() - 2, 2, ":0") == 0) {
        // zmq_connect would accept it and retry forever: nothing listens on port 0.
        return InvalidArgumentError(fmt::format(
            "--kv-events-endpoint '{}': an address without '*' is connected to (vLLM's rule), "
            "and port 0 is only for binding; to bind any port on this address give "
            "tcp://*:0",
            ep));
    }
    if ((bind ? zmq_bind(p->pub_, ep.c_str()) : zmq_connect(p->pub_, ep.c_str())) != 0) {
        return InvalidArgumentError(
            fmt::format("--kv-events-endpoint '{}': {}", ep, zmq_strerror(zmq_errno())));
    }
    p->bound_endpoint_ = bind ? LastEndpoint(p->pub_) : ep;
    if (!c.replay_endpoint.empty()) {
        p->replay_ = zmq_socket(p->ctx_, ZMQ_ROUTER);
        zmq_setsockopt(p->replay_, ZMQ_LINGER, &linger, sizeof linger);
        if (zmq_bind(p->replay_, c.replay_endpoint.c_str()) != 0) {
            return InvalidArgumentError(fmt::format("--kv-events-replay-endpoint '{}': {}",
                                                    c.replay_endpoint, zmq_strerror(zmq_errno())));
        }
        p->bound_replay_ = LastEndpoint(p->replay_);
    }
    p->thread_ = std::thread([raw = p.get()] { raw->Loop(); });
    return p;
}

KvEventPublisher::~KvEventPublisher() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    if (pub_) zmq_close(pub_);
    if (replay_) zmq_close(replay_);
    if (ctx_) zmq_ctx_term(ctx_);
}

void KvEventPublisher::Publish(std::vector<kv::KvCacheEvent> events) {
    if (events.empty()) return;
    const double ts =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    {
        std::lock_guard lock(mu_);
        if (queue_.size() >= config_.max_queue) {
            ++stats_.dropped;  // a subscriber sees the gap in the sequence numbers
            return;
        }
        queue_.emplace_back(ts, std::move(events));
    }
    cv_.notify_one();
}

KvEventsStats KvEventPublisher::Stats() const {
    std::lock_guard lock(mu_);
    return stats_;
}

void KvEventPublisher::Loop() {
    for (;;) {
        if (replay_) {
            zmq_pollitem_t item{replay_, 0, ZMQ_POLLIN, 0};
            while (zmq_poll(&item, 1, 0) > 0 && (item.revents & ZMQ_POLLIN)) ServeReplay();
        }
        std::pair<double, std::vector<kv::KvCacheEvent>> batch;
        {
            std::unique_lock lock(mu_);
            // With a replay socket, look at it every 10 ms; a batch wakes this at once.
            cv_.wait_for(lock, std::chrono::milliseconds(replay_ ? 10 : 200),
                         [&] { return stop_ || !queue_.empty(); });
            if (queue_.empty()) {
                if (stop_) return;
                continue;
            }
            batch = std::move(queue_.front());
            queue_.pop_front();
        }
        std::string payload =
            EncodeKvEventBatch(batch.first, batch.second, config_.layout, config_.block_size);
        const uint64_t seq = next_seq_++;
        const bool sent = Send(pub_, config_.topic, true) &&
                          Send(pub_, router::KvEventSeqBytes(int64_t(seq)), true) &&
                          Send(pub_, payload, false);
        if (!sent)
            FERRY_LOG(kWarn, "kv events: batch {} not sent: {}", seq, zmq_strerror(zmq_errno()));
        buffer_.emplace_back(seq, std::move(payload));
        while (buffer_.size() > config_.buffer_batches) buffer_.pop_front();
        std::lock_guard lock(mu_);
        ++stats_.batches;
        stats_.events += batch.second.size();
    }
}

void KvEventPublisher::ServeReplay() {
    // A REQ client's request: identity, empty delimiter, 8-byte start sequence.
    std::vector<std::string> frames = router::ReceiveZmqFrames(replay_);
    if (frames.empty()) return;
    if (frames.size() != 3 || !frames[1].empty() || frames[2].size() != 8) {
        FERRY_LOG(kWarn,
                  "kv events: replay request of {} frames ignored (want identity, empty, "
                  "an 8-byte sequence number)",
                  frames.size());
        if (frames.size() >= 2 && frames[1].empty()) {
            // Still answer a REQ client (it waits for a reply): the end marker alone.
            Send(replay_, frames[0], true) && Send(replay_, "", true) &&
                Send(replay_, router::KvEventSeqBytes(-1), true) && Send(replay_, "", false);
        }
        return;
    }
    uint64_t start = 0;
    for (unsigned char c : frames[2]) start = (start << 8) | c;
    for (const auto& [seq, payload] : buffer_) {
        if (seq < start) continue;
        Send(replay_, frames[0], true) && Send(replay_, "", true) &&
            Send(replay_, router::KvEventSeqBytes(int64_t(seq)), true) &&
            Send(replay_, payload, false);
    }
    Send(replay_, frames[0], true) && Send(replay_, "", true) &&
        Send(replay_, router::KvEventSeqBytes(-1), true) && Send(replay_, "", false);
    std::lock_guard lock(mu_);
    ++stats_.replays;
}

}  // namespace ferry::serve
