// The vision encoder against a naive double-precision reference read straight from the mmproj
// file, Pillow's resampling against Pillow's own output, and the loader's refusals.
#include "model/vision.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>

#include "model/model.h"
#include "testing/testing.h"

namespace ferry::model {
namespace {

using ::ferry::testing::StatusHas;

std::string TempPath(const std::string& name) {
    return (std::filesystem::temp_directory_path() /
            (name + "-" + std::to_string(getpid()) + ".gguf"))
        .string();
}

RandomVisionSpec TestSpec() {
    RandomVisionSpec s;
    s.name = "test-vl";
    s.image_size = 32;
    s.patch_size = 8;
    s.dim = 32;
    s.num_heads = 2;
    s.ffn_dim = 64;
    s.num_layers = 3;
    s.proj_hidden = 48;
    s.out_dim = 40;
    return s;
}

std::vector<uint8_t> TestImage(int w, int h, uint64_t seed) {
    std::vector<uint8_t> rgb(size_t(w) * h * 3);
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (auto& b : rgb) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        b = static_cast<uint8_t>(x >> 24);
    }
    return rgb;
}

// --- Pillow's resampling
// ---------------------------------------------------------------------------

// A 7 x 5 image from Python's random.seed(5), resized by Pillow 9.4 (Debian 12's python3-pil):
// Image.frombytes('RGB', (7, 5), src).resize(size, Image.BICUBIC).tobytes().
const std::vector<uint8_t> kPillowSrc = {
    130, 183, 14,  238, 127, 26,  80,  57,  190, 240, 126, 194, 52,  127, 6,   110, 208, 143,
    93,  199, 81,  36,  71,  227, 64,  67,  0,   2,   107, 110, 84,  85,  148, 160, 101, 104,
    93,  100, 196, 152, 11,  184, 212, 84,  74,  135, 33,  169, 154, 1,   173, 33,  158, 181,
    156, 246, 161, 94,  246, 241, 90,  29,  131, 11,  183, 206, 9,   214, 187, 192, 4,   231,
    23,  92,  100, 60,  125, 236, 176, 181, 128, 236, 55,  188, 151, 18,  221, 46,  106, 174,
    185, 75,  174, 141, 47,  159, 162, 156, 90,  40,  76,  158, 247, 82,  24};

TEST(VisionResize, MatchesPillowShrinkingBothWays) {
    const std::vector<uint8_t> want = {137, 124, 65,  133, 103, 132, 101, 163, 105, 90,  52,  114,
                                       87,  118, 141, 119, 106, 182, 99,  114, 177, 87,  110, 180,
                                       146, 151, 179, 93,  88,  200, 133, 85,  152, 151, 98,  106};
    EXPECT_EQ(ResizeBicubic(kPillowSrc.data(), 7, 5, 3, 4), want);
}

TEST(VisionResize, MatchesPillowShrinkingOneAxis) {
    const std::vector<uint8_t> want = {106, 118, 116, 140, 83,  49,  65,  62,  154, 122, 118,
                                       170, 119, 144, 88,  103, 176, 188, 116, 80,  141, 105,
                                       99,  186, 46,  132, 178, 178, 29,  195, 61,  91,  138,
                                       122, 164, 171, 109, 157, 167, 207, 52,  121};
    EXPECT_EQ(ResizeBicubic(kPillowSrc.data(), 7, 5, 7, 2), want);
}

TEST(VisionResize, MatchesPillowEnlarging) {
    // The first two and the last two output rows of 11 x 9 (Pillow's values).
    const std::vector<uint8_t> head = {
        129, 196, 0,   194, 171, 0,   246, 125, 39,  115, 63,  159, 138, 73,  217, 253, 129,
        198, 115, 126, 55,  44,  149, 17,  108, 212, 133, 101, 220, 107, 87,  214, 68,  91,
        154, 83,  142, 137, 43,  182, 108, 20,  76,  79,  128, 96,  84,  188, 199, 112, 180,
        125, 112, 72,  79,  129, 50,  104, 171, 150, 110, 161, 137, 112, 144, 108};
    const std::vector<uint8_t> tail = {
        108, 57,  140, 123, 118, 132, 116, 141, 137, 77,  107, 148, 177, 84,  103, 255, 73,
        66,  170, 0,   225, 108, 44,  201, 52,  100, 171, 153, 89,  169, 183, 63,  171, 151,
        43,  164, 173, 126, 100, 134, 145, 95,  29,  73,  161, 150, 72,  77,  255, 85,  1};
    std::vector<uint8_t> got = ResizeBicubic(kPillowSrc.data(), 7, 5, 11, 9);
    ASSERT_EQ(got.size(), 11u * 9 * 3);
    EXPECT_EQ(std::vector<uint8_t>(got.begin(), got.begin() + head.size()), head);
    EXPECT_EQ(std::vector<uint8_t>(got.end() - tail.size(), got.end()), tail);
}

TEST(VisionResize, SameSizeIsACopyAndAUniformImageStaysUniform) {
    std::vector<uint8_t> img = TestImage(13, 9, 3);
    EXPECT_EQ(ResizeBicubic(img.data(), 13, 9, 13, 9), img);
    std::vector<uint8_t> flat(size_t(40) * 30 * 3);
    for (size_t i = 0; i < flat.size(); ++i) flat[i] = i % 3 == 0 ? 200 : (i % 3 == 1 ? 7 : 255);
    for (auto [w, h] : {std::pair{3, 2}, {64, 64}, {41, 7}, {1, 1}}) {
        std::vector<uint8_t> out = ResizeBicubic(flat.data(), 40, 30, w, h);
        for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], flat[i % 3]) << w << "x" << h;
    }
}

