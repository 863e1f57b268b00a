#include "model/model.h"

#include <cblas.h>
#include <fmt/core.h>
#include <strings.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>

#include "core/cpu.h"
#include "core/crypto.h"
#include "core/half.h"
#include "core/log.h"
#include "kv/connector.h"
#include "kv/kv_layout.h"
#include "model/kernels.h"

namespace ferry::model {

namespace {

Result<uint64_t> Key(const GgufFile& f, const std::string& key) { return f.GetUint(key); }

void Append(std::vector<float>* dst, const std::vector<float>& src) {
    dst->insert(dst->end(), src.begin(), src.end());
}

// A layer's MLP and its two norms, as every architecture here has them.
struct MlpTensors {
    const Weights& gate;
    const Weights& up;
    const Weights& down;
    const std::vector<float>& attn_norm;
    const std::vector<float>& ffn_norm;
};

// Rank r's slice of them: its rows of gate and up (one product), its columns of down; the norms
// whole.
template <class Rank, class Layer>
void SliceMlp(int r, const MlpTensors& t, Rank* rk, Layer* layer) {
    const uint64_t f0 = uint64_t(r) * rk->ffn, f1 = f0 + rk->ffn;
    layer->wgu = RowsOf(t.gate, f0, f1);
    AppendRows(&layer->wgu, RowsOf(t.up, f0, f1));
    layer->wdown = ColsOf(t.down, f0, f1);
    Append(&rk->attn_norm, t.attn_norm);
    Append(&rk->ffn_norm, t.ffn_norm);
}

void RmsNorm(const float* x, const float* w, int dim, float eps, float* out) {
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += double(x[i]) * x[i];
    float scale = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
    for (int i = 0; i < dim; ++i) out[i] = x[i] * scale * w[i];
}

float Dot(const float* a, const float* b, int n) {
    float acc[8] = {};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
    }
    float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

// Chunks up to this many tokens (decode steps) attend with dot products read straight from the
// blocks; longer ones gather K and V and use sgemm over tiles of query rows.
constexpr int kSmallChunk = 8;
constexpr int kQueryTile = 128;

}  // namespace

// --- config ------------------------------------------------------------------------------------

Result<ModelConfig> ModelConfig::FromGguf(const GgufFile& f) {
    auto arch = f.GetString("general.architecture");
    if (!arch.ok()) return InvalidArgumentError(f.path() + ": general.architecture is missing");
    if (*arch != "llama" && *arch != "deepseek2") {
        return InvalidArgumentError(
            fmt::format("{}: architecture '{}' is not supported (llama, or deepseek2 for MLA)",
                        f.path(), *arch));
    }
    const std::string a = *arch + ".";
    ModelConfig c;
    c.mla = *arch == "deepseek2";
    auto name = f.GetString("general.name");
    c.name = name.ok() ? *name : f.path().substr(f.path().find_last_of('/') + 1);
    // `min` 0 allows a key to be 0 (q_lora_rank: none).
    auto get = [&](const std::string& key, int* out, bool required, int fallback,
                   uint64_t min = 1) -> Status {
        auto v = Key(f, a + key);
        if (!v.ok()) {
            if (required || v.status().code() != Code::kNotFound) {
                return InvalidArgumentError(fmt::format("{}: {}", f.path(), v.status().message()));
            }
            *out = fallback;
            return Status::Ok();
        }
        if (*v < min || *v > (1u << 24)) {
            return InvalidArgumentError(
                fmt::format("{}: {}{} = {} is out of range", f.path(), a, key, *v));
        }
        *out = static_cast<int>(*v);
        return Status::Ok();
    };
    FERRY_RETURN_IF_ERROR(get("embedding_length", &c.dim, true, 0));
    FERRY_RETURN_IF_ERROR(get("block_count", &c.num_layers, true, 0));
    FERRY_RETURN_IF_ERROR(get("attention.head_count", &c.num_heads, true, 0));
    FERRY_RETURN_IF_ERROR(get("attention.head_count_kv", &c.num_kv_heads, false, c.num_heads));
    FERRY_RETURN_IF_ERROR(get("feed_forward_length", &c.ffn_dim, true, 0));
    FERRY_RETURN_IF_ERROR(get("context_length", &c.context_length, false, 2048));
    if (!c.mla) {
        FERRY_RETURN_IF_ERROR(
            get("attention.key_length", &c.head_dim, false, c.num_heads ? c.dim / c.num_heads : 0));
    } else {
        // llama.cpp's deepseek2 with MLA: the latent view (key_length = latent + rope,
        // value_length = latent, one kv head) and the per-head view (key_length_mla,
        // value_length_mla); the split attn_k_b / attn_v_b tensors, not the legacy attn_kv_b.
        int key_mla = 0, lead = 0, key = 0, value = 0;
        FERRY_RETURN_IF_ERROR(get("attention.kv_lora_rank", &c.kv_lora_rank, true, 0));
        FERRY_RETURN_IF_ERROR(get("attention.q_lora_rank", &c.q_lora_rank, false, 0, 0));
        FERRY_RETURN_IF_ERROR(get("rope.dimension_count", &c.qk_rope_dim, true, 0));
        FERRY_RETURN_IF_ERROR(get("attention.key_length_mla", &key_mla, true, 0));
        FERRY_RETURN_IF_ERROR(get("attention.value_length_mla", &c.v_head_dim, true, 0));
        FERRY_RETURN_IF_ERROR(get("leading_dense_block_count", &lead, false, 0, 0));
        FERRY_RETURN_IF_ERROR(get("attention.key_length", &key, false, 0));
        FERRY_RETURN_IF_ERROR(get("attention.value_length", &value, false, 0));
        if (lead != c.num_layers) {
            return InvalidArgumentError(fmt::format(
                "{}: {}leading_dense_block_count is {} of {} layers: mixture-of-experts layers "
                "are not supported (dense layers only)",
                f.path(), a, lead, c.num_layers));
        }
        if (c.num_kv_heads != 1) {
            return InvalidArgumentError(
                fmt::format("{}: {}attention.head_count_kv is {}; MLA's latent is one kv head",
                            f.path(), a, c.num_kv_heads));
        }
        if (key_mla <= c.qk_rope_dim) {
            return InvalidArgumentError(fmt::format(
                "{}: {}attention.key_length_mla {} leaves no dims without RoPE ({} with)", f.path(),
                a, key_mla, c.qk_rope_dim));
        }
        c.qk_nope_dim = key_mla - c.qk_rope_dim;
        c.head_dim = c.kv_lora_rank + c.qk_rope_dim;
        if ((key && key != c.head_dim) || (value && value != c.kv_lora_rank)) {
            return InvalidArgumentError(fmt::format(
                "{}: {}attention.key_length {} and value_length {} are not the latent's {} + {} "
                "and {}",
                f.path(), a, key, value, c.kv_lora_rank, c.qk_rope_dim, c.kv_lora_rank));
        }
        if (f.FindTensor("blk.0.attn_kv_b.weight") && !f.FindTensor("blk.0.attn_k_b.weight")) {
            return InvalidArgumentError(f.path() +
                                        ": a legacy MLA file (attn_kv_b, not attn_k_b / attn_v_b)");
        }
    }
    // An optional float keeps its default when absent; present, it must be a positive float.
    auto get_float = [&](const std::string& key, float* out) -> Status {
        auto v = f.GetFloat(a + key);
        if (!v.ok()) {
            return v.status().code() == Code::kNotFound ? Status::Ok() : v.status();
        }
        if (!(*v > 0 && *v <= std::numeric_limits<float>::max())) {
            return InvalidArgumentError(
                fmt::format("{}: {}{} = {} is not a positive float", f.path(), a, key, *v));
        }
        *out = static_cast<float>(*v);
        return Status::Ok();
    };
    FERRY_RETURN_IF_ERROR(get_float("rope.freq_base", &c.rope_theta));
    FERRY_RETURN_IF_ERROR(get_float("attention.layer_norm_rms_epsilon", &c.norm_eps));
    const GgufTensor* emb = f.FindTensor("token_embd.weight");
    if (!emb || emb->dims.size() != 2) {
        return InvalidArgumentError(f.path() + ": tensor token_embd.weight is missing or not 2-D");
    }
    c.vocab_size = static_cast<int>(std::min<uint64_t>(emb->dims[1], 1u << 24));
    c.tied_embeddings = f.FindTensor("output.weight") == nullptr;
    FERRY_RETURN_IF_ERROR(c.Validate().WithContext(f.path()));
    return c;
}

Status ModelConfig::Validate() const {
    if (dim <= 0 || num_layers <= 0 || num_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0 ||
        ffn_dim <= 0 || vocab_size <= 0 || context_length <= 0) {
        return InvalidArgumentError("model config: every dimension must be positive");
    }
    if (num_heads % num_kv_heads != 0) {
        return InvalidArgumentError(fmt::format(
            "model config: {} heads are not a multiple of {} kv heads", num_heads, num_kv_heads));
    }
    if (head_dim % 2 != 0) {
        return InvalidArgumentError(fmt::format("model config: head dim {} is odd", head_dim));
    }
    if (mla) {
        if (num_kv_heads != 1 || kv_lora_rank <= 0 || qk_nope_dim <= 0 || qk_rope_dim <= 0 ||
            v_head_dim <= 0 || q_lora_rank < 0 || head_dim != kv_lora_rank + qk_rope_dim) {
            return InvalidArgumentError(
                "model config: MLA needs one kv head, a latent, per-head dims with and without "
                "RoPE and a value width");
        }
        if (qk_rope_dim % 2 != 0) {
            return InvalidArgumentError(
                fmt::format("model config: RoPE dims {} are odd", qk_rope_dim));
        }
    }
    if (!(rope_theta > 0) || !(norm_eps > 0)) {
        return InvalidArgumentError("model config: rope theta and norm eps must be positive");
    }
    return Status::Ok();
}

uint64_t ModelConfig::ParamCount() const {
    uint64_t attn = uint64_t(dim) * head_dim * (2 * num_heads + 2 * num_kv_heads);
    if (mla) {
        const uint64_t h = num_heads, qk = qk_nope_dim + qk_rope_dim;
        const uint64_t q = q_lora_rank > 0
                               ? uint64_t(dim) * q_lora_rank + q_lora_rank + q_lora_rank * h * qk
                               : uint64_t(dim) * h * qk;
        attn = q + uint64_t(dim) * head_dim + kv_lora_rank +
               h * kv_lora_rank * (qk_nope_dim + v_head_dim) + h * v_head_dim * dim;
    }
    uint64_t per_layer = attn + 3ull * dim * ffn_dim + 2ull * dim;
    return per_layer * num_layers + uint64_t(vocab_size) * dim * (tied_embeddings ? 1 : 2) + dim;
}

uint64_t ModelConfig::KvBytesPerToken(int dtype_bytes) const {
    const uint64_t per_layer = mla ? uint64_t(head_dim) : 2ull * num_kv_heads * head_dim;
    return per_layer * num_layers * dtype_bytes;
}

// --- ranks -------------------------------------------------------------------------------------

// Weights in the file's precision (kernels.h).
struct Model::Layer {
    Weights wqkv;   // [(q + 2 kv) * head_dim][dim]; MLA: the queries' rows (or q_a's), then kv_a's
    Weights wo;     // [dim][q * head_dim]; MLA: [dim][q * v_head_dim]
    Weights wgu;    // [2 ffn][dim]: gate rows, then up rows
    Weights wdown;  // [dim][ffn]
    // MLA only.
    Weights wqb;                   // [q * (nope + rope)][q_lora_rank] (with a query LoRA)
    std::vector<float> q_a_norm;   // [q_lora_rank]
    std::vector<float> kv_a_norm;  // [kv_lora_rank]
    std::vector<float> wkb;        // [q heads][kv_lora_rank][nope]: no-RoPE query to latent
    std::vector<float> wvb;        // [q heads][v_head_dim][kv_lora_rank]: latent to value
};

struct Model::AttendSpace {
    AlignedFloats kbuf, vbuf, qstack, scores;
};

struct Model::Rank {
    int q_heads = 0, kv_heads = 0, ffn = 0;
    int vocab_begin = 0, vocab_end = 0;
    std::vector<Layer> layers;
    std::vector<float> attn_norm, ffn_norm;  // [layers][dim], shared values
    Weights wout;                            // [vocab_end - vocab_begin][dim]
    // The threads of this rank's matrix products on 16-bit weights.
    std::unique_ptr<WorkPool> work;
    // Workspace, grown as needed.
    // Cache-line aligned: the row kernels read rows of these with 64-byte loads.
    AlignedFloats xn, qkv, attn, partial, gu, act, sel, widened;
    AlignedFloats qa, qmla, qcat, olat;  // MLA: q LoRA, queries, latent-space queries, outputs
    // A layer's attention of short chunks: one part per chunk and KV head.
    struct ShortPart {
        const SeqChunk* chunk;
        int head, t0;
    };
    std::vector<ShortPart> short_parts;
    std::vector<ShortPart> long_parts;  // the same for long chunks (prefill)
    AttendSpace attend;  // the workspace of long chunks' attention, one head at a time

