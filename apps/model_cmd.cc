#include "model_cmd.h"

#include <fmt/core.h>
#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "bench/model/model_bench.h"
#include "core/host_port.h"
#include "engine/engine.h"
#include "ferry/agent.h"
#include "model/model.h"
#include "model/vision.h"
#include "serve/openai_server.h"
#include "serve/serve_flags.h"
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
    static serve::ServeFlags flags;
    serve::AddServeFlags(*serve, flags);
    serve->callback([rc] {
        const serve::ServeFlags& f = flags;
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
        auto config = serve::ToWorkerConfig(f);
        if (!config.ok()) return fail(config.status());
        serve::WorkerConfig wc = std::move(config).value();
        const std::shared_ptr<model::Model> m = wc.model;
        const serve::ServerConfig sc = wc.server;
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
            server->model_name(), c.ParamCount() / 1e6, c.num_layers, f.tp, got.num_blocks,
            got.block_tokens, f.kv_dtype, got.max_model_len);
        if (sc.vision) {
            const model::VisionConfig& v = sc.vision->config();
            fmt::print(
                "ferry serve: vision encoder {} ({}x{} pixels, {} tokens an image), "
                "encoder cache {} MiB{}\n",
                f.mmproj, v.image_size, v.image_size, v.tokens_per_image(), f.encoder_cache_mib,
                sc.encoder_cache_dir.empty()
                    ? ""
                    : fmt::format(" + {} MiB in {}", f.encoder_cache_disk_mib,
                                  sc.encoder_cache_dir));
        }
        if (agent) {
            fmt::print("ferry serve: role {}, kv agent {} at {}\n", f.role, agent->name(),
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
        if (sig == SIGTERM && f.drain_timeout_ms > 0) {
            fmt::print("ferry serve: SIGTERM, draining ({} in flight, at most {} ms)\n",
                       worker->InFlight(), f.drain_timeout_ms);
            std::fflush(stdout);
            bool again = false;
            auto interrupted = [&] {
                const timespec none{0, 0};
                again = again || sigtimedwait(&signals, nullptr, &none) > 0;
                return again;
            };
            serve::Worker::DrainResult d =
                worker->Drain(std::chrono::milliseconds(f.drain_timeout_ms),
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
