// `ferry bench serve`: the serving benchmark users know from `vllm bench serve`, against any
// OpenAI-compatible endpoint (a ferry worker or proxy, or another server). Requests arrive as a
// Poisson process (or a gamma process with --burstiness), optionally capped in concurrency; every
// response is streamed, and one event loop thread holds all connections, so a thousand
// concurrent streams do not skew the timings. Prints vLLM's "Serving Benchmark Result" table and
// can save every per-request record as JSON (for `ferry bench plot`).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bench/serve_metrics.h"
#include "ferry/status.h"

namespace ferry::bench {

struct ServeBenchOptions {
    std::string base_url = "http://127.0.0.1:8000";
    std::string endpoint = "/v1/completions";  // or /v1/chat/completions
    std::string model;                         // empty: the first of GET /v1/models
    std::string dataset_name = "random";       // random | sharegpt | random-mm | prefix_repetition
    std::string dataset_path;                  // sharegpt: a ShareGPT-format JSON file
    int random_input_len = 1024;
    int random_output_len = 128;
    double random_range_ratio = 0.0;  // lengths uniform in [len * (1 - r), len * (1 + r)]
    int random_prefix_len = 0;        // tokens shared by every prompt, before the random part
    int mm_images = 1;                // random-mm: images per request
    int mm_width = 64, mm_height = 64;
    int mm_distinct = 0;  // random-mm: images drawn from a pool of this many (0: all distinct)
    int sharegpt_output_len = 0;  // > 0: overrides the dataset's output lengths
    // prefix_repetition (vLLM's dataset of that name): num_prefixes random prefixes, each
    // shared by num_prompts / num_prefixes prompts that add a random suffix; shuffled.
    int prefix_repetition_prefix_len = 256;
    int prefix_repetition_suffix_len = 256;
    int prefix_repetition_num_prefixes = 10;
    int prefix_repetition_output_len = 128;
    std::string tokenizer;  // a GGUF file whose tokenizer makes and counts the prompts
    int num_prompts = 1000;
    double request_rate = std::numeric_limits<double>::infinity();
    double burstiness = 1.0;  // gamma shape; 1 = Poisson
    int max_concurrency = 0;  // 0: no cap
    bool ignore_eos = false;
    double temperature = 0.0;
    uint64_t seed = 0;
    GoodputLimits goodput;
    std::vector<double> percentiles = {99};
    std::string save_result;  // JSON file
    std::string label;        // a name for this run in the JSON and in plots
    double request_timeout = 600;
    bool progress = true;
};

struct ServeBenchResult {
    ServeMetrics metrics;
    std::vector<RequestRecord> records;
    std::string model;
};

Result<ServeBenchResult> RunServeBench(const ServeBenchOptions& options);
// vLLM's layout (serve_report.cc).
std::string FormatServeResult(const ServeBenchOptions& options, const ServeBenchResult& result);
Status SaveServeResult(const ServeBenchOptions& options, const ServeBenchResult& result,
                       const std::string& path);
// The command: run, print, save. Returns the exit code.
int RunServeBenchCommand(const ServeBenchOptions& options);

}  // namespace ferry::bench