    // The forward pass's rows in runs of one kind: [begin, end) rows of short chunks (decode
    // steps), which go through the row kernels however many there are, or of long ones
    // (prefill), which go through sgemm. A sequence's numbers then depend on its own chunk,
    // not on what else is in the batch: a decode worker's tokens equal a colocated engine's
    // whatever each batched them with.
    struct RowRun {
        int begin, end;
        bool short_rows;
    };
    std::vector<RowRun> runs;

    // C = A W^T over the forward pass's rows, run by run.
    void MatMul(const float* a, int lda, const Weights& w, float* c, int ldc) {
        for (const RowRun& r : runs) {
            const float* ar = a + static_cast<size_t>(r.begin) * lda;
            float* cr = c + static_cast<size_t>(r.begin) * ldc;
            if (r.short_rows) {
                MatMulRows(r.end - r.begin, ar, lda, w, cr, ldc, *work);
            } else {
                MatMulBulk(r.end - r.begin, ar, lda, w, cr, ldc, *work, &widened);
            }
        }
    }
};

class Model::RankPool {
  public:
    explicit RankPool(int n) : n_(n), barrier_(n) {
        for (int r = 1; r < n; ++r) threads_.emplace_back([this, r] { Loop(r); });
    }
    ~RankPool() {
        {
            std::lock_guard lock(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : threads_) t.join();
    }
    // Runs fn(r) for every rank, rank 0 on the caller, and returns when all are done.
    void Run(const std::function<void(int)>& fn) {
        if (n_ == 1) {
            fn(0);
            return;
        }
        {
            std::lock_guard lock(mu_);
            fn_ = &fn;
            pending_ = n_ - 1;
            ++generation_;
        }
        cv_.notify_all();
        fn(0);
        std::unique_lock lock(mu_);
        done_cv_.wait(lock, [&] { return pending_ == 0; });
        fn_ = nullptr;
    }
    void Sync() {
        if (n_ > 1) barrier_.arrive_and_wait();
    }

  private:
    void Loop(int r) {
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(int)>* fn;
            {
                std::unique_lock lock(mu_);
                cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
                if (stop_) return;
                seen = generation_;
                fn = fn_;
            }
            (*fn)(r);
            {
                std::lock_guard lock(mu_);
                if (--pending_ == 0) done_cv_.notify_one();
            }
        }
    }

