// The requests a stream connection has sent and waits for answers to, and what each answer
// means: a response frame matched to its request by id, checked against what was asked (a
// payload of exactly the bytes a read asked for, or the object size of a pull that fits), and
// turned into the op's chunk completing, the metadata caller's callback, or where the payload
// that follows goes. Anything else from the peer is a protocol error the connection closes on.
// One table per connection, used on its loop thread only.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ferry/status.h"
#include "transfer/region_table.h"
#include "transfer/transfer_op.h"
#include "transfer/wire.h"

namespace ferry::internal {

// What a frame that expects an answer waits for.
struct Expectation {
    std::shared_ptr<TransferOp> op;  // the chunk of this op completes with the response
    std::vector<iovec> local;        // inline READ / PULL: where the response payload goes
    uint64_t local_bytes = 0;
    bool cma = false;  // the peer copies into `op`'s memory directly
    // Generic answer (metadata fetch): status, and the frame body when OK.
    std::function<void(const Status&, std::string_view)> callback;

    void Fail(const Status& s) const;
};

// Received payload destination.
struct PayloadSink {
    std::vector<iovec> iov;  // empty: discard everything
    std::shared_ptr<TransferOp> op;
    std::vector<RegionPin> pins;
    std::function<void(const Status&)> done;
};

class PendingResponses {
  public:
    // Request `id` waits for `e`.
    void Expect(uint64_t id, Expectation e);
    // Everything still waiting, taken out (the connection closes and fails them).
    std::unordered_map<uint64_t, Expectation> TakeAll();
    size_t size() const { return pending_.size(); }

    // What the connection does with an answer.
    struct Outcome {
        // Not empty: the peer broke the protocol (the request it answered, if any, has been
        // failed): close the connection with this.
        std::string protocol_error;
        // The frame's payload goes here (set for a read's or a pull's answer with a payload).
        bool has_sink = false;
        PayloadSink sink;
    };
    // A response, metadata or region-grant frame; `peer` names the peer in messages.
    Outcome OnAnswer(const wire::FrameHeader& h, std::string_view body, const std::string& peer);

  private:
    std::unordered_map<uint64_t, Expectation> pending_;
};

}  // namespace ferry::internal
