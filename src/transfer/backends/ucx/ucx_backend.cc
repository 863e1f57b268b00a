#include "transfer/backends/ucx/ucx_backend.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>

#include <algorithm>
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

namespace ferry {

using internal::TransferOp;

namespace {

// Active message ids.
enum : uint16_t {
    kAmWrite = 1,
    kAmRead = 2,
    kAmPull = 3,
    kAmNotify = 4,
    kAmReply = 5,
    kAmHello = 6,   // an initiator's worker address: the target answers on an endpoint of its own
    kAmBye = 7,     // the initiator closed that endpoint: the target closes its own
    kAmGrant = 8,   // one-sided access to a region: answered with its address, length and rkey
    kAmRevoke = 9,  // target -> grantee: let go of a region (Deregister)
    kAmRevokeAck = 10  // grantee -> target: done with it
};

// A grant's answer: u64 address, u64 length, then the packed rkey (at most this much).
constexpr size_t kMaxPackedRkey = 4096;

constexpr size_t kSegmentBytes = 32;
// The progress thread polls without sleeping for this long after the last event.
constexpr auto kSpinAfterActivity = std::chrono::microseconds(500);
constexpr size_t kRequestHeaderFixed = 8 * 4 + 4;
// After a peer process's endpoint failed, how long before we try to connect to it again.
constexpr auto kReconnectBackoff = std::chrono::seconds(1);
// How long a clean close waits for what was sent to arrive before it forces the close.
constexpr auto kFlushBeforeClose = std::chrono::seconds(2);

// "<hex worker address>.<16 hex digits token>"
Status ParseAddress(std::string_view address, std::string* worker, uint64_t* token) {
    size_t dot = address.rfind('.');
    std::string tok;
    if (dot == std::string_view::npos || address.size() - dot - 1 != 16 ||
        !HexDecode(address.substr(0, dot), worker) || worker->empty() ||
        !HexDecode(address.substr(dot + 1), &tok)) {
        return InvalidArgumentError("ucx endpoint address '" + std::string(address.substr(0, 64)) +
                                    "' is not <hex worker address>.<16 hex digit token>");
    }
    *token = 0;
    for (char c : tok) *token = (*token << 8) | static_cast<uint8_t>(c);
    return Status::Ok();
}

Status FromUcs(ucs_status_t s, std::string_view what) {
    return UnavailableError(std::string(what) + ": " + ucs_status_string(s));
}

// UCX moves bytes through sockets ThreadSanitizer cannot see through (and is not instrumented):
// as for the tcp backend (core/tsan.h), a send releases, a receive acquires, and the kernel's
// reads of our buffers are ordered by the protocol. Nothing outside TSan builds.
template <typename F>
auto ThroughUcx(F&& f) {
    FERRY_TSAN_SOCKET_SENT();
    FERRY_TSAN_IGNORE_READS_BEGIN();
    auto r = f();
    FERRY_TSAN_IGNORE_READS_END();
    FERRY_TSAN_SOCKET_RECEIVED();
    return r;
}
unsigned Progress(ucp_worker_h w) {
    return ThroughUcx([&] { return ucp_worker_progress(w); });
}
ucs_status_ptr_t AmSend(ucp_ep_h ep, unsigned id, const void* header, size_t header_length,
                        const void* buffer, size_t count, const ucp_request_param_t* param) {
    return ThroughUcx(
        [&] { return ucp_am_send_nbx(ep, id, header, header_length, buffer, count, param); });
}
ucs_status_ptr_t AmRecv(ucp_worker_h w, void* desc, void* buffer, size_t count,
                        const ucp_request_param_t* param) {
    return ThroughUcx([&] { return ucp_am_recv_data_nbx(w, desc, buffer, count, param); });
}

// Copies an eager message's bytes (already here, in order) into `iov`.
void ScatterEager(const void* data, const std::vector<ucp_dt_iov_t>& iov) {
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
Buffers AsBuffers(std::vector<ucp_dt_iov_t>& iov) {
    if (iov.empty()) return {};
    if (iov.size() == 1) return {iov[0].buffer, iov[0].length, ucp_dt_make_contig(1)};
    return {iov.data(), iov.size(), ucp_dt_make_iov()};
}

}  // namespace

// --- the implementation: all UCX calls happen on the progress thread --------------------------

class UcxBackend::Impl {
  public:
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
        // Which of the initiator's endpoints (announced in kAmHello) it answers; for ours, the
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
    // Opens our endpoint to an initiator that announced itself (kAmHello).
    void OpenReplyEp(uint64_t initiator, uint64_t generation, const std::string& address);
    // Sends kAmHello or kAmBye for our endpoint `ep` (eager, fire and forget).
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
    HandlerArg handler_args_[kAmRevokeAck + 1];
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
};

Result<std::string> UcxBackend::Impl::Init() {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return FromUcs(st, "ucx: reading the UCX configuration");
    // UCX finds dead peers by keepalive on endpoints nobody sends on, among them the ones it
    // made itself for peers that connected to us: each keeps a socket until then. 1 s instead of
    // UCX 1.13's 20 s, unless UCX_KEEPALIVE_INTERVAL says otherwise. (Safe because the backend
    // never holds such an endpoint: UCX destroys them on its own.)
    if (getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
        (void)ucp_config_modify(config, "KEEPALIVE_INTERVAL", "1s");
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    // RMA only with ucx_rma: a worker with UCX's RMA feature runs UCX's software put/get
    // handlers (what RMA becomes over tcp), and those write and read wherever the initiator says,
    // under any rkey it makes up. Without the feature the worker has no such handler.
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (rma_ ? UCP_FEATURE_RMA : 0);
    params.name = agent_.c_str();
    st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) return FromUcs(st, "ucx: ucp_init");

    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread calls UCX
    st = ucp_worker_create(context_, &wp, &worker_);
    if (st != UCS_OK) return FromUcs(st, "ucx: ucp_worker_create");

    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS | UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
    st = ucp_worker_query(worker_, &attr);
    if (st != UCS_OK) return FromUcs(st, "ucx: ucp_worker_query");
    char tok[17];
    snprintf(tok, sizeof tok, "%016llx", static_cast<unsigned long long>(token_));
    my_address_.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
    std::string address =
        HexEncode(reinterpret_cast<const uint8_t*>(attr.address), attr.address_length) + "." + tok;
    ucp_worker_release_address(worker_, attr.address);
    max_header_ = attr.max_am_header;

    for (uint16_t id : {kAmWrite, kAmRead, kAmPull, kAmNotify, kAmReply, kAmHello, kAmBye, kAmGrant,
                        kAmRevoke, kAmRevokeAck}) {
        handler_args_[id] = HandlerArg{this, id};
        ucp_am_handler_param_t hp{};
        hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                        UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
        hp.id = id;
        hp.cb = &Impl::OnAm;
        hp.arg = &handler_args_[id];
        hp.flags = UCP_AM_FLAG_WHOLE_MSG;
        st = ucp_worker_set_am_recv_handler(worker_, &hp);
        if (st != UCS_OK) return FromUcs(st, "ucx: ucp_worker_set_am_recv_handler");
    }
    st = ucp_worker_get_efd(worker_, &efd_);
    if (st != UCS_OK) return FromUcs(st, "ucx: ucp_worker_get_efd");
    return address;
}

Status UcxBackend::Impl::Start(TargetServices* host) {
    host_ = host;
    wake_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_ = epoll_create1(EPOLL_CLOEXEC);
    if (wake_ < 0 || epoll_ < 0) {
        return InternalError(std::string("ucx: eventfd/epoll: ") + strerror(errno));
    }
    for (int fd : {efd_, wake_}) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.fd = fd;
        if (epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev) != 0) {
            return InternalError(std::string("ucx: epoll_ctl: ") + strerror(errno));
        }
    }
    thread_ = std::thread([this] { Loop(); });
    return Status::Ok();
}

bool UcxBackend::Impl::Run(std::function<void()> f) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_ || !thread_.joinable()) return false;
        commands_.push_back(std::move(f));
    }
    uint64_t one = 1;
    ssize_t n = write(wake_, &one, sizeof one);
    (void)n;
    return true;
}

