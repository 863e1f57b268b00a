// Agent metadata: the versioned binary blob an agent hands its peers (docs/wire-protocol.md,
// "Metadata blob"). Pure codec.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/agent.h"

namespace ferry {

struct EndpointInfo {
    std::string backend;  // "tcp", "shm"
    std::string address;  // backend-specific: "host:port", "<host id>/<socket name>"
};

struct RemoteRegion {
    RegionId id = 0;
    uint64_t length = 0;
    uint64_t key = 0;
    MemoryKind kind = MemoryKind::kHost;
};

struct AgentMetadata {
    std::string name;
    uint64_t epoch = 0;
    // Identifies the host (boot id + network namespace): equal ids mean shared memory works.
    std::string host_id;
    std::vector<EndpointInfo> endpoints;
    std::vector<RemoteRegion> regions;
    // Grows each time the agent registers or deregisters a region (within one epoch): a copy
    // that arrives late (a store event a moment behind the side channel) is told apart from a
    // newer one by it. 0 from a writer that does not send it.
    uint64_t revision = 0;

    const EndpointInfo* FindEndpoint(std::string_view backend) const;
    const RemoteRegion* FindRegion(RegionId id) const;
};

inline constexpr uint32_t kMetadataMagic = 0x444d5246;  // "FRMD"
inline constexpr uint16_t kMetadataVersion = 1;
inline constexpr uint32_t kMaxRegionsInMetadata = 1u << 20;
inline constexpr uint32_t kMaxEndpointAddressLen = 16384;
// Extension tags (the blob's optional trailer; readers skip the ones they do not know).
inline constexpr uint16_t kMetadataExtRevision = 1;  // u64: AgentMetadata::revision

std::string EncodeMetadata(const AgentMetadata& md);
// InvalidArgument naming the problem for anything malformed, truncated or out of bounds.
Result<AgentMetadata> DecodeMetadata(std::string_view blob);

// Checks an agent name: 1..128 bytes of [A-Za-z0-9._:-].
Status ValidateAgentName(std::string_view name);

}  // namespace ferry
