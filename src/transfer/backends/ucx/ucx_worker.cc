// The ucx backend's worker and progress thread: the UCX context and worker, the one thread that
// drives them (sleeping on the worker's event fd when idle), start and stop.
#include "transfer/backends/ucx/ucx_impl.h"

namespace ferry {

Result<std::string> UcxBackend::Impl::Init() {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return ucx::FromUcs(st, "ucx: reading the UCX configuration");
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
    if (st != UCS_OK) return ucx::FromUcs(st, "ucx: ucp_init");

    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread calls UCX
    st = ucp_worker_create(context_, &wp, &worker_);
    if (st != UCS_OK) return ucx::FromUcs(st, "ucx: ucp_worker_create");

    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS | UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
    st = ucp_worker_query(worker_, &attr);
    if (st != UCS_OK) return ucx::FromUcs(st, "ucx: ucp_worker_query");
    my_address_.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
    std::string address = ucx::FormatAddress(my_address_, token_);
    ucp_worker_release_address(worker_, attr.address);
    max_header_ = attr.max_am_header;

    for (uint16_t id :
         {ucx::kAmWrite, ucx::kAmRead, ucx::kAmPull, ucx::kAmNotify, ucx::kAmReply, ucx::kAmHello,
          ucx::kAmBye, ucx::kAmGrant, ucx::kAmRevoke, ucx::kAmRevokeAck}) {
        handler_args_[id] = HandlerArg{this, id};
        ucp_am_handler_param_t hp{};
        hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                        UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
        hp.id = id;
        hp.cb = &Impl::OnAm;
        hp.arg = &handler_args_[id];
        hp.flags = UCP_AM_FLAG_WHOLE_MSG;
        st = ucp_worker_set_am_recv_handler(worker_, &hp);
        if (st != UCS_OK) return ucx::FromUcs(st, "ucx: ucp_worker_set_am_recv_handler");
    }
    st = ucp_worker_get_efd(worker_, &efd_);
    if (st != UCS_OK) return ucx::FromUcs(st, "ucx: ucp_worker_get_efd");
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
        while (ucx::Progress(worker_) != 0) {
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
        if (now - last_active < ucx::kSpinAfterActivity) continue;
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
            ucx::Progress(worker_);
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
                ucx::Progress(worker_);
                RunDeferred();
            }
            if (ucp_request_check_status(flush) == UCS_INPROGRESS) {
                FERRY_LOG(kWarn, "ucx: worker flush still in progress at shutdown");
                ucp_request_cancel(worker_, flush);
                while (ucp_request_check_status(flush) == UCS_INPROGRESS) ucx::Progress(worker_);
            }
            ucp_request_free(flush);
        }
        // Then until nothing has happened for a while: a wireup still connecting is not part
        // of the flush.
        auto quiet_until = Clock::now() + std::chrono::seconds(2);
        auto last_event = Clock::now();
        while (Clock::now() - last_event < std::chrono::milliseconds(100) &&
               Clock::now() < quiet_until) {
            if (ucx::Progress(worker_) != 0) last_event = Clock::now();
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

}  // namespace ferry