void UcxBackend::Impl::Loop() {
    pthread_setname_np(pthread_self(), ("ucx:" + agent_).substr(0, 15).c_str());
    progress_thread_.store(std::this_thread::get_id(), std::memory_order_release);
    Clock::time_point last_active{};
    // Reused: this loop spins while transfers are in flight, and a fresh std::deque allocates.
    std::deque<std::function<void()>> work;
    for (;;) {
        bool stop = false;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!commands_.empty()) work.swap(commands_);
            stop = stopping_;
        }
        bool active = !work.empty();
        for (auto& f : work) f();
        work.clear();
        while (Progress(worker_) != 0) {
            active = true;
        }
        active = active || !deferred_.empty();
        RunDeferred();
        auto now = Clock::now();
        if (active) last_active = now;
        if (stop) {
            std::lock_guard<std::mutex> lock(mu_);
            if (commands_.empty()) return;
            continue;
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!commands_.empty()) continue;
        }
        // Busy: keep polling (a rendezvous takes many steps, each waiting for the other side);
        // sleep once nothing has happened for a while.
        if (now - last_active < kSpinAfterActivity) continue;
        if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
        epoll_event evs[2];
        // Idle: sleep until UCX or a command wakes us (deferred work left: poll it soon).
        int n = epoll_wait(epoll_, evs, 2, deferred_.empty() ? 100 : 1);
        for (int i = 0; i < n; ++i) {
            if (evs[i].data.fd == wake_) {
                uint64_t v;
                ssize_t r = read(wake_, &v, sizeof v);
                (void)r;
            }
        }
    }
}

void UcxBackend::Impl::Stop() {
    if (!thread_.joinable()) return;
    Run([this] {
        stopping_local_ = true;
        std::vector<std::shared_ptr<Ep>> eps;
        for (auto& [n, ep] : eps_) eps.push_back(ep);
        for (auto& [t, ep] : replies_) eps.push_back(ep);
        for (auto& ep : eps) {
            CloseEp(ep, CancelledError("agent " + agent_ + " is shutting down"), /*force=*/false);
        }
        // Wait (bounded) for the closes and every request to finish.
        auto until = Clock::now() + std::chrono::seconds(5);
        while ((!closing_.empty() || !pending_.empty() || serving_inflight_ > 0) &&
               Clock::now() < until) {
            Progress(worker_);
            RunDeferred();
        }
        if (!pending_.empty() || serving_inflight_ > 0) {
            FERRY_LOG(kWarn, "ucx: {} requests of ours and {} served still pending at shutdown",
                      pending_.size(), serving_inflight_);
        }
        // Endpoints UCX made for peers that reached us (the ones replies go out on) may still
        // have wireup messages queued; UCX 1.13 aborts in ucp_worker_destroy when it purges one
        // (ucp_request_send_state_ff: "got REP message"). Flush the whole worker first.
        ucp_request_param_t fp{};
        ucs_status_ptr_t flush = ucp_worker_flush_nbx(worker_, &fp);
        if (UCS_PTR_IS_PTR(flush)) {
            auto flush_until = Clock::now() + std::chrono::seconds(2);
            while (ucp_request_check_status(flush) == UCS_INPROGRESS &&
                   Clock::now() < flush_until) {
                Progress(worker_);
                RunDeferred();
            }
            if (ucp_request_check_status(flush) == UCS_INPROGRESS) {
                FERRY_LOG(kWarn, "ucx: worker flush still in progress at shutdown");
                ucp_request_cancel(worker_, flush);
                while (ucp_request_check_status(flush) == UCS_INPROGRESS) Progress(worker_);
            }
            ucp_request_free(flush);
        }
        // Then until nothing has happened for a while: a wireup still connecting is not part
        // of the flush.
        auto quiet_until = Clock::now() + std::chrono::seconds(2);
        auto last_event = Clock::now();
        while (Clock::now() - last_event < std::chrono::milliseconds(100) &&
               Clock::now() < quiet_until) {
            if (Progress(worker_) != 0) last_event = Clock::now();
            RunDeferred();
        }
    });
    {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
    }
    uint64_t one = 1;
    ssize_t n = write(wake_, &one, sizeof one);
    (void)n;
    thread_.join();
}

void UcxBackend::Impl::Destroy() {
    if (thread_.joinable()) Stop();
    // What Stop could not close in time: rkeys and mappings go before the worker and context.
    for (auto& [n, ep] : eps_) Closed(ep);
    for (auto& ep : closing_) Closed(ep);
    for (auto& [id, g] : granted_) {
        if (g.memh != nullptr) ucp_mem_unmap(context_, g.memh);
    }
    granted_.clear();
    for (auto& [id, rv] : revocations_) rv.done->set_value();
    revocations_.clear();
    eps_.clear();
    by_handle_.clear();
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
    worker_ = nullptr;
    context_ = nullptr;
    for (int fd : {wake_, epoll_}) {
        if (fd >= 0) close(fd);
    }
    wake_ = epoll_ = -1;
}

Result<std::shared_ptr<UcxBackend::Impl::Ep>> UcxBackend::Impl::GetEp(const PeerRef& peer) {
    auto it = eps_.find(peer.name);
    if (it != eps_.end()) {
        if (it->second->epoch == peer.epoch && !it->second->failed) return it->second;
        CloseEp(it->second, UnavailableError("peer " + peer.name + " restarted (new epoch)"));
    }
    auto ep = std::make_shared<Ep>();
    ep->name = peer.name;
    ep->epoch = peer.epoch;
    ep->impl = this;
    std::string worker;
    FERRY_RETURN_IF_ERROR(
        ParseAddress(peer.address, &worker, &ep->token).WithContext("peer " + peer.name));
    // The same process (its token) failed us a moment ago: most likely it is dead, and UCX 1.13
    // keeps the socket of a connect that is refused at once (loopback, same host) when
    // ucp_ep_create fails; one per attempt. Ask again only after a pause.
    if (auto f = failed_.find(ep->token); f != failed_.end()) {
        auto since = Clock::now() - f->second.first;
        if (since < kReconnectBackoff) {
            return UnavailableError(fmt::format(
                "{} {} ms ago; not reconnecting to that process for {} ms",
                f->second.second.message(),
                std::chrono::duration_cast<std::chrono::milliseconds>(since).count(),
                std::chrono::duration_cast<std::chrono::milliseconds>(kReconnectBackoff).count()));
        }
        failed_.erase(f);
    }
    ep->proof = ProofFor(ep->token);
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(worker.data());
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &Impl::OnEpError;
    params.err_handler.arg = this;
    ucs_status_t st = ucp_ep_create(worker_, &params, &ep->ep);
    if (st != UCS_OK) {
        Status s = FromUcs(st, "ucx: connecting to peer " + peer.name);
        NoteFailure(ep->token, s);
        return s;
    }
    eps_[peer.name] = ep;
    by_handle_[ep->ep] = ep;
    // Announce ourselves first (the peer answers our requests on an endpoint of its own).
    ep->generation = next_generation_++;
    ucs_status_t st_hello = Announce(ep, kAmHello);
    if (st_hello != UCS_OK) {
        Status s = FromUcs(st_hello, "ucx: announcing ourselves to peer " + peer.name);
        CloseEp(ep, s);
        return s;
    }
    return ep;
}

ucs_status_t UcxBackend::Impl::Announce(const std::shared_ptr<Ep>& ep, uint16_t am) {
    ByteWriter w;
    w.U64(ep->token);
    w.U64(ep->proof);
    w.U64(token_);
    w.U64(ep->generation);
    const bool hello = am == kAmHello;
    return SendControl(ep->ep, am, w.Take(), hello ? my_address_.data() : nullptr,
                       hello ? my_address_.size() : 0);
}

void UcxBackend::Impl::OpenReplyEp(uint64_t initiator, uint64_t generation,
                                   const std::string& address) {
    auto it = replies_.find(initiator);
    if (it != replies_.end() && !it->second->failed && it->second->ep != nullptr) {
        it->second->generation = generation;  // the initiator's newer endpoint: same answers
        return;
    }
    if (replies_.size() >= 4096) {
        FERRY_LOG(kWarn, "ucx: {} initiators already announced; ignoring another", replies_.size());
        return;
    }
    auto ep = std::make_shared<Ep>();
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(initiator));
    ep->name = std::string("initiator ") + hex;
    ep->token = initiator;
    ep->impl = this;
    ep->reply = true;
    ep->generation = generation;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(address.data());
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &Impl::OnEpError;
    params.err_handler.arg = this;
    ucs_status_t st = ThroughUcx([&] { return ucp_ep_create(worker_, &params, &ep->ep); });
    if (st != UCS_OK) {
        FERRY_LOG(kWarn, "ucx: cannot open an endpoint to {}: {}", ep->name, ucs_status_string(st));
        return;
    }
    replies_[initiator] = ep;
    by_handle_[ep->ep] = ep;
}

void UcxBackend::Impl::OnEpError(void* arg, ucp_ep_h handle, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    auto it = self->by_handle_.find(handle);
    if (it == self->by_handle_.end()) return;
    std::shared_ptr<Ep> ep = it->second;
    ep->failed = true;
    Status why = UnavailableError("peer " + ep->name + ": UCX endpoint failed (" +
                                  ucs_status_string(status) + ")");
    if (!ep->reply) self->NoteFailure(ep->token, why);
    self->deferred_.push_back([self, ep, why] { self->CloseEp(ep, why); });
}

