// shm: peers on the same host (same boot, network and pid namespace). Requests travel over a
// Unix socket in the abstract namespace; the target checks every descriptor and then copies the
// bytes itself with one cross-memory-attach call (process_vm_readv/writev) between its region
// and the initiator's buffer: one copy, no staging, and the target keeps control of its memory.
// The handshake proves the target may attach to the initiator before anything else happens.
#pragma once

#include "transfer/backend.h"

namespace ferry {

class ShmBackend final : public Backend {
  public:
    ShmBackend(const AgentConfig& config, std::string host_id);

    std::string_view name() const override { return "shm"; }
    BackendCapabilities capabilities() const override;
    wire::DataMode data_mode() const override { return wire::DataMode::kCma; }
    int streams() const override { return streams_; }
    Result<std::string> Listen(ScopedFd* listener) override;
    bool CanReach(const AgentMetadata& self, const AgentMetadata& peer) const override;
    Result<ScopedFd> Dial(std::string_view address, bool* in_progress) const override;
    bool verify_cma() const override { return true; }

  private:
    std::string host_id_;
    int streams_;
    bool one_sided_;  // AgentConfig::shm_map_peer_regions
};

}  // namespace ferry
