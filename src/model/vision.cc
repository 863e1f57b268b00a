#include "model/vision.h"

#include <cblas.h>
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "core/crypto.h"

namespace ferry::model {

struct VisionEncoder::Layer {
    std::vector<float> ln1_w, ln1_b, ln2_w, ln2_b;
    Weights qkv;               // q, k and v stacked: [3 * dim][dim]
    std::vector<float> qkv_b;  // [3 * dim]
    Weights out;               // [dim][dim]
    std::vector<float> out_b;
    Weights up, down;  // [ffn][dim], [dim][ffn]
    std::vector<float> up_b, down_b;
};

namespace {

// --- Pillow's resampling -------------------------------------------------------------------------

constexpr int kPrecisionBits = 32 - 8 - 2;

double BicubicFilter(double x) {
    constexpr double a = -0.5;
    x = std::fabs(x);
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
    if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
    return 0.0;
}

// For each output pixel of one axis: the first input pixel, how many, and their fixed-point
// weights (ksize a pixel).
struct AxisWeights {
    int ksize = 0;
    std::vector<int> first, count;
    std::vector<int32_t> w;
};

AxisWeights Precompute(int in, int out) {
    AxisWeights a;
    double scale = double(in) / out;
    double filterscale = std::max(scale, 1.0);
    double support = 2.0 * filterscale;
    a.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
    a.first.resize(out);
    a.count.resize(out);
    a.w.assign(size_t(out) * a.ksize, 0);
    std::vector<double> k(a.ksize);
    for (int xx = 0; xx < out; ++xx) {
        double center = (xx + 0.5) * scale;
        int xmin = std::max(0, static_cast<int>(center - support + 0.5));
        int xmax = std::min(in, static_cast<int>(center + support + 0.5)) - xmin;
        double sum = 0;
        for (int x = 0; x < xmax; ++x) {
            k[x] = BicubicFilter((x + xmin - center + 0.5) / filterscale);
            sum += k[x];
        }
        for (int x = 0; x < xmax; ++x) {
            double v = sum != 0.0 ? k[x] / sum : k[x];
            // Pillow rounds half away from zero by adding +-0.5 and truncating.
            a.w[size_t(xx) * a.ksize + x] =
                static_cast<int32_t>(v * (1 << kPrecisionBits) + (v < 0 ? -0.5 : 0.5));
        }
        a.first[xx] = xmin;
        a.count[xx] = xmax;
    }
    return a;
}

uint8_t Clip8(int32_t v) {
    v >>= kPrecisionBits;
    return static_cast<uint8_t>(std::clamp(v, 0, 255));
}

}  // namespace

std::vector<uint8_t> ResizeBicubic(const uint8_t* rgb, int width, int height, int out_width,
                                   int out_height) {
    // Horizontal: width -> out_width on every row.
    AxisWeights h = Precompute(width, out_width);
    std::vector<uint8_t> mid(size_t(out_width) * height * 3);
    for (int y = 0; y < height; ++y) {
        const uint8_t* src = rgb + size_t(y) * width * 3;
        uint8_t* dst = mid.data() + size_t(y) * out_width * 3;
        for (int xx = 0; xx < out_width; ++xx) {
            const int32_t* k = &h.w[size_t(xx) * h.ksize];
            const uint8_t* p = src + size_t(h.first[xx]) * 3;
            for (int c = 0; c < 3; ++c) {
                int32_t ss = 1 << (kPrecisionBits - 1);
                for (int x = 0; x < h.count[xx]; ++x) ss += p[3 * x + c] * k[x];
                dst[3 * xx + c] = Clip8(ss);
            }
        }
    }
    // Vertical: height -> out_height on every column.
    AxisWeights v = Precompute(height, out_height);
    std::vector<uint8_t> out(size_t(out_width) * out_height * 3);
    for (int yy = 0; yy < out_height; ++yy) {
        const int32_t* k = &v.w[size_t(yy) * v.ksize];
        for (int x = 0; x < out_width * 3; ++x) {
            int32_t ss = 1 << (kPrecisionBits - 1);
            for (int y = 0; y < v.count[yy]; ++y) {
                ss += mid[(size_t(v.first[yy]) + y) * out_width * 3 + x] * k[y];
            }
            out[size_t(yy) * out_width * 3 + x] = Clip8(ss);
        }
    }
    return out;
}

namespace {

void LayerNorm(const float* x, const std::vector<float>& w, const std::vector<float>& b, int dim,
               float eps, float* out) {
    double mean = 0;
    for (int i = 0; i < dim; ++i) mean += x[i];
    mean /= dim;
    double var = 0;
    for (int i = 0; i < dim; ++i) var += (x[i] - mean) * (x[i] - mean);
    var /= dim;
    const double inv = 1.0 / std::sqrt(var + eps);
    for (int i = 0; i < dim; ++i) {
        out[i] = static_cast<float>((x[i] - mean) * inv) * w[i] + b[i];
    }
}

float Gelu(float x) {
    // ggml_gelu's tanh form.
    constexpr float kC = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + std::tanh(kC * (x + 0.044715f * x * x * x)));
}

float GeluQuick(float x) { return x / (1.0f + std::exp(-1.702f * x)); }

void AddBias(float* rows, int n, const std::vector<float>& bias) {
    const int d = static_cast<int>(bias.size());
    for (int t = 0; t < n; ++t) {
        for (int i = 0; i < d; ++i) rows[size_t(t) * d + i] += bias[i];
    }
}

Result<uint64_t> Need(const gguf::GgufFile& f, const std::string& key) {
    auto v = f.GetUint(key);
    if (!v.ok()) {
        return InvalidArgumentError(
            fmt::format("{}: key {}: {}", f.path(), key, v.status().message()));
    }
    if (*v == 0 || *v > (1u << 20)) {
        return InvalidArgumentError(
            fmt::format("{}: key {} is {}, out of range", f.path(), key, *v));
    }
    return *v;
}

bool FlagOf(const gguf::GgufFile& f, std::string_view key) {
    const gguf::GgufValue* v = f.Find(key);
    if (!v || v->type != gguf::GgufValueType::kBool) return false;
    return std::get<bool>(v->scalar);
}

Status Floats3(const gguf::GgufFile& f, const std::string& key, float out[3]) {
    const gguf::GgufValue* v = f.Find(key);
    if (!v) return InvalidArgumentError(fmt::format("{}: key {} is missing", f.path(), key));
    if (v->type != gguf::GgufValueType::kArray || v->array.size() < 3 ||
        (v->element_type != gguf::GgufValueType::kFloat32 &&
         v->element_type != gguf::GgufValueType::kFloat64)) {
        return InvalidArgumentError(
            fmt::format("{}: key {} must be an array of 3 floats", f.path(), key));
    }
    for (int i = 0; i < 3; ++i) out[i] = static_cast<float>(std::get<double>(v->array[i].scalar));
    return Status::Ok();
}

}  // namespace

