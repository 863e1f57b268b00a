// The ucx backend's implementation (UcxBackend::Impl), shared by its files; every UCX call
// happens on the one progress thread. By job:
//   ucx_messages.{h,cc}   the active messages as bytes (pure code, fuzzed)
//   ucx_worker.cc         context, worker, the progress thread, start and stop
//   ucx_endpoints.cc      endpoints to peers and initiators, announcements, failures, closing
//   ucx_requests.cc       our requests (active-message writes and reads, notify, pull) and replies
//   ucx_grants.cc         one-sided access: grants, RMA puts and gets, revocation
//   ucx_handlers.cc       the handlers of peers' messages
//   ucx_backend.cc        the Backend facade (hands every call to the progress thread)
#pragma once

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "core/bytes.h"
#include "core/crypto.h"
#include "core/log.h"
#include "core/tsan.h"
#include "transfer/backends/ucx/ucx_backend.h"
#include "transfer/backends/ucx/ucx_messages.h"

namespace ferry {

namespace ucx {

// The progress thread polls without sleeping for this long after the last event.
inline constexpr auto kSpinAfterActivity = std::chrono::microseconds(500);
// After a peer process's endpoint failed, how long before we try to connect to it again.
inline constexpr auto kReconnectBackoff = std::chrono::seconds(1);
// How long a clean close waits for what was sent to arrive before it forces the close.
inline constexpr auto kFlushBeforeClose = std::chrono::seconds(2);

inline Status FromUcs(ucs_status_t s, std::string_view what) {
    return UnavailableError(std::string(what) + ": " + ucs_status_string(s));
}

// UCX moves bytes through sockets ThreadSanitizer cannot see through (and is not instrumented):
// as for the tcp backend (core/tsan.h), a send releases, a receive acquires, and the kernel's
// reads of our buffers are ordered by the protocol. Nothing outside TSan builds.
template <typename F>
inline auto ThroughUcx(F&& f) {
    FERRY_TSAN_SOCKET_SENT();
    FERRY_TSAN_IGNORE_READS_BEGIN();
    auto r = f();
    FERRY_TSAN_IGNORE_READS_END();
    FERRY_TSAN_SOCKET_RECEIVED();
    return r;
}
inline unsigned Progress(ucp_worker_h w) {
    return ThroughUcx([&] { return ucp_worker_progress(w); });
}
inline ucs_status_ptr_t AmSend(ucp_ep_h ep, unsigned id, const void* header, size_t header_length,
                               const void* buffer, size_t count, const ucp_request_param_t* param) {
    return ThroughUcx(
        [&] { return ucp_am_send_nbx(ep, id, header, header_length, buffer, count, param); });
}
inline ucs_status_ptr_t AmRecv(ucp_worker_h w, void* desc, void* buffer, size_t count,
                               const ucp_request_param_t* param) {
    return ThroughUcx([&] { return ucp_am_recv_data_nbx(w, desc, buffer, count, param); });
}

// Copies an eager message's bytes (already here, in order) into `iov`.
inline void ScatterEager(const void* data, const std::vector<ucp_dt_iov_t>& iov) {
    size_t off = 0;
    for (const ucp_dt_iov_t& v : iov) {
        std::memcpy(v.buffer, static_cast<const char*>(data) + off, v.length);
        off += v.length;
    }
}

// A buffer list as UCX takes it: one piece as contiguous bytes (UCX's fast paths), several as
// an iov.
struct Buffers {
    void* buffer = nullptr;
    size_t count = 0;
    ucp_datatype_t datatype = ucp_dt_make_contig(1);
};
inline Buffers AsBuffers(std::vector<ucp_dt_iov_t>& iov) {
    if (iov.empty()) return {};
    if (iov.size() == 1) return {iov[0].buffer, iov[0].length, ucp_dt_make_contig(1)};
    return {iov.data(), iov.size(), ucp_dt_make_iov()};
}

}  // namespace ucx

class UcxBackend::Impl {
  public:
    using TransferOp = internal::TransferOp;

    Impl(std::string agent, std::string secret, bool rma)
        : agent_(std::move(agent)),
          secret_(std::move(secret)),
          rma_(rma),
          token_(SecureRandomU64()),
          my_proof_(Proof(token_)) {}
    ~Impl() { Destroy(); }

