#include "bench/model/model_bench.h"

#include <cblas.h>
#include <fmt/core.h>
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "bench/serve_metrics.h"
#include "core/cpu.h"
#include "core/half.h"
#include "core/huge_page_allocator.h"
#include "engine/engine.h"
#include "model/blas.h"
#include "model/kernels.h"
#include "model/model.h"

namespace ferry::bench {

namespace {

using Clock = std::chrono::steady_clock;

double SecondsBetween(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
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
        rates.push_back(2.0 * n * n * n / SecondsBetween(t0, Clock::now()) / 1e9);
    }
    return Median(rates);
}

// Sums n floats from p, eight lanes and four accumulators at a time where the CPU has AVX2.
__attribute__((target("avx2"))) float SumAvx2(const float* p, size_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(p + i));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(p + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_loadu_ps(p + i + 16));
        s3 = _mm256_add_ps(s3, _mm256_loadu_ps(p + i + 24));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    float s = 0;
    for (float v : lanes) s += v;
    for (; i < n; ++i) s += p[i];
    return s;
}

// The same, sixteen lanes at a time, every line prefetched 4 KiB ahead: as the AVX-512 row
// kernels read weights (a reference slower than the kernels it bounds is no ceiling: on the
// AVX-512 EPYC here decode steps read at 101-103% of the AVX2 sum's rate).
__attribute__((target("avx512f"))) float SumAvx512(const float* p, size_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        for (int b = 0; b < 256; b += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(p + i) + 4096 + b, _MM_HINT_T0);
        }
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p + i));
        s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + i + 16));
        s2 = _mm512_add_ps(s2, _mm512_loadu_ps(p + i + 32));
        s3 = _mm512_add_ps(s3, _mm512_loadu_ps(p + i + 48));
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    float s = 0;
    for (float v : lanes) s += v;
    for (; i < n; ++i) s += p[i];
    return s;
}

float Sum(const float* p, size_t n) {
    if (model::BestRowIsa() == model::KernelIsa::kAvx512) return SumAvx512(p, n);
    if (CpuHasAvx2F16c()) return SumAvx2(p, n);
    float acc[16] = {};
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int k = 0; k < 16; ++k) acc[k] += p[i + k];
    }
    float s = 0;
    for (float a : acc) s += a;
    for (; i < n; ++i) s += p[i];
    return s;
}

// GFLOP/s of the bf16 pairs products (model::MatMulBulk on bf16 weights where the CPU has
// AVX-512 BF16) on `threads` threads: n rows of A by an n x n bf16 matrix, median of 5. The
// compute reference of a bf16 model's prefill there, which sgemm's rate does not bound.
double Bf16PairsGflops(int threads, int n) {
    model::Weights w;
    w.type = gguf::TensorType::kBF16;
    w.rows = n;
    w.cols = n;
    w.bytes.resize(size_t(n) * n * 2);
    for (size_t i = 0; i < size_t(n) * n; ++i) {
        const uint16_t h = FloatToBf16(0.001f * static_cast<float>(i % 1000));
        std::memcpy(&w.bytes[2 * i], &h, 2);
    }
    std::vector<float> a(size_t(n) * n, 0.5f), c(size_t(n) * n);
    model::WorkPool pool(threads);
    model::AlignedFloats scratch;
    model::MatMulBulk(n, a.data(), n, w, c.data(), n, pool, &scratch);  // warm-up
    std::vector<double> rates;
    for (int i = 0; i < 5; ++i) {
        auto t0 = Clock::now();
        model::MatMulBulk(n, a.data(), n, w, c.data(), n, pool, &scratch);
        rates.push_back(2.0 * n * n * n / SecondsBetween(t0, Clock::now()) / 1e9);
    }
    return Median(rates);
}