    int n_;
    std::barrier<> barrier_;
    std::mutex mu_;
    std::condition_variable cv_, done_cv_;
    const std::function<void(int)>* fn_ = nullptr;
    uint64_t generation_ = 0;
    int pending_ = 0;
    bool stop_ = false;
    std::vector<std::thread> threads_;
};

// --- loading -----------------------------------------------------------------------------------

Model::~Model() = default;

Result<std::unique_ptr<Model>> Model::Load(const std::string& path, const ModelOptions& options) {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(path));
    std::unique_ptr<Model> m(new Model());
    FERRY_ASSIGN_OR_RETURN(m->config_, ModelConfig::FromGguf(*file));
    FERRY_ASSIGN_OR_RETURN(m->tokenizer_, Tokenizer::FromGguf(*file));
    if (m->tokenizer_->vocab_size() > m->config_.vocab_size) {
        return InvalidArgumentError(
            fmt::format("{}: the tokenizer has {} tokens but the embedding only {} rows", path,
                        m->tokenizer_->vocab_size(), m->config_.vocab_size));
    }
    const ModelConfig& c = m->config_;
    const int tp = options.tp;
    // More ranks than kv heads replicate them (kv::RankHeadBegin): each rank holds the one its
    // query heads attend to.
    if (tp < 1 || tp > 64 || c.num_heads % tp || !kv::TpSplitsHeads(tp, c.num_kv_heads) ||
        c.ffn_dim % tp) {
        return InvalidArgumentError(fmt::format(
            "tp {} must divide the {} heads and MLP width {}, and divide or be a multiple of the "
            "{} kv heads, of {}",
            tp, c.num_heads, c.ffn_dim, c.num_kv_heads, path));
    }
    m->tp_ = tp;
    FERRY_RETURN_IF_ERROR(m->LoadWeights(*file));
    {
        // Metadata alone would not tell two random-weight files of one shape apart: a sample of
        // every tensor's bytes goes in too.
        std::string id = fmt::format("{} {} {} {} {} {} {} {} {}", c.vocab_size, c.dim,
                                     c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                                     c.ffn_dim, c.rope_theta, c.norm_eps);
        if (c.mla) {
            id += fmt::format(" mla {} {} {} {} {}", c.q_lora_rank, c.kv_lora_rank, c.qk_nope_dim,
                              c.qk_rope_dim, c.v_head_dim);
        }
        id += file->TensorSample();
        Digest d = HmacSha256("ferry model fingerprint", id);
        m->fingerprint_ = HexEncode(d.data(), 16);
    }
    m->pool_ = std::make_unique<RankPool>(tp);
    // BLAS threads per rank: the cores this process may use (its affinity, e.g. `taskset`),
    // shared out among the ranks, each of which calls sgemm on its own thread; never more than
    // OPENBLAS_NUM_THREADS asks for.
    int threads = std::max(1, UsableCores() / tp);
    if (const char* env = std::getenv("OPENBLAS_NUM_THREADS"); env && std::atoi(env) > 0) {
        threads = std::min(threads, std::atoi(env));
    }
    ChooseBlasCore();
    openblas_set_num_threads(threads);
    m->blas_threads_ = threads;
    for (auto& rank : m->ranks_) rank->work = std::make_unique<WorkPool>(threads);
    return m;
}

int BlasThreads() { return openblas_get_num_threads(); }

}  // namespace ferry::model

// In OpenBLAS builds with DYNAMIC_ARCH (Debian's): drop and redo the choice of kernel table, as
// at load, which reads OPENBLAS_CORETYPE. Weak, so a build without them links and skips.
extern "C" void gotoblas_dynamic_init(void) __attribute__((weak));
extern "C" void gotoblas_dynamic_quit(void) __attribute__((weak));
extern "C" char* openblas_get_corename(void);

namespace ferry::model {

std::string BlasCore() {
    const char* name = openblas_get_corename();
    return name ? name : "";
}

namespace {

// How wide OpenBLAS's x86-64 kernels for a core name are: 0 older than AVX2, 1 AVX2 + FMA,
// 2 AVX-512; -1 a name not listed (left alone).
int BlasCoreWidth(const std::string& core) {
    static constexpr const char* kOld[] = {
        "Prescott",  "Core2",      "Penryn",       "Dunnington", "Nehalem", "Atom",
        "Nano",      "Opteron",    "Opteron_SSE3", "Barcelona",  "Bobcat",  "Sandybridge",
        "Bulldozer", "Piledriver", "Steamroller",  "Unknown"};
    static constexpr const char* kAvx2[] = {"Haswell", "Zen", "Excavator"};
    static constexpr const char* kAvx512[] = {"SkylakeX", "Cooperlake", "SapphireRapids"};
    auto in = [&](const auto& names) {
        for (const char* n : names) {
            if (strcasecmp(core.c_str(), n) == 0) return true;
        }
        return false;
    };
    if (in(kOld)) return 0;
    if (in(kAvx2)) return 1;
    if (in(kAvx512)) return 2;
    return -1;
}

}  // namespace

const std::string& ChooseBlasCore() {
    static const std::string said = [] {
        const std::string was = BlasCore();
        __builtin_cpu_init();
        const char* want = nullptr;
        int want_width = 0;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
            want = __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
            want_width = 2;
        } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
            want = "Haswell";
            want_width = 1;
        }
        const int width = BlasCoreWidth(was);
        if (std::getenv("OPENBLAS_CORETYPE")) {
            // Yours to choose; but a core narrower than the CPU halves sgemm (prefill) or worse,
            // and an environment can set it without anyone noticing: say so.
            if (want && width >= 0 && width < want_width) {
                std::string msg = fmt::format(
                    "OpenBLAS core {} (OPENBLAS_CORETYPE; this CPU has {}'s features: unset it "
                    "for wider sgemm kernels)",
                    was, want);
                FERRY_LOG(kWarn, "{}", msg);
                return msg;
            }
            return fmt::format("OpenBLAS core {} (OPENBLAS_CORETYPE)", was);
        }
        if (width != 0 || !want) return fmt::format("OpenBLAS core {}", was);
        if (!gotoblas_dynamic_init || !gotoblas_dynamic_quit) {
            return fmt::format(
                "OpenBLAS core {} on a CPU with {}'s features (OpenBLAS built "
                "without DYNAMIC_ARCH: left as is)",
                was, want);
        }
        // Before any BLAS call of ours. The variable is set only for OpenBLAS's init and then
        // removed, so child processes choose for themselves.
        setenv("OPENBLAS_CORETYPE", want, 1);
        gotoblas_dynamic_quit();
        gotoblas_dynamic_init();
        unsetenv("OPENBLAS_CORETYPE");
        return fmt::format(
            "OpenBLAS core {} (OpenBLAS picked {} for this CPU, which has {}'s "
            "features)",
            BlasCore(), was, want);
    }();
    return said;
}

