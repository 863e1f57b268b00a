#include "transfer/object_directory.h"

#include <unordered_map>

#include "transfer/planner.h"
#include "transfer/wire.h"

namespace ferry::internal {

Status ObjectDirectory::Publish(std::string key, std::vector<Descriptor> descriptors) {
    if (key.empty() || key.size() > wire::kMaxKeyLen) {
        return InvalidArgumentError("Publish: key must be 1.." + std::to_string(wire::kMaxKeyLen) +
                                    " bytes");
    }
    std::vector<Run> runs;
    std::unordered_map<RegionId, RegionView> views;
    RegionId file_region = 0;
    FERRY_RETURN_IF_ERROR(ExpandDescriptors(
        descriptors,
        [&](RegionId id) -> const RegionView* {
            auto e = regions_.Find(id);
            if (!e) return nullptr;
            if (e->kind == MemoryKind::kFile) file_region = id;
            return &(views[id] = RegionView{e->base, e->length, e->key});
        },
        "Publish", &runs));
    if (file_region != 0) {
        return InvalidArgumentError("Publish: region " + std::to_string(file_region) +
                                    " is a file region; objects must lie in memory regions (read "
                                    "the file into one first)");
    }
    uint64_t total = 0;
    for (const Run& r : runs) total += r.length;
    if (total > wire::kMaxPayload) {
        return InvalidArgumentError("Publish: object of " + std::to_string(total) +
                                    " bytes exceeds the limit of " +
                                    std::to_string(wire::kMaxPayload));
    }
    std::lock_guard<std::mutex> lock(mu_);
    objects_[std::move(key)] = std::move(descriptors);
    return Status::Ok();
}

Status ObjectDirectory::Unpublish(std::string_view key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(key);
    if (it == objects_.end()) {
        return NotFoundError("Unpublish: no object '" + std::string(key) + "'");
    }
    objects_.erase(it);
    return Status::Ok();
}

Status ObjectDirectory::Resolve(std::string_view key, std::vector<RegionPin>* pins,
                                std::vector<iovec>* iov, uint64_t* size) const {
    std::vector<Descriptor> descs;
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = objects_.find(key);
        if (it == objects_.end()) {
            return NotFoundError("no object '" + std::string(key) + "'");
        }
        descs = it->second;
    }
    std::vector<Run> runs;
    std::unordered_map<RegionId, RegionView> views;
    Status s = ExpandDescriptors(
        descs,
        [&](RegionId id) -> const RegionView* {
            auto e = regions_.Find(id);
            if (!e || e->kind == MemoryKind::kFile) return nullptr;
            return &(views[id] = RegionView{e->base, e->length, e->key});
        },
        "object '" + std::string(key) + "'", &runs);
    if (!s.ok()) {
        return s.code() == Code::kNotFound ? NotFoundError(s.message()) : s;
    }
    *size = 0;
    for (const Run& r : runs) {
        *size += r.length;
        iov->push_back(iovec{r.base + r.offset, r.length});
    }
    for (auto& [id, v] : views) {
        Result<RegionPin> p = regions_.PinLocal(id);
        if (!p.ok()) {
            return p.status().code() == Code::kNotFound ? NotFoundError(p.status().message())
                                                        : p.status();
        }
        pins->push_back(std::move(*p));
    }
    return Status::Ok();
}

}  // namespace ferry::internal
