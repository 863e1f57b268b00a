#include "bench/serve_metrics.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

namespace ferry::bench {

double Percentile(std::vector<double> v, double p) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    double rank = p / 100.0 * double(v.size() - 1);
    auto lo = static_cast<size_t>(std::floor(rank));
    size_t hi = std::min(lo + 1, v.size() - 1);
    double frac = rank - double(lo);
    return v[lo] + (v[hi] - v[lo]) * frac;
}

MetricStats Stats(const std::vector<double>& v, const std::vector<double>& percentiles) {
    MetricStats s;
    if (!v.empty()) {
        s.mean = std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
        double ss = 0;
        for (double x : v) ss += (x - s.mean) * (x - s.mean);
        s.std = std::sqrt(ss / double(v.size()));
        s.median = Percentile(v, 50);
    }
    for (double p : percentiles) s.percentiles.emplace_back(p, Percentile(v, p));
    return s;
}

ServeMetrics ComputeServeMetrics(const std::vector<RequestRecord>& records, double duration,
                                 const std::vector<double>& percentiles,
                                 const GoodputLimits& goodput) {
    ServeMetrics m;
    m.duration = duration;
    std::vector<double> ttft, tpot, itl, e2el;
    int good = 0;
    long reported_input = 0;
    bool any_cached = false;
    std::map<long, double> per_second;
    std::vector<std::pair<double, int>> edges;  // (time, +1 | -1)
    for (const RequestRecord& r : records) {
        if (!r.success) {
            ++m.failed;
            continue;
        }
        ++m.completed;
        m.total_input += r.prompt_tokens;
        m.total_output += r.output_tokens;
        if (r.cached_tokens >= 0) {
            any_cached = true;
            m.total_cached += r.cached_tokens;
            reported_input += r.prompt_tokens;
        }
        ttft.push_back(r.ttft * 1e3);
        e2el.push_back(r.latency * 1e3);
        double req_tpot = 0;
        if (r.output_tokens > 1) {
            req_tpot = (r.latency - r.ttft) / (r.output_tokens - 1) * 1e3;
            tpot.push_back(req_tpot);
        }
        for (double g : r.itl) itl.push_back(g * 1e3);
        for (double t : r.chunk_times) per_second[static_cast<long>(std::floor(t))] += 1;
        edges.emplace_back(r.start, +1);
        edges.emplace_back(r.start + r.latency, -1);
        bool ok = (!goodput.ttft_ms || r.ttft * 1e3 <= *goodput.ttft_ms) &&
                  (!goodput.tpot_ms || req_tpot <= *goodput.tpot_ms) &&
                  (!goodput.e2el_ms || r.latency * 1e3 <= *goodput.e2el_ms);
        good += ok;
    }
    if (duration > 0) {
        m.request_throughput = m.completed / duration;
        m.output_throughput = double(m.total_output) / duration;
        m.total_token_throughput = double(m.total_input + m.total_output) / duration;
        if (goodput.any()) m.request_goodput = good / duration;
    }
    if (any_cached && reported_input > 0)
        m.prefix_cache_hit_rate = double(m.total_cached) / double(reported_input);
    for (const auto& [sec, n] : per_second)
        m.peak_output_throughput = std::max(m.peak_output_throughput, n);
    // Ends sort before starts at the same instant: back-to-back requests do not overlap.
    std::sort(edges.begin(), edges.end());
    int live = 0;
    for (const auto& [t, d] : edges) {
        live += d;
        m.peak_concurrency = std::max(m.peak_concurrency, double(live));
    }
    m.ttft_ms = Stats(ttft, percentiles);
    m.tpot_ms = Stats(tpot, percentiles);
    m.itl_ms = Stats(itl, percentiles);
    m.e2el_ms = Stats(e2el, percentiles);
    return m;
}

}  // namespace ferry::bench
