#include "transfer/backends/file/file_backend.h"

#include <fmt/core.h>

#include <unordered_map>

#include "transfer/backends/file/file_engine.h"
#include "transfer/transfer_op.h"

namespace ferry {

using internal::FileEngine;
using internal::FileIo;
using internal::kDirectAlignment;

namespace {

struct FilePlan final : SelfTransfer {
    uint64_t total = 0;
    std::vector<FileIo> ios;
    std::vector<RegionPin> pins;
    FileEngine* files = nullptr;
    uint64_t bytes() const override { return total; }
};

}  // namespace

BackendCapabilities FileBackend::capabilities() const {
    BackendCapabilities c;
    c.data_path = DataPath::kOwn;
    c.locality = Locality::kSelf;
    c.notifications = false;
    c.pull_by_key = false;
    c.memory_kinds = BackendCapabilities::MemoryKindBit(MemoryKind::kHost) |
                     BackendCapabilities::MemoryKindBit(MemoryKind::kFile);
    return c;
}

Result<std::string> FileBackend::Listen(ScopedFd* listener) {
    (void)listener;
    return std::string();
}

bool FileBackend::CanReach(const AgentMetadata& self, const AgentMetadata& peer) const {
    (void)self;
    (void)peer;
    return false;
}

Status FileBackend::Start(TargetServices* services) {
    services_ = services;
    return Status::Ok();
}

Result<std::unique_ptr<SelfTransfer>> FileBackend::PlanSelf(bool write,
                                                            std::span<const Descriptor> local,
                                                            std::span<const Descriptor> remote) {
    std::unordered_map<RegionId, std::shared_ptr<RegionEntry>> entries;
    std::unordered_map<RegionId, RegionView> views;
    auto find = [&](RegionId id) -> const RegionView* {
        auto it = views.find(id);
        if (it != views.end()) return &it->second;
        auto e = services_->OwnRegion(id);
        if (!e) return nullptr;
        entries[id] = e;
        return &(views[id] = RegionView{e->base, e->length, e->key});
    };
    std::vector<Run> local_runs, remote_runs;
    FERRY_RETURN_IF_ERROR(ExpandDescriptors(local, find, "local", &local_runs));
    FERRY_RETURN_IF_ERROR(ExpandDescriptors(remote, find, "remote", &remote_runs));
    uint64_t local_total = 0, remote_total = 0;
    for (const Run& r : local_runs) local_total += r.length;
    for (const Run& r : remote_runs) remote_total += r.length;
    if (local_total != remote_total) {
        return InvalidArgumentError("local descriptors cover " + std::to_string(local_total) +
                                    " bytes, remote descriptors " + std::to_string(remote_total));
    }

    // Pair the runs into pieces, source -> destination by the direction.
    auto plan = std::make_unique<FilePlan>();
    plan->total = local_total;
    std::vector<FileIo>& ios = plan->ios;
    size_t i = 0, j = 0;
    uint64_t in_i = 0, in_j = 0;
    while (i < local_runs.size() && j < remote_runs.size()) {
        const Run& l = local_runs[i];
        const Run& r = remote_runs[j];
        uint64_t n = std::min(l.length - in_i, r.length - in_j);
        const RegionEntry& le = *entries[l.region];
        const RegionEntry& re = *entries[r.region];
        const RegionEntry& src = write ? le : re;
        const RegionEntry& dst = write ? re : le;
        uint64_t src_off = write ? l.offset + in_i : r.offset + in_j;
        uint64_t dst_off = write ? r.offset + in_j : l.offset + in_i;
        FileIo io;
        io.length = n;
        if (src.kind == MemoryKind::kFile && dst.kind == MemoryKind::kFile) {
            return InvalidArgumentError("regions " + std::to_string(src.id) + " and " +
                                        std::to_string(dst.id) +
                                        " are both file regions: file to file copies are not "
                                        "supported; stage them through a memory region");
        }
        const RegionEntry* file = nullptr;
        if (dst.kind == MemoryKind::kFile) {
            file = &dst;
            io.fd = dst.file_fd;
            io.file_offset = dst.file_offset + dst_off;
            io.mem = src.base + src_off;
            io.to_file = true;
            if (dst.read_only) {
                return PermissionDeniedError("region " + std::to_string(dst.id) +
                                             " is a read-only file region (" + dst.path + ")");
            }
        } else if (src.kind == MemoryKind::kFile) {
            file = &src;
            io.fd = src.file_fd;
            io.file_offset = src.file_offset + src_off;
            io.mem = dst.base + dst_off;
        } else {
            io.mem = dst.base + dst_off;
            io.from = src.base + src_off;
        }
        if (file != nullptr) {
            io.region = file->id;
            if (file->direct &&
                (io.file_offset % kDirectAlignment != 0 || n % kDirectAlignment != 0 ||
                 reinterpret_cast<uintptr_t>(io.mem) % kDirectAlignment != 0)) {
                return InvalidArgumentError(
                    "region " + std::to_string(file->id) + " is a file opened with O_DIRECT: " +
                    std::to_string(n) + " bytes at file offset " + std::to_string(io.file_offset) +
                    " with memory at " + fmt::format("{}", static_cast<const void*>(io.mem)) +
                    " are not all aligned to " + std::to_string(kDirectAlignment) + " bytes");
            }
        }
        // Pieces that continue the previous one on both sides become one io.
        FileIo* prev = ios.empty() ? nullptr : &ios.back();
        if (prev != nullptr && prev->fd == io.fd && prev->to_file == io.to_file &&
            prev->mem + prev->length == io.mem &&
            (io.fd >= 0 ? prev->file_offset + prev->length == io.file_offset
                        : prev->from + prev->length == io.from)) {
            prev->length += n;
        } else {
            ios.push_back(io);
        }
        in_i += n;
        in_j += n;
        if (in_i == l.length) {
            ++i;
            in_i = 0;
        }
        if (in_j == r.length) {
            ++j;
            in_j = 0;
        }
    }
    // Without a file region ever registered, memory copies still go through the engine.
    FERRY_ASSIGN_OR_RETURN(plan->files, services_->Files());
    for (auto& [id, e] : entries) {
        FERRY_ASSIGN_OR_RETURN(RegionPin p, services_->PinOwnRegion(id));
        plan->pins.push_back(std::move(p));
    }
    return std::unique_ptr<SelfTransfer>(std::move(plan));
}

void FileBackend::StartSelf(const std::shared_ptr<internal::TransferOp>& op,
                            std::unique_ptr<SelfTransfer> plan) {
    auto* fp = static_cast<FilePlan*>(plan.get());  // ours: made by PlanSelf above
    FileEngine* files = fp->files;
    // Cancel, a deadline or a Deregister stop the batch and return once the kernel is done with
    // its memory. Nothing can call it before `*batch` is set: the agent publishes the op (its
    // table, the handle) only after this returns.
    auto batch = std::make_shared<std::shared_ptr<FileEngine::Batch>>();
    op->SetCutOff([files, batch](const Status& s) { files->Cancel(*batch, s); });
    op->Arm(1, std::move(fp->pins), nullptr);
    std::weak_ptr<internal::TransferOp> weak = op;
    *batch = files->Submit(std::move(fp->ios), [weak](const Status& s) {
        if (auto o = weak.lock()) o->ChunkDone(s);
    });
}

std::unique_ptr<Backend> MakeFileBackend(const BackendContext& ctx) {
    (void)ctx;
    return std::make_unique<FileBackend>();
}

}  // namespace ferry
