#include "transfer/connection.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>

#include "core/log.h"
#include "core/tsan.h"
#include "transfer/metadata.h"

namespace ferry::internal {

namespace {

// An authenticated connection's read buffer: frame headers and small bodies (payloads go
// straight to their destination). A bigger body grows it for as long as it takes.
constexpr size_t kReadBufferSize = 64 * 1024;
constexpr size_t kSmallRead = 4096;
constexpr int kMaxFramesPerEvent = 64;
constexpr size_t kMaxIovPerCall = 256;
constexpr size_t kMaxBytesPerEvent = 32u << 20;  // fairness between connections on one loop
constexpr size_t kZeroBufSize = 1u << 20;

const char* ZeroBuffer() {
    static const std::vector<char> zeros(kZeroBufSize, 0);
    return zeros.data();
}

// Discard target for payloads nobody may receive.
char* ScratchBuffer() {
    static thread_local std::vector<char> scratch(kReadBufferSize);
    return scratch.data();
}

}  // namespace

std::shared_ptr<Connection> Connection::Create(IoLoop* loop, ScopedFd fd, Role role,
                                               HandshakeConfig config, ConnectionOwner* owner,
                                               std::string label, bool connecting) {
    return std::shared_ptr<Connection>(new Connection(loop, std::move(fd), role, std::move(config),
                                                      owner, std::move(label), connecting));
}

Connection::Connection(IoLoop* loop, ScopedFd fd, Role role, HandshakeConfig config,
                       ConnectionOwner* owner, std::string label, bool connecting)
    : loop_(loop),
      fd_(std::move(fd)),
      role_(role),
      config_(std::move(config)),
      owner_(owner),
      label_(std::move(label)),
      created_(std::chrono::steady_clock::now()),
      handshake_(role == Role::kServer ? Handshake::Side::kServer : Handshake::Side::kClient,
                 config_, label_, [this](const wire::Hello& h) { return VerifyCmaProbe(h); }),
      connecting_(connecting),
      state_(role == Role::kServer ? State::kHandshake : State::kConnecting),
      rbuf_(role == Role::kServer ? kHandshakeBufferSize : kReadBufferSize) {}

Connection::~Connection() = default;

void Connection::Start() {
    auto self = shared_from_this();
    loop_->Post([self] {
        if (self->closed_.load()) {
            return;
        }
        uint32_t events = EPOLLIN | EPOLLRDHUP;
        if (self->state_ == State::kConnecting && self->connecting_) {
            events |= EPOLLOUT;
        }
        Status s = self->loop_->Watch(self->fd_.get(), events, self);
        if (!s.ok()) {
            self->CloseNow(s);
            return;
        }
        if (self->state_ == State::kConnecting && !self->connecting_) {
            // Client socket already connected (blocking connect or socketpair).
            self->OnEvents(EPOLLOUT);
        }
    });
}

void Connection::Send(OutFrame f) {
    bool post = false;
    {
        std::lock_guard<std::mutex> lock(in_mu_);
        if (!in_closed_) {
            incoming_.push_back(std::move(f));
            if (!flush_posted_) {
                flush_posted_ = true;
                post = true;
            }
            f.expects_response = false;
        }
    }
    if (f.expects_response) {  // not queued: the connection is closed
        f.expect.Fail(ClosedFailure());
        return;
    }
    if (post) {
        auto self = shared_from_this();
        loop_->Post([self] { self->FlushIncoming(); });
    }
}

void Connection::Close(const Status& why) {
    if (closed_.load()) {
        return;
    }
    auto self = shared_from_this();
    loop_->Post([self, why] { self->CloseNow(why); });
}

void Connection::CloseAndWait(const Status& why) {
    auto self = shared_from_this();
    if (!loop_->RunSync([self, why] { self->CloseNow(why); })) {
        // Loop stopped: nothing runs on it any more, so nothing touches memory either.
        closed_.store(true);
    }
}

void Connection::FlushIncoming() {
    std::vector<OutFrame> frames;
    {
        std::lock_guard<std::mutex> lock(in_mu_);
        frames.swap(incoming_);
        flush_posted_ = false;
    }
    for (OutFrame& f : frames) {
        Enqueue(std::move(f));
    }
    TryWrite();
}

void Connection::SendNow(OutFrame f) {
    Enqueue(std::move(f));
    TryWrite();
}

void Connection::Enqueue(OutFrame f) {
    if (closed_.load()) {
        if (f.expects_response) {
            f.expect.Fail(ClosedFailure());
        }
        return;
    }
    if (state_ != State::kReady) {
        held_.push_back(std::move(f));
        return;
    }
    if (f.expects_response) {
        pending_.Expect(f.request_id, std::move(f.expect));
        f.expects_response = false;
    }
    if (config_.counters) config_.counters->sent.fetch_add(1, std::memory_order_relaxed);
    sendq_.push_back(std::move(f));
}

void Connection::SendHandshakeFrames(std::vector<std::string> frames) {
    for (std::string& frame : frames) {
        OutFrame f;
        f.head = std::move(frame);
        sendq_.push_back(std::move(f));
    }
    TryWrite();
}

void Connection::BecomeReady() {
    ucred cred{};
    socklen_t len = sizeof(cred);
    sockaddr_storage addr{};
    socklen_t alen = sizeof(addr);
    if (getsockname(fd_.get(), reinterpret_cast<sockaddr*>(&addr), &alen) == 0 &&
        addr.ss_family == AF_UNIX &&
        getsockopt(fd_.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid > 0) {
        peer_pid_.store(cred.pid, std::memory_order_release);
    }
    state_ = State::kReady;
    ready_.store(true);
    owner_->OnReady(*this);
    std::vector<OutFrame> held;
    held.swap(held_);
    for (OutFrame& f : held) {
        Enqueue(std::move(f));
    }
    TryWrite();
}

void Connection::SetPayloadSink(PayloadSink sink) {
    sink_ = std::move(sink);
    sink_pos_ = IovCursor{};
}

bool Connection::HoldsRegion(RegionId id) const {
    auto holds = [id](const std::vector<RegionPin>& pins) {
        for (const RegionPin& p : pins) {
            if (p.entry() != nullptr && p.entry()->id == id) {
                return true;
            }
        }
        return false;
    };
    if (in_payload_ && holds(sink_.pins)) {
        return true;
    }
    return !sendq_.empty() && front_started_ && holds(sendq_.front().pins);
}

bool Connection::PeerStillThere() const {
    char c;
    ssize_t r = recv(fd_.get(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return !(r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR));
}

void Connection::CloseNow(const Status& why) {
    if (closed_.exchange(true)) {
        return;
    }
    Status failure = FailureFor(why);
    std::vector<OutFrame> incoming;
    {
        std::lock_guard<std::mutex> lock(in_mu_);
        in_closed_ = true;
        close_failure_ = failure;
        incoming.swap(incoming_);
    }
    if (why.code() == Code::kUnavailable || why.code() == Code::kCancelled) {
        FERRY_LOG(kInfo, "{}: {}: closed: {}", config_.backend, label_, why.ToString());
    } else {
        FERRY_LOG(kWarn, "{}: {}: closing: {}", config_.backend, label_, why.ToString());
    }
    if (fd_.valid()) {
        loop_->Unwatch(fd_.get());
        fd_.Reset();
    }
    std::vector<char>().swap(rbuf_);
    rpos_ = rlen_ = 0;
    ReleaseBudget();
    for (auto& [id, e] : pending_.TakeAll()) {
        e.Fail(failure);
    }
    for (OutFrame& f : held_) {
        if (f.expects_response) f.expect.Fail(failure);
    }
    for (OutFrame& f : incoming) {
        if (f.expects_response) f.expect.Fail(failure);
    }
    held_.clear();
    sendq_.clear();
    if (in_payload_ && sink_.done) {
        auto done = std::move(sink_.done);
        sink_ = PayloadSink{};
        done(failure);
    }
    sink_ = PayloadSink{};
    in_payload_ = false;
    owner_->OnClosed(*this, why);
}

Status Connection::FailureFor(const Status& why) const {
    // Refusals and timeouts keep their code; everything else means the peer is unreachable.
    if (why.code() == Code::kPermissionDenied || why.code() == Code::kDeadlineExceeded) {
        return why;
    }
    return UnavailableError(config_.backend + ": connection to " + label_ +
                            " lost: " + why.message());
}

Status Connection::ClosedFailure() {
    std::lock_guard<std::mutex> lock(in_mu_);
    if (!close_failure_.ok()) {
        return close_failure_;
    }
    return UnavailableError(config_.backend + ": connection to " + label_ + " is closed");
}

void Connection::UpdateInterest() {
    if (!fd_.valid()) {
        return;
    }
    bool want = !sendq_.empty();
    if (want != want_write_ || budget_paused_ != read_paused_) {
        want_write_ = want;
        read_paused_ = budget_paused_;
        // Paused for the receive budget: no EPOLLIN (level-triggered, it would spin); a hang-up
        // still comes as EPOLLHUP.
        loop_->Modify(fd_.get(),
                      (read_paused_ ? 0u : EPOLLIN | EPOLLRDHUP) | (want ? EPOLLOUT : 0u));
    }
}

void Connection::TryWrite() {
    while (!sendq_.empty() && !closed_.load()) {
        iovec iov[kMaxIovPerCall];
        size_t n_iov = 0;
        size_t batch_bytes = 0;
        std::unique_lock<std::mutex> op_lock;
        bool zero_fill = false;
        for (auto it = sendq_.begin(); it != sendq_.end() && n_iov + 2 < kMaxIovPerCall; ++it) {
            OutFrame& f = *it;
            bool first = (it == sendq_.begin());
            if (!first && (f.op || !f.pins.empty())) {
                break;  // frames touching memory go first in their own call
            }
            size_t skip = first ? front_sent_ : 0;
            if (first && !front_started_) {
                front_started_ = true;
                bool revoked = false;
                for (const RegionPin& p : f.pins) revoked |= p.revoked();
                if (revoked) {
                    f.head = std::move(f.if_revoked);
                    f.payload.clear();
                    f.pins.clear();
                }
            }
            if (f.op) {
                op_lock = std::unique_lock<std::mutex>(f.op->io_mu);
                zero_fill = f.op->io_closed;
            }
            // Head.
            if (skip < f.head.size()) {
                iov[n_iov++] = iovec{f.head.data() + skip, f.head.size() - skip};
                batch_bytes += f.head.size() - skip;
                skip = 0;
            } else {
                skip -= f.head.size();
            }
            // Payload.
            for (const iovec& p : f.payload) {
                if (n_iov >= kMaxIovPerCall) break;
                if (skip >= p.iov_len) {
                    skip -= p.iov_len;
                    continue;
                }
                size_t len = p.iov_len - skip;
                if (zero_fill) {
                    len = std::min(len, kZeroBufSize);
                    iov[n_iov++] = iovec{const_cast<char*>(ZeroBuffer()), len};
                } else {
                    iov[n_iov++] = iovec{static_cast<char*>(p.iov_base) + skip, len};
                }
                batch_bytes += len;
                skip = 0;
                if (zero_fill) break;
            }
            if (f.op || !f.pins.empty() || batch_bytes >= (8u << 20)) {
                break;
            }
        }
        if (n_iov == 0) {
            // Empty frame (cannot happen: every frame has a header). Drop it defensively.
            sendq_.pop_front();
            front_sent_ = 0;
            front_started_ = false;
            continue;
        }
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = n_iov;
        FERRY_TSAN_SOCKET_SENT();  // the receiver may act the moment bytes land
        FERRY_TSAN_IGNORE_READS_BEGIN();
        ssize_t w = sendmsg(fd_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        FERRY_TSAN_IGNORE_READS_END();
        if (op_lock.owns_lock()) {
            op_lock.unlock();
        }
        if (w < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                break;
            }
            CloseNow(UnavailableError(std::string("send: ") + std::strerror(errno)));
            return;
        }
        // Retire fully written frames.
        size_t written = static_cast<size_t>(w);
        while (written > 0 && !sendq_.empty()) {
            OutFrame& f = sendq_.front();
            size_t total = f.head.size();
            for (const iovec& p : f.payload) total += p.iov_len;
            size_t left = total - front_sent_;
            if (written >= left) {
                written -= left;
                sendq_.pop_front();
                front_sent_ = 0;
                front_started_ = false;
            } else {
                front_sent_ += written;
                written = 0;
            }
        }
    }
    UpdateInterest();
}

void Connection::OnEvents(uint32_t events) {
    if (closed_.load()) {
        return;
    }
    if (state_ == State::kConnecting) {
        if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) {
            int err = 0;
            socklen_t len = sizeof(err);
            getsockopt(fd_.get(), SOL_SOCKET, SO_ERROR, &err, &len);
            if (err != 0) {
                CloseNow(UnavailableError(std::string("connect: ") + std::strerror(err)));
                return;
            }
            state_ = State::kHandshake;
            want_write_ = true;  // force UpdateInterest to recompute
            SendHandshakeFrames({handshake_.Hello()});
            if (closed_.load()) return;
            UpdateInterest();
        }
        return;
    }
    if (events & EPOLLOUT) {
        TryWrite();
        if (closed_.load()) return;
    }
    if (budget_paused_ && (events & (EPOLLHUP | EPOLLERR))) {
        CloseNow(UnavailableError("peer closed the connection"));
        return;
    }
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
        ReadSome();
    }
}

void Connection::ReadSome() {
    if (budget_paused_) {
        return;  // CheckStalled resumes it
    }
    size_t budget = kMaxBytesPerEvent;
    int frames = 0;
    while (!closed_.load() && budget > 0) {
        if (++frames > kMaxFramesPerEvent) {
            // Let the loop run its other work (closes, other connections), then continue: the
            // rest may already sit in rbuf_, where epoll would not report it.
            auto self = shared_from_this();
            loop_->Post([self] {
                if (!self->closed_.load()) self->ReadSome();
            });
            return;
        }
        if (in_payload_) {
            if (!ReadPayload()) {
                return;
            }
            continue;
        }
        // Parse whatever whole frames the buffer holds.
        size_t avail = rlen_ - rpos_;
        size_t need = 0;  // bytes of the frame at rpos_, once its header is in
        if (avail >= wire::kHeaderSize) {
            Result<wire::FrameHeader> h =
                wire::DecodeHeader(std::string_view(rbuf_.data() + rpos_, wire::kHeaderSize));
            if (!h.ok()) {
                ProtocolError(h.status().message());
                return;
            }
            if (state_ != State::kReady &&
                (h->body_len > kMaxHandshakeBody || h->payload_len > 0)) {
                // Nothing is allocated for a peer that has not proven the secret.
                ProtocolError(fmt::format(
                    "a {} frame of {} body and {} payload bytes during the handshake (at most {} "
                    "body bytes and no payload before the peer is authenticated)",
                    wire::FrameTypeName(h->type), h->body_len, h->payload_len, kMaxHandshakeBody));
                return;
            }
            need = wire::kHeaderSize + h->body_len;
            if (avail >= need) {
                std::string_view body(rbuf_.data() + rpos_ + wire::kHeaderSize, h->body_len);
                rpos_ += need;
                partial_since_ = {};
                if (h->payload_len > 0) {
                    in_payload_ = true;
                    payload_left_ = h->payload_len;
                    sink_ = PayloadSink{};
                    sink_pos_ = IovCursor{};
                    partial_since_ = std::chrono::steady_clock::now();
                }
                Dispatch(*h, body);
                continue;
            }
        }
        if (avail > 0 && partial_since_ == std::chrono::steady_clock::time_point{}) {
            partial_since_ = std::chrono::steady_clock::now();  // a frame (or header) begun
        }
        // Need more bytes: compact and read. Read only what the current frame's header and body
        // need (at least a few KiB for runs of small frames), so that a payload that follows is
        // read straight into its destination instead of through this buffer.
        size_t want = std::max(kSmallRead, need > avail ? need - avail : 0);
        if (rpos_ > 0) {
            std::memmove(rbuf_.data(), rbuf_.data() + rpos_, rlen_ - rpos_);
            rlen_ -= rpos_;
            rpos_ = 0;
        }
        const size_t base = BaseBufferSize();
        if (rlen_ == 0 && rbuf_.size() > base) {
            std::vector<char>(base).swap(rbuf_);
            ReleaseBudget();
        } else if (rbuf_.size() < base) {
            rbuf_.resize(base);  // authenticated now: the full buffer, not charged
        }
        if (rlen_ == rbuf_.size() && need > rbuf_.size()) {
            // A big body (a long descriptor list): the buffer grows as its bytes arrive,
            // doubling up to the frame's size, never ahead of them, within the agent's budget.
            size_t target = std::min(need, std::max(rbuf_.size() * 2, kReadBufferSize));
            size_t extra = target - rbuf_.size();
            if (config_.budget && !config_.budget->TryTake(extra)) {
                config_.budget->waits.fetch_add(1);
                budget_paused_ = true;
                UpdateInterest();
                return;
            }
            if (config_.budget) charged_.fetch_add(extra, std::memory_order_relaxed);
            rbuf_.resize(target);
        }
        ssize_t r = recv(fd_.get(), rbuf_.data() + rlen_, std::min(want, rbuf_.size() - rlen_),
                         MSG_DONTWAIT);
        if (r == 0) {
            CloseNow(UnavailableError("peer closed the connection"));
            return;
        }
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            CloseNow(UnavailableError(std::string("recv: ") + std::strerror(errno)));
            return;
        }
        FERRY_TSAN_SOCKET_RECEIVED();
        rlen_ += static_cast<size_t>(r);
        budget -= std::min(budget, static_cast<size_t>(r));
    }
}