// --- The encoder --------------------------------------------------------------------------------

class VisionTest : public ::testing::Test {
  protected:
    void SetUp() override {
        path_ = TempPath("vision");
        FERRY_ASSERT_OK(WriteRandomMmproj(TestSpec(), 11, path_));
    }
    void TearDown() override { std::remove(path_.c_str()); }
    std::string path_;
};

TEST_F(VisionTest, PreprocessPadsToASquareAndNormalizes) {
    auto enc = std::move(VisionEncoder::Load(path_)).value();
    const VisionConfig& c = enc->config();
    const int s = c.image_size;
    // A square image of the right size goes straight to normalization.
    std::vector<uint8_t> img = TestImage(s, s, 1);
    std::vector<float> px = enc->Preprocess(img.data(), s, s);
    ASSERT_EQ(px.size(), size_t(3) * s * s);
    for (int ch = 0; ch < 3; ++ch) {
        for (int i = 0; i < s * s; i += 37) {
            float want = (img[size_t(i) * 3 + ch] / 255.0f - c.mean[ch]) / c.std[ch];
            ASSERT_FLOAT_EQ(px[size_t(ch) * s * s + i], want);
        }
    }
    // A wide image fills the width, centred, the pad colour above and below: 64 x 16 into 32 is
    // 32 x 8 at rows 12..19.
    std::vector<uint8_t> wide = TestImage(64, 16, 2);
    px = enc->Preprocess(wide.data(), 64, 16);
    std::vector<uint8_t> resized = ResizeBicubic(wide.data(), 64, 16, 32, 8);
    for (int ch = 0; ch < 3; ++ch) {
        float pad = (c.pad_color[ch] / 255.0f - c.mean[ch]) / c.std[ch];
        for (int y = 0; y < s; ++y) {
            for (int x = 0; x < s; ++x) {
                float got = px[(size_t(ch) * s + y) * s + x];
                if (y < 12 || y >= 20) {
                    ASSERT_FLOAT_EQ(got, pad) << y << "," << x;
                } else {
                    uint8_t v = resized[(size_t(y - 12) * 32 + x) * 3 + ch];
                    ASSERT_FLOAT_EQ(got, (v / 255.0f - c.mean[ch]) / c.std[ch]);
                }
            }
        }
    }
    // A one-pixel image and a tall one are valid too.
    EXPECT_EQ(enc->Preprocess(TestImage(1, 1, 3).data(), 1, 1).size(), px.size());
    EXPECT_EQ(enc->Preprocess(TestImage(5, 300, 3).data(), 5, 300).size(), px.size());
}

