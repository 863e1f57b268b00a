// UcxBackend: the Backend facade of the ucx backend; every call goes to the progress thread
// (ucx_impl.h says which file holds which job).
#include "transfer/backends/ucx/ucx_backend.h"

#include "transfer/backends/ucx/ucx_impl.h"

namespace ferry {

UcxBackend::UcxBackend(const AgentConfig& config)
    : config_(config), impl_(std::make_unique<Impl>(config.name, config.secret, config.ucx_rma)) {}

UcxBackend::~UcxBackend() = default;

Result<std::string> UcxBackend::Listen(ScopedFd* listener) {
    (void)listener;
    FERRY_ASSIGN_OR_RETURN(std::string address, impl_->Init());
    size_t hdr = impl_->max_header();
    if (hdr > ucx::kRequestHeaderFixed + 1 + ucx::kSegmentBytes) {
        max_segments_ = static_cast<uint32_t>(std::min<size_t>(
            (hdr - ucx::kRequestHeaderFixed - 1) / ucx::kSegmentBytes, wire::kMaxSegmentsPerFrame));
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

void UcxBackend::Post(const std::shared_ptr<internal::TransferOp>& op, const PeerRef& peer,
                      bool write, std::vector<Chunk> chunks, bool all_host) {
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

void UcxBackend::Pull(const std::shared_ptr<internal::TransferOp>& op, const PeerRef& peer,
                      std::string key, std::vector<iovec> local, uint64_t capacity) {
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
uint64_t UcxBackend::messages_sent() const { return impl_->messages_sent(); }
uint64_t UcxBackend::messages_received() const { return impl_->messages_received(); }

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
