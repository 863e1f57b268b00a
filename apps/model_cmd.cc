#include "model_cmd.h"

#include <fmt/core.h>
#include <signal.h>

#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench/model/model_bench.h"
#include "core/crypto.h"
#include "core/host_port.h"
#include "discovery_cmd.h"
#include "engine/engine.h"
#include "ferry/agent.h"
#include "http/http.h"
#include "kv/agent_connector.h"
#include "kv/connector_registry.h"
#include "model/model.h"
#include "model/vision.h"
#include "serve/ec_connector.h"
#include "serve/openai_server.h"
#include "serve/worker.h"

namespace ferry::cli {

namespace {

std::vector<int> ParseIntList(const std::string& flag, const std::string& text, int lo, int hi) {
    std::vector<int> out;
    size_t start = 0;
    while (true) {
        size_t comma = text.find(',', start);
        std::string item =
            text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        char* end = nullptr;
        long v = std::strtol(item.c_str(), &end, 10);
        if (item.empty() || *end != '\0' || v < lo || v > hi) {
            throw CLI::ValidationError(
                flag, fmt::format("'{}' is not an integer in {}..{}", item, lo, hi));
        }
        out.push_back(static_cast<int>(v));
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    return out;
}

}  // namespace

void AddModelCommand(CLI::App& app, int* rc) {
    CLI::App* model = app.add_subcommand("model", "Make or inspect model files");
    model->require_subcommand(1);

    CLI::App* init = model->add_subcommand(
        "init", "Write a deterministic random-weight llama model (GGUF) with a byte vocabulary");
    static std::string preset = "tiny", out, dtype = "f32";
    static uint64_t seed = 1;
    init->add_option("--preset", preset,
                     "tiny (4 layers, dim 256) or small (12 layers, dim 768); tiny-mla and "
                     "small-mla: the same with multi-head latent attention (deepseek2); tiny-vl "
                     "and small-vl: tiny and small with a vision encoder (an mmproj file, "
                     "--mmproj-out)")
        ->check(CLI::IsMember({"tiny", "small", "tiny-mla", "small-mla", "tiny-vl", "small-vl"}));
    static std::string mmproj_out;
    init->add_option("--mmproj-out", mmproj_out,
                     "tiny-vl and small-vl: where the vision projector goes (llama.cpp's mmproj "
                     "GGUF; default: --out with -mmproj before .gguf)");
    init->add_option("--seed", seed, "weights seed");
    init->add_option("--out", out, "output .gguf file")->required();
    init->add_option("--dtype", dtype, "weight type: f32, f16 or bf16")
        ->check(CLI::IsMember({"f32", "f16", "bf16"}));
    static std::string vocab;
    init->add_option("--vocab", vocab,
                     "take the tokenizer from this GGUF file (a real model's vocabulary, e.g. "
                     "tests/data/tokenizers/ggml-vocab-falcon.gguf) instead of the byte one")
        ->check(CLI::ExistingFile);
    init->callback([rc] {
        const bool vl = preset.ends_with("-vl");
        auto spec = model::PresetSpec(vl ? preset.substr(0, preset.size() - 3) : preset);
        spec->vocab_file = vocab;
        spec->dtype = dtype == "f16"    ? gguf::TensorType::kF16
                      : dtype == "bf16" ? gguf::TensorType::kBF16
                                        : gguf::TensorType::kF32;
        Status st = model::WriteRandomModel(*spec, seed, out);
        if (!st.ok()) {
            fmt::print(stderr, "ferry model init: {}\n", st.ToString());
            *rc = 1;
            return;
        }
        fmt::print("wrote {} ({} preset, seed {}, {} weights, {})\n", out, preset, seed, dtype,
                   vocab.empty() ? "byte vocabulary" : "vocabulary of " + vocab);
        if (!vl) return;
        std::string proj = mmproj_out;
        if (proj.empty()) {
            proj = out.ends_with(".gguf") ? out.substr(0, out.size() - 5) : out;
            proj += "-mmproj.gguf";
        }
        model::RandomVisionSpec vs = *model::PresetVisionSpec(preset);
        st = model::WriteRandomMmproj(vs, seed, proj);
        if (!st.ok()) {
            fmt::print(stderr, "ferry model init: {}\n", st.ToString());
            *rc = 1;
            return;
        }
        fmt::print("wrote {} (vision encoder: {} tokens an image, {}x{} pixels)\n", proj,
                   (vs.image_size / vs.patch_size) * (vs.image_size / vs.patch_size), vs.image_size,
                   vs.image_size);
    });

    CLI::App* info = model->add_subcommand("info", "Print a GGUF model's configuration");
    static std::string info_path;
    info->add_option("path", info_path, "a .gguf file")->required();
    info->callback([rc] {
        auto m = model::Model::Load(info_path);
        if (!m.ok()) {
            fmt::print(stderr, "ferry model info: {}\n", m.status().ToString());
            *rc = 1;
            return;
        }
        const model::ModelConfig& c = (*m)->config();
        const tokenizer::Tokenizer& t = (*m)->tokenizer();
        fmt::print(
            "name {}\nparameters {:.1f} M\nlayers {}\ndim {}\nheads {} (kv {}), head dim {}\n"
            "ffn {}\nvocab {} ({} tokenizer, chat template {})\ncontext {}\nrope theta {}\n"
            "tied embeddings {}\n",
            c.name, c.ParamCount() / 1e6, c.num_layers, c.dim, c.num_heads, c.num_kv_heads,
            c.head_dim, c.ffn_dim, c.vocab_size,
            t.kind() == tokenizer::Tokenizer::Kind::kSentencePiece ? "sentencepiece" : "byte-bpe",
            tokenizer::ChatTemplateName(t.chat_template()), c.context_length, c.rope_theta,
            c.tied_embeddings);
    });
}

void AddServeCommand(CLI::App& app, int* rc) {
    CLI::App* serve = app.add_subcommand(
        "serve", "Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions)");
    static std::string model_path, kv_dtype = "f32", chat_template;
    static serve::ServerConfig sc;
    static engine::EngineConfig ec;
    static int tp = 1, kv_mib = 512;
    static bool no_chunked = false, no_prefix = false;
    serve->add_option("--model", model_path, "GGUF model file")->required();
    serve->add_option("--host", sc.host, "address to listen on")->capture_default_str();
    serve->add_option("--port", sc.port, "port (0: any free port, printed)")
        ->check(CLI::Range(0, 65535))
        ->capture_default_str();
    serve->add_option("--served-model-name", sc.served_model_name,
                      "model name in the API (default: the model's name)");
    serve->add_option("--tp", tp, "tensor-parallel ranks (threads)")->check(CLI::Range(1, 64));
    serve->add_option("--block-size", ec.block_tokens, "tokens per KV block")
        ->check(CLI::Range(1, 1024))
        ->capture_default_str();
    serve->add_option("--kv-cache-mib", kv_mib, "KV cache size, all ranks")
        ->check(CLI::Range(1, 1 << 20))
        ->capture_default_str();
    serve->add_option("--num-kv-blocks", ec.num_blocks, "KV blocks (overrides --kv-cache-mib)")
        ->check(CLI::Range(0, 1 << 24));
    serve->add_option("--kv-dtype", kv_dtype, "KV cache type: f32, f16, bf16")
        ->check(CLI::IsMember({"f32", "f16", "bf16"}));
    serve->add_option("--max-num-seqs", ec.max_num_seqs, "sequences per step")
        ->check(CLI::Range(1, 1 << 16))
        ->capture_default_str();
    serve->add_option("--max-num-batched-tokens", ec.max_batched_tokens, "tokens per step")
        ->check(CLI::Range(1, 1 << 20))
        ->capture_default_str();
    serve
        ->add_option("--max-prefill-chunk", ec.max_prefill_chunk,
                     "most prompt tokens of one sequence per step (0: no limit)")
        ->check(CLI::Range(0, 1 << 20));
    serve->add_flag("--no-chunked-prefill", no_chunked, "prefill each prompt in one step");
    serve->add_flag("--no-prefix-caching", no_prefix, "disable automatic prefix caching");
    static std::string hash_seed =
        std::getenv("PYTHONHASHSEED") ? std::getenv("PYTHONHASHSEED") : "0";
    serve
        ->add_option("--prefix-hash-seed", hash_seed,
                     "the seed of the prefix cache's block hashes, vLLM's sha256_cbor form "
                     "(default $PYTHONHASHSEED, as vLLM, else 0): routers and vLLM-compatible "
                     "KV-aware routers recompute them with it")
        ->capture_default_str();
    static std::string kv_events_endpoint, kv_events_replay, kv_events_topic,
        kv_events_layout = "vllm";
    serve->add_option("--kv-events-endpoint", kv_events_endpoint,
                      "publish KV events (blocks stored, removed, all cleared) in vLLM's wire "
                      "format on this ZeroMQ PUB endpoint, e.g. tcp://*:5557 (bound; an address "
                      "without '*' is connected to); off by default");
    static bool kv_events_bind = false;
    serve->add_flag("--kv-events-bind", kv_events_bind,
                    "bind --kv-events-endpoint even without '*' (one interface: "
                    "tcp://10.0.0.5:5557), where vLLM's rule would connect to it");
    serve->add_option("--kv-events-replay-endpoint", kv_events_replay,
                      "ZeroMQ ROUTER endpoint that replays missed batches, e.g. tcp://*:5558");
    serve->add_option("--kv-events-topic", kv_events_topic, "the events' topic frame (vLLM: \"\")");
    static double kv_events_replays = 20;
    serve
        ->add_option("--kv-events-replays-per-second", kv_events_replays,
                     "replay requests served per second (each sends up to the whole 10 000-batch "
                     "buffer); more get no answer")
        ->check(CLI::Range(0.1, 1e6))
        ->capture_default_str();
    serve
        ->add_option("--kv-events-layout", kv_events_layout,
                     "vllm (vLLM's current structs, 32-byte hashes) or legacy (array_like structs "
                     "and 64-bit integer hashes, as vLLM's example subscriber decodes)")
        ->check(CLI::IsMember({"vllm", "legacy"}))
        ->capture_default_str();
    serve->add_option("--max-model-len", ec.max_model_len, "context limit (0: the model's)")
        ->check(CLI::Range(0, 1 << 24));
    // Images (docs/inference.md).
    static std::string mmproj, limit_mm;
    static double encoder_cache_mib = 256, encoder_cache_disk_mib = 4096;
    serve->add_option("--mmproj", mmproj,
                      "the vision encoder (llama.cpp's mmproj GGUF, projector mlp): chat "
                      "requests may then carry image_url parts");
    serve->add_option("--limit-mm-per-prompt", limit_mm,
                      "images one request may carry, as vLLM: '{\"image\": N}' (default 8)");
    serve
        ->add_option("--max-image-bytes", sc.media.limits.max_encoded_bytes,
                     "bytes of one encoded image (a file or a data: URL's payload)")
        ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 32))
        ->capture_default_str();
    serve
        ->add_option("--max-image-pixels", sc.media.limits.max_pixels,
                     "width x height of one decoded image, checked before decoding")
        ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 32))
        ->capture_default_str();
    serve->add_option("--allowed-local-media-path", sc.media.allowed_local_media_path,
                      "file:// image URLs are read only from under this directory (default: "
                      "none are)");
    serve
        ->add_option("--encoder-cache-mib", encoder_cache_mib,
                     "image embeddings kept in memory by mm_hash, least recently used out (0: "
                     "none)")
        ->check(CLI::Range(0.0, double(1 << 20)))
        ->capture_default_str();
    serve->add_option("--encoder-cache-dir", sc.encoder_cache_dir,
                      "the encoder cache's disk tier: embeddings evicted from memory are kept "
                      "in files here (made if missing; one worker a directory) and found again, "
                      "also after a restart");
    serve
        ->add_option("--encoder-cache-disk-mib", encoder_cache_disk_mib,
                     "--encoder-cache-dir: its files' capacity, least recently used out")
        ->check(CLI::Range(0.0, double(1 << 24)))
        ->capture_default_str();
    serve
        ->add_option("--max-pending-image-requests", sc.max_pending_image_requests,
                     "requests with images waiting for the encoder; more get 503")
        ->check(CLI::Range(1, 1 << 20))
        ->capture_default_str();
    serve
        ->add_option("--chat-template", chat_template,
                     "chatml, llama3 or llama2 (default: from the model file)")
        ->check(CLI::IsMember({"chatml", "llama3", "llama2"}));
    serve->add_option("--max-connections", sc.max_connections, "concurrent HTTP connections")
        ->check(CLI::Range(1, 65536))
        ->capture_default_str();
    static uint64_t max_inflight_body_mib = 256;
    serve
        ->add_option("--max-inflight-body-mib", max_inflight_body_mib,
                     "request bodies held at once, over all connections, with the copies of "
                     "their images that wait for the encoder; more get 503")
        ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 20))
        ->capture_default_str();
    static int64_t request_deadline_ms = 10000;
    serve
        ->add_option("--request-deadline-ms", request_deadline_ms,
                     "close a connection that has not sent a complete request this long after "
                     "connecting or after its previous response (slowloris)")
        ->check(CLI::Range(int64_t{100}, int64_t{3600000}))
        ->capture_default_str();
    // Disaggregation (docs/disaggregation.md).
    static std::string role = "colocated", kv_transfer = "pull", kv_backend = "auto";
    static std::string agent_listen = "127.0.0.1:0", agent_name, store, secret_file;
    static std::string kv_connector = kv::kDefaultKvConnector;
    static int64_t hold_lease_ms = 10000, kv_timeout_ms = 10000, handshake_ms = 5000;
    serve
        ->add_option("--role", role,
                     "colocated (prefill and decode here), prefill or decode (KV moves to or "
                     "from other workers through the transfer engine), or encode (the vision "
                     "encoder alone: needs --mmproj and --ec-connector)")
        ->check(CLI::IsMember({"colocated", "prefill", "decode", "encode"}))
        ->capture_default_str();
    serve
        ->add_option("--kv-transfer", kv_transfer,
                     "protocol of requests whose kv_transfer_params do not say: pull (vLLM's "
                     "NixlConnector: the decoder reads the held blocks) or push (layer-wise "
                     "writes from the prefill worker)")
        ->check(CLI::IsMember({"pull", "push"}))
        ->capture_default_str();
    {
        std::string kinds;
        for (const std::string& n : kv::KvConnectorNames())
            kinds += (kinds.empty() ? "" : ", ") + n;
        serve
            ->add_option("--kv-connector", kv_connector,
                         "the KV connector's kind (registered: " + kinds +
                             "); it defines and parses kv_transfer_params")
            ->check(CLI::IsMember(kv::KvConnectorNames()))
            ->capture_default_str();
    }
    serve->add_option("--kv-backend", kv_backend, "transfer backend for KV: auto, shm, tcp, ucx")
        ->check(CLI::IsMember({"auto", "shm", "tcp", "ucx"}))
        ->capture_default_str();
    serve->add_option("--agent-listen", agent_listen, "the transfer agent's HOST:PORT")
        ->capture_default_str();
    serve->add_option("--agent-name", agent_name,
                      "the agent's name (remote_engine_id; default ferry-ROLE-PID)");
    serve->add_option("--store", store, "discovery store for the agent (http://H:P, etcd://H:P)");
    serve->add_option("--secret-file", secret_file, "deployment secret for the agent");
    serve
        ->add_option("--kv-hold-lease-ms", hold_lease_ms,
                     "prefill: free held blocks no decoder claimed within this time")
        ->check(CLI::Range(int64_t{100}, int64_t{3600000}))
        ->capture_default_str();
    serve
        ->add_option("--kv-transfer-timeout-ms", kv_timeout_ms,
                     "fail a KV transfer not done this long after it started")
        ->check(CLI::Range(int64_t{100}, int64_t{3600000}))
        ->capture_default_str();
    serve
        ->add_option("--kv-handshake-timeout-ms", handshake_ms,
                     "give up on a peer agent that has not completed the KV handshake by then")
        ->check(CLI::Range(int64_t{100}, int64_t{600000}))
        ->capture_default_str();
    static std::string kv_verify = "sample";
    serve
        ->add_option("--kv-verify", kv_verify,
                     "checksums of the KV that arrives, compared with the sender's (a mismatch "
                     "fails the request): off, sample (one unit in 16 of layers x heads x K|V, "
                     "at random per request) or all")
        ->check(CLI::IsMember({"off", "sample", "all"}))
        ->capture_default_str();
    static std::vector<std::string> kv_peers;
    serve->add_option("--kv-peers", kv_peers,
                      "the only agents (HOST:PORT) this worker dials for KV; without it, with "
                      "--store they are found by name there, with a secret those the router "
                      "names, and otherwise any address a request names (docs/security.md)");
    static int client_hold_blocks = -1, client_loads = 64;
    serve
        ->add_option("--kv-client-hold-blocks", client_hold_blocks,
                     "prefill: KV blocks one client (an address; the router is exempt) may have "
                     "held unclaimed for remote decoders (-1: a quarter of the cache, 0: no cap)")
        ->check(CLI::Range(-1, 1 << 24))
        ->capture_default_str();
    serve
        ->add_option("--kv-client-loads", client_loads,
                     "decode: KV loads one client (the router is exempt) may have in flight (0: "
                     "no cap)")
        ->check(CLI::Range(0, 1 << 24))
        ->capture_default_str();
    static std::string ec_connector, ec_dir, ec_load_failure = "encode";
    static uint64_t ec_buffer_mib = 256;
    static int64_t ec_lease_ms = 30000, ec_timeout_ms = 5000;
    serve
        ->add_option("--ec-connector", ec_connector,
                     [] {
                         // The registered kinds (serve/ec_connector.h), each with its line.
                         std::string help = "EPD: how image embeddings move from encode workers:";
                         for (const std::string& name : serve::EcConnectorNames()) {
                             help += fmt::format(" {} ({});", name,
                                                 serve::FindEcConnector(name)->description);
                         }
                         help.back() = '.';
                         return help;
                     }())
        ->check(CLI::IsMember(serve::EcConnectorNames()));
    serve->add_option("--ec-dir", ec_dir, "--ec-connector disk: the shared directory");
    serve
        ->add_option("--ec-load-failure", ec_load_failure,
                     "when embeddings an encode worker should hold cannot be loaded: encode "
                     "here, or fail the request (503)")
        ->check(CLI::IsMember({"encode", "fail"}))
        ->capture_default_str();
    serve
        ->add_option("--ec-buffer-mib", ec_buffer_mib,
                     "--role encode with transfer: memory for published embeddings")
        ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 20))
        ->capture_default_str();
    serve
        ->add_option("--ec-lease-ms", ec_lease_ms,
                     "--role encode with transfer: how long published embeddings are kept for "
                     "a consumer that has not pulled them")
        ->check(CLI::Range(int64_t{100}, int64_t{3600000}))
        ->capture_default_str();
    serve
        ->add_option("--ec-transfer-timeout-ms", ec_timeout_ms,
                     "transfer: give up on a pull (then --ec-load-failure) after this long")
        ->check(CLI::Range(int64_t{10}, int64_t{600000}))
        ->capture_default_str();
    static std::vector<std::string> encoder_urls;
    serve->add_option("--encoder-urls", encoder_urls,
                      "EPD without a router step (SGLang's): encode workers (HOST:PORT or URL) "
                      "this worker sends its requests with images to, then loads their "
                      "embeddings (needs --ec-connector)");
    static std::vector<std::string> remote_prefill;
    serve->add_option("--remote-prefill", remote_prefill,
                      "decode-first: prefill workers (HOST:PORT) that prefill prompts for this "
                      "decode worker and push the KV (needs --role decode)");
    serve
        ->add_option("--remote-prefill-min-tokens", sc.remote_prefill_min_tokens,
                     "decode-first: shorter prompts are prefilled here")
        ->check(CLI::Range(0, 1 << 24));
    static int64_t encoder_timeout_ms = 10000, remote_prefill_timeout_ms = 60000,
                   agent_lookup_timeout_ms = 5000;
    serve
        ->add_option("--encoder-timeout-ms", encoder_timeout_ms,
                     "--encoder-urls: an encode worker that has not answered by then costs only "
                     "the encoding (done here) and gets no request until it answers a probe")
        ->check(CLI::Range(int64_t{100}, int64_t{86400000}))
        ->capture_default_str();
    serve
        ->add_option("--remote-prefill-timeout-ms", remote_prefill_timeout_ms,
                     "decode-first: a prefill worker that has not answered by then fails the "
                     "request (503) and gets no prompt until it answers a probe")
        ->check(CLI::Range(int64_t{100}, int64_t{86400000}))
        ->capture_default_str();
    serve
        ->add_option("--agent-lookup-timeout-ms", agent_lookup_timeout_ms,
                     "decode-first: asking a prefill worker where its agent is (GET "
                     "/v1/kv/agent) gives up after this long")
        ->check(CLI::Range(int64_t{100}, int64_t{600000}))
        ->capture_default_str();
    static int64_t drain_timeout_ms = 30000, store_ttl_ms = 10000;
    serve
        ->add_option("--store-ttl-ms", store_ttl_ms,
                     "with --store: the lease of this worker's record there, which routers "
                     "follow; a worker that dies unannounced drops out within it")
        ->check(CLI::Range(int64_t{300}, int64_t{3600000}))
        ->capture_default_str();
    serve
        ->add_option("--drain-timeout-ms", drain_timeout_ms,
                     "on SIGTERM: leave the store, answer /health with 503 and finish what is "
                     "in flight for at most this long before stopping (0: stop at once; SIGINT "
                     "or a second signal always stops at once)")
        ->check(CLI::Range(int64_t{0}, int64_t{86400000}))
        ->capture_default_str();
    serve->callback([rc] {
        sc.request_deadline = std::chrono::milliseconds(request_deadline_ms);
        // SIGINT/SIGTERM are taken by sigwait below, in every thread started from here.
        sigset_t signals;
        sigemptyset(&signals);
        sigaddset(&signals, SIGINT);
        sigaddset(&signals, SIGTERM);
        pthread_sigmask(SIG_BLOCK, &signals, nullptr);
        auto fail = [rc](const Status& st) {
            fmt::print(stderr, "ferry serve: {}\n", st.ToString());
            *rc = 1;
        };
        auto loaded = model::Model::Load(model_path, {.tp = tp});
        if (!loaded.ok()) return fail(loaded.status());
        std::shared_ptr<model::Model> m(std::move(loaded).value());
        if (!chat_template.empty()) {
            m->mutable_tokenizer().set_chat_template(*tokenizer::ParseChatTemplate(chat_template));
        }
        if (!limit_mm.empty()) {
            const nlohmann::json j = nlohmann::json::parse(limit_mm, nullptr, false);
            if (!j.is_object() || !j.contains("image") || !j["image"].is_number_integer() ||
                j["image"].get<int64_t>() < 0 || j["image"].get<int64_t>() > 1024 ||
                j.size() != 1) {
                return fail(InvalidArgumentError(fmt::format(
                    "--limit-mm-per-prompt: '{}' is not {{\"image\": N}} with N in 0..1024",
                    limit_mm)));
            }
            sc.media.limits.max_images = j["image"].get<int>();
        }
        if (!mmproj.empty()) {
            auto v = model::VisionEncoder::Load(mmproj);
            if (!v.ok()) return fail(v.status().WithContext("--mmproj"));
            sc.vision = std::move(v).value();
        }
        if (!sc.encoder_cache_dir.empty() && mmproj.empty()) {
            return fail(InvalidArgumentError("--encoder-cache-dir needs --mmproj"));
        }
        sc.encoder_cache_bytes = uint64_t(encoder_cache_mib * (1 << 20));
        sc.encoder_cache_disk_bytes = uint64_t(encoder_cache_disk_mib * (1 << 20));
        ec.kv_dtype = *kv::ParseKvDtype(kv_dtype);
        ec.kv_cache_bytes = uint64_t(kv_mib) << 20;
        ec.chunked_prefill = !no_chunked;
        ec.prefix_caching = !no_prefix;
        ec.prefix_hash_seed = hash_seed;
        serve::WorkerConfig wc;
        wc.role = *serve::ParseWorkerRole(role);
        wc.kv_connector = kv_connector;
        wc.model = m;
        for (const std::string& u : remote_prefill) {
            auto ep = http::ParseEndpoint(u);
            if (!ep.ok()) return fail(ep.status().WithContext("--remote-prefill"));
            sc.remote_prefill.push_back(*ep);
        }
        sc.max_inflight_body_bytes = size_t(max_inflight_body_mib) << 20;
        sc.encoder_timeout = std::chrono::milliseconds(encoder_timeout_ms);
        sc.remote_prefill_timeout = std::chrono::milliseconds(remote_prefill_timeout_ms);
        sc.agent_timeout = std::chrono::milliseconds(agent_lookup_timeout_ms);
        for (const std::string& u : encoder_urls) {
            auto ep = http::ParseEndpoint(u);
            if (!ep.ok()) return fail(ep.status().WithContext("--encoder-urls"));
            sc.encoder_urls.push_back(*ep);
        }
        if (!encoder_urls.empty() && (ec_connector.empty() || role == "encode")) {
            return fail(InvalidArgumentError(
                "--encoder-urls needs --ec-connector and a role other than encode"));
        }
        wc.ec.kind = ec_connector;
        wc.ec.dir = ec_dir;
        wc.ec.buffer_bytes = ec_buffer_mib << 20;
        wc.ec.lease = std::chrono::milliseconds(ec_lease_ms);
        wc.ec.pull_timeout = std::chrono::milliseconds(ec_timeout_ms);
        sc.ec_load_failure = *serve::ParseEcLoadFailure(ec_load_failure);
        if (wc.role != serve::WorkerRole::kColocated || ec_connector == "transfer") {
            wc.agent.name = agent_name;
            auto listen = http::ParseListenAddress(agent_listen);
            if (!listen.ok()) return fail(listen.status().WithContext("--agent-listen"));
            wc.agent.listen_host = listen->host;
            wc.agent.listen_port = static_cast<uint16_t>(listen->port);
            if (kv_backend != "auto") {
                wc.agent.backends = {kv_backend};
                wc.agent.force_backend = kv_backend;
            } else {
                wc.agent.backends = AvailableBackends();
            }
            wc.agent.store = store;
            try {
                wc.agent.secret = LoadSecret(secret_file);
            } catch (const CLI::ValidationError& e) {
                return fail(InvalidArgumentError(e.what()));
            }
            kv::AgentConnectorConfig& cc = wc.connector;
            cc.hold_lease = std::chrono::milliseconds(hold_lease_ms);
            cc.transfer_timeout = std::chrono::milliseconds(kv_timeout_ms);
            cc.handshake_timeout = std::chrono::milliseconds(handshake_ms);
            cc.verify = *kv::ParseKvVerifyMode(kv_verify);
            for (const std::string& p : kv_peers) {
                auto ep = http::ParseEndpoint(p);
                if (!ep.ok()) return fail(ep.status().WithContext("--kv-peers"));
                cc.allowed_agents.push_back(FormatHostPort(ep->host, ep->port));
            }
            cc.max_client_hold_blocks = client_hold_blocks;
            cc.max_client_loads = client_loads;
            wc.kv_mode =
                kv_transfer == "push" ? kv::KvTransferMode::kPush : kv::KvTransferMode::kPull;
        }
        if (wc.agent.secret.empty() && !secret_file.empty()) {
            // A colocated worker without an agent: the secret still makes its router token
            // (what --encoder-urls calls carry).
            try {
                wc.agent.secret = LoadSecret(secret_file);
            } catch (const CLI::ValidationError& e) {
                return fail(InvalidArgumentError(e.what()));
            }
        }
        wc.engine = ec;
        wc.server = sc;
        wc.registration_ttl = std::chrono::milliseconds(store_ttl_ms);
        wc.kv_events.endpoint = kv_events_endpoint;
        wc.kv_events.bind = kv_events_bind;
        wc.kv_events.replay_endpoint = kv_events_replay;
        wc.kv_events.topic = kv_events_topic;
        wc.kv_events.replays_per_second = kv_events_replays;
        wc.kv_events.layout = *serve::ParseKvEventsLayout(kv_events_layout);
        if (kv_events_endpoint.empty() && !kv_events_replay.empty()) {
            return fail(
                InvalidArgumentError("--kv-events-replay-endpoint needs --kv-events-endpoint"));
        }
        auto started = serve::Worker::Start(std::move(wc));
        if (!started.ok()) return fail(started.status());
        std::unique_ptr<serve::Worker> worker = std::move(started).value();
        const std::shared_ptr<engine::Engine>& e = worker->shared_engine();
        const std::shared_ptr<Agent>& agent = worker->agent();
        serve::OpenAiServer* server = worker->server();
        const model::ModelConfig& c = m->config();
        const engine::EngineConfig& got = e->config();
        fmt::print(
            "ferry serve: model {} ({:.1f} M parameters, {} layers), tp {}, kv cache {} blocks x "
            "{} tokens ({}), max model len {}\n",
            server->model_name(), c.ParamCount() / 1e6, c.num_layers, tp, got.num_blocks,
            got.block_tokens, kv_dtype, got.max_model_len);
        if (sc.vision) {
            const model::VisionConfig& v = sc.vision->config();
            fmt::print(
                "ferry serve: vision encoder {} ({}x{} pixels, {} tokens an image), "
                "encoder cache {} MiB{}\n",
                mmproj, v.image_size, v.image_size, v.tokens_per_image(), encoder_cache_mib,
                sc.encoder_cache_dir.empty()
                    ? ""
                    : fmt::format(" + {} MiB in {}", encoder_cache_disk_mib, sc.encoder_cache_dir));
        }
        if (agent) {
            fmt::print("ferry serve: role {}, kv agent {} at {}\n", role, agent->name(),
                       agent->ListenAddress());
        }
        if (serve::KvEventPublisher* ev = worker->kv_events()) {
            fmt::print("ferry serve: kv events {} {}{}\n", ev->connected() ? "connecting to" : "at",
                       ev->endpoint(),
                       ev->replay_endpoint().empty() ? "" : ", replay at " + ev->replay_endpoint());
        }
        fmt::print("ferry serve: listening on http://{}\n",
                   FormatHostPort(sc.host, server->port()));
        std::fflush(stdout);
        int sig = 0;
        sigwait(&signals, &sig);
        if (sig == SIGTERM && drain_timeout_ms > 0) {
            fmt::print("ferry serve: SIGTERM, draining ({} in flight, at most {} ms)\n",
                       worker->InFlight(), drain_timeout_ms);
            std::fflush(stdout);
            bool again = false;
            auto interrupted = [&] {
                const timespec none{0, 0};
                again = again || sigtimedwait(&signals, nullptr, &none) > 0;
                return again;
            };
            serve::Worker::DrainResult d =
                worker->Drain(std::chrono::milliseconds(drain_timeout_ms),
                              std::chrono::milliseconds(500), interrupted);
            fmt::print("ferry serve: {} after {} ms{}, stopping\n",
                       d.drained ? "drained"
                       : again   ? "a second signal"
                                 : "drain timed out",
                       d.took.count(),
                       d.drained ? "" : fmt::format(" with {} requests in flight", d.in_flight));
        } else {
            fmt::print("ferry serve: signal {}, stopping\n", sig);
        }
        worker.reset();  // server, engine (it unbinds the connector), connector, agent
    });
}