// Steps 2-4 in double precision, from the file's tensors as stored.
std::vector<double> Reference(const std::string& path, const std::vector<float>& pixels) {
    auto file = std::move(gguf::GgufFile::Open(path)).value();
    auto t = [&](const std::string& name) {
        const gguf::GgufTensor* g = file->FindTensor(name);
        EXPECT_NE(g, nullptr) << name;
        std::vector<double> v(g->elements());
        for (size_t i = 0; i < v.size(); ++i) {
            float f;
            std::memcpy(&f, g->data + 4 * i, 4);
            v[i] = f;
        }
        return v;
    };
    const RandomVisionSpec s = TestSpec();
    const int side = s.image_size / s.patch_size, n = side * side, d = s.dim, p = s.patch_size;
    const int hd = d / s.num_heads;
    // y[t][o] = sum_i W[o][i] x[t][i] + b[o], W stored [out][in].
    auto linear = [&](const std::vector<double>& x, int in, const std::string& name, int out) {
        std::vector<double> w = t(name + ".weight"), b = t(name + ".bias"), y(size_t(n) * out);
        for (int r = 0; r < n; ++r) {
            for (int o = 0; o < out; ++o) {
                double acc = b[o];
                for (int i = 0; i < in; ++i) acc += w[size_t(o) * in + i] * x[size_t(r) * in + i];
                y[size_t(r) * out + o] = acc;
            }
        }
        return y;
    };
    auto norm = [&](std::vector<double> x, const std::string& name) {
        std::vector<double> w = t(name + ".weight"), b = t(name + ".bias");
        for (int r = 0; r < n; ++r) {
            double* row = &x[size_t(r) * d];
            double mean = 0, var = 0;
            for (int i = 0; i < d; ++i) mean += row[i] / d;
            for (int i = 0; i < d; ++i) var += (row[i] - mean) * (row[i] - mean) / d;
            for (int i = 0; i < d; ++i)
                row[i] = (row[i] - mean) / std::sqrt(var + 1e-5) * w[i] + b[i];
        }
        return x;
    };
    // The convolution, pixel by pixel.
    std::vector<double> conv = t("v.patch_embd.weight"), bias = t("v.patch_embd.bias");
    std::vector<double> pos = t("v.position_embd.weight"), x(size_t(n) * d);
    for (int py = 0; py < side; ++py) {
        for (int px = 0; px < side; ++px) {
            for (int o = 0; o < d; ++o) {
                double acc = bias[o];
                for (int ch = 0; ch < 3; ++ch) {
                    for (int ky = 0; ky < p; ++ky) {
                        for (int kx = 0; kx < p; ++kx) {
                            double w = conv[((size_t(o) * 3 + ch) * p + ky) * p + kx];
                            acc += w *
                                   pixels[(size_t(ch) * s.image_size + py * p + ky) * s.image_size +
                                          px * p + kx];
                        }
                    }
                }
                const int tok = py * side + px;
                x[size_t(tok) * d + o] = acc + pos[size_t(tok) * d + o];
            }
        }
    }
    x = norm(x, "v.pre_ln");
    for (int l = 0; l + 1 < s.num_layers; ++l) {
        const std::string b = "v.blk." + std::to_string(l) + ".";
        std::vector<double> h = norm(x, b + "ln1");
        std::vector<double> q = linear(h, d, b + "attn_q", d), k = linear(h, d, b + "attn_k", d),
                            v = linear(h, d, b + "attn_v", d), a(size_t(n) * d);
        for (int head = 0; head < s.num_heads; ++head) {
            for (int i = 0; i < n; ++i) {
                std::vector<double> sc(n);
                double mx = -1e300, sum = 0;
                for (int j = 0; j < n; ++j) {
                    double dot = 0;
                    for (int e = 0; e < hd; ++e) {
                        dot += q[size_t(i) * d + head * hd + e] * k[size_t(j) * d + head * hd + e];
                    }
                    sc[j] = dot / std::sqrt(double(hd));
                    mx = std::max(mx, sc[j]);
                }
                for (double& z : sc) sum += (z = std::exp(z - mx));
                for (int e = 0; e < hd; ++e) {
                    double acc = 0;
                    for (int j = 0; j < n; ++j)
                        acc += sc[j] / sum * v[size_t(j) * d + head * hd + e];
                    a[size_t(i) * d + head * hd + e] = acc;
                }
            }
        }
        std::vector<double> o = linear(a, d, b + "attn_out", d);
        for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
        h = norm(x, b + "ln2");
        std::vector<double> u = linear(h, d, b + "ffn_up", s.ffn_dim);
        for (double& z : u) z = z / (1 + std::exp(-1.702 * z));  // GELU-quick
        std::vector<double> dn = linear(u, s.ffn_dim, b + "ffn_down", d);
        for (size_t i = 0; i < x.size(); ++i) x[i] += dn[i];
    }
    std::vector<double> m = linear(x, d, "mm.0", s.proj_hidden);
    for (double& z : m) {
        z = 0.5 * z * (1 + std::tanh(std::sqrt(2 / M_PI) * (z + 0.044715 * z * z * z)));
    }
    return linear(m, s.proj_hidden, "mm.2", s.out_dim);
}