TensorType Model::MatrixType() const {
    const Rank& rk = *ranks_.front();
    return rk.layers.empty() ? rk.wout.type : rk.layers.front().wqkv.type;
}

uint64_t Model::StreamedWeightBytes() const {
    uint64_t n = 0;
    for (const auto& rk : ranks_) {
        n += rk->wout.size_bytes();
        for (const Layer& L : rk->layers) {
            n += L.wqkv.size_bytes() + L.wo.size_bytes() + L.wgu.size_bytes() +
                 L.wdown.size_bytes() + L.wqb.size_bytes() + (L.wkb.size() + L.wvb.size()) * 4;
        }
    }
    return n;
}

Status Model::LoadWeights(const GgufFile& f) {
    const ModelConfig& c = config_;
    const auto dim = static_cast<uint64_t>(c.dim);
    const auto hd = static_cast<uint64_t>(c.head_dim);
    const auto vocab = static_cast<uint64_t>(c.vocab_size);
    FERRY_ASSIGN_OR_RETURN(embedding_, TensorWeights(f, "token_embd.weight", {dim, vocab}));
    FERRY_ASSIGN_OR_RETURN(output_norm_, TensorF32(f, "output_norm.weight", {dim}));
    Weights out_w;
    if (!c.tied_embeddings) {
        FERRY_ASSIGN_OR_RETURN(out_w, TensorWeights(f, "output.weight", {dim, vocab}));
    }
    const Weights& head = c.tied_embeddings ? embedding_ : out_w;

    // RoPE over the head (llama) or over the rope part of MLA's heads, adjacent pairs (llama.cpp's
    // "norm" RoPE for both architectures).
    const uint64_t rd = c.mla ? static_cast<uint64_t>(c.qk_rope_dim) : hd;
    rope_freq_.resize(rd / 2);
    std::vector<float> factors;
    if (f.FindTensor("rope_freqs.weight")) {
        FERRY_ASSIGN_OR_RETURN(factors, TensorF32(f, "rope_freqs.weight", {rd / 2}));
    }
    for (uint64_t i = 0; i < rd / 2; ++i) {
        double inv = std::pow(double(c.rope_theta), -2.0 * double(i) / double(rd));
        if (!factors.empty() && factors[i] > 0) inv /= factors[i];
        rope_freq_[i] = static_cast<float>(inv);
    }

    ranks_.clear();
    for (int r = 0; r < tp_; ++r) {
        auto rank = std::make_unique<Rank>();
        rank->q_heads = c.num_heads / tp_;
        rank->kv_heads = kv::RankKvHeads(tp_, c.num_kv_heads);
        rank->ffn = c.ffn_dim / tp_;
        rank->vocab_begin = static_cast<int>(vocab * r / tp_);
        rank->vocab_end = static_cast<int>(vocab * (r + 1) / tp_);
        rank->wout = RowsOf(head, rank->vocab_begin, rank->vocab_end);
        rank->layers.resize(c.num_layers);
        ranks_.push_back(std::move(rank));
    }
    out_w = Weights();

    const uint64_t q_rows = uint64_t(c.num_heads) * hd, kv_rows = uint64_t(c.num_kv_heads) * hd;
    const auto ffn = static_cast<uint64_t>(c.ffn_dim);
    for (int l = 0; l < c.num_layers; ++l) {
        if (c.mla) {
            FERRY_RETURN_IF_ERROR(LoadMlaLayer(f, l));
            continue;
        }
        std::string p = fmt::format("blk.{}.", l);
        FERRY_ASSIGN_OR_RETURN(auto an, TensorF32(f, p + "attn_norm.weight", {dim}));
        FERRY_ASSIGN_OR_RETURN(auto fn, TensorF32(f, p + "ffn_norm.weight", {dim}));
        FERRY_ASSIGN_OR_RETURN(auto wq, TensorWeights(f, p + "attn_q.weight", {dim, q_rows}));
        FERRY_ASSIGN_OR_RETURN(auto wk, TensorWeights(f, p + "attn_k.weight", {dim, kv_rows}));
        FERRY_ASSIGN_OR_RETURN(auto wv, TensorWeights(f, p + "attn_v.weight", {dim, kv_rows}));
        FERRY_ASSIGN_OR_RETURN(auto wo, TensorWeights(f, p + "attn_output.weight", {q_rows, dim}));
        FERRY_ASSIGN_OR_RETURN(auto wg, TensorWeights(f, p + "ffn_gate.weight", {dim, ffn}));
        FERRY_ASSIGN_OR_RETURN(auto wu, TensorWeights(f, p + "ffn_up.weight", {dim, ffn}));
        FERRY_ASSIGN_OR_RETURN(auto wd, TensorWeights(f, p + "ffn_down.weight", {ffn, dim}));
        // One layer's matrices in one type: the kernels take one type per product.
        for (const Weights* w : {&wk, &wv, &wo, &wg, &wu, &wd}) {
            if (w->type != wq.type) {
                return InvalidArgumentError(fmt::format(
                    "{}: layer {} mixes weight types ({} and {}); ferry needs one per layer",
                    f.path(), l, TensorTypeName(wq.type), TensorTypeName(w->type)));
            }
        }
        for (int r = 0; r < tp_; ++r) {
            Rank& rk = *ranks_[r];
            Layer& L = rk.layers[l];
            const uint64_t q0 = uint64_t(r) * rk.q_heads * hd, q1 = q0 + rk.q_heads * hd;
            const uint64_t k0 = uint64_t(kv::RankHeadBegin(r, tp_, c.num_kv_heads)) * hd;
            const uint64_t k1 = k0 + uint64_t(rk.kv_heads) * hd;
            L.wqkv = RowsOf(wq, q0, q1);
            AppendRows(&L.wqkv, RowsOf(wk, k0, k1));
            AppendRows(&L.wqkv, RowsOf(wv, k0, k1));
            L.wo = ColsOf(wo, q0, q1);
            SliceMlp(r, {wg, wu, wd, an, fn}, &rk, &L);
        }
    }
    return Status::Ok();
}

