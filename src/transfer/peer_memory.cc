#include "transfer/peer_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <string>

#include "core/fd.h"
#include "transfer/connection.h"
#include "transfer/iov_cursor.h"

namespace ferry::internal {

PeerMapping::~PeerMapping() {
    if (base != nullptr) {
        munmap(base, length);
    }
}

Status CmaCopy(pid_t pid, const std::vector<iovec>& ours, const std::vector<iovec>& theirs,
               bool to_peer) {
    constexpr size_t kIovMax = IOV_MAX;
    IovCursor o, t;
    iovec lw[kIovMax];
    iovec rw[kIovMax];
    while (!o.AtEnd(ours) && !t.AtEnd(theirs)) {
        size_t ln = 0, rn = 0;
        uint64_t lbytes = 0, rbytes = 0;
        for (size_t i = o.index, off = o.offset; i < ours.size() && ln < kIovMax; ++i, off = 0) {
            lw[ln++] = iovec{static_cast<char*>(ours[i].iov_base) + off, ours[i].iov_len - off};
            lbytes += ours[i].iov_len - off;
        }
        for (size_t i = t.index, off = t.offset; i < theirs.size() && rn < kIovMax; ++i, off = 0) {
            rw[rn++] = iovec{static_cast<char*>(theirs[i].iov_base) + off, theirs[i].iov_len - off};
            rbytes += theirs[i].iov_len - off;
        }
        uint64_t want = std::min(lbytes, rbytes);
        ssize_t r = to_peer ? process_vm_writev(pid, lw, ln, rw, rn, 0)
                            : process_vm_readv(pid, lw, ln, rw, rn, 0);
        if (r < 0) {
            return Status(errno == EFAULT ? Code::kInvalidArgument : Code::kUnavailable,
                          std::string("shm: ") +
                              (to_peer ? "process_vm_writev" : "process_vm_readv") + " to pid " +
                              std::to_string(pid) + ": " + std::strerror(errno));
        }
        if (static_cast<uint64_t>(r) != want) {
            return InvalidArgumentError("shm: partial copy (" + std::to_string(r) + " of " +
                                        std::to_string(want) +
                                        " bytes): the initiator's buffer is not mapped");
        }
        o.Advance(ours, want);
        t.Advance(theirs, want);
    }
    return Status::Ok();
}

wire::SharedRegion ShareOf(const RegionEntry& e) {
    return wire::SharedRegion{e.share_id, static_cast<uint32_t>(e.memfd), e.inode,
                              reinterpret_cast<uint64_t>(e.base), e.length};
}

std::vector<wire::SharedRegion> SharesFor(const RegionTable& table,
                                          const std::vector<RegionId>& regions) {
    std::vector<wire::SharedRegion> out;
    for (RegionId id : regions) {
        if (out.size() >= wire::kMaxSharesPerFrame) break;
        std::shared_ptr<RegionEntry> e = table.Find(id);
        if (e && e->memfd >= 0) {
            out.push_back(ShareOf(*e));
        }
    }
    return out;
}

std::shared_ptr<PeerMapping> PeerMemory::Map(pid_t pid, const wire::SharedRegion& share) {
    std::lock_guard<std::mutex> lock(mu_);
    auto key = std::make_pair(pid, share.share_id);
    auto it = maps_.find(key);
    if (it != maps_.end()) {
        return it->second->length == share.length ? it->second : nullptr;
    }
    // Opening another process's fd needs the same ptrace access the handshake probe proved.
    std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(share.fd);
    ScopedFd fd(open(path.c_str(), O_RDWR | O_CLOEXEC));
    struct stat st {};
    if (!fd.valid() || fstat(fd.get(), &st) != 0 || st.st_ino != share.inode ||
        static_cast<uint64_t>(st.st_size) < share.length || share.length == 0) {
        return nullptr;  // not what the initiator claims: fall back to cross-memory attach
    }
    void* p =
        mmap(nullptr, share.length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
    if (p == MAP_FAILED) {
        return nullptr;
    }
    auto m = std::make_shared<PeerMapping>();
    m->base = static_cast<uint8_t*>(p);
    m->length = share.length;
    maps_[key] = m;
    return m;
}

Status PeerMemory::Copy(pid_t pid, const std::vector<iovec>& ours, const std::vector<iovec>& theirs,
                        const std::vector<wire::SharedRegion>& shares, bool to_peer) {
    // Translate every initiator buffer into our mapping of its region.
    std::vector<std::shared_ptr<PeerMapping>> maps;
    std::vector<iovec> local_theirs;
    bool mapped = !shares.empty();
    if (mapped) {
        for (const wire::SharedRegion& sh : shares) {
            maps.push_back(Map(pid, sh));
        }
        local_theirs.reserve(theirs.size());
        for (const iovec& v : theirs) {
            uint64_t addr = reinterpret_cast<uint64_t>(v.iov_base);
            bool found = false;
            for (size_t i = 0; i < shares.size() && !found; ++i) {
                const wire::SharedRegion& sh = shares[i];
                if (maps[i] && addr >= sh.base && v.iov_len <= sh.length &&
                    addr - sh.base <= sh.length - v.iov_len) {
                    local_theirs.push_back(iovec{maps[i]->base + (addr - sh.base), v.iov_len});
                    found = true;
                }
            }
            if (!found) {
                mapped = false;
                break;
            }
        }
    }
    if (!mapped) {
        return CmaCopy(pid, ours, theirs, to_peer);
    }
    IovCursor o, t;
    while (!o.AtEnd(ours) && !t.AtEnd(local_theirs)) {
        size_t n = std::min(o.Contiguous(ours), t.Contiguous(local_theirs));
        if (to_peer) {
            std::memcpy(t.Pointer(local_theirs), o.Pointer(ours), n);
        } else {
            std::memcpy(o.Pointer(ours), t.Pointer(local_theirs), n);
        }
        o.Advance(ours, n);
        t.Advance(local_theirs, n);
    }
    return Status::Ok();
}

void PeerMemory::Forget(pid_t pid, uint64_t share_id) {
    std::lock_guard<std::mutex> lock(mu_);
    maps_.erase({pid, share_id});
}

void PeerMemory::ForgetProcess(pid_t pid) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = maps_.lower_bound({pid, 0}); it != maps_.end() && it->first.first == pid;) {
        it = maps_.erase(it);
    }
}

void PeerMemory::RecordGrant(uint64_t share_id, const std::shared_ptr<Connection>& conn) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& conns = grants_[share_id];
    std::erase_if(conns, [](const std::weak_ptr<Connection>& w) { return w.expired(); });
    conns.push_back(conn);
}

std::vector<std::shared_ptr<Connection>> PeerMemory::TakeGrants(uint64_t share_id) {
    std::vector<std::shared_ptr<Connection>> conns;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = grants_.find(share_id);
    if (it == grants_.end()) {
        return conns;
    }
    for (const auto& w : it->second) {
        if (auto c = w.lock(); c && !c->closed()) conns.push_back(std::move(c));
    }
    grants_.erase(it);
    return conns;
}

}  // namespace ferry::internal