TEST_F(VisionTest, EncodeMatchesTheDoublePrecisionReference) {
    auto enc = std::move(VisionEncoder::Load(path_)).value();
    const VisionConfig& c = enc->config();
    EXPECT_EQ(c.tokens_per_image(), 16);
    EXPECT_EQ(c.out_dim, 40);
    EXPECT_EQ(c.proj_hidden, 48);
    EXPECT_TRUE(c.pre_ln);
    EXPECT_FALSE(c.post_ln);
    for (uint64_t seed : {1, 2}) {
        std::vector<uint8_t> img = TestImage(45, 29, seed);
        std::vector<float> px = enc->Preprocess(img.data(), 45, 29);
        std::vector<float> got = enc->EncodePixels(px);
        std::vector<double> want = Reference(path_, px);
        ASSERT_EQ(got.size(), want.size());
        double max_err = 0, max_val = 0;
        for (size_t i = 0; i < got.size(); ++i) {
            max_err = std::max(max_err, std::fabs(got[i] - want[i]));
            max_val = std::max(max_val, std::fabs(want[i]));
        }
        EXPECT_GT(max_val, 0.3);  // rows of about unit size, not a collapse to zero
        EXPECT_LT(max_err, 2e-4 * std::max(1.0, max_val)) << "max |want| " << max_val;
        // The same pixels give the same rows; other pixels give other rows.
        EXPECT_EQ(enc->Encode(img.data(), 45, 29), got);
        std::vector<uint8_t> other = img;
        other[100] ^= 0x40;
        EXPECT_NE(enc->Encode(other.data(), 45, 29), got);
    }
}

TEST_F(VisionTest, FingerprintTellsWeightsApart) {
    auto a = std::move(VisionEncoder::Load(path_)).value();
    auto b = std::move(VisionEncoder::Load(path_)).value();
    EXPECT_EQ(a->fingerprint(), b->fingerprint());
    EXPECT_EQ(a->fingerprint().size(), 32u);
    std::string other = TempPath("vision-other");
    FERRY_ASSERT_OK(WriteRandomMmproj(TestSpec(), 12, other));
    auto c = std::move(VisionEncoder::Load(other)).value();
    EXPECT_NE(a->fingerprint(), c->fingerprint());
    std::remove(other.c_str());
}

// Rewrites `src` into `dst` through `edit` (keys and tensors by name; a tensor edit may change
// its dims or drop it).
struct Edits {
    std::function<bool(const std::string& key, gguf::GgufWriter* w)> key;        // true: handled
    std::function<bool(const gguf::GgufTensor& t, gguf::GgufWriter* w)> tensor;  // true: handled
};
Edits TensorEdit(std::function<bool(const gguf::GgufTensor& t, gguf::GgufWriter* w)> fn) {
    return Edits{.key = {}, .tensor = std::move(fn)};
}
void Rewrite(const std::string& src, const std::string& dst, const Edits& e) {
    auto f = std::move(gguf::GgufFile::Open(src)).value();
    gguf::GgufWriter w;
    for (const auto& [key, value] : f->metadata()) {
        if (e.key && e.key(key, &w)) continue;
        FERRY_ASSERT_OK(w.SetValue(key, value));
    }
    for (const gguf::GgufTensor& t : f->tensors()) {
        if (e.tensor && e.tensor(t, &w)) continue;
        FERRY_ASSERT_OK(w.AddTensor(t.name, t.dims, t.type,
                                    std::string(reinterpret_cast<const char*>(t.data), t.bytes)));
    }
    FERRY_ASSERT_OK(w.Write(dst));
}

