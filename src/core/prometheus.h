// Prometheus text exposition (format 0.0.4), written in one place for every /metrics ferry serves
// (worker, engine, KV connector, proxy, router): each family once with its HELP and TYPE, label
// values escaped, histograms with cumulative buckets and +Inf.
#pragma once

#include <fmt/core.h>

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace ferry {

class PrometheusWriter {
  public:
    using Labels = std::initializer_list<std::pair<std::string_view, std::string_view>>;

    // A family of one unlabelled sample.
    void Gauge(std::string_view name, std::string_view help, double value) {
        Family(name, "gauge", help);
        Sample(name, {}, value);
    }
    void Counter(std::string_view name, std::string_view help, double value) {
        Family(name, "counter", help);
        Sample(name, {}, value);
    }
    // A family's HELP and TYPE; its samples follow.
    void Family(std::string_view name, std::string_view type, std::string_view help) {
        out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    }
    void Sample(std::string_view name, Labels labels, double value) {
        out_ += name;
        if (labels.size() > 0) {
            out_ += '{';
            bool first = true;
            for (const auto& [k, v] : labels) {
                if (!first) out_ += ',';
                first = false;
                out_ += k;
                out_ += "=\"";
                AppendEscaped(v);
                out_ += '"';
            }
            out_ += '}';
        }
        out_ += fmt::format(" {}\n", value);
    }
    // A histogram: `cumulative[i]` observations <= bounds[i] (missing ones count as the last
    // given), `count` in all (the +Inf bucket), their `sum`.
    void Histogram(std::string_view name, std::string_view help, std::span<const double> bounds,
                   std::span<const uint64_t> cumulative, double sum, uint64_t count) {
        Family(name, "histogram", help);
        const std::string bucket = std::string(name) + "_bucket";
        uint64_t last = 0;
        for (size_t i = 0; i < bounds.size(); ++i) {
            if (i < cumulative.size()) last = cumulative[i];
            Sample(bucket, {{"le", fmt::format("{}", bounds[i])}}, double(last));
        }
        Sample(bucket, {{"le", "+Inf"}}, double(count));
        Sample(std::string(name) + "_sum", {}, sum);
        Sample(std::string(name) + "_count", {}, double(count));
    }
    // Text already in the format (another writer's).
    void Append(std::string_view text) { out_ += text; }
    const std::string& text() const { return out_; }
    std::string Take() {
        std::string text = std::move(out_);
        out_.clear();
        return text;
    }

  private:
    void AppendEscaped(std::string_view v) {
        for (char c : v) {
            if (c == '\\' || c == '"') {
                out_ += '\\';
                out_ += c;
            } else if (c == '\n') {
                out_ += "\\n";
            } else {
                out_ += c;
            }
        }
    }
    std::string out_;
};

}  // namespace ferry
