#include "media/encoder_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/core.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <tuple>

#include "core/clock.h"
#include "core/log.h"
#include "media/embeddings_file.h"

namespace ferry::media {

namespace {

constexpr std::string_view kSuffix = ".safetensors";

}  // namespace

Result<std::unique_ptr<EncoderCache>> EncoderCache::Open(uint64_t capacity_bytes,
                                                         EncoderCacheDisk disk) {
    auto c = std::make_unique<EncoderCache>(capacity_bytes);
    if (disk.dir.empty()) return c;
    auto fail = [&](std::string_view what, int err) {
        return InvalidArgumentError(fmt::format("--encoder-cache-dir {}: {}{}{}", disk.dir, what,
                                                err ? ": " : "", err ? std::strerror(err) : ""));
    };
    if (disk.entry_floats == 0 || disk.width == 0 || disk.entry_floats % disk.width != 0) {
        return fail("no entry shape (needs the vision encoder)", 0);
    }
    while (disk.dir.size() > 1 && disk.dir.back() == '/') disk.dir.pop_back();
    if (mkdir(disk.dir.c_str(), 0700) != 0 && errno != EEXIST) return fail("mkdir", errno);
    struct stat st {};
    if (stat(disk.dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        return fail("not a directory", 0);
    }
    // What is read back is used as embeddings: only this worker's user may write there (the
    // checksum finds damage, not a planted file).
    if (st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
        return fail("other users may write there (it must be this user's, mode go-w)", 0);
    }
    const std::string lock = disk.dir + "/.lock";
    c->lock_fd_ = open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (c->lock_fd_ < 0) return fail("open .lock", errno);
    if (flock(c->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK) {
            return fail("another process uses it (one worker a directory)", 0);
        }
        return fail("lock", errno);
    }
    // What an earlier run left: its files, oldest first out; temporary files of a write it did
    // not finish go.
    DIR* d = opendir(disk.dir.c_str());
    if (!d) return fail("opendir", errno);
    std::vector<std::tuple<int64_t, std::string, uint64_t>> found;  // mtime, mm_hash, bytes
    while (dirent* e = readdir(d)) {
        const std::string name = e->d_name;
        const std::string path = disk.dir + "/" + name;
        if (name.rfind(".tmp-", 0) == 0) {
            unlink(path.c_str());
            continue;
        }
        if (name.size() != 64 + kSuffix.size() || !name.ends_with(kSuffix) ||
            !IsMmHash(std::string_view(name).substr(0, 64))) {
            continue;  // not ours
        }
        struct stat fs {};
        if (lstat(path.c_str(), &fs) != 0 || !S_ISREG(fs.st_mode)) continue;
        found.emplace_back(int64_t(fs.st_mtim.tv_sec) * 1000000000 + fs.st_mtim.tv_nsec,
                           name.substr(0, 64), uint64_t(fs.st_size));
    }
    closedir(d);
    std::sort(found.begin(), found.end());
    c->disk_ = std::move(disk);
    for (auto& [mtime, hash, bytes] : found) {  // newest ends at the front
        c->disk_lru_.push_front(hash);
        c->files_.emplace(hash, File{bytes, c->disk_lru_.begin()});
        c->stats_.disk_bytes += bytes;
    }
    std::lock_guard lk(c->mu_);
    while (c->stats_.disk_bytes > c->disk_.capacity_bytes && !c->disk_lru_.empty()) {
        ++c->stats_.disk_evictions;
        c->DropFileLocked(c->disk_lru_.back(), true);
    }
    if (!c->files_.empty()) {
        FERRY_LOG(kInfo, "encoder cache: {} files ({} bytes) in {}", c->files_.size(),
                  c->stats_.disk_bytes, c->disk_.dir);
    }
    return c;
}

EncoderCache::~EncoderCache() {
    if (lock_fd_ >= 0) close(lock_fd_);
}

std::string EncoderCache::PathOf(const std::string& mm_hash) const {
    return fmt::format("{}/{}{}", disk_.dir, mm_hash, kSuffix);
}

void EncoderCache::DropFileLocked(std::string mm_hash, bool remove) {
    auto it = files_.find(mm_hash);
    if (it == files_.end()) return;
    if (remove) unlink(PathOf(mm_hash).c_str());
    stats_.disk_bytes -= it->second.bytes;
    disk_lru_.erase(it->second.lru);
    files_.erase(it);
}

Embeddings EncoderCache::Find(const std::string& mm_hash) {
    {
        std::lock_guard lock(mu_);
        auto it = map_.find(mm_hash);
        if (it != map_.end()) {
            ++stats_.hits;
            lru_.splice(lru_.begin(), lru_, it->second.lru);
            return it->second.value;
        }
        if (auto s = spilling_.find(mm_hash); s != spilling_.end()) {
            ++stats_.hits;  // still in memory, its file being written
            return s->second;
        }
        if (!HasDisk() || !files_.count(mm_hash)) {
            ++stats_.misses;
            return nullptr;
        }
    }
    FileMetadata meta;
    const auto t0 = std::chrono::steady_clock::now();
    Result<Embeddings> r =
        ReadEmbeddingsFile(PathOf(mm_hash), disk_.entry_floats, disk_.width, &meta);
    Status checked = r.status();
    if (r.ok()) {
        if (meta.count("xxh3") == 0) {
            checked = DataLossError(PathOf(mm_hash) + ": it carries no checksum");
        } else if (meta["mm_hash"] != mm_hash) {
            checked = DataLossError(PathOf(mm_hash) + ": it holds another image's embeddings");
        } else if (meta["encoder"] != disk_.encoder) {
            checked = DataLossError(PathOf(mm_hash) + ": another vision encoder wrote it");
        }
    }
    Spills spill;
    {
        std::lock_guard lock(mu_);
        if (!checked.ok()) {
            ++stats_.misses;
            if (checked.code() == Code::kNotFound) {
                DropFileLocked(mm_hash, false);  // removed under us (its capacity)
            } else if (checked.code() == Code::kUnavailable) {
                FERRY_LOG(kWarn, "encoder cache: {}", checked.message());  // kept: not its fault
            } else if (files_.count(mm_hash)) {
                ++stats_.disk_bad_files;
                FERRY_LOG(kWarn, "encoder cache: removed a bad file: {}", checked.message());
                DropFileLocked(mm_hash, true);
            }
            return nullptr;
        }
        ++stats_.disk_hits;
        stats_.disk_read_micros += MicrosSince(t0);
        if (auto f = files_.find(mm_hash); f != files_.end()) {
            disk_lru_.splice(disk_lru_.begin(), disk_lru_, f->second.lru);
        }
        if (auto it = map_.find(mm_hash); it != map_.end()) return it->second.value;  // raced
        InsertLocked(mm_hash, *r, &spill);
    }
    Spill(std::move(spill));
    return std::move(r).value();
}

void EncoderCache::Insert(const std::string& mm_hash, Embeddings e) {
    if (!e) return;
    Spills spill;
    {
        std::lock_guard lock(mu_);
        if (map_.count(mm_hash)) return;
        if (InsertLocked(mm_hash, std::move(e), &spill)) ++stats_.inserts;
    }
    Spill(std::move(spill));
}

bool EncoderCache::InsertLocked(const std::string& mm_hash, Embeddings e, Spills* spill) {
    const uint64_t bytes = e->size() * sizeof(float);
    auto to_disk = [&](const std::string& h, Embeddings v) {
        if (!HasDisk() || v->size() != disk_.entry_floats) return false;
        spilling_[h] = v;
        spill->emplace_back(h, std::move(v));
        return true;
    };
    if (bytes > capacity_) return to_disk(mm_hash, std::move(e));  // disk only (memory 0)
    while (stats_.bytes + bytes > capacity_ && !lru_.empty()) {
        auto victim = map_.find(lru_.back());
        stats_.bytes -= victim->second.bytes;
        to_disk(victim->first, std::move(victim->second.value));
        map_.erase(victim);
        lru_.pop_back();
        ++stats_.evictions;
    }
    lru_.push_front(mm_hash);
    map_.emplace(mm_hash, Entry{std::move(e), bytes, lru_.begin()});
    stats_.bytes += bytes;
    return true;
}

void EncoderCache::Spill(Spills spill) {
    for (auto& [hash, value] : spill) {
        bool write = false;
        {
            std::lock_guard lock(mu_);
            if (auto f = files_.find(hash); f != files_.end()) {
                disk_lru_.splice(disk_lru_.begin(), disk_lru_, f->second.lru);  // already there
            } else {
                write = true;
            }
        }
        Status st = Status::Ok();
        uint64_t bytes = 0;
        const std::string path = PathOf(hash);
        if (write) {
            Result<uint64_t> written = WriteEmbeddingsFile(
                path, *value, disk_.width,
                {{"producer", "ferry"}, {"mm_hash", hash}, {"encoder", disk_.encoder}}, 0600);
            st = written.status();
            if (written.ok()) bytes = *written;
        }
        std::lock_guard lock(mu_);
        if (write && !st.ok()) {
            ++stats_.disk_write_errors;
            const uint64_t n = stats_.disk_write_errors;
            if ((n & (n - 1)) == 0) {  // the 1st, 2nd, 4th, ...: a full disk does not flood the log
                FERRY_LOG(kWarn, "encoder cache: not kept on disk ({} so far): {}", n,
                          st.message());
            }
        } else if (write && bytes > disk_.capacity_bytes) {
            unlink(path.c_str());
        } else if (write && !files_.count(hash)) {
            ++stats_.disk_writes;
            disk_lru_.push_front(hash);
            files_.emplace(hash, File{bytes, disk_lru_.begin()});
            stats_.disk_bytes += bytes;
            while (stats_.disk_bytes > disk_.capacity_bytes && disk_lru_.size() > 1) {
                ++stats_.disk_evictions;
                DropFileLocked(disk_lru_.back(), true);
            }
        }
        if (auto s = spilling_.find(hash); s != spilling_.end() && s->second == value) {
            spilling_.erase(s);
        }
    }
}

EncoderCacheStats EncoderCache::Stats() const {
    std::lock_guard lock(mu_);
    EncoderCacheStats s = stats_;
    s.entries = map_.size();
    s.capacity_bytes = capacity_;
    s.disk_entries = files_.size();
    s.disk_capacity_bytes = disk_.capacity_bytes;
    return s;
}

}  // namespace ferry::media
