// The serving benchmark's metrics on hand-made timelines with known answers, its datasets and
// arrivals by seed, and its charts.
#include "bench/serve_bench.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "bench/datasets.h"
#include "bench/plot.h"
#include "bench/serve_metrics.h"
#include "media/image.h"
#include "model/model.h"
#include "testing/testing.h"
#include "tokenizer/tokenizer.h"

namespace ferry::bench {
namespace {

using ::ferry::testing::StatusHas;
using ::testing::HasSubstr;

RequestRecord Req(double start, double ttft, std::vector<double> gaps, int prompt) {
    RequestRecord r;
    r.success = true;
    r.start = start;
    r.ttft = ttft;
    r.itl = gaps;
    r.prompt_tokens = prompt;
    r.output_tokens = static_cast<int>(gaps.size()) + 1;
    double t = start + ttft;
    r.chunk_times.push_back(t);
    for (double g : gaps) r.chunk_times.push_back(t += g);
    r.latency = t - start;
    return r;
}

TEST(ServeMetrics, KnownTimelines) {
    // A: starts at 0, first token at 0.1 s, then 3 tokens 0.05 s apart: E2E 0.25, TPOT 0.05.
    // B: starts at 0.2, first token at 0.3 s (0.5 s absolute), one more 0.2 s later: E2E 0.5,
    //    TPOT 0.2.
    // C: failed.
    std::vector<RequestRecord> recs = {Req(0, 0.1, {0.05, 0.05, 0.05}, 10),
                                       Req(0.2, 0.3, {0.2}, 20)};
    RequestRecord failed;
    failed.error = "HTTP 400: nope";
    recs.push_back(failed);
    ServeMetrics m = ComputeServeMetrics(recs, 2.0, {50, 90, 99}, {});
    EXPECT_EQ(m.completed, 2);
    EXPECT_EQ(m.failed, 1);
    EXPECT_EQ(m.total_input, 30);
    EXPECT_EQ(m.total_output, 6);
    EXPECT_DOUBLE_EQ(m.request_throughput, 1.0);
    EXPECT_DOUBLE_EQ(m.output_throughput, 3.0);
    EXPECT_DOUBLE_EQ(m.total_token_throughput, 18.0);
    EXPECT_NEAR(m.ttft_ms.mean, 200, 1e-9);
    EXPECT_NEAR(m.ttft_ms.median, 200, 1e-9);
    EXPECT_NEAR(m.ttft_ms.std, 100, 1e-9);
    EXPECT_NEAR(m.tpot_ms.mean, 125, 1e-9);  // (50 + 200) / 2
    // ITL pooled: 50, 50, 50, 200 -> mean 87.5, median 50, P90 by linear interpolation:
    // rank 0.9 * 3 = 2.7 -> 50 + 0.7 * 150 = 155.
    EXPECT_NEAR(m.itl_ms.mean, 87.5, 1e-9);
    EXPECT_NEAR(m.itl_ms.median, 50, 1e-9);
    EXPECT_NEAR(m.itl_ms.percentiles[1].second, 155, 1e-9);
    EXPECT_NEAR(m.e2el_ms.mean, 375, 1e-9);
    EXPECT_NEAR(m.e2el_ms.percentiles[2].second, 250 + 0.99 * 250, 1e-9);
    // A runs over [0, 0.25], B over [0.2, 0.7]: both in flight at 0.2..0.25.
    EXPECT_EQ(m.peak_concurrency, 2);
    // Chunk arrivals all fall within the first second: 6 chunks.
    EXPECT_EQ(m.peak_output_throughput, 6);
    EXPECT_FALSE(m.request_goodput.has_value());
    // Goodput: TTFT <= 150 ms keeps A only; adding TPOT <= 100 still A.
    GoodputLimits g;
    g.ttft_ms = 150;
    g.tpot_ms = 100;
    EXPECT_DOUBLE_EQ(*ComputeServeMetrics(recs, 2.0, {99}, g).request_goodput, 0.5);
}

TEST(ServeMetrics, PrefixHitRateCountsOnlyAnswersThatReportedCachedTokens) {
    std::vector<RequestRecord> recs = {Req(0, 0.1, {0.05}, 100), Req(0.2, 0.3, {0.2}, 50),
                                       Req(0.3, 0.1, {}, 1000)};
    ServeMetrics none = ComputeServeMetrics(recs, 1.0, {99}, {});
    EXPECT_FALSE(none.prefix_cache_hit_rate.has_value());
    recs[0].cached_tokens = 64;
    recs[1].cached_tokens = 0;  // reported, none cached; recs[2] reported nothing
    ServeMetrics m = ComputeServeMetrics(recs, 1.0, {99}, {});
    EXPECT_EQ(m.total_cached, 64);
    ASSERT_TRUE(m.prefix_cache_hit_rate.has_value());
    EXPECT_DOUBLE_EQ(*m.prefix_cache_hit_rate, 64.0 / 150.0);
}

TEST(ServeMetrics, PercentileInterpolatesLikeNumpy) {
    EXPECT_DOUBLE_EQ(Percentile({1, 2, 3, 4}, 50), 2.5);
    EXPECT_DOUBLE_EQ(Percentile({10}, 99), 10);
    EXPECT_DOUBLE_EQ(Percentile({}, 99), 0);
    EXPECT_DOUBLE_EQ(Percentile({5, 1, 3}, 100), 5);
    EXPECT_DOUBLE_EQ(Percentile({0, 10}, 99), 9.9);
}

TEST(ServeBenchDatasets, RandomIsReproducibleBySeed) {
    ServeBenchOptions o;
    o.num_prompts = 20;
    o.random_input_len = 100;
    o.random_output_len = 30;
    o.random_range_ratio = 0.5;
    o.random_prefix_len = 10;
    o.seed = 7;
    auto a = std::move(SampleDataset(o, nullptr)).value();
    auto b = std::move(SampleDataset(o, nullptr)).value();
    ASSERT_EQ(a.size(), 20u);
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].text, b[i].text);
        EXPECT_EQ(a[i].output_len, b[i].output_len);
        EXPECT_GE(a[i].prompt_len, 10 + 50);
        EXPECT_LE(a[i].prompt_len, 10 + 150);
        EXPECT_EQ(static_cast<int>(a[i].text.size()), a[i].prompt_len);
        EXPECT_GE(a[i].output_len, 15);
        EXPECT_LE(a[i].output_len, 45);
        EXPECT_EQ(a[i].text.substr(0, 10), a[0].text.substr(0, 10));  // the shared prefix
    }
    o.seed = 8;
    auto c = std::move(SampleDataset(o, nullptr)).value();
    EXPECT_NE(a[0].text, c[0].text);
}

