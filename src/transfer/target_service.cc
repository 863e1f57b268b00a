#include "transfer/target_service.h"

#include "core/log.h"

namespace ferry::internal {

FileEngine* FileEngineSlot::Get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return engine_.get();
}

Result<FileEngine*> FileEngineSlot::Ensure(const std::string& agent) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!engine_) {
        FERRY_ASSIGN_OR_RETURN(engine_, FileEngine::Create(options_));
        FERRY_LOG(kInfo, "agent {}: file backend started ({})", agent, engine_->mode());
    }
    return engine_.get();
}

void FileEngineSlot::Reset() {
    std::unique_ptr<FileEngine> gone;
    {
        std::lock_guard<std::mutex> lock(mu_);
        gone = std::move(engine_);
    }
}

Status TargetService::PinSegments(const std::vector<wire::Segment>& segs, bool write,
                                  std::vector<RegionPin>* pins, std::vector<iovec>* iov,
                                  FileStaging* staging) {
    iov->reserve(segs.size());
    RegionId last = 0;
    uint64_t staged = 0;  // bytes of file segments, each rounded up to the O_DIRECT alignment
    for (const wire::Segment& s : segs) {
        FERRY_ASSIGN_OR_RETURN(RegionPin p,
                               regions_.PinRemote(s.region, s.key, s.offset, s.length));
        const RegionEntry& e = *p.entry();
        if (e.kind == MemoryKind::kFile) {
            if (staging == nullptr) {
                return FailedPreconditionError("region " + std::to_string(s.region) +
                                               " is a file region; this request cannot reach it");
            }
            if (write && e.read_only) {
                return PermissionDeniedError("region " + std::to_string(s.region) +
                                             " is a read-only file region (" + e.path + ")");
            }
            if (e.direct && ((e.file_offset + s.offset) % kDirectAlignment != 0 ||
                             s.length % kDirectAlignment != 0)) {
                return InvalidArgumentError(
                    "region " + std::to_string(s.region) + " is a file opened with O_DIRECT: [" +
                    std::to_string(s.offset) + ", +" + std::to_string(s.length) +
                    ") is not aligned to " + std::to_string(kDirectAlignment) + " bytes");
            }
            FileIo io;
            io.fd = e.file_fd;
            io.file_offset = e.file_offset + s.offset;
            io.length = s.length;
            io.to_file = write;
            io.region = e.id;
            io.mem = reinterpret_cast<uint8_t*>(staged);  // an offset until the buffer exists
            staging->ios.push_back(io);
            staged += (s.length + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment;
            iov->push_back(iovec{nullptr, s.length});
        } else {
            iov->push_back(iovec{e.base + s.offset, s.length});
        }
        // One pin per distinct region is enough; consecutive segments usually share one.
        if (pins->empty() || last != s.region) {
            last = s.region;
            pins->push_back(std::move(p));
        }
    }
    if (staged == 0) {
        return Status::Ok();
    }
    staging->buffer = AlignedBuffer::Allocate(staged);
    if (!staging->buffer) {
        return ResourceExhaustedError("staging " + std::to_string(staged) +
                                      " bytes of file regions: out of memory");
    }
    size_t k = 0;
    for (iovec& v : *iov) {
        if (v.iov_base != nullptr) continue;
        FileIo& io = staging->ios[k++];
        io.mem = staging->buffer->data() + reinterpret_cast<uintptr_t>(io.mem);
        v.iov_base = io.mem;
    }
    return Status::Ok();
}

Status TargetService::MoveStaged(FileStaging& staging, bool to_file) {
    FileEngine* files = files_.Get();
    if (files == nullptr) {
        return FailedPreconditionError("no file engine");  // cannot happen: file regions exist
    }
    for (FileIo& io : staging.ios) io.to_file = to_file;
    return files->Run(staging.ios);
}

Status TargetService::ResolveObject(std::string_view key, std::vector<RegionPin>* pins,
                                    std::vector<iovec>* iov, uint64_t* size) {
    return objects_.Resolve(key, pins, iov, size);
}

void TargetService::DeliverNotification(std::string peer, std::string payload) {
    notes_.Push(std::move(peer), std::move(payload));
}

Result<FileEngine*> TargetService::Files() { return files_.Ensure(agent_); }

Status TargetService::GrantRegion(RegionId id, uint64_t key, void** base, uint64_t* length) {
    FERRY_ASSIGN_OR_RETURN(RegionPin pin, regions_.PinRemote(id, key, 0, 0));
    const RegionEntry& e = *pin.entry();
    if (e.kind != MemoryKind::kHost) {
        return FailedPreconditionError("region " + std::to_string(id) +
                                       " is not host memory: no one-sided access");
    }
    *base = e.base;
    *length = e.length;
    return Status::Ok();
}

}  // namespace ferry::internal
