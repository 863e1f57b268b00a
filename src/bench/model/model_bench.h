// `ferry bench model`: prefill and decode throughput of the inference engine on this machine,
// next to the machine's measured sgemm GFLOP/s (one core, and all cores: the ceiling).
#pragma once

#include <string>
#include <vector>

namespace ferry::bench {

struct ModelBenchOptions {
    std::string preset = "small";  // used when `model` is empty
    std::string model;             // a GGUF file
    int tp = 1;
    std::vector<int> prompt_lens = {512, 2048};
    std::vector<int> batches = {1, 8, 32};
    int decode_context = 128;  // prompt tokens of each decoding sequence
    int decode_steps = 32;
    int repeats = 3;
    std::string kv_dtype = "f32";
};

int RunModelBench(const ModelBenchOptions& options);

}  // namespace ferry::bench