// Memory read bandwidth: `threads` threads (all the cores this process may use) each summing
// its share of a 1 GiB buffer, far larger than the caches, from one start line. The buffer is
// on huge pages where the system gives them, as the weights are (model weights use the same
// allocator). This is what a batch-1 decode step is bound by: it reads every weight once. It is
// a ceiling, so the best of 8 passes: on a shared machine the median of a few passes moved by a
// third from one run to the next, and a decode step measured beside it beat it.
double StreamReadGBps(int threads) {
    const size_t n = size_t(1) << 28;                           // floats: 1 GiB
    std::vector<float, HugePageAllocator<float>> buf(n, 1.0f);  // written once: pre-faulted
    double best = 0;
    std::vector<float> sums(threads);
    for (int pass = 0; pass < 9; ++pass) {
        std::atomic<int> ready{0};
        std::atomic<bool> go{false};
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t) {
            ts.emplace_back([&, t] {
                const size_t b = n * t / threads, e = n * (t + 1) / threads;
                ready.fetch_add(1);
                while (!go.load(std::memory_order_acquire)) {
                }
                sums[t] = Sum(buf.data() + b, e - b);
            });
        }
        while (ready.load() < threads) std::this_thread::yield();
        auto t0 = Clock::now();
        go.store(true, std::memory_order_release);
        for (auto& t : ts) t.join();
        if (pass > 0) best = std::max(best, double(n) * 4 / SecondsBetween(t0, Clock::now()) / 1e9);
    }
    static volatile float sink;  // the sums are used: the reads cannot be left out
    for (float v : sums) sink = sink + v;
    return best;
}

std::vector<int32_t> Prompt(int n, int salt, int vocab) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back((i * 131 + salt * 977 + 7) % std::min(vocab, 256));
    return t;
}

