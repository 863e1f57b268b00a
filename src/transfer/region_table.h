// Registered regions of one agent and the checks every remote access goes through.
//
// A RegionPin keeps a region's memory valid while a backend reads or writes it. Deregistration
// marks the region revoked (no new pins) and waits until the pins drop, so memory is never
// touched after Deregister returns.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ferry/agent.h"

namespace ferry {

struct RegionEntry {
    RegionId id = 0;
    uint8_t* base = nullptr;
    uint64_t length = 0;
    uint64_t key = 0;
    MemoryKind kind = MemoryKind::kHost;
    bool owned = false;  // mapped by the agent, unmapped when the last reference goes
    // Agent-allocated regions are memfd-backed: same-host peers may map them (shm backend).
    int memfd = -1;
    uint64_t inode = 0;
    uint64_t share_id = 0;
    // kFile: the agent's own descriptor of the file, and where the region starts in it.
    int file_fd = -1;
    uint64_t file_offset = 0;
    bool direct = false;
    bool read_only = false;
    std::string path;  // for messages ("fd N" when registered by descriptor)

    std::atomic<int64_t> pins{0};
    std::atomic<bool> revoked{false};
    std::mutex pin_mu;  // with unpinned: Deregister waits for pins to drop
    std::condition_variable unpinned;

    RegionEntry() = default;
    RegionEntry(const RegionEntry&) = delete;
    RegionEntry& operator=(const RegionEntry&) = delete;
    ~RegionEntry();

    RegionInfo Info() const { return RegionInfo{id, base, length, key, kind}; }
};

class RegionTable;

class RegionPin {
  public:
    RegionPin() = default;
    RegionPin(RegionPin&& o) noexcept : entry_(std::move(o.entry_)) {}
    RegionPin& operator=(RegionPin&& o) noexcept;
    RegionPin(const RegionPin&) = delete;
    RegionPin& operator=(const RegionPin&) = delete;
    ~RegionPin() { Release(); }

    const RegionEntry* entry() const { return entry_.get(); }
    bool revoked() const { return entry_ && entry_->revoked.load(); }
    void Release();

  private:
    friend class RegionTable;
    explicit RegionPin(std::shared_ptr<RegionEntry> e) : entry_(std::move(e)) {}
    std::shared_ptr<RegionEntry> entry_;
};

class RegionTable {
  public:
    Result<RegionInfo> Register(void* ptr, size_t length);
    Result<RegionInfo> Allocate(size_t length);
    // File regions (Agent::RegisterFile): `fd` < 0 opens `path`, else `fd` is duplicated.
    Result<RegionInfo> RegisterFile(const std::string& path, int fd, uint64_t offset,
                                    uint64_t length, const FileRegionOptions& options);

    // Marks the region revoked and waits until nothing pins it. After `grace`, calls
    // `on_stuck(id)` once (which must make the holders let go, e.g. by closing connections)
    // and waits again. NotFound for an unknown id.
    Status Deregister(RegionId id, std::chrono::milliseconds grace,
                      const std::function<void(RegionId)>& on_stuck);

    // Pins [offset, offset+length) of `id` for a peer holding `key`. NotFound: no such region;
    // PermissionDenied: wrong key; OutOfRange: outside the region.
    Result<RegionPin> PinRemote(RegionId id, uint64_t key, uint64_t offset, uint64_t length);
    // Pins a region of our own (no key check); bounds are checked by the caller's planner.
    Result<RegionPin> PinLocal(RegionId id);

    std::shared_ptr<RegionEntry> Find(RegionId id) const;
    // Every region; `revision` (if given) gets the table's revision, which grows with each
    // registration and deregistration, read under the same lock as the list.
    std::vector<RegionInfo> List(uint64_t* revision = nullptr) const;
    size_t size() const;

  private:
    Result<RegionPin> Pin(std::shared_ptr<RegionEntry> e);
    RegionInfo Add(std::shared_ptr<RegionEntry> e);

    mutable std::mutex mu_;
    std::unordered_map<RegionId, std::shared_ptr<RegionEntry>> regions_;
    RegionId next_id_ = 1;
    uint64_t revision_ = 0;
};

// Touches every page of [p, p+len) so that later transfers do not pay first-touch faults.
// Contents are unchanged.
void PrefaultMemory(void* p, size_t len);

}  // namespace ferry
