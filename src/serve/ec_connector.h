// Encoder-cache connectors (EPD, docs/disaggregation.md "Encoder disaggregation"): how image
// embeddings computed by an encode worker (the producer) reach the prefill, decode or colocated
// workers that need them (consumers), keyed by mm_hash (the SHA-256 of the decoded pixels and
// their size, media/image.h), never by URL.
//
//   transfer  The producer keeps each image's embeddings in slots of one agent memory region and
//             publishes each as a named object "mm:<mm_hash>" (Agent::Publish); a consumer pulls
//             it in one round trip (Agent::PullByKey over shm, tcp or ucx) from the agent its
//             request's ec_transfer_params name. A slot is leased when written: it is not reused
//             until a consumer says it pulled it (a notification after the pull, not waited for)
//             or the lease lapses, so nothing waits forever and nothing is overwritten under a
//             reader. Each slot carries its key, its shape and an XXH3-64 of its payload: a pull
//             that raced a slot's reuse after its lease is refused as a miss, never used.
//   disk      vLLM's ECExampleConnector layout: DIR/<mm_hash>/encoder_cache.safetensors holding
//             one F32 tensor "ec_cache" [tokens, width] (its metadata carries the payload's
//             XXH3-64), written to a temporary name and renamed, so a reader sees a whole file
//             or none. Consumers look there for every image; no params are needed.
//
// A consumer that misses (or cannot reach the producer) encodes the image itself, or fails the
// request with --ec-load-failure fail.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/peer_trust.h"
#include "ferry/agent.h"
#include "ferry/status.h"
#include "media/encoder_cache.h"
#include "schema/ec_transfer_params.h"

