#include "ferry/agent.h"

#include "transfer/agent_core.h"
#include "transfer/transfer_op.h"

namespace ferry {

using internal::AgentCore;
using internal::TransferOp;

std::vector<std::string> AvailableBackends() { return KnownBackends(); }

// --- Transfer -------------------------------------------------------------------------------

Transfer::Transfer(std::shared_ptr<TransferOp> op) : op_(std::move(op)) {}
Transfer::Transfer(Transfer&&) noexcept = default;
Transfer& Transfer::operator=(Transfer&& o) noexcept {
    if (this != &o) {
        if (op_ && !op_->finished()) {
            op_->Fail(CancelledError("transfer handle overwritten"));
        }
        op_ = std::move(o.op_);
    }
    return *this;
}

Transfer::~Transfer() {
    if (op_ && !op_->finished()) {
        op_->Fail(CancelledError("transfer handle destroyed while pending"));
    }
}

Result<TransferState> Transfer::Poll() const {
    if (!op_) return FailedPreconditionError("empty transfer handle");
    return op_->Poll();
}

Status Transfer::Wait(Clock::time_point deadline) const {
    if (!op_) return FailedPreconditionError("empty transfer handle");
    return op_->Wait(deadline);
}

Status Transfer::Cancel() {
    if (!op_) return FailedPreconditionError("empty transfer handle");
    op_->Fail(CancelledError("transfer " + std::to_string(op_->id()) + " cancelled"));
    return Status::Ok();
}

void Transfer::OnDone(std::function<void()> f) {
    if (op_ && f) op_->SetOnReported(std::move(f));
}

uint64_t Transfer::bytes() const { return op_ ? op_->bytes() : 0; }

// --- Agent ----------------------------------------------------------------------------------

Agent::Agent(std::shared_ptr<AgentCore> core) : core_(std::move(core)) {}

Result<std::unique_ptr<Agent>> Agent::Create(AgentConfig config) {
    FERRY_ASSIGN_OR_RETURN(auto core, AgentCore::Create(std::move(config)));
    return std::unique_ptr<Agent>(new Agent(std::move(core)));
}

Agent::~Agent() { core_->Shutdown(); }

const std::string& Agent::name() const { return core_->name(); }
uint64_t Agent::epoch() const { return core_->epoch(); }
std::string Agent::ListenAddress() const { return core_->ListenAddress(); }

Result<RegionInfo> Agent::RegisterMemory(void* ptr, size_t length) {
    return core_->RegisterMemory(ptr, length);
}
Result<RegionInfo> Agent::AllocateRegion(size_t length) { return core_->AllocateRegion(length); }
Result<RegionInfo> Agent::RegisterFile(const std::string& path, uint64_t offset, uint64_t length,
                                       FileRegionOptions options) {
    return core_->RegisterFile(path, -1, offset, length, options);
}
Result<RegionInfo> Agent::RegisterFileDescriptor(int fd, uint64_t offset, uint64_t length,
                                                 FileRegionOptions options) {
    if (fd < 0) {
        return InvalidArgumentError("RegisterFileDescriptor: negative descriptor " +
                                    std::to_string(fd));
    }
    return core_->RegisterFile("", fd, offset, length, options);
}
Status Agent::Deregister(RegionId id) { return core_->Deregister(id); }
std::vector<RegionInfo> Agent::Regions() const { return core_->Regions(); }

std::string Agent::Metadata() const { return core_->Metadata(); }
Result<std::string> Agent::AddPeer(std::string_view metadata) { return core_->AddPeer(metadata); }
Result<std::string> Agent::Connect(std::string_view host_port, std::chrono::milliseconds timeout) {
    return core_->Connect(host_port, timeout);
}
Status Agent::RemovePeer(std::string_view name) { return core_->RemovePeer(name); }
Result<std::string> Agent::ConnectByName(std::string_view name) {
    return core_->ConnectByName(name);
}
Result<std::string> Agent::PeerBackend(std::string_view name) const {
    return core_->PeerBackend(name);
}
AgentStats Agent::Stats() const { return core_->Stats(); }

Result<Transfer> Agent::PostRead(std::span<const Descriptor> local, std::string_view peer,
                                 std::span<const Descriptor> remote, TransferOptions options) {
    return core_->Post(TransferOp::Kind::kRead, local, peer, remote, options);
}
Result<Transfer> Agent::PostWrite(std::span<const Descriptor> local, std::string_view peer,
                                  std::span<const Descriptor> remote, TransferOptions options) {
    return core_->Post(TransferOp::Kind::kWrite, local, peer, remote, options);
}

Status Agent::Notify(std::string_view peer, std::string_view payload) {
    return core_->Notify(peer, payload);
}
std::vector<Notification> Agent::TakeNotifications() { return core_->TakeNotifications(); }
std::vector<Notification> Agent::WaitNotifications(Clock::time_point deadline) {
    return core_->WaitNotifications(deadline);
}

Status Agent::Publish(std::string key, std::vector<Descriptor> descriptors) {
    return core_->Publish(std::move(key), std::move(descriptors));
}
Status Agent::Unpublish(std::string_view key) { return core_->Unpublish(key); }
Result<PullResult> Agent::PullByKey(std::string_view peer, std::string_view key,
                                    const Descriptor& local, std::chrono::milliseconds timeout) {
    return core_->PullByKey(peer, key, local, timeout);
}

}  // namespace ferry