VisionEncoder::VisionEncoder() : mu_(std::make_unique<std::mutex>()) {}
VisionEncoder::~VisionEncoder() = default;

Result<std::unique_ptr<VisionEncoder>> VisionEncoder::Load(const std::string& path, int threads) {
    FERRY_ASSIGN_OR_RETURN(auto file, gguf::GgufFile::Open(path));
    const gguf::GgufFile& f = *file;
    std::unique_ptr<VisionEncoder> e(new VisionEncoder());
    VisionConfig& c = e->config_;
    if (!FlagOf(f, "clip.has_vision_encoder")) {
        return InvalidArgumentError(fmt::format(
            "{}: clip.has_vision_encoder is not true: not a vision projector (mmproj) file", path));
    }
    auto proj = f.GetString("clip.projector_type");
    if (!proj.ok()) proj = f.GetString("clip.vision.projector_type");
    if (!proj.ok()) {
        return InvalidArgumentError(fmt::format("{}: key clip.projector_type is missing", path));
    }
    if (*proj != "mlp") {
        return InvalidArgumentError(fmt::format(
            "{}: projector type '{}' is not supported (ferry runs 'mlp', LLaVA's)", path, *proj));
    }
    c.projector_type = *proj;
    FERRY_ASSIGN_OR_RETURN(uint64_t image_size, Need(f, "clip.vision.image_size"));
    FERRY_ASSIGN_OR_RETURN(uint64_t patch_size, Need(f, "clip.vision.patch_size"));
    FERRY_ASSIGN_OR_RETURN(uint64_t dim, Need(f, "clip.vision.embedding_length"));
    FERRY_ASSIGN_OR_RETURN(uint64_t heads, Need(f, "clip.vision.attention.head_count"));
    FERRY_ASSIGN_OR_RETURN(uint64_t ffn, Need(f, "clip.vision.feed_forward_length"));
    FERRY_ASSIGN_OR_RETURN(uint64_t layers, Need(f, "clip.vision.block_count"));
    FERRY_ASSIGN_OR_RETURN(uint64_t proj_dim, Need(f, "clip.vision.projection_dim"));
    auto eps = f.GetFloat("clip.vision.attention.layer_norm_epsilon");
    if (!eps.ok() || !(*eps > 0) || *eps > 1) {
        return InvalidArgumentError(fmt::format(
            "{}: key clip.vision.attention.layer_norm_epsilon is missing or not in (0, 1]", path));
    }
    if (image_size % patch_size != 0 || image_size / patch_size > 64) {
        return InvalidArgumentError(fmt::format(
            "{}: image_size {} must be a multiple of patch_size {}, at most 64 patches a side",
            path, image_size, patch_size));
    }
    if (dim % heads != 0) {
        return InvalidArgumentError(fmt::format(
            "{}: embedding_length {} is not a multiple of head_count {}", path, dim, heads));
    }
    if (layers < 2) {
        return InvalidArgumentError(fmt::format(
            "{}: block_count {}: the mlp projector reads the second-to-last layer, so at least 2",
            path, layers));
    }
    if (const gguf::GgufValue* fl = f.Find("clip.vision.feature_layer"); fl && !fl->array.empty()) {
        return InvalidArgumentError(fmt::format(
            "{}: clip.vision.feature_layer (stacked feature layers) is not supported", path));
    }
    if (f.FindTensor("v.class_embd")) {
        return InvalidArgumentError(
            fmt::format("{}: v.class_embd (a class embedding) is not supported", path));
    }
    c.image_size = static_cast<int>(image_size);
    c.patch_size = static_cast<int>(patch_size);
    c.dim = static_cast<int>(dim);
    c.num_heads = static_cast<int>(heads);
    c.ffn_dim = static_cast<int>(ffn);
    c.num_layers = static_cast<int>(layers);
    c.out_dim = static_cast<int>(proj_dim);
    c.eps = static_cast<float>(*eps);
    c.use_gelu = FlagOf(f, "clip.use_gelu");
    if (FlagOf(f, "clip.use_silu")) {
        return InvalidArgumentError(fmt::format("{}: clip.use_silu is not supported", path));
    }
    FERRY_RETURN_IF_ERROR(Floats3(f, "clip.vision.image_mean", c.mean));
    FERRY_RETURN_IF_ERROR(Floats3(f, "clip.vision.image_std", c.std));
    for (float s : c.std) {
        if (!(s > 0)) {
            return InvalidArgumentError(
                fmt::format("{}: clip.vision.image_std has a value that is not positive", path));
        }
    }
    const gguf::GgufTensor* mm0 = f.FindTensor("mm.0.weight");
    if (!mm0 || mm0->dims.size() != 2) {
        return InvalidArgumentError(fmt::format("{}: tensor mm.0.weight is missing", path));
    }
    c.proj_hidden = static_cast<int>(std::min<uint64_t>(mm0->dims[1], 1u << 20));
    FERRY_RETURN_IF_ERROR(e->LoadTensors(f));
    e->pool_ = std::make_unique<WorkPool>(std::max(1, threads));

    std::string id = fmt::format("vision {} {} {} {} {} {} {} {} {} {} {}", c.projector_type,
                                 c.image_size, c.patch_size, c.dim, c.num_heads, c.ffn_dim,
                                 c.num_layers, c.proj_hidden, c.out_dim, c.eps, c.use_gelu);
    for (int i = 0; i < 3; ++i) id += fmt::format(" {} {}", c.mean[i], c.std[i]);
    id += f.TensorSample();
    Digest d = HmacSha256("ferry vision fingerprint", id);
    e->fingerprint_ = HexEncode(d.data(), 16);
    return e;
}