void UcxBackend::Impl::NoteFailure(uint64_t token, const Status& why) {
    const auto now = Clock::now();
    if (failed_.size() >= 1024) {
        for (auto it = failed_.begin(); it != failed_.end();) {
            it = now - it->second.first >= kReconnectBackoff ? failed_.erase(it) : std::next(it);
        }
    }
    failed_.insert_or_assign(token, std::make_pair(now, why));
}

void UcxBackend::Impl::CloseEp(std::shared_ptr<Ep> ep, const Status& why, bool force) {
    if (ep->ep == nullptr) return;
    const bool was_failed = ep->failed;
    force = force || ep->failed;  // a failed endpoint can only be force-closed
    ep->failed = true;
    if (ep->reply) {
        auto r = replies_.find(ep->token);
        if (r != replies_.end() && r->second == ep) {
            replies_.erase(r);
            // The initiator can no longer be asked to let go: it holds no grant of ours.
            for (auto& [id, g] : granted_) g.grantees.erase(ep->token);
            std::vector<uint64_t> waiting;
            for (auto& [id, rv] : revocations_) {
                if (rv.waiting.count(ep->token) != 0) waiting.push_back(id);
            }
            for (uint64_t id : waiting) Acknowledged(id, ep->token);
        }
    } else {
        auto it = eps_.find(ep->name);
        if (it != eps_.end() && it->second == ep) eps_.erase(it);
    }
    // Fail its requests: each op hears now unless UCX still holds its memory (then when the
    // force close below completes that request).
    std::vector<uint64_t> ids(ep->requests.begin(), ep->requests.end());
    for (uint64_t id : ids) {
        auto p = pending_.find(id);
        if (p != pending_.end()) {
            auto keep = p->second;
            keep->replied = true;
            if (keep->status.ok()) keep->status = why;
            MaybeComplete(keep);
        }
    }
    if (!ep->reply && !was_failed) {
        (void)Announce(ep, kAmBye);  // delivered before the close when it flushes
    }
    ucp_ep_h handle = ep->ep;
    ep->ep = nullptr;
    // Keep progressing until the close is done (the loop does; Stop and CutOff wait for it).
    closing_.push_back(ep);
    if (force) {
        ForceClose(ep, handle);
        return;
    }
    // A clean close flushes first (what we sent, the goodbye among it, arrives; wireup is
    // complete, so the forced close cannot cut it off), then forces the close: UCX 1.13 keeps an
    // endpoint closed without FORCE, and its socket, until the worker goes.
    ucp_request_param_t fp{};
    ucs_status_ptr_t flush = ucp_ep_flush_nbx(handle, &fp);
    if (UCS_PTR_IS_PTR(flush)) {
        PollFlush(flush, ep, handle, Clock::now() + kFlushBeforeClose);
    } else {
        ForceClose(ep, handle);
    }
}

void UcxBackend::Impl::Closed(const std::shared_ptr<Ep>& ep) {
    for (auto& [id, g] : ep->grants) {
        if (g.rkey != nullptr) ucp_rkey_destroy(g.rkey);
    }
    ep->grants.clear();
    for (ucp_rkey_h k : ep->retired) ucp_rkey_destroy(k);
    ep->retired.clear();
}

void UcxBackend::Impl::MaybeComplete(const std::shared_ptr<Pending>& p) {
    if (!p->replied || p->send_req != nullptr || p->recv_req != nullptr || p->rma_inflight > 0) {
        return;
    }
    if (pending_.erase(p->id) == 0) return;  // already reported
    if (p->ep) p->ep->requests.erase(p->id);
    for (RegionId region : p->holds) {
        auto g = p->ep->grants.find(region);
        if (g == p->ep->grants.end()) continue;
        if (--g->second.holds == 0 && g->second.revoked) ReleaseGrant(p->ep, region);
    }
    p->holds.clear();
    if (!p->op) {
        if (p->done) p->done(*p);
        return;
    }
    auto range = by_op_.equal_range(p->op->id());
    for (auto it = range.first; it != range.second; ++it) {
        if (it->second == p->id) {
            by_op_.erase(it);
            break;
        }
    }
    p->op->ChunkDone(p->status, p->value);
}

void UcxBackend::Impl::Finish(const std::shared_ptr<Pending>& p, const Status& s, uint64_t value) {
    p->replied = true;
    if (p->status.ok()) {
        p->status = s;
        p->value = value;
    }
    MaybeComplete(p);
}

void UcxBackend::Impl::Track(const std::shared_ptr<Pending>& p) {
    pending_[p->id] = p;
    if (p->op) by_op_.emplace(p->op->id(), p->id);
    p->ep->requests.insert(p->id);
}

void UcxBackend::Impl::Send(const std::shared_ptr<Pending>& p, uint16_t am, bool with_data) {
    Track(p);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE;
    // The target answers on its own endpoint to us; UCX's reply endpoint is only for refusing
    // an initiator it cannot answer otherwise (unannounced: a wrong token or no secret).
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    Buffers b = with_data ? AsBuffers(p->iov) : Buffers{};
    param.datatype = b.datatype;
    auto* holder = new std::weak_ptr<Pending>(p);
    param.user_data = holder;
    param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
        auto* h = static_cast<std::weak_ptr<Pending>*>(user_data);
        if (auto pp = h->lock()) {
            Impl* self = pp->ep->impl;
            pp->send_req = nullptr;
            if (status != UCS_OK) {
                self->Finish(pp, FromUcs(status, "ucx: sending to peer " + pp->ep->name));
            } else {
                self->MaybeComplete(pp);
            }
        }
        delete h;
        ucp_request_free(request);
    };
    ucs_status_ptr_t r =
        AmSend(p->ep->ep, am, p->header.data(), p->header.size(), b.buffer, b.count, &param);
    if (UCS_PTR_IS_ERR(r)) {
        delete holder;
        Finish(p, FromUcs(UCS_PTR_STATUS(r), "ucx: sending to peer " + p->ep->name));
    } else if (r == nullptr) {
        delete holder;  // done at once: the callback is not called
    } else {
        p->send_req = r;
    }
}

void UcxBackend::Impl::DoPost(const std::shared_ptr<TransferOp>& op, const PeerRef& peer,
                              bool write, std::vector<Chunk> chunks, bool one_sided) {
    bool closed = false;
    {
        std::lock_guard<std::mutex> io(op->io_mu);
        closed = op->io_closed;
    }
    Result<std::shared_ptr<Ep>> got =
        closed ? Result<std::shared_ptr<Ep>>(CancelledError("transfer ended")) : GetEp(peer);
    if (!got.ok()) {
        for (size_t i = 0; i < chunks.size(); ++i) op->ChunkDone(got.status());
        return;
    }
    std::shared_ptr<Ep> ep = *got;
    if (!one_sided || ep->no_rma) {
        PostAm(op, ep, write, chunks);
        return;
    }
    // One-sided: every region needs a grant of the peer first (asked once, kept until revoked).
    std::map<RegionId, uint64_t> missing;
    for (const Chunk& c : chunks) {
        for (const wire::Segment& s : c.remote) {
            auto g = ep->grants.find(s.region);
            if (g == ep->grants.end() || g->second.revoked || g->second.key != s.key) {
                missing[s.region] = s.key;
            }
        }
    }
    if (missing.empty()) {
        PostRma(op, ep, write, chunks);
        return;
    }
    auto left = std::make_shared<size_t>(missing.size());
    auto failed = std::make_shared<Status>();
    auto waiting = std::make_shared<std::vector<Chunk>>(std::move(chunks));
    awaiting_[op->id()] = Awaiting{op, waiting};  // a cut-off fails them meanwhile
    for (const auto& [region, key] : missing) {
        RequestGrant(ep, region, key,
                     [this, op, peer, write, waiting, left, failed, ep](const Status& s) {
                         if (!s.ok() && failed->ok()) *failed = s;
                         if (--*left > 0) return;
                         auto aw = awaiting_.find(op->id());
                         if (aw == awaiting_.end() || aw->second.chunks != waiting) return;
                         awaiting_.erase(aw);
                         if (failed->code() == Code::kUnimplemented) {
                             ep->no_rma = true;  // the peer grants nothing: active messages
                         } else if (!failed->ok()) {
                             for (size_t i = 0; i < waiting->size(); ++i) op->ChunkDone(*failed);
                             return;
                         }
                         // Not from inside the UCX callback that delivered the grant.
                         deferred_.push_back([this, op, peer, write, waiting] {
                             DoPost(op, peer, write, std::move(*waiting), true);
                         });
                     });
    }
}

