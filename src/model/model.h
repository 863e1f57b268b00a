// A llama-style decoder-only transformer over the paged KV cache: token embedding, RMSNorm, RoPE,
// grouped-query attention, SwiGLU MLP, tied or separate output head. Weights come from a GGUF
// file (architecture "llama"; F32, F16 or BF16 tensors, converted to f32 at load). Compute is
// fp32 with matrix products through OpenBLAS.
//
// Multi-head latent attention (MLA, DeepSeek-V2/V3; GGUF architecture "deepseek2" as llama.cpp
// reads it, dense layers only): per token and layer the cache holds one compressed latent
// (kv_lora_rank, RMS-normed) and one RoPE key shared by the heads, [latent | rope] as llama.cpp
// stores it. Attention runs in the latent space ("absorbed", as llama.cpp and vLLM do): each
// head's no-RoPE query goes through attn_k_b into the latent, scores are [q_latent | q_rope] .
// [latent | k_rope] scaled by 1/sqrt(qk_nope + qk_rope), the weighted sum of latents goes
// through attn_v_b to the head's value, then attn_output. With TP the heads are split; the
// latent is the same for every rank, so the ranks share one cache (rank 0 writes it).
//
// Tensor parallelism: with tp = N the query and KV heads and the MLP columns are split into N
// contiguous shards, one per rank; each rank has its own KV cache (its kv heads only) and runs on
// its own thread; partial outputs are summed after the attention output and MLP down projections
// (an all-reduce inside the process).
//
// Forward() is not thread-safe (one caller at a time: the engine's step loop); the config and
// tokenizer are immutable.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "gguf/gguf.h"
#include "kv/block_pool.h"
#include "kv/kv_cache.h"
#include "model/kernels.h"
#include "tokenizer/tokenizer.h"

namespace ferry::kv {
class LayerHook;
}

namespace ferry::model {

class WorkPool;

struct ModelConfig {
    std::string name;  // general.name, or the file name
    int vocab_size = 0;
    int dim = 0;
    int num_layers = 0;
    int num_heads = 0;
    int num_kv_heads = 0;
    int head_dim = 0;
    int ffn_dim = 0;
    int context_length = 0;
    float rope_theta = 10000.0f;
    float norm_eps = 1e-5f;
    bool tied_embeddings = false;
    // MLA (architecture deepseek2): num_kv_heads is 1 and head_dim the cache row,
    // kv_lora_rank + qk_rope_dim.
    bool mla = false;
    int q_lora_rank = 0;   // 0: the queries come straight from the input (attn_q)
    int kv_lora_rank = 0;  // the latent's width
    int qk_nope_dim = 0;   // per head: the query and key dims without RoPE
    int qk_rope_dim = 0;   // per head: with RoPE (the key's part is shared by all heads)
    int v_head_dim = 0;    // per head: the value's width

    // "gqa" or "mla".
    std::string_view attention() const { return mla ? "mla" : "gqa"; }
    // KV cache bytes per token over all layers and kv heads (what one worker holds, whatever its
    // TP: MLA's latent once, GQA's heads once each) at `dtype_bytes` per value.
    uint64_t KvBytesPerToken(int dtype_bytes) const;

