// The tiny random-weight model every test that runs the engine uses (written once, here): a
// GGUF file in the temp directory, removed when the fixture goes, and models loaded from it.
#pragma once

#include <memory>
#include <string>

#include "model/model.h"
#include "model/vision.h"

namespace ferry::testing {

// dim 64, 2 layers, 4 heads, 2 kv heads, MLP 128: milliseconds per step on one core.
model::RandomModelSpec TinyModelSpec(int context_length = 2048);
// Its MLA twin (architecture deepseek2): latent 32 + RoPE 8 per token and layer, 4 heads.
model::RandomModelSpec TinyMlaModelSpec(int context_length = 2048);

// A vision projector (mmproj) into TinyModelSpec's width: 32x32 pixels in 8-pixel patches (16
// tokens an image), a 32-wide 2-head ViT of 2 running layers.
model::RandomVisionSpec TinyVisionSpec();
// Writes it from `seed` to a file unique to this process and `tag`; aborts if that fails.
std::string WriteTinyMmproj(const std::string& tag, uint64_t seed);

class TinyModelFile {
  public:
    // Writes the model for `spec` from `seed` to a file unique to this process and `tag`;
    // aborts the test binary if that fails (nothing else could run).
    TinyModelFile(const std::string& tag, const model::RandomModelSpec& spec, uint64_t seed);
    ~TinyModelFile();
    TinyModelFile(const TinyModelFile&) = delete;
    TinyModelFile& operator=(const TinyModelFile&) = delete;

    const std::string& path() const { return path_; }
    std::shared_ptr<model::Model> Load(int tp = 1) const;

  private:
    std::string path_;
};

}  // namespace ferry::testing