    Result<std::string> Init();
    Status Start(TargetServices* host);
    void Stop();
    // Runs `f` on the progress thread (in order); false once stopped.
    bool Run(std::function<void()> f);
    bool OnProgressThread() const {
        return std::this_thread::get_id() == progress_thread_.load(std::memory_order_acquire);
    }
    // Whether UCX is receiving into memory of transfer `op_id` right now (any thread).
    bool IsReceiving(uint64_t op_id) {
        std::lock_guard<std::mutex> lock(receiving_mu_);
        return receiving_.count(op_id) != 0;
    }
    void Receiving(uint64_t op_id, int delta) {
        std::lock_guard<std::mutex> lock(receiving_mu_);
        int& n = receiving_[op_id];
        n += delta;
        if (n <= 0) receiving_.erase(op_id);
    }
    size_t max_header() const { return max_header_; }

    // Progress-thread side of the public calls.
    void DoPost(const std::shared_ptr<TransferOp>& op, const PeerRef& peer, bool write,
                std::vector<Chunk> chunks, bool one_sided);
    void DoNotify(const PeerRef& peer, const std::string& payload, const std::string& sender);
    void DoPull(const std::shared_ptr<TransferOp>& op, const PeerRef& peer, const std::string& key,
                std::vector<iovec> local, uint64_t capacity);
    void DoDropPeer(const std::string& peer, uint64_t epoch, const Status& why);
    void DoCutOff(uint64_t op_id, const Status& why);
    void DoRevoke(RegionId id, const std::shared_ptr<std::promise<void>>& done);
    void DoRevokeExpired(RegionId id);
    void DoRegionGone(RegionId id) { revoking_.erase(id); }
    uint64_t one_sided_transfers() const { return one_sided_.load(std::memory_order_relaxed); }
    uint64_t messages_sent() const { return messages_sent_.load(std::memory_order_relaxed); }
    uint64_t messages_received() const {
        return messages_received_.load(std::memory_order_relaxed);
    }

  private:
    struct Ep {
        std::string name;
        uint64_t epoch = 0;
        uint64_t token = 0;  // the peer's
        uint64_t proof = 0;  // Proof(token)
        ucp_ep_h ep = nullptr;
        Impl* impl = nullptr;
        bool failed = false;
        // Ours to an initiator, for answering it (replies_), not for requests (eps_).
        bool reply = false;
        // Which of the initiator's endpoints (announced in ucx::kAmHello) it answers; for ours, the
        // number we announced.
        uint64_t generation = 0;
        std::unordered_set<uint64_t> requests;  // pending request ids
        // One-sided access the peer granted us, by region. A revoked grant stays until the
        // chunks holding it are done, then is acknowledged (`revokes`) and dropped.
        struct Grant {
            uint64_t key = 0;
            uint64_t address = 0;
            uint64_t length = 0;
            ucp_rkey_h rkey = nullptr;
            int holds = 0;
            bool revoked = false;
            std::vector<uint64_t> revokes;
        };
        std::unordered_map<RegionId, Grant> grants;
        std::vector<ucp_rkey_h> retired;  // replaced while in use: destroyed when the ep is
        bool no_rma = false;              // the peer grants nothing: active messages only
    };

    // One request of ours awaiting the peer's reply (and, for writes, our send's completion).
    struct Pending {
        uint64_t id = 0;
        std::shared_ptr<TransferOp> op;
        std::shared_ptr<Ep> ep;
        uint16_t am = 0;
        std::string header;
        std::vector<ucp_dt_iov_t> iov;  // our memory: sent (write) or received into (read, pull)
        uint64_t bytes = 0;             // expected reply data (read, pull: capacity)
        void* send_req = nullptr;       // in flight: UCX reads our memory (write)
        void* recv_req = nullptr;       // in flight: UCX writes our memory (read, pull)
        bool replied = false;
        Status status;
        uint64_t value = 0;
        // One-sided: requests (and the write's flush) UCX still works on; gets write our memory.
        int rma_inflight = 0;
        bool rma_get = false;
        std::vector<RegionId> holds;  // grants held until the chunk is done
        // Requests of the backend's own (a grant) end here instead of in an op.
        std::function<void(Pending&)> done;
        std::string buffer;  // a grant's answer lands here
    };