Status Model::LoadMlaLayer(const GgufFile& f, int l) {
    const ModelConfig& c = config_;
    const auto dim = static_cast<uint64_t>(c.dim), ffn = static_cast<uint64_t>(c.ffn_dim);
    const auto heads = static_cast<uint64_t>(c.num_heads), lat = uint64_t(c.kv_lora_rank);
    const auto nope = uint64_t(c.qk_nope_dim), qk = nope + c.qk_rope_dim;
    const auto vd = uint64_t(c.v_head_dim), ql = uint64_t(c.q_lora_rank);
    const std::string p = fmt::format("blk.{}.", l);
    FERRY_ASSIGN_OR_RETURN(auto an, TensorF32(f, p + "attn_norm.weight", {dim}));
    FERRY_ASSIGN_OR_RETURN(auto fn, TensorF32(f, p + "ffn_norm.weight", {dim}));
    Weights wq, wqa, wqb;
    std::vector<float> qan;
    if (ql > 0) {
        FERRY_ASSIGN_OR_RETURN(wqa, TensorWeights(f, p + "attn_q_a.weight", {dim, ql}));
        FERRY_ASSIGN_OR_RETURN(qan, TensorF32(f, p + "attn_q_a_norm.weight", {ql}));
        FERRY_ASSIGN_OR_RETURN(wqb, TensorWeights(f, p + "attn_q_b.weight", {ql, heads * qk}));
    } else {
        FERRY_ASSIGN_OR_RETURN(wq, TensorWeights(f, p + "attn_q.weight", {dim, heads * qk}));
    }
    FERRY_ASSIGN_OR_RETURN(
        auto wkva, TensorWeights(f, p + "attn_kv_a_mqa.weight", {dim, lat + c.qk_rope_dim}));
    FERRY_ASSIGN_OR_RETURN(auto kvan, TensorF32(f, p + "attn_kv_a_norm.weight", {lat}));
    FERRY_ASSIGN_OR_RETURN(auto wkb, TensorF32(f, p + "attn_k_b.weight", {nope, lat, heads}));
    FERRY_ASSIGN_OR_RETURN(auto wvb, TensorF32(f, p + "attn_v_b.weight", {lat, vd, heads}));
    FERRY_ASSIGN_OR_RETURN(auto wo, TensorWeights(f, p + "attn_output.weight", {heads * vd, dim}));
    FERRY_ASSIGN_OR_RETURN(auto wg, TensorWeights(f, p + "ffn_gate.weight", {dim, ffn}));
    FERRY_ASSIGN_OR_RETURN(auto wu, TensorWeights(f, p + "ffn_up.weight", {dim, ffn}));
    FERRY_ASSIGN_OR_RETURN(auto wd, TensorWeights(f, p + "ffn_down.weight", {ffn, dim}));
    const Weights& first = ql > 0 ? wqa : wq;
    for (const Weights* w : {&wkva, &wo, &wg, &wu, &wd, ql > 0 ? &wqb : &wq}) {
        if (w->type != first.type) {
            return InvalidArgumentError(fmt::format(
                "{}: layer {} mixes weight types ({} and {}); ferry needs one per layer", f.path(),
                l, TensorTypeName(first.type), TensorTypeName(w->type)));
        }
    }
    for (int r = 0; r < tp_; ++r) {
        Rank& rk = *ranks_[r];
        Layer& L = rk.layers[l];
        const uint64_t h0 = uint64_t(r) * rk.q_heads, h1 = h0 + rk.q_heads;
        if (ql > 0) {
            L.wqkv = RowsOf(wqa, 0, ql);
            L.wqb = RowsOf(wqb, h0 * qk, h1 * qk);
            L.q_a_norm = qan;
        } else {
            L.wqkv = RowsOf(wq, h0 * qk, h1 * qk);
        }
        AppendRows(&L.wqkv, RowsOf(wkva, 0, lat + c.qk_rope_dim));
        L.kv_a_norm = kvan;
        L.wkb.assign(wkb.begin() + h0 * lat * nope, wkb.begin() + h1 * lat * nope);
        L.wvb.assign(wvb.begin() + h0 * vd * lat, wvb.begin() + h1 * vd * lat);
        L.wo = ColsOf(wo, h0 * vd, h1 * vd);
        SliceMlp(r, {wg, wu, wd, an, fn}, &rk, &L);
    }
    return Status::Ok();
}

kv::KvCacheSpec Model::CacheSpec(int block_tokens, int num_blocks, kv::KvDtype dtype) const {
    kv::KvCacheSpec s;
    s.num_layers = config_.num_layers;
    s.latent = config_.mla;
    s.kv_heads = config_.mla ? 1 : kv::RankKvHeads(tp_, config_.num_kv_heads);
    s.head_dim = config_.head_dim;
    s.block_tokens = block_tokens;
    s.num_blocks = num_blocks;
    s.dtype = dtype;
    return s;
}

// --- forward -----------------------------------------------------------------------------------

Status Model::Forward(std::span<const SeqChunk> batch, std::span<kv::KvCache* const> caches,
                      float* logits, kv::LayerHook* hook) {
    const ModelConfig& c = config_;
    if (static_cast<int>(caches.size()) != cache_ranks()) {
        return InvalidArgumentError(fmt::format("forward: {} caches for tp {} ({} expected)",
                                                caches.size(), tp_, cache_ranks()));
    }
    const kv::KvCacheSpec& spec = caches[0]->spec();
    for (kv::KvCache* cache : caches) {
        const kv::KvCacheSpec& s = cache->spec();
        const int heads = c.mla ? 1 : kv::RankKvHeads(tp_, c.num_kv_heads);
        if (s.num_layers != c.num_layers || s.kv_heads != heads || s.head_dim != c.head_dim ||
            s.latent != c.mla || s.block_tokens != spec.block_tokens ||
            s.num_blocks != spec.num_blocks) {
            return InvalidArgumentError("forward: a kv cache does not match the model");
        }
    }
    int total = 0;
    for (const SeqChunk& ch : batch) {
        if (ch.tokens.empty()) return InvalidArgumentError("forward: a chunk has no tokens");
        if (ch.start_pos < 0 ||
            ch.start_pos + static_cast<int>(ch.tokens.size()) > c.context_length) {
            return InvalidArgumentError(
                fmt::format("forward: positions {}..{} exceed the context length {}", ch.start_pos,
                            ch.start_pos + ch.tokens.size(), c.context_length));
        }
        size_t need = (ch.start_pos + ch.tokens.size() + spec.block_tokens - 1) / spec.block_tokens;
        if (ch.block_table.size() < need) {
            return InvalidArgumentError(fmt::format("forward: {} blocks for {} tokens",
                                                    ch.block_table.size(),
                                                    ch.start_pos + ch.tokens.size()));
        }
        for (size_t i = 0; i < need; ++i) {
            if (ch.block_table[i] < 0 || ch.block_table[i] >= spec.num_blocks) {
                return InvalidArgumentError(
                    fmt::format("forward: block id {} out of range", ch.block_table[i]));
            }
        }
        for (const InputEmbeds& e : ch.embeds) {
            if (e.count < 0 || e.pos < 0 || (e.count > 0 && e.rows == nullptr)) {
                return InvalidArgumentError(fmt::format(
                    "forward: input embeddings at {} for {} tokens are malformed", e.pos, e.count));
            }
        }
        for (int32_t t : ch.tokens) {
            if (t < 0 || t >= c.vocab_size) {
                return InvalidArgumentError(
                    fmt::format("forward: token id {} outside the vocabulary", t));
            }
        }
        total += static_cast<int>(ch.tokens.size());
    }
    if (total == 0) return Status::Ok();

    num_tokens_ = total;
    x_.resize(size_t(total) * c.dim);
    positions_.resize(total);
    logit_rows_.clear();
    int row = 0;
    for (const SeqChunk& ch : batch) {
        for (size_t i = 0; i < ch.tokens.size(); ++i, ++row) {
            WidenRow(embedding_, ch.tokens[i], &x_[size_t(row) * c.dim]);
            positions_[row] = ch.start_pos + static_cast<int>(i);
        }
        const int end = ch.start_pos + static_cast<int>(ch.tokens.size());
        for (const InputEmbeds& e : ch.embeds) {
            const int lo = std::max(e.pos, ch.start_pos), hi = std::min(e.pos + e.count, end);
            for (int p = lo; p < hi; ++p) {
                std::copy_n(e.rows + size_t(p - e.pos) * c.dim, c.dim,
                            &x_[size_t(row - (end - p)) * c.dim]);
            }
        }
        if (ch.want_logits) logit_rows_.push_back(row - 1);
    }
    pool_->Run([&](int r) { RankForward(r, batch, caches[c.mla ? 0 : r], logits, hook); });
    return Status::Ok();
}