std::shared_ptr<UcxBackend::Impl::Pending> UcxBackend::Impl::NewChunk(
    const std::shared_ptr<TransferOp>& op, const std::shared_ptr<Ep>& ep, bool write,
    const Chunk& c) {
    auto p = std::make_shared<Pending>();
    p->id = next_request_++;
    p->op = op;
    p->ep = ep;
    p->am = write ? kAmWrite : kAmRead;
    p->bytes = c.bytes;
    return p;
}

void UcxBackend::Impl::PostAm(const std::shared_ptr<TransferOp>& op, const std::shared_ptr<Ep>& ep,
                              bool write, std::vector<Chunk>& chunks) {
    for (Chunk& c : chunks) {
        auto p = NewChunk(op, ep, write, c);
        ByteWriter w;
        w.U64(p->ep->token);
        w.U64(p->ep->proof);
        w.U64(token_);
        w.U64(p->id);
        w.U32(static_cast<uint32_t>(c.remote.size()));
        for (const wire::Segment& s : c.remote) {
            w.U64(s.region);
            w.U64(s.key);
            w.U64(s.offset);
            w.U64(s.length);
        }
        p->header = w.Take();
        for (const iovec& v : c.local) p->iov.push_back(ucp_dt_iov_t{v.iov_base, v.iov_len});
        if (write) {
            Send(p, kAmWrite, true);
        } else {
            Send(p, kAmRead, false);
        }
    }
}

void UcxBackend::Impl::PostRma(const std::shared_ptr<TransferOp>& op, const std::shared_ptr<Ep>& ep,
                               bool write, std::vector<Chunk>& chunks) {
    one_sided_.fetch_add(1, std::memory_order_relaxed);
    std::vector<std::shared_ptr<Pending>> batch;
    for (Chunk& c : chunks) {
        auto p = NewChunk(op, ep, write, c);
        p->replied = true;  // nothing answers: done when UCX completes its requests
        p->rma_get = !write;
        Track(p);
        batch.push_back(p);
        for (const wire::Segment& s : c.remote) {
            if (std::find(p->holds.begin(), p->holds.end(), s.region) == p->holds.end()) {
                p->holds.push_back(s.region);
                ++ep->grants[s.region].holds;
            }
        }
        // Walk the remote segments and the local pieces together (they are cut differently).
        size_t li = 0;
        uint64_t loff = 0;
        for (const wire::Segment& s : c.remote) {
            if (!p->status.ok()) break;
            const Ep::Grant& g = ep->grants[s.region];
            // Against what the target granted, never what its metadata claims.
            if (s.offset > g.length || s.length > g.length - s.offset) {
                p->status = OutOfRangeError(
                    "range [" + std::to_string(s.offset) + ", +" + std::to_string(s.length) +
                    ") outside region " + std::to_string(s.region) + " of " +
                    std::to_string(g.length) + " bytes (as peer " + ep->name + " granted it)");
                break;
            }
            uint64_t moved = 0;
            while (moved < s.length && p->status.ok() && li < c.local.size()) {
                const iovec& v = c.local[li];
                size_t n = std::min<uint64_t>(s.length - moved, v.iov_len - loff);
                IssueRma(p, write, static_cast<char*>(v.iov_base) + loff, n,
                         g.address + s.offset + moved, g.rkey);
                moved += n;
                loff += n;
                if (loff == v.iov_len) {
                    ++li;
                    loff = 0;
                }
            }
        }
    }
    if (write) {
        // A put completes when UCX is done with our memory; the flush completes once every one
        // of them has landed at the peer. Only then is the write done (and its notification
        // sent).
        auto* waiting = new std::vector<std::weak_ptr<Pending>>(batch.begin(), batch.end());
        ucp_request_param_t fp{};
        fp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        fp.user_data = waiting;
        fp.cb.send = [](void* request, ucs_status_t status, void* user_data) {
            auto* w = static_cast<std::vector<std::weak_ptr<Pending>>*>(user_data);
            for (auto& wp : *w) {
                if (auto pp = wp.lock()) {
                    --pp->rma_inflight;
                    if (status != UCS_OK && pp->status.ok()) {
                        pp->status = FromUcs(status, "ucx: flushing writes to " + pp->ep->name);
                    }
                    pp->ep->impl->MaybeComplete(pp);
                }
            }
            delete w;
            ucp_request_free(request);
        };
        for (auto& p : batch) ++p->rma_inflight;
        ucs_status_ptr_t r = ThroughUcx([&] { return ucp_ep_flush_nbx(ep->ep, &fp); });
        if (!UCS_PTR_IS_PTR(r)) {
            delete waiting;
            for (auto& p : batch) {
                --p->rma_inflight;
                if (UCS_PTR_IS_ERR(r) && p->status.ok()) {
                    p->status = FromUcs(UCS_PTR_STATUS(r), "ucx: flushing writes to " + ep->name);
                }
            }
        }
    }
    for (auto& p : batch) MaybeComplete(p);
}

void UcxBackend::Impl::IssueRma(const std::shared_ptr<Pending>& p, bool write, void* local,
                                size_t n, uint64_t remote, ucp_rkey_h rkey) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    auto* holder = new std::weak_ptr<Pending>(p);
    rp.user_data = holder;
    rp.cb.send = [](void* request, ucs_status_t status, void* user_data) {
        auto* h = static_cast<std::weak_ptr<Pending>*>(user_data);
        if (auto pp = h->lock()) {
            Impl* self = pp->ep->impl;
            --pp->rma_inflight;
            if (pp->rma_get) self->Receiving(pp->op->id(), -1);
            if (status != UCS_OK && pp->status.ok()) {
                pp->status = FromUcs(status, std::string(pp->rma_get ? "ucx: reading from peer "
                                                                     : "ucx: writing to peer ") +
                                                 pp->ep->name);
            }
            self->MaybeComplete(pp);
        }
        delete h;
        ucp_request_free(request);
    };
    ucs_status_ptr_t r = ThroughUcx([&] {
        return write ? ucp_put_nbx(p->ep->ep, local, n, remote, rkey, &rp)
                     : ucp_get_nbx(p->ep->ep, local, n, remote, rkey, &rp);
    });
    if (UCS_PTR_IS_PTR(r)) {
        ++p->rma_inflight;
        if (p->rma_get) Receiving(p->op->id(), +1);
        return;
    }
    delete holder;
    if (UCS_PTR_IS_ERR(r)) {
        p->status = FromUcs(
            UCS_PTR_STATUS(r),
            std::string(write ? "ucx: writing to peer " : "ucx: reading from peer ") + p->ep->name);
    }
}

void UcxBackend::Impl::RequestGrant(const std::shared_ptr<Ep>& ep, RegionId region, uint64_t key,
                                    std::function<void(const Status&)> then) {
    auto p = std::make_shared<Pending>();
    p->id = next_request_++;
    p->ep = ep;
    p->am = kAmGrant;
    ByteWriter w;
    w.U64(ep->token);
    w.U64(ep->proof);
    w.U64(token_);
    w.U64(p->id);
    w.U64(region);
    w.U64(key);
    p->header = w.Take();
    p->buffer.resize(16 + kMaxPackedRkey);
    p->iov.push_back(ucp_dt_iov_t{p->buffer.data(), p->buffer.size()});
    p->bytes = p->buffer.size();
    p->done = [this, region, key, then = std::move(then)](Pending& q) {
        Status s = q.status;
        std::shared_ptr<Ep> ep = q.ep;
        uint64_t address = 0, length = 0;
        ByteReader r(std::string_view(q.buffer.data(), std::min<size_t>(q.value, 16)), "ucx grant");
        if (s.ok() &&
            (q.value < 16 || q.value > q.buffer.size() || !r.U64(&address) || !r.U64(&length))) {
            s = DataLossError("peer " + ep->name + " sent a malformed grant of region " +
                              std::to_string(region));
        }
        if (s.ok() && (ep->ep == nullptr || ep->failed)) {
            s = UnavailableError("peer " + ep->name + ": endpoint closed");
        }
        ucp_rkey_h rkey = nullptr;
        if (s.ok()) {
            ucs_status_t st = ucp_ep_rkey_unpack(ep->ep, q.buffer.data() + 16, &rkey);
            if (st != UCS_OK) {
                s = DataLossError("peer " + ep->name + ": the rkey of region " +
                                  std::to_string(region) +
                                  " does not unpack: " + ucs_status_string(st));
            }
        }
        if (s.ok()) {
            Ep::Grant& g = ep->grants[region];
            if (g.revoked) {
                ucp_rkey_destroy(rkey);
                s = NotFoundError("peer " + ep->name + " deregistered region " +
                                  std::to_string(region));
            } else {
                if (g.rkey != nullptr) {
                    if (g.holds > 0) {
                        ep->retired.push_back(g.rkey);
                    } else {
                        ucp_rkey_destroy(g.rkey);
                    }
                }
                g.key = key;
                g.address = address;
                g.length = length;
                g.rkey = rkey;
            }
        }
        then(s);
    };
    Send(p, kAmGrant, false);
}

