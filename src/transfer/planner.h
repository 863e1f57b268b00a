// TransferPlanner: turns a batch of local and remote descriptors into wire chunks.
//
// 1. Expand: each descriptor (possibly strided) becomes runs, checked against its region's
//    bounds; adjacent runs in the same region are coalesced.
// 2. Pair: walk both run lists, cutting where either side ends (gather/scatter); coalesce pairs
//    that continue each other on both sides.
// 3. Chunk: group segments into frames of at most `chunk_bytes` bytes and `max_segments`
//    segments, splitting long segments, so large transfers spread over parallel streams.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "ferry/agent.h"
#include "transfer/wire.h"

namespace ferry {

inline constexpr size_t kMaxDescriptorsPerSide = 1u << 20;
inline constexpr size_t kMaxRunsPerTransfer = 1u << 24;

struct RegionView {
    uint8_t* base = nullptr;  // null for a remote region
    uint64_t length = 0;
    uint64_t key = 0;
};

struct Run {
    RegionId region = 0;
    uint64_t key = 0;
    uint8_t* base = nullptr;
    uint64_t offset = 0;
    uint64_t length = 0;
};

// `find` returns the region or nullptr. `side` ("local", "remote") names the side in errors:
// NotFound for an unknown region, OutOfRange for bounds, InvalidArgument for a bad shape.
Status ExpandDescriptors(std::span<const Descriptor> descs,
                         const std::function<const RegionView*(RegionId)>& find,
                         std::string_view side, std::vector<Run>* out);

struct PlannedSegment {
    uint8_t* local = nullptr;
    wire::Segment remote;
    RegionId local_region = 0;
};

// InvalidArgument if the two sides do not cover the same number of bytes.
Result<std::vector<PlannedSegment>> PairRuns(const std::vector<Run>& local,
                                             const std::vector<Run>& remote);

struct Chunk {
    std::vector<wire::Segment> remote;
    std::vector<iovec> local;
    std::vector<RegionId> local_regions;  // distinct, in order of first use
    uint64_t bytes = 0;
};

std::vector<Chunk> MakeChunks(const std::vector<PlannedSegment>& segments, uint64_t chunk_bytes,
                              uint32_t max_segments);

}  // namespace ferry
