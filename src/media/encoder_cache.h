// The encoder cache: image embeddings by mm_hash, least recently used first out under a byte
// capacity (vLLM's encoder cache, kept across requests: a repeated image is not encoded again).
// Entries are immutable and shared: an evicted entry stays valid for whoever still holds it.
//
// With a disk tier (Open with a directory), entries evicted from memory are written to files
// there, one per mm_hash (DIR/<mm_hash>.safetensors, media/embeddings_file.h: their shape, the
// mm_hash, the vision encoder's fingerprint and an XXH3-64 of the data in the header), under a
// byte capacity of their own with the least recently used file removed first; a memory miss reads
// the file back (checked: a file that fails any check is removed and is a miss) and keeps the
// entry in memory again. The files outlive the process: a worker restarted on the same directory
// with the same vision encoder finds them; those of another encoder are stale and removed when
// met. One worker a directory (a lock file; a second worker's Open fails).
//
// Thread-safe. Files are read and written by the calling thread outside the cache's lock.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ferry/status.h"

namespace ferry::media {

using Embeddings = std::shared_ptr<const std::vector<float>>;

struct EncoderCacheStats {
    uint64_t hits = 0;    // found in memory
    uint64_t misses = 0;  // found in neither tier
    uint64_t evictions = 0;
    uint64_t inserts = 0;
    uint64_t entries = 0;
    uint64_t bytes = 0;  // of the entries held now
    uint64_t capacity_bytes = 0;
    // The disk tier (all zero without one).
    uint64_t disk_hits = 0;         // found on disk (then kept in memory again)
    uint64_t disk_read_micros = 0;  // reading those hits' files back
    uint64_t disk_writes = 0;       // files written for entries evicted from memory
    uint64_t disk_evictions = 0;    // files removed for the capacity
    uint64_t disk_write_errors = 0;
    uint64_t disk_bad_files = 0;  // failed a check (torn, corrupt, another encoder's): removed
    uint64_t disk_entries = 0;
    uint64_t disk_bytes = 0;  // of the files held now
    uint64_t disk_capacity_bytes = 0;
};

struct EncoderCacheDisk {
    std::string dir;  // created (0700) if missing
    uint64_t capacity_bytes = 0;
    // The vision encoder's fingerprint (model::VisionEncoder::fingerprint): files another encoder
    // wrote are not its embeddings.
    std::string encoder;
    size_t entry_floats = 0;  // an entry's floats: tokens per image x width
    size_t width = 0;
};

class EncoderCache {
  public:
    // Memory only; capacity 0: nothing is kept.
    explicit EncoderCache(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}
    // With the disk tier in `disk.dir` (memory capacity 0: every entry goes to disk). Fails
    // naming the directory when it cannot be made or used, or another process holds it.
    static Result<std::unique_ptr<EncoderCache>> Open(uint64_t capacity_bytes,
                                                      EncoderCacheDisk disk);
    ~EncoderCache();
    EncoderCache(const EncoderCache&) = delete;
    EncoderCache& operator=(const EncoderCache&) = delete;

    // The entry for `mm_hash`, made most recently used; null (a miss) if in neither tier.
    Embeddings Find(const std::string& mm_hash);
    // Keeps `e` under `mm_hash` (replacing nothing: an entry already there stays), evicting the
    // least recently used entries (to disk, with a disk tier) until it fits; an entry larger than
    // the capacity is not kept in memory.
    void Insert(const std::string& mm_hash, Embeddings e);
    EncoderCacheStats Stats() const;

  private:
    struct Entry {
        Embeddings value;
        uint64_t bytes;
        std::list<std::string>::iterator lru;
    };
    struct File {
        uint64_t bytes;
        std::list<std::string>::iterator lru;
    };
    using Spills = std::vector<std::pair<std::string, Embeddings>>;

    bool HasDisk() const { return !disk_.dir.empty(); }
    std::string PathOf(const std::string& mm_hash) const;
    // Under mu_: keeps `e`, moving what it evicts to `spill` (with a disk tier); false if it is
    // kept nowhere.
    bool InsertLocked(const std::string& mm_hash, Embeddings e, Spills* spill);
    // Without mu_: writes each evicted entry's file (unless one is there).
    void Spill(Spills spill);
    // Under mu_: forgets a file (and removes it when `unlink`).
    void DropFileLocked(std::string mm_hash, bool unlink);

    const uint64_t capacity_;
    EncoderCacheDisk disk_;
    int lock_fd_ = -1;
    mutable std::mutex mu_;
    std::list<std::string> lru_;  // front: most recently used
    std::unordered_map<std::string, Entry> map_;
    // Evicted from memory, their files being written: still found.
    std::unordered_map<std::string, Embeddings> spilling_;
    std::list<std::string> disk_lru_;  // front: most recently used
    std::unordered_map<std::string, File> files_;
    EncoderCacheStats stats_;
};

}  // namespace ferry::media