TEST(ServeBenchDatasets, PrefixRepetitionGroupsPromptsByPrefixAsVllm) {
    ServeBenchOptions o;
    o.dataset_name = "prefix_repetition";
    o.num_prompts = 23;  // 4 prefixes: 5 prompts each, 3 dropped, as vLLM does
    o.prefix_repetition_prefix_len = 40;
    o.prefix_repetition_suffix_len = 12;
    o.prefix_repetition_num_prefixes = 4;
    o.prefix_repetition_output_len = 9;
    o.seed = 3;
    auto a = std::move(SampleDataset(o, nullptr)).value();
    ASSERT_EQ(a.size(), 20u);
    std::map<std::string, int> per_prefix;
    std::set<std::string> suffixes;
    for (const BenchPrompt& p : a) {
        ASSERT_EQ(p.text.size(), 52u);
        EXPECT_EQ(p.prompt_len, 52);
        EXPECT_EQ(p.output_len, 9);
        ++per_prefix[p.text.substr(0, 40)];
        suffixes.insert(p.text.substr(40));
    }
    ASSERT_EQ(per_prefix.size(), 4u);
    for (const auto& [prefix, n] : per_prefix) EXPECT_EQ(n, 5) << prefix;
    EXPECT_EQ(suffixes.size(), 20u);
    // Shuffled: the first five are not all one prefix's.
    std::set<std::string> first_five;
    for (int i = 0; i < 5; ++i) first_five.insert(a[i].text.substr(0, 40));
    EXPECT_GT(first_five.size(), 1u);
    auto b = std::move(SampleDataset(o, nullptr)).value();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].text, b[i].text);
    o.prefix_repetition_num_prefixes = 30;  // more prefixes than prompts
    auto bad = SampleDataset(o, nullptr);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("--prefix-repetition-num-prefixes 30"), std::string::npos)
        << bad.status().message();
}

