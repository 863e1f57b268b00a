#include "bench/datasets.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/utf8.h"
#include "media/image.h"
#include "tokenizer/tokenizer.h"

namespace ferry::bench {

using Json = nlohmann::json;

std::string RandomPng(int width, int height, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> rgb(size_t(width) * height * 3);
    for (uint8_t& b : rgb) b = static_cast<uint8_t>(rng() & 0xff);
    auto png = media::EncodePng(width, height, rgb);
    return png.ok() ? *png : std::string();
}

namespace {

bool IsPrintableUtf8(const std::string& s) {
    if (s.empty()) return false;
    for (size_t i = 0; i < s.size();) {
        auto c = static_cast<unsigned char>(s[i]);
        size_t n = Utf8SequenceLength(c);
        if (n == 0 || i + n > s.size()) return false;
        if (n == 1 && (c < 0x20 || c == 0x7f)) return false;
        for (size_t k = 1; k < n; ++k) {
            if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
        }
        i += n;
    }
    return true;
}

}  // namespace

std::vector<double> ArrivalTimes(int n, double rate, double burstiness, uint64_t seed) {
    std::vector<double> t(n, 0.0);
    if (!std::isfinite(rate) || rate <= 0) return t;
    std::mt19937_64 rng(seed ^ 0x5eed5eedull);
    std::gamma_distribution<double> gap(burstiness, 1.0 / (rate * burstiness));
    double now = 0;
    for (int i = 0; i < n; ++i) {
        t[i] = now;
        now += gap(rng);
    }
    return t;
}

Result<std::vector<BenchPrompt>> SampleDataset(const ServeBenchOptions& o,
                                               const tokenizer::Tokenizer* tk) {
    std::mt19937_64 rng(o.seed);
    std::vector<BenchPrompt> out;
    if (o.num_prompts <= 0) return InvalidArgumentError("--num-prompts must be positive");
    const bool prefix_repetition = o.dataset_name == "prefix_repetition";
    if (o.dataset_name == "random" || o.dataset_name == "random-mm" || prefix_repetition) {
        if (prefix_repetition &&
            (o.prefix_repetition_prefix_len < 0 || o.prefix_repetition_suffix_len < 0 ||
             o.prefix_repetition_prefix_len + o.prefix_repetition_suffix_len < 1 ||
             o.prefix_repetition_output_len < 1 || o.prefix_repetition_num_prefixes < 1)) {
            return InvalidArgumentError(
                "--prefix-repetition-prefix-len and --prefix-repetition-suffix-len must be >= 0 "
                "(not both 0), --prefix-repetition-output-len and "
                "--prefix-repetition-num-prefixes >= 1");
        }
        if (prefix_repetition && o.num_prompts < o.prefix_repetition_num_prefixes) {
            return InvalidArgumentError(fmt::format(
                "--num-prompts {} is fewer than --prefix-repetition-num-prefixes {}: each prefix "
                "needs a prompt",
                o.num_prompts, o.prefix_repetition_num_prefixes));
        }
        if (!prefix_repetition &&
            (o.random_input_len < 1 || o.random_output_len < 1 || o.random_range_ratio < 0 ||
             o.random_range_ratio >= 1 || o.random_prefix_len < 0)) {
            return InvalidArgumentError(
                "--random-input-len and --random-output-len must be >= 1, "
                "--random-range-ratio in [0, 1), --random-prefix-len >= 0");
        }
        // Token ids whose text is whole printable UTF-8 on its own: control tokens decode to
        // nothing, and a lone byte of a multi-byte character would reach the server as U+FFFD
        // (JSON carries only valid UTF-8) and change the prompt's length.
        std::vector<int32_t> ids;
        if (tk) {
            for (int32_t i = 0; i < tk->vocab_size(); ++i) {
                if (!tk->IsControl(i) && IsPrintableUtf8(tk->TokenBytes(i))) ids.push_back(i);
            }
            if (ids.empty()) return InvalidArgumentError("the tokenizer has no text tokens");
        }
        static const char kAlphabet[] =
            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,";
        auto random_text = [&](int len) {
            std::string text;
            if (tk) {
                std::vector<int32_t> t;
                for (int i = 0; i < len; ++i) t.push_back(ids[rng() % ids.size()]);
                text = tk->Decode(t);
            } else {
                for (int i = 0; i < len; ++i)
                    text.push_back(kAlphabet[rng() % (sizeof(kAlphabet) - 1)]);
            }
            return text;
        };
        auto range = [&](int len) {
            int lo = std::max(1, static_cast<int>(len * (1 - o.random_range_ratio)));
            int hi = std::max(lo, static_cast<int>(len * (1 + o.random_range_ratio)));
            return lo + static_cast<int>(rng() % uint64_t(hi - lo + 1));
        };
        auto count = [&](const std::string& text, int untokenized) {
            return tk ? static_cast<int>(tk->Encode(text, tk->add_bos()).size()) : untokenized;
        };
        if (prefix_repetition) {
            // As vLLM: num_prompts / num_prefixes prompts per prefix (the rest dropped), then
            // shuffled so that a prefix's prompts arrive spread over the run.
            const int per_prefix = o.num_prompts / o.prefix_repetition_num_prefixes;
            const int len = o.prefix_repetition_prefix_len + o.prefix_repetition_suffix_len;
            for (int k = 0; k < o.prefix_repetition_num_prefixes; ++k) {
                std::string prefix = random_text(o.prefix_repetition_prefix_len);
                for (int i = 0; i < per_prefix; ++i) {
                    BenchPrompt p;
                    p.text = prefix + random_text(o.prefix_repetition_suffix_len);
                    p.prompt_len = count(p.text, len);
                    p.output_len = o.prefix_repetition_output_len;
                    out.push_back(std::move(p));
                }
            }
            std::shuffle(out.begin(), out.end(), rng);
            return out;
        }
        std::string prefix = random_text(o.random_prefix_len);
        for (int i = 0; i < o.num_prompts; ++i) {
            BenchPrompt p;
            int in = range(o.random_input_len);
            p.output_len = range(o.random_output_len);
            p.text = prefix + random_text(in);
            p.prompt_len = count(p.text, o.random_prefix_len + in);
            p.images = o.dataset_name == "random-mm" ? o.mm_images : 0;
            out.push_back(std::move(p));
        }
        return out;
    }
    if (o.dataset_name == "sharegpt") {
        if (o.dataset_path.empty()) return InvalidArgumentError("sharegpt needs --dataset-path");
        std::ifstream f(o.dataset_path);
        if (!f) return NotFoundError(fmt::format("--dataset-path {}: cannot open", o.dataset_path));
        std::stringstream ss;
        ss << f.rdbuf();
        Json data = Json::parse(ss.str(), nullptr, false);
        if (!data.is_array()) {
            return InvalidArgumentError(fmt::format(
                "{}: not a ShareGPT file (a JSON array of {{\"conversations\": [...]}})",
                o.dataset_path));
        }
        // Conversations with at least two turns: the first is the prompt, the second's length is
        // the output length (vLLM's filter: prompt >= 4 tokens, output >= 4, prompt <= 1024,
        // prompt + output <= 2048).
        std::vector<std::pair<std::string, std::string>> pairs;
        for (const Json& e : data) {
            if (!e.is_object() || !e.contains("conversations") || !e["conversations"].is_array() ||
                e["conversations"].size() < 2) {
                continue;
            }
            const Json& c = e["conversations"];
            if (!c[0].is_object() || !c[1].is_object() || !c[0].contains("value") ||
                !c[1].contains("value") || !c[0]["value"].is_string() ||
                !c[1]["value"].is_string()) {
                continue;
            }
            pairs.emplace_back(c[0]["value"].get<std::string>(), c[1]["value"].get<std::string>());
        }
        std::shuffle(pairs.begin(), pairs.end(), rng);
        auto count = [&](const std::string& s) {
            return tk ? static_cast<int>(tk->Encode(s, false).size())
                      : std::max(1, static_cast<int>(s.size() / 4));
        };
        for (const auto& [prompt, answer] : pairs) {
            if (static_cast<int>(out.size()) == o.num_prompts) break;
            BenchPrompt p;
            p.text = prompt;
            p.prompt_len = count(prompt);
            p.output_len = o.sharegpt_output_len > 0 ? o.sharegpt_output_len : count(answer);
            if (p.prompt_len < 4 || p.output_len < 4 || p.prompt_len > 1024 ||
                p.prompt_len + p.output_len > 2048) {
                continue;
            }
            out.push_back(std::move(p));
        }
        if (out.empty()) {
            return InvalidArgumentError(fmt::format("{}: no usable conversations", o.dataset_path));
        }
        return out;
    }
    return InvalidArgumentError(fmt::format(
        "--dataset-name '{}' is not one of random, sharegpt, random-mm, prefix_repetition",
        o.dataset_name));
}

}  // namespace ferry::bench
