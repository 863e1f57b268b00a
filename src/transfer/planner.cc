#include "transfer/planner.h"

#include <algorithm>
#include <string>

namespace ferry {

Status ExpandDescriptors(std::span<const Descriptor> descs,
                         const std::function<const RegionView*(RegionId)>& find,
                         std::string_view side, std::vector<Run>* out) {
    std::string where(side);
    if (descs.empty()) {
        return InvalidArgumentError(where + " descriptor list is empty");
    }
    if (descs.size() > kMaxDescriptorsPerSide) {
        return InvalidArgumentError(where + " descriptor list of " + std::to_string(descs.size()) +
                                    " exceeds the limit of " +
                                    std::to_string(kMaxDescriptorsPerSide));
    }
    out->clear();
    out->reserve(descs.size());
    RegionId cached_id = 0;
    const RegionView* cached = nullptr;
    for (size_t i = 0; i < descs.size(); ++i) {
        const Descriptor& d = descs[i];
        auto what = [&] { return where + " descriptor " + std::to_string(i); };
        if (d.length == 0 || d.count == 0) {
            return InvalidArgumentError(what() + ": zero length or count");
        }
        if (d.count > 1 && d.stride < d.length) {
            return InvalidArgumentError(what() + ": stride " + std::to_string(d.stride) +
                                        " is smaller than its length " + std::to_string(d.length) +
                                        " (runs would overlap)");
        }
        if (cached == nullptr || cached_id != d.region) {
            cached = find(d.region);
            cached_id = d.region;
            if (cached == nullptr) {
                return NotFoundError(what() + ": no region " + std::to_string(d.region));
            }
        }
        // End of the last run, computed without overflow.
        uint64_t span_len = 0;
        if (d.count > 1) {
            if (__builtin_mul_overflow(d.stride, d.count - 1, &span_len) ||
                __builtin_add_overflow(span_len, d.length, &span_len)) {
                return OutOfRangeError(what() + ": stride * count overflows");
            }
        } else {
            span_len = d.length;
        }
        if (d.offset > cached->length || span_len > cached->length - d.offset) {
            return OutOfRangeError(what() + ": [" + std::to_string(d.offset) + ", +" +
                                   std::to_string(span_len) + ") outside region " +
                                   std::to_string(d.region) + " of " +
                                   std::to_string(cached->length) + " bytes");
        }
        if (out->size() + d.count > kMaxRunsPerTransfer) {
            return InvalidArgumentError(where + " descriptors expand to more than " +
                                        std::to_string(kMaxRunsPerTransfer) + " runs");
        }
        for (uint64_t k = 0; k < d.count; ++k) {
            uint64_t off = d.offset + k * d.stride;
            if (!out->empty()) {
                Run& last = out->back();
                if (last.region == d.region && last.offset + last.length == off) {
                    last.length += d.length;
                    continue;
                }
            }
            out->push_back(Run{d.region, cached->key, cached->base, off, d.length});
        }
    }
    return Status::Ok();
}

Result<std::vector<PlannedSegment>> PairRuns(const std::vector<Run>& local,
                                             const std::vector<Run>& remote) {
    uint64_t local_total = 0;
    uint64_t remote_total = 0;
    for (const Run& r : local) local_total += r.length;
    for (const Run& r : remote) remote_total += r.length;
    if (local_total != remote_total) {
        return InvalidArgumentError("local descriptors cover " + std::to_string(local_total) +
                                    " bytes but remote descriptors cover " +
                                    std::to_string(remote_total));
    }
    std::vector<PlannedSegment> out;
    out.reserve(std::max(local.size(), remote.size()));
    size_t li = 0;
    size_t ri = 0;
    uint64_t loff = 0;  // consumed bytes of local[li]
    uint64_t roff = 0;
    while (li < local.size() && ri < remote.size()) {
        const Run& l = local[li];
        const Run& r = remote[ri];
        uint64_t n = std::min(l.length - loff, r.length - roff);
        uint8_t* laddr = l.base + l.offset + loff;
        uint64_t raddr = r.offset + roff;
        PlannedSegment* last = out.empty() ? nullptr : &out.back();
        if (last != nullptr && last->local + last->remote.length == laddr &&
            last->local_region == l.region && last->remote.region == r.region &&
            last->remote.offset + last->remote.length == raddr) {
            last->remote.length += n;
        } else {
            out.push_back(
                PlannedSegment{laddr, wire::Segment{r.region, r.key, raddr, n}, l.region});
        }
        loff += n;
        roff += n;
        if (loff == l.length) {
            ++li;
            loff = 0;
        }
        if (roff == r.length) {
            ++ri;
            roff = 0;
        }
    }
    return out;
}

std::vector<Chunk> MakeChunks(const std::vector<PlannedSegment>& segments, uint64_t chunk_bytes,
                              uint32_t max_segments) {
    std::vector<Chunk> chunks;
    Chunk cur;
    auto flush = [&] {
        if (!cur.remote.empty()) {
            chunks.push_back(std::move(cur));
            cur = Chunk{};
        }
    };
    for (const PlannedSegment& s : segments) {
        uint64_t done = 0;
        while (done < s.remote.length) {
            if (cur.bytes >= chunk_bytes || cur.remote.size() >= max_segments) {
                flush();
            }
            uint64_t n = std::min(s.remote.length - done, chunk_bytes - cur.bytes);
            wire::Segment seg = s.remote;
            seg.offset += done;
            seg.length = n;
            cur.remote.push_back(seg);
            cur.local.push_back(iovec{s.local + done, n});
            if (std::find(cur.local_regions.begin(), cur.local_regions.end(), s.local_region) ==
                cur.local_regions.end()) {
                cur.local_regions.push_back(s.local_region);
            }
            cur.bytes += n;
            done += n;
        }
    }
    flush();
    return chunks;
}

}  // namespace ferry
