#include "transfer/responses.h"

#include <algorithm>
#include <string>
#include <utility>

namespace ferry::internal {

void Expectation::Fail(const Status& s) const {
    if (op) {
        op->ChunkDone(s);
    }
    if (callback) {
        callback(s, {});
    }
}

void PendingResponses::Expect(uint64_t id, Expectation e) { pending_.emplace(id, std::move(e)); }

std::unordered_map<uint64_t, Expectation> PendingResponses::TakeAll() {
    std::unordered_map<uint64_t, Expectation> all = std::move(pending_);
    pending_.clear();
    return all;
}

PendingResponses::Outcome PendingResponses::OnAnswer(const wire::FrameHeader& h,
                                                     std::string_view body,
                                                     const std::string& peer) {
    Outcome out;
    auto it = pending_.find(h.request_id);
    if (it == pending_.end()) {
        out.protocol_error = "response to unknown request " + std::to_string(h.request_id);
        return out;
    }
    Expectation e = std::move(it->second);
    pending_.erase(it);
    if (e.callback) {
        if (h.payload_len > 0) {
            e.callback(UnavailableError("protocol error"), {});
            out.protocol_error = "unexpected payload on a metadata response";
            return out;
        }
        if (h.type == wire::FrameType::kMetadata || h.type == wire::FrameType::kRegionGrant) {
            e.callback(Status::Ok(), body);
        } else {
            Result<wire::Response> r = wire::DecodeResponse(body);
            e.callback(r.ok() ? Status(r->code, r->message) : r.status(), {});
        }
        return out;
    }
    if (h.type != wire::FrameType::kResponse) {
        e.Fail(UnavailableError("protocol error"));
        out.protocol_error =
            std::string(wire::FrameTypeName(h.type)) + " frame answering a transfer";
        return out;
    }
    Result<wire::Response> r = wire::DecodeResponse(body);
    if (!r.ok()) {
        e.Fail(UnavailableError("malformed response from " + peer));
        out.protocol_error = r.status().message();
        return out;
    }
    Status s(r->code, r->code == Code::kOk ? "" : "target " + peer + ": " + r->message);
    if (h.payload_len > 0) {
        // Must be exactly what we asked for (a read) or the object size (a pull that fits).
        bool pull = e.op && e.op->kind() == TransferOp::Kind::kPull;
        bool fits = pull ? (r->value == h.payload_len && h.payload_len <= e.local_bytes)
                         : (h.payload_len == e.local_bytes);
        if (r->code != Code::kOk || e.cma || !fits) {
            e.Fail(DataLossError("target " + peer + " sent " + std::to_string(h.payload_len) +
                                 " payload bytes, expected " + std::to_string(e.local_bytes)));
            out.protocol_error = "payload length does not match the request";
            return out;
        }
        // Clip the destination to the payload (a pull may be shorter than the buffer).
        std::vector<iovec> dst;
        uint64_t left = h.payload_len;
        for (const iovec& v : e.local) {
            if (left == 0) break;
            size_t k = static_cast<size_t>(std::min<uint64_t>(left, v.iov_len));
            dst.push_back(iovec{v.iov_base, k});
            left -= k;
        }
        PayloadSink sink;
        sink.iov = std::move(dst);
        sink.op = e.op;
        uint64_t value = r->value;
        sink.done = [op = e.op, value](const Status& st) { op->ChunkDone(st, value); };
        out.has_sink = true;
        out.sink = std::move(sink);
        return out;
    }
    if (e.op) {
        e.op->ChunkDone(s, r->value);
    }
    return out;
}

}  // namespace ferry::internal
