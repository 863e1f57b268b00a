// The serving benchmark's workload: its prompts (vLLM's random, random-mm, sharegpt and
// prefix_repetition datasets), the images random-mm sends, and when each request is sent.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/serve_bench.h"
#include "ferry/status.h"

namespace ferry::tokenizer {
class Tokenizer;
}

namespace ferry::bench {

// One prompt of the dataset.
struct BenchPrompt {
    std::string text;
    int prompt_len = 0;  // tokens, as counted by the tokenizer (or characters without one)
    int output_len = 0;  // max_tokens
    int images = 0;
};

// Deterministic for a seed. Without a tokenizer, random prompts are ASCII text with one
// character per token (exact for byte-level vocabularies such as ferry's presets), and ShareGPT
// lengths are estimated at four bytes per token.
Result<std::vector<BenchPrompt>> SampleDataset(const ServeBenchOptions& options,
                                               const tokenizer::Tokenizer* tokenizer);
// Send times (seconds from the start) of n requests: gaps drawn from a gamma distribution with
// shape `burstiness` and mean 1 / rate; all zero for an infinite rate.
std::vector<double> ArrivalTimes(int n, double rate, double burstiness, uint64_t seed);
// A PNG image of random pixels (libpng; random pixels do not compress, so its size is the
// pixels'), deterministic for a seed.
std::string RandomPng(int width, int height, uint64_t seed);

}  // namespace ferry::bench
