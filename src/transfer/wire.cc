#include "transfer/wire.h"

#include <fmt/core.h>

#include "core/bytes.h"

namespace ferry::wire {
namespace {

constexpr uint8_t kMaxFrameType = static_cast<uint8_t>(FrameType::kRegionGrant);
constexpr uint32_t kMaxIovecs = kMaxSegmentsPerFrame;

void PutIovecs(ByteWriter& w, const std::vector<iovec>& iov) {
    w.U32(static_cast<uint32_t>(iov.size()));
    for (const iovec& v : iov) {
        w.U64(reinterpret_cast<uint64_t>(v.iov_base));
        w.U64(v.iov_len);
    }
}

bool GetIovecs(ByteReader& r, std::vector<iovec>* iov) {
    uint32_t n = 0;
    if (!r.Count(&n, kMaxIovecs, 16)) {
        return false;
    }
    iov->resize(n);
    for (iovec& v : *iov) {
        uint64_t addr = 0;
        uint64_t len = 0;
        if (!r.U64(&addr) || !r.U64(&len)) {
            return false;
        }
        v.iov_base = reinterpret_cast<void*>(addr);
        v.iov_len = len;
    }
    return true;
}

void PutShares(ByteWriter& w, const std::vector<SharedRegion>& shares) {
    w.U32(static_cast<uint32_t>(shares.size()));
    for (const SharedRegion& s : shares) {
        w.U64(s.share_id);
        w.U32(s.fd);
        w.U64(s.inode);
        w.U64(s.base);
        w.U64(s.length);
    }
}

bool GetShares(ByteReader& r, std::vector<SharedRegion>* shares) {
    uint32_t n = 0;
    if (!r.Count(&n, kMaxSharesPerFrame, 36)) {
        return false;
    }
    shares->resize(n);
    for (SharedRegion& s : *shares) {
        if (!r.U64(&s.share_id) || !r.U32(&s.fd) || !r.U64(&s.inode) || !r.U64(&s.base) ||
            !r.U64(&s.length)) {
            return false;
        }
    }
    return true;
}

bool GetMode(ByteReader& r, DataMode* mode) {
    uint8_t m = 0;
    if (!r.U8(&m)) {
        return false;
    }
    if (m > static_cast<uint8_t>(DataMode::kCma)) {
        r.SetError(InvalidArgumentError("unknown data mode " + std::to_string(m)));
        return false;
    }
    *mode = static_cast<DataMode>(m);
    return true;
}

// Sum of lengths, or false on overflow or past kMaxPayload * many frames (a lie).
bool SumIovecs(const std::vector<iovec>& iov, uint64_t* total) {
    uint64_t t = 0;
    for (const iovec& v : iov) {
        if (v.iov_len > kMaxPayload || t + v.iov_len < t) {
            return false;
        }
        t += v.iov_len;
    }
    *total = t;
    return true;
}

}  // namespace

std::string_view FrameTypeName(FrameType t) {
    switch (t) {
        case FrameType::kHello:
            return "hello";
        case FrameType::kHelloAck:
            return "hello-ack";
        case FrameType::kAuth:
            return "auth";
        case FrameType::kReady:
            return "ready";
        case FrameType::kGetMetadata:
            return "get-metadata";
        case FrameType::kMetadata:
            return "metadata";
        case FrameType::kWrite:
            return "write";
        case FrameType::kRead:
            return "read";
        case FrameType::kResponse:
            return "response";
        case FrameType::kNotify:
            return "notify";
        case FrameType::kPull:
            return "pull";
        case FrameType::kError:
            return "error";
        case FrameType::kUnshare:
            return "unshare";
        case FrameType::kMapRegion:
            return "map-region";
        case FrameType::kRegionGrant:
            return "region-grant";
    }
    return "unknown";
}

void EncodeHeader(const FrameHeader& h, char out[kHeaderSize]) {
    ByteWriter w;
    w.U32(kMagic);
    w.U8(kVersion);
    w.U8(static_cast<uint8_t>(h.type));
    w.U16(h.flags);
    w.U32(h.body_len);
    w.U32(0);  // reserved
    w.U64(h.request_id);
    w.U64(h.payload_len);
    std::memcpy(out, w.buffer().data(), kHeaderSize);
}

Result<FrameHeader> DecodeHeader(std::string_view bytes) {
    ByteReader r(bytes.substr(0, kHeaderSize), "frame header");
    uint32_t magic = 0;
    uint8_t version = 0;
    uint8_t type = 0;
    uint32_t reserved = 0;
    FrameHeader h;
    if (!r.U32(&magic) || !r.U8(&version) || !r.U8(&type) || !r.U16(&h.flags) ||
        !r.U32(&h.body_len) || !r.U32(&reserved) || !r.U64(&h.request_id) ||
        !r.U64(&h.payload_len)) {
        return r.error();
    }
    if (magic != kMagic) {
        return InvalidArgumentError(
            fmt::format("frame header: bad magic 0x{:08x} (not a ferry peer?)", magic));
    }
    if (version != kVersion) {
        return InvalidArgumentError("frame header: unsupported protocol version " +
                                    std::to_string(version) + " (this side speaks " +
                                    std::to_string(kVersion) + ")");
    }
    if (type == 0 || type > kMaxFrameType) {
        return InvalidArgumentError("frame header: unknown frame type " + std::to_string(type));
    }
    h.type = static_cast<FrameType>(type);
    if (h.body_len > kMaxBody) {
        return InvalidArgumentError("frame header: body of " + std::to_string(h.body_len) +
                                    " bytes exceeds the limit of " + std::to_string(kMaxBody));
    }
    if (h.payload_len > kMaxPayload) {
        return InvalidArgumentError("frame header: payload of " + std::to_string(h.payload_len) +
                                    " bytes exceeds the limit of " + std::to_string(kMaxPayload));
    }
    if (h.payload_len > 0 && h.type != FrameType::kWrite && h.type != FrameType::kResponse) {
        return InvalidArgumentError(std::string("frame header: a ") +
                                    std::string(FrameTypeName(h.type)) +
                                    " frame cannot carry a payload");
    }
    return h;
}

std::string MakeFrame(FrameType type, uint64_t request_id, std::string_view body,
                      uint64_t payload_len) {
    std::string out(kHeaderSize, '\0');
    FrameHeader h{type, 0, static_cast<uint32_t>(body.size()), request_id, payload_len};
    EncodeHeader(h, out.data());
    out.append(body);
    return out;
}

std::string EncodeHello(const Hello& m) {
    ByteWriter w;
    w.Str(m.name);
    w.U64(m.epoch);
    w.Raw(m.nonce.data(), m.nonce.size());
    w.U8(static_cast<uint8_t>(m.purpose));
    w.U8(m.wants_auth);
    w.U64(m.probe_addr);
    w.U64(m.probe_value);
    return w.Take();
}

Result<Hello> DecodeHello(std::string_view body) {
    ByteReader r(body, "hello");
    Hello m;
    uint8_t purpose = 0;
    if (!r.Str(&m.name, kMaxNameLen) || !r.U64(&m.epoch) ||
        !r.Raw(m.nonce.data(), m.nonce.size()) || !r.U8(&purpose) || !r.U8(&m.wants_auth) ||
        !r.U64(&m.probe_addr) || !r.U64(&m.probe_value)) {
        return r.error();
    }
    if (purpose > static_cast<uint8_t>(Purpose::kSideChannel)) {
        return InvalidArgumentError("hello: unknown purpose " + std::to_string(purpose));
    }
    m.purpose = static_cast<Purpose>(purpose);
    FERRY_RETURN_IF_ERROR(r.Finish());
    return m;
}

std::string EncodeHelloAck(const HelloAck& m) {
    ByteWriter w;
    w.Str(m.name);
    w.U64(m.epoch);
    w.Raw(m.nonce.data(), m.nonce.size());
    w.U8(m.auth_required);
    w.Raw(m.proof.data(), m.proof.size());
    return w.Take();
}

Result<HelloAck> DecodeHelloAck(std::string_view body) {
    ByteReader r(body, "hello-ack");
    HelloAck m;
    if (!r.Str(&m.name, kMaxNameLen) || !r.U64(&m.epoch) ||
        !r.Raw(m.nonce.data(), m.nonce.size()) || !r.U8(&m.auth_required) ||
        !r.Raw(m.proof.data(), m.proof.size())) {
        return r.error();
    }
    FERRY_RETURN_IF_ERROR(r.Finish());
    return m;
}

namespace {
Digest Proof(std::string_view label, std::string_view secret, const Nonce& c, const Nonce& s) {
    std::string data(label);
    data.append(reinterpret_cast<const char*>(c.data()), c.size());
    data.append(reinterpret_cast<const char*>(s.data()), s.size());
    return HmacSha256(secret, data);
}
}  // namespace

Digest ServerProof(std::string_view secret, const Nonce& client, const Nonce& server) {
    return Proof("ferry-server-v1", secret, client, server);
}
Digest ClientProof(std::string_view secret, const Nonce& client, const Nonce& server) {
    return Proof("ferry-client-v1", secret, client, server);
}

uint64_t DataRequest::TotalLength() const {
    uint64_t t = 0;
    for (const Segment& s : segments) {
        t += s.length;
    }
    return t;
}

std::string EncodeDataRequest(const DataRequest& r) {
    ByteWriter w;
    w.U8(static_cast<uint8_t>(r.mode));
    w.U32(static_cast<uint32_t>(r.segments.size()));
    for (const Segment& s : r.segments) {
        w.U64(s.region);
        w.U64(s.key);
        w.U64(s.offset);
        w.U64(s.length);
    }
    if (r.mode == DataMode::kCma) {
        PutIovecs(w, r.initiator_iov);
        PutShares(w, r.shares);
    }
    return w.Take();
}

Result<DataRequest> DecodeDataRequest(std::string_view body) {
    ByteReader r(body, "data request");
    DataRequest req;
    uint32_t n = 0;
    if (!GetMode(r, &req.mode) || !r.Count(&n, kMaxSegmentsPerFrame, kSegmentWireSize)) {
        return r.error();
    }
    req.segments.resize(n);
    uint64_t total = 0;
    for (Segment& s : req.segments) {
        if (!r.U64(&s.region) || !r.U64(&s.key) || !r.U64(&s.offset) || !r.U64(&s.length)) {
            return r.error();
        }
        if (s.length == 0 || s.length > kMaxPayload) {
            return InvalidArgumentError("data request: segment length " + std::to_string(s.length) +
                                        " outside 1.." + std::to_string(kMaxPayload));
        }
        total += s.length;
        if (total > kMaxPayload) {
            return InvalidArgumentError("data request: segments total more than " +
                                        std::to_string(kMaxPayload) + " bytes");
        }
    }
    if (req.mode == DataMode::kCma) {
        if (!GetIovecs(r, &req.initiator_iov) || !GetShares(r, &req.shares)) {
            return r.error();
        }
        uint64_t itotal = 0;
        if (!SumIovecs(req.initiator_iov, &itotal) || itotal != total) {
            return InvalidArgumentError("data request: initiator buffers do not cover the " +
                                        std::to_string(total) + " bytes of its segments");
        }
    }
    FERRY_RETURN_IF_ERROR(r.Finish());
    return req;
}

std::string EncodePullRequest(const PullRequest& r) {
    ByteWriter w;
    w.Str(r.key);
    w.U64(r.capacity);
    w.U8(static_cast<uint8_t>(r.mode));
    if (r.mode == DataMode::kCma) {
        PutIovecs(w, r.initiator_iov);
        PutShares(w, r.shares);
    }
    return w.Take();
}

Result<PullRequest> DecodePullRequest(std::string_view body) {
    ByteReader r(body, "pull request");
    PullRequest req;
    if (!r.Str(&req.key, kMaxKeyLen) || !r.U64(&req.capacity) || !GetMode(r, &req.mode)) {
        return r.error();
    }
    if (req.key.empty()) {
        return InvalidArgumentError("pull request: empty key");
    }
    if (req.mode == DataMode::kCma) {
        if (!GetIovecs(r, &req.initiator_iov) || !GetShares(r, &req.shares)) {
            return r.error();
        }
        uint64_t itotal = 0;
        if (!SumIovecs(req.initiator_iov, &itotal) || itotal != req.capacity) {
            return InvalidArgumentError(
                "pull request: initiator buffers do not cover its "
                "capacity of " +
                std::to_string(req.capacity) + " bytes");
        }
    }
    FERRY_RETURN_IF_ERROR(r.Finish());
    return req;
}

std::string EncodeResponse(const Response& r) {
    ByteWriter w;
    w.U8(static_cast<uint8_t>(r.code));
    w.Str(r.message.size() > kMaxMessageLen ? r.message.substr(0, kMaxMessageLen) : r.message);
    w.U64(r.value);
    return w.Take();
}

std::string EncodeMapRequest(const MapRequest& m) {
    ByteWriter w;
    w.U64(m.region);
    w.U64(m.key);
    return w.Take();
}

Result<MapRequest> DecodeMapRequest(std::string_view body) {
    ByteReader r(body, "map-region request");
    MapRequest m;
    if (!r.U64(&m.region) || !r.U64(&m.key)) {
        return r.error();
    }
    FERRY_RETURN_IF_ERROR(r.Finish());
    return m;
}

std::string EncodeRegionGrant(const SharedRegion& g) {
    ByteWriter w;
    PutShares(w, {g});
    return w.Take();
}

Result<SharedRegion> DecodeRegionGrant(std::string_view body) {
    ByteReader r(body, "region grant");
    std::vector<SharedRegion> shares;
    if (!GetShares(r, &shares)) {
        return r.error();
    }
    FERRY_RETURN_IF_ERROR(r.Finish());
    if (shares.size() != 1 || shares[0].length == 0) {
        return InvalidArgumentError("region grant: expected one region of nonzero length");
    }
    return shares[0];
}

Result<Response> DecodeResponse(std::string_view body) {
    ByteReader r(body, "response");
    Response resp;
    uint8_t code = 0;
    if (!r.U8(&code) || !r.Str(&resp.message, kMaxMessageLen) || !r.U64(&resp.value)) {
        return r.error();
    }
    if (code > static_cast<uint8_t>(Code::kDataLoss)) {
        return InvalidArgumentError("response: unknown status code " + std::to_string(code));
    }
    resp.code = static_cast<Code>(code);
    FERRY_RETURN_IF_ERROR(r.Finish());
    return resp;
}

}  // namespace ferry::wire
