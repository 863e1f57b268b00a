#include "bench/model_bench.h"

#include <cblas.h>
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>

#include "core/cpu.h"
#include "engine/engine.h"
#include "model/model.h"

namespace ferry::bench {

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// sgemm GFLOP/s on `threads` threads: n x n x n products, median of 5.
double SgemmGflops(int threads, int n) {
    openblas_set_num_threads(threads);
    std::vector<float> a(size_t(n) * n, 0.5f), b(size_t(n) * n, 0.25f), c(size_t(n) * n, 0);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1, a.data(), n, b.data(), n, 0,
                c.data(), n);  // warm-up, pre-faults c
    std::vector<double> rates;
    for (int i = 0; i < 5; ++i) {
        auto t0 = Clock::now();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1, a.data(), n, b.data(), n,
                    0, c.data(), n);
        rates.push_back(2.0 * n * n * n / Seconds(t0, Clock::now()) / 1e9);
    }
    return Median(rates);
}

// Weight-streaming bandwidth: sgemv over a 256 MiB matrix on all cores (what a batch-1 decode
// step does with every weight), median of 5.
double SgemvGBps(int threads) {
    openblas_set_num_threads(threads);
    const int n = 8192;
    std::vector<float> a(size_t(n) * n, 0.5f), x(n, 1.0f), y(n, 0);
    cblas_sgemv(CblasRowMajor, CblasNoTrans, n, n, 1, a.data(), n, x.data(), 1, 0, y.data(), 1);
    std::vector<double> rates;
    for (int i = 0; i < 5; ++i) {
        auto t0 = Clock::now();
        cblas_sgemv(CblasRowMajor, CblasNoTrans, n, n, 1, a.data(), n, x.data(), 1, 0, y.data(), 1);
        rates.push_back(double(n) * n * 4 / Seconds(t0, Clock::now()) / 1e9);
    }
    return Median(rates);
}

std::vector<int32_t> Prompt(int n, int salt, int vocab) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back((i * 131 + salt * 977 + 7) % std::min(vocab, 256));
    return t;
}

engine::Request MakeRequest(std::string id, std::vector<int32_t> prompt, int max_tokens) {
    engine::Request r;
    r.id = std::move(id);
    r.prompt = std::move(prompt);
    r.sampling.temperature = 0;
    r.sampling.ignore_eos = true;
    r.sampling.max_tokens = max_tokens;
    r.on_output = [](const engine::RequestOutput&) {};
    return r;
}

}  // namespace