namespace ferry::serve {

enum class EcLoadFailure { kEncode, kFail };
Result<EcLoadFailure> ParseEcLoadFailure(std::string_view name);  // "encode" | "fail"

// Where an image's embeddings wait: the producer's agent and its vision encoder, from the
// ec_transfer_params of an encode worker's answer (schema/ec_transfer_params.h).
using EcSource = schema::EcTransferParams;

struct EcConnectorConfig {
    std::string kind;  // a registered kind: "transfer", "disk", ...
    bool producer = false;
    // transfer: this worker's agent; the producer's region holds `buffer_bytes` of slots of
    // `entry_floats` floats (an image's embeddings: tokens per image x the model's width).
    std::shared_ptr<Agent> agent = {};
    uint64_t buffer_bytes = 256ull << 20;
    size_t entry_floats = 0;
    size_t width = 0;  // the model's: an entry is entry_floats / width rows
    // This worker's vision encoder (model::VisionEncoder::fingerprint): written with every entry
    // a producer publishes (the slot's header, the file's metadata), and what a consumer
    // requires of every entry it loads: embeddings of another encoder are refused
    // (FailedPrecondition naming both), never used or cached.
    std::string encoder = {};
    std::chrono::milliseconds lease{30000};
    std::chrono::milliseconds pull_timeout{5000};
    // transfer, consumer: which producer agents it dials (the KV connector's setting; with no
    // allowed agents, no store and no secret, any the params name: docs/security.md).
    PeerTrust trust = {};
    // transfer, consumer: where an image's embeddings are looked for when its request names no
    // encode worker (vLLM's EPD proxy sends the original request, no ec_transfer_params): the
    // deployment's encode workers, asked by mm_hash one after another (one round trip each,
    // the first that holds it wins). A source without an engine_id is dialed by address and
    // taken under the name it gives. Unset or empty: such images are encoded here.
    std::function<std::vector<EcSource>()> producers = {};
    // disk: the shared directory.
    std::string dir = {};
};

struct EcConnectorStats {
    uint64_t saved = 0;              // producer: entries written
    uint64_t save_refused = 0;       // producer: every slot leased (the request got 503)
    uint64_t loads = 0;              // consumer: entries found and taken
    uint64_t load_misses = 0;        // consumer: not there (or not for this key and shape)
    uint64_t load_failures = 0;      // consumer: the producer unreachable, a bad file, a timeout
    uint64_t load_foreign = 0;       // consumer: of those, another vision encoder's embeddings
    uint64_t found_by_hash = 0;      // consumer: of the loads, found with no encode worker named
    uint64_t load_bytes = 0;         // consumer
    uint64_t load_micros = 0;        // consumer: time in Load
    uint64_t released_unpulled = 0;  // consumer: leases ended without a pull (cached here)
    uint64_t released = 0;           // producer: consumers' notifications that they pulled an entry
    uint64_t lapsed = 0;             // producer: leases that ran out
    uint64_t renewals_sent = 0;      // consumer: renewals of waiting requests' entries
    uint64_t renewed = 0;            // producer: leases a consumer's renewal set anew
    uint64_t leased = 0;             // producer: slots leased now
    uint64_t entries = 0;            // producer: slots in use now
    uint64_t slots = 0;              // producer
};

class EcConnector {
  public:
    virtual ~EcConnector() = default;
    const std::string& kind() const { return kind_; }
    // Producer: keeps `floats` (entry_floats of them) under mm_hash for consumers.
    // ResourceExhausted when nothing can be reused (every slot leased).
    virtual Status Save(const std::string& mm_hash, const std::vector<float>& floats) = 0;
    // Consumer: the embeddings of mm_hash (`floats` of them), from `source` (transfer: required;
    // disk: ignored). NotFound on a miss; Unavailable, DeadlineExceeded or DataLoss for a
    // producer that cannot be reached or sent something wrong; FailedPrecondition for
    // embeddings another vision encoder computed (or a file that does not say which).
    virtual Result<media::Embeddings> Load(const std::string& mm_hash, size_t floats,
                                           const EcSource* source) = 0;
    // Consumer: the image was found in this worker's own encoder cache, so `source`'s entry is
    // not pulled; ends the lease taken for this consumer (transfer: one notification, not
    // waited for) so the producer's slot is free at once rather than when the lease lapses.
    virtual void Release(const std::string& mm_hash, const EcSource* source) {
        (void)mm_hash;
        (void)source;
    }
    // Consumer: a request that will load `source`'s entries (its mm_hashes) waits here (in the
    // media queue): their leases are to last `lease` more from now, no longer (transfer: one
    // notification, not waited for). Sent on arrival and again each renewal interval while it
    // waits, so a long queue keeps its entries and a consumer that dies frees them within
    // `lease` instead of the producer's whole lease.
    virtual void Renew(const EcSource& source, std::chrono::milliseconds lease) {
        (void)source;
        (void)lease;
    }
    // Whether what Load returns may be cached (the encoder cache, and the prefix cache's blocks
    // computed from it): only when it can come from the deployment alone (a secret, the
    // store's agents, --kv-peers; the operator's directory), as for loaded KV. Otherwise a
    // client that names its own agent could plant embeddings under an image's hash.
    virtual bool Cacheable() const = 0;
    // The ec_transfer_params a producer's answer carries (null: none).
    virtual nlohmann::json Params() const = 0;
    // Whether a consumer finds entries with no params (disk: the shared directory), so that a
    // miss there is an entry expected and not found.
    virtual bool FindsWithoutParams() const { return false; }
    virtual EcConnectorStats Stats() const = 0;

  protected:
    explicit EcConnector(std::string kind) : kind_(std::move(kind)) {}

  private:
    std::string kind_;
};

// Encoder-cache connectors by name (`ferry serve --ec-connector NAME`), registered as KV
// connectors are (kv/connector_registry.h): a new kind is added without touching the worker or
// the server. "transfer" and "disk" are built in.
struct EcConnectorKind {
    std::string name;
    std::string description;   // one line, for --help
    bool needs_agent = false;  // the worker starts its transfer agent for it
    // InvalidArgument for a config that cannot work (no directory, no agent, no entry size).
    std::function<Result<std::shared_ptr<EcConnector>>(EcConnectorConfig config)> create;
};
// Adds a kind. InvalidArgument without a name or create; AlreadyExists for a known name.
// Thread-safe.
Status RegisterEcConnector(EcConnectorKind kind);
// NotFound naming the known kinds.
Result<EcConnectorKind> FindEcConnector(std::string_view name);
// The registered names, sorted.
std::vector<std::string> EcConnectorNames();

// The connector of config.kind (FindEcConnector, then its create).
Result<std::shared_ptr<EcConnector>> MakeEcConnector(EcConnectorConfig config);

// The object key of an image's embeddings: "mm:" + mm_hash.
std::string EcObjectKey(std::string_view mm_hash);

}  // namespace ferry::serve
