// The inference engine: requests in, tokens out. One step loop runs continuous batching over the
// paged KV cache (vLLM v1's scheduler): every step it gives running sequences their next token or
// prefill chunk, then admits waiting ones while the token budget (max_batched_tokens), the
// sequence limit and free blocks last; prompt chunks and decode tokens share one forward pass.
// Prompts start from the longest cached prefix (automatic prefix caching). When blocks run out,
// the most recently admitted sequence is preempted: its blocks are freed and it is recomputed
// later from its prompt and the tokens it already produced.
//
// Disaggregation: with a KV connector (EngineConfig.connector, src/kv/connector.h) a request that
// carries kv_transfer params may get its prompt's KV from another worker (it waits for it in a
// scheduler state, holding its blocks, and never in a thread), or keep its blocks after it ends
// for a remote reader. Without a connector none of this code runs.
//
// Thread-safety: Submit, Abort and Stats may be called from any thread. Output callbacks run on
// the step thread and must not block.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ferry/status.h"
#include "kv/block_pool.h"
#include "kv/connector.h"
#include "kv/kv_cache.h"
#include "model/model.h"
#include "model/sampler.h"

namespace ferry::engine {

struct EngineConfig {
    int block_tokens = 16;
    int num_blocks = 0;                      // 0: as many as kv_cache_bytes holds
    uint64_t kv_cache_bytes = 256ull << 20;  // all ranks together
    kv::KvDtype kv_dtype = kv::KvDtype::kF32;
    int max_num_seqs = 64;
    // The tokens of one step; 0: 2048, raised to the max model length without chunked prefill
    // (vLLM's default: a whole prompt must fit one step).
    int max_batched_tokens = 0;
    bool chunked_prefill = true;
    int max_prefill_chunk = 0;  // > 0: at most this many prompt tokens of one sequence per step
    bool prefix_caching = true;
    // The seed of the prefix cache's block hashes (vLLM's PYTHONHASHSEED: core/block_hash.h).
    std::string prefix_hash_seed = "0";
    // Called on the step thread after a step that changed the prefix cache, with what changed
    // in order (vLLM's KV events). Must not block. Null: no events are recorded.
    std::function<void(std::vector<schema::KvCacheEvent>)> on_kv_events;
    int max_model_len = 0;  // 0: the model's context length
    // No step thread: the owner calls Step() (deterministic batching for tests and benchmarks).
    bool manual_steps = false;
    // Where the KV tensors live (one allocation per rank); default anonymous memory.
    kv::KvAllocator allocator;
    // Moves KV to and from other workers (null: colocated). Bound to the caches at Create.
    std::shared_ptr<kv::KvConnector> connector;
    // vLLM's kv_load_failure_policy: a request whose remote KV did not arrive (the prefill
    // worker gone, a refused claim, a failed or unverified transfer) fails (kFail), or computes
    // its prompt here instead (kRecompute): what the local prefix cache holds is kept, the rest
    // computed, and the answer is the one it would have had.
    enum class KvLoadFailure : uint8_t { kFail, kRecompute };
    KvLoadFailure kv_load_failure = KvLoadFailure::kFail;
};

// "fail" | "recompute"; InvalidArgument naming the text otherwise.
Result<EngineConfig::KvLoadFailure> ParseKvLoadFailure(std::string_view name);

enum class FinishReason : uint8_t { kNone, kStop, kLength, kAbort, kError };
const char* FinishReasonName(FinishReason r);  // "stop" | "length" | "abort" | "error"

// What one step produced for one request.
struct RequestOutput {
    std::vector<int32_t> tokens;  // newly sampled
    std::vector<float> logprobs;  // of each token (when asked)
    std::vector<std::vector<std::pair<int32_t, float>>> top_logprobs;
    std::string text;  // new text; complete UTF-8, held back while a stop string may be forming
    FinishReason finish = FinishReason::kNone;
    Status error;  // when finish == kError
    int prompt_tokens = 0;
    int completion_tokens = 0;  // so far
    int cached_tokens = 0;      // prompt tokens served from the prefix cache
    int external_tokens = 0;    // prompt tokens whose KV came from another worker
    // Final output of a request that kept its KV for a remote reader: where it is (the
    // response's kv_transfer_params).
    std::shared_ptr<const kv::ConnectorParams> kv_transfer;
};
using OutputCallback = std::function<void(const RequestOutput&)>;

// A multimodal input of a prompt (an image): `length` placeholder tokens from `offset` whose
// inputs are `embeds` ([length][model dim], the encoder's projected output) instead of the
// tokens' embedding rows. `hash` (its mm_hash, hex) keys the prefix cache's blocks that overlap
// it, so that another image behind the same placeholder tokens never hits them.
struct MmInput {
    int offset = 0;
    int length = 0;
    std::string hash;
    std::shared_ptr<const std::vector<float>> embeds;
};

struct Request {
    std::string id;
    std::vector<int32_t> prompt;
    // Sorted by offset, not overlapping, inside the prompt.
    std::vector<MmInput> mm;
    model::SamplingParams sampling;
    OutputCallback on_output;
    // Disaggregation (needs a connector): the request's kv_transfer_params as the connector
    // parsed them (KvConnector::ParseParams). prefill_only: it prefills and keeps the KV (and
    // stops after its first token); loads_kv: the prompt's KV comes from elsewhere.
    std::shared_ptr<const kv::ConnectorParams> kv_transfer;
    // Its blocks are never put in the prefix cache (inputs from a source outside the
    // deployment, e.g. embeddings an unauthenticated peer sent: they serve this request alone).
    bool no_cache = false;
    // A stream migrated from a worker that died (router/driver.h): the output tokens it had
    // already sent. They follow the prompt and count as output (max_tokens, usage); the sampler
    // skips their draws and the text state takes their bytes as already sent, so the rest
    // continues exactly as the first worker would have gone on. Not with kv_transfer.
    std::vector<int32_t> continued;
};

struct EngineStats {
    int running = 0;
    int waiting = 0;
    int kv_blocks_total = 0;
    int kv_blocks_used = 0;
    uint64_t prefix_query_tokens = 0;
    uint64_t prefix_hit_tokens = 0;
    uint64_t prompt_tokens = 0;  // computed, excluding prefix hits
    uint64_t generation_tokens = 0;
    uint64_t preemptions = 0;
    uint64_t steps = 0;
    uint64_t requests_finished = 0;
    // Disaggregation.
    int kv_parked = 0;   // waiting for the connector to allow scheduling (push prefill)
    int kv_loading = 0;  // holding blocks while their KV arrives
    int kv_held = 0;     // finished requests whose blocks a remote reader or writer still uses
    uint64_t kv_external_tokens = 0;  // prompt tokens loaded from other workers
    uint64_t kv_load_failures = 0;
    uint64_t kv_load_recomputed = 0;  // of those, computed here (kv_load_failure kRecompute)
};

class Engine {
  public:
    // Sizes and allocates the KV cache of every rank and starts the step thread.
    // InvalidArgument for an inconsistent config; ResourceExhausted if the cache cannot be had.
    static Result<std::unique_ptr<Engine>> Create(std::shared_ptr<model::Model> model,
                                                  const EngineConfig& config);
    // Aborts what is in flight (callbacks get kAbort) and stops the step thread.
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // Queues a request. InvalidArgument for an empty prompt, a token outside the vocabulary, bad
    // sampling parameters, or a prompt plus max_tokens that exceeds max_model_len or the whole
    // cache; AlreadyExists for an id in use. Never blocks on the step loop.
    Status Submit(Request request);
    // Whether a request of this id is live (queued, running, or holding its blocks for a remote
    // reader): Submit would refuse the id now.
    bool IdInUse(const std::string& id) const;
    // Ends a request (client gone): its blocks are freed at the next step (a request loading
    // remote KV: once the connector says nothing writes them any more) and its callback gets
    // kAbort (kError with `reason` when one is given: the request cannot go on, e.g. its remote
    // prefill failed). Unknown or finished ids are ignored.
    void Abort(const std::string& id, Status reason = Status::Ok());