void Model::AllReduceAdd(int r, float* x, int rows) {
    // Every rank's partial is ready after the first barrier; each rank then adds a slice of the
    // rows (the same order of ranks for every row, so results do not depend on who sums).
    pool_->Sync();
    const int dim = config_.dim;
    int r0 = rows * r / tp_, r1 = rows * (r + 1) / tp_;
    for (int t = r0; t < r1; ++t) {
        float* dst = x + size_t(t) * dim;
        if (tp_ == 1) {
            const float* p = &ranks_[0]->partial[size_t(t) * dim];
            for (int i = 0; i < dim; ++i) dst[i] += p[i];
            continue;
        }
        for (int i = 0; i < dim; ++i) {
            float sum = 0;
            for (int k = 0; k < tp_; ++k) sum += ranks_[k]->partial[size_t(t) * dim + i];
            dst[i] += sum;
        }
    }
    pool_->Sync();
}

namespace {

// Attention of a short chunk (decode steps: n <= kSmallChunk query rows) for one KV head and
// its group of query heads, block by block over the paged cache. q: the chunk's first query row
// (row width W, query heads at head_dim apart); out: its first row of attention output (width
// qw, heads dv apart; the values' first dv dims, all of them but for a latent cache). The
// workspaces are the caller's, so that chunks and heads can run on several threads.
void AttendShort(const kv::KvCache& cache, int l, int h, const SeqChunk& ch, int group,
                 const float* q_rows, int W, float* out_rows, int qw, int dv, float scale,
                 std::vector<float>* scores, std::vector<float>* kbuf) {
    const int hd = cache.spec().head_dim, bt = cache.spec().block_tokens;
    const int n = static_cast<int>(ch.tokens.size()), p0 = ch.start_pos, ctx = p0 + n;
    const int blocks = (ctx + bt - 1) / bt;
    const bool f32 = cache.spec().dtype == kv::KvDtype::kF32;
    auto block_rows = [&](bool v, int j) -> const float* {
        const int cnt = std::min(bt, ctx - j * bt);
        if (f32) {
            return reinterpret_cast<const float*>(cache.memory().data() +
                                                  cache.Offset(l, v, ch.block_table[j], h));
        }
        cache.Load(l, v, ch.block_table[j], h, cnt, kbuf->data());
        return kbuf->data();
    };
    // scores[(g * n + i)][ctx]
    scores->resize(size_t(group) * n * ctx);
    kbuf->resize(size_t(bt) * hd);
    for (int j = 0; j < blocks; ++j) {
        const float* kb = block_rows(false, j);
        const int cnt = std::min(bt, ctx - j * bt);
        for (int g = 0; g < group; ++g) {
            for (int i = 0; i < n; ++i) {
                const float* q = q_rows + size_t(i) * W + (h * group + g) * hd;
                float* srow = &(*scores)[(size_t(g) * n + i) * ctx + size_t(j) * bt];
                const int valid = std::min(cnt, p0 + i + 1 - j * bt);
                for (int k = 0; k < valid; ++k) srow[k] = Dot(q, kb + size_t(k) * hd, hd) * scale;
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        for (int i = 0; i < n; ++i) {
            float* srow = &(*scores)[(size_t(g) * n + i) * ctx];
            Softmax(srow, p0 + i + 1, ctx);
            float* out = out_rows + size_t(i) * qw + (h * group + g) * dv;
            std::fill(out, out + dv, 0.0f);
        }
    }
    for (int j = 0; j < blocks; ++j) {
        const float* vb = block_rows(true, j);
        const int cnt = std::min(bt, ctx - j * bt);
        for (int g = 0; g < group; ++g) {
            for (int i = 0; i < n; ++i) {
                const float* srow = &(*scores)[(size_t(g) * n + i) * ctx + size_t(j) * bt];
                float* out = out_rows + size_t(i) * qw + (h * group + g) * dv;
                for (int k = 0; k < cnt; ++k) {
                    const float p = srow[k];
                    const float* vr = vb + size_t(k) * hd;
                    for (int d = 0; d < dv; ++d) out[d] += p * vr[d];
                }
            }
        }
    }
}

}  // namespace

void Model::Attend(Rank& rk, const kv::KvCache& cache, int l, int h, const SeqChunk& ch, int t0,
                   const AttendIo& io, AttendSpace& ws, WorkPool* softmax_pool) {
    const int hd = cache.spec().head_dim, bt = cache.spec().block_tokens, dv = io.v_dim;
    const int W = io.q_width, qw = io.out_width;
    const float scale = io.scale;
    const bool latent = cache.spec().latent;  // the values are the keys' first dv dims
    const int group = rk.q_heads / rk.kv_heads;
    const int n = static_cast<int>(ch.tokens.size()), p0 = ch.start_pos, ctx = p0 + n;
    const int blocks = (ctx + bt - 1) / bt;
    // Long chunks: gather this head's K and V, then per tile of query rows two sgemms over the
    // keys that tile can see (causal: rows [i0, i1) see keys [0, p0 + i1)).
    ws.kbuf.resize(size_t(blocks) * bt * hd);
    if (!latent) ws.vbuf.resize(size_t(blocks) * bt * hd);
    for (int j = 0; j < blocks; ++j) {
        int cnt = std::min(bt, ctx - j * bt);
        cache.Load(l, false, ch.block_table[j], h, cnt, &ws.kbuf[size_t(j) * bt * hd]);
        if (!latent) cache.Load(l, true, ch.block_table[j], h, cnt, &ws.vbuf[size_t(j) * bt * hd]);
    }
    const float* values = latent ? ws.kbuf.data() : ws.vbuf.data();
    // The group's query heads go through together: rows (g, i) of one [group * rows][head_dim]
    // matrix, so each tile is two larger sgemms instead of two per head.
    const int tile = std::min(n, kQueryTile);
    ws.qstack.resize(size_t(group) * tile * hd);  // stacked queries, then stacked outputs (dv)
    ws.scores.resize(size_t(group) * tile * ctx);
    for (int i0 = 0; i0 < n; i0 += kQueryTile) {
        const int rows = std::min(kQueryTile, n - i0), keys = p0 + i0 + rows, m = group * rows;
        for (int g = 0; g < group; ++g) {
            for (int i = 0; i < rows; ++i) {
                std::memcpy(&ws.qstack[(size_t(g) * rows + i) * hd],
                            &io.q[size_t(t0 + i0 + i) * W + (h * group + g) * hd], size_t(hd) * 4);
            }
        }
        float* s = ws.scores.data();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, keys, hd, scale, ws.qstack.data(),
                    hd, ws.kbuf.data(), hd, 0.0f, s, keys);
        // The rows' softmax on this rank's pool (OpenBLAS's threads are idle meanwhile): one
        // thread alone spent a fifth of a 2048-token prefill here. With the heads in parallel,
        // each on its own thread.
        constexpr int kRowsPerPart = 16;
        auto softmax_rows = [&](int part) {
            for (int gi = part * kRowsPerPart; gi < std::min(m, (part + 1) * kRowsPerPart); ++gi) {
                const int i = gi % rows;
                Softmax(s + size_t(gi) * keys, p0 + i0 + i + 1, keys);
            }
        };
        const int parts = (m + kRowsPerPart - 1) / kRowsPerPart;
        if (softmax_pool) {
            softmax_pool->Run(parts, softmax_rows, /*then_spin=*/false);
        } else {
            for (int part = 0; part < parts; ++part) softmax_rows(part);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, dv, keys, 1.0f, s, keys, values,
                    hd, 0.0f, ws.qstack.data(), dv);
        for (int g = 0; g < group; ++g) {
            for (int i = 0; i < rows; ++i) {
                std::memcpy(&io.out[size_t(t0 + i0 + i) * qw + (h * group + g) * dv],
                            &ws.qstack[(size_t(g) * rows + i) * dv], size_t(dv) * 4);
            }
        }
    }
}

void Model::AttendAll(Rank& rk, const kv::KvCache& cache, int l, std::span<const SeqChunk> batch,
                      const AttendIo& io) {
    // Short chunks (decode steps), one part per chunk and KV head, on the rank's pool. Long ones
    // (prefill): with one rank, one part per chunk and KV head on the rank's pool too, each
    // part's sgemms on its own thread (OpenBLAS set to one thread meanwhile: its threads on
    // products of head_dim 64 were slower, and spinning after each call they took the cores from
    // the pool's); with several ranks (which call OpenBLAS at once and share its thread count),
    // one head at a time on OpenBLAS's threads.
    const int heads = cache.spec().kv_heads;
    rk.short_parts.clear();
    rk.long_parts.clear();
    int t0 = 0;
    for (const SeqChunk& ch : batch) {
        const int n = static_cast<int>(ch.tokens.size());
        for (int h = 0; h < heads; ++h) {
            (n <= kSmallChunk ? rk.short_parts : rk.long_parts).push_back({&ch, h, t0});
        }
        t0 += n;
    }
    if (tp_ == 1 && blas_threads_ > 1 && rk.long_parts.size() > 1) {
        openblas_set_num_threads(1);
        rk.work->Run(
            static_cast<int>(rk.long_parts.size()),
            [&](int part) {
                const Rank::ShortPart& lp = rk.long_parts[part];
                thread_local AttendSpace ws;
                Attend(rk, cache, l, lp.head, *lp.chunk, lp.t0, io, ws, nullptr);
            },
            /*then_spin=*/false);
        openblas_set_num_threads(blas_threads_);
    } else {
        for (const Rank::ShortPart& lp : rk.long_parts) {
            Attend(rk, cache, l, lp.head, *lp.chunk, lp.t0, io, rk.attend, rk.work.get());
        }
    }
    rk.work->Run(static_cast<int>(rk.short_parts.size()), [&](int part) {
        const Rank::ShortPart& sp = rk.short_parts[part];
        thread_local std::vector<float> scores, kbuf;
        AttendShort(cache, l, sp.head, *sp.chunk, rk.q_heads / heads,
                    io.q + size_t(sp.t0) * io.q_width, io.q_width,
                    io.out + size_t(sp.t0) * io.out_width, io.out_width, io.v_dim, io.scale,
                    &scores, &kbuf);
    });
}

namespace {

// RoPE on `heads` runs of `dims` floats, `stride` apart from `v`, at position `pos`: pairs
// (2i, 2i+1) rotated by pos * freq[i].
void Rope(float* v, int heads, int stride, int dims, float pos, const float* freq) {
    for (int i = 0; i < dims / 2; ++i) {
        const float theta = pos * freq[i];
        const float cs = std::cos(theta), sn = std::sin(theta);
        for (int h = 0; h < heads; ++h) {
            float* x = v + size_t(h) * stride + 2 * i;
            const float a = x[0], b = x[1];
            x[0] = a * cs - b * sn;
            x[1] = a * sn + b * cs;
        }
    }
}

// Per head h of `heads`: C[rows][m] (row stride ldc, at h * hstride_c) = A[rows][k] (row stride
// lda, at h * hstride_a) times W[h]^T, W[h] being [m][k] row-major. Rows of short runs (decode
// steps) go one at a time through dot products, so a sequence's numbers do not depend on what
// else is in the batch (as the row kernels); long runs go through sgemm.
template <class Runs>
void PerHeadProduct(const Runs& runs, int heads, const float* a, int lda, int hstride_a,
                    const float* w, int m, int k, float* c, int ldc, int hstride_c) {
    for (const auto& run : runs) {
        for (int h = 0; h < heads; ++h) {
            const float* wh = w + size_t(h) * m * k;
            if (run.short_rows) {
                for (int t = run.begin; t < run.end; ++t) {
                    const float* x = a + size_t(t) * lda + size_t(h) * hstride_a;
                    float* y = c + size_t(t) * ldc + size_t(h) * hstride_c;
                    for (int j = 0; j < m; ++j) y[j] = Dot(wh + size_t(j) * k, x, k);
                }
            } else {
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, run.end - run.begin, m, k,
                            1.0f, a + size_t(run.begin) * lda + size_t(h) * hstride_a, lda, wh, k,
                            0.0f, c + size_t(run.begin) * ldc + size_t(h) * hstride_c, ldc);
            }
        }
    }
}

}  // namespace