TEST(ServeBenchDatasets, WithATokenizerPromptsHaveTheirTokenCountAfterTheTrip) {
    std::string path = (std::filesystem::temp_directory_path() /
                        ("bench-tok-" + std::to_string(getpid()) + ".gguf"))
                           .string();
    model::RandomModelSpec spec;
    spec.dim = 32;
    spec.num_layers = 1;
    spec.num_heads = 2;
    spec.num_kv_heads = 1;
    spec.ffn_dim = 32;
    ASSERT_TRUE(model::WriteRandomModel(spec, 1, path).ok());
    auto file = std::move(gguf::GgufFile::Open(path)).value();
    auto tk = std::move(tokenizer::Tokenizer::FromGguf(*file)).value();
    ServeBenchOptions o;
    o.num_prompts = 30;
    o.random_input_len = 50;
    o.random_range_ratio = 0.2;
    auto sampled = SampleDataset(o, tk.get());
    ASSERT_TRUE(sampled.ok()) << sampled.status().ToString();
    for (const BenchPrompt& p : *sampled) {
        // What the server will count: the text as it arrives in JSON (valid UTF-8), encoded.
        nlohmann::json j = p.text;
        std::string received = nlohmann::json::parse(j.dump()).get<std::string>();
        EXPECT_EQ(received, p.text);
        EXPECT_EQ(static_cast<int>(tk->Encode(received, tk->add_bos()).size()), p.prompt_len);
        EXPECT_GE(p.prompt_len, 40);
        EXPECT_LE(p.prompt_len, 60);
    }
    std::remove(path.c_str());
}

TEST(ServeBenchDatasets, ShareGptFiltersAndSamples) {
    std::string path = (std::filesystem::temp_directory_path() /
                        ("sharegpt-" + std::to_string(getpid()) + ".json"))
                           .string();
    nlohmann::json data = nlohmann::json::array();
    for (int i = 0; i < 30; ++i) {
        data.push_back({{"id", i},
                        {"conversations",
                         {{{"from", "human"}, {"value", std::string(40 + i, 'q')}},
                          {{"from", "gpt"}, {"value", std::string(80, 'a')}}}}});
    }
    data.push_back({{"conversations", {{{"from", "human"}, {"value", "hi"}}}}});  // one turn
    data.push_back(
        {{"conversations",
          {{{"from", "human"}, {"value", "x"}}, {{"from", "gpt"}, {"value", "y"}}}}});  // too short
    std::ofstream(path) << data.dump();
    ServeBenchOptions o;
    o.dataset_name = "sharegpt";
    o.dataset_path = path;
    o.num_prompts = 10;
    o.seed = 3;
    auto a = std::move(SampleDataset(o, nullptr)).value();
    auto b = std::move(SampleDataset(o, nullptr)).value();
    ASSERT_EQ(a.size(), 10u);
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].text, b[i].text);
        EXPECT_EQ(a[i].output_len, 20);  // 80 bytes at 4 per token
        EXPECT_EQ(a[i].text[0], 'q');
    }
    std::ofstream(path) << "{\"not\": \"a list\"}";
    EXPECT_THAT(SampleDataset(o, nullptr).status(),
                StatusHas(Code::kInvalidArgument, "not a ShareGPT file"));
    std::remove(path.c_str());
    EXPECT_THAT(SampleDataset(o, nullptr).status(), StatusHas(Code::kNotFound, "cannot open"));
}

