// The ucx backend's endpoints: to peers (created from the worker address they publish, with peer
// error handling), to initiators that announced themselves (for the replies), their failure and
// their clean or forced close.
#include "transfer/backends/ucx/ucx_impl.h"

namespace ferry {

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
        ucx::ParseAddress(peer.address, &worker, &ep->token).WithContext("peer " + peer.name));
    // The same process (its token) failed us a moment ago: most likely it is dead, and UCX 1.13
    // keeps the socket of a connect that is refused at once (loopback, same host) when
    // ucp_ep_create fails; one per attempt. Ask again only after a pause.
    if (auto f = failed_.find(ep->token); f != failed_.end()) {
        auto since = Clock::now() - f->second.first;
        if (since < ucx::kReconnectBackoff) {
            return UnavailableError(fmt::format(
                "{} {} ms ago; not reconnecting to that process for {} ms",
                f->second.second.message(),
                std::chrono::duration_cast<std::chrono::milliseconds>(since).count(),
                std::chrono::duration_cast<std::chrono::milliseconds>(ucx::kReconnectBackoff)
                    .count()));
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
        Status s = ucx::FromUcs(st, "ucx: connecting to peer " + peer.name);
        NoteFailure(ep->token, s);
        return s;
    }
    eps_[peer.name] = ep;
    by_handle_[ep->ep] = ep;
    // Announce ourselves first (the peer answers our requests on an endpoint of its own).
    ep->generation = next_generation_++;
    ucs_status_t st_hello = Announce(ep, ucx::kAmHello);
    if (st_hello != UCS_OK) {
        Status s = ucx::FromUcs(st_hello, "ucx: announcing ourselves to peer " + peer.name);
        CloseEp(ep, s);
        return s;
    }
    return ep;
}

ucs_status_t UcxBackend::Impl::Announce(const std::shared_ptr<Ep>& ep, uint16_t am) {
    const bool hello = am == ucx::kAmHello;
    return SendControl(ep->ep, am,
                       ucx::Encode(ucx::Announce{{ep->token, ep->proof}, token_, ep->generation}),
                       hello ? my_address_.data() : nullptr, hello ? my_address_.size() : 0);
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
    ucs_status_t st = ucx::ThroughUcx([&] { return ucp_ep_create(worker_, &params, &ep->ep); });
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
            it = now - it->second.first >= ucx::kReconnectBackoff ? failed_.erase(it)
                                                                  : std::next(it);
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
        (void)Announce(ep, ucx::kAmBye);  // delivered before the close when it flushes
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
        PollFlush(flush, ep, handle, Clock::now() + ucx::kFlushBeforeClose);
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

}  // namespace ferry