Status VisionEncoder::LoadTensors(const gguf::GgufFile& f) {
    const VisionConfig& c = config_;
    const uint64_t d = c.dim, p = c.patch_size, n = c.tokens_per_image();
    // The patch embedding is a convolution kernel {p, p, 3, dim}: row-major, one row of
    // 3 * p * p (channel, y, x) per output channel.
    FERRY_ASSIGN_OR_RETURN(auto conv, TensorF32(f, "v.patch_embd.weight", {p, p, 3, d}));
    patch_embd_.type = gguf::TensorType::kF32;
    patch_embd_.rows = c.dim;
    patch_embd_.cols = static_cast<int64_t>(3 * p * p);
    patch_embd_.bytes.resize(conv.size() * 4);
    std::memcpy(patch_embd_.bytes.data(), conv.data(), conv.size() * 4);
    if (f.FindTensor("v.patch_embd.bias")) {
        FERRY_ASSIGN_OR_RETURN(patch_bias_, TensorF32(f, "v.patch_embd.bias", {d}));
    } else {
        patch_bias_.assign(d, 0.0f);
    }
    FERRY_ASSIGN_OR_RETURN(position_, TensorF32(f, "v.position_embd.weight", {d, n}));
    if (f.FindTensor("v.pre_ln.weight")) {
        config_.pre_ln = true;
        FERRY_ASSIGN_OR_RETURN(pre_ln_w_, TensorF32(f, "v.pre_ln.weight", {d}));
        FERRY_ASSIGN_OR_RETURN(pre_ln_b_, TensorF32(f, "v.pre_ln.bias", {d}));
    }
    if (f.FindTensor("v.post_ln.weight")) {
        config_.post_ln = true;
        FERRY_ASSIGN_OR_RETURN(post_ln_w_, TensorF32(f, "v.post_ln.weight", {d}));
        FERRY_ASSIGN_OR_RETURN(post_ln_b_, TensorF32(f, "v.post_ln.bias", {d}));
    }
    const uint64_t ff = c.ffn_dim;
    // The last layer is the one llava skips: read but not kept.
    for (int l = 0; l + 1 < c.num_layers; ++l) {
        Layer L;
        auto name = [l](const char* what) { return fmt::format("v.blk.{}.{}", l, what); };
        FERRY_ASSIGN_OR_RETURN(L.ln1_w, TensorF32(f, name("ln1.weight"), {d}));
        FERRY_ASSIGN_OR_RETURN(L.ln1_b, TensorF32(f, name("ln1.bias"), {d}));
        FERRY_ASSIGN_OR_RETURN(L.ln2_w, TensorF32(f, name("ln2.weight"), {d}));
        FERRY_ASSIGN_OR_RETURN(L.ln2_b, TensorF32(f, name("ln2.bias"), {d}));
        for (const char* qkv : {"attn_q", "attn_k", "attn_v"}) {
            FERRY_ASSIGN_OR_RETURN(Weights w, TensorWeights(f, name(qkv) + ".weight", {d, d}));
            AppendRows(&L.qkv, w);
            FERRY_ASSIGN_OR_RETURN(auto b, TensorF32(f, name(qkv) + ".bias", {d}));
            L.qkv_b.insert(L.qkv_b.end(), b.begin(), b.end());
        }
        FERRY_ASSIGN_OR_RETURN(L.out, TensorWeights(f, name("attn_out.weight"), {d, d}));
        FERRY_ASSIGN_OR_RETURN(L.out_b, TensorF32(f, name("attn_out.bias"), {d}));
        FERRY_ASSIGN_OR_RETURN(L.up, TensorWeights(f, name("ffn_up.weight"), {d, ff}));
        FERRY_ASSIGN_OR_RETURN(L.up_b, TensorF32(f, name("ffn_up.bias"), {ff}));
        FERRY_ASSIGN_OR_RETURN(L.down, TensorWeights(f, name("ffn_down.weight"), {ff, d}));
        FERRY_ASSIGN_OR_RETURN(L.down_b, TensorF32(f, name("ffn_down.bias"), {d}));
        layers_.push_back(std::move(L));
    }
    const uint64_t h = c.proj_hidden, o = c.out_dim;
    FERRY_ASSIGN_OR_RETURN(mm0_, TensorWeights(f, "mm.0.weight", {d, h}));
    FERRY_ASSIGN_OR_RETURN(mm0_b_, TensorF32(f, "mm.0.bias", {h}));
    FERRY_ASSIGN_OR_RETURN(mm2_, TensorWeights(f, "mm.2.weight", {h, o}));
    FERRY_ASSIGN_OR_RETURN(mm2_b_, TensorF32(f, "mm.2.bias", {o}));
    return Status::Ok();
}