// `started`, when given, counts the requests that have their first token (their prefill done).
engine::Request MakeRequest(std::string id, std::vector<int32_t> prompt, int max_tokens,
                            std::atomic<int>* started = nullptr) {
    engine::Request r;
    r.id = std::move(id);
    r.prompt = std::move(prompt);
    r.sampling.temperature = 0;
    r.sampling.ignore_eos = true;
    r.sampling.max_tokens = max_tokens;
    r.on_output = [started](const engine::RequestOutput& out) {
        if (started && out.completion_tokens == static_cast<int>(out.tokens.size()) &&
            !out.tokens.empty()) {
            started->fetch_add(1);
        }
    };
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
    const std::string& blas = model::ChooseBlasCore();  // before the sgemm reference
    double gflops1 = SgemmGflops(1, 2048);
    double gflops_all = SgemmGflops(cores, 2048);
    double stream_gbps = StreamReadGBps(cores);
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
        "head dim {}, {}), tp {}, kv {}, {} cores\n",
        c.name, c.ParamCount() / 1e6, c.num_layers, c.dim, c.num_heads, c.num_kv_heads, c.head_dim,
        c.attention(), o.tp, kv::KvDtypeName(*kv_dtype), cores);
    {
        // What a request's KV costs: the cache a disaggregated request moves, per token.
        const kv::KvCacheSpec rank = m->CacheSpec(16, 1, *kv_dtype);
        const uint64_t row = uint64_t(rank.head_dim) * kv::KvDtypeSize(rank.dtype);
        if (c.mla) {
            const uint64_t mha = uint64_t(rank.num_layers) * c.num_heads *
                                 (c.qk_nope_dim + c.qk_rope_dim + c.v_head_dim) *
                                 kv::KvDtypeSize(rank.dtype);
            fmt::print(
                "kv cache: {} bytes per token (mla: {} layers x latent {} + rope {} x {}; one "
                "copy per worker at any tp; per-head K and V of its {} heads would be {})\n",
                c.KvBytesPerToken(static_cast<int>(kv::KvDtypeSize(rank.dtype))), rank.num_layers,
                c.kv_lora_rank, c.qk_rope_dim, kv::KvDtypeName(rank.dtype), c.num_heads, mha);
        } else {
            const uint64_t model_bytes = 2ull * rank.num_layers * c.num_kv_heads * row;
            const uint64_t worker_bytes = 2ull * rank.num_layers * rank.kv_heads * row * o.tp;
            fmt::print("kv cache: {} bytes per token ({} layers x K|V x {} kv heads x {} x {}){}\n",
                       model_bytes, rank.num_layers, c.num_kv_heads, rank.head_dim,
                       kv::KvDtypeName(rank.dtype),
                       worker_bytes == model_bytes
                           ? std::string()
                           : fmt::format("; {} held by the {} ranks (heads replicated)",
                                         worker_bytes, o.tp));
        }
    }
    fmt::print("kernels: rows {}; {}\n", model::KernelIsaName(model::RowIsa()), blas);
    // A decode step reads every weight once, in its stored precision (f16 and bf16 stay 16-bit).
    const double weight_bytes = static_cast<double>(m->StreamedWeightBytes());
    // A bf16 model's prompt runs on bf16 pairs where the CPU has them: its compute reference is
    // that product's rate, measured the same way.
    const bool pairs = m->MatrixType() == gguf::TensorType::kBF16 && model::Bf16DotProducts();
    const double pairs_all = pairs ? Bf16PairsGflops(cores, 2048) : 0;
    const double compute_all = std::max(gflops_all, pairs_all);
    const double compute_ceiling = compute_all * 1e9 / flops_per_token;
    const double stream_ceiling = stream_gbps * 1e9 / weight_bytes;
    fmt::print(
        "reference: sgemm 2048^3 {:.1f} GFLOP/s on 1 core, {:.1f} GFLOP/s on {} cores; "
        "memory read 1 GiB on {} cores {:.1f} GB/s (best of 8)\n",
        gflops1, gflops_all, cores, cores, stream_gbps);
    if (pairs) {
        fmt::print("reference: bf16 pairs 2048^3 {:.1f} GFLOP/s on {} cores\n", pairs_all, cores);
    }
    fmt::print(
        "ceilings: compute {:.0f} tokens/s (all-core {}), batch-1 decode {:.1f} tokens/s "
        "(reading {:.0f} MB of weights per step)\n\n",
        compute_ceiling, pairs_all > gflops_all ? "bf16 pairs" : "sgemm", stream_ceiling,
        weight_bytes / 1e6);
    fmt::print("{:<8} {:>7} {:>7} {:>12} {:>10} {:>12}\n", "phase", "tokens", "batch", "tokens/s",
               "GFLOP/s", "of ceiling");

    int serial = 0;
    {
        // One untimed request first, as llama-bench warms up: the workspaces, the KV blocks and
        // the kernels' buffers are touched once before anything is timed.
        const int len = std::min(max_prompt, ec.max_model_len - 9);
        Status st = e->Submit(MakeRequest("warm-up", Prompt(len, 0, c.vocab_size), 8));
        if (!st.ok()) {
            fmt::print(stderr, "ferry bench model: {}\n", st.ToString());
            return 1;
        }
        e->RunUntilIdle();
    }
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
            rates.push_back(len / SecondsBetween(t0, Clock::now()));
        }
        double tps = Median(rates);
        fmt::print("{:<8} {:>7} {:>7} {:>12.1f} {:>10.1f} {:>8.0f}% cmp\n", "prefill", len, 1, tps,
                   tps * flops_per_token / 1e9, 100 * tps / compute_ceiling);
    }
    for (int b : o.batches) {
        std::vector<double> rates;
        for (int r = 0; r < o.repeats; ++r) {
            std::atomic<int> started{0};
            for (int i = 0; i < b; ++i) {
                ++serial;
                Status st = e->Submit(MakeRequest(fmt::format("d{}", serial),
                                                  Prompt(o.decode_context, serial, c.vocab_size),
                                                  o.decode_steps + 1, &started));
                if (!st.ok()) {
                    fmt::print(stderr, "ferry bench model: {}\n", st.ToString());
                    return 1;
                }
            }
            // Prefill all of them (one step when they fit the budget, chunks otherwise) up to
            // each one's first token, then time the decode steps.
            while (started.load() < b) e->Step();
            auto t0 = Clock::now();
            uint64_t before = e->Stats().generation_tokens;
            e->RunUntilIdle();
            double dt = SecondsBetween(t0, Clock::now());
            rates.push_back(double(e->Stats().generation_tokens - before) / dt);
        }
        double tps = Median(rates);
        // A step of b sequences reads the weights once and computes b tokens: bound by the
        // smaller of b times the bandwidth ceiling and the compute ceiling.
        const bool memory_bound = b * stream_ceiling < compute_ceiling;
        const double ceiling = memory_bound ? b * stream_ceiling : compute_ceiling;
        fmt::print("{:<8} {:>7} {:>7} {:>12.1f} {:>10.1f} {:>8.0f}% {}\n", "decode",
                   o.decode_context, b, tps, tps * flops_per_token / 1e9, 100 * tps / ceiling,
                   memory_bound ? "mem" : "cmp");
    }
    fmt::print(
        "\nprefill: one prompt per step, whole; decode: {} sequences of {} prompt tokens, "
        "{} steps timed after their prefill; medians of {}.\n"
        "GFLOP/s counts 2 x the layer weights per token (attention scores and the output head "
        "excluded).\n"
        "of ceiling: of the compute ceiling (cmp), or of batch x the batch-1 decode ceiling "
        "(mem), whichever binds.\n",
        "batch", o.decode_context, o.decode_steps, o.repeats);
    return 0;
}

}  // namespace ferry::bench