void UcxBackend::Impl::ServeGrant(const std::shared_ptr<Serving>& sv, RegionId region,
                                  uint64_t key) {
    auto refuse = [&](const Status& s) {
        Reply(sv->initiator, sv->request_id, sv->proof, s, 0, {});
    };
    if (revoking_.count(region) != 0) {
        refuse(NotFoundError("no region " + std::to_string(region) + " (deregistered)"));
        return;
    }
    auto rit = replies_.find(sv->initiator);
    if (rit == replies_.end() || rit->second->failed || rit->second->ep == nullptr) {
        return;  // nobody to answer, nor to revoke the grant from later
    }
    void* base = nullptr;
    uint64_t length = 0;
    Status s = host_->GrantRegion(region, key, &base, &length);
    if (!s.ok()) {
        refuse(s);
        return;
    }
    Granted& g = granted_[region];
    if (g.memh == nullptr) {
        ucp_mem_map_params_t mp{};
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        mp.address = base;
        mp.length = length;
        ucs_status_t st = ucp_mem_map(context_, &mp, &g.memh);
        void* packed = nullptr;
        size_t size = 0;
        if (st == UCS_OK) st = ucp_rkey_pack(context_, g.memh, &packed, &size);
        if (st == UCS_OK && size > kMaxPackedRkey) {
            ucp_rkey_buffer_release(packed);
            st = UCS_ERR_EXCEEDS_LIMIT;
        }
        if (st != UCS_OK) {
            if (g.memh != nullptr) ucp_mem_unmap(context_, g.memh);
            granted_.erase(region);
            refuse(FromUcs(st, "ucx: mapping region " + std::to_string(region)));
            return;
        }
        g.packed.assign(static_cast<const char*>(packed), size);
        ucp_rkey_buffer_release(packed);
        g.address = reinterpret_cast<uint64_t>(base);
        g.length = length;
    }
    g.grantees.insert(sv->initiator);
    ByteWriter w;
    w.U64(g.address);
    w.U64(g.length);
    sv->blob = w.Take() + g.packed;
    sv->iov.push_back(ucp_dt_iov_t{sv->blob.data(), sv->blob.size()});
    Reply(sv->initiator, sv->request_id, sv->proof, Status::Ok(), sv->blob.size(), sv);
}

void UcxBackend::Impl::ReleaseGrant(const std::shared_ptr<Ep>& ep, RegionId region) {
    auto it = ep->grants.find(region);
    if (it == ep->grants.end()) return;
    if (it->second.rkey != nullptr) ucp_rkey_destroy(it->second.rkey);
    std::vector<uint64_t> revokes = std::move(it->second.revokes);
    ep->grants.erase(it);
    for (uint64_t id : revokes) SendRevokeAck(ep, id);
}

ucs_status_t UcxBackend::Impl::SendControl(ucp_ep_h handle, uint16_t am, std::string header,
                                           const void* data, size_t length) {
    auto* h = new std::string(std::move(header));
    ucp_request_param_t hp{};
    hp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    hp.flags = UCP_AM_SEND_FLAG_EAGER;
    hp.user_data = h;
    hp.cb.send = [](void* request, ucs_status_t, void* user_data) {
        delete static_cast<std::string*>(user_data);
        ucp_request_free(request);
    };
    ucs_status_ptr_t r = AmSend(handle, am, h->data(), h->size(), data, length, &hp);
    if (UCS_PTR_IS_PTR(r)) return UCS_OK;
    delete h;
    return UCS_PTR_STATUS(r);
}

void UcxBackend::Impl::SendRevokeAck(const std::shared_ptr<Ep>& ep, uint64_t revocation) {
    if (ep->ep == nullptr || ep->failed) return;  // the target sees the endpoint go instead
    ByteWriter w;
    w.U64(ep->token);
    w.U64(ep->proof);
    w.U64(token_);
    w.U64(revocation);
    (void)SendControl(ep->ep, kAmRevokeAck, w.Take());
}

void UcxBackend::Impl::DoRevoke(RegionId id, const std::shared_ptr<std::promise<void>>& done) {
    revoking_.insert(id);
    auto g = granted_.find(id);
    if (g == granted_.end()) {
        done->set_value();
        return;
    }
    uint64_t rid = next_revocation_++;
    Revocation& rv = revocations_[rid];
    rv.region = id;
    rv.done = done;
    for (uint64_t t : g->second.grantees) {
        auto r = replies_.find(t);
        if (r == replies_.end() || r->second->failed || r->second->ep == nullptr) continue;
        ByteWriter w;
        w.U64(t);
        w.U64(ProofFor(t));
        w.U64(token_);
        w.U64(rid);
        w.U64(id);
        if (SendControl(r->second->ep, kAmRevoke, w.Take()) == UCS_OK) rv.waiting.insert(t);
    }
    if (rv.waiting.empty()) FinishRevocation(rid);
}

void UcxBackend::Impl::DoRevokeExpired(RegionId id) {
    std::vector<uint64_t> late;
    std::vector<uint64_t> ids;
    for (auto& [rid, rv] : revocations_) {
        if (rv.region != id) continue;
        ids.push_back(rid);
        late.insert(late.end(), rv.waiting.begin(), rv.waiting.end());
    }
    for (uint64_t t : late) {
        auto r = replies_.find(t);
        if (r == replies_.end()) continue;
        FERRY_LOG(kWarn,
                  "ucx: {} did not let go of region {} in time; disconnected so that the region "
                  "can go",
                  r->second->name, id);
        CloseEp(r->second, UnavailableError("region " + std::to_string(id) +
                                            " deregistered and the grantee did not let go"));
    }
    for (uint64_t rid : ids) FinishRevocation(rid);
}

void UcxBackend::Impl::Acknowledged(uint64_t revocation, uint64_t grantee) {
    auto it = revocations_.find(revocation);
    if (it == revocations_.end()) return;
    it->second.waiting.erase(grantee);
    if (it->second.waiting.empty()) FinishRevocation(revocation);
}

void UcxBackend::Impl::FinishRevocation(uint64_t revocation) {
    auto it = revocations_.find(revocation);
    if (it == revocations_.end()) return;
    auto g = granted_.find(it->second.region);
    if (g != granted_.end()) {
        if (g->second.memh != nullptr) ucp_mem_unmap(context_, g->second.memh);
        granted_.erase(g);
    }
    it->second.done->set_value();
    revocations_.erase(it);
}

void UcxBackend::Impl::DoNotify(const PeerRef& peer, const std::string& payload,
                                const std::string& sender) {
    Result<std::shared_ptr<Ep>> ep = GetEp(peer);
    if (!ep.ok()) {
        FERRY_LOG(kWarn, "ucx: notification to {} dropped: {}", peer.name, ep.status().ToString());
        return;
    }
    ByteWriter w;
    w.U64((*ep)->token);
    w.U64((*ep)->proof);
    w.Str(sender);
    auto header = std::make_shared<std::string>(w.Take());
    auto body = std::make_shared<std::string>(payload);
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    // Eager only: a rendezvous notification could be overtaken by a later eager one.
    param.flags = UCP_AM_SEND_FLAG_EAGER;
    auto* keep =
        new std::pair<std::shared_ptr<std::string>, std::shared_ptr<std::string>>(header, body);
    param.user_data = keep;
    param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
        delete static_cast<std::pair<std::shared_ptr<std::string>, std::shared_ptr<std::string>>*>(
            user_data);
        ucp_request_free(request);
    };
    ucs_status_ptr_t r = AmSend((*ep)->ep, kAmNotify, header->data(), header->size(), body->data(),
                                body->size(), &param);
    if (!UCS_PTR_IS_PTR(r)) {
        delete keep;
        if (UCS_PTR_IS_ERR(r)) {
            FERRY_LOG(kWarn, "ucx: notification to {} failed: {}", peer.name,
                      ucs_status_string(UCS_PTR_STATUS(r)));
        }
    }
}

