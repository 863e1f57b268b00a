// The KV connector over ferry's transfer engine: moves a request's paged KV between a prefill
// and a decode worker, each with its own Agent, by one of two protocols (docs/disaggregation.md):
//
// pull (vLLM's NixlConnector protocol): the prefill worker finishes the request, holds its blocks
//   under a lease and answers with kv_transfer_params naming its agent, host, port and block ids;
//   the decode worker claims the hold and READs the blocks (one strided descriptor per run of
//   adjacent blocks), then tells the prefill worker, which frees them.
// push (SGLang / Mooncake style, layer-wise): the decode worker allocates blocks and sends their
//   ids to the prefill worker under a transfer id; the prefill worker WRITEs each layer's KV the
//   moment the layer is stored, while the forward pass goes on, then sends the first sampled
//   token; the decode worker continues from it.
//
// Peers handshake once (cached): model fingerprint, layers, kv heads, head dim, dtype, block
// size, layout and TP size must match, or the request fails with an error naming the field and
// both values. Each TP rank's cache is one region, registered once at Bind.
//
// The connector owns its Agent's notifications (TakeNotifications): give it an Agent used for
// nothing else that reads notifications. Thread-safe; threads of its own (messages, timers and
// transfer completions, a few for handshakes) besides the Agent's.
//
// Trust (docs/security.md): a pull claim names the blocks it reads and the prompt's SHA-256;
// the prefill worker refuses one whose blocks, prompt or claimer differ from its hold's. A hold's
// nonce and every transfer id are 128 random bits. Loaded KV enters the prefix cache only when
// the sender confirmed it is the prompt's and the peer is the deployment's.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/peer_trust.h"
#include "ferry/agent.h"
#include "kv/connector.h"
#include "kv/kv_transfer_params.h"
#include "kv/kv_verify.h"

namespace ferry::kv {

// The built-in kind's own options (KvConnectorContext::options, `ferry serve`'s --kv-* flags):
// AgentConnectorOptionsJson writes them, ParseAgentConnectorOptions reads them back.
struct AgentConnectorOptions {
    // pull: a held request's blocks are freed if no decoder claims them within this time.
    std::chrono::milliseconds hold_lease{10000};
    // pull, the decoder: while a request it was given a hold for waits to claim it (queued
    // behind others), it renews the hold this often, each time for three intervals (the holder
    // grants at most hold_lease): a long queue does not lose its holds, and a decoder that dies
    // stops renewing, so its holds come back within three intervals.
    // push, the prefill worker: while a request bound to a decoder's blocks is queued or
    // computing, it tells the decoder to go on waiting this often (push-alive), for three
    // intervals each time (the decoder grants at most bootstrap_timeout + transfer_timeout from
    // now): a long prefill queue does not fail its decoders, and a prefill worker stopped or
    // wedged stops renewing, so its decoders free their blocks within three intervals.
    // 0: no renewals.
    std::chrono::milliseconds hold_renew_interval{1000};
    // A load or push not finished this long after it started fails (DeadlineExceeded).
    std::chrono::milliseconds transfer_timeout{10000};
    // push: a prefill request whose decoder has not sent its block ids by then fails.
    std::chrono::milliseconds bootstrap_timeout{30000};
    std::chrono::milliseconds handshake_timeout{5000};
    // While a decoder waits on a prefill worker (push: for its writes; pull: for the answer to
    // its claim) it checks every interval that the peer is alive (a small READ, which fails once
    // the peer's streams are closed), so a killed prefill fails the request within ~2 s.
    std::chrono::milliseconds liveness_interval{500};
    // The protocol of kv_transfer_params that do not name one ("transfer_mode").
    KvTransferMode default_mode = KvTransferMode::kPull;
    // Backend for KV transfers ("" = the agent's choice for the peer).
    std::string backend = "";
    // Caps (0: none). Per client (ConnectorParams::requester; the router is exempt): KV blocks
    // of its unclaimed pull holds (-1: a quarter of the cache; checked at Admit and again when
    // the hold would be made, which then fails the request with ResourceExhausted), its loads in
    // flight, and the peers its loads wait to handshake with. Per peer: loads in flight.
    int max_client_hold_blocks = -1;
    int max_client_loads = 64;
    int max_client_dials = 4;
    int max_peer_loads = 1024;
    // Handshakes run on these many threads, each with its own deadline.
    int connect_threads = 16;
    // The receiving side's checksums of what moved (kv_verify.h): off, a random sample of units
    // per request, or all. A mismatch fails the request (DataLoss), never a wrong answer.
    KvVerifyMode verify = KvVerifyMode::kSample;
    // The handshake canary (kv_verify.h): a peer is ready only once its canary, read through the
    // mapping requests use, arrived right.
    bool canary = true;
};

// {"hold_lease_ms", "hold_renew_interval_ms", "transfer_timeout_ms", "bootstrap_timeout_ms",
// "handshake_timeout_ms",
//  "liveness_interval_ms", "transfer_mode", "backend", "max_client_hold_blocks",
//  "max_client_loads", "max_client_dials", "max_peer_loads", "connect_threads", "verify",
//  "canary"}: every option.
nlohmann::json AgentConnectorOptionsJson(const AgentConnectorOptions& o);
// The options a JSON object names, the defaults for the rest. An operator's setting, so stricter
// than a peer's message: InvalidArgument naming an unknown key (and the known ones), a mistyped
// or out-of-range value.
Result<AgentConnectorOptions> ParseAgentConnectorOptions(const nlohmann::json& options);

struct AgentConnectorConfig : AgentConnectorOptions {
    // Model::fingerprint() and the model's total kv heads (all ranks): checked at handshake.
    std::string model_fingerprint;
    int model_kv_heads = 0;
    // The worker's TP, reported as kv_transfer_params' tp_size (vLLM's meaning); 0: the caches
    // bound. They differ for MLA, whose ranks share one latent cache.
    int model_tp = 0;
    // Which agents this worker dials, and whether KV that arrives may enter the prefix cache.
    PeerTrust trust = {};
    // Tests only: a mapping bug on purpose. Each peer rank's heads are taken to begin this many
    // heads later than they do (what the canary and --kv-verify must catch). Not an option.
    int fault_head_offset_for_testing = 0;
};

// Seconds buckets of the transfer time histogram (upper bounds; the last bucket is +Inf).
inline constexpr double kTransferSecondsBuckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                     0.1,   0.25,   0.5,   1,    2.5,   5};

