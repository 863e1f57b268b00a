// The KV connector seam: how the engine lets KV arrive from, or leave for, another worker
// without knowing how it moves (vLLM's KVConnectorBase_V1 is the model). The engine calls the
// scheduler side on its step thread and the worker side around the model's forward pass; with no
// connector configured it calls nothing and behaves exactly as before.
//
// Request life on the receiving (decode) side: waiting -> [local prefix-cache lookup] ->
// ExternalTokens > 0 -> blocks allocated -> StartLoad -> "waiting for remote KV" (a scheduler
// state; no thread blocks) -> a kLoaded event -> running from the first token (carried by the
// event when the sender sampled it) | a kFailed event -> the request ends with the error.
// On the sending (prefill) side: ReadyToSchedule (push: the receiver's block list has arrived)
// -> prefill, each layer handed to the LayerHook right after it is stored -> RequestFinished ->
// blocks held for the remote reader -> a kReleased event -> blocks freed.
//
// Ownership: the engine owns its blocks; the connector never frees or allocates one. A block
// handed to StartLoad, or held after RequestFinished, stays the connector's to write or read
// until the connector reports that request kLoaded, kFailed or kReleased; only then does the
// engine reuse it. That is the whole safety contract: a remote writer that might still be
// writing is never given a block that another request uses.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/status.h"
#include "kv/block_pool.h"
#include "kv/kv_cache.h"
#include "schema/kv_transfer_params.h"

namespace ferry::kv {

// The first token the sending side sampled, and its log-probabilities: the receiver continues
// from it instead of recomputing the last prompt token (kv_transfer_params carries it).
using FirstToken = schema::FirstToken;

// A request's kv_transfer_params as its connector parsed them (vLLM's design: the engine passes
// them through unread, and each connector defines its own; src/kv/kv_transfer_params.h is the
// built-in connector's). The engine reads only what it schedules by.
class ConnectorParams {
  public:
    virtual ~ConnectorParams() = default;
    // This worker prefills for another: the request stops after its first token and its KV is
    // kept for (or sent to) the other worker.
    virtual bool prefill_only() const = 0;
    // The prompt's KV comes from another worker.
    virtual bool loads_kv() const = 0;
    // The params of a response, as a JSON object (a router copies them to the next worker).
    virtual nlohmann::json ToJson() const = 0;

    // Who sent them (set by the server once it authenticated the sender, never read from the
    // request): kRouterRequester for a sender that proved the deployment secret, else the
    // client's address. Caps count by it.
    std::string requester;
};
// The requester of params whose sender proved the deployment secret (exempt from per-client caps).
inline constexpr char kRouterRequester[] = "router";

// What the engine tells the connector about a request. Valid for the call only.
struct ConnectorRequest {
    const std::string& id;
    std::span<const int32_t> prompt;
    const ConnectorParams& params;  // what this connector's ParseParams made
    // The prompt's images (their mm_hashes): part of its identity, as its token ids are.
    std::span<const MmSpan> mm = {};
};

// One sequence's share of a forward pass, for the worker side.
struct StepChunk {
    const std::string* id = nullptr;
    const ConnectorParams* params = nullptr;
    std::span<const BlockId> block_table;
    int start_pos = 0;
    int num_tokens = 0;
    bool last = false;  // the chunk ends the prompt
};

// Called by the model on each rank's thread right after layer `layer`'s K and V of every chunk
// of the step are in `rank`'s cache. Must not block.
class LayerHook {
  public:
    virtual ~LayerHook() = default;
    virtual void OnLayerStored(int rank, int layer) = 0;
};

struct ConnectorEvent {
    enum class Kind : uint8_t {
        kReady,     // a request may now be scheduled (push: the receiver's blocks are known)
        kLoaded,    // its external tokens are in its blocks
        kFailed,    // it cannot go on (status); none of its blocks is touched any more
        kReleased,  // blocks held after RequestFinished may be freed
    };
    Kind kind = Kind::kReady;
    std::string id;
    Status status;
    std::optional<FirstToken> first_token;  // kLoaded
    // kLoaded: the sender confirmed these bytes are this prompt's (its hold or its prefill had
    // the same prompt digest, and the peer is one of the deployment's). Only then may the engine
    // put the loaded blocks in its prefix cache; otherwise they serve this request alone.
    bool cacheable = false;
};

struct FinishAction {
    bool hold_blocks = false;                       // freed on kReleased, not now
    std::shared_ptr<const ConnectorParams> params;  // for the response (pull: where the KV is)
    // Not OK: the request ends with this error instead (e.g. its client already holds its share
    // of blocks); its blocks are freed now.
    Status refused;
};

class KvConnector {
  public:
    virtual ~KvConnector() = default;

