#include "serve/serve_flags.h"

#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>
#include <variant>

#include "core/crypto.h"
#include "core/host_port.h"
#include "core/json_depth.h"
#include "http/http.h"
#include "kv/connector_registry.h"
#include "model/vision.h"
#include "serve/ec_connector.h"
#include "tokenizer/tokenizer.h"

namespace ferry::serve {

ServeFlags::ServeFlags() {
    const WorkerConfig w;
    const ServerConfig& s = w.server;
    const engine::EngineConfig& e = w.engine;
    host = s.host;
    port = s.port;
    block_size = e.block_tokens;
    num_kv_blocks = e.num_blocks;
    max_num_seqs = e.max_num_seqs;
    max_num_batched_tokens = e.max_batched_tokens;
    max_prefill_chunk = e.max_prefill_chunk;
    const char* seed = std::getenv("PYTHONHASHSEED");
    prefix_hash_seed = seed != nullptr ? seed : e.prefix_hash_seed;
    max_model_len = e.max_model_len;
    kv_events_bind = w.kv_events.bind;
    kv_events_replays_per_second = w.kv_events.replays_per_second;
    max_image_bytes = s.media.limits.max_encoded_bytes;
    max_image_pixels = s.media.limits.max_pixels;
    encoder_cache_mib = double(s.encoder_cache_bytes >> 20);
    encoder_cache_disk_mib = double(s.encoder_cache_disk_bytes >> 20);
    max_pending_image_requests = s.max_pending_image_requests;
    max_connections = s.max_connections;
    max_inflight_body_mib = s.max_inflight_body_bytes >> 20;
    request_deadline_ms = s.request_deadline.count();
    kv_connector = w.kv_connector;
    const kv::AgentConnectorOptions o;  // the built-in kind's
    kv_transfer = o.default_mode == kv::KvTransferMode::kPush ? "push" : "pull";
    kv_hold_lease_ms = o.hold_lease.count();
    kv_transfer_timeout_ms = o.transfer_timeout.count();
    kv_handshake_timeout_ms = o.handshake_timeout.count();
    kv_verify = std::string(kv::KvVerifyModeName(o.verify));
    kv_client_hold_blocks = o.max_client_hold_blocks;
    kv_client_loads = o.max_client_loads;
    ec_buffer_mib = w.ec.buffer_bytes >> 20;
    ec_lease_ms = w.ec.lease.count();
    ec_transfer_timeout_ms = w.ec.pull_timeout.count();
    encoder_timeout_ms = s.encoder_timeout.count();
    remote_prefill_min_tokens = s.remote_prefill_min_tokens;
    remote_prefill_timeout_ms = s.remote_prefill_timeout.count();
    agent_lookup_timeout_ms = s.agent_timeout.count();
    store_ttl_ms = w.registration_ttl.count();
}

namespace {

using Field = std::variant<std::string ServeFlags::*, int ServeFlags::*, int64_t ServeFlags::*,
                           uint64_t ServeFlags::*, double ServeFlags::*, bool ServeFlags::*,
                           std::vector<std::string> ServeFlags::*>;

// One flag: its name, field and help; its values' check (an integer or a real range, or one of
// some names); whether --help shows its default.
struct Flag {
    std::string name;
    Field field;
    std::string help = {};
    std::variant<std::monostate, std::pair<int64_t, int64_t>, std::pair<uint64_t, uint64_t>,
                 std::pair<double, double>>
        range = {};
    std::vector<std::string> one_of = {};
    bool show_default = false;
};

std::string Joined(const std::vector<std::string>& names) {
    std::string s;
    for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
    return s;
}

std::string EcConnectorHelp() {
    // The registered kinds (serve/ec_connector.h), each with its line.
    std::string help = "EPD: how image embeddings move from encode workers:";
    for (const std::string& name : EcConnectorNames()) {
        help += fmt::format(" {} ({});", name, FindEcConnector(name)->description);
    }
    help.back() = '.';
    return help;
}

const std::vector<Flag>& Flags() {
    using I = std::pair<int64_t, int64_t>;
    using U = std::pair<uint64_t, uint64_t>;
    using R = std::pair<double, double>;
    constexpr int64_t kHour = 3600000, kDay = 86400000;
    static const std::vector<Flag> flags = {
        {"--model", &ServeFlags::model, "GGUF model file"},
        {"--host", &ServeFlags::host, "address to listen on", {}, {}, true},
        {"--port", &ServeFlags::port, "port (0: any free port, printed)", I{0, 65535}, {}, true},
        {"--served-model-name", &ServeFlags::served_model_name,
         "model name in the API (default: the model's name)"},
        {"--tp", &ServeFlags::tp, "tensor-parallel ranks (threads)", I{1, 64}},
        {"--block-size", &ServeFlags::block_size, "tokens per KV block", I{1, 1024}, {}, true},
        {"--kv-cache-mib",
         &ServeFlags::kv_cache_mib,
         "KV cache size, all ranks",
         I{1, 1 << 20},
         {},
         true},
        {"--num-kv-blocks", &ServeFlags::num_kv_blocks, "KV blocks (overrides --kv-cache-mib)",
         I{0, 1 << 24}},
        {"--kv-dtype",
         &ServeFlags::kv_dtype,
         "KV cache type: f32, f16, bf16",
         {},
         {"f32", "f16", "bf16"}},
        {"--max-num-seqs",
         &ServeFlags::max_num_seqs,
         "sequences per step",
         I{1, 1 << 16},
         {},
         true},
        {"--max-num-batched-tokens",
         &ServeFlags::max_num_batched_tokens,
         "tokens per step (0: 2048, or the max model length without chunked prefill, as vLLM)",
         I{0, 1 << 20},
         {},
         true},
        {"--max-prefill-chunk", &ServeFlags::max_prefill_chunk,
         "most prompt tokens of one sequence per step (0: no limit)", I{0, 1 << 20}},
        {"--no-chunked-prefill", &ServeFlags::no_chunked_prefill,
         "prefill each prompt in one step"},
        {"--no-prefix-caching", &ServeFlags::no_prefix_caching, "disable automatic prefix caching"},
        {"--prefix-hash-seed",
         &ServeFlags::prefix_hash_seed,
         "the seed of the prefix cache's block hashes, vLLM's sha256_cbor form (default "
         "$PYTHONHASHSEED, as vLLM, else 0): routers and vLLM-compatible KV-aware routers "
         "recompute them with it",
         {},
         {},
         true},
        {"--kv-events-endpoint", &ServeFlags::kv_events_endpoint,
         "publish KV events (blocks stored, removed, all cleared) in vLLM's wire format on this "
         "ZeroMQ PUB endpoint, e.g. tcp://*:5557 (bound; an address without '*' is connected "
         "to); off by default"},
        {"--kv-events-bind", &ServeFlags::kv_events_bind,
         "bind --kv-events-endpoint even without '*' (one interface: tcp://10.0.0.5:5557), "
         "where vLLM's rule would connect to it"},
        {"--kv-events-replay-endpoint", &ServeFlags::kv_events_replay_endpoint,
         "ZeroMQ ROUTER endpoint that replays missed batches, e.g. tcp://*:5558"},
        {"--kv-events-topic", &ServeFlags::kv_events_topic, "the events' topic frame (vLLM: \"\")"},
        {"--kv-events-replays-per-second",
         &ServeFlags::kv_events_replays_per_second,
         "replay requests served per second (each sends up to the whole 10 000-batch buffer); "
         "more get no answer",
         R{0.1, 1e6},
         {},
         true},
        {"--kv-events-layout",
         &ServeFlags::kv_events_layout,
         "vllm (vLLM's current structs, 32-byte hashes) or legacy (array_like structs and "
         "64-bit integer hashes, as vLLM's example subscriber decodes)",
         {},
         {"vllm", "legacy"},
         true},
        {"--max-model-len", &ServeFlags::max_model_len, "context limit (0: the model's)",
         I{0, 1 << 24}},
        // Images (docs/inference.md).
        {"--mmproj", &ServeFlags::mmproj,
         "the vision encoder (llama.cpp's mmproj GGUF, projector mlp): chat requests may then "
         "carry image_url parts"},
        {"--limit-mm-per-prompt", &ServeFlags::limit_mm_per_prompt,
         "images one request may carry, as vLLM: '{\"image\": N}' (default 8)"},
        {"--max-image-bytes",
         &ServeFlags::max_image_bytes,
         "bytes of one encoded image (a file or a data: URL's payload)",
         U{1, uint64_t{1} << 32},
         {},
         true},
        {"--max-image-pixels",
         &ServeFlags::max_image_pixels,
         "width x height of one decoded image, checked before decoding",
         U{1, uint64_t{1} << 32},
         {},
         true},
        {"--allowed-local-media-path", &ServeFlags::allowed_local_media_path,
         "file:// image URLs are read only from under this directory (default: none are)"},
        {"--encoder-cache-mib",
         &ServeFlags::encoder_cache_mib,
         "image embeddings kept in memory by mm_hash, least recently used out (0: none)",
         R{0, double(1 << 20)},
         {},
         true},
        {"--encoder-cache-dir", &ServeFlags::encoder_cache_dir,
         "the encoder cache's disk tier: embeddings evicted from memory are kept in files here "
         "(made if missing; one worker a directory) and found again, also after a restart"},
        {"--encoder-cache-disk-mib",
         &ServeFlags::encoder_cache_disk_mib,
         "--encoder-cache-dir: its files' capacity, least recently used out",
         R{0, double(1 << 24)},
         {},
         true},
        {"--max-pending-image-requests",
         &ServeFlags::max_pending_image_requests,
         "requests with images waiting for the encoder; more get 503",
         I{1, 1 << 20},
         {},
         true},
        {"--chat-template",
         &ServeFlags::chat_template,
         "chatml, llama3 or llama2 (default: from the model file)",
         {},
         {"chatml", "llama3", "llama2"}},
        {"--max-connections",
         &ServeFlags::max_connections,
         "concurrent HTTP connections",
         I{1, 65536},
         {},
         true},
        {"--max-inflight-body-mib",
         &ServeFlags::max_inflight_body_mib,
         "request bodies held at once, over all connections, with the copies of their images "
         "that wait for the encoder; more get 503",
         U{1, 1 << 20},
         {},
         true},
        {"--request-deadline-ms",
         &ServeFlags::request_deadline_ms,
         "close a connection that has not sent a complete request this long after connecting or "
         "after its previous response (slowloris)",
         I{100, kHour},
         {},
         true},
        // Disaggregation (docs/disaggregation.md).
        {"--role",
         &ServeFlags::role,
         "colocated (prefill and decode here), prefill or decode (KV moves to or from other "
         "workers through the transfer engine), or encode (the vision encoder alone: needs "
         "--mmproj and --ec-connector)",
         {},
         {"colocated", "prefill", "decode", "encode"},
         true},
        {"--kv-transfer",
         &ServeFlags::kv_transfer,
         "protocol of requests whose kv_transfer_params do not say: pull (vLLM's NixlConnector: "
         "the decoder reads the held blocks) or push (layer-wise writes from the prefill "
         "worker)",
         {},
         {"pull", "push"},
         true},
        {"--kv-connector",
         &ServeFlags::kv_connector,
         "the KV connector's kind (registered: " + Joined(kv::KvConnectorNames()) +
             "); it defines and parses kv_transfer_params",
         {},
         kv::KvConnectorNames(),
         true},
        {"--kv-connector-config", &ServeFlags::kv_connector_config,
         "the KV connector kind's own options, a JSON object (vLLM's kv_connector_extra_config); "
         "for the built-in kind its keys override the --kv-* flags (docs/disaggregation.md)"},
        {"--kv-backend",
         &ServeFlags::kv_backend,
         "transfer backend for KV: auto, shm, tcp, ucx",
         {},
         {"auto", "shm", "tcp", "ucx"},
         true},
        {"--agent-listen",
         &ServeFlags::agent_listen,
         "the transfer agent's HOST:PORT",
         {},
         {},
         true},
        {"--agent-name", &ServeFlags::agent_name,
         "the agent's name (remote_engine_id; default ferry-ROLE-PID)"},
        {"--store", &ServeFlags::store, "discovery store for the agent (http://H:P, etcd://H:P)"},
        {"--secret-file", &ServeFlags::secret_file, "deployment secret for the agent"},
        {"--kv-hold-lease-ms",
         &ServeFlags::kv_hold_lease_ms,
         "prefill: free held blocks no decoder claimed within this time",
         I{100, kHour},
         {},
         true},
        {"--kv-transfer-timeout-ms",
         &ServeFlags::kv_transfer_timeout_ms,
         "fail a KV transfer not done this long after it started",
         I{100, kHour},
         {},
         true},
        {"--kv-handshake-timeout-ms",
         &ServeFlags::kv_handshake_timeout_ms,
         "give up on a peer agent that has not completed the KV handshake by then",
         I{100, 600000},
         {},
         true},
        {"--kv-verify",
         &ServeFlags::kv_verify,
         "checksums of the KV that arrives, compared with the sender's (a mismatch fails the "
         "request): off, sample (one unit in 16 of layers x heads x K|V, at random per request) "
         "or all",
         {},
         {"off", "sample", "all"},
         true},
        {"--kv-peers", &ServeFlags::kv_peers,
         "the only agents (HOST:PORT) this worker dials for KV; without it, with --store they "
         "are found by name there, with a secret those the router names, and otherwise any "
         "address a request names (docs/security.md)"},
        {"--kv-client-hold-blocks",
         &ServeFlags::kv_client_hold_blocks,
         "prefill: KV blocks one client (an address; the router is exempt) may have held "
         "unclaimed for remote decoders (-1: a quarter of the cache, 0: no cap)",
         I{-1, 1 << 24},
         {},
         true},
        {"--kv-client-loads",
         &ServeFlags::kv_client_loads,
         "decode: KV loads one client (the router is exempt) may have in flight (0: no cap)",
         I{0, 1 << 24},
         {},
         true},
        {"--ec-connector", &ServeFlags::ec_connector, EcConnectorHelp(), {}, EcConnectorNames()},
        {"--ec-dir", &ServeFlags::ec_dir, "--ec-connector disk: the shared directory"},
        {"--kv-load-failure",
         &ServeFlags::kv_load_failure,
         "vLLM's kv_load_failure_policy, on a decode worker: when a request's remote KV does not "
         "arrive (the prefill worker gone, a refused claim, a failed transfer), fail it (503) or "
         "compute its prompt here (recompute: the same answer, later)",
         {},
         {"fail", "recompute"},
         true},
        {"--ec-load-failure",
         &ServeFlags::ec_load_failure,
         "when embeddings an encode worker should hold cannot be loaded: encode here, or fail "
         "the request (503)",
         {},
         {"encode", "fail"},
         true},
        {"--ec-buffer-mib",
         &ServeFlags::ec_buffer_mib,
         "--role encode with transfer: memory for published embeddings",
         U{1, 1 << 20},
         {},
         true},
        {"--ec-lease-ms",
         &ServeFlags::ec_lease_ms,
         "--role encode with transfer: how long published embeddings are kept for a consumer "
         "that has not pulled them",
         I{100, kHour},
         {},
         true},
        {"--ec-transfer-timeout-ms",
         &ServeFlags::ec_transfer_timeout_ms,
         "transfer: give up on a pull (then --ec-load-failure) after this long",
         I{10, 600000},
         {},
         true},
        {"--encoder-urls", &ServeFlags::encoder_urls,
         "EPD without a router step (SGLang's): encode workers (HOST:PORT or URL) this worker "
         "sends its requests with images to, then loads their embeddings (needs "
         "--ec-connector)"},
        {"--remote-prefill", &ServeFlags::remote_prefill,
         "decode-first: prefill workers (HOST:PORT) that prefill prompts for this decode worker "
         "and push the KV (needs --role decode)"},
        {"--remote-prefill-min-tokens", &ServeFlags::remote_prefill_min_tokens,
         "decode-first: shorter prompts are prefilled here", I{0, 1 << 24}},
        {"--bootstrap-port", &ServeFlags::bootstrap_port,
         "SGLang's PD protocol (mini_lb's bootstrap_host/port/room): --role prefill serves "
         "SGLang's "
         "bootstrap server on this port (0: any free port; -1: none); --role decode uses it for "
         "requests whose bootstrap_port is null (-1: SGLang's 8998)",
         I{-1, 65535}},
        {"--encoder-timeout-ms",
         &ServeFlags::encoder_timeout_ms,
         "--encoder-urls: an encode worker that has not answered by then costs only the "
         "encoding (done here) and gets no request until it answers a probe",
         I{100, kDay},
         {},
         true},
        {"--remote-prefill-timeout-ms",
         &ServeFlags::remote_prefill_timeout_ms,
         "decode-first: a prefill worker that has not answered by then fails the request (503) "
         "and gets no prompt until it answers a probe",
         I{100, kDay},
         {},
         true},
        {"--agent-lookup-timeout-ms",
         &ServeFlags::agent_lookup_timeout_ms,
         "decode-first: asking a prefill worker where its agent is (GET /v1/kv/agent) gives up "
         "after this long",
         I{100, 600000},
         {},
         true},
        {"--store-ttl-ms",
         &ServeFlags::store_ttl_ms,
         "with --store: the lease of this worker's record there, which routers follow; a worker "
         "that dies unannounced drops out within it",
         I{300, kHour},
         {},
         true},
        {"--drain-timeout-ms",
         &ServeFlags::drain_timeout_ms,
         "on SIGTERM: leave the store, answer /health with 503 and finish what is in flight for "
         "at most this long before stopping (0: stop at once; SIGINT or a second signal always "
         "stops at once)",
         I{0, kDay},
         {},
         true},
    };
    return flags;
}

template <class T>
std::string Text(const T& v) {
    return fmt::format("{}", v);
}

}  // namespace

void AddServeFlags(CLI::App& cmd, ServeFlags& flags) {
    for (const Flag& f : Flags()) {
        CLI::Option* o = std::visit(
            [&](auto member) -> CLI::Option* {
                auto& value = flags.*member;
                if constexpr (std::is_same_v<std::decay_t<decltype(value)>, bool>) {
                    return cmd.add_flag(f.name, value, f.help);
                } else {
                    return cmd.add_option(f.name, value, f.help);
                }
            },
            f.field);
        if (auto* r = std::get_if<std::pair<int64_t, int64_t>>(&f.range)) {
            o->check(CLI::Range(r->first, r->second));
        } else if (auto* u = std::get_if<std::pair<uint64_t, uint64_t>>(&f.range)) {
            o->check(CLI::Range(u->first, u->second));
        } else if (auto* d = std::get_if<std::pair<double, double>>(&f.range)) {
            o->check(CLI::Range(d->first, d->second));
        }
        if (!f.one_of.empty()) o->check(CLI::IsMember(f.one_of));
        if (f.show_default) o->capture_default_str();
        if (f.name == "--model") o->required();
    }
}

std::vector<std::string> ServeArgs(const ServeFlags& flags) {
    static const ServeFlags defaults;
    std::vector<std::string> args;
    for (const Flag& f : Flags()) {
        std::visit(
            [&](auto member) {
                const auto& value = flags.*member;
                using T = std::decay_t<decltype(value)>;
                if (value == defaults.*member && f.name != "--model") return;
                if constexpr (std::is_same_v<T, bool>) {
                    if (value) args.push_back(f.name);
                } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
                    for (const std::string& v : value) args.insert(args.end(), {f.name, v});
                } else {
                    args.insert(args.end(), {f.name, Text(value)});
                }
            },
            f.field);
    }
    return args;
}

