#include "transfer/stream_target.h"

#include "core/log.h"

namespace ferry::internal {

OutFrame StreamTarget::ResponseFrame(uint64_t request_id, const Status& s, uint64_t value) {
    OutFrame f;
    f.head = wire::MakeFrame(wire::FrameType::kResponse, request_id,
                             wire::EncodeResponse({s.code(), s.message(), value}));
    return f;
}

void StreamTarget::Respond(Connection& conn, uint64_t request_id, const Status& s, uint64_t value) {
    conn.SendNow(ResponseFrame(request_id, s, value));
}

void StreamTarget::ServeData(Connection& conn, const wire::FrameHeader& h, std::string_view body) {
    bool write = h.type == wire::FrameType::kWrite;
    Result<wire::DataRequest> req = wire::DecodeDataRequest(body);
    if (!req.ok()) {
        conn.Close(InvalidArgumentError("malformed " + std::string(write ? "write" : "read") +
                                        " request from " + conn.peer_name() + ": " +
                                        req.status().message()));
        return;
    }
    bool inline_mode = req->mode == wire::DataMode::kInline;
    uint64_t expected_payload = write && inline_mode ? req->TotalLength() : 0;
    if (h.payload_len != expected_payload) {
        conn.Close(InvalidArgumentError(
            "request from " + conn.peer_name() + " carries " + std::to_string(h.payload_len) +
            " payload bytes for segments of " + std::to_string(expected_payload)));
        return;
    }
    std::vector<RegionPin> pins;
    std::vector<iovec> iov;
    FileStaging staging;
    Status s = target_.PinSegments(req->segments, write, &pins, &iov, &staging);
    uint64_t id = h.request_id;
    if (!s.ok()) {
        FERRY_LOG(kInfo, "refusing {} from {}: {}", write ? "write" : "read", conn.peer_name(),
                  s.ToString());
    }
    if (!inline_mode) {
        if (shutting_down_.load()) {
            return;  // the stream is about to close; the initiator sees Unavailable
        }
        if (s.ok() && conn.cma_pid() == 0) {
            s = FailedPreconditionError("cma transfer on a stream without a verified peer");
        }
        if (s.ok() && !conn.PeerStillThere()) {
            return;  // the initiator hung up (cancelled): do not touch its memory
        }
        // File bytes are staged: read before the copy to the initiator, written after the copy
        // from it (on this loop thread, like the copy itself).
        if (s.ok() && !write && !staging.empty()) {
            s = target_.MoveStaged(staging, /*to_file=*/false);
        }
        if (s.ok()) {
            s = peer_memory_.Copy(conn.cma_pid(), iov, req->initiator_iov, req->shares,
                                  /*to_peer=*/!write);
        }
        if (s.ok() && write && !staging.empty()) {
            s = target_.MoveStaged(staging, /*to_file=*/true);
        }
        pins.clear();
        Respond(conn, id, s);
        return;
    }
    if (s.ok() && !staging.empty()) {
        ServeStaged(conn, id, *req, write, std::move(pins), std::move(iov), std::move(staging));
        return;
    }
    if (write) {
        PayloadSink sink;
        if (s.ok()) {
            sink.iov = std::move(iov);
            sink.pins = std::move(pins);
        }
        std::weak_ptr<Connection> weak = conn.shared_from_this();
        sink.done = [weak, id, s](const Status& st) {
            auto c = weak.lock();
            if (c && st.ok()) Respond(*c, id, s);
        };
        conn.SetPayloadSink(std::move(sink));
        return;
    }
    // Inline read: the response carries the bytes straight from the region.
    if (!s.ok()) {
        Respond(conn, id, s);
        return;
    }
    OutFrame f;
    f.head = wire::MakeFrame(wire::FrameType::kResponse, id, wire::EncodeResponse({}),
                             req->TotalLength());
    f.if_revoked = wire::MakeFrame(
        wire::FrameType::kResponse, id,
        wire::EncodeResponse({Code::kNotFound, "region deregistered during the read", 0}));
    f.payload = std::move(iov);
    f.pins = std::move(pins);
    conn.SendNow(std::move(f));
}

void StreamTarget::ServeStaged(Connection& conn, uint64_t request_id, const wire::DataRequest& req,
                               bool write, std::vector<RegionPin> pins, std::vector<iovec> iov,
                               FileStaging staging) {
    FileEngine* files = files_.Get();
    std::weak_ptr<Connection> weak = conn.shared_from_this();
    // The pins stay with the file I/O: a Deregister of the file region waits for it.
    struct State {
        std::vector<RegionPin> pins;
        std::vector<iovec> iov;
        FileStaging staging;
    };
    auto st = std::make_shared<State>();
    st->staging = std::move(staging);
    st->iov = iov;
    if (write) {
        // The payload lands in the staging buffer (and in memory regions); then the file write.
        PayloadSink sink;
        sink.iov = std::move(iov);
        sink.pins = std::move(pins);  // for Deregister's check of stalled streams
        for (const RegionPin& p : sink.pins) {
            if (p.entry()->kind == MemoryKind::kFile) {
                Result<RegionPin> again = regions_.PinLocal(p.entry()->id);
                if (again.ok()) st->pins.push_back(std::move(*again));
            }
        }
        sink.done = [files, weak, request_id, st](const Status& received) {
            if (!received.ok()) return;  // the stream closed: no one to answer
            for (FileIo& io : st->staging.ios) io.to_file = true;
            files->Submit(st->staging.ios, [weak, request_id, st](const Status& s) {
                st->pins.clear();
                if (auto c = weak.lock()) c->Send(ResponseFrame(request_id, s));
            });
        };
        conn.SetPayloadSink(std::move(sink));
        return;
    }
    st->pins = std::move(pins);
    const uint64_t total = req.TotalLength();
    files->Submit(st->staging.ios, [weak, request_id, st, total](const Status& s) {
        auto c = weak.lock();
        if (!c) return;
        if (!s.ok()) {
            st->pins.clear();
            c->Send(ResponseFrame(request_id, s));
            return;
        }
        OutFrame f;
        f.head = wire::MakeFrame(wire::FrameType::kResponse, request_id, wire::EncodeResponse({}),
                                 total);
        f.if_revoked = wire::MakeFrame(
            wire::FrameType::kResponse, request_id,
            wire::EncodeResponse({Code::kNotFound, "region deregistered during the read", 0}));
        f.payload = st->iov;
        f.pins = std::move(st->pins);
        f.keep = st->staging.buffer;
        c->Send(std::move(f));
    });
}

void StreamTarget::ServePull(Connection& conn, const wire::FrameHeader& h, std::string_view body) {
    Result<wire::PullRequest> req = wire::DecodePullRequest(body);
    if (!req.ok()) {
        conn.Close(InvalidArgumentError("malformed pull request from " + conn.peer_name() + ": " +
                                        req.status().message()));
        return;
    }
    std::vector<RegionPin> pins;
    std::vector<iovec> iov;
    uint64_t size = 0;
    Status s = target_.ResolveObject(req->key, &pins, &iov, &size);
    if (!s.ok()) {
        Respond(conn, h.request_id, s);
        return;
    }
    if (size > req->capacity) {
        Respond(conn, h.request_id, Status::Ok(), size);  // too small: just the size
        return;
    }
    if (req->mode == wire::DataMode::kCma) {
        if (conn.cma_pid() == 0) {
            s = FailedPreconditionError("cma pull on a stream without a verified peer");
        } else if (!conn.PeerStillThere()) {
            return;
        } else {
            s = peer_memory_.Copy(conn.cma_pid(), iov, req->initiator_iov, req->shares,
                                  /*to_peer=*/true);
        }
        Respond(conn, h.request_id, s, size);
        return;
    }
    OutFrame f;
    f.head = wire::MakeFrame(wire::FrameType::kResponse, h.request_id,
                             wire::EncodeResponse({Code::kOk, "", size}), size);
    f.if_revoked = wire::MakeFrame(
        wire::FrameType::kResponse, h.request_id,
        wire::EncodeResponse({Code::kNotFound, "object's region deregistered during the pull", 0}));
    f.payload = std::move(iov);
    f.pins = std::move(pins);
    conn.SendNow(std::move(f));
}

void StreamTarget::ServeMapRegion(Connection& conn, const wire::FrameHeader& h,
                                  std::string_view body) {
    Result<wire::MapRequest> req = wire::DecodeMapRequest(body);
    if (!req.ok()) {
        conn.Close(InvalidArgumentError("malformed map-region request from " + conn.peer_name() +
                                        ": " + req.status().message()));
        return;
    }
    if (conn.cma_pid() == 0) {
        Respond(conn, h.request_id,
                FailedPreconditionError("map-region needs a verified shm stream"));
        return;
    }
    Result<RegionPin> pin = regions_.PinRemote(req->region, req->key, 0, 0);
    if (!pin.ok()) {
        Respond(conn, h.request_id, pin.status());
        return;
    }
    const RegionEntry& e = *pin->entry();
    if (e.memfd < 0) {
        Respond(conn, h.request_id,
                FailedPreconditionError("region " + std::to_string(e.id) +
                                        " is registered memory, not shareable: the target copies"));
        return;
    }
    // Recorded while pinned: a Deregister waits for the pin, then revokes this grant too.
    peer_memory_.RecordGrant(e.share_id, conn.shared_from_this());
    OutFrame f;
    f.head = wire::MakeFrame(wire::FrameType::kRegionGrant, h.request_id,
                             wire::EncodeRegionGrant(ShareOf(e)));
    conn.SendNow(std::move(f));
}

}  // namespace ferry::internal