std::vector<float> VisionEncoder::Preprocess(const uint8_t* rgb, int width, int height) const {
    const int s = config_.image_size;
    std::vector<uint8_t> square;
    if (width == s && height == s) {
        square.assign(rgb, rgb + size_t(s) * s * 3);
    } else {
        // llama.cpp's PAD_CEIL in single precision, as it computes it.
        float scale = std::min(static_cast<float>(s) / width, static_cast<float>(s) / height);
        int w = std::clamp(static_cast<int>(std::ceil(width * scale)), 1, s);
        int h = std::clamp(static_cast<int>(std::ceil(height * scale)), 1, s);
        std::vector<uint8_t> resized = ResizeBicubic(rgb, width, height, w, h);
        square.resize(size_t(s) * s * 3);
        for (size_t i = 0; i < square.size(); ++i) square[i] = config_.pad_color[i % 3];
        const int ox = (s - w) / 2, oy = (s - h) / 2;
        for (int y = 0; y < h; ++y) {
            std::memcpy(&square[(size_t(oy + y) * s + ox) * 3], &resized[size_t(y) * w * 3],
                        size_t(w) * 3);
        }
    }
    std::vector<float> out(size_t(3) * s * s);
    for (int c = 0; c < 3; ++c) {
        for (size_t i = 0; i < size_t(s) * s; ++i) {
            out[size_t(c) * s * s + i] =
                (static_cast<float>(square[i * 3 + c]) / 255.0f - config_.mean[c]) / config_.std[c];
        }
    }
    return out;
}

