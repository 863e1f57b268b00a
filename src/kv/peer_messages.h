// The messages two KV connectors exchange over their agents' notification channel, one struct
// each, and their one codec. On the wire a message is a JSON object whose "t" names its type
// (docs/disaggregation.md, "Connector messages").
//
// Decoding is strict in one way for every message: a missing or mistyped field, an out-of-range
// number or an unknown type is an error naming the field (or the type); fields a message does not
// define are ignored, so a newer peer may add some. Whether the values make sense for this worker
// (its TP size, its holds and loads) is for the connector to decide, not the codec.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ferry/status.h"
#include "kv/block_pool.h"
#include "kv/connector.h"

namespace ferry::kv::msg {

// 2: prompts named by SHA-256, hold nonces of 128 bits, claims that name their blocks.
inline constexpr int kProtocolVersion = 2;
// A message nests at most this deep (checked before any parse).
inline constexpr size_t kMaxDepth = 8;
// The most blocks one message names (a 16M-token prompt at block size 1).
inline constexpr size_t kMaxBlocks = size_t{1} << 24;
inline constexpr size_t kMaxIdChars = 1024;
inline constexpr size_t kMaxErrorChars = 16384;
inline constexpr size_t kMaxTopLogprobs = 64;
inline constexpr int kMaxRanks = 1024;
// The most checksum units one message names (kv_verify.h).
inline constexpr size_t kMaxUnits = size_t{1} << 20;

// What two workers must agree on to move KV between them.
struct Compat {
    int protocol = kProtocolVersion;
    std::string model;  // weights fingerprint
    // "gqa" (per-head K and V) or "mla" (one latent per token and layer, the same on every rank:
    // the connector then sees one cache per worker whatever its TP). Absent in a hello: "gqa".
    std::string attention = "gqa";
    int layers = 0;
    int kv_heads = 0;  // the model's, over all ranks
    int head_dim = 0;
    std::string dtype;
    int block_tokens = 0;  // may differ between peers: transfers cut at both sides' blocks
    std::string layout = "HND";
    // Its ranks (the hello's `ranks` list them): it may differ between peers (heterogeneous TP:
    // each rank's heads are read from, or written to, the peer ranks that hold them), so it is
    // not compared below.
    int tp = 0;
};

// The first field where `theirs` differs from `ours` (block_tokens and tp excepted): protocol,
// attention, model, then the rest in the order above.
struct CompatDiff {
    std::string field, ours, theirs;
};
std::optional<CompatDiff> FirstDifference(const Compat& ours, const Compat& theirs);

// One rank's KV cache as its peer needs to address it.
struct RankInfo {
    uint64_t region = 0;
    int blocks = 0;
    // Its handshake canary (kv_verify.h): a region laid out as the cache with just enough blocks
    // for kv::kCanaryTokens; 0: none offered (the peer's canary is then not checked).
    uint64_t canary = 0;
};

// What the receiver of KV asks the sender to checksum (`--kv-verify`): units (kv_verify.h) over
// tokens [begin, end) of the request's sequence. The answer's `sums` are in the same order.
struct VerifyRequest {
    int begin = 0, end = 0;
    std::vector<int> units;
};

// "hello" (the dialing side) and "hello-ack" (the answer).
struct Hello {
    bool ack = false;
    int version = kProtocolVersion;
    Compat compat;
    std::vector<RankInfo> ranks;
    std::string addr;  // the sender's agent listener
    // hello-ack: whether the peer accepts us, and why not.
    bool ok = true;
    std::string error;
};

// pull: a decoder claims a prefill worker's hold; it names every block it will read.
struct Claim {
    std::string rid;     // the prefill worker's request id
    std::string nonce;   // the hold's, 32 hex digits
    std::string lid;     // the decoder's request id
    std::string prompt;  // SHA-256 of the prompt's token ids, 64 hex digits
    std::vector<BlockId> blocks;
    std::optional<VerifyRequest> verify = std::nullopt;
};

// pull: the holder's answer; on success the token the prefill sampled.
struct ClaimAck {
    std::string lid;
    bool ok = false;
    std::optional<FirstToken> first;  // set when ok
    std::string error;                // when !ok
    std::string code;                 // when !ok: "gone" (lease lapsed) or "conflict"
    std::vector<uint64_t> sums = {};  // when ok and the claim asked to verify
};

// pull: the decoder is done with a hold ("read-done") or gives it up ("release").
struct HoldEnd {
    enum class Kind { kReadDone, kRelease } kind = Kind::kReadDone;
    std::string rid, nonce;
};

// pull: the decoder that was given a hold and has not claimed it yet (its request waits in the
// queue) asks for `lease_ms` more, from now; sent again before that lapses. A decoder that dies
// stops asking, and the hold lapses that soon after instead of at the whole lease.
struct HoldRenew {
    std::string rid, nonce;
    int lease_ms = 0;  // 1..600000; the holder grants at most its own lease
};

// push: the decoder's blocks for a transfer id, sent to the prefill worker.
struct PushTarget {
    std::string xid, lid;
    std::vector<BlockId> blocks;
    int from = 0;  // first token to write (what the decoder has cached before it)
    int len = 0;   // the prompt's length
    std::string prompt;
    std::optional<VerifyRequest> verify = std::nullopt;
};

// push: the prefill worker that has a decoder's blocks bound to a request it has not finished
// yet (queued or computing) tells the decoder to wait `lease_ms` more, from now; sent again
// before that lapses. A long prefill queue keeps its decoders waiting; a prefill worker that is
// stopped or wedged stops saying so, and its decoders free their blocks that soon after.
struct PushAlive {
    std::string xid, lid;
    int lease_ms = 0;  // 1..600000; the decoder grants at most its own whole wait
};

// push: the decoder stops a transfer.
struct PushCancel {
    std::string xid, lid;
};

// push: how a transfer ended, from the prefill worker.
struct PushEnd {
    enum class Kind { kDone, kFailed, kCancelled } kind = Kind::kDone;
    std::string xid, lid;
    std::optional<FirstToken> first;  // kDone
    std::string error;                // kFailed (may be empty)
    std::vector<uint64_t> sums = {};  // kDone, when the push-target asked to verify
};

using PeerMessage = std::variant<Hello, Claim, ClaimAck, HoldEnd, HoldRenew, PushTarget, PushAlive,
                                 PushCancel, PushEnd>;

// The wire name of a message ("hello-ack", "claim", ...).
std::string_view TypeOf(const PeerMessage& m);

std::string Encode(const PeerMessage& m);

// Reads one message. `type`, when given, receives the "t" field as soon as it is read (so that a
// caller can tell whose message failed to decode).
Result<PeerMessage> Decode(std::string_view payload, std::string* type = nullptr);

}  // namespace ferry::kv::msg
