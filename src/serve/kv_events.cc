#include "serve/kv_events.h"

#include <fmt/core.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/log.h"
#include "core/msgpack.h"
#include "router/kv_index.h"
#include "router/zmq_socket.h"

namespace ferry::serve {

namespace {

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

Result<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Start(KvEventsConfig config) {
    std::unique_ptr<KvEventPublisher> p(new KvEventPublisher());
    p->config_ = std::move(config);
    const KvEventsConfig& c = p->config_;
    p->ctx_ = zmq_ctx_new();
    if (!p->ctx_) return InternalError("kv events: zmq_ctx_new failed");
    p->pub_ = zmq_socket(p->ctx_, ZMQ_PUB);
    int hwm = 100000;
    zmq_setsockopt(p->pub_, ZMQ_SNDHWM, &hwm, sizeof hwm);
    // What subscribers send it (subscriptions) is a few bytes: a peer that declares more is cut.
    router::BoundZmqSocket(p->pub_, schema::kMaxKvEventRequestBytes);
    // vLLM's convention: bind a wildcard or local transport, connect to anything else.
    const std::string& ep = c.endpoint;
    const bool bind = c.bind || ep.find('*') != std::string::npos ||
                      ep.find("::") != std::string::npos || ep.rfind("ipc://", 0) == 0 ||
                      ep.rfind("inproc://", 0) == 0;
    if (!bind && ep.size() > 2 && ep.compare(ep.size() - 2, 2, ":0") == 0) {
        // zmq_connect would accept it and retry forever: nothing listens on port 0.
        return InvalidArgumentError(fmt::format(
            "--kv-events-endpoint '{}': an address without '*' is connected to (vLLM's rule), "
            "and port 0 is only for binding; to bind it give --kv-events-bind (or tcp://*:0 "
            "for every interface)",
            ep));
    }
    if ((bind ? zmq_bind(p->pub_, ep.c_str()) : zmq_connect(p->pub_, ep.c_str())) != 0) {
        return InvalidArgumentError(
            fmt::format("--kv-events-endpoint '{}': {}", ep, zmq_strerror(zmq_errno())));
    }
    p->bound_endpoint_ = bind ? LastEndpoint(p->pub_) : ep;
    p->connected_ = !bind;
    if (!bind) {
        // vLLM's rule, and easy to misread: this worker dials out to whoever listens there.
        FERRY_LOG(kInfo,
                  "kv events: connecting to {} (an address without '*' is dialed, not bound: "
                  "the subscriber listens there; --kv-events-bind binds it instead)",
                  ep);
    }
    if (!c.replay_endpoint.empty()) {
        p->replay_ = zmq_socket(p->ctx_, ZMQ_ROUTER);
        router::BoundZmqSocket(p->replay_, schema::kMaxKvEventRequestBytes);
        if (zmq_bind(p->replay_, c.replay_endpoint.c_str()) != 0) {
            return InvalidArgumentError(fmt::format("--kv-events-replay-endpoint '{}': {}",
                                                    c.replay_endpoint, zmq_strerror(zmq_errno())));
        }
        p->bound_replay_ = LastEndpoint(p->replay_);
    }
    p->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->wake_fd_ < 0) {
        return InternalError(fmt::format("kv events: eventfd: {}", std::strerror(errno)));
    }
    p->replay_tokens_ = c.replays_per_second;
    p->replay_refill_ = std::chrono::steady_clock::now();
    p->thread_ = std::thread([raw = p.get()] { raw->Loop(); });
    return p;
}

KvEventPublisher::~KvEventPublisher() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    Wake();
    if (thread_.joinable()) thread_.join();
    if (wake_fd_ >= 0) close(wake_fd_);
    if (pub_) zmq_close(pub_);
    if (replay_) zmq_close(replay_);
    if (ctx_) zmq_ctx_term(ctx_);
}

void KvEventPublisher::Publish(std::vector<schema::KvCacheEvent> events) {
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
    Wake();
}

void KvEventPublisher::Wake() {
    if (wake_fd_ < 0) return;
    const uint64_t one = 1;
    // A full counter (never, at 2^64 - 1) already wakes the thread.
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof one);
}

KvEventsStats KvEventPublisher::Stats() const {
    std::lock_guard lock(mu_);
    return stats_;
}