TEST_F(VisionTest, LoadRefusesWhatItCannotRunByName) {
    const std::string bad = TempPath("vision-bad");
    auto expect = [&](const Edits& e, const std::string& text) {
        Rewrite(path_, bad, e);
        EXPECT_THAT(VisionEncoder::Load(bad).status(), StatusHas(Code::kInvalidArgument, text));
    };
    auto set_key = [](std::string name, std::function<void(gguf::GgufWriter*)> fn) {
        return Edits{.key =
                         [name, fn](const std::string& k, gguf::GgufWriter* w) {
                             if (k != name) return false;
                             fn(w);
                             return true;
                         },
                     .tensor = {}};
    };
    expect(
        set_key("clip.projector_type",
                [](gguf::GgufWriter* w) { w->SetString("clip.projector_type", "qwen2vl_merger"); }),
        "projector type 'qwen2vl_merger' is not supported");
    expect(set_key("clip.has_vision_encoder",
                   [](gguf::GgufWriter* w) { w->SetBool("clip.has_vision_encoder", false); }),
           "not a vision projector");
    expect(set_key("clip.vision.patch_size",
                   [](gguf::GgufWriter* w) { w->SetUint32("clip.vision.patch_size", 5); }),
           "must be a multiple of patch_size 5");
    expect(set_key("clip.vision.block_count", [](gguf::GgufWriter*) {}), "clip.vision.block_count");
    expect(
        set_key("clip.vision.image_mean",
                [](gguf::GgufWriter* w) { w->SetFloat32Array("clip.vision.image_mean", {0.5f}); }),
        "clip.vision.image_mean must be an array of 3 floats");
    expect(set_key("clip.vision.image_std",
                   [](gguf::GgufWriter* w) {
                       w->SetFloat32Array("clip.vision.image_std", {0.5f, 0.0f, 0.5f});
                   }),
           "image_std has a value that is not positive");
    expect(TensorEdit([](const gguf::GgufTensor& t, gguf::GgufWriter*) {
               return t.name == "v.blk.1.attn_k.weight";
           }),
           "tensor v.blk.1.attn_k.weight is missing");
    expect(TensorEdit([](const gguf::GgufTensor& t, gguf::GgufWriter* w) {
               if (t.name != "mm.2.bias") return false;
               FERRY_EXPECT_OK(
                   w->AddTensor(t.name, {t.dims[0] - 1}, t.type,
                                std::string(reinterpret_cast<const char*>(t.data), t.bytes - 4)));
               return true;
           }),
           "tensor mm.2.bias has dims [39], expected [40]");
    expect(
        TensorEdit([](const gguf::GgufTensor& t, gguf::GgufWriter* w) {
            if (t.name != "mm.0.bias") return false;
            FERRY_EXPECT_OK(w->AddTensor("v.class_embd", {32}, t.type, std::string(32 * 4, '\0')));
            FERRY_EXPECT_OK(
                w->AddTensor(t.name, t.dims, t.type,
                             std::string(reinterpret_cast<const char*>(t.data), t.bytes)));
            return true;
        }),
        "v.class_embd (a class embedding) is not supported");
    // A language model is not a projector.
    ASSERT_TRUE(WriteRandomModel(PresetSpec("tiny").value(), 1, bad).ok());
    EXPECT_THAT(VisionEncoder::Load(bad).status(),
                StatusHas(Code::kInvalidArgument, "not a vision projector (mmproj) file"));
    std::remove(bad.c_str());
}

TEST(VisionPresets, ProjectIntoTheirLanguageModelsWidth) {
    for (auto [vl, lm] : {std::pair{"tiny-vl", "tiny"}, {"small-vl", "small"}}) {
        RandomVisionSpec v = PresetVisionSpec(vl).value();
        EXPECT_EQ(v.out_dim, PresetSpec(lm).value().dim) << vl;
        EXPECT_EQ(v.image_size % v.patch_size, 0) << vl;
    }
    EXPECT_EQ(PresetVisionSpec("tiny-vl").value().image_size / 8, 8);  // 64 tokens
    EXPECT_THAT(PresetVisionSpec("huge-vl").status(),
                StatusHas(Code::kNotFound, "unknown vision preset 'huge-vl'"));
}

}  // namespace
}  // namespace ferry::model