    // Serving one request of a peer.
    struct Serving {
        uint64_t initiator = 0;  // its token: the reply goes out on replies_[initiator]
        uint64_t request_id = 0;
        uint64_t proof = 0;  // for the initiator's token
        std::vector<RegionPin> pins;
        std::vector<ucp_dt_iov_t> iov;
        internal::FileStaging
            staging;  // file regions' bytes, moved by the host around the transfer
        std::string header;
        std::string blob;  // a grant's answer
        Impl* impl = nullptr;
        uint64_t value = 0;
    };

    void Loop();
    void Destroy();
    // Runs the deferred work queued so far (what it queues runs next time).
    void RunDeferred() {
        if (deferred_.empty()) return;  // the common case while spinning: no allocation
        std::deque<std::function<void()>> now;
        now.swap(deferred_);
        for (auto& f : now) f();
    }
    Result<std::shared_ptr<Ep>> GetEp(const PeerRef& peer);
    // `force`: at once, failing what is in flight; else flushed first, then forced (a clean
    // goodbye the peer sees as such: UCX 1.13 can abort a peer whose endpoint wireup is cut off
    // by a forced close, and keeps an endpoint closed without force until the worker goes).
    void CloseEp(std::shared_ptr<Ep> ep, const Status& why,
                 bool force = true);  // by value: it erases the maps that hold it
    // Checks the flush that starts a clean close until it is done, or until `deadline` (a peer
    // that stopped reading, say), then forces the close.
    void PollFlush(void* req, const std::shared_ptr<Ep>& ep, ucp_ep_h handle,
                   Clock::time_point deadline) {
        if (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < deadline) {
            deferred_.push_back(
                [this, req, ep, handle, deadline] { PollFlush(req, ep, handle, deadline); });
            return;
        }
        ucp_request_free(req);  // one still in progress goes when the forced close ends it
        ForceClose(ep, handle);
    }
    // Closes `handle` (of `ep`, already in closing_) at once; done when PollClose says so.
    void ForceClose(const std::shared_ptr<Ep>& ep, ucp_ep_h handle) {
        ucp_request_param_t param{};
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_EP_CLOSE_FLAG_FORCE;
        ucs_status_ptr_t req = ucp_ep_close_nbx(handle, &param);
        if (UCS_PTR_IS_PTR(req)) {
            PollClose(req, ep, handle);
            return;
        }
        CloseDone(ep, handle);
    }
    // Checks an endpoint close request until it is done (from the deferred queue).
    void PollClose(void* req, const std::shared_ptr<Ep>& ep, ucp_ep_h handle) {
        if (ucp_request_check_status(req) == UCS_INPROGRESS) {
            deferred_.push_back([this, req, ep, handle] { PollClose(req, ep, handle); });
            return;
        }
        ucp_request_free(req);
        CloseDone(ep, handle);
    }
    // UCX is done with `handle`: forget it and release what `ep` held.
    void CloseDone(const std::shared_ptr<Ep>& ep, ucp_ep_h handle) {
        by_handle_.erase(handle);
        closing_.erase(std::remove(closing_.begin(), closing_.end(), ep), closing_.end());
        Closed(ep);
    }
    // Sends request `p` (its header; its iov as payload when `with_data`) and tracks it.
    void Send(const std::shared_ptr<Pending>& p, uint16_t am, bool with_data);
    void Track(const std::shared_ptr<Pending>& p);
    // A request for chunk `c` of `op` (not sent, not tracked yet).
    std::shared_ptr<Pending> NewChunk(const std::shared_ptr<TransferOp>& op,
                                      const std::shared_ptr<Ep>& ep, bool write, const Chunk& c);
    // The active-message path of DoPost.
    void PostAm(const std::shared_ptr<TransferOp>& op, const std::shared_ptr<Ep>& ep, bool write,
                std::vector<Chunk>& chunks);
    // The one-sided path: every region of `chunks` is granted.
    void PostRma(const std::shared_ptr<TransferOp>& op, const std::shared_ptr<Ep>& ep, bool write,
                 std::vector<Chunk>& chunks);
    // Issues one ucp_put_nbx / ucp_get_nbx for `p`.
    void IssueRma(const std::shared_ptr<Pending>& p, bool write, void* local, size_t n,
                  uint64_t remote, ucp_rkey_h rkey);
    // Asks the peer of `ep` for a grant of `region`; `then` hears how it went.
    void RequestGrant(const std::shared_ptr<Ep>& ep, RegionId region, uint64_t key,
                      std::function<void(const Status&)> then);
    // Serves a grant request (progress thread, outside UCX callbacks).
    void ServeGrant(const std::shared_ptr<Serving>& sv, RegionId region, uint64_t key);
    // Drops a grant nobody holds any more, acknowledging its revocations.
    void ReleaseGrant(const std::shared_ptr<Ep>& ep, RegionId region);
    void SendRevokeAck(const std::shared_ptr<Ep>& ep, uint64_t revocation);
    // Sends a control message (eager, fire and forget). `data` must outlive the send (ours).
    ucs_status_t SendControl(ucp_ep_h handle, uint16_t am, std::string header,
                             const void* data = nullptr, size_t length = 0);
    // A grantee is gone or acknowledged: the revocation may be complete.
    void Acknowledged(uint64_t revocation, uint64_t grantee);
    void FinishRevocation(uint64_t revocation);
    // The endpoint's close completed: UCX holds none of its requests, so its rkeys can go.
    void Closed(const std::shared_ptr<Ep>& ep);
    // The chunk of `p` ends: its op hears once, after UCX let go of its memory.
    void Finish(const std::shared_ptr<Pending>& p, const Status& s, uint64_t value = 0);
    void MaybeComplete(const std::shared_ptr<Pending>& p);
    // Opens our endpoint to an initiator that announced itself (ucx::kAmHello).
    void OpenReplyEp(uint64_t initiator, uint64_t generation, const std::string& address);
    // Sends ucx::kAmHello or ucx::kAmBye for our endpoint `ep` (eager, fire and forget).
    ucs_status_t Announce(const std::shared_ptr<Ep>& ep, uint16_t am);
    void SendReply(ucp_ep_h reply_ep, uint64_t request_id, uint64_t proof, const Status& s,
                   uint64_t value, std::shared_ptr<Serving> data);
    void Reply(uint64_t initiator, uint64_t request_id, uint64_t proof, const Status& s,
               uint64_t value, std::shared_ptr<Serving> data);

