// The handlers of peers' active messages (UCX callbacks on the progress thread): each checks the
// envelope (the receiver token and proof), decodes its header (ucx_messages.h), and serves
// through the agent's TargetServices. What may not run inside a UCX callback is deferred.
#include "transfer/backends/ucx/ucx_impl.h"

namespace ferry {

ucs_status_t UcxBackend::Impl::OnAm(void* arg, const void* header, size_t header_length, void* data,
                                    size_t length, const ucp_am_recv_param_t* param) {
    auto* a = static_cast<HandlerArg*>(arg);
    a->self->messages_received_.fetch_add(1, std::memory_order_relaxed);
    std::string_view h(static_cast<const char*>(header), header_length);
    if (a->id == ucx::kAmReply) return a->self->HandleReply(h, data, length, param);
    return a->self->HandleRequest(a->id, h, data, length, param);
}

ucs_status_t UcxBackend::Impl::HandleRequest(uint16_t am, std::string_view header, void* data,
                                             size_t length, const ucp_am_recv_param_t* param) {
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    switch (am) {
        case ucx::kAmHello:
        case ucx::kAmBye:
            OnAnnounce(am == ucx::kAmHello, header, data, length, rndv);
            return UCS_OK;
        case ucx::kAmRevoke:
        case ucx::kAmRevokeAck:
            OnRevoke(am == ucx::kAmRevokeAck, header, length);
            return UCS_OK;
        case ucx::kAmNotify:
            OnNotify(header, data, length, rndv);
            return UCS_OK;
        default:
            break;
    }
    // A request with a reply: from here on a refusal is answered.
    Result<ucx::RequestHead> head = ucx::DecodeRequestHead(header);
    if (!head.ok()) {
        Release(data, param);  // nobody to answer
        return UCS_OK;
    }
    Incoming in{*head, ProofFor(head->initiator), data, length, param};
    // Initiators we may have no endpoint to (their announcement was refused, or we are closing
    // ours) are refused at once on UCX's reply endpoint, valid during this callback only.
    if (stopping_local_) {
        return RefuseNow(in, UnavailableError("agent " + agent_ + " is shutting down"));
    }
    if (head->to.token != token_) {
        return RefuseNow(in, UnavailableError("agent " + agent_ +
                                              ": wrong ucx endpoint token (metadata of an "
                                              "earlier process?)"));
    }
    if (!secret_.empty() && head->to.proof != my_proof_) {
        return RefuseNow(in, PermissionDeniedError("agent " + agent_ +
                                                   ": the initiator did not prove the deployment "
                                                   "secret"));
    }
    switch (am) {
        case ucx::kAmGrant:
            return ServeGrantRequest(in, header);
        case ucx::kAmPull:
            return ServePullRequest(in, header);
        case ucx::kAmWrite:
        case ucx::kAmRead:
            return ServeDataRequest(am == ucx::kAmWrite, in, header);
        default:
            return Refuse(in, InvalidArgumentError("unknown ucx request " + std::to_string(am)));
    }
}

ucs_status_t UcxBackend::Impl::Refuse(const Incoming& in, const Status& s) {
    Release(in.data, in.param);
    deferred_.push_back([this, initiator = in.head.initiator, request_id = in.head.request_id,
                         proof = in.reply_proof,
                         s] { Reply(initiator, request_id, proof, s, 0, {}); });
    return UCS_OK;
}

ucs_status_t UcxBackend::Impl::RefuseNow(const Incoming& in, const Status& s) {
    Release(in.data, in.param);
    if (in.param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
        SendReply(in.param->reply_ep, in.head.request_id, in.reply_proof, s, 0, {});
    }
    return UCS_OK;
}

std::shared_ptr<UcxBackend::Impl::Serving> UcxBackend::Impl::NewServing(const Incoming& in) {
    auto sv = std::make_shared<Serving>();
    sv->initiator = in.head.initiator;
    sv->request_id = in.head.request_id;
    sv->proof = in.reply_proof;
    sv->impl = this;
    return sv;
}

void UcxBackend::Impl::OnAnnounce(bool hello, std::string_view header, void* data, size_t length,
                                  bool rndv) {
    Result<ucx::Announce> m = ucx::DecodeAnnounce(header);
    const bool ok = m.ok() && !rndv && (hello ? length > 0 && length <= 65536 : length == 0);
    if (const char* why = Refusal(ok, ok ? m->to.token : 0, ok ? m->to.proof : 0)) {
        FERRY_LOG(kWarn, "ucx: an initiator's announcement refused ({})", why);
        return;
    }
    const uint64_t initiator = m->initiator, generation = m->generation;
    if (!hello) {
        deferred_.push_back([this, initiator, generation] {
            auto it = replies_.find(initiator);
            if (it != replies_.end() && it->second->generation == generation) {
                CloseEp(it->second, CancelledError("the initiator closed its endpoint"),
                        /*force=*/false);
            }
        });
        return;
    }
    std::string address(static_cast<const char*>(data), length);
    deferred_.push_back(
        [this, initiator, generation, address] { OpenReplyEp(initiator, generation, address); });
}

void UcxBackend::Impl::OnRevoke(bool ack, std::string_view header, size_t length) {
    Result<ucx::Revoke> m = ucx::DecodeRevoke(header, ack);
    const bool ok = m.ok() && length == 0;
    if (const char* why = Refusal(ok, ok ? m->to.token : 0, ok ? m->to.proof : 0)) {
        FERRY_LOG(kWarn, "ucx: a revocation message refused ({})", why);
        return;
    }
    const uint64_t sender = m->sender, revocation = m->revocation, region = m->region;
    if (ack) {
        deferred_.push_back([this, revocation, sender] { Acknowledged(revocation, sender); });
        return;
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
}

void UcxBackend::Impl::OnNotify(std::string_view header, void* data, size_t length, bool rndv) {
    Result<ucx::NotifyHeader> m = ucx::DecodeNotify(header);
    if (const char* why = Refusal(m.ok(), m.ok() ? m->to.token : 0, m.ok() ? m->to.proof : 0)) {
        FERRY_LOG(kWarn, "ucx: notification refused ({})", why);
        return;
    }
    if (rndv) {
        FERRY_LOG(kWarn, "ucx: notification from {} sent by rendezvous, dropped", m->sender);
        return;
    }
    host_->DeliverNotification(std::move(m->sender),
                               std::string(static_cast<const char*>(data), length));
}

ucs_status_t UcxBackend::Impl::ServeGrantRequest(const Incoming& in, std::string_view header) {
    Result<ucx::GrantRequest> m = ucx::DecodeGrantRequest(header);
    if (!m.ok() || in.length != 0) {
        return Refuse(in, InvalidArgumentError("malformed ucx grant request" +
                                               (m.ok() ? std::string(" (it carries data)")
                                                       : ": " + m.status().message())));
    }
    if (!rma_) {
        return Refuse(in, UnimplementedError("agent " + agent_ +
                                             " grants no one-sided ucx access (ucx_rma is off)"));
    }
    auto sv = NewServing(in);
    deferred_.push_back(
        [this, sv, region = m->region, key = m->key] { ServeGrant(sv, region, key); });
    return UCS_OK;
}

ucs_status_t UcxBackend::Impl::ServePullRequest(const Incoming& in, std::string_view header) {
    Result<ucx::PullRequest> m = ucx::DecodePullRequest(header);
    if (!m.ok()) {
        return Refuse(in,
                      InvalidArgumentError("malformed ucx pull request: " + m.status().message()));
    }
    auto sv = NewServing(in);
    std::vector<iovec> iov;
    uint64_t size = 0;
    Status s = host_->ResolveObject(m->key, &sv->pins, &iov, &size);
    if (!s.ok()) return Refuse(in, s);
    if (size > m->capacity) {
        sv->pins.clear();
        deferred_.push_back([this, sv, size] {
            Reply(sv->initiator, sv->request_id, sv->proof, Status::Ok(), size, {});
        });
        return UCS_OK;
    }
    for (const iovec& v : iov) sv->iov.push_back(ucp_dt_iov_t{v.iov_base, v.iov_len});
    deferred_.push_back([this, sv, size] {
        Reply(sv->initiator, sv->request_id, sv->proof, Status::Ok(), size, sv);
    });
    return UCS_OK;
}

ucs_status_t UcxBackend::Impl::ServeDataRequest(bool write, const Incoming& in,
                                                std::string_view header) {
    Result<ucx::DataRequest> m = ucx::DecodeDataRequest(header);
    if (!m.ok()) {
        return Refuse(in,
                      InvalidArgumentError("malformed ucx data request: " + m.status().message()));
    }
    auto sv = NewServing(in);
    std::vector<iovec> iov;
    Status s = host_->PinSegments(m->segments, write, &sv->pins, &iov, &sv->staging);
    if (!s.ok()) return Refuse(in, s);
    for (const iovec& v : iov) sv->iov.push_back(ucp_dt_iov_t{v.iov_base, v.iov_len});
    if (!write) {
        if (in.length != 0)
            return Refuse(in, InvalidArgumentError("ucx read request carries data"));
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
    const uint64_t total = m->TotalLength();
    if (in.length != total) {
        return Refuse(in, InvalidArgumentError("ucx write of " + std::to_string(in.length) +
                                               " bytes for segments of " + std::to_string(total)));
    }
    if (!(in.param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        ucx::ScatterEager(in.data, sv->iov);  // eager: the bytes are here already
        Release(in.data, in.param);
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
    ucx::Buffers b = ucx::AsBuffers(sv->iov);
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
        Status st =
            status == UCS_OK ? Status::Ok() : ucx::FromUcs(status, "ucx: receiving a write");
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
    ucs_status_ptr_t rr = ucx::AmRecv(worker_, in.data, b.buffer, b.count, &rp);
    if (UCS_PTR_IS_ERR(rr)) {
        delete holder;
        Status st = ucx::FromUcs(UCS_PTR_STATUS(rr), "ucx: receiving a write");
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
    uint64_t request_id = 0, proof = 0;
    if (!ucx::DecodeReplyHead(header, &request_id, &proof).ok()) {
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
    Result<ucx::Reply> reply = ucx::DecodeReply(header);
    if (!reply.ok()) {
        Release(data, param);
        Finish(p, DataLossError("peer " + p->ep->name +
                                " sent a malformed reply: " + reply.status().message()));
        return UCS_OK;
    }
    if (reply->code != Code::kOk) {
        Release(data, param);
        Finish(p, Status(reply->code, std::move(reply->message)));
        return UCS_OK;
    }
    const uint64_t value = reply->value;
    uint64_t expect = p->am == ucx::kAmRead ? p->bytes : (value <= p->bytes ? value : 0);
    if (length != expect) {
        Release(data, param);
        Finish(
            p,
            length == 0 && p->am == ucx::kAmPull
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
        ucx::ScatterEager(data, into);
        Release(data, param);
        Finish(p, Status::Ok(), value);
        return UCS_OK;
    }
    p->iov = std::move(into);
    p->value = value;
    ucp_request_param_t rp{};
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    ucx::Buffers b = ucx::AsBuffers(p->iov);
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
                         status == UCS_OK
                             ? Status::Ok()
                             : ucx::FromUcs(status, "ucx: receiving from " + pp->ep->name),
                         pp->value);
        }
        delete h;
        ucp_request_free(request);
    };
    ucs_status_ptr_t rr = ucx::AmRecv(worker_, data, b.buffer, b.count, &rp);
    if (UCS_PTR_IS_ERR(rr)) {
        delete holder;
        Finish(p, ucx::FromUcs(UCS_PTR_STATUS(rr), "ucx: receiving from " + p->ep->name), value);
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

}  // namespace ferry