TEST(ServeBenchArrivals, PoissonMeanRateAndInfinity) {
    auto t = ArrivalTimes(20000, 50.0, 1.0, 1);
    EXPECT_EQ(t[0], 0);
    for (size_t i = 1; i < t.size(); ++i) EXPECT_GE(t[i], t[i - 1]);
    EXPECT_NEAR(t.back() / double(t.size() - 1), 1.0 / 50, 0.001);
    EXPECT_EQ(ArrivalTimes(5, 50.0, 1.0, 1), ArrivalTimes(5, 50.0, 1.0, 1));
    // Lower burstiness: same mean, larger spread of gaps.
    auto bursty = ArrivalTimes(20000, 50.0, 0.2, 1);
    EXPECT_NEAR(bursty.back() / double(bursty.size() - 1), 1.0 / 50, 0.002);
    auto sd = [](const std::vector<double>& v) {
        double mean = v.back() / double(v.size() - 1), ss = 0;
        for (size_t i = 1; i < v.size(); ++i) ss += std::pow(v[i] - v[i - 1] - mean, 2);
        return std::sqrt(ss / double(v.size() - 1));
    };
    EXPECT_GT(sd(bursty), 1.8 * sd(t));
    for (double x : ArrivalTimes(4, INFINITY, 1.0, 1)) EXPECT_EQ(x, 0);
}

TEST(ServeBenchImages, RandomPngIsAValidPng) {
    std::string png = RandomPng(8, 4, 1);
    ASSERT_GT(png.size(), 8u + 25 + 12);
    EXPECT_EQ(png.substr(0, 8), "\x89PNG\r\n\x1a\n");
    EXPECT_EQ(png.substr(12, 4), "IHDR");
    EXPECT_EQ(png.substr(png.size() - 8, 4), "IEND");
    auto image = media::DecodeImage(png, {});
    ASSERT_TRUE(image.ok()) << image.status().ToString();
    EXPECT_EQ(image->width, 8);
    EXPECT_EQ(image->height, 4);
    EXPECT_EQ(png, RandomPng(8, 4, 1));
    EXPECT_NE(png, RandomPng(8, 4, 2));
}

TEST(ServePlots, ChartsAreWrittenWithLabelsAndData) {
    const std::string dir =
        (std::filesystem::temp_directory_path() / ("plots-" + std::to_string(getpid()))).string();
    std::vector<std::string> files;
    int k = 0;
    for (const char* rate : {"2", "8", "inf"}) {
        nlohmann::json j;
        j["label"] = "colocated";
        j["request_rate"] =
            std::string(rate) == "inf" ? nlohmann::json("inf") : nlohmann::json(std::stod(rate));
        j["output_throughput"] = 100.0 * ++k;
        nlohmann::json reqs = nlohmann::json::array();
        for (int i = 0; i < 50; ++i) {
            reqs.push_back({{"success", true},
                            {"ttft_s", 0.01 * (i + k)},
                            {"latency_s", 1.0 + 0.01 * i},
                            {"output_tokens", 20},
                            {"itl_s", {0.01, 0.02, 0.03}}});
        }
        j["requests"] = reqs;
        std::string f = dir + "-in-" + rate + ".json";
        std::ofstream(f) << j.dump();
        files.push_back(f);
    }
    auto written = PlotServeResults(files, dir);
    ASSERT_TRUE(written.ok()) << written.status().ToString();
    EXPECT_EQ(written->size(), 5u);
    for (const std::string& f : *written) {
        std::ifstream in(f);
        std::string svg((std::istreambuf_iterator<char>(in)), {});
        EXPECT_THAT(svg, HasSubstr("<svg")) << f;
        EXPECT_THAT(svg, HasSubstr("</svg>")) << f;
        EXPECT_THAT(svg, HasSubstr("<polyline")) << f;
        EXPECT_THAT(svg, HasSubstr("colocated")) << f;  // legend
        EXPECT_GT(svg.size(), 1000u) << f;
    }
    std::ifstream in(dir + "/throughput_vs_rate.svg");
    std::string svg((std::istreambuf_iterator<char>(in)), {});
    EXPECT_THAT(svg, HasSubstr(">inf<"));
    EXPECT_THAT(svg, HasSubstr("request rate (req/s)"));
    EXPECT_THAT(svg, HasSubstr("output tokens/s"));
    size_t circles = 0;
    for (size_t at = svg.find("<circle"); at != std::string::npos;
         at = svg.find("<circle", at + 1)) {
        ++circles;
    }
    EXPECT_EQ(circles, 3u);  // one marker per rate
    std::filesystem::remove_all(dir);
    for (const std::string& f : files) std::remove(f.c_str());
    EXPECT_THAT(PlotServeResults({"/nonexistent.json"}, dir).status(),
                StatusHas(Code::kNotFound, "cannot open"));
}

}  // namespace
}  // namespace ferry::bench
