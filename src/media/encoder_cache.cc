#include "media/encoder_cache.h"

namespace ferry::media {

Embeddings EncoderCache::Find(const std::string& mm_hash) {
    std::lock_guard lock(mu_);
    auto it = map_.find(mm_hash);
    if (it == map_.end()) {
        ++stats_.misses;
        return nullptr;
    }
    ++stats_.hits;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    return it->second.value;
}

void EncoderCache::Insert(const std::string& mm_hash, Embeddings e) {
    if (!e) return;
    const uint64_t bytes = e->size() * sizeof(float);
    std::lock_guard lock(mu_);
    if (bytes > capacity_ || map_.count(mm_hash)) return;
    while (stats_.bytes + bytes > capacity_ && !lru_.empty()) {
        auto victim = map_.find(lru_.back());
        stats_.bytes -= victim->second.bytes;
        map_.erase(victim);
        lru_.pop_back();
        ++stats_.evictions;
    }
    lru_.push_front(mm_hash);
    map_.emplace(mm_hash, Entry{std::move(e), bytes, lru_.begin()});
    stats_.bytes += bytes;
    ++stats_.inserts;
}

EncoderCacheStats EncoderCache::Stats() const {
    std::lock_guard lock(mu_);
    EncoderCacheStats s = stats_;
    s.entries = map_.size();
    s.capacity_bytes = capacity_;
    return s;
}

}  // namespace ferry::media
