#include "transfer/region_table.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <functional>

#include "core/crypto.h"
#include "core/fd.h"
#include "core/log.h"

namespace ferry {

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

void PrefaultMemory(void* p, size_t len) {
    if (len == 0) {
        return;
    }
    long page = sysconf(_SC_PAGESIZE);
    auto start = reinterpret_cast<uintptr_t>(p) & ~static_cast<uintptr_t>(page - 1);
    size_t span = reinterpret_cast<uintptr_t>(p) + len - start;
    if (madvise(reinterpret_cast<void*>(start), span, MADV_POPULATE_WRITE) == 0) {
        return;
    }
    // Older kernel or read-only memory: reading still maps the pages in.
    if (madvise(reinterpret_cast<void*>(start), span, MADV_POPULATE_READ) == 0) {
        return;
    }
    volatile const uint8_t* b = static_cast<const uint8_t*>(p);
    uint8_t sink = 0;
    for (size_t off = 0; off < len; off += static_cast<size_t>(page)) {
        sink ^= b[off];
    }
    (void)sink;
}

RegionEntry::~RegionEntry() {
    if (owned && base != nullptr) {
        munmap(base, length);
    }
    if (memfd >= 0) {
        close(memfd);
    }
}

RegionPin& RegionPin::operator=(RegionPin&& o) noexcept {
    if (this != &o) {
        Release();
        entry_ = std::move(o.entry_);
    }
    return *this;
}

namespace {
void Unpin(RegionEntry* e) {
    if (e->pins.fetch_sub(1) == 1 && e->revoked.load()) {
        std::lock_guard<std::mutex> lock(e->pin_mu);
        e->unpinned.notify_all();
    }
}
}  // namespace

void RegionPin::Release() {
    if (entry_) {
        Unpin(entry_.get());
        entry_.reset();
    }
}

RegionInfo RegionTable::Add(std::shared_ptr<RegionEntry> e) {
    uint64_t key = 0;
    while (key == 0) {
        key = SecureRandomU64();
    }
    e->key = key;
    std::lock_guard<std::mutex> lock(mu_);
    e->id = next_id_++;
    RegionInfo info = e->Info();
    regions_.emplace(e->id, std::move(e));
    return info;
}

Result<RegionInfo> RegionTable::Register(void* ptr, size_t length) {
    if (ptr == nullptr || length == 0) {
        return InvalidArgumentError("RegisterMemory: null pointer or zero length");
    }
    PrefaultMemory(ptr, length);
    auto e = std::make_shared<RegionEntry>();
    e->base = static_cast<uint8_t*>(ptr);
    e->length = length;
    return Add(std::move(e));
}

Result<RegionInfo> RegionTable::Allocate(size_t length) {
    if (length == 0) {
        return InvalidArgumentError("AllocateRegion: zero length");
    }
    // A memfd-backed shared mapping: same-host peers can map it, and it is zeroed.
    ScopedFd fd(memfd_create("ferry-region", MFD_CLOEXEC));
    if (!fd.valid()) {
        return ResourceExhaustedError(std::string("AllocateRegion: memfd_create: ") +
                                      std::strerror(errno));
    }
    if (ftruncate(fd.get(), static_cast<off_t>(length)) != 0) {
        return ResourceExhaustedError("AllocateRegion: ftruncate " + std::to_string(length) +
                                      " bytes: " + std::strerror(errno));
    }
    void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
    if (p == MAP_FAILED) {
        return ResourceExhaustedError("AllocateRegion: mmap " + std::to_string(length) +
                                      " bytes: " + std::strerror(errno));
    }
    PrefaultMemory(p, length);
    struct stat st {};
    fstat(fd.get(), &st);
    auto e = std::make_shared<RegionEntry>();
    e->base = static_cast<uint8_t*>(p);
    e->length = length;
    e->owned = true;
    e->inode = st.st_ino;
    e->share_id = SecureRandomU64();
    e->memfd = fd.Release();
    return Add(std::move(e));
}

Status RegionTable::Deregister(RegionId id, std::chrono::milliseconds grace,
                               const std::function<void(RegionId)>& on_stuck) {
    std::shared_ptr<RegionEntry> e;
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = regions_.find(id);
        if (it == regions_.end()) {
            return NotFoundError("Deregister: no region " + std::to_string(id));
        }
        e = std::move(it->second);
        regions_.erase(it);
    }
    e->revoked.store(true);
    std::unique_lock<std::mutex> lock(e->pin_mu);
    if (!e->unpinned.wait_for(lock, grace, [&] { return e->pins.load() == 0; })) {
        lock.unlock();
        FERRY_LOG(kWarn, "deregister region {}: still in use after {} ms, closing its connections",
                  id, grace.count());
        on_stuck(id);
        lock.lock();
        e->unpinned.wait(lock, [&] { return e->pins.load() == 0; });
    }
    return Status::Ok();
}

Result<RegionPin> RegionTable::Pin(std::shared_ptr<RegionEntry> e) {
    e->pins.fetch_add(1);
    if (e->revoked.load()) {
        Unpin(e.get());
        return NotFoundError("region " + std::to_string(e->id) + " was deregistered");
    }
    return RegionPin(std::move(e));
}

Result<RegionPin> RegionTable::PinRemote(RegionId id, uint64_t key, uint64_t offset,
                                         uint64_t length) {
    std::shared_ptr<RegionEntry> e = Find(id);
    if (!e) {
        return NotFoundError("no region " + std::to_string(id));
    }
    // Constant-time enough: a 64-bit compare does not leak through timing at this granularity,
    // and a wrong key costs the sender a round trip.
    if (e->key != key) {
        return PermissionDeniedError("wrong access key for region " + std::to_string(id));
    }
    if (offset > e->length || length > e->length - offset) {
        return OutOfRangeError("range [" + std::to_string(offset) + ", +" + std::to_string(length) +
                               ") outside region " + std::to_string(id) + " of " +
                               std::to_string(e->length) + " bytes");
    }
    return Pin(std::move(e));
}

Result<RegionPin> RegionTable::PinLocal(RegionId id) {
    std::shared_ptr<RegionEntry> e = Find(id);
    if (!e) {
        return NotFoundError("no local region " + std::to_string(id));
    }
    return Pin(std::move(e));
}

std::shared_ptr<RegionEntry> RegionTable::Find(RegionId id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(id);
    return it == regions_.end() ? nullptr : it->second;
}

std::vector<RegionInfo> RegionTable::List() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<RegionInfo> out;
    out.reserve(regions_.size());
    for (const auto& [id, e] : regions_) {
        out.push_back(e->Info());
    }
    return out;
}

size_t RegionTable::size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return regions_.size();
}

}  // namespace ferry
