// `ferry serve`'s command line in one place: every flag as a field, each default the config's
// own (WorkerConfig and the configs it nests) or, for what only the command line has, written
// here once; the flags' names, help and checks in one table (AddServeFlags); the conversion to
// a WorkerConfig (ToWorkerConfig); and the argv that launches a worker with given flags
// (ServeArgs), which `ferry demo` and the tests' worker processes use instead of spelling flags.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/status.h"
#include "serve/worker.h"

namespace CLI {
class App;
}

namespace ferry::serve {

struct ServeFlags {
    ServeFlags();

    std::string model;  // required
    std::string host;
    int port;
    std::string served_model_name;
    int tp = 1;
    // The engine (engine::EngineConfig).
    int block_size;
    int kv_cache_mib = 512;  // the command's own default (EngineConfig's is 256 MiB)
    int num_kv_blocks;
    std::string kv_dtype = "f32";
    int max_num_seqs;
    int max_num_batched_tokens;
    int max_prefill_chunk;
    bool no_chunked_prefill = false;
    bool no_prefix_caching = false;
    std::string prefix_hash_seed;  // $PYTHONHASHSEED as vLLM, else the engine's
    int max_model_len;
    // KV events (KvEventsConfig).
    std::string kv_events_endpoint;
    bool kv_events_bind;
    std::string kv_events_replay_endpoint;
    std::string kv_events_topic;
    double kv_events_replays_per_second;
    std::string kv_events_layout = "vllm";
    // Images (ServerConfig, media::ImageLimits).
    std::string mmproj;
    std::string limit_mm_per_prompt;  // '{"image": N}'
    uint64_t max_image_bytes;
    uint64_t max_image_pixels;
    std::string allowed_local_media_path;
    double encoder_cache_mib;
    std::string encoder_cache_dir;
    double encoder_cache_disk_mib;
    int max_pending_image_requests;
    std::string chat_template;
    // HTTP (ServerConfig).
    int max_connections;
    uint64_t max_inflight_body_mib;
    int64_t request_deadline_ms;
    // Disaggregation (AgentConfig, the built-in KV connector's kv::AgentConnectorOptions).
    std::string role = "colocated";
    std::string kv_transfer;
    std::string kv_connector;
    std::string kv_connector_config;  // the kind's options, a JSON object
    std::string kv_backend = "auto";
    std::string agent_listen = "127.0.0.1:0";
    std::string agent_name;
    std::string store;
    std::string secret_file;
    int64_t kv_hold_lease_ms;
    int64_t kv_transfer_timeout_ms;
    int64_t kv_handshake_timeout_ms;
    std::string kv_verify;
    std::vector<std::string> kv_peers;
    int kv_client_hold_blocks;
    int kv_client_loads;
    // EPD (EcConnectorConfig, ServerConfig).
    std::string ec_connector;
    std::string ec_dir;
    std::string ec_load_failure = "encode";
    std::string kv_load_failure = "fail";
    uint64_t ec_buffer_mib;
    int64_t ec_lease_ms;
    int64_t ec_transfer_timeout_ms;
    std::vector<std::string> encoder_urls;
    int64_t encoder_timeout_ms;
    // Decode-first (ServerConfig).
    std::vector<std::string> remote_prefill;
    int remote_prefill_min_tokens;
    // SGLang's PD protocol (ServerConfig::sglang_bootstrap_port).
    int bootstrap_port = -1;
    int64_t remote_prefill_timeout_ms;
    int64_t agent_lookup_timeout_ms;
    // The store record and shutdown.
    int64_t store_ttl_ms;
    int64_t drain_timeout_ms = 30000;  // the command's: how long SIGTERM drains
};

// Adds every flag to `cmd`, parsed into `flags` (whose values are the defaults shown).
void AddServeFlags(CLI::App& cmd, ServeFlags& flags);

// The arguments after `ferry serve` that parse back to `flags`: the flags whose values differ
// from a default ServeFlags, in the table's order (--model always).
std::vector<std::string> ServeArgs(const ServeFlags& flags);

// Parses `args` (what follows `ferry serve`) over `flags`: the flags named take their values, the
// others keep theirs (--model is not required here). InvalidArgument with CLI11's message.
Status ParseServeArgs(const std::vector<std::string>& args, ServeFlags* flags);

// The worker's config: checks what the table's checks cannot (flags that need one another,
// URLs, '{"image": N}'), loads the model, the vision encoder (--mmproj) and the deployment
// secret. InvalidArgument naming the flag; the loaders' errors with the flag as context.
Result<WorkerConfig> ToWorkerConfig(const ServeFlags& flags);

}  // namespace ferry::serve
