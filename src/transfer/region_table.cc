#include "transfer/region_table.h"

#include <fcntl.h>
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
    if (file_fd >= 0) {
        close(file_fd);
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
    ++revision_;
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

Result<RegionInfo> RegionTable::RegisterFile(const std::string& path, int fd, uint64_t offset,
                                             uint64_t length, const FileRegionOptions& options) {
    const std::string what = fd >= 0 ? "RegisterFileDescriptor(fd " + std::to_string(fd) + ")"
                                     : "RegisterFile(" + path + ")";
    if (length == 0) {
        return InvalidArgumentError(what + ": zero length");
    }
    if (offset > (1ull << 62) || length > (1ull << 62) - offset) {
        return InvalidArgumentError(what + ": offset " + std::to_string(offset) + " + length " +
                                    std::to_string(length) + " is out of range");
    }
    if (options.create && options.read_only) {
        return InvalidArgumentError(what + ": create and read_only exclude each other");
    }
    if (options.direct && (offset % 4096 != 0 || length % 4096 != 0)) {
        return InvalidArgumentError(what + ": with direct I/O, offset (" + std::to_string(offset) +
                                    ") and length (" + std::to_string(length) +
                                    ") must be multiples of 4096");
    }
    ScopedFd file;
    if (fd >= 0) {
        file.Reset(fcntl(fd, F_DUPFD_CLOEXEC, 3));
        if (!file.valid()) {
            return InvalidArgumentError(what + ": " + std::strerror(errno));
        }
        int fl = fcntl(file.get(), F_GETFL);
        if ((fl & O_ACCMODE) == O_WRONLY) {
            return InvalidArgumentError(what +
                                        ": the descriptor is write-only; READs need it readable");
        }
        if (options.direct != ((fl & O_DIRECT) != 0)) {
            return InvalidArgumentError(
                what + ": options.direct does not match the descriptor (" +
                std::string((fl & O_DIRECT) ? "opened with" : "opened without") + " O_DIRECT)");
        }
        if (!options.read_only && (fl & O_ACCMODE) == O_RDONLY) {
            return InvalidArgumentError(what +
                                        ": the descriptor is read-only; set options.read_only");
        }
    } else {
        if (path.empty()) {
            return InvalidArgumentError("RegisterFile: empty path");
        }
        int flags = O_CLOEXEC | (options.read_only ? O_RDONLY : O_RDWR) |
                    (options.create ? O_CREAT : 0) | (options.direct ? O_DIRECT : 0);
        file.Reset(open(path.c_str(), flags, 0644));
        if (!file.valid()) {
            int err = errno;
            std::string why = what + ": " + std::strerror(err);
            if (err == ENOENT) return NotFoundError(why + " (set options.create to create it)");
            if (err == EACCES || err == EPERM || err == EROFS) return PermissionDeniedError(why);
            if (err == EINVAL && options.direct) {
                return InvalidArgumentError(why + " (the file system does not support O_DIRECT)");
            }
            return InvalidArgumentError(why);
        }
    }
    struct stat st {};
    if (fstat(file.get(), &st) != 0) {
        return InternalError(what + ": fstat: " + std::strerror(errno));
    }
    if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
        return InvalidArgumentError(what + ": not a regular file or block device");
    }
    uint64_t size = static_cast<uint64_t>(st.st_size);
    if (S_ISBLK(st.st_mode)) {
        off_t end = lseek(file.get(), 0, SEEK_END);
        size = end < 0 ? 0 : static_cast<uint64_t>(end);
    }
    if (size < offset + length) {
        if (!options.create || S_ISBLK(st.st_mode)) {
            return InvalidArgumentError(
                what + ": the range [" + std::to_string(offset) + ", " +
                std::to_string(offset + length) + ") lies beyond the end of the file (" +
                std::to_string(size) + " bytes)" +
                (options.create ? "" : "; set options.create to extend it"));
        }
        if (ftruncate(file.get(), static_cast<off_t>(offset + length)) != 0) {
            return ResourceExhaustedError(what + ": extending to " +
                                          std::to_string(offset + length) +
                                          " bytes: " + std::strerror(errno));
        }
    }
    auto e = std::make_shared<RegionEntry>();
    e->kind = MemoryKind::kFile;
    e->length = length;
    e->file_fd = file.Release();
    e->file_offset = offset;
    e->direct = options.direct;
    e->read_only = options.read_only;
    e->path = fd >= 0 ? "fd " + std::to_string(fd) : path;
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
        ++revision_;
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

std::vector<RegionInfo> RegionTable::List(uint64_t* revision) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (revision != nullptr) *revision = revision_;
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