void UcxBackend::Impl::DoPull(const std::shared_ptr<TransferOp>& op, const PeerRef& peer,
                              const std::string& key, std::vector<iovec> local, uint64_t capacity) {
    {
        std::lock_guard<std::mutex> io(op->io_mu);
        if (op->io_closed) {
            op->ChunkDone(CancelledError("transfer ended"));
            return;
        }
    }
    Result<std::shared_ptr<Ep>> ep = GetEp(peer);
    if (!ep.ok()) {
        op->ChunkDone(ep.status());
        return;
    }
    auto p = std::make_shared<Pending>();
    p->id = next_request_++;
    p->op = op;
    p->ep = *ep;
    p->am = kAmPull;
    ByteWriter w;
    w.U64(p->ep->token);
    w.U64(p->ep->proof);
    w.U64(token_);
    w.U64(p->id);
    w.U64(capacity);
    w.Str(key);
    p->header = w.Take();
    for (const iovec& v : local) p->iov.push_back(ucp_dt_iov_t{v.iov_base, v.iov_len});
    p->bytes = capacity;
    Send(p, kAmPull, false);
}

void UcxBackend::Impl::DoDropPeer(const std::string& peer, uint64_t epoch, const Status& why) {
    auto it = eps_.find(peer);
    if (it == eps_.end()) return;
    if (epoch != 0 && it->second->epoch != epoch) return;
    // Nothing in flight: a clean close (the peer hears kAmBye and closes its endpoint to us).
    CloseEp(it->second, why, /*force=*/!it->second->requests.empty());
}

void UcxBackend::Impl::DoCutOff(uint64_t op_id, const Status& why) {
    auto aw = awaiting_.find(op_id);
    if (aw != awaiting_.end()) {
        // Still waiting for grants: nothing of its memory was handed to UCX yet.
        Awaiting a = std::move(aw->second);
        awaiting_.erase(aw);
        for (size_t i = 0; i < a.chunks->size(); ++i) a.op->ChunkDone(why);
    }
    std::vector<std::shared_ptr<Pending>> mine;
    auto range = by_op_.equal_range(op_id);
    for (auto it = range.first; it != range.second; ++it) {
        auto p = pending_.find(it->second);
        if (p != pending_.end()) mine.push_back(p->second);
    }
    // UCX reading our memory (a WRITE's send) does not stop the op from reporting: its pins stay
    // with the chunk until UCX lets go, so the memory stays valid and Deregister waits for it.
    // UCX writing our memory (a READ's receive) must stop before the op reports: cancel it, and
    // close the endpoint under it.
    std::unordered_set<std::shared_ptr<Ep>> close;
    for (auto& p : mine) {
        if (p->recv_req != nullptr || (p->rma_get && p->rma_inflight > 0)) {
            if (p->recv_req != nullptr) ucp_request_cancel(worker_, p->recv_req);
            close.insert(p->ep);
        } else if (p->send_req != nullptr || p->rma_inflight > 0) {
            close.insert(p->ep);
        } else {
            Finish(p, why);  // only waiting for a reply: forget it
        }
    }
    for (auto& ep : close) {
        CloseEp(ep, UnavailableError("endpoint to " + ep->name + " closed to stop transfer " +
                                     std::to_string(op_id) + " (" + why.message() + ")"));
    }
    auto receiving = [&] {
        for (auto& p : mine) {
            if (p->recv_req != nullptr || (p->rma_get && p->rma_inflight > 0)) return true;
        }
        return false;
    };
    auto until = Clock::now() + std::chrono::seconds(2);
    while (receiving() && Clock::now() < until) {
        Progress(worker_);
        RunDeferred();
    }
    if (receiving()) {
        FERRY_LOG(kError,
                  "ucx: transfer {}: a cancelled receive is still held by UCX after 2 s; its "
                  "local region stays pinned until UCX lets go",
                  op_id);
    }
}

void UcxBackend::Impl::Reply(uint64_t initiator, uint64_t request_id, uint64_t proof,
                             const Status& s, uint64_t value, std::shared_ptr<Serving> data) {
    auto it = replies_.find(initiator);
    if (it == replies_.end() || it->second->failed || it->second->ep == nullptr) {
        // The initiator is gone (its endpoint failed) or never announced itself: nobody to
        // answer. Its transfer fails on its side (peer failure or deadline).
        FERRY_LOG(kDebug, "ucx: no endpoint to answer request {} of initiator {:016x}", request_id,
                  initiator);
        return;
    }
    SendReply(it->second->ep, request_id, proof, s, value, std::move(data));
}

void UcxBackend::Impl::SendReply(ucp_ep_h reply_ep, uint64_t request_id, uint64_t proof,
                                 const Status& s, uint64_t value, std::shared_ptr<Serving> data) {
    ByteWriter w;
    w.U64(request_id);
    w.U64(proof);
    w.U8(static_cast<uint8_t>(s.code()));
    w.U64(value);
    w.Str(s.message().substr(0, wire::kMaxMessageLen));
    auto sv = data ? data : std::make_shared<Serving>();
    sv->header = w.Take();
    sv->impl = this;
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    Buffers b = AsBuffers(sv->iov);
    param.datatype = b.datatype;
    auto* holder = new std::shared_ptr<Serving>(sv);
    param.user_data = holder;
    param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
        auto* h = static_cast<std::shared_ptr<Serving>*>(user_data);
        --(*h)->impl->serving_inflight_;
        delete h;  // unpins
        ucp_request_free(request);
    };
    ucs_status_ptr_t r =
        AmSend(reply_ep, kAmReply, sv->header.data(), sv->header.size(), b.buffer, b.count, &param);
    if (UCS_PTR_IS_PTR(r)) {
        ++serving_inflight_;
    } else {
        delete holder;
        if (UCS_PTR_IS_ERR(r)) {
            FERRY_LOG(kWarn, "ucx: reply to request {} failed: {}", request_id,
                      ucs_status_string(UCS_PTR_STATUS(r)));
        }
    }
}

ucs_status_t UcxBackend::Impl::OnAm(void* arg, const void* header, size_t header_length, void* data,
                                    size_t length, const ucp_am_recv_param_t* param) {
    auto* a = static_cast<HandlerArg*>(arg);
    std::string_view h(static_cast<const char*>(header), header_length);
    if (a->id == kAmReply) return a->self->HandleReply(h, data, length, param);
    return a->self->HandleRequest(a->id, h, data, length, param);
}

