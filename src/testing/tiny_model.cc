#include "testing/tiny_model.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

namespace ferry::testing {

model::RandomModelSpec TinyModelSpec(int context_length) {
    model::RandomModelSpec s;
    s.name = "ferry-test-tiny";
    s.dim = 64;
    s.num_layers = 2;
    s.num_heads = 4;
    s.num_kv_heads = 2;
    s.ffn_dim = 128;
    s.context_length = context_length;
    return s;
}

model::RandomModelSpec TinyMlaModelSpec(int context_length) {
    model::RandomModelSpec s = TinyModelSpec(context_length);
    s.name = "ferry-test-tiny-mla";
    s.mla = true;
    s.num_kv_heads = 1;
    s.kv_lora_rank = 32;
    s.qk_nope_dim = 16;
    s.qk_rope_dim = 8;
    s.v_head_dim = 16;
    return s;
}

model::RandomVisionSpec TinyVisionSpec() {
    model::RandomVisionSpec v;
    v.name = "ferry-test-tiny-vl";
    v.image_size = 32;
    v.patch_size = 8;
    v.dim = 32;
    v.num_heads = 2;
    v.ffn_dim = 64;
    v.num_layers = 3;
    v.proj_hidden = 64;
    v.out_dim = TinyModelSpec().dim;
    return v;
}

std::string WriteTinyMmproj(const std::string& tag, uint64_t seed) {
    const std::string path = (std::filesystem::temp_directory_path() /
                              (tag + "-" + std::to_string(getpid()) + "-mmproj.gguf"))
                                 .string();
    Status st = model::WriteRandomMmproj(TinyVisionSpec(), seed, path);
    if (!st.ok()) {
        std::fprintf(stderr, "WriteTinyMmproj %s: %s\n", path.c_str(), st.ToString().c_str());
        std::abort();
    }
    return path;
}

TinyModelFile::TinyModelFile(const std::string& tag, const model::RandomModelSpec& spec,
                             uint64_t seed)
    : path_((std::filesystem::temp_directory_path() /
             (tag + "-" + std::to_string(getpid()) + ".gguf"))
                .string()) {
    Status s = model::WriteRandomModel(spec, seed, path_);
    if (!s.ok()) {
        std::fprintf(stderr, "tiny model %s: %s\n", path_.c_str(), s.ToString().c_str());
        std::abort();
    }
}

TinyModelFile::~TinyModelFile() { std::remove(path_.c_str()); }

std::shared_ptr<model::Model> TinyModelFile::Load(int tp) const {
    auto m = model::Model::Load(path_, {.tp = tp});
    if (!m.ok()) {
        std::fprintf(stderr, "tiny model %s: %s\n", path_.c_str(), m.status().ToString().c_str());
        std::abort();
    }
    return std::shared_ptr<model::Model>(std::move(m).value());
}

}  // namespace ferry::testing