void Model::MlaAttention(int r, int l, std::span<const SeqChunk> batch, kv::KvCache* cache,
                         kv::LayerHook* hook) {
    const ModelConfig& c = config_;
    Rank& rk = *ranks_[r];
    const Layer& L = rk.layers[l];
    const int T = num_tokens_, dim = c.dim, H = rk.q_heads;
    const int lat = c.kv_lora_rank, rope = c.qk_rope_dim, nope = c.qk_nope_dim;
    const int qk = nope + rope, row = lat + rope, ql = c.q_lora_rank;
    // rk.qkv: [T][first | latent | k_rope], first = q_a (LoRA) or this rank's queries.
    const int first = ql > 0 ? ql : H * qk, W = first + row;
    rk.qkv.resize(size_t(T) * W);
    rk.MatMul(rk.xn.data(), dim, L.wqkv, rk.qkv.data(), W);
    float* q = rk.qkv.data();
    int qw = W;
    if (ql > 0) {
        rk.qa.resize(size_t(T) * ql);
        rk.qmla.resize(size_t(T) * H * qk);
        for (int t = 0; t < T; ++t) {
            RmsNorm(&rk.qkv[size_t(t) * W], L.q_a_norm.data(), ql, c.norm_eps,
                    &rk.qa[size_t(t) * ql]);
        }
        rk.MatMul(rk.qa.data(), ql, L.wqb, rk.qmla.data(), H * qk);
        q = rk.qmla.data();
        qw = H * qk;
    }
    // The latent (normed) and the shared key's RoPE, in place; the queries' RoPE.
    for (int t = 0; t < T; ++t) {
        float* kv = &rk.qkv[size_t(t) * W + first];
        RmsNorm(kv, L.kv_a_norm.data(), lat, c.norm_eps, kv);
        const auto pos = static_cast<float>(positions_[t]);
        Rope(kv + lat, 1, 0, rope, pos, rope_freq_.data());
        Rope(q + size_t(t) * qw + nope, H, qk, rope, pos, rope_freq_.data());
    }
    // Rank 0 stores the latent rows for every rank; the others wait until they are in.
    if (r == 0) {
        const int bt = cache->spec().block_tokens;
        int t0 = 0;
        for (const SeqChunk& ch : batch) {
            const int n = static_cast<int>(ch.tokens.size());
            for (int i = 0; i < n;) {
                const int pos = ch.start_pos + i;
                const int block = ch.block_table[pos / bt], slot = pos % bt;
                const int cnt = std::min(n - i, bt - slot);
                cache->Store(l, false, block, 0, slot, cnt, &rk.qkv[size_t(t0 + i) * W + first], W);
                i += cnt;
            }
            t0 += n;
        }
        if (hook) hook->OnLayerStored(0, l);
    }
    pool_->Sync();
    // Queries into the latent space: [q_nope W_kb | q_rope] per head.
    rk.qcat.resize(size_t(T) * H * row);
    PerHeadProduct(rk.runs, H, q, qw, qk, L.wkb.data(), lat, nope, rk.qcat.data(), H * row, row);
    for (int t = 0; t < T; ++t) {
        for (int h = 0; h < H; ++h) {
            std::memcpy(&rk.qcat[(size_t(t) * H + h) * row + lat],
                        q + size_t(t) * qw + h * qk + nope, size_t(rope) * 4);
        }
    }
    rk.olat.resize(size_t(T) * H * lat);
    AttendAll(rk, *cache, l, batch,
              {rk.qcat.data(), H * row, rk.olat.data(), H * lat, lat,
               1.0f / std::sqrt(static_cast<float>(qk))});
    // Each head's latent output to its value.
    rk.attn.resize(size_t(T) * H * c.v_head_dim);
    PerHeadProduct(rk.runs, H, rk.olat.data(), H * lat, lat, L.wvb.data(), c.v_head_dim, lat,
                   rk.attn.data(), H * c.v_head_dim, c.v_head_dim);
}

