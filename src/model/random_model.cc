// Deterministic random-weight llama models (`ferry model init`, tests, benchmarks).
#include <fmt/core.h>

#include <cmath>
#include <cstring>

#include "core/half.h"
#include "model/model.h"
#include "model/vision.h"
#include "tokenizer/tokenizer.h"

namespace ferry::model {

namespace {

constexpr const char* kChatMlTemplate =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

class Rng {
  public:
    explicit Rng(uint64_t seed) : s_(seed) {}
    uint64_t Next() {
        uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    // Uniform in [-a, a).
    float Uniform(float a) {
        return static_cast<float>((double(Next() >> 11) * 0x1.0p-53 * 2.0 - 1.0) * a);
    }

  private:
    uint64_t s_;
};

uint64_t NameSeed(uint64_t seed, const std::string& name) {
    uint64_t h = 1469598103934665603ull;
    for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    return seed * 0x2545f4914f6cdd1dull ^ h;
}

std::string Encode(const std::vector<float>& v, gguf::TensorType type) {
    std::string out;
    if (type == gguf::TensorType::kF32) {
        out.resize(v.size() * 4);
        std::memcpy(out.data(), v.data(), out.size());
        return out;
    }
    out.resize(v.size() * 2);
    for (size_t i = 0; i < v.size(); ++i) {
        uint16_t h = type == gguf::TensorType::kF16 ? FloatToF16(v[i]) : FloatToBf16(v[i]);
        std::memcpy(&out[2 * i], &h, 2);
    }
    return out;
}

}  // namespace

Result<RandomModelSpec> PresetSpec(std::string_view preset) {
    RandomModelSpec s;
    if (preset == "tiny") {
        return s;
    }
    if (preset == "tiny-mla") {
        // DeepSeek-V2-Lite's shape in small: queries from the input, a latent of 2 head widths,
        // a RoPE key of half a head.
        s.name = "ferry-tiny-mla";
        s.mla = true;
        s.num_kv_heads = 1;
        s.kv_lora_rank = 64;
        s.qk_nope_dim = 32;
        s.qk_rope_dim = 16;
        s.v_head_dim = 32;
        return s;
    }
    if (preset == "small" || preset == "small-mla") {
        s.name = "ferry-small";
        s.dim = 768;
        s.num_layers = 12;
        s.num_heads = 12;
        s.num_kv_heads = 4;
        s.ffn_dim = 2048;
        if (preset == "small-mla") {
            // DeepSeek-V2's proportions: queries through a LoRA, latent 4 head widths, RoPE half.
            s.name = "ferry-small-mla";
            s.mla = true;
            s.num_kv_heads = 1;
            s.q_lora_rank = 384;
            s.kv_lora_rank = 256;
            s.qk_nope_dim = 64;
            s.qk_rope_dim = 32;
            s.v_head_dim = 64;
        }
        return s;
    }
    return InvalidArgumentError(
        fmt::format("preset '{}' is not one of tiny, small, tiny-mla, small-mla", preset));
}

std::vector<RandomTensor> RandomModelTensors(const RandomModelSpec& spec) {
    if (spec.dim <= 0 || spec.num_heads <= 0) return {};
    const auto dim = static_cast<uint64_t>(spec.dim);
    const uint64_t hd = dim / spec.num_heads;
    std::vector<RandomTensor> out;
    // 1-D tensors (the norms) stay f32 in every dtype, as llama.cpp's converter writes them:
    // its ops take them only as f32 (an f16 norm aborts it in ggml's mul).
    auto add = [&](const std::string& name, std::vector<uint64_t> dims, float amplitude,
                   float center) {
        gguf::TensorType type = dims.size() == 1 ? gguf::TensorType::kF32 : spec.dtype;
        out.push_back({name, std::move(dims), type, amplitude, center});
    };
    // Uniform(-a, a) has standard deviation a / sqrt(3): unit-variance embeddings, projections
    // that keep the variance (1 / sqrt(fan_in)), and an output head with logits of std ~2 so
    // greedy choices are clear-cut rather than near-ties.
    const float s3 = std::sqrt(3.0f);
    auto fan = [&](uint64_t in) { return s3 / std::sqrt(static_cast<float>(in)); };
    const uint64_t vocab = spec.vocab_size;
    add("token_embd.weight", {dim, vocab}, s3, 0);
    add("output_norm.weight", {dim}, 0.1f, 1.0f);
    if (!spec.tied_embeddings) add("output.weight", {dim, vocab}, 2 * fan(dim), 0);
    const uint64_t q = hd * spec.num_heads, kv = hd * spec.num_kv_heads;
    const auto ffn = static_cast<uint64_t>(spec.ffn_dim);
    for (int l = 0; l < spec.num_layers; ++l) {
        std::string p = fmt::format("blk.{}.", l);
        add(p + "attn_norm.weight", {dim}, 0.1f, 1.0f);
        add(p + "ffn_norm.weight", {dim}, 0.1f, 1.0f);
        if (spec.mla) {
            // llama.cpp's deepseek2 tensors, MLA split (attn_k_b, attn_v_b), in its order.
            const auto heads = static_cast<uint64_t>(spec.num_heads);
            const auto lat = uint64_t(spec.kv_lora_rank), nope = uint64_t(spec.qk_nope_dim);
            const uint64_t qk = nope + spec.qk_rope_dim, vd = uint64_t(spec.v_head_dim);
            const auto ql = uint64_t(spec.q_lora_rank);
            if (ql > 0) {
                add(p + "attn_q_a_norm.weight", {ql}, 0.1f, 1.0f);
                add(p + "attn_q_a.weight", {dim, ql}, fan(dim), 0);
                add(p + "attn_q_b.weight", {ql, heads * qk}, fan(ql), 0);
            } else {
                add(p + "attn_q.weight", {dim, heads * qk}, fan(dim), 0);
            }
            add(p + "attn_kv_a_norm.weight", {lat}, 0.1f, 1.0f);
            add(p + "attn_kv_a_mqa.weight", {dim, lat + spec.qk_rope_dim}, fan(dim), 0);
            add(p + "attn_k_b.weight", {nope, lat, heads}, fan(nope), 0);
            add(p + "attn_v_b.weight", {lat, vd, heads}, fan(lat), 0);
            add(p + "attn_output.weight", {heads * vd, dim}, fan(heads * vd), 0);
            add(p + "ffn_gate.weight", {dim, ffn}, fan(dim), 0);
            add(p + "ffn_up.weight", {dim, ffn}, fan(dim), 0);
            add(p + "ffn_down.weight", {ffn, dim}, fan(ffn), 0);
            continue;
        }
        add(p + "attn_q.weight", {dim, q}, fan(dim), 0);
        add(p + "attn_k.weight", {dim, kv}, fan(dim), 0);
        add(p + "attn_v.weight", {dim, kv}, fan(dim), 0);
        add(p + "attn_output.weight", {q, dim}, fan(q), 0);
        add(p + "ffn_gate.weight", {dim, ffn}, fan(dim), 0);
        add(p + "ffn_up.weight", {dim, ffn}, fan(dim), 0);
        add(p + "ffn_down.weight", {ffn, dim}, fan(ffn), 0);
    }
    return out;
}

Status WriteRandomModel(const RandomModelSpec& spec, uint64_t seed, const std::string& path) {
    if (spec.dim <= 0 || spec.num_layers <= 0 || spec.num_heads <= 0 || spec.num_kv_heads <= 0 ||
        spec.ffn_dim <= 0 || spec.dim % spec.num_heads || spec.num_heads % spec.num_kv_heads) {
        return InvalidArgumentError("random model: inconsistent dimensions");
    }
    if (spec.mla && (spec.kv_lora_rank <= 0 || spec.qk_nope_dim <= 0 || spec.qk_rope_dim <= 0 ||
                     spec.qk_rope_dim % 2 || spec.v_head_dim <= 0 || spec.q_lora_rank < 0)) {
        return InvalidArgumentError("random model: inconsistent MLA dimensions");
    }
    gguf::GgufWriter w;
    const std::string arch = spec.mla ? "deepseek2" : "llama";
    const std::string a = arch + ".";
    w.SetString("general.architecture", arch);
    w.SetString("general.name", spec.name);
    w.SetUint32(a + "context_length", spec.context_length);
    w.SetUint32(a + "embedding_length", spec.dim);
    w.SetUint32(a + "block_count", spec.num_layers);
    w.SetUint32(a + "feed_forward_length", spec.ffn_dim);
    w.SetUint32(a + "attention.head_count", spec.num_heads);
    w.SetUint32(a + "attention.head_count_kv", spec.mla ? 1 : spec.num_kv_heads);
    w.SetFloat32(a + "rope.freq_base", spec.rope_theta);
    w.SetFloat32(a + "attention.layer_norm_rms_epsilon", 1e-5f);
    if (spec.mla) {
        // As llama.cpp's converter writes a DeepSeek-V2 without experts: every layer dense (the
        // expert keys it requires, with no expert), the latent view of the cache (one kv head
        // of latent + rope; values the latent) and the per-head view (*_mla).
        w.SetUint32(a + "leading_dense_block_count", spec.num_layers);
        w.SetUint32(a + "vocab_size", 0);  // set below, once the vocabulary is known
        w.SetUint32(a + "attention.q_lora_rank", spec.q_lora_rank);
        w.SetUint32(a + "attention.kv_lora_rank", spec.kv_lora_rank);
        w.SetUint32(a + "attention.key_length", spec.kv_lora_rank + spec.qk_rope_dim);
        w.SetUint32(a + "attention.value_length", spec.kv_lora_rank);
        w.SetUint32(a + "attention.key_length_mla", spec.qk_nope_dim + spec.qk_rope_dim);
        w.SetUint32(a + "attention.value_length_mla", spec.v_head_dim);
        w.SetUint32(a + "expert_feed_forward_length", spec.ffn_dim);
        w.SetUint32(a + "expert_shared_count", 0);
        w.SetUint32(a + "rope.dimension_count", spec.qk_rope_dim);
    }

    RandomModelSpec sized = spec;
    if (!spec.vocab_file.empty()) {
        // A real vocabulary: every tokenizer.* key of that file, as it is there.
        FERRY_ASSIGN_OR_RETURN(std::unique_ptr<gguf::GgufFile> vocab,
                               gguf::GgufFile::Open(spec.vocab_file));
        FERRY_ASSIGN_OR_RETURN(std::vector<std::string> tokens,
                               vocab->GetStringArray("tokenizer.ggml.tokens"));
        for (const auto& [key, value] : vocab->metadata()) {
            if (key.rfind("tokenizer.", 0) == 0) FERRY_RETURN_IF_ERROR(w.SetValue(key, value));
        }
        // Check it now, so a file `ferry serve` would refuse is not written.
        FERRY_RETURN_IF_ERROR(tokenizer::Tokenizer::FromGguf(*vocab).status());
        sized.vocab_size = tokens.size();
    } else {
        // Byte-level vocabulary: the 256 bytes in GPT-2's printable mapping, then three specials.
        std::vector<std::string> tokens;
        std::vector<int32_t> types;
        for (int b = 0; b < 256; ++b) {
            tokens.push_back(tokenizer::ByteLevelToken(static_cast<uint8_t>(b)));
            types.push_back(1);
        }
        for (const char* s : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
            tokens.emplace_back(s);
            types.push_back(3);
        }
        if (tokens.size() != kRandomModelVocab)
            return InternalError("random model: vocabulary size");
        w.SetString("tokenizer.ggml.model", "gpt2");
        w.SetString("tokenizer.ggml.pre", "default");
        w.SetStringArray("tokenizer.ggml.tokens", tokens);
        w.SetInt32Array("tokenizer.ggml.token_type", types);
        w.SetStringArray("tokenizer.ggml.merges", {});
        w.SetUint32("tokenizer.ggml.bos_token_id", 256);
        w.SetUint32("tokenizer.ggml.eos_token_id", 256);
        w.SetBool("tokenizer.ggml.add_bos_token", false);
        w.SetString("tokenizer.chat_template", kChatMlTemplate);
        sized.vocab_size = kRandomModelVocab;
    }

    if (spec.mla) w.SetUint32(a + "vocab_size", static_cast<uint32_t>(sized.vocab_size));
    for (const RandomTensor& t : RandomModelTensors(sized)) {
        uint64_t n = 1;
        for (uint64_t d : t.dims) n *= d;
        std::vector<float> v(n);
        Rng rng(NameSeed(seed, t.name));
        for (float& x : v) x = t.center + rng.Uniform(t.amplitude);
        FERRY_RETURN_IF_ERROR(w.AddTensor(t.name, t.dims, t.type, Encode(v, t.type)));
    }
    return w.Write(path);
}

Result<RandomVisionSpec> PresetVisionSpec(std::string_view preset) {
    RandomVisionSpec s;
    if (preset == "tiny-vl") return s;
    if (preset == "small-vl") {
        s.name = "ferry-small-vl";
        s.image_size = 224;
        s.patch_size = 14;
        s.dim = 384;
        s.num_heads = 6;
        s.ffn_dim = 1536;
        s.num_layers = 7;
        s.proj_hidden = 768;
        s.out_dim = 768;
        return s;
    }
    return NotFoundError(fmt::format("unknown vision preset '{}' (tiny-vl, small-vl)", preset));
}

Status WriteRandomMmproj(const RandomVisionSpec& spec, uint64_t seed, const std::string& path) {
    if (spec.image_size <= 0 || spec.patch_size <= 0 || spec.image_size % spec.patch_size ||
        spec.dim <= 0 || spec.num_heads <= 0 || spec.dim % spec.num_heads || spec.ffn_dim <= 0 ||
        spec.num_layers < 2 || spec.proj_hidden <= 0 || spec.out_dim <= 0) {
        return InvalidArgumentError("random vision projector: inconsistent dimensions");
    }
    gguf::GgufWriter w;
    // The keys llama.cpp's clip loader reads for a LLaVA-style projector (tools/mtmd/clip.cpp).
    w.SetString("general.architecture", "clip");
    w.SetString("general.name", spec.name);
    w.SetUint32("general.file_type", 0);  // all f32
    w.SetBool("clip.has_vision_encoder", true);
    w.SetBool("clip.has_text_encoder", false);
    w.SetBool("clip.has_llava_projector", true);
    w.SetString("clip.projector_type", "mlp");
    w.SetUint32("clip.vision.image_size", spec.image_size);
    w.SetUint32("clip.vision.patch_size", spec.patch_size);
    w.SetUint32("clip.vision.embedding_length", spec.dim);
    w.SetUint32("clip.vision.feed_forward_length", spec.ffn_dim);
    w.SetUint32("clip.vision.projection_dim", spec.out_dim);
    w.SetUint32("clip.vision.attention.head_count", spec.num_heads);
    w.SetFloat32("clip.vision.attention.layer_norm_epsilon", 1e-5f);
    w.SetUint32("clip.vision.block_count", spec.num_layers);
    // OpenAI CLIP's normalization, as LLaVA 1.5's processor has it.
    w.SetFloat32Array("clip.vision.image_mean", {0.48145466f, 0.4578275f, 0.40821073f});
    w.SetFloat32Array("clip.vision.image_std", {0.26862954f, 0.26130258f, 0.27577711f});
    w.SetBool("clip.use_gelu", false);

    const uint64_t d = spec.dim, p = spec.patch_size, f = spec.ffn_dim;
    const uint64_t n =
        uint64_t(spec.image_size / spec.patch_size) * (spec.image_size / spec.patch_size);
    const float s3 = std::sqrt(3.0f);
    auto fan = [&](uint64_t in) { return s3 / std::sqrt(static_cast<float>(in)); };
    std::vector<RandomTensor> ts;
    auto add = [&](const std::string& name, std::vector<uint64_t> dims, float amplitude,
                   float center) {
        ts.push_back({name, std::move(dims), gguf::TensorType::kF32, amplitude, center});
    };
    add("v.patch_embd.weight", {p, p, 3, d}, fan(3 * p * p), 0);
    add("v.patch_embd.bias", {d}, 0.02f, 0);
    add("v.position_embd.weight", {d, n}, 0.5f, 0);
    add("v.pre_ln.weight", {d}, 0.1f, 1.0f);
    add("v.pre_ln.bias", {d}, 0.02f, 0);
    for (int l = 0; l < spec.num_layers; ++l) {
        std::string b = fmt::format("v.blk.{}.", l);
        add(b + "ln1.weight", {d}, 0.1f, 1.0f);
        add(b + "ln1.bias", {d}, 0.02f, 0);
        for (const char* m : {"attn_q", "attn_k", "attn_v", "attn_out"}) {
            add(b + m + ".weight", {d, d}, fan(d), 0);
            add(b + m + ".bias", {d}, 0.02f, 0);
        }
        add(b + "ln2.weight", {d}, 0.1f, 1.0f);
        add(b + "ln2.bias", {d}, 0.02f, 0);
        add(b + "ffn_up.weight", {d, f}, fan(d), 0);
        add(b + "ffn_up.bias", {f}, 0.02f, 0);
        add(b + "ffn_down.weight", {f, d}, fan(f), 0);
        add(b + "ffn_down.bias", {d}, 0.02f, 0);
    }
    const uint64_t h = spec.proj_hidden, o = spec.out_dim;
    add("mm.0.weight", {d, h}, fan(d), 0);
    add("mm.0.bias", {h}, 0.02f, 0);
    // Rows of about unit variance, as the language model's token embeddings are.
    add("mm.2.weight", {h, o}, 2 * fan(h), 0);
    add("mm.2.bias", {o}, 0.02f, 0);
    for (const RandomTensor& t : ts) {
        uint64_t count = 1;
        for (uint64_t x : t.dims) count *= x;
        std::vector<float> v(count);
        Rng rng(NameSeed(seed, t.name));
        for (float& x : v) x = t.center + rng.Uniform(t.amplitude);
        FERRY_RETURN_IF_ERROR(w.AddTensor(t.name, t.dims, t.type, Encode(v, t.type)));
    }
    return w.Write(path);
}

}  // namespace ferry::model
