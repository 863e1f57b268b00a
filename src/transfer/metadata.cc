#include "transfer/metadata.h"

#include <unordered_set>

#include "core/bytes.h"
#include "transfer/wire.h"

namespace ferry {

const EndpointInfo* AgentMetadata::FindEndpoint(std::string_view backend) const {
    for (const EndpointInfo& e : endpoints) {
        if (e.backend == backend) {
            return &e;
        }
    }
    return nullptr;
}

const RemoteRegion* AgentMetadata::FindRegion(RegionId id) const {
    for (const RemoteRegion& r : regions) {
        if (r.id == id) {
            return &r;
        }
    }
    return nullptr;
}

Status ValidateAgentName(std::string_view name) {
    if (name.empty() || name.size() > wire::kMaxNameLen) {
        return InvalidArgumentError("agent name must be 1.." + std::to_string(wire::kMaxNameLen) +
                                    " bytes, got " + std::to_string(name.size()));
    }
    for (char c : name) {
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '_' || c == ':' || c == '-';
        if (!ok) {
            return InvalidArgumentError("agent name '" + std::string(name) +
                                        "' has a character outside [A-Za-z0-9._:-]");
        }
    }
    return Status::Ok();
}

// Layout (all little-endian): u32 magic, u16 version, str name, u64 epoch, str host_id,
// u32 n_endpoints {str backend, str address}, u32 n_regions {u64 id, u64 length, u64 key, u8 kind},
// u32 n_extensions {u16 tag, str bytes}. Extensions are skipped by readers that do not know
// them, so fields can be added without a version bump.
std::string EncodeMetadata(const AgentMetadata& md) {
    ByteWriter w;
    w.U32(kMetadataMagic);
    w.U16(kMetadataVersion);
    w.Str(md.name);
    w.U64(md.epoch);
    w.Str(md.host_id);
    w.U32(static_cast<uint32_t>(md.endpoints.size()));
    for (const EndpointInfo& e : md.endpoints) {
        w.Str(e.backend);
        w.Str(e.address);
    }
    w.U32(static_cast<uint32_t>(md.regions.size()));
    for (const RemoteRegion& r : md.regions) {
        w.U64(r.id);
        w.U64(r.length);
        w.U64(r.key);
        w.U8(static_cast<uint8_t>(r.kind));
    }
    ByteWriter rev;
    rev.U64(md.revision);
    w.U32(1);
    w.U16(kMetadataExtRevision);
    w.Str(rev.Take());
    return w.Take();
}

Result<AgentMetadata> DecodeMetadata(std::string_view blob) {
    if (blob.size() > wire::kMaxMetadataLen) {
        return InvalidArgumentError("metadata: blob of " + std::to_string(blob.size()) +
                                    " bytes exceeds the limit of " +
                                    std::to_string(wire::kMaxMetadataLen));
    }
    ByteReader r(blob, "metadata");
    uint32_t magic = 0;
    uint16_t version = 0;
    if (!r.U32(&magic) || !r.U16(&version)) {
        return r.error();
    }
    if (magic != kMetadataMagic) {
        return InvalidArgumentError("metadata: bad magic (not a ferry agent metadata blob)");
    }
    if (version != kMetadataVersion) {
        return InvalidArgumentError("metadata: unsupported version " + std::to_string(version) +
                                    " (this side reads " + std::to_string(kMetadataVersion) + ")");
    }
    AgentMetadata md;
    uint32_t n = 0;
    if (!r.Str(&md.name, wire::kMaxNameLen) || !r.U64(&md.epoch) || !r.Str(&md.host_id, 256) ||
        !r.Count(&n, 16, 8)) {
        return r.error();
    }
    FERRY_RETURN_IF_ERROR(ValidateAgentName(md.name).WithContext("metadata"));
    md.endpoints.resize(n);
    for (EndpointInfo& e : md.endpoints) {
        // ucx addresses are a hex-encoded UCX worker address: a few hundred bytes to a few KiB.
        if (!r.Str(&e.backend, 32) || !r.Str(&e.address, kMaxEndpointAddressLen)) {
            return r.error();
        }
    }
    if (!r.Count(&n, kMaxRegionsInMetadata, 25)) {
        return r.error();
    }
    md.regions.resize(n);
    std::unordered_set<RegionId> seen;
    for (RemoteRegion& reg : md.regions) {
        uint8_t kind = 0;
        if (!r.U64(&reg.id) || !r.U64(&reg.length) || !r.U64(&reg.key) || !r.U8(&kind)) {
            return r.error();
        }
        if (kind > static_cast<uint8_t>(MemoryKind::kCuda)) {
            return InvalidArgumentError("metadata: region " + std::to_string(reg.id) +
                                        " has unknown memory kind " + std::to_string(kind));
        }
        reg.kind = static_cast<MemoryKind>(kind);
        if (!seen.insert(reg.id).second) {
            return InvalidArgumentError("metadata: region " + std::to_string(reg.id) +
                                        " listed twice");
        }
    }
    if (!r.Count(&n, 1024, 6)) {
        return r.error();
    }
    for (uint32_t i = 0; i < n; ++i) {
        uint16_t tag = 0;
        std::string bytes;
        if (!r.U16(&tag) || !r.Str(&bytes, wire::kMaxMetadataLen)) {
            return r.error();
        }
        if (tag == kMetadataExtRevision) {
            ByteReader ext(bytes, "metadata revision");
            if (!ext.U64(&md.revision)) return ext.error();
            FERRY_RETURN_IF_ERROR(ext.Finish());
        }
    }
    FERRY_RETURN_IF_ERROR(r.Finish());
    return md;
}

}  // namespace ferry