void Model::RankForward(int r, std::span<const SeqChunk> batch, kv::KvCache* cache, float* logits,
                        kv::LayerHook* hook) {
    const ModelConfig& c = config_;
    Rank& rk = *ranks_[r];
    const int T = num_tokens_, dim = c.dim, hd = c.head_dim;
    const int qw = c.mla ? rk.q_heads * c.v_head_dim : rk.q_heads * hd;
    const int kvw = rk.kv_heads * hd, W = rk.q_heads * hd + 2 * kvw;
    const int bt = cache->spec().block_tokens;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    rk.xn.resize(size_t(T) * dim);
    if (!c.mla) {
        rk.qkv.resize(size_t(T) * W);
        rk.attn.resize(size_t(T) * qw);
    }
    rk.partial.resize(size_t(T) * dim);
    rk.gu.resize(size_t(T) * 2 * rk.ffn);
    rk.act.resize(size_t(T) * rk.ffn);
    rk.runs.clear();
    {
        int t = 0;
        for (const SeqChunk& ch : batch) {
            const int n = static_cast<int>(ch.tokens.size());
            const bool short_rows = n <= kSmallChunk;
            if (!rk.runs.empty() && rk.runs.back().short_rows == short_rows) {
                rk.runs.back().end = t + n;
            } else {
                rk.runs.push_back({t, t + n, short_rows});
            }
            t += n;
        }
    }

    for (int l = 0; l < c.num_layers; ++l) {
        const Layer& L = rk.layers[l];
        // Attention.
        for (int t = 0; t < T; ++t) {
            RmsNorm(&x_[size_t(t) * dim], &rk.attn_norm[size_t(l) * dim], dim, c.norm_eps,
                    &rk.xn[size_t(t) * dim]);
        }
        if (c.mla) {
            MlaAttention(r, l, batch, cache, hook);
        } else {
            rk.MatMul(rk.xn.data(), dim, L.wqkv, rk.qkv.data(), W);
            for (int t = 0; t < T; ++t) {  // RoPE on q and k heads
                Rope(&rk.qkv[size_t(t) * W], rk.q_heads + rk.kv_heads, hd, hd,
                     static_cast<float>(positions_[t]), rope_freq_.data());
            }
            const int qwidth = rk.q_heads * hd;
            int t0 = 0;
            for (const SeqChunk& ch : batch) {
                const int n = static_cast<int>(ch.tokens.size());
                const int p0 = ch.start_pos;
                // Store this chunk's K and V, one run of slots per block.
                for (int i = 0; i < n;) {
                    int pos = p0 + i;
                    int block = ch.block_table[pos / bt], slot = pos % bt;
                    int cnt = std::min(n - i, bt - slot);
                    const float* krow = &rk.qkv[size_t(t0 + i) * W + qwidth];
                    for (int h = 0; h < rk.kv_heads; ++h) {
                        cache->Store(l, false, block, h, slot, cnt, krow + h * hd, W);
                        cache->Store(l, true, block, h, slot, cnt, krow + kvw + h * hd, W);
                    }
                    i += cnt;
                }
                t0 += n;
            }
            // Every chunk's K and V of this layer are stored: a connector may send them while
            // this rank attends and computes the next layers.
            if (hook) hook->OnLayerStored(r, l);
            AttendAll(rk, *cache, l, batch, {rk.qkv.data(), W, rk.attn.data(), qw, hd, scale});
        }
        rk.MatMul(rk.attn.data(), qw, L.wo, rk.partial.data(), dim);
        AllReduceAdd(r, x_.data(), T);

        // MLP.
        for (int t = 0; t < T; ++t) {
            RmsNorm(&x_[size_t(t) * dim], &rk.ffn_norm[size_t(l) * dim], dim, c.norm_eps,
                    &rk.xn[size_t(t) * dim]);
        }
        const int F = rk.ffn;
        rk.MatMul(rk.xn.data(), dim, L.wgu, rk.gu.data(), 2 * F);
        for (int t = 0; t < T; ++t) {
            const float* gu = &rk.gu[size_t(t) * 2 * F];
            float* a = &rk.act[size_t(t) * F];
            for (int i = 0; i < F; ++i) {
                float g = gu[i];
                a[i] = g / (1.0f + std::exp(-g)) * gu[F + i];
            }
        }
        rk.MatMul(rk.act.data(), F, L.wdown, rk.partial.data(), dim);
        AllReduceAdd(r, x_.data(), T);
    }

    // Output head: this rank's slice of the vocabulary for the rows that want logits.
    const int nl = static_cast<int>(logit_rows_.size());
    if (nl == 0) return;
    rk.sel.resize(size_t(nl) * dim);
    for (int i = 0; i < nl; ++i) {
        RmsNorm(&x_[size_t(logit_rows_[i]) * dim], output_norm_.data(), dim, c.norm_eps,
                &rk.sel[size_t(i) * dim]);
    }
    // One row per sequence that wants logits: the row kernels, whatever the count.
    MatMulRows(nl, rk.sel.data(), dim, rk.wout, logits + rk.vocab_begin, c.vocab_size, *rk.work);
}

}  // namespace ferry::model
