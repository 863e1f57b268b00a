// The ferry wire protocol (docs/wire-protocol.md): a fixed 32-byte frame header, a bounded body,
// and an optional payload of bulk bytes that the receiver places straight into registered
// memory. Pure codecs: no I/O here, so everything is unit-testable and fuzzable.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/crypto.h"
#include "ferry/status.h"

namespace ferry::wire {

inline constexpr uint32_t kMagic = 0x31595246;  // "FRY1" in little-endian byte order
inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kHeaderSize = 32;
inline constexpr uint32_t kMaxBody = 4u << 20;        // 4 MiB
inline constexpr uint64_t kMaxPayload = 64ull << 20;  // 64 MiB per frame
inline constexpr uint32_t kMaxSegmentsPerFrame = 8192;
inline constexpr uint32_t kMaxNameLen = 128;
inline constexpr uint32_t kMaxKeyLen = 4096;
inline constexpr uint32_t kMaxMessageLen = 4096;
inline constexpr uint32_t kMaxNotificationLen = 1u << 20;  // 1 MiB
inline constexpr uint32_t kMaxMetadataLen = 16u << 20;

enum class FrameType : uint8_t {
    kHello = 1,         // client -> server: who I am, my nonce
    kHelloAck = 2,      // server -> client: who I am, my nonce, my proof
    kAuth = 3,          // client -> server: my proof
    kReady = 4,         // server -> client: handshake done
    kGetMetadata = 5,   // client -> server: send me your metadata
    kMetadata = 6,      // server -> client: metadata blob
    kWrite = 7,         // initiator -> target: segments (+ payload, or initiator iovecs for cma)
    kRead = 8,          // initiator -> target: segments (+ initiator iovecs for cma)
    kResponse = 9,      // target -> initiator: status (+ payload for an inline read or pull)
    kNotify = 10,       // either direction: a notification
    kPull = 11,         // initiator -> target: named object by key
    kError = 12,        // either direction, then close: why
    kUnshare = 13,      // either direction (shm): my region `share_id` is gone, unmap it
    kMapRegion = 14,    // initiator -> target (shm): may I map your region {id, key}?
    kRegionGrant = 15,  // target -> initiator: yes, here is its memfd (a SharedRegion)
};
std::string_view FrameTypeName(FrameType t);

// How the bytes of a READ/WRITE/PULL travel. kInline: as the frame payload on the same stream.
// kCma: the target copies straight into or out of the initiator's address space
// (process_vm_readv/writev), the initiator sends its addresses.
enum class DataMode : uint8_t { kInline = 0, kCma = 1 };

struct FrameHeader {
    FrameType type = FrameType::kError;
    uint16_t flags = 0;
    uint32_t body_len = 0;
    uint64_t request_id = 0;
    uint64_t payload_len = 0;
};

void EncodeHeader(const FrameHeader& h, char out[kHeaderSize]);
// Checks magic, version, type and bounds. InvalidArgument says which.
Result<FrameHeader> DecodeHeader(std::string_view bytes);

// Header + body as one string, ready to send.
std::string MakeFrame(FrameType type, uint64_t request_id, std::string_view body,
                      uint64_t payload_len = 0);

// --- Handshake ------------------------------------------------------------------------------
enum class Purpose : uint8_t { kData = 0, kSideChannel = 1 };

struct Hello {
    std::string name;
    uint64_t epoch = 0;
    Nonce nonce{};
    Purpose purpose = Purpose::kData;
    uint8_t wants_auth = 0;  // the client has a secret and will demand the server's proof
    // cma: an address in the client holding probe_value, read by the server to prove it may.
    uint64_t probe_addr = 0;
    uint64_t probe_value = 0;
};
std::string EncodeHello(const Hello& m);
Result<Hello> DecodeHello(std::string_view body);

struct HelloAck {
    std::string name;
    uint64_t epoch = 0;
    Nonce nonce{};
    uint8_t auth_required = 0;
    Digest proof{};  // HMAC(secret, "ferry-server" | client nonce | server nonce) when required
};
std::string EncodeHelloAck(const HelloAck& m);
Result<HelloAck> DecodeHelloAck(std::string_view body);

// Proofs bind both nonces and the direction, so a proof can be neither replayed nor reflected.
Digest ServerProof(std::string_view secret, const Nonce& client, const Nonce& server);
Digest ClientProof(std::string_view secret, const Nonce& client, const Nonce& server);

// --- Requests -------------------------------------------------------------------------------
struct Segment {
    uint64_t region = 0;
    uint64_t key = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
};
inline constexpr size_t kSegmentWireSize = 32;

// kCma: an agent-allocated (memfd) region of the initiator that the target may map instead of
// attaching per call. The target opens /proc/<pid>/fd/<fd>, checks the inode, maps it once.
struct SharedRegion {
    uint64_t share_id = 0;  // random per region: the mapping cache key
    uint32_t fd = 0;        // the memfd's number in the initiator
    uint64_t inode = 0;
    uint64_t base = 0;  // where the initiator has it mapped
    uint64_t length = 0;
};
inline constexpr uint32_t kMaxSharesPerFrame = 64;

struct DataRequest {
    DataMode mode = DataMode::kInline;
    std::vector<Segment> segments;
    std::vector<iovec> initiator_iov;  // kCma only: the initiator's memory, same total length
    std::vector<SharedRegion> shares;  // kCma only: regions holding some of initiator_iov
    uint64_t TotalLength() const;
};
std::string EncodeDataRequest(const DataRequest& r);
Result<DataRequest> DecodeDataRequest(std::string_view body);

struct PullRequest {
    std::string key;
    uint64_t capacity = 0;
    DataMode mode = DataMode::kInline;
    std::vector<iovec> initiator_iov;  // kCma only, capacity bytes in all
    std::vector<SharedRegion> shares;  // kCma only
};
std::string EncodePullRequest(const PullRequest& r);
Result<PullRequest> DecodePullRequest(std::string_view body);

// kMapRegion: the initiator asks to map a target region and copy in and out of it itself.
struct MapRequest {
    uint64_t region = 0;
    uint64_t key = 0;
};
std::string EncodeMapRequest(const MapRequest& r);
Result<MapRequest> DecodeMapRequest(std::string_view body);
// kRegionGrant body: the target's region as a SharedRegion (base is the target's address).
std::string EncodeRegionGrant(const SharedRegion& r);
Result<SharedRegion> DecodeRegionGrant(std::string_view body);

struct Response {
    Code code = Code::kOk;
    std::string message;
    uint64_t value = 0;  // pull: the object size
};
std::string EncodeResponse(const Response& r);
Result<Response> DecodeResponse(std::string_view body);

}  // namespace ferry::wire