ucs_status_t UcxBackend::Impl::HandleRequest(uint16_t am, std::string_view header, void* data,
                                             size_t length, const ucp_am_recv_param_t* param) {
    ByteReader r(header, "ucx request");
    uint64_t token = 0, proof = 0;
    if (!r.U64(&token) || !r.U64(&proof)) {
        Release(data, param);
        return UCS_OK;
    }
    if (am == kAmHello || am == kAmBye) {
        uint64_t initiator = 0, generation = 0;
        bool ok = r.U64(&initiator) && r.U64(&generation) && r.Finish().ok() &&
                  !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) &&
                  (am == kAmBye ? length == 0 : length > 0 && length <= 65536);
        if (const char* why = Refusal(ok, token, proof)) {
            FERRY_LOG(kWarn, "ucx: an initiator's announcement refused ({})", why);
            Release(data, param);
            return UCS_OK;
        }
        if (am == kAmBye) {
            deferred_.push_back([this, initiator, generation] {
                auto it = replies_.find(initiator);
                if (it != replies_.end() && it->second->generation == generation) {
                    CloseEp(it->second, CancelledError("the initiator closed its endpoint"),
                            /*force=*/false);
                }
            });
            return UCS_OK;
        }
        std::string address(static_cast<const char*>(data), length);
        deferred_.push_back([this, initiator, generation, address] {
            OpenReplyEp(initiator, generation, address);
        });
        return UCS_OK;
    }
    if (am == kAmRevoke || am == kAmRevokeAck) {
        uint64_t sender = 0, revocation = 0, region = 0;
        bool ok = r.U64(&sender) && r.U64(&revocation) && (am == kAmRevokeAck || r.U64(&region)) &&
                  r.Finish().ok() && length == 0;
        if (const char* why = Refusal(ok, token, proof)) {
            FERRY_LOG(kWarn, "ucx: a revocation message refused ({})", why);
            Release(data, param);
            return UCS_OK;
        }
        if (am == kAmRevokeAck) {
            deferred_.push_back([this, revocation, sender] { Acknowledged(revocation, sender); });
            return UCS_OK;
        }
        deferred_.push_back([this, sender, revocation, region] {
            // Our endpoint to the target that revokes: the grant lives there.
            std::shared_ptr<Ep> ep;
            for (auto& [n, e] : eps_) {
                if (e->token == sender && !e->failed && e->ep != nullptr) ep = e;
            }
            if (!ep) return;  // we hold nothing of its; it sees our endpoint go
            auto g = ep->grants.find(region);
            if (g == ep->grants.end()) {
                SendRevokeAck(ep, revocation);
                return;
            }
            g->second.revoked = true;
            g->second.revokes.push_back(revocation);
            if (g->second.holds == 0) ReleaseGrant(ep, region);  // else when the last chunk ends
        });
        return UCS_OK;
    }
    if (am == kAmNotify) {
        std::string sender;
        bool ok = r.Str(&sender, wire::kMaxNameLen) && r.Finish().ok();
        if (const char* why = Refusal(ok, token, proof)) {
            FERRY_LOG(kWarn, "ucx: notification refused ({})", why);
            Release(data, param);
            return UCS_OK;
        }
        if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
            FERRY_LOG(kWarn, "ucx: notification from {} sent by rendezvous, dropped", sender);
            return UCS_OK;
        }
        host_->DeliverNotification(std::move(sender),
                                   std::string(static_cast<const char*>(data), length));
        return UCS_OK;
    }
    uint64_t initiator = 0, request_id = 0;
    if (!r.U64(&initiator) || !r.U64(&request_id)) {
        Release(data, param);
        return UCS_OK;
    }
    const uint64_t reply_proof = ProofFor(initiator);
    auto refuse = [&](const Status& s) {
        Release(data, param);
        deferred_.push_back([this, initiator, request_id, reply_proof, s] {
            Reply(initiator, request_id, reply_proof, s, 0, {});
        });
        return UCS_OK;
    };
    // Initiators we may have no endpoint to (their announcement was refused, or we are closing
    // ours) are refused at once on UCX's reply endpoint, valid during this callback only.
    auto refuse_now = [&](const Status& s) {
        Release(data, param);
        if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
            SendReply(param->reply_ep, request_id, reply_proof, s, 0, {});
        }
        return UCS_OK;
    };
    if (stopping_local_) {
        return refuse_now(UnavailableError("agent " + agent_ + " is shutting down"));
    }
    if (token != token_) {
        return refuse_now(UnavailableError(
            "agent " + agent_ + ": wrong ucx endpoint token (metadata of an earlier process?)"));
    }
    if (!secret_.empty() && proof != my_proof_) {
        return refuse_now(PermissionDeniedError(
            "agent " + agent_ + ": the initiator did not prove the deployment secret"));
    }
    auto sv = std::make_shared<Serving>();
    sv->initiator = initiator;
    sv->request_id = request_id;
    sv->proof = reply_proof;
    sv->impl = this;
    std::vector<iovec> iov;
    if (am == kAmGrant) {
        uint64_t region = 0, key = 0;
        if (!r.U64(&region) || !r.U64(&key) || !r.Finish().ok() || length != 0) {
            return refuse(InvalidArgumentError("malformed ucx grant request"));
        }
        if (!rma_) {
            return refuse(UnimplementedError("agent " + agent_ +
                                             " grants no one-sided ucx access (ucx_rma is off)"));
        }
        deferred_.push_back([this, sv, region, key] { ServeGrant(sv, region, key); });
        return UCS_OK;
    }
    if (am == kAmPull) {
        uint64_t capacity = 0;
        std::string key;
        if (!r.U64(&capacity) || !r.Str(&key, wire::kMaxKeyLen) || !r.Finish().ok()) {
            return refuse(InvalidArgumentError("malformed ucx pull request"));
        }
        uint64_t size = 0;
        Status s = host_->ResolveObject(key, &sv->pins, &iov, &size);
        if (!s.ok()) return refuse(s);
        if (size > capacity) {
            deferred_.push_back([this, initiator, request_id, reply_proof, size] {
                Reply(initiator, request_id, reply_proof, Status::Ok(), size, {});
            });
            return UCS_OK;
        }
        for (const iovec& v : iov) sv->iov.push_back(ucp_dt_iov_t{v.iov_base, v.iov_len});
        deferred_.push_back([this, sv, size] {
            Reply(sv->initiator, sv->request_id, sv->proof, Status::Ok(), size, sv);
        });
        return UCS_OK;
    }
    uint32_t n = 0;
    if (!r.Count(&n, wire::kMaxSegmentsPerFrame, kSegmentBytes)) {
        return refuse(InvalidArgumentError("malformed ucx data request: " + r.error().message()));
    }
    std::vector<wire::Segment> segs(n);
    uint64_t total = 0;
    for (wire::Segment& s : segs) {
        if (!r.U64(&s.region) || !r.U64(&s.key) || !r.U64(&s.offset) || !r.U64(&s.length)) break;
        total += s.length;
    }
    if (!r.Finish().ok()) {
        return refuse(InvalidArgumentError("malformed ucx data request: " + r.error().message()));
    }
    Status s = host_->PinSegments(segs, am == kAmWrite, &sv->pins, &iov, &sv->staging);
    if (!s.ok()) return refuse(s);
    for (const iovec& v : iov) sv->iov.push_back(ucp_dt_iov_t{v.iov_base, v.iov_len});
    if (am == kAmRead) {
        if (length != 0) return refuse(InvalidArgumentError("ucx read request carries data"));
        deferred_.push_back([this, sv] {
            // File regions: read their bytes into the staging buffer first (on this thread).
            Status st = sv->staging.empty() ? Status::Ok()
                                            : host_->MoveStaged(sv->staging, /*to_file=*/false);
            if (!st.ok()) {
                sv->pins.clear();
                Reply(sv->initiator, sv->request_id, sv->proof, st, 0, {});
                return;
            }
            Reply(sv->initiator, sv->request_id, sv->proof, Status::Ok(), 0, sv);
        });
        return UCS_OK;
    }
    if (am != kAmWrite) return refuse(InvalidArgumentError("unknown ucx request"));
    if (length != total) {
        return refuse(InvalidArgumentError("ucx write of " + std::to_string(length) +
                                           " bytes for segments of " + std::to_string(total)));
    }
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        ScatterEager(data, sv->iov);  // eager: the bytes are here already
        Release(data, param);
        sv->iov.clear();
        deferred_.push_back([this, sv] {
            Status st = sv->staging.empty() ? Status::Ok()
                                            : host_->MoveStaged(sv->staging, /*to_file=*/true);
            sv->pins.clear();
            Reply(sv->initiator, sv->request_id, sv->proof, st, 0, {});
        });
        return UCS_OK;
    }
    // Rendezvous: UCX receives straight into the region.
    ucp_request_param_t rp{};
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    Buffers b = AsBuffers(sv->iov);
    rp.datatype = b.datatype;
    auto* holder = new std::shared_ptr<Serving>(sv);
    rp.user_data = holder;
    rp.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
        auto* h = static_cast<std::shared_ptr<Serving>*>(user_data);
        std::shared_ptr<Serving> sv = *h;
        delete h;
        ucp_request_free(request);
        Impl* self = sv->impl;
        --self->serving_inflight_;
        Status st = status == UCS_OK ? Status::Ok() : FromUcs(status, "ucx: receiving a write");
        sv->iov.clear();
        self->deferred_.push_back([self, sv, st] {
            Status done = st;
            if (done.ok() && !sv->staging.empty()) {
                done = self->host_->MoveStaged(sv->staging, /*to_file=*/true);
            }
            sv->pins.clear();
            self->Reply(sv->initiator, sv->request_id, sv->proof, done, 0, {});
        });
    };
    ucs_status_ptr_t rr = AmRecv(worker_, data, b.buffer, b.count, &rp);
    if (UCS_PTR_IS_ERR(rr)) {
        delete holder;
        Status st = FromUcs(UCS_PTR_STATUS(rr), "ucx: receiving a write");
        deferred_.push_back(
            [this, sv, st] { Reply(sv->initiator, sv->request_id, sv->proof, st, 0, {}); });
    } else if (rr == nullptr) {
        delete holder;
        deferred_.push_back([this, sv] {
            Status st = sv->staging.empty() ? Status::Ok()
                                            : host_->MoveStaged(sv->staging, /*to_file=*/true);
            sv->pins.clear();
            Reply(sv->initiator, sv->request_id, sv->proof, st, 0, {});
        });
    } else {
        ++serving_inflight_;  // UCX writes into the pinned region until the callback
    }
    return UCS_OK;
}

