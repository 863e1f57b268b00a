// The forward pass: embeddings (or given input embeddings), then per layer attention over the
// paged KV cache (MHA/GQA, or MLA in latent space) and the MLP, on every TP rank with an
// all-reduce between; then the logits of the rows that want them.
#include "model/model.h"

#include <cblas.h>
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/half.h"
#include "kv/connector.h"
#include "kv/kv_layout.h"
#include "model/kernels.h"
#include "model/model_ranks.h"

namespace ferry::model {

namespace {

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
