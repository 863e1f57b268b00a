// One-sided ucx access: grants of a peer's regions (asked once per region, kept until revoked),
// RMA puts and gets under them, our grants to peers and their revocation on Deregister.
#include "transfer/backends/ucx/ucx_impl.h"

namespace ferry {

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
                        pp->status =
                            ucx::FromUcs(status, "ucx: flushing writes to " + pp->ep->name);
                    }
                    pp->ep->impl->MaybeComplete(pp);
                }
            }
            delete w;
            ucp_request_free(request);
        };
        for (auto& p : batch) ++p->rma_inflight;
        ucs_status_ptr_t r = ucx::ThroughUcx([&] { return ucp_ep_flush_nbx(ep->ep, &fp); });
        if (!UCS_PTR_IS_PTR(r)) {
            delete waiting;
            for (auto& p : batch) {
                --p->rma_inflight;
                if (UCS_PTR_IS_ERR(r) && p->status.ok()) {
                    p->status =
                        ucx::FromUcs(UCS_PTR_STATUS(r), "ucx: flushing writes to " + ep->name);
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
                pp->status = ucx::FromUcs(
                    status,
                    std::string(pp->rma_get ? "ucx: reading from peer " : "ucx: writing to peer ") +
                        pp->ep->name);
            }
            self->MaybeComplete(pp);
        }
        delete h;
        ucp_request_free(request);
    };
    ucs_status_ptr_t r = ucx::ThroughUcx([&] {
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
        p->status = ucx::FromUcs(
            UCS_PTR_STATUS(r),
            std::string(write ? "ucx: writing to peer " : "ucx: reading from peer ") + p->ep->name);
    }
}

void UcxBackend::Impl::RequestGrant(const std::shared_ptr<Ep>& ep, RegionId region, uint64_t key,
                                    std::function<void(const Status&)> then) {
    auto p = std::make_shared<Pending>();
    p->id = next_request_++;
    p->ep = ep;
    p->am = ucx::kAmGrant;
    p->header =
        ucx::Encode(ucx::GrantRequest{{{ep->token, ep->proof}, token_, p->id}, region, key});
    p->buffer.resize(ucx::kGrantAnswerFixed + ucx::kMaxPackedRkey);
    p->iov.push_back(ucp_dt_iov_t{p->buffer.data(), p->buffer.size()});
    p->bytes = p->buffer.size();
    p->done = [region, key, then = std::move(then)](Pending& q) {
        Status s = q.status;
        std::shared_ptr<Ep> ep = q.ep;
        ucx::GrantAnswer answer;
        if (s.ok()) {
            Result<ucx::GrantAnswer> a =
                q.value > q.buffer.size()
                    ? Result<ucx::GrantAnswer>(InvalidArgumentError(
                          "its size " + std::to_string(q.value) + " exceeds the buffer"))
                    : ucx::DecodeGrantAnswer(std::string_view(q.buffer.data(), q.value));
            if (a.ok()) {
                answer = std::move(*a);
            } else {
                s = DataLossError("peer " + ep->name + " sent a malformed grant of region " +
                                  std::to_string(region) + ": " + a.status().message());
            }
        }
        const uint64_t address = answer.address;
        const uint64_t length = answer.length;
        if (s.ok() && (ep->ep == nullptr || ep->failed)) {
            s = UnavailableError("peer " + ep->name + ": endpoint closed");
        }
        ucp_rkey_h rkey = nullptr;
        if (s.ok()) {
            ucs_status_t st = ucp_ep_rkey_unpack(ep->ep, answer.rkey.data(), &rkey);
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
    Send(p, ucx::kAmGrant, false);
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
        if (st == UCS_OK && size > ucx::kMaxPackedRkey) {
            ucp_rkey_buffer_release(packed);
            st = UCS_ERR_EXCEEDS_LIMIT;
        }
        if (st != UCS_OK) {
            if (g.memh != nullptr) ucp_mem_unmap(context_, g.memh);
            granted_.erase(region);
            refuse(ucx::FromUcs(st, "ucx: mapping region " + std::to_string(region)));
            return;
        }
        g.packed.assign(static_cast<const char*>(packed), size);
        ucp_rkey_buffer_release(packed);
        g.address = reinterpret_cast<uint64_t>(base);
        g.length = length;
    }
    g.grantees.insert(sv->initiator);
    sv->blob = ucx::Encode(ucx::GrantAnswer{g.address, g.length, g.packed});
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
    messages_sent_.fetch_add(1, std::memory_order_relaxed);
    ucs_status_ptr_t r = ucx::AmSend(handle, am, h->data(), h->size(), data, length, &hp);
    if (UCS_PTR_IS_PTR(r)) return UCS_OK;
    delete h;
    return UCS_PTR_STATUS(r);
}

void UcxBackend::Impl::SendRevokeAck(const std::shared_ptr<Ep>& ep, uint64_t revocation) {
    if (ep->ep == nullptr || ep->failed) return;  // the target sees the endpoint go instead
    (void)SendControl(ep->ep, ucx::kAmRevokeAck,
                      ucx::Encode(ucx::Revoke{{ep->token, ep->proof}, token_, revocation, 0},
                                  /*ack=*/true));
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
        const std::string header =
            ucx::Encode(ucx::Revoke{{t, ProofFor(t)}, token_, rid, id}, /*ack=*/false);
        if (SendControl(r->second->ep, ucx::kAmRevoke, header) == UCS_OK) rv.waiting.insert(t);
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

}  // namespace ferry
