// The target side, backend-neutral: every check a peer's request passes before it touches this
// agent's memory (segments pinned against region, key and bounds; file regions staged; named
// objects resolved; one-sided grants; notifications queued). The stream machinery (StreamTarget)
// and every backend with its own data path (through TargetServices) serve peers with it.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "ferry/agent.h"
#include "transfer/backend.h"
#include "transfer/backends/file/file_engine.h"
#include "transfer/notification_queue.h"
#include "transfer/object_directory.h"
#include "transfer/region_table.h"

namespace ferry::internal {

// The agent's file engine, made with the first file region (or the first local transfer).
class FileEngineSlot {
  public:
    explicit FileEngineSlot(FileEngine::Options options) : options_(options) {}
    // Null before Ensure made it.
    FileEngine* Get() const;
    Result<FileEngine*> Ensure(const std::string& agent);
    // Destroys the engine (waiting for its I/O), before what its callbacks reach goes.
    void Reset();

  private:
    const FileEngine::Options options_;
    mutable std::mutex mu_;
    std::unique_ptr<FileEngine> engine_;
};

class TargetService final : public TargetServices {
  public:
    TargetService(std::string agent, RegionTable& regions, ObjectDirectory& objects,
                  NotificationQueue& notes, FileEngineSlot& files)
        : agent_(std::move(agent)),
          regions_(regions),
          objects_(objects),
          notes_(notes),
          files_(files) {}

    Status PinSegments(const std::vector<wire::Segment>& segs, bool write,
                       std::vector<RegionPin>* pins, std::vector<iovec>* iov,
                       FileStaging* staging) override;
    Status MoveStaged(FileStaging& staging, bool to_file) override;
    Status ResolveObject(std::string_view key, std::vector<RegionPin>* pins,
                         std::vector<iovec>* iov, uint64_t* size) override;
    void DeliverNotification(std::string peer, std::string payload) override;
    Status GrantRegion(RegionId id, uint64_t key, void** base, uint64_t* length) override;
    std::shared_ptr<RegionEntry> OwnRegion(RegionId id) override { return regions_.Find(id); }
    Result<RegionPin> PinOwnRegion(RegionId id) override { return regions_.PinLocal(id); }
    Result<FileEngine*> Files() override;

  private:
    const std::string agent_;
    RegionTable& regions_;
    ObjectDirectory& objects_;
    NotificationQueue& notes_;
    FileEngineSlot& files_;
};

}  // namespace ferry::internal