size_t Connection::BaseBufferSize() const {
    return state_ == State::kReady ? kReadBufferSize : kHandshakeBufferSize;
}

void Connection::ReleaseBudget() {
    size_t held = charged_.exchange(0, std::memory_order_relaxed);
    if (held > 0 && config_.budget) config_.budget->Give(held);
}

bool Connection::CheckStalled(std::chrono::steady_clock::time_point now,
                              std::chrono::milliseconds deadline) {
    if (closed_.load()) return false;
    if (partial_since_ != std::chrono::steady_clock::time_point{} &&
        now - partial_since_ > deadline) {
        CloseNow(DeadlineExceededError(fmt::format(
            "a frame from {} stayed incomplete for over {} ms (stalled); its bytes are dropped",
            handshake_.peer_name().empty() ? label_ : handshake_.peer_name(), deadline.count())));
        return true;
    }
    if (budget_paused_) {
        budget_paused_ = false;
        UpdateInterest();
        ReadSome();
    }
    return false;
}

bool Connection::ReadPayload() {
    // Into the sink, or into scratch when discarding or after the op closed its memory.
    std::unique_lock<std::mutex> op_lock;
    bool discard = sink_.iov.empty();
    if (!discard && sink_.op) {
        op_lock = std::unique_lock<std::mutex>(sink_.op->io_mu);
        discard = sink_.op->io_closed;
    }
    // First the bytes already buffered.
    size_t buffered = rlen_ - rpos_;
    if (buffered > 0) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(buffered, payload_left_));
        if (!discard) {
            IovCursor c = sink_pos_;
            for (size_t copied = 0; copied < n && !c.AtEnd(sink_.iov);) {
                size_t k = std::min(n - copied, c.Contiguous(sink_.iov));
                std::memcpy(c.Pointer(sink_.iov), rbuf_.data() + rpos_ + copied, k);
                copied += k;
                c.Advance(sink_.iov, k);
            }
        }
        // Dropped bytes still move the position, in case the payload continues below.
        sink_pos_.Advance(sink_.iov, n);
        rpos_ += n;
        payload_left_ -= n;
    } else {
        iovec iov[kMaxIovPerCall];
        size_t n_iov = 0;
        uint64_t want = payload_left_;
        if (discard) {
            iov[n_iov++] = iovec{ScratchBuffer(),
                                 static_cast<size_t>(std::min<uint64_t>(want, kReadBufferSize))};
        } else {
            size_t idx = sink_pos_.index;
            size_t off = sink_pos_.offset;
            while (idx < sink_.iov.size() && n_iov < kMaxIovPerCall && want > 0) {
                const iovec& v = sink_.iov[idx];
                size_t k = static_cast<size_t>(std::min<uint64_t>(v.iov_len - off, want));
                iov[n_iov++] = iovec{static_cast<char*>(v.iov_base) + off, k};
                want -= k;
                ++idx;
                off = 0;
            }
        }
        ssize_t r = readv(fd_.get(), iov, static_cast<int>(n_iov));
        if (op_lock.owns_lock()) {
            op_lock.unlock();
        }
        if (r == 0) {
            CloseNow(UnavailableError("peer closed the connection mid-payload"));
            return false;
        }
        if (r < 0) {
            if (errno == EINTR) return true;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
            CloseNow(UnavailableError(std::string("recv payload: ") + std::strerror(errno)));
            return false;
        }
        FERRY_TSAN_SOCKET_RECEIVED();
        payload_left_ -= static_cast<size_t>(r);
        sink_pos_.Advance(sink_.iov, static_cast<size_t>(r));
        partial_since_ = std::chrono::steady_clock::now();  // progress
    }
    if (op_lock.owns_lock()) {
        op_lock.unlock();
    }
    if (payload_left_ == 0) {
        FinishPayload(Status::Ok());
    }
    return true;
}

