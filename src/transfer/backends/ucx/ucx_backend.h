// ucx: any host, through UCX (UCP) from Debian's libucx. One worker per agent, driven by one
// progress thread that sleeps on the worker's event fd when idle. Peers are reached through
// endpoints created from the worker address published in the agent metadata, with peer error
// handling, so a dead or lying peer fails its transfers instead of hanging them.
//
// Data moves by active messages: a WRITE is one message per chunk whose header lists the
// target segments (region, key, offset, length); the target checks every key and bound, then
// lets UCX's rendezvous protocol land the payload straight in its region (zero-copy receive).
// A READ is a request the target checks and answers with the bytes. With one-sided access
// (AgentConfig::ucx_rma) an initiator instead asks the target once per region for a grant (key
// checked, the region mapped with ucp_mem_map, its packed rkey returned) and then moves the bytes
// with ucp_put_nbx / ucp_get_nbx, bounds checked against the grant; Deregister revokes every grant
// and returns once each grantee acknowledged. Notifications and
// pull-by-key are active messages too. Every message carries the receiver's endpoint token
// (random, published in the metadata next to the worker address) and, with a deployment secret,
// an HMAC of it, so a message meant for an earlier process, or forged by someone holding only
// the metadata, is refused. docs/transfer-engine.md, "ucx".
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "transfer/backend.h"
#include "transfer/backends/file/file_engine.h"
#include "transfer/planner.h"
#include "transfer/region_table.h"
#include "transfer/transfer_op.h"

namespace ferry {

class UcxBackend final : public Backend {
  public:
    explicit UcxBackend(const AgentConfig& config);
    ~UcxBackend() override;

    std::string_view name() const override { return "ucx"; }
    BackendCapabilities capabilities() const override;
    // Creates the UCX context and worker; `listener` stays empty (UCX listens itself). Returns
    // "<hex worker address>.<hex token>".
    Result<std::string> Listen(ScopedFd* listener) override;
    bool CanReach(const AgentMetadata& self, const AgentMetadata& peer) const override;

    // Starts the progress thread: from now on peers' messages are served.
    Status Start(TargetServices* services) override;
    // Fails everything in flight (Cancelled), closes every endpoint, stops the thread.
    void Stop() override;

    uint64_t chunk_bytes() const override { return 4u << 20; }
    // Segments per message (bounded by UCX's largest active-message header).
    uint32_t max_segments() const override { return max_segments_; }

    // Sends `chunks` of `op` (armed with chunks.size()) to `peer`. With AgentConfig::ucx_rma and
    // `all_host`, the bytes move with ucp_put_nbx / ucp_get_nbx under grants of the peer's
    // regions, or by active messages if the peer grants none (its ucx_rma is off).
    void Post(const std::shared_ptr<internal::TransferOp>& op, const PeerRef& peer, bool write,
              std::vector<Chunk> chunks, bool all_host) override;
    // Deregister of region `id` (with ucx_rma): refuses new grants of it, asks every grantee to
    // let go and returns once each acknowledged (its one-sided requests to the region are
    // complete at this end) or, after `grace`, was disconnected; then unmaps the region.
    void RevokeRegion(RegionId id, std::chrono::milliseconds grace) override;
    void RegionGone(RegionId id) override;
    // Transfers moved one-sided (ucp_put_nbx / ucp_get_nbx) so far.
    uint64_t one_sided_transfers() const override;
    uint64_t messages_sent() const override;
    uint64_t messages_received() const override;
    Status Notify(const PeerRef& peer, std::string payload, std::string sender) override;
    void Pull(const std::shared_ptr<internal::TransferOp>& op, const PeerRef& peer, std::string key,
              std::vector<iovec> local, uint64_t capacity) override;
    // Closes the endpoint to `peer` (of `epoch`, 0 = any), failing its transfers with `why`.
    void PeerLost(const std::string& peer, uint64_t epoch, const Status& why) override;
    // Returns once UCX touches no local memory of `op` any more (closing the endpoints that
    // carry it if needed).
    void CutOff(uint64_t op_id, const Status& why) override;

    class Impl;

  private:
    const AgentConfig config_;
    uint32_t max_segments_ = 64;
    std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