struct KvConnectorStats {
    // Requests in each state now (both roles).
    int bootstrapping = 0;      // waiting for the peer's handshake or (push) its block ids
    int waiting_for_input = 0;  // push decoder: blocks sent, waiting for the KV
    int transferring = 0;       // bytes moving
    int holding = 0;            // pull prefill: blocks held for a reader
    uint64_t succeeded = 0;
    uint64_t failed = 0;
    std::map<std::string, uint64_t> failures;  // by reason (canonical code name, "lease_expired")
    uint64_t bytes_read = 0;
    uint64_t bytes_written = 0;
    uint64_t transfers = 0;        // posted READs and WRITEs
    uint64_t descriptors = 0;      // local descriptors over all of them
    uint64_t max_descriptors = 0;  // in one transfer
    uint64_t handshakes = 0;
    // pull: hold renewals sent (decode side) and granted (prefill side).
    uint64_t holds_renewals_sent = 0;
    uint64_t holds_renewed = 0;
    // push: push-alive messages sent (prefill side) and waits extended by them (decode side).
    uint64_t push_renewals_sent = 0;
    uint64_t pushes_renewed = 0;
    // Peer messages refused after the handshake (unknown request, wrong nonce or peer, ...).
    uint64_t messages_refused = 0;
    // --kv-verify: loads whose checksums were compared, and those that differed; units checked.
    uint64_t verified = 0;
    uint64_t verify_mismatches = 0;
    uint64_t verify_units = 0;
    // Time spent computing checksums, both roles (the receiver's of what landed, the sender's
    // of what it holds).
    double verify_seconds = 0;
    // Handshake canaries checked, and those that arrived wrong.
    uint64_t canaries = 0;
    uint64_t canary_failures = 0;
    // Per request, from the first byte posted to the last byte in place.
    uint64_t transfer_seconds_count = 0;
    double transfer_seconds_sum = 0;
    std::vector<uint64_t> transfer_seconds_buckets;  // cumulative, one more than the bounds
    // push, prefill side: of the transfer time, the part after the prefill's compute ended
    // (the rest ran under the forward pass, layer by layer).
    double transfer_exposed_seconds_sum = 0;
    uint64_t transfer_exposed_count = 0;
};

class AgentKvConnector final : public KvConnector {
  public:
    // InvalidArgument without a fingerprint or kv heads.
    static Result<std::shared_ptr<AgentKvConnector>> Create(std::shared_ptr<Agent> agent,
                                                            AgentConnectorConfig config);
    ~AgentKvConnector() override;

    Agent& agent() const;
    KvConnectorStats Stats() const;

    Status Bind(std::span<KvCache* const> caches, std::function<void()> wake) override;
    // kv::ParseKvTransferParams with the configured default mode.
    Result<std::shared_ptr<ConnectorParams>> ParseParams(
        const nlohmann::json& params) const override;
    void Unbind() override;
    Status Admit(const ConnectorRequest& r) override;
    void Retire(const std::string& id) override;
    bool ReadyToSchedule(const ConnectorRequest& r) override;
    int ExternalTokens(const ConnectorRequest& r, int num_computed) override;
    void StartLoad(const ConnectorRequest& r, std::span<const BlockId> blocks, int num_computed,
                   int num_external) override;
    FinishAction RequestFinished(const ConnectorRequest& r, std::span<const BlockId> blocks,
                                 bool ok, const FirstToken* first) override;
    void Abort(const std::string& id) override;
    std::vector<ConnectorEvent> TakeEvents() override;
    LayerHook* BeginStep(std::span<const StepChunk> chunks) override;
    void EndStep() override;
    std::string RenderMetrics() const override;  // RenderKvConnectorMetrics(Stats())

    // Handles `payload` as a message from the peer `from` (the fuzzer's way in; peers' messages
    // otherwise arrive through the Agent).
    void DeliverForTesting(const std::string& from, std::string_view payload);

    struct Impl;

  private:
    explicit AgentKvConnector(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

// The stats as Prometheus text (ferry_kv_connector_* families), for a worker's /metrics.
std::string RenderKvConnectorMetrics(const KvConnectorStats& s);

// Allocates KV caches as regions of `agent` (pre-faulted shared memory), so that same-host peers
// map them and copy one-sided (EngineConfig.allocator).
KvAllocator AgentKvAllocator(std::shared_ptr<Agent> agent);

}  // namespace ferry::kv