    // Manual mode: runs one step; returns false when there was nothing to do (true while
    // requests wait for remote KV).
    bool Step();
    // Manual mode: steps until no request is left.
    void RunUntilIdle();

    EngineStats Stats() const;
    // SGLang's /flush_cache: forgets every cached prefix block, on the step thread, when no
    // request is in flight or held (true); false when one is, or the step thread did not get
    // to it within `timeout`. Thread-safe.
    bool FlushPrefixCache(std::chrono::milliseconds timeout);
    const EngineConfig& config() const { return config_; }
    const model::Model& model() const { return *model_; }
    int max_model_len() const { return config_.max_model_len; }
    // The KV caches (one per rank), e.g. to register them with a transfer Agent.
    const std::vector<std::unique_ptr<kv::KvCache>>& caches() const { return caches_; }

  private:
    struct Sequence;
    Engine(std::shared_ptr<model::Model> model, const EngineConfig& config);
    void Loop();
    void DrainInbox();
    void Schedule(std::vector<std::pair<Sequence*, int>>* plan);
    void Preempt(Sequence* s);
    // Applies the connector's events (kv loaded, failed, released, ready); true if any.
    bool HandleConnectorEvents();
    // The blocks of a request that ended are freed, or held for the connector (`ok`: it ended
    // normally); fills out->kv_transfer.
    void ReleaseBlocks(Sequence* s, bool ok, RequestOutput* out);
    void FreeHeld(const std::string& id);
    kv::ConnectorRequest Conn(const Sequence* s) const;
    // The body of Step, before its stats are published and its final outputs delivered.
    bool StepBatch();
    // Ends `s`: frees its blocks and queues its final output for DeliverFinals.
    void Finish(Sequence* s, FinishReason reason, RequestOutput* out);
    // Finish with FinishReason::kAbort (kError with a non-OK `reason`), outside a step's output.
    void FinishAborted(Sequence* s, Status reason = Status::Ok());
    // Runs the queued final callbacks. After PublishStats, so that a client that got its final
    // output never finds the request still counted as running in Stats().
    void DeliverFinals();
    void ProcessToken(Sequence* s, const model::SampledToken& tok, RequestOutput* out);
    // InvalidArgument for continued tokens the request cannot go on from (Request::continued).
    Status CheckContinued(const Request& request) const;
    void CommitFullBlocks(Sequence* s);
    void PublishStats();