    static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
    ucs_status_t HandleRequest(uint16_t am, std::string_view header, void* data, size_t length,
                               const ucp_am_recv_param_t* param);
    ucs_status_t HandleReply(std::string_view header, void* data, size_t length,
                             const ucp_am_recv_param_t* param);
    // One handler per message (ucx_handlers.cc). Messages without a reply are dropped (and
    // logged) when refused; requests are refused with an answer.
    void OnAnnounce(bool hello, std::string_view header, void* data, size_t length, bool rndv);
    void OnRevoke(bool ack, std::string_view header, size_t length);
    void OnNotify(std::string_view header, void* data, size_t length, bool rndv);
    // A request whose head (envelope, initiator, request id) decoded and checked.
    struct Incoming {
        ucx::RequestHead head;
        uint64_t reply_proof = 0;  // for the initiator's token
        void* data = nullptr;
        size_t length = 0;
        const ucp_am_recv_param_t* param = nullptr;
    };
    ucs_status_t ServeGrantRequest(const Incoming& in, std::string_view header);
    ucs_status_t ServePullRequest(const Incoming& in, std::string_view header);
    ucs_status_t ServeDataRequest(bool write, const Incoming& in, std::string_view header);
    // Refuses on our endpoint to the initiator (deferred) or at once on UCX's reply endpoint.
    ucs_status_t Refuse(const Incoming& in, const Status& s);
    ucs_status_t RefuseNow(const Incoming& in, const Status& s);
    std::shared_ptr<Serving> NewServing(const Incoming& in);
    static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);
    // Remembers that the peer process with `token` failed us (GetEp waits before reconnecting).
    void NoteFailure(uint64_t token, const Status& why);
    // Peer processes (tokens) whose endpoint failed, when and why; progress thread.
    std::unordered_map<uint64_t, std::pair<Clock::time_point, Status>> failed_;

    // A message we do not take: returning UCS_OK from the callback drops it (a rendezvous
    // sender then completes without sending the bytes). Marks the places that drop data.
    static void Release(void* data, const ucp_am_recv_param_t* param) {
        (void)data;
        (void)param;
    }