void Connection::FinishPayload(const Status& s) {
    in_payload_ = false;
    partial_since_ = {};
    PayloadSink sink = std::move(sink_);
    sink_ = PayloadSink{};
    if (sink.done) {
        sink.done(s);
    }
}

void Connection::ProtocolError(const std::string& why) {
    RefuseAndClose(InvalidArgumentError("protocol error from " + label_ + ": " + why));
}

void Connection::RefuseAndClose(const Status& why) {
    // Tell the peer why (best effort, one non-blocking send), then close.
    // Only between frames: a partly sent frame would make the error unreadable.
    if (fd_.valid() && front_sent_ == 0) {
        wire::Response r{why.code(), why.message(), 0};
        std::string frame = wire::MakeFrame(wire::FrameType::kError, 0, wire::EncodeResponse(r));
        ssize_t ignored = send(fd_.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)ignored;
    }
    CloseNow(why);
}

Status Connection::VerifyCmaProbe(const wire::Hello& hello) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd_.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) {
        return PermissionDeniedError("shm: cannot identify the peer process (SO_PEERCRED)");
    }
    uint64_t value = 0;
    iovec local{&value, sizeof(value)};
    iovec remote{reinterpret_cast<void*>(hello.probe_addr), sizeof(value)};
    ssize_t r = process_vm_readv(cred.pid, &local, 1, &remote, 1, 0);
    if (r != static_cast<ssize_t>(sizeof(value))) {
        return PermissionDeniedError("shm: cross-memory attach to pid " + std::to_string(cred.pid) +
                                     " refused: " + std::strerror(errno) +
                                     " (use the tcp backend)");
    }
    if (value != hello.probe_value) {
        return PermissionDeniedError("shm: probe of pid " + std::to_string(cred.pid) +
                                     " read the wrong value: not the process that connected");
    }
    cma_pid_ = cred.pid;
    return Status::Ok();
}