int RunModelBench(const ModelBenchOptions& o) {
    std::string path = o.model;
    bool temp = false;
    if (path.empty()) {
        auto spec = model::PresetSpec(o.preset);
        if (!spec.ok()) {
            fmt::print(stderr, "ferry bench model: {}\n", spec.status().message());
            return 2;
        }
        path = (std::filesystem::temp_directory_path() /
                fmt::format("ferry-bench-{}-{}.gguf", o.preset, getpid()))
                   .string();
        if (Status st = model::WriteRandomModel(*spec, 1, path); !st.ok()) {
            fmt::print(stderr, "ferry bench model: {}\n", st.ToString());
            return 1;
        }
        temp = true;
    }
    auto kv_dtype = kv::ParseKvDtype(o.kv_dtype);
    if (!kv_dtype.ok()) {
        fmt::print(stderr, "ferry bench model: {}\n", kv_dtype.status().message());
        return 2;
    }
    const int cores = UsableCores();
    double gflops1 = SgemmGflops(1, 1024);
    double gflops_all = SgemmGflops(cores, 1024);
    double stream_gbps = SgemvGBps(cores);
    openblas_set_num_threads(cores);

    auto loaded = model::Model::Load(path, {.tp = o.tp});
    if (temp) std::filesystem::remove(path);
    if (!loaded.ok()) {
        fmt::print(stderr, "ferry bench model: {}\n", loaded.status().ToString());
        return 1;
    }
    std::shared_ptr<model::Model> m(std::move(loaded).value());
    const model::ModelConfig& c = m->config();
    // The transformer layers' weights (embedding lookup, output head and attention left out).
    const double flops_per_token =
        2.0 * double(c.ParamCount() - uint64_t(c.vocab_size) * c.dim * (c.tied_embeddings ? 1 : 2) -
                     c.dim);
    int max_prompt = *std::max_element(o.prompt_lens.begin(), o.prompt_lens.end());
    int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
    engine::EngineConfig ec;
    ec.manual_steps = true;
    ec.prefix_caching = false;  // every prefill computes its whole prompt
    ec.kv_dtype = *kv_dtype;
    ec.max_batched_tokens = std::max({max_prompt, max_batch, 16});
    ec.max_num_seqs = std::max(max_batch, 1);
    ec.max_model_len =
        std::min(c.context_length, std::max(max_prompt, o.decode_context) + o.decode_steps + 2);
    int need_tokens = std::max(max_prompt + 1, max_batch * (o.decode_context + o.decode_steps + 2));
    ec.num_blocks = need_tokens / ec.block_tokens + 8;
    auto created = engine::Engine::Create(m, ec);
    if (!created.ok()) {
        fmt::print(stderr, "ferry bench model: {}\n", created.status().ToString());
        return 1;
    }
    std::unique_ptr<engine::Engine> e = std::move(created).value();

    fmt::print(
        "ferry bench model: {} ({:.1f} M parameters, {} layers, dim {}, heads {}/{}, "
        "head dim {}), tp {}, kv {}, {} cores\n",
        c.name, c.ParamCount() / 1e6, c.num_layers, c.dim, c.num_heads, c.num_kv_heads, c.head_dim,
        o.tp, kv::KvDtypeName(*kv_dtype), cores);
    const double weight_bytes = flops_per_token / 2 * 4;  // f32 layer weights
    fmt::print(
        "reference: sgemm 1024^3 {:.1f} GFLOP/s on 1 core, {:.1f} GFLOP/s on {} cores; "
        "sgemv 256 MiB {:.1f} GB/s\n"
        "ceilings: compute {:.0f} tokens/s (all-core sgemm), batch-1 decode {:.1f} tokens/s "
        "(streaming {:.0f} MB of f32 layer weights per step)\n\n",
        gflops1, gflops_all, cores, stream_gbps, gflops_all * 1e9 / flops_per_token,
        stream_gbps * 1e9 / weight_bytes, weight_bytes / 1e6);
    fmt::print("{:<8} {:>7} {:>7} {:>12} {:>10} {:>10}\n", "phase", "tokens", "batch", "tokens/s",
               "GFLOP/s", "of all-core");

    int serial = 0;
    for (int len : o.prompt_lens) {
        if (len + 1 > ec.max_model_len) {
            fmt::print("prefill  {:>7}: longer than the model's context ({}), skipped\n", len,
                       c.context_length);
            continue;
        }
        std::vector<double> rates;
        for (int r = 0; r < o.repeats; ++r) {
            ++serial;
            Status st = e->Submit(
                MakeRequest(fmt::format("p{}", serial), Prompt(len, serial, c.vocab_size), 1));
            if (!st.ok()) {
                fmt::print(stderr, "ferry bench model: {}\n", st.ToString());
                return 1;
            }
            auto t0 = Clock::now();
            e->RunUntilIdle();
            rates.push_back(len / Seconds(t0, Clock::now()));
        }
        double tps = Median(rates);
        fmt::print("{:<8} {:>7} {:>7} {:>12.1f} {:>10.1f} {:>9.0f}%\n", "prefill", len, 1, tps,
                   tps * flops_per_token / 1e9, 100 * tps * flops_per_token / 1e9 / gflops_all);
    }
    for (int b : o.batches) {
        std::vector<double> rates;
        for (int r = 0; r < o.repeats; ++r) {
            for (int i = 0; i < b; ++i) {
                ++serial;
                Status st = e->Submit(MakeRequest(fmt::format("d{}", serial),
                                                  Prompt(o.decode_context, serial, c.vocab_size),
                                                  o.decode_steps + 1));
                if (!st.ok()) {
                    fmt::print(stderr, "ferry bench model: {}\n", st.ToString());
                    return 1;
                }
            }
            // Prefill all of them (one step when they fit the budget), then time decode steps.
            while (e->Stats().running < b || e->Stats().waiting > 0) e->Step();
            auto t0 = Clock::now();
            uint64_t before = e->Stats().generation_tokens;
            e->RunUntilIdle();
            double dt = Seconds(t0, Clock::now());
            rates.push_back(double(e->Stats().generation_tokens - before) / dt);
        }
        double tps = Median(rates);
        fmt::print("{:<8} {:>7} {:>7} {:>12.1f} {:>10.1f} {:>9.0f}%\n", "decode", o.decode_context,
                   b, tps, tps * flops_per_token / 1e9,
                   100 * tps * flops_per_token / 1e9 / gflops_all);
    }
    fmt::print(
        "\nprefill: one prompt per step, whole; decode: {} sequences of {} prompt tokens, "
        "{} steps timed after their prefill; medians of {}.\n"
        "GFLOP/s counts 2 x the layer weights per token (attention scores and the output head "
        "excluded).\n",
        "batch", o.decode_context, o.decode_steps, o.repeats);
    return 0;
}

}  // namespace ferry::bench
