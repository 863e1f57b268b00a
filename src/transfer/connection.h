// Connection: one framed, non-blocking stream (TCP or Unix socket) owned by an IoLoop.
//
// It runs the handshake (identity, deployment-secret challenge-response, cma probe), sends
// queued frames with scatter/gather I/O straight from registered memory, receives payloads
// straight into registered memory, matches responses to the requests that expect them, and on
// close fails every request still expecting an answer. Send() and Close() may be called from any
// thread; everything else runs on the loop thread.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/crypto.h"
#include "core/fd.h"
#include "transfer/handshake.h"
#include "transfer/io_loop.h"
#include "transfer/iov_cursor.h"
#include "transfer/region_table.h"
#include "transfer/responses.h"
#include "transfer/transfer_op.h"
#include "transfer/wire.h"

namespace ferry::internal {

class Connection;

struct OutFrame {
    std::string head;            // header + body
    std::vector<iovec> payload;  // sent after head, not copied
    // The payload is the op's local memory: read under op->io_mu, zeros once io_closed.
    std::shared_ptr<TransferOp> op;
    // The payload is this agent's region memory, pinned until sent.
    std::vector<RegionPin> pins;
    // Sent instead (without payload) if a pin was revoked before the frame's first byte.
    std::string if_revoked;
    // Other memory the payload points into (a file region's staging buffer), kept until sent.
    std::shared_ptr<void> keep;
    uint64_t request_id = 0;
    bool expects_response = false;
    Expectation expect;
};

class ConnectionOwner {
  public:
    virtual ~ConnectionOwner() = default;
    // A request frame (write, read, pull, get-metadata, notify, unshare, map-region) on a ready
    // connection. May call
    // conn.SetPayloadSink (required for frames with a payload) and conn.SendNow.
    virtual void OnRequest(Connection& conn, const wire::FrameHeader& h, std::string_view body) = 0;
    virtual void OnClosed(Connection& conn, const Status& why) = 0;
    // The handshake completed (loop thread).
    virtual void OnReady(Connection& conn) {}
};

// Bytes of frame bodies this agent's connections hold beyond their base read buffers, shared by
// every connection of the agent: a big body (a long descriptor list) is read into a buffer
// that grows as its bytes arrive, within this budget; a connection that would exceed it stops
// reading until others give bytes back.
struct ReceiveBudget {
    explicit ReceiveBudget(size_t limit) : limit(limit) {}
    const size_t limit;
    std::atomic<size_t> used{0};
    std::atomic<uint64_t> waits{0};  // times a connection paused for it
    bool TryTake(size_t n) {
        size_t cur = used.load();
        do {
            if (cur + n > limit) return false;
        } while (!used.compare_exchange_weak(cur, cur + n));
        return true;
    }
    void Give(size_t n) { used.fetch_sub(n); }
};

// Frames this agent's stream connections sent and received after their handshakes (requests,
// responses, notifications): AgentStats.messages_sent / messages_received.
struct WireCounters {
    std::atomic<uint64_t> sent{0};
    std::atomic<uint64_t> received{0};
};

// Before the peer has proven the secret a connection reads only frames of at most this body
// (a hello is a few hundred bytes), into a buffer of this size.
inline constexpr size_t kMaxHandshakeBody = 1024;
inline constexpr size_t kHandshakeBufferSize = 2048;

class Connection final : public EventHandler, public std::enable_shared_from_this<Connection> {
  public:
    enum class Role { kClient, kServer };

    // `connecting`: a client socket whose non-blocking connect is in progress.
    static std::shared_ptr<Connection> Create(IoLoop* loop, ScopedFd fd, Role role,
                                              HandshakeConfig config, ConnectionOwner* owner,
                                              std::string label, bool connecting);
    ~Connection() override;

    // Registers with the loop and starts the handshake. Any thread.
    void Start();
    // Queues a frame (any thread). Frames queued before the handshake completes wait for it. On
    // a closed connection the frame's expectation fails at once with Unavailable.
    void Send(OutFrame f);
    // Closes (any thread, idempotent): pending expectations fail with `why`.
    void Close(const Status& why);
    // As Close, and returns after the loop thread has closed the socket.
    void CloseAndWait(const Status& why);

    // Loop thread only.
    void SendNow(OutFrame f);
    void SetPayloadSink(PayloadSink sink);
    bool HoldsRegion(RegionId id) const;
    void OnEvents(uint32_t events) override;