    // Reads llama.* or deepseek2.* keys; InvalidArgument naming the key that is missing or
    // inconsistent.
    static Result<ModelConfig> FromGguf(const gguf::GgufFile& file);
    Status Validate() const;
    uint64_t ParamCount() const;
};

struct ModelOptions {
    int tp = 1;  // tensor-parallel ranks (threads)
};

// Input embeddings that stand in for `count` tokens from prompt position `pos` (an image's
// placeholder tokens: its encoder output, already projected to the model's width): rows
// [count][dim] of floats the caller keeps alive for the call.
struct InputEmbeds {
    int pos = 0;
    int count = 0;
    const float* rows = nullptr;
};

// One sequence's share of a forward pass: `num_tokens` new tokens at positions
// [start_pos, start_pos + num_tokens); the KV of positions [0, start_pos) is already in the
// blocks of `block_table`, which must cover start_pos + num_tokens tokens.
struct SeqChunk {
    std::span<const int32_t> tokens;
    int start_pos = 0;
    std::span<const kv::BlockId> block_table;
    bool want_logits = false;  // logits of the chunk's last token
    // Runs of positions whose input is given as embeddings instead of the tokens' rows; the
    // part of each run inside this chunk's positions is used, the rest ignored.
    std::span<const InputEmbeds> embeds = {};
};

class Model {
  public:
    // Maps and loads `path`. InvalidArgument for a file that is not a usable llama GGUF (the
    // message names the tensor or key), NotFound if missing, and for tp that does not divide the
    // heads or the MLP.
    static Result<std::unique_ptr<Model>> Load(const std::string& path,
                                               const ModelOptions& options = {});
    ~Model();
    Model(const Model&) = delete;
    Model& operator=(const Model&) = delete;

    const ModelConfig& config() const { return config_; }
    const tokenizer::Tokenizer& tokenizer() const { return *tokenizer_; }
    tokenizer::Tokenizer& mutable_tokenizer() { return *tokenizer_; }
    int tp() const { return tp_; }
    // Identity of the weights: a hash of the file's tensor metadata (names, shapes, types,
    // offsets), the first and last bytes of every tensor, and the config (hex). Two workers
    // exchange KV only when theirs are equal.
    const std::string& fingerprint() const { return fingerprint_; }
    // KV caches a forward pass takes: one per rank, or one for all ranks with MLA (its latent is
    // the same on every rank).
    int cache_ranks() const { return config_.mla ? 1 : tp_; }
    // The spec of each of those caches for the given pool geometry.
    kv::KvCacheSpec CacheSpec(int block_tokens, int num_blocks, kv::KvDtype dtype) const;

    // Runs one step over `batch` (chunks of different sequences; their tokens are processed
    // together), writes each chunk's K and V into `caches` (cache_ranks() of them) and the logits
    // of every chunk with want_logits, in batch order, into `logits` ([n][vocab_size]).
    // InvalidArgument for a token id outside the vocabulary, a position past the context or a
    // block table too short; nothing is written then. `hook`, when given, is called on each
    // rank's thread as soon as a layer's K and V of the whole batch are stored (a KV connector
    // sends them from there while the next layers compute).
    Status Forward(std::span<const SeqChunk> batch, std::span<kv::KvCache* const> caches,
                   float* logits, kv::LayerHook* hook = nullptr);

    // Bytes of weights one decode step reads, in their stored precision, over all ranks: the
    // layers' matrices and the output head (the embedding rows a step looks up excluded).
    uint64_t StreamedWeightBytes() const;
    // The stored type of the layers' matrices (the first layer's QKV: a file has one).
    gguf::TensorType MatrixType() const;

  private:
    struct Rank;
    struct Layer;
    class RankPool;
    Model() = default;
    Status LoadWeights(const gguf::GgufFile& file);
    // Attention of a long chunk (prefill) for one KV head; short ones go through AttendShort.
    // Its gathered K and V, stacked queries and scores go in `ws`; the rows' softmax runs on
    // `softmax_pool`, or on the calling thread when that is null (heads in parallel).
    // Queries are rows of `q_width` floats (head g's at g * key width, the cache's head_dim);
    // outputs rows of `out_width` (head g's at g * v_dim). With a latent cache the values are
    // the first v_dim floats of the keys.
    struct AttendSpace;
    struct AttendIo {
        const float* q;
        int q_width;
        float* out;
        int out_width;
        int v_dim;
        float scale;
    };
    void Attend(Rank& rk, const kv::KvCache& cache, int layer, int kv_head, const SeqChunk& ch,
                int t0, const AttendIo& io, AttendSpace& ws, WorkPool* softmax_pool);
    // Every chunk's attention of one layer over this rank's kv heads.
    void AttendAll(Rank& rk, const kv::KvCache& cache, int layer, std::span<const SeqChunk> batch,
                   const AttendIo& io);
    void RankForward(int r, std::span<const SeqChunk> batch, kv::KvCache* cache, float* logits,
                     kv::LayerHook* hook);
    // MLA's attention of layer l on rank r: from rk.xn to rk.attn (the heads' values).
    void MlaAttention(int r, int l, std::span<const SeqChunk> batch, kv::KvCache* cache,
                      kv::LayerHook* hook);
    Status LoadMlaLayer(const gguf::GgufFile& f, int l);
    void AllReduceAdd(int r, float* x, int rows);