ucs_status_t UcxBackend::Impl::HandleReply(std::string_view header, void* data, size_t length,
                                           const ucp_am_recv_param_t* param) {
    ByteReader r(header, "ucx reply");
    uint64_t request_id = 0, proof = 0, value = 0;
    uint8_t code = 0;
    std::string message;
    if (!r.U64(&request_id) || !r.U64(&proof)) {
        FERRY_LOG(kWarn, "ucx: malformed reply dropped");
        Release(data, param);
        return UCS_OK;
    }
    auto it = pending_.find(request_id);
    if (it == pending_.end() || it->second->replied) {
        Release(data, param);  // late (the op ended) or unknown
        return UCS_OK;
    }
    std::shared_ptr<Pending> p = it->second;
    if (!secret_.empty() && proof != my_proof_) {
        Release(data, param);
        Finish(p, PermissionDeniedError("peer " + p->ep->name +
                                        " did not prove the deployment secret (an impostor?)"));
        return UCS_OK;
    }
    // The request it answers is known: fail it now rather than at its deadline.
    if (!r.U8(&code) || !r.U64(&value) || !r.Str(&message, wire::kMaxMessageLen) ||
        !r.Finish().ok() || code > static_cast<uint8_t>(Code::kDataLoss)) {
        Release(data, param);
        Finish(p, DataLossError("peer " + p->ep->name + " sent a malformed reply" +
                                (code > static_cast<uint8_t>(Code::kDataLoss)
                                     ? " (status code " + std::to_string(code) + ")"
                                     : std::string())));
        return UCS_OK;
    }
    if (code != 0) {
        Release(data, param);
        Finish(p, Status(static_cast<Code>(code), message));
        return UCS_OK;
    }
    uint64_t expect = p->am == kAmRead ? p->bytes : (value <= p->bytes ? value : 0);
    if (length != expect) {
        Release(data, param);
        Finish(
            p,
            length == 0 && p->am == kAmPull
                ? Status::Ok()
                : DataLossError("peer " + p->ep->name + " answered with " + std::to_string(length) +
                                " bytes, expected " + std::to_string(expect)),
            value);
        return UCS_OK;
    }
    if (length == 0) {
        Finish(p, Status::Ok(), value);
        return UCS_OK;
    }
    if (p->op) {
        std::lock_guard<std::mutex> io(p->op->io_mu);
        if (p->op->io_closed) {
            Release(data, param);
            Finish(p, CancelledError("transfer ended"), value);
            return UCS_OK;
        }
    }
    // The local iov may be longer than the object (pull): cut it to the bytes that come.
    std::vector<ucp_dt_iov_t> into;
    uint64_t left = length;
    for (const ucp_dt_iov_t& v : p->iov) {
        if (left == 0) break;
        size_t n = std::min<uint64_t>(v.length, left);
        into.push_back(ucp_dt_iov_t{v.buffer, n});
        left -= n;
    }
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        ScatterEager(data, into);
        Release(data, param);
        Finish(p, Status::Ok(), value);
        return UCS_OK;
    }
    p->iov = std::move(into);
    p->value = value;
    ucp_request_param_t rp{};
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    Buffers b = AsBuffers(p->iov);
    rp.datatype = b.datatype;
    auto* holder = new std::weak_ptr<Pending>(p);
    rp.user_data = holder;
    rp.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
        auto* h = static_cast<std::weak_ptr<Pending>*>(user_data);
        if (auto pp = h->lock()) {
            Impl* self = pp->ep->impl;
            pp->recv_req = nullptr;
            if (pp->op) self->Receiving(pp->op->id(), -1);
            self->Finish(pp,
                         status == UCS_OK ? Status::Ok()
                                          : FromUcs(status, "ucx: receiving from " + pp->ep->name),
                         pp->value);
        }
        delete h;
        ucp_request_free(request);
    };
    ucs_status_ptr_t rr = AmRecv(worker_, data, b.buffer, b.count, &rp);
    if (UCS_PTR_IS_ERR(rr)) {
        delete holder;
        Finish(p, FromUcs(UCS_PTR_STATUS(rr), "ucx: receiving from " + p->ep->name), value);
    } else if (rr == nullptr) {
        delete holder;
        Finish(p, Status::Ok(), value);
    } else {
        p->recv_req = rr;
        if (p->op) Receiving(p->op->id(), +1);
        p->replied = true;  // the status now comes from the receive
    }
    return UCS_OK;
}

// --- UcxBackend -------------------------------------------------------------------------------

UcxBackend::UcxBackend(const AgentConfig& config)
    : config_(config), impl_(std::make_unique<Impl>(config.name, config.secret, config.ucx_rma)) {}

UcxBackend::~UcxBackend() = default;

Result<std::string> UcxBackend::Listen(ScopedFd* listener) {
    (void)listener;
    FERRY_ASSIGN_OR_RETURN(std::string address, impl_->Init());
    size_t hdr = impl_->max_header();
    if (hdr > kRequestHeaderFixed + 1 + kSegmentBytes) {
        max_segments_ = static_cast<uint32_t>(std::min<size_t>(
            (hdr - kRequestHeaderFixed - 1) / kSegmentBytes, wire::kMaxSegmentsPerFrame));
    } else {
        max_segments_ = 1;
    }
    return address;
}

bool UcxBackend::CanReach(const AgentMetadata& self, const AgentMetadata& peer) const {
    return peer.FindEndpoint("ucx") != nullptr;
}

BackendCapabilities UcxBackend::capabilities() const {
    BackendCapabilities c;
    c.data_path = DataPath::kOwn;
    c.locality = Locality::kAnyHost;
    c.one_sided = config_.ucx_rma;
    return c;
}

Status UcxBackend::Start(TargetServices* services) { return impl_->Start(services); }

void UcxBackend::Stop() { impl_->Stop(); }

void UcxBackend::Post(const std::shared_ptr<TransferOp>& op, const PeerRef& peer, bool write,
                      std::vector<Chunk> chunks, bool all_host) {
    const bool one_sided = config_.ucx_rma && all_host;
    size_t n = chunks.size();
    auto shared = std::make_shared<std::vector<Chunk>>(std::move(chunks));
    if (!impl_->Run([this, op, peer, write, shared, one_sided] {
            impl_->DoPost(op, peer, write, std::move(*shared), one_sided);
        })) {
        for (size_t i = 0; i < n; ++i) op->ChunkDone(CancelledError("ucx backend stopped"));
    }
}

Status UcxBackend::Notify(const PeerRef& peer, std::string payload, std::string sender) {
    if (!impl_->Run([this, peer, payload = std::move(payload), sender = std::move(sender)] {
            impl_->DoNotify(peer, payload, sender);
        })) {
        return CancelledError("ucx backend stopped");
    }
    return Status::Ok();
}

void UcxBackend::Pull(const std::shared_ptr<TransferOp>& op, const PeerRef& peer, std::string key,
                      std::vector<iovec> local, uint64_t capacity) {
    if (!impl_->Run([this, op, peer, key = std::move(key), local = std::move(local), capacity] {
            impl_->DoPull(op, peer, key, local, capacity);
        })) {
        op->ChunkDone(CancelledError("ucx backend stopped"));
    }
}

void UcxBackend::RevokeRegion(RegionId id, std::chrono::milliseconds grace) {
    if (!config_.ucx_rma) return;  // nothing granted
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> f = done->get_future();
    if (!impl_->Run([this, id, done] { impl_->DoRevoke(id, done); })) return;  // stopped
    if (f.wait_for(grace) == std::future_status::ready) return;
    // Grantees that did not let go in time are disconnected; then the region goes.
    if (!impl_->Run([this, id] { impl_->DoRevokeExpired(id); })) return;
    f.wait();
}

void UcxBackend::RegionGone(RegionId id) {
    if (!config_.ucx_rma) return;
    impl_->Run([this, id] { impl_->DoRegionGone(id); });
}

uint64_t UcxBackend::one_sided_transfers() const { return impl_->one_sided_transfers(); }

void UcxBackend::PeerLost(const std::string& peer, uint64_t epoch, const Status& why) {
    impl_->Run([this, peer, epoch, why] { impl_->DoDropPeer(peer, epoch, why); });
}

void UcxBackend::CutOff(uint64_t op_id, const Status& why) {
    if (impl_->OnProgressThread()) {
        impl_->DoCutOff(op_id, why);
        return;
    }
    if (!impl_->IsReceiving(op_id)) {
        // UCX writes none of the op's memory: it may report now. The progress thread closes
        // what carries it when it gets there (it can be stuck for seconds in ucp_ep_create,
        // whose tcp connect blocks while a peer's host is unreachable).
        impl_->Run([this, op_id, why] { impl_->DoCutOff(op_id, why); });
        return;
    }
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> f = done->get_future();
    if (!impl_->Run([this, op_id, why, done] {
            impl_->DoCutOff(op_id, why);
            done->set_value();
        })) {
        return;  // stopped: nothing in flight any more
    }
    f.wait();
}

std::unique_ptr<Backend> MakeUcxBackend(const BackendContext& ctx) {
    return std::make_unique<UcxBackend>(ctx.config);
}

}  // namespace ferry