    // Set once the handshake is done; read from any thread after that.
    bool ready() const { return ready_.load(); }
    bool closed() const { return closed_.load(); }
    const std::string& peer_name() const { return handshake_.peer_name(); }
    uint64_t peer_epoch() const { return handshake_.peer_epoch(); }
    pid_t cma_pid() const { return cma_pid_.load(std::memory_order_acquire); }
    // The process at the other end of a Unix socket (SO_PEERCRED), 0 for tcp; set when ready.
    // Unlike cma_pid() it proves nothing: opening that process's files still needs the kernel's
    // ptrace access check.
    pid_t peer_pid() const { return peer_pid_.load(std::memory_order_acquire); }
    const std::string& label() const { return label_; }
    const std::string& source() const { return config_.source; }
    const std::string& backend() const { return config_.backend; }
    IoLoop* loop() const { return loop_; }
    std::chrono::steady_clock::time_point created() const { return created_; }
    Role role() const { return role_; }
    wire::Purpose purpose() const { return handshake_.purpose(); }
    // Health check before a cma copy: false if the peer has hung up.
    bool PeerStillThere() const;
    // Loop thread (the agent's tick): closes the connection if a frame has been incomplete
    // past `deadline` (a header whose body stalls, a payload that stopped arriving), and
    // resumes reading if it paused for the receive budget. True if it closed.
    bool CheckStalled(std::chrono::steady_clock::time_point now,
                      std::chrono::milliseconds deadline);
    // Bytes of the receive budget this connection holds (any thread, approximate).
    size_t budget_held() const { return charged_.load(std::memory_order_relaxed); }

  private:
    // The socket connecting (client), then the handshake's frames, then requests and responses.
    enum class State { kConnecting, kHandshake, kReady };

    Connection(IoLoop* loop, ScopedFd fd, Role role, HandshakeConfig config, ConnectionOwner* owner,
               std::string label, bool connecting);

    void CloseNow(const Status& why);
    // The status pending requests fail with when the connection closes for `why`.
    Status FailureFor(const Status& why) const;
    Status ClosedFailure();
    void FlushIncoming();
    void Enqueue(OutFrame f);
    void TryWrite();
    void UpdateInterest();
    void ReadSome();
    size_t BaseBufferSize() const;
    void ReleaseBudget();
    bool ReadPayload();  // false: stop reading for now (EAGAIN or closed)
    void FinishPayload(const Status& s);
    void Dispatch(const wire::FrameHeader& h, std::string_view body);
    void HandleHandshake(const wire::FrameHeader& h, std::string_view body);
    void SendHandshakeFrames(std::vector<std::string> frames);
    void HandleResponse(const wire::FrameHeader& h, std::string_view body);
    void BecomeReady();
    void ProtocolError(const std::string& why);
    void RefuseAndClose(const Status& why);
    Status VerifyCmaProbe(const wire::Hello& hello);

    IoLoop* const loop_;
    ScopedFd fd_;
    const Role role_;
    const HandshakeConfig config_;
    ConnectionOwner* const owner_;
    const std::string label_;
    const std::chrono::steady_clock::time_point created_;

    std::atomic<bool> ready_{false};
    std::atomic<bool> closed_{false};

    // The peer's name, epoch and purpose: written before ready_ is set, constant afterwards.
    Handshake handshake_;
    const bool connecting_;  // client: its non-blocking connect was in progress at Create
    std::atomic<pid_t> cma_pid_{0};
    std::atomic<pid_t> peer_pid_{0};

    // Frames from other threads.
    std::mutex in_mu_;
    std::vector<OutFrame> incoming_;
    bool flush_posted_ = false;
    bool in_closed_ = false;
    Status close_failure_;  // under in_mu_: what frames sent after the close fail with

    // Loop thread state.
    State state_;
    std::vector<OutFrame> held_;  // queued before the handshake completed
    std::deque<OutFrame> sendq_;
    size_t front_sent_ = 0;  // bytes of sendq_.front() already written
    bool front_started_ = false;
    bool want_write_ = false;
    PendingResponses pending_;

    std::vector<char> rbuf_;
    std::atomic<size_t> charged_{0};  // of rbuf_, taken from config_.budget
    bool budget_paused_ = false;
    bool read_paused_ = false;  // as told to epoll
    // When the frame now incomplete started (its header known, body or payload not yet in),
    // or of its last payload progress; epoch when none is.
    std::chrono::steady_clock::time_point partial_since_{};
    size_t rpos_ = 0;
    size_t rlen_ = 0;
    bool in_payload_ = false;
    uint64_t payload_left_ = 0;
    PayloadSink sink_;
    IovCursor sink_pos_;
};

}  // namespace ferry::internal
