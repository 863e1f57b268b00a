// The target side of the stream backends: a peer's READ, WRITE and PULL frames and its requests
// to map one of our regions (one-sided shm), checked by the TargetService, answered on the
// stream. Inline data travels as frame payload; cross-memory (kCma) data is copied here into or
// out of the initiator's address space; file regions are staged through the file engine.
#pragma once

#include <atomic>
#include <string_view>

#include "transfer/connection.h"
#include "transfer/peer_memory.h"
#include "transfer/target_service.h"

namespace ferry::internal {

class StreamTarget {
  public:
    StreamTarget(TargetService& target, RegionTable& regions, PeerMemory& peer_memory,
                 FileEngineSlot& files, const std::atomic<bool>& shutting_down)
        : target_(target),
          regions_(regions),
          peer_memory_(peer_memory),
          files_(files),
          shutting_down_(shutting_down) {}

    // kWrite, kRead.
    void ServeData(Connection& conn, const wire::FrameHeader& h, std::string_view body);
    void ServePull(Connection& conn, const wire::FrameHeader& h, std::string_view body);
    // kMapRegion: grants the initiator a mapping of an agent-allocated (memfd) region.
    void ServeMapRegion(Connection& conn, const wire::FrameHeader& h, std::string_view body);

    static OutFrame ResponseFrame(uint64_t request_id, const Status& s, uint64_t value = 0);
    static void Respond(Connection& conn, uint64_t request_id, const Status& s, uint64_t value = 0);

  private:
    // An inline READ or WRITE that touches file regions: the file bytes go through `staging`
    // (read before the response is sent, written after the payload arrived).
    void ServeStaged(Connection& conn, uint64_t request_id, const wire::DataRequest& req,
                     bool write, std::vector<RegionPin> pins, std::vector<iovec> iov,
                     FileStaging staging);

    TargetService& target_;
    RegionTable& regions_;
    PeerMemory& peer_memory_;
    FileEngineSlot& files_;
    const std::atomic<bool>& shutting_down_;
};

}  // namespace ferry::internal