    // Once, before the first step: the caches of every rank (the connector registers them with
    // its transfer agent) and a callback that wakes the step loop when events are queued (any
    // thread may call it). Unbind is called before the caches go away.
    virtual Status Bind(std::span<KvCache* const> caches, std::function<void()> wake) = 0;
    virtual void Unbind() = 0;

    // A request's kv_transfer_params (the JSON value the request held, parsed once by the
    // server; as vLLM hands a connector its dict) as this connector's params.
    // InvalidArgument naming the field ("'kv_transfer_params.remote_port' must be ..."); null
    // without an error when they ask nothing of a connector. Any thread.
    virtual Result<std::shared_ptr<ConnectorParams>> ParseParams(
        const nlohmann::json& params) const = 0;

    // --- admission (any thread) ---
    // Whether a request with params may be queued at all: per-client and per-peer caps on
    // holds and loads. ResourceExhausted (the client's share is used up) or Unavailable (the
    // peer's) refuse it. An admitted request is retired exactly once, when it ends (or at once if
    // it was not queued after all); its hold, if it left one, is counted until released.
    virtual Status Admit(const ConnectorRequest& r) {
        (void)r;
        return Status::Ok();
    }
    virtual void Retire(const std::string& id) { (void)id; }

    // --- scheduler side (step thread) ---
    // Whether a request with params may be scheduled now. When not, the engine parks it until a
    // kReady or kFailed event names it.
    virtual bool ReadyToSchedule(const ConnectorRequest& r) = 0;
    // After the local prefix-cache lookup found `num_computed` tokens: how many of the following
    // prompt tokens will arrive from elsewhere (0: compute them here).
    virtual int ExternalTokens(const ConnectorRequest& r, int num_computed) = 0;
    // Blocks are allocated for num_computed + num_external tokens: start moving KV into
    // blocks[num_computed / block_tokens...].
    virtual void StartLoad(const ConnectorRequest& r, std::span<const BlockId> blocks,
                           int num_computed, int num_external) = 0;
    // The request ended (its last output is being delivered); `blocks` still hold its KV.
    // `first` is the token it sampled first (null if none, e.g. on an error).
    virtual FinishAction RequestFinished(const ConnectorRequest& r, std::span<const BlockId> blocks,
                                         bool ok, const FirstToken* first) = 0;
    // The client went away while the request was parked or loading. The connector stops what it
    // does for it and reports kFailed once none of its blocks is touched any more.
    virtual void Abort(const std::string& id) = 0;
    // Events since the last call, oldest first.
    virtual std::vector<ConnectorEvent> TakeEvents() = 0;

    // --- worker side (around the forward pass, step thread) ---
    // The step's chunks of requests that carry params; returns the hook for the forward pass
    // (null: none needed). EndStep follows the forward pass.
    virtual LayerHook* BeginStep(std::span<const StepChunk> chunks) = 0;
    virtual void EndStep() = 0;

    // --- observation (any thread) ---
    // Its state as Prometheus text, for the worker's /metrics ("" = nothing to add).
    virtual std::string RenderMetrics() const { return ""; }
};

}  // namespace ferry::kv
