// ModelConfig: a model's shape, read from a GGUF file's metadata and checked.
#include <fmt/core.h>

#include "model/model.h"

namespace ferry::model {

namespace {

Result<uint64_t> Key(const gguf::GgufFile& f, const std::string& key) { return f.GetUint(key); }

}  // namespace

Result<ModelConfig> ModelConfig::FromGguf(const gguf::GgufFile& f) {
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
    const gguf::GgufTensor* emb = f.FindTensor("token_embd.weight");
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

}  // namespace ferry::model