    std::shared_ptr<model::Model> model_;
    EngineConfig config_;
    std::vector<std::unique_ptr<kv::KvCache>> caches_;
    std::vector<kv::KvCache*> cache_ptrs_;
    std::unique_ptr<kv::KvBlockPool> pool_;

    // Step-thread state.
    std::deque<std::unique_ptr<Sequence>> waiting_;
    std::vector<std::unique_ptr<Sequence>> running_;  // in admission order
    // Disaggregation: sequences parked or loading remote KV, and blocks of ended requests that
    // the connector still uses (by request id; the id stays in use until they are freed).
    std::vector<std::unique_ptr<Sequence>> remote_;
    std::unordered_map<std::string, std::vector<kv::BlockId>> held_;
    kv::KvConnector* connector_ = nullptr;
    bool progressed_ = true;  // the last step did something: stepping again may do more
    std::vector<float> logits_;
    EngineStats counters_;
    std::vector<std::pair<OutputCallback, RequestOutput>> finals_;  // for DeliverFinals

    // Shared with submitters.
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::vector<std::unique_ptr<Sequence>> inbox_;
    std::vector<std::pair<std::string, Status>> aborts_;
    std::vector<std::shared_ptr<std::promise<bool>>> flushes_;  // FlushPrefixCache's asks
    std::unordered_map<std::string, bool> live_ids_;
    EngineStats stats_;
    bool stop_ = false;
    bool wake_ = false;  // the connector queued events
    std::thread thread_;
};

}  // namespace ferry::engine