void Connection::Dispatch(const wire::FrameHeader& h, std::string_view body) {
    if (h.type == wire::FrameType::kError) {
        Result<wire::Response> r = wire::DecodeResponse(body);
        if (!r.ok()) {
            CloseNow(UnavailableError("peer sent a malformed error frame"));
            return;
        }
        CloseNow(Status(r->code, "peer " + label_ + " refused: " + r->message));
        return;
    }
    if (state_ != State::kReady) {
        HandleHandshake(h, body);
        return;
    }
    if (config_.counters) config_.counters->received.fetch_add(1, std::memory_order_relaxed);
    switch (h.type) {
        case wire::FrameType::kResponse:
        case wire::FrameType::kMetadata:
        case wire::FrameType::kRegionGrant:
            HandleResponse(h, body);
            break;
        case wire::FrameType::kWrite:
        case wire::FrameType::kRead:
        case wire::FrameType::kPull:
        case wire::FrameType::kGetMetadata:
        case wire::FrameType::kNotify:
        case wire::FrameType::kUnshare:
        case wire::FrameType::kMapRegion:
            owner_->OnRequest(*this, h, body);
            break;
        default:
            ProtocolError(std::string("unexpected ") + std::string(wire::FrameTypeName(h.type)) +
                          " frame after the handshake");
            return;
    }
    // A payload nobody claimed (no sink set) is read and dropped: the stream stays in sync.
}

void Connection::HandleHandshake(const wire::FrameHeader& h, std::string_view body) {
    Handshake::Step step = handshake_.OnFrame(h, body);
    if (!step.error.ok()) {
        if (step.tell_peer) {
            RefuseAndClose(step.error);
        } else {
            CloseNow(step.error);
        }
        return;
    }
    if (!step.send.empty()) SendHandshakeFrames(std::move(step.send));
    if (step.ready && !closed_.load()) BecomeReady();
}

void Connection::HandleResponse(const wire::FrameHeader& h, std::string_view body) {
    PendingResponses::Outcome o = pending_.OnAnswer(h, body, label_);
    if (!o.protocol_error.empty()) {
        ProtocolError(o.protocol_error);
        return;
    }
    if (o.has_sink) SetPayloadSink(std::move(o.sink));
}

}  // namespace ferry::internal