    ModelConfig config_;
    std::string fingerprint_;
    int tp_ = 1;
    int blas_threads_ = 1;  // OpenBLAS's threads per rank (Load)
    std::unique_ptr<tokenizer::Tokenizer> tokenizer_;
    Weights embedding_;               // [vocab][dim], in the file's precision
    std::vector<float> output_norm_;  // [dim]
    std::vector<float> rope_freq_;    // [rope dims / 2] inverse frequencies
    std::vector<std::unique_ptr<Rank>> ranks_;
    std::unique_ptr<RankPool> pool_;

    // Per-call state shared by the ranks.
    std::vector<float> x_;  // residual stream [T][dim]
    std::vector<int32_t> positions_;
    std::vector<int> logit_rows_;  // token row of each requested logit
    int num_tokens_ = 0;
};

// The random model's vocabulary: 256 byte tokens and 3 specials.
inline constexpr uint64_t kRandomModelVocab = 259;

// Deterministic random-weight models for tests, demos and benchmarks (`ferry model init`).
struct RandomModelSpec {
    std::string name = "ferry-tiny";
    int dim = 256;
    int num_layers = 4;
    int num_heads = 8;
    int num_kv_heads = 4;
    int ffn_dim = 688;
    int context_length = 4096;
    float rope_theta = 10000.0f;
    bool tied_embeddings = false;
    gguf::TensorType dtype = gguf::TensorType::kF32;
    // MLA (written as architecture deepseek2, every layer dense): num_kv_heads is then ignored.
    bool mla = false;
    int q_lora_rank = 0;
    int kv_lora_rank = 0;
    int qk_nope_dim = 0;
    int qk_rope_dim = 0;
    int v_head_dim = 0;
    // The tokenizer: empty for the byte vocabulary below, else a GGUF file whose tokenizer.*
    // keys the model takes (a real model's vocabulary, e.g. tests/data/tokenizers/); the
    // embedding and output tensors then have its vocabulary's size.
    std::string vocab_file;
    uint64_t vocab_size = kRandomModelVocab;  // set from vocab_file by WriteRandomModel
};
// "tiny" (4 layers, dim 256) or "small" (12 layers, dim 768, GQA 12/4, head_dim 64), or their
// MLA twins "tiny-mla" (latent 64 + RoPE 16, queries from the input) and "small-mla" (latent
// 256 + RoPE 32, queries through a rank-384 LoRA), same widths, layers and MLP otherwise.
Result<RandomModelSpec> PresetSpec(std::string_view preset);
// The tensors WriteRandomModel writes for `spec`, in order: name, dims, the dtype they are stored
// in (1-D tensors, the norms, always f32 as llama.cpp's converter writes them; the rest in
// spec.dtype), and the distribution their values are drawn from.
struct RandomTensor {
    std::string name;
    std::vector<uint64_t> dims;
    gguf::TensorType type;
    float amplitude;
    float center;
};
std::vector<RandomTensor> RandomModelTensors(const RandomModelSpec& spec);
// Writes a llama (or, for MLA, deepseek2) GGUF with a byte-level vocabulary (256 byte tokens plus
// <|endoftext|>,
// <|im_start|>, <|im_end|>; gpt2 tokenizer, ChatML template), or spec.vocab_file's tokenizer,
// and weights drawn from `seed`.
Status WriteRandomModel(const RandomModelSpec& spec, uint64_t seed, const std::string& path);

}  // namespace ferry::model
