// The serving benchmark's report: vLLM's "Serving Benchmark Result" table and the JSON file of
// every request (--save-result, which `ferry bench plot` reads).
#include <fmt/core.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bench/serve_bench.h"

namespace ferry::bench {

using Json = nlohmann::json;

std::string FormatServeResult(const ServeBenchOptions& o, const ServeBenchResult& r) {
    const ServeMetrics& m = r.metrics;
    std::string s;
    auto line = [&](const std::string& k, const std::string& v) {
        s += fmt::format("{:<40} {:<10}\n", k, v);
    };
    auto f2 = [](double v) { return fmt::format("{:.2f}", v); };
    s += fmt::format("{:=^50}\n", " Serving Benchmark Result ");
    line("Successful requests:", std::to_string(m.completed));
    line("Failed requests:", std::to_string(m.failed));
    if (o.max_concurrency > 0)
        line("Maximum request concurrency:", std::to_string(o.max_concurrency));
    if (std::isfinite(o.request_rate)) line("Request rate configured (RPS):", f2(o.request_rate));
    line("Benchmark duration (s):", f2(m.duration));
    line("Total input tokens:", std::to_string(m.total_input));
    line("Total generated tokens:", std::to_string(m.total_output));
    if (m.prefix_cache_hit_rate) {
        line("Prefix cache hit rate (%):", f2(*m.prefix_cache_hit_rate * 100));
    }
    line("Request throughput (req/s):", f2(m.request_throughput));
    if (m.request_goodput) line("Request goodput (req/s):", f2(*m.request_goodput));
    line("Output token throughput (tok/s):", f2(m.output_throughput));
    line("Peak output token throughput (tok/s):", f2(m.peak_output_throughput));
    line("Peak concurrent requests:", f2(m.peak_concurrency));
    line("Total token throughput (tok/s):", f2(m.total_token_throughput));
    auto section = [&](const char* title, const char* name, const MetricStats& st) {
        s += fmt::format("{:-^50}\n", title);
        line(fmt::format("Mean {} (ms):", name), f2(st.mean));
        line(fmt::format("Median {} (ms):", name), f2(st.median));
        line(fmt::format("Std {} (ms):", name), f2(st.std));
        for (const auto& [p, v] : st.percentiles) {
            line(fmt::format("P{} {} (ms):", fmt::format("{:g}", p), name), f2(v));
        }
    };
    section("Time to First Token", "TTFT", m.ttft_ms);
    section("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms);
    section("Inter-token Latency", "ITL", m.itl_ms);
    section("End-to-end Latency", "E2EL", m.e2el_ms);
    s += std::string(50, '=') + "\n";
    int shown = 0;
    for (const RequestRecord& rec : r.records) {
        if (!rec.success && shown < 3) {
            s += fmt::format("error: {}\n", rec.error.substr(0, 300));
            ++shown;
        }
    }
    return s;
}

Status SaveServeResult(const ServeBenchOptions& o, const ServeBenchResult& r,
                       const std::string& path) {
    const ServeMetrics& m = r.metrics;
    Json j;
    std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof(date), "%Y%m%d-%H%M%S", std::gmtime(&now));
    j["date"] = date;
    j["label"] = o.label;
    j["backend"] = o.endpoint == "/v1/chat/completions" ? "openai-chat" : "openai";
    j["base_url"] = o.base_url;
    j["endpoint"] = o.endpoint;
    j["model_id"] = r.model;
    j["dataset_name"] = o.dataset_name;
    j["num_prompts"] = o.num_prompts;
    j["request_rate"] = std::isfinite(o.request_rate) ? Json(o.request_rate) : Json("inf");
    j["burstiness"] = o.burstiness;
    j["max_concurrency"] = o.max_concurrency > 0 ? Json(o.max_concurrency) : Json();
    j["seed"] = o.seed;
    j["duration"] = m.duration;
    j["completed"] = m.completed;
    j["failed"] = m.failed;
    j["total_input_tokens"] = m.total_input;
    j["total_output_tokens"] = m.total_output;
    j["request_throughput"] = m.request_throughput;
    j["request_goodput"] = m.request_goodput ? Json(*m.request_goodput) : Json();
    j["prefix_cache_hit_rate"] = m.prefix_cache_hit_rate ? Json(*m.prefix_cache_hit_rate) : Json();
    j["total_cached_tokens"] = m.total_cached;
    j["output_throughput"] = m.output_throughput;
    j["total_token_throughput"] = m.total_token_throughput;
    j["max_output_tokens_per_s"] = m.peak_output_throughput;
    j["max_concurrent_requests"] = m.peak_concurrency;
    auto put = [&](const char* name, const MetricStats& st) {
        j[fmt::format("mean_{}_ms", name)] = st.mean;
        j[fmt::format("median_{}_ms", name)] = st.median;
        j[fmt::format("std_{}_ms", name)] = st.std;
        for (const auto& [p, v] : st.percentiles) j[fmt::format("p{:g}_{}_ms", p, name)] = v;
    };
    put("ttft", m.ttft_ms);
    put("tpot", m.tpot_ms);
    put("itl", m.itl_ms);
    put("e2el", m.e2el_ms);
    Json reqs = Json::array();
    for (const RequestRecord& rec : r.records) {
        reqs.push_back(
            {{"success", rec.success},
             {"error", rec.error},
             {"start_s", rec.start},
             {"prompt_tokens", rec.prompt_tokens},
             {"output_tokens", rec.output_tokens},
             {"cached_tokens", rec.cached_tokens >= 0 ? Json(rec.cached_tokens) : Json()},
             {"ttft_s", rec.ttft},
             {"latency_s", rec.latency},
             {"itl_s", rec.itl}});
    }
    j["requests"] = reqs;
    std::string tmp = path + ".tmp";
    {
        std::ofstream f(tmp);
        if (!f) return UnavailableError(fmt::format("--save-result {}: cannot write", path));
        f << j.dump(1);
        if (!f) return UnavailableError(fmt::format("--save-result {}: write failed", path));
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        return UnavailableError(fmt::format("--save-result {}: {}", path, std::strerror(errno)));
    }
    return Status::Ok();
}

}  // namespace ferry::bench
