// The metrics of `ferry bench serve`, defined as `vllm bench serve` defines them:
// - TTFT: from sending the request to the first streamed chunk with content;
// - TPOT: (E2E latency - TTFT) / (output tokens - 1), per request with more than one token;
// - ITL: the gaps between consecutive chunks with content, pooled over all requests;
// - E2EL: from sending the request to its last byte.
// Statistics are mean, median, standard deviation (population) and percentiles with linear
// interpolation (numpy's default), in milliseconds.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ferry::bench {

// One request as the client saw it. Times in seconds; `start` from the start of the run.
struct RequestRecord {
    bool success = false;
    std::string error;
    int prompt_tokens = 0;
    int output_tokens = 0;
    int cached_tokens = -1;  // usage.prompt_tokens_details.cached_tokens; -1: not reported
    double start = 0;
    double ttft = 0;
    double latency = 0;
    std::vector<double> itl;          // gaps between content chunks
    std::vector<double> chunk_times;  // arrival of each content chunk, from the start of the run
};

struct MetricStats {
    double mean = 0, median = 0, std = 0;
    std::vector<std::pair<double, double>> percentiles;  // (p, value)
};

// Requests are good when every given limit (milliseconds) holds.
struct GoodputLimits {
    std::optional<double> ttft_ms, tpot_ms, e2el_ms;
    bool any() const { return ttft_ms || tpot_ms || e2el_ms; }
};

struct ServeMetrics {
    int completed = 0;
    int failed = 0;
    long total_input = 0;
    long total_output = 0;
    long total_cached = 0;  // prompt tokens the servers found in their prefix caches
    // total_cached / total_input over the requests whose answer reported cached tokens; none
    // when no answer did.
    std::optional<double> prefix_cache_hit_rate;
    double duration = 0;
    double request_throughput = 0;
    std::optional<double> request_goodput;
    double output_throughput = 0;
    double total_token_throughput = 0;
    double peak_output_throughput = 0;  // content chunks in the busiest one-second window
    double peak_concurrency = 0;        // most requests in flight at once
    MetricStats ttft_ms, tpot_ms, itl_ms, e2el_ms;
};

double Percentile(std::vector<double> values, double p);  // numpy linear; 0 for none
// The middle value (the mean of the two middle values for an even count); 0 for none.
inline double Median(std::vector<double> values) { return Percentile(std::move(values), 50); }
MetricStats Stats(const std::vector<double>& values_ms, const std::vector<double>& percentiles);
ServeMetrics ComputeServeMetrics(const std::vector<RequestRecord>& records, double duration,
                                 const std::vector<double>& percentiles,
                                 const GoodputLimits& goodput);

}  // namespace ferry::bench