std::vector<float> VisionEncoder::EncodePixels(const std::vector<float>& pixels) {
    std::lock_guard<std::mutex> lock(*mu_);
    const VisionConfig& c = config_;
    const int s = c.image_size, p = c.patch_size, side = c.patches_per_side();
    const int n = c.tokens_per_image(), d = c.dim, kd = 3 * p * p;
    const int heads = c.num_heads, hd = d / heads;

    // Patches as rows (channel, y, x), as the convolution kernel's rows are laid out.
    std::vector<float> patches(size_t(n) * kd);
    for (int py = 0; py < side; ++py) {
        for (int px = 0; px < side; ++px) {
            float* row = &patches[(size_t(py) * side + px) * kd];
            for (int ch = 0; ch < 3; ++ch) {
                for (int y = 0; y < p; ++y) {
                    const float* src = &pixels[(size_t(ch) * s + py * p + y) * s + px * p];
                    std::memcpy(row + (ch * p + y) * p, src, size_t(p) * 4);
                }
            }
        }
    }
    std::vector<float> x(size_t(n) * d), h(size_t(n) * d), qkv(size_t(n) * 3 * d);
    std::vector<float> attn(size_t(n) * d), scores(size_t(n) * n);
    std::vector<float> ffn(size_t(n) * std::max(c.ffn_dim, c.proj_hidden));
    MatMulT(n, patches.data(), kd, patch_embd_, x.data(), d, *pool_, &scratch_);
    AddBias(x.data(), n, patch_bias_);
    for (size_t i = 0; i < x.size(); ++i) x[i] += position_[i];
    if (c.pre_ln) {
        for (int t = 0; t < n; ++t) {
            LayerNorm(&x[size_t(t) * d], pre_ln_w_, pre_ln_b_, d, c.eps, &x[size_t(t) * d]);
        }
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    for (const Layer& L : layers_) {
        for (int t = 0; t < n; ++t) {
            LayerNorm(&x[size_t(t) * d], L.ln1_w, L.ln1_b, d, c.eps, &h[size_t(t) * d]);
        }
        MatMulT(n, h.data(), d, L.qkv, qkv.data(), 3 * d, *pool_, &scratch_);
        AddBias(qkv.data(), n, L.qkv_b);
        for (int hh = 0; hh < heads; ++hh) {
            const float* q = &qkv[size_t(hh) * hd];
            const float* k = &qkv[size_t(d) + hh * hd];
            const float* v = &qkv[size_t(2) * d + hh * hd];
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, hd, scale, q, 3 * d, k,
                        3 * d, 0.0f, scores.data(), n);
            for (int t = 0; t < n; ++t) Softmax(&scores[size_t(t) * n], n, n);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, hd, n, 1.0f, scores.data(), n,
                        v, 3 * d, 0.0f, &attn[size_t(hh) * hd], d);
        }
        MatMulT(n, attn.data(), d, L.out, h.data(), d, *pool_, &scratch_);
        AddBias(h.data(), n, L.out_b);
        for (size_t i = 0; i < x.size(); ++i) x[i] += h[i];
        for (int t = 0; t < n; ++t) {
            LayerNorm(&x[size_t(t) * d], L.ln2_w, L.ln2_b, d, c.eps, &h[size_t(t) * d]);
        }
        const int f = c.ffn_dim;
        MatMulT(n, h.data(), d, L.up, ffn.data(), f, *pool_, &scratch_);
        AddBias(ffn.data(), n, L.up_b);
        for (size_t i = 0; i < size_t(n) * f; ++i) {
            ffn[i] = c.use_gelu ? Gelu(ffn[i]) : GeluQuick(ffn[i]);
        }
        MatMulT(n, ffn.data(), f, L.down, h.data(), d, *pool_, &scratch_);
        AddBias(h.data(), n, L.down_b);
        for (size_t i = 0; i < x.size(); ++i) x[i] += h[i];
    }
    if (c.post_ln) {
        for (int t = 0; t < n; ++t) {
            LayerNorm(&x[size_t(t) * d], post_ln_w_, post_ln_b_, d, c.eps, &x[size_t(t) * d]);
        }
    }
    const int ph = c.proj_hidden;
    MatMulT(n, x.data(), d, mm0_, ffn.data(), ph, *pool_, &scratch_);
    AddBias(ffn.data(), n, mm0_b_);
    for (size_t i = 0; i < size_t(n) * ph; ++i) ffn[i] = Gelu(ffn[i]);
    std::vector<float> out(size_t(n) * c.out_dim);
    MatMulT(n, ffn.data(), ph, mm2_, out.data(), c.out_dim, *pool_, &scratch_);
    AddBias(out.data(), n, mm2_b_);
    return out;
}

std::vector<float> VisionEncoder::Encode(const uint8_t* rgb, int width, int height) {
    return EncodePixels(Preprocess(rgb, width, height));
}

}  // namespace ferry::model
