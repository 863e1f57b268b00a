// The ucx backend's active messages, as bytes: ids, header layouts, encoders and decoders. Pure
// code (no UCX), so the decoders of what peers send can be unit-tested and fuzzed
// (fuzz/ucx_messages_fuzzer.cc) without a worker.
//
// Every message to a target starts with an envelope: the receiver's endpoint token (random per
// process, published with its worker address) and, with a deployment secret, the proof of it
// (an HMAC only deployment members can compute; 0 without a secret). All integers are little
// endian; strings are u32 length + bytes. Layouts (after the envelope):
//   kHello, kBye        initiator token, generation (kHello's data: the initiator's worker address)
//   kRevoke             sender token, revocation id, region          (no data)
//   kRevokeAck          sender token, revocation id                  (no data)
//   kNotify             sender agent name (str)                      (data: the payload)
//   kWrite, kRead       initiator token, request id, u32 n, n x {region, key, offset, length}
//                       (kWrite's data: the bytes of the segments, in order)
//   kGrant              initiator token, request id, region, key     (no data)
//   kPull               initiator token, request id, capacity, key (str)
// A reply (kReply, target -> initiator) has no envelope: request id, proof of the initiator's
// token, u8 status code, u64 value, message (str); its data: the bytes read, the object pulled or
// a grant answer (address, length, packed rkey).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "transfer/wire.h"

namespace ferry::ucx {

enum Am : uint16_t {
    kAmWrite = 1,
    kAmRead = 2,
    kAmPull = 3,
    kAmNotify = 4,
    kAmReply = 5,
    kAmHello = 6,   // an initiator's worker address: the target answers on an endpoint of its own
    kAmBye = 7,     // the initiator closed that endpoint: the target closes its own
    kAmGrant = 8,   // one-sided access to a region: answered with its address, length and rkey
    kAmRevoke = 9,  // target -> grantee: let go of a region (Deregister)
    kAmRevokeAck = 10  // grantee -> target: done with it
};
inline constexpr uint16_t kAmLast = kAmRevokeAck;
std::string_view AmName(uint16_t am);

inline constexpr size_t kSegmentBytes = 32;
// The fixed part of a data request's header: envelope, initiator, request id, segment count.
inline constexpr size_t kRequestHeaderFixed = 8 * 4 + 4;
// The largest packed rkey a grant answer may carry.
inline constexpr size_t kMaxPackedRkey = 4096;
inline constexpr size_t kGrantAnswerFixed = 16;

struct Envelope {
    uint64_t token = 0;  // the receiver's
    uint64_t proof = 0;
    bool operator==(const Envelope&) const = default;
};

struct Announce {  // kHello, kBye
    Envelope to;
    uint64_t initiator = 0;
    uint64_t generation = 0;
    bool operator==(const Announce&) const = default;
};

struct Revoke {  // kRevoke, kRevokeAck (region 0)
    Envelope to;
    uint64_t sender = 0;
    uint64_t revocation = 0;
    uint64_t region = 0;
    bool operator==(const Revoke&) const = default;
};

struct NotifyHeader {  // kNotify
    Envelope to;
    std::string sender;
    bool operator==(const NotifyHeader&) const = default;
};

// What every request that gets a reply starts with.
struct RequestHead {
    Envelope to;
    uint64_t initiator = 0;
    uint64_t request_id = 0;
    bool operator==(const RequestHead&) const = default;
};

struct DataRequest {  // kWrite, kRead
    RequestHead head;
    std::vector<wire::Segment> segments;
    uint64_t TotalLength() const;
};

struct GrantRequest {  // kGrant
    RequestHead head;
    uint64_t region = 0;
    uint64_t key = 0;
    bool operator==(const GrantRequest&) const = default;
};

struct PullRequest {  // kPull
    RequestHead head;
    uint64_t capacity = 0;
    std::string key;
    bool operator==(const PullRequest&) const = default;
};

struct Reply {  // kReply
    uint64_t request_id = 0;
    uint64_t proof = 0;
    Code code = Code::kOk;
    uint64_t value = 0;
    std::string message;
    bool operator==(const Reply&) const = default;
};

struct GrantAnswer {  // a kGrant reply's data
    uint64_t address = 0;
    uint64_t length = 0;
    std::string rkey;  // packed
    bool operator==(const GrantAnswer&) const = default;
};

std::string Encode(const Announce& m);
std::string Encode(const Revoke& m, bool ack);
std::string Encode(const NotifyHeader& m);
std::string Encode(const DataRequest& m);
std::string Encode(const GrantRequest& m);
std::string Encode(const PullRequest& m);
std::string Encode(const Reply& m);
std::string Encode(const GrantAnswer& m);

// Each decoder takes the whole header and wants all of it (nothing missing, nothing after);
// an error says what was wrong.
Result<Envelope> DecodeEnvelope(std::string_view header);
Result<Announce> DecodeAnnounce(std::string_view header);
Result<Revoke> DecodeRevoke(std::string_view header, bool ack);
Result<NotifyHeader> DecodeNotify(std::string_view header);
// Only the head of a request with a reply (the rest may still be malformed).
Result<RequestHead> DecodeRequestHead(std::string_view header);
Result<DataRequest> DecodeDataRequest(std::string_view header);
Result<GrantRequest> DecodeGrantRequest(std::string_view header);
Result<PullRequest> DecodePullRequest(std::string_view header);
// The request id and proof only: enough to find the request it answers.
Status DecodeReplyHead(std::string_view header, uint64_t* request_id, uint64_t* proof);
Result<Reply> DecodeReply(std::string_view header);
Result<GrantAnswer> DecodeGrantAnswer(std::string_view data);

// "<hex worker address>.<16 hex digits token>"
std::string FormatAddress(std::string_view worker, uint64_t token);
Status ParseAddress(std::string_view address, std::string* worker, uint64_t* token);

}  // namespace ferry::ucx
