// The model against a naive reference written here (whole sequence, no paging, no batching,
// double accumulation), read straight from the GGUF file.
#include "model/model.h"

#include <cblas.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <strings.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "core/cpu.h"
#include "core/half.h"
#include "model/blas.h"
#include "model/kernels.h"
#include "testing/testing.h"

namespace ferry::model {
namespace {

using ::ferry::testing::StatusHas;
using ::ferry::testing::StatusIs;

RandomModelSpec TestSpec() {
    RandomModelSpec s;
    s.name = "test";
    s.dim = 64;
    s.num_layers = 2;
    s.num_heads = 4;
    s.num_kv_heads = 2;
    s.ffn_dim = 96;
    s.context_length = 256;
    return s;
}

// MLA's twin of TestSpec (architecture deepseek2); q_lora 0: queries straight from the input.
RandomModelSpec TestSpecMla(int q_lora) {
    RandomModelSpec s = TestSpec();
    s.name = "test-mla";
    s.mla = true;
    s.num_kv_heads = 1;
    s.q_lora_rank = q_lora;
    s.kv_lora_rank = 32;
    s.qk_nope_dim = 16;
    s.qk_rope_dim = 8;
    s.v_head_dim = 12;
    return s;
}

std::string TempPath(const std::string& name) {
    return (std::filesystem::temp_directory_path() /
            (name + "-" + std::to_string(getpid()) + ".gguf"))
        .string();
}

// The reference: logits at every position of `tokens`.
class Reference {
  public:
    explicit Reference(const std::string& path)
        : file_(std::move(gguf::GgufFile::Open(path)).value()) {
        cfg_ = ModelConfig::FromGguf(*file_).value();
    }