void KvEventPublisher::Loop() {
    for (;;) {
        // Sleeps until a batch is queued (the eventfd) or a replay request arrives: no polling.
        zmq_pollitem_t items[2] = {{nullptr, wake_fd_, ZMQ_POLLIN, 0}, {replay_, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, replay_ ? 2 : 1, -1) < 0 && zmq_errno() != EINTR) {
            FERRY_LOG(kWarn, "kv events: zmq_poll: {}", zmq_strerror(zmq_errno()));
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        if (items[0].revents & ZMQ_POLLIN) {
            uint64_t n;
            [[maybe_unused]] ssize_t r = read(wake_fd_, &n, sizeof n);
        }
        if (replay_) {
            zmq_pollitem_t item{replay_, 0, ZMQ_POLLIN, 0};
            while (zmq_poll(&item, 1, 0) > 0 && (item.revents & ZMQ_POLLIN)) ServeReplay();
        }
        for (;;) {
            std::pair<double, std::vector<schema::KvCacheEvent>> batch;
            {
                std::lock_guard lock(mu_);
                if (queue_.empty()) {
                    if (stop_) return;
                    break;
                }
                batch = std::move(queue_.front());
                queue_.pop_front();
            }
            std::string payload = schema::EncodeKvEventBatch(batch.first, batch.second,
                                                             config_.layout, config_.block_size);
            if (payload.size() > config_.max_batch_bytes && batch.second.size() > 1) {
                // Larger than a subscriber takes: two batches, in order.
                const auto half = batch.second.begin() + long(batch.second.size() / 2);
                std::vector<schema::KvCacheEvent> first(
                    std::make_move_iterator(batch.second.begin()), std::make_move_iterator(half));
                std::vector<schema::KvCacheEvent> second(
                    std::make_move_iterator(half), std::make_move_iterator(batch.second.end()));
                std::lock_guard lock(mu_);
                queue_.emplace_front(batch.first, std::move(second));
                queue_.emplace_front(batch.first, std::move(first));
                continue;
            }
            const uint64_t seq = next_seq_++;
            const bool sent = Send(pub_, config_.topic, true) &&
                              Send(pub_, schema::KvEventSeqBytes(int64_t(seq)), true) &&
                              Send(pub_, payload, false);
            if (!sent) {
                FERRY_LOG(kWarn, "kv events: batch {} not sent: {}", seq,
                          zmq_strerror(zmq_errno()));
            }
            buffer_.emplace_back(seq, std::move(payload));
            while (buffer_.size() > config_.buffer_batches) buffer_.pop_front();
            std::lock_guard lock(mu_);
            ++stats_.batches;
            stats_.events += batch.second.size();
        }
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
                Send(replay_, schema::KvEventSeqBytes(-1), true) && Send(replay_, "", false);
        }
        return;
    }
    // The budget: replays_per_second tokens, refilled continuously.
    const auto now = std::chrono::steady_clock::now();
    const double rate = config_.replays_per_second;
    replay_tokens_ = std::min(
        rate, replay_tokens_ + rate * std::chrono::duration<double>(now - replay_refill_).count());
    replay_refill_ = now;
    if (replay_tokens_ < 1) {
        uint64_t refused;
        {
            std::lock_guard lock(mu_);
            refused = ++stats_.replays_refused;
        }
        if ((refused & (refused - 1)) == 0) {  // the 1st, 2nd, 4th, ...: the log stays small
            FERRY_LOG(kWarn,
                      "kv events: replay request refused: more than {:g} a second ({} refused "
                      "so far)",
                      rate, refused);
        }
        return;
    }
    replay_tokens_ -= 1;
    uint64_t start = 0;
    for (unsigned char c : frames[2]) start = (start << 8) | c;
    for (const auto& [seq, payload] : buffer_) {
        if (seq < start) continue;
        Send(replay_, frames[0], true) && Send(replay_, "", true) &&
            Send(replay_, schema::KvEventSeqBytes(int64_t(seq)), true) &&
            Send(replay_, payload, false);
    }
    Send(replay_, frames[0], true) && Send(replay_, "", true) &&
        Send(replay_, schema::KvEventSeqBytes(-1), true) && Send(replay_, "", false);
    std::lock_guard lock(mu_);
    ++stats_.replays;
}

}  // namespace ferry::serve
