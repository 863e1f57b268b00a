// The encoder cache: image embeddings by mm_hash, least recently used first out under a byte
// capacity (vLLM's encoder cache, kept across requests: a repeated image is not encoded again).
// Entries are immutable and shared: an evicted entry stays valid for whoever still holds it.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace ferry::media {

using Embeddings = std::shared_ptr<const std::vector<float>>;

struct EncoderCacheStats {
    uint64_t hits = 0;
    uint64_t misses = 0;
    uint64_t evictions = 0;
    uint64_t inserts = 0;
    uint64_t entries = 0;
    uint64_t bytes = 0;  // of the entries held now
    uint64_t capacity_bytes = 0;
};

class EncoderCache {
  public:
    // capacity 0: nothing is kept.
    explicit EncoderCache(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}

    // The entry for `mm_hash`, made most recently used; null (a miss) if absent.
    Embeddings Find(const std::string& mm_hash);
    // Keeps `e` under `mm_hash` (replacing nothing: an entry already there stays), evicting the
    // least recently used entries until it fits; an entry larger than the capacity is not kept.
    void Insert(const std::string& mm_hash, Embeddings e);
    EncoderCacheStats Stats() const;

  private:
    struct Entry {
        Embeddings value;
        uint64_t bytes;
        std::list<std::string>::iterator lru;
    };
    const uint64_t capacity_;
    mutable std::mutex mu_;
    std::list<std::string> lru_;  // front: most recently used
    std::unordered_map<std::string, Entry> map_;
    EncoderCacheStats stats_;
};

}  // namespace ferry::media