    // With a deployment secret, messages to the holder of `token` carry Proof(token): only
    // deployment members can compute it (the metadata alone is not enough). 0 without a secret.
    uint64_t Proof(uint64_t token) const {
        if (secret_.empty()) return 0;
        char msg[24] = "ferry-ucx-token:";
        std::memcpy(msg + 16, &token, 8);
        Digest d = HmacSha256(secret_, std::string_view(msg, sizeof msg));
        uint64_t v = 0;
        std::memcpy(&v, d.data(), 8);
        return v;
    }
    // Why a message that must not be answered is dropped (nullptr: take it).
    const char* Refusal(bool well_formed, uint64_t token, uint64_t proof) const {
        if (!well_formed) return "malformed header";
        if (token != token_) return "wrong endpoint token";
        if (!secret_.empty() && proof != my_proof_) return "no proof of the deployment secret";
        return nullptr;
    }
    uint64_t ProofFor(uint64_t token) {
        auto it = proofs_.find(token);
        if (it != proofs_.end()) return it->second;
        if (proofs_.size() > 4096) proofs_.clear();
        return proofs_[token] = Proof(token);
    }

    const std::string agent_;
    const std::string secret_;
    const bool rma_;  // we grant one-sided access to our regions
    const uint64_t token_;
    const uint64_t my_proof_;
    std::unordered_map<uint64_t, uint64_t> proofs_;  // progress thread
    ucp_context_h context_ = nullptr;
    ucp_worker_h worker_ = nullptr;
    size_t max_header_ = 0;
    int efd_ = -1;   // the worker's event fd
    int wake_ = -1;  // eventfd: commands queued
    int epoll_ = -1;
    TargetServices* host_ = nullptr;

    std::mutex mu_;
    struct HandlerArg {
        Impl* self = nullptr;
        uint16_t id = 0;
    };
    HandlerArg handler_args_[ucx::kAmLast + 1];
    // Set by the thread itself as it starts; read from any thread (a CutOff can come before the
    // first command ever reached the thread).
    std::atomic<std::thread::id> progress_thread_{};

    std::deque<std::function<void()>> commands_;  // under mu_
    std::mutex receiving_mu_;
    std::unordered_map<uint64_t, int> receiving_;  // op id -> receives in flight
    bool stopping_ = false;                        // under mu_
    std::thread thread_;

    // Progress thread only.
    std::map<std::string, std::shared_ptr<Ep>> eps_;
    // Initiators that announced themselves, by token: our endpoints to them, on which their
    // requests are answered. UCX's own endpoints for peers that connected to us (the reply_ep of
    // a message) are never held: UCX destroys them by itself when keepalive finds the peer dead.
    std::unordered_map<uint64_t, std::shared_ptr<Ep>> replies_;
    std::string my_address_;  // our worker address, announced to every peer we connect to
    uint64_t next_generation_ = 1;
    std::unordered_map<ucp_ep_h, std::shared_ptr<Ep>> by_handle_;
    std::unordered_map<uint64_t, std::shared_ptr<Pending>> pending_;
    std::unordered_multimap<uint64_t, uint64_t> by_op_;  // op id -> request ids
    std::deque<std::function<void()>> deferred_;         // work that may not run in a callback
    std::vector<std::shared_ptr<Ep>> closing_;
    // Requests served for peers that UCX still works on (a rendezvous receive into one of our
    // regions, a reply): the worker may not be destroyed under them.
    size_t serving_inflight_ = 0;
    bool stopping_local_ = false;  // Stop began: new requests are refused
    uint64_t next_request_ = 1;

    // One-sided access we granted, by region: its UCX mapping and who holds a grant.
    struct Granted {
        ucp_mem_h memh = nullptr;
        std::string packed;
        uint64_t address = 0;
        uint64_t length = 0;
        std::unordered_set<uint64_t> grantees;  // initiator tokens
    };
    std::unordered_map<RegionId, Granted> granted_;
    // Transfers waiting for grants, by op id.
    struct Awaiting {
        std::shared_ptr<TransferOp> op;
        std::shared_ptr<std::vector<Chunk>> chunks;
    };
    std::unordered_map<uint64_t, Awaiting> awaiting_;
    std::unordered_set<RegionId> revoking_;  // being (or were) deregistered: no new grants
    struct Revocation {
        RegionId region = 0;
        std::unordered_set<uint64_t> waiting;  // grantees that have not acknowledged yet
        std::shared_ptr<std::promise<void>> done;
    };
    std::unordered_map<uint64_t, Revocation> revocations_;
    uint64_t next_revocation_ = 1;
    std::atomic<uint64_t> one_sided_{0};
    std::atomic<uint64_t> messages_sent_{0};  // active messages (AgentStats)
    std::atomic<uint64_t> messages_received_{0};
};

}  // namespace ferry