    std::vector<std::vector<double>> Logits(const std::vector<int32_t>& tokens) {
        const int n = static_cast<int>(tokens.size()), d = cfg_.dim, F = cfg_.ffn_dim;
        auto emb = W("token_embd.weight");
        std::vector<std::vector<double>> x(n, std::vector<double>(d));
        for (int t = 0; t < n; ++t) {
            for (int i = 0; i < d; ++i) x[t][i] = emb[size_t(tokens[t]) * d + i];
        }
        for (int l = 0; l < cfg_.num_layers; ++l) {
            std::string p = "blk." + std::to_string(l) + ".";
            auto an = W(p + "attn_norm.weight"), fn = W(p + "ffn_norm.weight");
            if (cfg_.mla) {
                MlaLayer(p, an, &x);
            } else {
                MhaLayer(p, an, &x);
            }
            for (int t = 0; t < n; ++t) {
                auto h = Norm(x[t], fn);
                auto wg = W(p + "ffn_gate.weight"), wu = W(p + "ffn_up.weight");
                auto wd = W(p + "ffn_down.weight");
                auto g = MatVec(wg, h, F), u = MatVec(wu, h, F);
                for (int i = 0; i < F; ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
                auto o = MatVec(wd, g, d);
                for (int i = 0; i < d; ++i) x[t][i] += o[i];
            }
        }
        auto on = W("output_norm.weight");
        auto head = file_->FindTensor("output.weight") ? W("output.weight") : emb;
        std::vector<std::vector<double>> out;
        for (int t = 0; t < n; ++t) out.push_back(MatVec(head, Norm(x[t], on), cfg_.vocab_size));
        return out;
    }

    const ModelConfig& config() const { return cfg_; }

  private:
    using Rows = std::vector<std::vector<double>>;

    // MLA as its paper writes it, decompressed (no absorption): per head a key [k_nope | k_rope]
    // with k_nope = W_kb^T latent and the shared k_rope, a value W_vb latent, and plain
    // attention over them.
    void MlaLayer(const std::string& p, const std::vector<double>& an, Rows* xs) {
        Rows& x = *xs;
        const int n = static_cast<int>(x.size()), d = cfg_.dim, H = cfg_.num_heads;
        const int L = cfg_.kv_lora_rank, N = cfg_.qk_nope_dim, R = cfg_.qk_rope_dim;
        const int qk = N + R, vd = cfg_.v_head_dim;
        auto wkva = W(p + "attn_kv_a_mqa.weight"), kvan = W(p + "attn_kv_a_norm.weight");
        auto wkb = W(p + "attn_k_b.weight"), wvb = W(p + "attn_v_b.weight");
        auto wo = W(p + "attn_output.weight");
        Rows q(n), k(n), v(n);
        for (int t = 0; t < n; ++t) {
            auto h = Norm(x[t], an);
            if (cfg_.q_lora_rank > 0) {
                auto qa = MatVec(W(p + "attn_q_a.weight"), h, cfg_.q_lora_rank);
                q[t] = MatVec(W(p + "attn_q_b.weight"), Norm(qa, W(p + "attn_q_a_norm.weight")),
                              H * qk);
            } else {
                q[t] = MatVec(W(p + "attn_q.weight"), h, H * qk);
            }
            auto ckv = MatVec(wkva, h, L + R);
            std::vector<double> c(ckv.begin(), ckv.begin() + L);
            std::vector<double> kr(ckv.begin() + L, ckv.end());
            c = Norm(c, kvan);
            RopeDims(&kr, 0, R, t);
            k[t].assign(size_t(H) * qk, 0.0);
            v[t].assign(size_t(H) * vd, 0.0);
            for (int hh = 0; hh < H; ++hh) {
                RopeDims(&q[t], hh * qk + N, R, t);
                for (int dd = 0; dd < N; ++dd) {
                    double acc = 0;
                    for (int j = 0; j < L; ++j) acc += wkb[(size_t(hh) * L + j) * N + dd] * c[j];
                    k[t][hh * qk + dd] = acc;
                }
                for (int r = 0; r < R; ++r) k[t][hh * qk + N + r] = kr[r];
                for (int e = 0; e < vd; ++e) {
                    double acc = 0;
                    for (int j = 0; j < L; ++j) acc += wvb[(size_t(hh) * vd + e) * L + j] * c[j];
                    v[t][hh * vd + e] = acc;
                }
            }
        }
        for (int t = 0; t < n; ++t) {
            std::vector<double> att(size_t(H) * vd, 0.0);
            for (int hh = 0; hh < H; ++hh) {
                std::vector<double> sc(t + 1);
                double mx = -1e300;
                for (int u = 0; u <= t; ++u) {
                    double dot = 0;
                    for (int i = 0; i < qk; ++i) dot += q[t][hh * qk + i] * k[u][hh * qk + i];
                    sc[u] = dot / std::sqrt(double(qk));
                    mx = std::max(mx, sc[u]);
                }
                double sum = 0;
                for (double& e : sc) sum += (e = std::exp(e - mx));
                for (int u = 0; u <= t; ++u) {
                    for (int e = 0; e < vd; ++e)
                        att[hh * vd + e] += sc[u] / sum * v[u][hh * vd + e];
                }
            }
            auto o = MatVec(wo, att, d);
            for (int i = 0; i < d; ++i) x[t][i] += o[i];
        }
    }

    void MhaLayer(const std::string& p, const std::vector<double>& an, Rows* xs) {
        Rows& x = *xs;
        const int n = static_cast<int>(x.size()), d = cfg_.dim, hd = cfg_.head_dim;
        const int H = cfg_.num_heads, KV = cfg_.num_kv_heads;
        {
            auto wq = W(p + "attn_q.weight"), wk = W(p + "attn_k.weight");
            auto wv = W(p + "attn_v.weight"), wo = W(p + "attn_output.weight");
            std::vector<std::vector<double>> q(n), k(n), v(n);
            for (int t = 0; t < n; ++t) {
                auto h = Norm(x[t], an);
                q[t] = MatVec(wq, h, H * hd);
                k[t] = MatVec(wk, h, KV * hd);
                v[t] = MatVec(wv, h, KV * hd);
                Rope(&q[t], H, t);
                Rope(&k[t], KV, t);
            }
            for (int t = 0; t < n; ++t) {
                std::vector<double> att(H * hd, 0.0);
                for (int h = 0; h < H; ++h) {
                    int kh = h / (H / KV);
                    std::vector<double> s(t + 1);
                    double mx = -1e300;
                    for (int u = 0; u <= t; ++u) {
                        double dot = 0;
                        for (int i = 0; i < hd; ++i) dot += q[t][h * hd + i] * k[u][kh * hd + i];
                        s[u] = dot / std::sqrt(double(hd));
                        mx = std::max(mx, s[u]);
                    }
                    double sum = 0;
                    for (double& e : s) sum += (e = std::exp(e - mx));
                    for (int u = 0; u <= t; ++u) {
                        for (int i = 0; i < hd; ++i) {
                            att[h * hd + i] += s[u] / sum * v[u][kh * hd + i];
                        }
                    }
                }
                auto o = MatVec(wo, att, d);
                for (int i = 0; i < d; ++i) x[t][i] += o[i];
            }
        }
    }

    // RoPE (adjacent pairs) on dims [at, at + dims) of v, over `dims` dims.
    void RopeDims(std::vector<double>* v, int at, int dims, int pos) const {
        for (int i = 0; i < dims / 2; ++i) {
            double theta = pos * std::pow(double(cfg_.rope_theta), -2.0 * i / dims);
            double a = (*v)[at + 2 * i], b = (*v)[at + 2 * i + 1];
            (*v)[at + 2 * i] = a * std::cos(theta) - b * std::sin(theta);
            (*v)[at + 2 * i + 1] = a * std::sin(theta) + b * std::cos(theta);
        }
    }

  private:
    std::vector<double> W(const std::string& name) {
        const gguf::GgufTensor* t = file_->FindTensor(name);
        std::vector<double> out(t->elements());
        for (size_t i = 0; i < out.size(); ++i) {
            if (t->type == gguf::TensorType::kF32) {
                float f;
                std::memcpy(&f, t->data + 4 * i, 4);
                out[i] = f;
            } else {
                uint16_t h;
                std::memcpy(&h, t->data + 2 * i, 2);
                out[i] = t->type == gguf::TensorType::kF16 ? F16ToFloat(h) : Bf16ToFloat(h);
            }
        }
        return out;
    }
    // w is [rows][in] (ggml dims [in, rows]).
    static std::vector<double> MatVec(const std::vector<double>& w, const std::vector<double>& x,
                                      int rows) {
        std::vector<double> y(rows, 0.0);
        const size_t in = x.size();
        for (int r = 0; r < rows; ++r) {
            for (size_t i = 0; i < in; ++i) y[r] += w[r * in + i] * x[i];
        }
        return y;
    }
    std::vector<double> Norm(const std::vector<double>& x, const std::vector<double>& w) const {
        double ss = 0;
        for (double v : x) ss += v * v;
        double s = 1 / std::sqrt(ss / x.size() + cfg_.norm_eps);
        std::vector<double> y(x.size());
        for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * s * w[i];
        return y;
    }
    void Rope(std::vector<double>* v, int heads, int pos) const {
        const int hd = cfg_.head_dim;
        for (int h = 0; h < heads; ++h) {
            for (int i = 0; i < hd / 2; ++i) {
                double theta = pos * std::pow(double(cfg_.rope_theta), -2.0 * i / hd);
                double a = (*v)[h * hd + 2 * i], b = (*v)[h * hd + 2 * i + 1];
                (*v)[h * hd + 2 * i] = a * std::cos(theta) - b * std::sin(theta);
                (*v)[h * hd + 2 * i + 1] = a * std::sin(theta) + b * std::cos(theta);
            }
        }
    }

    std::unique_ptr<gguf::GgufFile> file_;
    ModelConfig cfg_;
};

struct Paged {
    std::vector<std::unique_ptr<kv::KvCache>> caches;
    std::vector<kv::KvCache*> ptrs;
};

Paged MakeCaches(const Model& m, int blocks, int block_tokens, kv::KvDtype dtype) {
    Paged p;
    for (int r = 0; r < m.cache_ranks(); ++r) {
        p.caches.push_back(
            std::move(kv::KvCache::Create(m.CacheSpec(block_tokens, blocks, dtype))).value());
        p.ptrs.push_back(p.caches.back().get());
    }
    return p;
}

std::vector<int32_t> Tokens(int n, int salt) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back((i * 37 + salt * 11 + 5) % 256);
    return t;
}

double MaxDiff(const float* got, const std::vector<double>& want) {
    double d = 0;
    for (size_t i = 0; i < want.size(); ++i) d = std::max(d, std::abs(got[i] - want[i]));
    return d;
}

class ModelTest : public ::testing::TestWithParam<int> {};  // tp

TEST_P(ModelTest, PrefillThenDecodeMatchesReference) {
    const int tp = GetParam();
    std::string path = TempPath("model-ref");
    FERRY_ASSERT_OK(WriteRandomModel(TestSpec(), 7, path));
    Reference ref(path);
    auto m = std::move(Model::Load(path, {.tp = tp})).value();
    const int V = m->config().vocab_size;
    auto tokens = Tokens(40, 1);
    auto want = ref.Logits(tokens);

    // Blocks deliberately out of order, so paging is exercised.
    std::vector<kv::BlockId> table = {5, 2, 7, 0, 3, 6};
    Paged p = MakeCaches(*m, 8, 8, kv::KvDtype::kF32);
    std::vector<float> logits(V);
    SeqChunk prefill{std::span(tokens).first(30), 0, table, true};
    FERRY_ASSERT_OK(m->Forward(std::span(&prefill, 1), p.ptrs, logits.data()));
    EXPECT_LT(MaxDiff(logits.data(), want[29]), 1e-4);
    for (int pos = 30; pos < 40; ++pos) {
        SeqChunk step{std::span(tokens).subspan(pos, 1), pos, table, true};
        FERRY_ASSERT_OK(m->Forward(std::span(&step, 1), p.ptrs, logits.data()));
        EXPECT_LT(MaxDiff(logits.data(), want[pos]), 1e-4) << "position " << pos;
    }
    std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(Tp, ModelTest, ::testing::Values(1, 2),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

// MLA (absorbed, over the shared latent cache) against the decompressed textbook form, with and
// without a query LoRA, at TP 1, 2 and 4 (the ranks share one cache), prefill in two chunks then
// decode steps, blocks out of order.
class MlaTest : public ::testing::TestWithParam<std::tuple<int, int>> {};  // tp, q_lora

TEST_P(MlaTest, PrefillThenDecodeMatchesTheDecompressedReference) {
    const auto [tp, q_lora] = GetParam();
    std::string path = TempPath("model-mla");
    FERRY_ASSERT_OK(WriteRandomModel(TestSpecMla(q_lora), 7, path));
    Reference ref(path);
    auto m = std::move(Model::Load(path, {.tp = tp})).value();
    const ModelConfig& c = m->config();
    EXPECT_TRUE(c.mla);
    EXPECT_EQ(c.attention(), "mla");
    EXPECT_EQ(c.head_dim, 32 + 8);
    EXPECT_EQ(m->cache_ranks(), 1);
    const kv::KvCacheSpec spec = m->CacheSpec(8, 8, kv::KvDtype::kF32);
    EXPECT_TRUE(spec.latent);
    EXPECT_EQ(spec.kv_heads, 1);
    EXPECT_EQ(spec.TotalBytes(), size_t(2) * 8 * 8 * 40 * 4);  // layers x blocks x tokens x row
    EXPECT_EQ(c.KvBytesPerToken(4), uint64_t(2) * 40 * 4);
    const int V = c.vocab_size;
    auto tokens = Tokens(40, 3);
    auto want = ref.Logits(tokens);
    std::vector<kv::BlockId> table = {5, 2, 7, 0, 3, 6};
    Paged p = MakeCaches(*m, 8, 8, kv::KvDtype::kF32);
    ASSERT_EQ(p.ptrs.size(), 1u);
    std::vector<float> logits(V);
    SeqChunk first{std::span(tokens).first(13), 0, table, true};
    FERRY_ASSERT_OK(m->Forward(std::span(&first, 1), p.ptrs, logits.data()));
    EXPECT_LT(MaxDiff(logits.data(), want[12]), 1e-4);
    SeqChunk second{std::span(tokens).subspan(13, 17), 13, table, true};
    FERRY_ASSERT_OK(m->Forward(std::span(&second, 1), p.ptrs, logits.data()));
    EXPECT_LT(MaxDiff(logits.data(), want[29]), 1e-4);
    for (int pos = 30; pos < 40; ++pos) {
        SeqChunk step{std::span(tokens).subspan(pos, 1), pos, table, true};
        FERRY_ASSERT_OK(m->Forward(std::span(&step, 1), p.ptrs, logits.data()));
        EXPECT_LT(MaxDiff(logits.data(), want[pos]), 1e-4) << "position " << pos;
    }
    // The cache holds [normed latent | roped key] rows: one per token, the same whatever the TP.
    std::vector<float> row(40);
    p.caches[0]->Load(1, false, table[0], 0, 1, row.data());
    EXPECT_NE(row[0], 0.0f);
    std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(Mla, MlaTest,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Values(0, 24)),
                         [](const auto& info) {
                             return "tp" + std::to_string(std::get<0>(info.param)) + "_qlora" +
                                    std::to_string(std::get<1>(info.param));
                         });

// A TP that does not split the heads, and a cache that is not one latent cache, are refused.
TEST(Mla, RefusesWhatItCannotRun) {
    std::string path = TempPath("model-mla-bad");
    RandomModelSpec s = TestSpecMla(0);
    FERRY_ASSERT_OK(WriteRandomModel(s, 1, path));
    // TP 3 divides neither the 4 heads nor the MLP.
    EXPECT_THAT(Model::Load(path, {.tp = 3}).status(), StatusIs(Code::kInvalidArgument));
    // A cache per rank is not what an MLA model takes.
    auto m = std::move(Model::Load(path, {.tp = 2})).value();
    kv::KvCacheSpec gqa = m->CacheSpec(8, 4, kv::KvDtype::kF32);
    gqa.latent = false;
    auto wrong = std::move(kv::KvCache::Create(gqa)).value();
    std::vector<kv::KvCache*> ptrs = {wrong.get()};
    std::vector<float> logits(m->config().vocab_size);
    auto tokens = Tokens(4, 1);
    std::vector<kv::BlockId> table = {0};
    SeqChunk ch{tokens, 0, table, true};
    EXPECT_THAT(m->Forward(std::span(&ch, 1), ptrs, logits.data()),
                StatusHas(Code::kInvalidArgument, "does not match"));
    std::remove(path.c_str());
}

// Thread counts follow the process's CPU affinity (`taskset`), not the machine's core count:
// pinned to one core, a model used to start as many BLAS threads as the machine has cores.
// Also run whole under `taskset -c 0` (ctest model_threads_under_taskset).
TEST(ModelThreads, FollowTheCpuAffinity) {
    if (std::getenv("OPENBLAS_NUM_THREADS")) GTEST_SKIP() << "OPENBLAS_NUM_THREADS is set";
    std::string path = TempPath("model-threads");
    FERRY_ASSERT_OK(WriteRandomModel(TestSpec(), 3, path));
    cpu_set_t all;
    ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
    EXPECT_EQ(UsableCores(), CPU_COUNT(&all));
    auto m = std::move(Model::Load(path)).value();
    EXPECT_EQ(BlasThreads(), CPU_COUNT(&all));
    m = std::move(Model::Load(path, {.tp = 2})).value();
    EXPECT_EQ(BlasThreads(), std::max(1, CPU_COUNT(&all) / 2));
    // Pinned to one of its cores (what `taskset -c N` does to a process).
    int first = 0;
    while (!CPU_ISSET(first, &all)) ++first;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
    EXPECT_EQ(UsableCores(), 1);
    m = std::move(Model::Load(path)).value();
    EXPECT_EQ(BlasThreads(), 1);
    ASSERT_EQ(sched_setaffinity(0, sizeof(all), &all), 0);
    std::filesystem::remove(path);
}

// OpenBLAS runs kernels of the CPU's width. Debian's OpenBLAS 0.3.21 does not know an Emerald
// Rapids Xeon (family 6, model 207) and ran Prescott's SSE3 kernels there: sgemm at a fifth of
// the rate of its SkylakeX kernels. After the switch, sgemm must still be right.
// An OPENBLAS_CORETYPE set in the environment is obeyed, and one narrower than the CPU (an
// environment here set Haswell on an AVX-512 EPYC: sgemm at half its SkylakeX rate) is named.
TEST(ModelBlas, KernelsOfTheCpusWidthAndStillRight) {
    const std::string said = ChooseBlasCore();
    EXPECT_EQ(&ChooseBlasCore(), &ChooseBlasCore());
    EXPECT_NE(said.find(BlasCore()), std::string::npos) << said;
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    if (const char* env = std::getenv("OPENBLAS_CORETYPE")) {
        EXPECT_STRCASEEQ(BlasCore().c_str(), env) << said;
        EXPECT_NE(said.find("OPENBLAS_CORETYPE"), std::string::npos) << said;
        const bool narrower = strcasecmp(env, "Haswell") == 0 || strcasecmp(env, "Zen") == 0 ||
                              strcasecmp(env, "Prescott") == 0;
        EXPECT_EQ(avx512 && narrower, said.find("unset it") != std::string::npos) << said;
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        for (const char* old : {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom",
                                "Nano", "Sandybridge", "Bulldozer", "Unknown"}) {
            EXPECT_STRCASENE(BlasCore().c_str(), old) << said;
        }
    }
    const int m = 37, n = 53, k = 29;
    std::vector<float> a(m * k), b(n * k), c(m * n);
    for (int i = 0; i < m * k; ++i) a[i] = std::sin(0.37f * i);
    for (int i = 0; i < n * k; ++i) b[i] = std::cos(0.11f * i);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, b.data(), k,
                0.0f, c.data(), n);
    for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
            double want = 0;
            for (int x = 0; x < k; ++x) want += double(a[i * k + x]) * b[j * k + x];
            ASSERT_NEAR(c[i * n + j], want, 1e-4) << i << "," << j;
        }
    }
}

// GGUF files ferry writes are valid for llama.cpp in every dtype: 1-D tensors (the norms) are
// f32, as llama.cpp's converter writes them (an f16 norm aborts llama.cpp in ggml's mul); the
// matrices are in the model's dtype.
TEST(RandomModel, OneDimensionalTensorsAreF32InEveryPresetAndDtype) {
    const gguf::TensorType dtypes[] = {gguf::TensorType::kF32, gguf::TensorType::kF16,
                                       gguf::TensorType::kBF16};
    for (const char* preset : {"tiny", "small"}) {
        for (gguf::TensorType dtype : dtypes) {
            SCOPED_TRACE(std::string(preset) + " " + std::string(gguf::TensorTypeName(dtype)));
            RandomModelSpec spec = PresetSpec(preset).value();
            spec.dtype = dtype;
            int norms = 0, matrices = 0;
            for (const RandomTensor& t : RandomModelTensors(spec)) {
                if (t.dims.size() == 1) {
                    EXPECT_EQ(t.type, gguf::TensorType::kF32) << t.name;
                    ++norms;
                } else {
                    EXPECT_EQ(t.type, dtype) << t.name;
                    ++matrices;
                }
            }
            EXPECT_EQ(norms, 2 * spec.num_layers + 1);
            EXPECT_EQ(matrices, 7 * spec.num_layers + 2);
        }
    }
    // And the writer stores exactly that (the tiny preset written in every dtype), and the
    // loader serves it.
    for (gguf::TensorType dtype : dtypes) {
        RandomModelSpec spec = TestSpec();
        spec.dtype = dtype;
        std::string path = TempPath("model-dtypes");
        FERRY_ASSERT_OK(WriteRandomModel(spec, 5, path));
        auto file = std::move(gguf::GgufFile::Open(path)).value();
        auto plan = RandomModelTensors(spec);
        ASSERT_EQ(file->tensors().size(), plan.size());
        for (const RandomTensor& t : plan) {
            const gguf::GgufTensor* got = file->FindTensor(t.name);
            ASSERT_NE(got, nullptr) << t.name;
            EXPECT_EQ(got->type, t.type) << t.name;
            EXPECT_EQ(got->dims, t.dims) << t.name;
        }
        FERRY_EXPECT_OK(Model::Load(path).status());
        std::filesystem::remove(path);
    }
}

// A decode step's logits are the same bits alone as in a batch with 39 other decode steps and
// a prefill chunk: decode rows go through the row kernels however many there are, prefill rows
// through sgemm (before, the kernel was chosen by the batch's row count, so a sequence's
// numbers depended on its neighbours, and a decode worker's greedy tokens could differ from a
// colocated engine's at a near tie).
TEST(Model, ADecodeStepIsTheSameBitsAloneAndInABigMixedBatch) {
    for (gguf::TensorType wt : {gguf::TensorType::kF32, gguf::TensorType::kF16}) {
        SCOPED_TRACE(std::string(gguf::TensorTypeName(wt)));
        RandomModelSpec spec = TestSpec();
        spec.dtype = wt;
        std::string path = TempPath("model-invariant");
        FERRY_ASSERT_OK(WriteRandomModel(spec, 4, path));
        auto m = std::move(Model::Load(path)).value();
        const int V = m->config().vocab_size;
        constexpr int kSeqs = 40, kPrompt = 5;
        Paged p = MakeCaches(*m, kSeqs + 4, 16, kv::KvDtype::kF32);
        std::vector<std::vector<int32_t>> prompts;
        std::vector<std::vector<kv::BlockId>> tables;
        for (int i = 0; i < kSeqs; ++i) {
            prompts.push_back(Tokens(kPrompt + 1, 10 + i));
            tables.push_back({kv::BlockId(i)});
        }
        // Every sequence's first kPrompt tokens, one prefill chunk each, in one step.
        std::vector<SeqChunk> pre;
        for (int i = 0; i < kSeqs; ++i) {
            pre.push_back({std::span(prompts[i]).first(kPrompt), 0, tables[i], false});
        }
        FERRY_ASSERT_OK(m->Forward(pre, p.ptrs, nullptr));
        // Sequence 0's decode step alone, then with the 39 others and a 40-token prefill.
        std::vector<float> alone(V);
        SeqChunk step0{std::span(prompts[0]).subspan(kPrompt), kPrompt, tables[0], true};
        FERRY_ASSERT_OK(m->Forward(std::span(&step0, 1), p.ptrs, alone.data()));
        auto long_prompt = Tokens(40, 99);
        std::vector<kv::BlockId> long_table = {kSeqs, kSeqs + 1, kSeqs + 2};
        std::vector<SeqChunk> big = {{std::span(long_prompt), 0, long_table, true}};
        for (int i = 0; i < kSeqs; ++i) {
            big.push_back({std::span(prompts[i]).subspan(kPrompt), kPrompt, tables[i], true});
        }
        std::vector<float> batch(size_t(V) * big.size());
        FERRY_ASSERT_OK(m->Forward(big, p.ptrs, batch.data()));
        for (int v = 0; v < V; ++v) ASSERT_EQ(alone[v], batch[size_t(V) + v]) << "logit " << v;
        std::filesystem::remove(path);
    }
}

TEST(Model, BatchOfChunksMatchesReferencePerSequence) {
    std::string path = TempPath("model-batch");
    FERRY_ASSERT_OK(WriteRandomModel(TestSpec(), 3, path));
    Reference ref(path);
    auto m = std::move(Model::Load(path)).value();
    const int V = m->config().vocab_size;
    auto a = Tokens(21, 2), b = Tokens(9, 3), c = Tokens(17, 4);
    auto wa = ref.Logits(a), wb = ref.Logits(b), wc = ref.Logits(c);
    Paged p = MakeCaches(*m, 16, 4, kv::KvDtype::kF32);
    std::vector<kv::BlockId> ta = {0, 1, 2, 3, 4, 5}, tb = {6, 7, 8}, tc = {9, 10, 11, 12, 13};
    // Step 1: a's first 12 tokens (no logits), b whole, c's first 16.
    std::vector<SeqChunk> s1 = {{std::span(a).first(12), 0, ta, false},
                                {std::span(b), 0, tb, true},
                                {std::span(c).first(16), 0, tc, true}};
    std::vector<float> logits(3 * V);
    FERRY_ASSERT_OK(m->Forward(s1, p.ptrs, logits.data()));
    EXPECT_LT(MaxDiff(&logits[0], wb[8]), 1e-4);
    EXPECT_LT(MaxDiff(&logits[V], wc[15]), 1e-4);
    // Step 2: the rest of a, and c's last token.
    std::vector<SeqChunk> s2 = {{std::span(a).subspan(12), 12, ta, true},
                                {std::span(c).subspan(16), 16, tc, true}};
    FERRY_ASSERT_OK(m->Forward(s2, p.ptrs, logits.data()));
    EXPECT_LT(MaxDiff(&logits[0], wa[20]), 1e-4);
    EXPECT_LT(MaxDiff(&logits[V], wc[16]), 1e-4);
    std::remove(path.c_str());
}

TEST(Model, HalfPrecisionWeightsAndCaches) {
    for (gguf::TensorType wt : {gguf::TensorType::kF16, gguf::TensorType::kBF16}) {
        for (kv::KvDtype kt : {kv::KvDtype::kF16, kv::KvDtype::kBF16}) {
            RandomModelSpec spec = TestSpec();
            spec.dtype = wt;
            spec.tied_embeddings = true;
            std::string path = TempPath("model-half");
            FERRY_ASSERT_OK(WriteRandomModel(spec, 9, path));
            Reference ref(path);  // reads the same rounded weights
            auto m = std::move(Model::Load(path)).value();
            EXPECT_TRUE(m->config().tied_embeddings);
            auto tokens = Tokens(24, 5);
            auto want = ref.Logits(tokens);
            Paged p = MakeCaches(*m, 4, 8, kt);
            std::vector<kv::BlockId> table = {3, 1, 2};
            std::vector<float> logits(m->config().vocab_size);
            SeqChunk ch{tokens, 0, table, true};
            FERRY_ASSERT_OK(m->Forward(std::span(&ch, 1), p.ptrs, logits.data()));
            // Only the KV rounding differs from the reference, and for bf16 weights on a CPU
            // with AVX-512 BF16 the prompt's activations rounded to bf16 (its products run on
            // bf16 pairs, as llama.cpp's do): as coarse as a bf16 cache.
            const bool coarse =
                kt == kv::KvDtype::kBF16 || (wt == gguf::TensorType::kBF16 && Bf16DotProducts());
            EXPECT_LT(MaxDiff(logits.data(), want[23]), coarse ? 1e-1 : 2e-2)
                << gguf::TensorTypeName(wt) << " weights, " << kv::KvDtypeName(kt) << " cache";
            std::remove(path.c_str());
        }
    }
}

TEST(Model, RefusesBadInputToForward) {
    std::string path = TempPath("model-bad");
    FERRY_ASSERT_OK(WriteRandomModel(TestSpec(), 1, path));
    auto m = std::move(Model::Load(path)).value();
    Paged p = MakeCaches(*m, 4, 8, kv::KvDtype::kF32);
    std::vector<float> logits(m->config().vocab_size);
    std::vector<int32_t> bad = {1, 2, 99999};
    std::vector<kv::BlockId> table = {0};
    SeqChunk ch{bad, 0, table, true};
    EXPECT_THAT(m->Forward(std::span(&ch, 1), p.ptrs, logits.data()),
                StatusHas(Code::kInvalidArgument, "token id 99999"));
    std::vector<int32_t> many(20, 1);
    SeqChunk ch2{many, 0, table, true};
    EXPECT_THAT(m->Forward(std::span(&ch2, 1), p.ptrs, logits.data()),
                StatusHas(Code::kInvalidArgument, "1 blocks for 20 tokens"));
    std::vector<kv::BlockId> far = {0, 9};
    SeqChunk ch3{std::span(many).first(10), 0, far, true};
    EXPECT_THAT(m->Forward(std::span(&ch3, 1), p.ptrs, logits.data()),
                StatusHas(Code::kInvalidArgument, "block id 9"));
    SeqChunk ch4{std::span(many).first(1), 256, table, true};
    EXPECT_THAT(m->Forward(std::span(&ch4, 1), p.ptrs, logits.data()),
                StatusHas(Code::kInvalidArgument, "context length 256"));
    std::remove(path.c_str());
}

TEST(Model, RefusesUnusableFiles) {
    std::string path = TempPath("model-unusable");
    EXPECT_THAT(Model::Load(path).status(), StatusIs(Code::kNotFound));
    FERRY_ASSERT_OK(WriteRandomModel(TestSpec(), 1, path));
    EXPECT_THAT(Model::Load(path, {.tp = 3}).status(),
                StatusHas(Code::kInvalidArgument, "tp 3 must divide"));
    // 4 heads, 2 kv heads: TP 4 replicates each kv head on two ranks; TP 8 has too few heads.
    FERRY_EXPECT_OK(Model::Load(path, {.tp = 4}).status());
    EXPECT_THAT(Model::Load(path, {.tp = 8}).status(),
                StatusHas(Code::kInvalidArgument, "tp 8 must divide the 4 heads"));
    // A file with a tensor of the wrong shape.
    gguf::GgufWriter w;
    w.SetString("general.architecture", "llama");
    w.SetUint32("llama.embedding_length", 8);
    w.SetUint32("llama.block_count", 1);
    w.SetUint32("llama.attention.head_count", 2);
    w.SetUint32("llama.feed_forward_length", 16);
    w.SetString("tokenizer.ggml.model", "gpt2");
    w.SetStringArray("tokenizer.ggml.tokens", {"a", "b"});
    FERRY_ASSERT_OK(
        w.AddTensor("token_embd.weight", {8, 2}, gguf::TensorType::kF32, std::string(64, '\0')));
    FERRY_ASSERT_OK(
        w.AddTensor("output_norm.weight", {7}, gguf::TensorType::kF32, std::string(28, '\0')));
    FERRY_ASSERT_OK(w.Write(path));
    EXPECT_THAT(
        Model::Load(path).status(),
        StatusHas(Code::kInvalidArgument, "tensor output_norm.weight has dims [7], expected [8]"));
    // Optional floats present with values no float holds, or not positive.
    for (double bad : {1e300, -1.0, 0.0, std::nan("")}) {
        SCOPED_TRACE(bad);
        gguf::GgufWriter f = w;
        f.SetFloat64("llama.rope.freq_base", bad);
        FERRY_ASSERT_OK(f.Write(path));
        EXPECT_THAT(Model::Load(path).status(),
                    StatusHas(Code::kInvalidArgument, "llama.rope.freq_base = "));
    }
    gguf::GgufWriter eps = w;
    eps.SetString("llama.attention.layer_norm_rms_epsilon", "small");
    FERRY_ASSERT_OK(eps.Write(path));
    EXPECT_THAT(Model::Load(path).status(),
                StatusHas(Code::kInvalidArgument,
                          "'llama.attention.layer_norm_rms_epsilon' is not a float"));
    gguf::GgufWriter other;
    other.SetString("general.architecture", "gpt-neox");
    FERRY_ASSERT_OK(other.Write(path));
    EXPECT_THAT(Model::Load(path).status(),
                StatusHas(Code::kInvalidArgument, "architecture 'gpt-neox'"));
    std::remove(path.c_str());
}

TEST(Half, ConversionsRoundToNearestEven) {
    for (float f : {0.0f, 1.0f, -2.5f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f, 0.33325195f}) {
        EXPECT_EQ(F16ToFloat(FloatToF16(f)), f) << f;
    }
    EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);            // rounds to infinity
    EXPECT_EQ(FloatToF16(1.0f + 1.0f / 2048), 0x3c00);  // tie to even
    EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(NAN))));
    EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f)), 1.0f);
    EXPECT_EQ(FloatToBf16(1.0f + 1.0f / 256), 0x3f80);  // tie to even
}

}  // namespace
}  // namespace ferry::model
