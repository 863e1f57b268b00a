#include "model/sampler.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>

namespace ferry::model {

Status SamplingParams::Validate() const {
    if (!(temperature >= 0) || temperature > 100) {
        return InvalidArgumentError(
            fmt::format("temperature {} must be between 0 and 100", temperature));
    }
    if (!(top_p > 0) || top_p > 1) {
        return InvalidArgumentError(fmt::format("top_p {} must be in (0, 1]", top_p));
    }
    if (max_tokens < 1) {
        return InvalidArgumentError(fmt::format("max_tokens {} must be at least 1", max_tokens));
    }
    if (logprobs > 20) {
        return InvalidArgumentError(fmt::format("logprobs {} must be at most 20", logprobs));
    }
    if (stop.size() > 16) return InvalidArgumentError("stop: at most 16 stop strings");
    for (const std::string& s : stop) {
        if (s.empty()) return InvalidArgumentError("stop: an empty stop string");
    }
    return Status::Ok();
}

Sampler::Sampler(const SamplingParams& params, uint64_t fallback_seed)
    : params_(params), rng_(params.seed.value_or(fallback_seed)) {}

void Sampler::Skip() {
    // Sample makes one uniform draw when it samples at all; the bounds do not change how much of
    // the stream a draw takes.
    if (params_.temperature >= 1e-5f) (void)std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
}

SampledToken Sampler::Sample(const float* logits, int vocab) {
    SampledToken out;
    float mx = logits[0];
    int32_t best = 0;
    for (int i = 1; i < vocab; ++i) {
        if (logits[i] > mx) {
            mx = logits[i];
            best = i;
        }
    }
    double sum = 0;
    for (int i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - mx);
    const double log_z = mx + std::log(sum);

    if (params_.temperature < 1e-5f) {
        out.token = best;
    } else {
        cand_.clear();
        cand_.reserve(vocab);
        for (int i = 0; i < vocab; ++i) cand_.emplace_back(logits[i], i);
        auto by_logit = [](const auto& a, const auto& b) {
            return a.first > b.first || (a.first == b.first && a.second < b.second);
        };
        size_t keep = cand_.size();
        if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < keep) {
            keep = params_.top_k;
            std::partial_sort(cand_.begin(), cand_.begin() + static_cast<std::ptrdiff_t>(keep),
                              cand_.end(), by_logit);
            cand_.resize(keep);
        } else if (params_.top_p < 1.0f) {
            std::sort(cand_.begin(), cand_.end(), by_logit);
        }
        std::vector<double> p(cand_.size());
        double total = 0;
        for (size_t i = 0; i < cand_.size(); ++i) {
            p[i] = std::exp((double(cand_[i].first) - mx) / params_.temperature);
            total += p[i];
        }
        if (params_.top_p < 1.0f) {  // candidates are sorted: keep the smallest prefix >= top_p
            double acc = 0;
            size_t n = 0;
            while (n < p.size()) {
                acc += p[n++] / total;
                if (acc >= params_.top_p) break;
            }
            p.resize(n);
            total = 0;
            for (double v : p) total += v;
        }
        double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
        size_t pick = p.size() - 1;
        for (size_t i = 0; i < p.size(); ++i) {
            if (u < p[i]) {
                pick = i;
                break;
            }
            u -= p[i];
        }
        out.token = cand_[pick].second;
    }
    out.logprob = static_cast<float>(logits[out.token] - log_z);
    if (params_.logprobs > 0) {
        std::vector<std::pair<float, int32_t>> top;
        top.reserve(vocab);
        for (int i = 0; i < vocab; ++i) top.emplace_back(logits[i], i);
        size_t n = std::min<size_t>(params_.logprobs, top.size());
        std::partial_sort(top.begin(), top.begin() + static_cast<std::ptrdiff_t>(n), top.end(),
                          [](const auto& a, const auto& b) {
                              return a.first > b.first ||
                                     (a.first == b.first && a.second < b.second);
                          });
        for (size_t i = 0; i < n; ++i) {
            out.top.emplace_back(top[i].second, static_cast<float>(top[i].first - log_z));
        }
    }
    return out;
}

}  // namespace ferry::model
