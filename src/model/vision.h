// The vision encoder: an image in, a fixed number of embedding rows of the language model's width
// out, from a multimodal projector file in llama.cpp's `mmproj` GGUF format (`clip.*` keys, `v.*`
// and `mm.*` tensors), projector type "mlp" (LLaVA 1.5's: a CLIP ViT, its second-to-last layer's
// output through two linear layers with a GELU between).
//
// As llama.cpp's clip graph for that projector (tools/mtmd: clip.cpp, models/llava.cpp):
// 1. The image is resized into image_size x image_size keeping its aspect ratio (Pillow's bicubic
//    resampling in 8 bits, the longer side filling the square, sizes rounded up), centred on a
//    square of the pad colour (122, 116, 104), then each channel scaled to [0, 1] and normalized
//    by the file's image_mean and image_std.
// 2. Patches of patch_size^2 pixels (row-major) through the patch embedding (a stride-patch_size
//    convolution) plus its bias, plus the position embeddings, then pre_ln if the file has it.
// 3. The first block_count - 1 transformer blocks: LayerNorm, multi-head self-attention over all
//    patches (no mask), residual, LayerNorm, MLP (GELU-quick, or GELU with clip.use_gelu),
//    residual. post_ln if the file has it.
// 4. mm.0, GELU (tanh form), mm.2: one row per patch, projection_dim wide.
// Not supported, and refused by name: other projector types, a class embedding (v.class_embd),
// stacked feature layers (clip.vision.feature_layer), SiLU MLPs.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "gguf/gguf.h"
#include "model/kernels.h"

namespace ferry::model {

struct VisionConfig {
    std::string projector_type = "mlp";
    int image_size = 0;  // the square the image is fitted into
    int patch_size = 0;  // image_size is a multiple of it
    int dim = 0;         // the ViT's width (clip.vision.embedding_length)
    int num_heads = 0;
    int ffn_dim = 0;
    int num_layers = 0;   // in the file; the encoder runs num_layers - 1 of them
    int proj_hidden = 0;  // mm.0's output width
    int out_dim = 0;      // mm.2's output width: the language model's embedding width
    float eps = 1e-5f;
    bool use_gelu = false;  // the blocks' MLP activation: GELU, else GELU-quick
    bool pre_ln = false;
    bool post_ln = false;
    float mean[3] = {0, 0, 0};
    float std[3] = {1, 1, 1};
    uint8_t pad_color[3] = {122, 116, 104};

    int patches_per_side() const { return image_size / patch_size; }
    // Embedding rows per image.
    int tokens_per_image() const { return patches_per_side() * patches_per_side(); }
};

class VisionEncoder {
  public:
    // Reads an mmproj GGUF: InvalidArgument naming the file and the key or tensor that is
    // missing, of the wrong type or shape, or a projector other than "mlp".
    static Result<std::unique_ptr<VisionEncoder>> Load(const std::string& path, int threads = 1);
    ~VisionEncoder();

    const VisionConfig& config() const { return config_; }
    // SHA-256 over the file's tensors and keys that the output depends on (hex): two workers
    // with the same fingerprint compute the same embeddings.
    const std::string& fingerprint() const { return fingerprint_; }

    // Step 1: `rgb` (width x height, both >= 1, 3 bytes a pixel, row-major) as the normalized
    // planar input,
    // 3 x image_size x image_size floats.
    std::vector<float> Preprocess(const uint8_t* rgb, int width, int height) const;
    // Steps 2-4: tokens_per_image() rows of out_dim floats. Calls are serialized (one scratch).
    std::vector<float> EncodePixels(const std::vector<float>& pixels);
    // Both.
    std::vector<float> Encode(const uint8_t* rgb, int width, int height);

  private:
    struct Layer;
    VisionEncoder();
    Status LoadTensors(const gguf::GgufFile& f);

    VisionConfig config_;
    std::string fingerprint_;
    Weights patch_embd_;             // [dim][3 * patch^2]
    std::vector<float> patch_bias_;  // [dim]
    std::vector<float> position_;    // [tokens][dim]
    std::vector<float> pre_ln_w_, pre_ln_b_, post_ln_w_, post_ln_b_;
    std::vector<Layer> layers_;
    Weights mm0_, mm2_;
    std::vector<float> mm0_b_, mm2_b_;
    std::unique_ptr<WorkPool> pool_;
    AlignedFloats scratch_;
    std::unique_ptr<std::mutex> mu_;
};

// Pillow's resampling of an 8-bit RGB image (Image.resize with BICUBIC: a separable
// convolution, a = -0.5, widened by the scale when shrinking, 22-bit fixed-point weights, each
// pass rounded to 8 bits; horizontal first). Exposed for tests.
std::vector<uint8_t> ResizeBicubic(const uint8_t* rgb, int width, int height, int out_width,
                                   int out_height);

// Random-weight projector files for tests, demos and benchmarks.
struct RandomVisionSpec {
    std::string name = "ferry-tiny-vl";
    int image_size = 64;
    int patch_size = 8;
    int dim = 128;
    int num_heads = 4;
    int ffn_dim = 512;
    int num_layers = 3;  // two run (llava's second-to-last layer)
    int proj_hidden = 256;
    int out_dim = 256;  // the language model's width
};
// "tiny-vl" (64 tokens an image, a 128-wide ViT, into the tiny model's 256) or "small-vl" (224
// pixels in 14-pixel patches: 256 tokens, a 384-wide 6-head ViT of 6 running layers, into the
// small model's 768). NotFound for other names.
Result<RandomVisionSpec> PresetVisionSpec(std::string_view preset);
// Writes an mmproj GGUF for `spec` with weights drawn from `seed` (f32; CLIP's mean and std).
Status WriteRandomMmproj(const RandomVisionSpec& spec, uint64_t seed, const std::string& path);

}  // namespace ferry::model
