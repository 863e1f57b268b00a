// Model::Load: the GGUF file's tensors sliced among the TP ranks, the model's fingerprint, and
// the BLAS threads it runs on.
#include <cblas.h>
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/cpu.h"
#include "core/crypto.h"
#include "kv/connector.h"
#include "kv/kv_layout.h"
#include "model/blas.h"
#include "model/model.h"
#include "model/model_ranks.h"

namespace ferry::model {

namespace {

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

}  // namespace

Model::~Model() = default;

Result<std::unique_ptr<Model>> Model::Load(const std::string& path, const ModelOptions& options) {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<gguf::GgufFile> file, gguf::GgufFile::Open(path));
    std::unique_ptr<Model> m(new Model());
    FERRY_ASSIGN_OR_RETURN(m->config_, ModelConfig::FromGguf(*file));
    FERRY_ASSIGN_OR_RETURN(m->tokenizer_, tokenizer::Tokenizer::FromGguf(*file));
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

gguf::TensorType Model::MatrixType() const {
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

Status Model::LoadWeights(const gguf::GgufFile& f) {
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
                    f.path(), l, gguf::TensorTypeName(wq.type), gguf::TensorTypeName(w->type)));
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

Status Model::LoadMlaLayer(const gguf::GgufFile& f, int l) {
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
                l, gguf::TensorTypeName(first.type), gguf::TensorTypeName(w->type)));
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

}  // namespace ferry::model
