// The ucx backend's requests: active-message writes and reads, notifications, pulls by key, the
// tracking of each until its reply and its completion, cut-offs, and the replies we send.
#include "transfer/backends/ucx/ucx_impl.h"

namespace ferry {

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
    ucx::Buffers b = with_data ? ucx::AsBuffers(p->iov) : ucx::Buffers{};
    param.datatype = b.datatype;
    auto* holder = new std::weak_ptr<Pending>(p);
    param.user_data = holder;
    param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
        auto* h = static_cast<std::weak_ptr<Pending>*>(user_data);
        if (auto pp = h->lock()) {
            Impl* self = pp->ep->impl;
            pp->send_req = nullptr;
            if (status != UCS_OK) {
                self->Finish(pp, ucx::FromUcs(status, "ucx: sending to peer " + pp->ep->name));
            } else {
                self->MaybeComplete(pp);
            }
        }
        delete h;
        ucp_request_free(request);
    };
    messages_sent_.fetch_add(1, std::memory_order_relaxed);
    ucs_status_ptr_t r =
        ucx::AmSend(p->ep->ep, am, p->header.data(), p->header.size(), b.buffer, b.count, &param);
    if (UCS_PTR_IS_ERR(r)) {
        delete holder;
        Finish(p, ucx::FromUcs(UCS_PTR_STATUS(r), "ucx: sending to peer " + p->ep->name));
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
    p->am = write ? ucx::kAmWrite : ucx::kAmRead;
    p->bytes = c.bytes;
    return p;
}

void UcxBackend::Impl::PostAm(const std::shared_ptr<TransferOp>& op, const std::shared_ptr<Ep>& ep,
                              bool write, std::vector<Chunk>& chunks) {
    for (Chunk& c : chunks) {
        auto p = NewChunk(op, ep, write, c);
        ucx::DataRequest req{{{p->ep->token, p->ep->proof}, token_, p->id}, std::move(c.remote)};
        p->header = ucx::Encode(req);
        for (const iovec& v : c.local) p->iov.push_back(ucp_dt_iov_t{v.iov_base, v.iov_len});
        if (write) {
            Send(p, ucx::kAmWrite, true);
        } else {
            Send(p, ucx::kAmRead, false);
        }
    }
}

void UcxBackend::Impl::DoNotify(const PeerRef& peer, const std::string& payload,
                                const std::string& sender) {
    Result<std::shared_ptr<Ep>> ep = GetEp(peer);
    if (!ep.ok()) {
        FERRY_LOG(kWarn, "ucx: notification to {} dropped: {}", peer.name, ep.status().ToString());
        return;
    }
    auto header = std::make_shared<std::string>(
        ucx::Encode(ucx::NotifyHeader{{(*ep)->token, (*ep)->proof}, sender}));
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
    messages_sent_.fetch_add(1, std::memory_order_relaxed);
    ucs_status_ptr_t r = ucx::AmSend((*ep)->ep, ucx::kAmNotify, header->data(), header->size(),
                                     body->data(), body->size(), &param);
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
    p->am = ucx::kAmPull;
    p->header =
        ucx::Encode(ucx::PullRequest{{{p->ep->token, p->ep->proof}, token_, p->id}, capacity, key});
    for (const iovec& v : local) p->iov.push_back(ucp_dt_iov_t{v.iov_base, v.iov_len});
    p->bytes = capacity;
    Send(p, ucx::kAmPull, false);
}

void UcxBackend::Impl::DoDropPeer(const std::string& peer, uint64_t epoch, const Status& why) {
    auto it = eps_.find(peer);
    if (it == eps_.end()) return;
    if (epoch != 0 && it->second->epoch != epoch) return;
    // Nothing in flight: a clean close (the peer hears ucx::kAmBye and closes its endpoint to us).
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
        ucx::Progress(worker_);
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
    auto sv = data ? data : std::make_shared<Serving>();
    sv->header = ucx::Encode(ucx::Reply{request_id, proof, s.code(), value, s.message()});
    sv->impl = this;
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    ucx::Buffers b = ucx::AsBuffers(sv->iov);
    param.datatype = b.datatype;
    auto* holder = new std::shared_ptr<Serving>(sv);
    param.user_data = holder;
    param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
        auto* h = static_cast<std::shared_ptr<Serving>*>(user_data);
        --(*h)->impl->serving_inflight_;
        delete h;  // unpins
        ucp_request_free(request);
    };
    messages_sent_.fetch_add(1, std::memory_order_relaxed);
    ucs_status_ptr_t r = ucx::AmSend(reply_ep, ucx::kAmReply, sv->header.data(), sv->header.size(),
                                     b.buffer, b.count, &param);
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

}  // namespace ferry
