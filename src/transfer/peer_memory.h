// Same-host peers' memory, for the stream backends whose payload bytes are copied across address
// spaces (wire::DataMode::kCma, the shm backend): the regions of peer processes mapped here (an
// agent-allocated region is a memfd the peer may open through /proc once the handshake proved
// ptrace access), the copies through those mappings or by cross-memory attach
// (process_vm_readv/writev), and the record of which streams were granted a mapping of which of
// our regions (revoked on Deregister).
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "ferry/status.h"
#include "transfer/region_table.h"
#include "transfer/wire.h"

namespace ferry::internal {

class Connection;

// One peer region mapped into this process; unmapped when the last reference goes.
struct PeerMapping {
    uint8_t* base = nullptr;
    uint64_t length = 0;
    PeerMapping() = default;
    PeerMapping(const PeerMapping&) = delete;
    PeerMapping& operator=(const PeerMapping&) = delete;
    ~PeerMapping();
};

// Copies between our iovecs and process `pid`'s with as few process_vm calls as possible.
// `to_peer`: ours -> theirs (process_vm_writev); otherwise theirs -> ours. The two lists cover
// the same number of bytes.
Status CmaCopy(pid_t pid, const std::vector<iovec>& ours, const std::vector<iovec>& theirs,
               bool to_peer);

// How a peer finds an agent-allocated (memfd) region of ours to map it.
wire::SharedRegion ShareOf(const RegionEntry& e);
// The shareable (memfd) ones among `regions`, at most kMaxSharesPerFrame.
std::vector<wire::SharedRegion> SharesFor(const RegionTable& table,
                                          const std::vector<RegionId>& regions);

class PeerMemory {
  public:
    // Maps region `share` of process `pid` (once; later calls share the mapping). Null when the
    // process's fd is not what it claims (another inode, too short) or cannot be mapped.
    std::shared_ptr<PeerMapping> Map(pid_t pid, const wire::SharedRegion& share);
    // Copies between `ours` and the peer's `theirs`: through our mappings of the peer's regions
    // when every buffer of `theirs` lies in one of `shares`, else by cross-memory attach.
    Status Copy(pid_t pid, const std::vector<iovec>& ours, const std::vector<iovec>& theirs,
                const std::vector<wire::SharedRegion>& shares, bool to_peer);
    // The peer dropped region `share_id` (it is unmapped here once no copy holds it).
    void Forget(pid_t pid, uint64_t share_id);
    // The peer process is gone or idle: everything mapped of it goes.
    void ForgetProcess(pid_t pid);

    // Stream `conn` was granted a mapping of our region `share_id`.
    void RecordGrant(uint64_t share_id, const std::shared_ptr<Connection>& conn);
    // The streams granted `share_id` that are still open; the record goes.
    std::vector<std::shared_ptr<Connection>> TakeGrants(uint64_t share_id);

  private:
    std::mutex mu_;
    std::map<std::pair<pid_t, uint64_t>, std::shared_ptr<PeerMapping>> maps_;
    std::map<uint64_t, std::vector<std::weak_ptr<Connection>>> grants_;
};

}  // namespace ferry::internal