Status ParseServeArgs(const std::vector<std::string>& args, ServeFlags* flags) {
    CLI::App app("ferry serve");
    AddServeFlags(app, *flags);
    app.get_option("--model")->required(false);
    std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes them so
    try {
        app.parse(reversed);
    } catch (const CLI::ParseError& e) {
        return InvalidArgumentError(std::string("ferry serve: ") + e.what());
    }
    return Status::Ok();
}

Result<WorkerConfig> ToWorkerConfig(const ServeFlags& f) {
    WorkerConfig wc;
    ServerConfig& sc = wc.server;
    engine::EngineConfig& ec = wc.engine;
    FERRY_ASSIGN_OR_RETURN(wc.role, ParseWorkerRole(f.role));
    FERRY_ASSIGN_OR_RETURN(ec.kv_load_failure, engine::ParseKvLoadFailure(f.kv_load_failure));
    if (!f.encoder_urls.empty() && (f.ec_connector.empty() || wc.role == WorkerRole::kEncode)) {
        return InvalidArgumentError(
            "--encoder-urls needs --ec-connector and a role other than encode");
    }
    if (!f.encoder_cache_dir.empty() && f.mmproj.empty()) {
        return InvalidArgumentError("--encoder-cache-dir needs --mmproj");
    }
    if (f.kv_events_endpoint.empty() && !f.kv_events_replay_endpoint.empty()) {
        return InvalidArgumentError("--kv-events-replay-endpoint needs --kv-events-endpoint");
    }
    // The server.
    sc.host = f.host;
    sc.port = f.port;
    sc.served_model_name = f.served_model_name;
    sc.max_connections = f.max_connections;
    sc.max_inflight_body_bytes = size_t(f.max_inflight_body_mib) << 20;
    sc.request_deadline = std::chrono::milliseconds(f.request_deadline_ms);
    sc.media.limits.max_encoded_bytes = f.max_image_bytes;
    sc.media.limits.max_pixels = f.max_image_pixels;
    sc.media.allowed_local_media_path = f.allowed_local_media_path;
    if (!f.limit_mm_per_prompt.empty()) {
        const nlohmann::json j = nlohmann::json::parse(f.limit_mm_per_prompt, nullptr, false);
        if (!j.is_object() || j.size() != 1 || !j.contains("image") ||
            !j["image"].is_number_integer() || j["image"].get<int64_t>() < 0 ||
            j["image"].get<int64_t>() > 1024) {
            return InvalidArgumentError(
                fmt::format("--limit-mm-per-prompt: '{}' is not {{\"image\": N}} with N in 0..1024",
                            f.limit_mm_per_prompt));
        }
        sc.media.limits.max_images = j["image"].get<int>();
    }
    sc.encoder_cache_bytes = uint64_t(f.encoder_cache_mib * (1 << 20));
    sc.encoder_cache_dir = f.encoder_cache_dir;
    sc.encoder_cache_disk_bytes = uint64_t(f.encoder_cache_disk_mib * (1 << 20));
    sc.max_pending_image_requests = f.max_pending_image_requests;
    FERRY_ASSIGN_OR_RETURN(sc.ec_load_failure, ParseEcLoadFailure(f.ec_load_failure));
    sc.encoder_timeout = std::chrono::milliseconds(f.encoder_timeout_ms);
    sc.remote_prefill_min_tokens = f.remote_prefill_min_tokens;
    sc.sglang_bootstrap_port = f.bootstrap_port;
    sc.remote_prefill_timeout = std::chrono::milliseconds(f.remote_prefill_timeout_ms);
    sc.agent_timeout = std::chrono::milliseconds(f.agent_lookup_timeout_ms);
    for (const std::string& u : f.remote_prefill) {
        auto ep = http::ParseEndpoint(u);
        if (!ep.ok()) return ep.status().WithContext("--remote-prefill");
        sc.remote_prefill.push_back(*ep);
    }
    for (const std::string& u : f.encoder_urls) {
        auto ep = http::ParseEndpoint(u);
        if (!ep.ok()) return ep.status().WithContext("--encoder-urls");
        sc.encoder_urls.push_back(*ep);
    }
    // The engine.
    ec.block_tokens = f.block_size;
    ec.num_blocks = f.num_kv_blocks;
    ec.kv_cache_bytes = uint64_t(f.kv_cache_mib) << 20;
    FERRY_ASSIGN_OR_RETURN(ec.kv_dtype, kv::ParseKvDtype(f.kv_dtype));
    ec.max_num_seqs = f.max_num_seqs;
    ec.max_batched_tokens = f.max_num_batched_tokens;
    ec.max_prefill_chunk = f.max_prefill_chunk;
    ec.chunked_prefill = !f.no_chunked_prefill;
    ec.prefix_caching = !f.no_prefix_caching;
    ec.prefix_hash_seed = f.prefix_hash_seed;
    ec.max_model_len = f.max_model_len;
    // KV events.
    wc.kv_events.endpoint = f.kv_events_endpoint;
    wc.kv_events.bind = f.kv_events_bind;
    wc.kv_events.replay_endpoint = f.kv_events_replay_endpoint;
    wc.kv_events.topic = f.kv_events_topic;
    wc.kv_events.replays_per_second = f.kv_events_replays_per_second;
    FERRY_ASSIGN_OR_RETURN(wc.kv_events.layout, schema::ParseKvEventsLayout(f.kv_events_layout));
    // The encoder-cache connector.
    wc.ec.kind = f.ec_connector;
    wc.ec.dir = f.ec_dir;
    wc.ec.buffer_bytes = f.ec_buffer_mib << 20;
    wc.ec.lease = std::chrono::milliseconds(f.ec_lease_ms);
    wc.ec.pull_timeout = std::chrono::milliseconds(f.ec_transfer_timeout_ms);
    // The agent and the KV connector, for the roles that move KV (and a transfer EC connector).
    wc.kv_connector = f.kv_connector;
    if (wc.role != WorkerRole::kColocated || f.ec_connector == "transfer") {  // has an agent
        wc.agent.name = f.agent_name;
        auto listen = http::ParseListenAddress(f.agent_listen);
        if (!listen.ok()) return listen.status().WithContext("--agent-listen");
        wc.agent.listen_host = listen->host;
        wc.agent.listen_port = static_cast<uint16_t>(listen->port);
        if (f.kv_backend != "auto") {
            wc.agent.backends = {f.kv_backend};
            wc.agent.force_backend = f.kv_backend;
        } else {
            wc.agent.backends = AvailableBackends();
        }
        wc.agent.store = f.store;
        for (const std::string& p : f.kv_peers) {
            auto ep = http::ParseEndpoint(p);
            if (!ep.ok()) return ep.status().WithContext("--kv-peers");
            wc.allowed_agents.push_back(FormatHostPort(ep->host, ep->port));
        }
    }
    // The KV connector's options: the built-in kind's from its flags, then --kv-connector-config
    // over them; another kind's from --kv-connector-config alone. Checked when the worker
    // starts (the kind's check_options).
    nlohmann::json options = nlohmann::json::object();
    if (f.kv_connector == kv::kDefaultKvConnector) {
        kv::AgentConnectorOptions o;
        o.hold_lease = std::chrono::milliseconds(f.kv_hold_lease_ms);
        o.transfer_timeout = std::chrono::milliseconds(f.kv_transfer_timeout_ms);
        o.handshake_timeout = std::chrono::milliseconds(f.kv_handshake_timeout_ms);
        FERRY_ASSIGN_OR_RETURN(o.verify, kv::ParseKvVerifyMode(f.kv_verify));
        o.max_client_hold_blocks = f.kv_client_hold_blocks;
        o.max_client_loads = f.kv_client_loads;
        o.default_mode =
            f.kv_transfer == "push" ? kv::KvTransferMode::kPush : kv::KvTransferMode::kPull;
        options = kv::AgentConnectorOptionsJson(o);
    }
    if (!f.kv_connector_config.empty()) {
        if (!JsonDepthWithin(f.kv_connector_config, 16)) {
            return InvalidArgumentError("--kv-connector-config: nests too deep");
        }
        nlohmann::json given = nlohmann::json::parse(f.kv_connector_config, nullptr, false);
        if (!given.is_object()) {
            return InvalidArgumentError(
                "--kv-connector-config: must be a JSON object (the kind's options)");
        }
        for (auto& [key, value] : given.items()) options[key] = value;
    }
    wc.kv_connector_options = std::move(options);
    // The secret ($FERRY_SECRET without --secret-file): the agent's; a colocated worker without
    // an agent takes it only from --secret-file, for its router token (what --encoder-urls
    // calls carry).
    const bool has_agent = wc.role != WorkerRole::kColocated || f.ec_connector == "transfer";
    if (has_agent || !f.secret_file.empty()) {
        FERRY_ASSIGN_OR_RETURN(wc.agent.secret, LoadDeploymentSecret(f.secret_file));
    }
    wc.registration_ttl = std::chrono::milliseconds(f.store_ttl_ms);
    // The files, last: a config that cannot work fails before loading them.
    auto loaded = model::Model::Load(f.model, {.tp = f.tp});
    if (!loaded.ok()) return loaded.status().WithContext("--model");
    wc.model = std::move(loaded).value();
    if (!f.chat_template.empty()) {
        FERRY_ASSIGN_OR_RETURN(tokenizer::ChatTemplate t,
                               tokenizer::ParseChatTemplate(f.chat_template));
        wc.model->mutable_tokenizer().set_chat_template(t);
    }
    if (!f.mmproj.empty()) {
        auto v = model::VisionEncoder::Load(f.mmproj);
        if (!v.ok()) return v.status().WithContext("--mmproj");
        sc.vision = std::move(v).value();
    }
    return wc;
}

}  // namespace ferry::serve
