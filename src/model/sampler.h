// Token sampling: greedy, temperature, top-k, top-p, per-request seed, and the log-probabilities
// of the sampled token (and optionally the top alternatives), computed from the raw logits as
// OpenAI and vLLM report them. One Sampler per request; not thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ferry/status.h"

namespace ferry::model {

struct SamplingParams {
    float temperature = 1.0f;  // 0: greedy
    int top_k = 0;             // <= 0: off
    float top_p = 1.0f;        // (0, 1]
    std::optional<uint64_t> seed;
    int max_tokens = 16;
    std::vector<std::string> stop;        // stop strings (not included in the output)
    std::vector<int32_t> stop_token_ids;  // stop tokens besides the model's own
    bool ignore_eos = false;
    int logprobs = -1;  // -1: none; 0: sampled token only; n: also the top n

    Status Validate() const;  // InvalidArgument naming the field
};

struct SampledToken {
    int32_t token = 0;
    float logprob = 0;
    std::vector<std::pair<int32_t, float>> top;  // when logprobs > 0, best first
};

class Sampler {
  public:
    // `fallback_seed` is used when params.seed is unset.
    Sampler(const SamplingParams& params, uint64_t fallback_seed);
    SampledToken Sample(const float* logits, int vocab);
    // Advances the random stream as Sample does for one token, without logits: a request that
    // continues from a token sampled elsewhere (disaggregated decode) then draws what it would
    // have drawn next.
    void Skip();

  private:
    SamplingParams params_;
    std::mt19937_64 rng_;
    std::vector<std::pair<float, int32_t>> cand_;
};

}  // namespace ferry::model