void AddModelBenchCommand(CLI::App& bench, int* rc) {
    CLI::App* mb = bench.add_subcommand(
        "model",
        "Prefill and decode tokens/s of the inference engine beside this machine's sgemm "
        "GFLOP/s");
    static bench::ModelBenchOptions o;
    static std::string prompts = "512,2048", batches = "1,8,32";
    mb->add_option("--preset", o.preset, "random-weight model: tiny, small, tiny-mla or small-mla")
        ->check(CLI::IsMember({"tiny", "small", "tiny-mla", "small-mla"}))
        ->capture_default_str();
    mb->add_option("--model", o.model, "a GGUF file instead of a preset");
    mb->add_option("--tp", o.tp, "tensor-parallel ranks")->check(CLI::Range(1, 64));
    mb->add_option("--prompt-lens", prompts, "prefill prompt lengths")->capture_default_str();
    mb->add_option("--batches", batches, "decode batch sizes")->capture_default_str();
    mb->add_option("--decode-context", o.decode_context, "prompt tokens per decoding sequence")
        ->check(CLI::Range(1, 1 << 20));
    mb->add_option("--decode-steps", o.decode_steps, "decode steps timed")
        ->check(CLI::Range(1, 1 << 20));
    mb->add_option("--repeats", o.repeats, "runs per row (median)")->check(CLI::Range(1, 100));
    mb->add_option("--kv-dtype", o.kv_dtype, "f32, f16, bf16")
        ->check(CLI::IsMember({"f32", "f16", "bf16"}));
    mb->callback([rc] {
        o.prompt_lens = ParseIntList("--prompt-lens", prompts, 1, 1 << 20);
        o.batches = ParseIntList("--batches", batches, 1, 4096);
        *rc = bench::RunModelBench(o);
    });
}

}  // namespace ferry::cli
