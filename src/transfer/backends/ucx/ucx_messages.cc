#include "transfer/backends/ucx/ucx_messages.h"

#include <cstdio>

#include "core/bytes.h"
#include "core/crypto.h"

namespace ferry::ucx {

namespace {

void Put(ByteWriter& w, const Envelope& e) {
    w.U64(e.token);
    w.U64(e.proof);
}

void Put(ByteWriter& w, const RequestHead& h) {
    Put(w, h.to);
    w.U64(h.initiator);
    w.U64(h.request_id);
}

bool Get(ByteReader& r, Envelope* e) { return r.U64(&e->token) && r.U64(&e->proof); }

bool Get(ByteReader& r, RequestHead* h) {
    return Get(r, &h->to) && r.U64(&h->initiator) && r.U64(&h->request_id);
}

// The decoded value, or the reader's error (a missing field, or bytes after the last one).
template <typename T>
Result<T> Done(ByteReader& r, T value) {
    Status s = r.Finish();
    if (!s.ok()) return s;
    return value;
}

}  // namespace

std::string_view AmName(uint16_t am) {
    switch (am) {
        case kAmWrite:
            return "write";
        case kAmRead:
            return "read";
        case kAmPull:
            return "pull";
        case kAmNotify:
            return "notify";
        case kAmReply:
            return "reply";
        case kAmHello:
            return "hello";
        case kAmBye:
            return "bye";
        case kAmGrant:
            return "grant";
        case kAmRevoke:
            return "revoke";
        case kAmRevokeAck:
            return "revoke-ack";
        default:
            return "unknown";
    }
}

uint64_t DataRequest::TotalLength() const {
    uint64_t n = 0;
    for (const wire::Segment& s : segments) n += s.length;
    return n;
}

std::string Encode(const Announce& m) {
    ByteWriter w;
    Put(w, m.to);
    w.U64(m.initiator);
    w.U64(m.generation);
    return w.Take();
}

std::string Encode(const Revoke& m, bool ack) {
    ByteWriter w;
    Put(w, m.to);
    w.U64(m.sender);
    w.U64(m.revocation);
    if (!ack) w.U64(m.region);
    return w.Take();
}

std::string Encode(const NotifyHeader& m) {
    ByteWriter w;
    Put(w, m.to);
    w.Str(m.sender);
    return w.Take();
}

std::string Encode(const DataRequest& m) {
    ByteWriter w;
    Put(w, m.head);
    w.U32(static_cast<uint32_t>(m.segments.size()));
    for (const wire::Segment& s : m.segments) {
        w.U64(s.region);
        w.U64(s.key);
        w.U64(s.offset);
        w.U64(s.length);
    }
    return w.Take();
}

std::string Encode(const GrantRequest& m) {
    ByteWriter w;
    Put(w, m.head);
    w.U64(m.region);
    w.U64(m.key);
    return w.Take();
}

std::string Encode(const PullRequest& m) {
    ByteWriter w;
    Put(w, m.head);
    w.U64(m.capacity);
    w.Str(m.key);
    return w.Take();
}

std::string Encode(const Reply& m) {
    ByteWriter w;
    w.U64(m.request_id);
    w.U64(m.proof);
    w.U8(static_cast<uint8_t>(m.code));
    w.U64(m.value);
    w.Str(std::string_view(m.message).substr(0, wire::kMaxMessageLen));
    return w.Take();
}

std::string Encode(const GrantAnswer& m) {
    ByteWriter w;
    w.U64(m.address);
    w.U64(m.length);
    w.Raw(m.rkey.data(), m.rkey.size());
    return w.Take();
}

Result<Envelope> DecodeEnvelope(std::string_view header) {
    ByteReader r(header, "ucx message envelope");
    Envelope e;
    if (!Get(r, &e)) return r.error();
    return e;
}

Result<Announce> DecodeAnnounce(std::string_view header) {
    ByteReader r(header, "ucx announcement");
    Announce m;
    (void)(Get(r, &m.to) && r.U64(&m.initiator) && r.U64(&m.generation));
    return Done(r, std::move(m));
}

Result<Revoke> DecodeRevoke(std::string_view header, bool ack) {
    ByteReader r(header, ack ? "ucx revocation acknowledgement" : "ucx revocation");
    Revoke m;
    (void)(Get(r, &m.to) && r.U64(&m.sender) && r.U64(&m.revocation) && (ack || r.U64(&m.region)));
    return Done(r, std::move(m));
}

Result<NotifyHeader> DecodeNotify(std::string_view header) {
    ByteReader r(header, "ucx notification");
    NotifyHeader m;
    (void)(Get(r, &m.to) && r.Str(&m.sender, wire::kMaxNameLen));
    return Done(r, std::move(m));
}

Result<RequestHead> DecodeRequestHead(std::string_view header) {
    ByteReader r(header, "ucx request");
    RequestHead h;
    if (!Get(r, &h)) return r.error();
    return h;
}

Result<DataRequest> DecodeDataRequest(std::string_view header) {
    ByteReader r(header, "ucx data request");
    DataRequest m;
    uint32_t n = 0;
    if (Get(r, &m.head) && r.Count(&n, wire::kMaxSegmentsPerFrame, kSegmentBytes)) {
        m.segments.resize(n);
        for (wire::Segment& s : m.segments) {
            if (!r.U64(&s.region) || !r.U64(&s.key) || !r.U64(&s.offset) || !r.U64(&s.length)) {
                break;
            }
        }
    }
    return Done(r, std::move(m));
}

Result<GrantRequest> DecodeGrantRequest(std::string_view header) {
    ByteReader r(header, "ucx grant request");
    GrantRequest m;
    (void)(Get(r, &m.head) && r.U64(&m.region) && r.U64(&m.key));
    return Done(r, std::move(m));
}

Result<PullRequest> DecodePullRequest(std::string_view header) {
    ByteReader r(header, "ucx pull request");
    PullRequest m;
    (void)(Get(r, &m.head) && r.U64(&m.capacity) && r.Str(&m.key, wire::kMaxKeyLen));
    return Done(r, std::move(m));
}

Status DecodeReplyHead(std::string_view header, uint64_t* request_id, uint64_t* proof) {
    ByteReader r(header, "ucx reply");
    if (!r.U64(request_id) || !r.U64(proof)) return r.error();
    return Status::Ok();
}

Result<Reply> DecodeReply(std::string_view header) {
    ByteReader r(header, "ucx reply");
    Reply m;
    uint8_t code = 0;
    (void)(r.U64(&m.request_id) && r.U64(&m.proof) && r.U8(&code) && r.U64(&m.value) &&
           r.Str(&m.message, wire::kMaxMessageLen));
    if (r.error().ok() && code > static_cast<uint8_t>(Code::kDataLoss)) {
        return InvalidArgumentError("ucx reply: status code " + std::to_string(code) +
                                    " is not a ferry status code");
    }
    m.code = static_cast<Code>(code);
    return Done(r, std::move(m));
}

Result<GrantAnswer> DecodeGrantAnswer(std::string_view data) {
    if (data.size() <= kGrantAnswerFixed || data.size() > kGrantAnswerFixed + kMaxPackedRkey) {
        return InvalidArgumentError("ucx grant answer of " + std::to_string(data.size()) +
                                    " bytes (" + std::to_string(kGrantAnswerFixed + 1) + ".." +
                                    std::to_string(kGrantAnswerFixed + kMaxPackedRkey) +
                                    " expected)");
    }
    ByteReader r(data.substr(0, kGrantAnswerFixed), "ucx grant answer");
    GrantAnswer m;
    (void)(r.U64(&m.address) && r.U64(&m.length));
    m.rkey = std::string(data.substr(kGrantAnswerFixed));
    return Done(r, std::move(m));
}

std::string FormatAddress(std::string_view worker, uint64_t token) {
    char tok[17];
    std::snprintf(tok, sizeof tok, "%016llx", static_cast<unsigned long long>(token));
    return HexEncode(reinterpret_cast<const uint8_t*>(worker.data()), worker.size()) + "." + tok;
}

Status ParseAddress(std::string_view address, std::string* worker, uint64_t* token) {
    size_t dot = address.rfind('.');
    std::string tok;
    if (dot == std::string_view::npos || address.size() - dot - 1 != 16 ||
        !HexDecode(address.substr(0, dot), worker) || worker->empty() ||
        !HexDecode(address.substr(dot + 1), &tok)) {
        return InvalidArgumentError("ucx endpoint address '" + std::string(address.substr(0, 64)) +
                                    "' is not <hex worker address>.<16 hex digit token>");
    }
    *token = 0;
    for (char c : tok) *token = (*token << 8) | static_cast<uint8_t>(c);
    return Status::Ok();
}

}  // namespace ferry::ucx
