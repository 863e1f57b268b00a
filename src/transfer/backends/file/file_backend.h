// file: the backend between an agent's own regions (Locality::kSelf). A transfer whose peer is the
// agent itself moves bytes between its memory and its file regions (pread/pwrite or io_uring,
// through the agent's file engine, file_engine.h) or between two of its memory regions (a copy
// on the engine's thread). Every check happens in PlanSelf, before anything moves: regions and
// bounds, equal lengths, no file-to-file copy, no write into a read-only file region, O_DIRECT
// alignment of file offset, length and memory. docs/transfer-engine.md, "File regions".
#pragma once

#include "transfer/backend.h"

namespace ferry {

class FileBackend final : public Backend {
  public:
    std::string_view name() const override { return "file"; }
    BackendCapabilities capabilities() const override;
    // No endpoint: nothing to publish, nobody to accept.
    Result<std::string> Listen(ScopedFd* listener) override;
    // No peer: only the agent itself, which never is one.
    bool CanReach(const AgentMetadata& self, const AgentMetadata& peer) const override;
    Status Start(TargetServices* services) override;

    Result<std::unique_ptr<SelfTransfer>> PlanSelf(bool write, std::span<const Descriptor> local,
                                                   std::span<const Descriptor> remote) override;
    void StartSelf(const std::shared_ptr<internal::TransferOp>& op,
                   std::unique_ptr<SelfTransfer> plan) override;

  private:
    TargetServices* services_ = nullptr;
};

}  // namespace ferry
