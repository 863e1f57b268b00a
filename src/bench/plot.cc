#include "bench/plot.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench/serve_metrics.h"

namespace ferry::bench {

namespace {

using Json = nlohmann::json;

constexpr double kWidth = 720, kHeight = 440;
constexpr double kLeft = 80, kRight = 190, kTop = 40, kBottom = 60;
const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                               "#9467bd", "#8c564b", "#e377c2", "#17becf"};

std::string Escape(const std::string& s) {
    std::string out;
    for (char c : s) {
        switch (c) {
            case '&':
                out += "&amp;";
                break;
            case '<':
                out += "&lt;";
                break;
            case '>':
                out += "&gt;";
                break;
            case '"':
                out += "&quot;";
                break;
            default:
                out.push_back(c);
        }
    }
    return out;
}

// Tick positions: 1-2-5 steps giving about five intervals over [lo, hi].
std::vector<double> Ticks(double lo, double hi) {
    double span = hi - lo;
    if (!(span > 0)) span = std::abs(hi) > 0 ? std::abs(hi) : 1;
    double raw = span / 5;
    double mag = std::pow(10, std::floor(std::log10(raw)));
    double step = mag;
    for (double m : {1.0, 2.0, 5.0, 10.0}) {
        if (raw <= m * mag) {
            step = m * mag;
            break;
        }
    }
    std::vector<double> t;
    for (double v = std::ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
        t.push_back(std::abs(v) < step * 1e-9 ? 0 : v);
    }
    return t;
}

std::string Num(double v) {
    if (v == 0) return "0";
    double a = std::abs(v);
    if (a >= 10000 || a < 0.01) return fmt::format("{:.3g}", v);
    return fmt::format("{:g}", std::round(v * 1000) / 1000);
}

}  // namespace

std::string RenderSvg(const PlotChart& c) {
    double x0 = INFINITY, x1 = -INFINITY, y0 = 0, y1 = -INFINITY;
    for (const PlotSeries& s : c.series) {
        for (auto [x, y] : s.points) {
            x0 = std::min(x0, x);
            x1 = std::max(x1, x);
            y0 = std::min(y0, y);
            y1 = std::max(y1, y);
        }
    }
    if (!std::isfinite(x0)) x0 = 0, x1 = 1, y1 = 1;
    if (c.x_from_zero) x0 = std::min(x0, 0.0);
    if (x1 <= x0) x1 = x0 + 1;
    if (y1 <= y0) y1 = y0 + 1;
    std::vector<double> xt = Ticks(x0, x1), yt = Ticks(y0, y1 * 1.05);
    x0 = std::min(x0, xt.front());
    x1 = std::max(x1, xt.back());
    y1 = std::max(y1 * 1.05, yt.back());
    const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
    auto px = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * pw; };
    auto py = [&](double y) { return kTop + ph - (y - y0) / (y1 - y0) * ph; };

    std::string s = fmt::format(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 "
        "{0} {1}\" font-family=\"DejaVu Sans, Arial, sans-serif\">\n"
        "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
        kWidth, kHeight);
    s += fmt::format("<text x=\"{}\" y=\"24\" font-size=\"16\" text-anchor=\"middle\">{}</text>\n",
                     kLeft + pw / 2, Escape(c.title));
    // Grid and ticks.
    for (double v : xt) {
        std::string name = Num(v);
        for (const auto& [at, label] : c.x_names) {
            if (std::abs(at - v) < 1e-9 * std::max(1.0, std::abs(v))) name = label;
        }
        s += fmt::format(
            "<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#e5e5e5\"/>\n"
            "<text x=\"{0:.1f}\" y=\"{3}\" font-size=\"11\" text-anchor=\"middle\">{4}</text>\n",
            px(v), kTop, kTop + ph, kTop + ph + 16, Escape(name));
    }
    for (const auto& [at, label] : c.x_names) {  // named positions off the tick grid
        const double pos = at;                   // clang 14 cannot capture a structured binding
        bool on_tick = std::any_of(xt.begin(), xt.end(), [&](double v) {
            return std::abs(pos - v) < 1e-9 * std::max(1.0, std::abs(v));
        });
        if (!on_tick) {
            s += fmt::format(
                "<text x=\"{:.1f}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\" "
                "font-weight=\"bold\">{}</text>\n",
                px(at), kTop + ph + 30, Escape(label));
        }
    }
    for (double v : yt) {
        s += fmt::format(
            "<line x1=\"{1}\" y1=\"{0:.1f}\" x2=\"{2}\" y2=\"{0:.1f}\" stroke=\"#e5e5e5\"/>\n"
            "<text x=\"{3}\" y=\"{4:.1f}\" font-size=\"11\" text-anchor=\"end\">{5}</text>\n",
            py(v), kLeft, kLeft + pw, kLeft - 6, py(v) + 4, Num(v));
    }
    s += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" "
        "stroke=\"#333\"/>\n",
        kLeft, kTop, pw, ph);
    s += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"13\" text-anchor=\"middle\">{}</text>\n",
                     kLeft + pw / 2, kHeight - 12, Escape(c.x_label));
    s += fmt::format(
        "<text x=\"18\" y=\"{0}\" font-size=\"13\" text-anchor=\"middle\" "
        "transform=\"rotate(-90 18 {0})\">{1}</text>\n",
        kTop + ph / 2, Escape(c.y_label));
    // Series and legend.
    for (size_t i = 0; i < c.series.size(); ++i) {
        const PlotSeries& se = c.series[i];
        const char* color = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
        std::string pts;
        for (auto [x, y] : se.points) pts += fmt::format("{:.1f},{:.1f} ", px(x), py(y));
        s += fmt::format(
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>\n", color,
            pts);
        if (se.markers) {
            for (auto [x, y] : se.points) {
                s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"{}\"/>\n",
                                 px(x), py(y), color);
            }
        }
        double ly = kTop + 14 + 20 * double(i);
        s += fmt::format(
            "<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"{3}\" "
            "stroke-width=\"3\"/>\n<text x=\"{4}\" y=\"{5:.1f}\" font-size=\"12\">{6}</text>\n",
            kLeft + pw + 12, ly, kLeft + pw + 36, color, kLeft + pw + 42, ly + 4, Escape(se.label));
    }
    s += "</svg>\n";
    return s;
}

Result<std::vector<std::string>> PlotServeResults(const std::vector<std::string>& files,
                                                  const std::string& out_dir) {
    if (files.empty()) return InvalidArgumentError("no result files given");
    struct Run {
        std::string label;
        double rate = 0;  // INFINITY for "inf"
        std::vector<double> ttft_ms, itl_ms, tpot_ms;
        double output_throughput = 0;
    };
    std::vector<Run> runs;
    for (const std::string& path : files) {
        std::ifstream f(path);
        if (!f) return NotFoundError(fmt::format("{}: cannot open", path));
        std::stringstream ss;
        ss << f.rdbuf();
        Json j = Json::parse(ss.str(), nullptr, false);
        if (!j.is_object() || !j.contains("requests") || !j["requests"].is_array()) {
            return InvalidArgumentError(fmt::format(
                "{}: not a `ferry bench serve --save-result` file (no \"requests\" array)", path));
        }
        Run r;
        r.label = j.value("label", std::string());
        if (r.label.empty()) r.label = j.value("model_id", std::string("run"));
        const Json& rate = j["request_rate"];
        r.rate = rate.is_number() ? rate.get<double>() : INFINITY;
        r.output_throughput = j.value("output_throughput", 0.0);
        for (const Json& q : j["requests"]) {
            if (!q.is_object() || !q.value("success", false)) continue;
            double ttft = q.value("ttft_s", 0.0), lat = q.value("latency_s", 0.0);
            int out = q.value("output_tokens", 0);
            r.ttft_ms.push_back(ttft * 1e3);
            if (out > 1) r.tpot_ms.push_back((lat - ttft) / (out - 1) * 1e3);
            if (q.contains("itl_s") && q["itl_s"].is_array()) {
                for (const Json& g : q["itl_s"]) {
                    if (g.is_number()) r.itl_ms.push_back(g.get<double>() * 1e3);
                }
            }
        }
        runs.push_back(std::move(r));
    }
    std::error_code ec;
    std::filesystem::create_directories(out_dir, ec);
    if (ec) return UnavailableError(fmt::format("--out {}: {}", out_dir, ec.message()));
    std::vector<std::string> written;
    auto write = [&](const std::string& name, const PlotChart& chart) -> Status {
        std::string path = (std::filesystem::path(out_dir) / name).string();
        std::ofstream f(path);
        f << RenderSvg(chart);
        if (!f) return UnavailableError(fmt::format("{}: write failed", path));
        written.push_back(path);
        return Status::Ok();
    };
    auto run_name = [&](const Run& r) {
        std::string rate = std::isfinite(r.rate) ? fmt::format("{:g} req/s", r.rate) : "inf";
        return runs.size() == 1 ? r.label : fmt::format("{} @ {}", r.label, rate);
    };
    auto cdf = [&](const char* title, const char* axis, auto member) {
        PlotChart c{title, axis, "fraction of samples (CDF)", {}, {}, false};
        for (const Run& r : runs) {
            std::vector<double> v = r.*member;
            std::sort(v.begin(), v.end());
            PlotSeries s{run_name(r), {}, false};
            const size_t step = std::max<size_t>(1, v.size() / 400);  // keep files small
            for (size_t i = 0; i < v.size(); i += step) {
                s.points.emplace_back(v[i], double(i + 1) / double(v.size()));
            }
            if (!v.empty()) s.points.emplace_back(v.back(), 1.0);
            c.series.push_back(std::move(s));
        }
        return c;
    };
    FERRY_RETURN_IF_ERROR(
        write("ttft_cdf.svg", cdf("Time to first token", "TTFT (ms)", &Run::ttft_ms)));
    FERRY_RETURN_IF_ERROR(
        write("itl_cdf.svg", cdf("Inter-token latency", "ITL (ms)", &Run::itl_ms)));

    // Against the request rate, when there are several rates.
    std::map<double, int> rates;
    for (const Run& r : runs) ++rates[r.rate];
    if (rates.size() >= 2) {
        double max_finite = 0;
        for (const Run& r : runs) {
            if (std::isfinite(r.rate)) max_finite = std::max(max_finite, r.rate);
        }
        const double inf_at = max_finite > 0 ? max_finite * 1.5 : 1;
        auto x_of = [&](double rate) { return std::isfinite(rate) ? rate : inf_at; };
        std::vector<std::pair<double, std::string>> names;
        for (const auto& [rate, n] : rates) {
            if (!std::isfinite(rate)) names.emplace_back(inf_at, "inf");
        }
        std::map<std::string, std::vector<const Run*>> by_label;
        for (const Run& r : runs) by_label[r.label].push_back(&r);
        auto vs_rate = [&](const char* title, const char* y, auto value) {
            PlotChart c{title, "request rate (req/s)", y, {}, names, true};
            for (auto& [label, list] : by_label) {
                std::vector<const Run*> sorted = list;
                std::sort(sorted.begin(), sorted.end(), [&](const Run* a, const Run* b) {
                    return x_of(a->rate) < x_of(b->rate);
                });
                PlotSeries s{label, {}, true};
                for (const Run* r : sorted) s.points.emplace_back(x_of(r->rate), value(*r));
                c.series.push_back(std::move(s));
            }
            return c;
        };
        FERRY_RETURN_IF_ERROR(write("throughput_vs_rate.svg",
                                    vs_rate("Output token throughput", "output tokens/s",
                                            [](const Run& r) { return r.output_throughput; })));
        FERRY_RETURN_IF_ERROR(
            write("p99_ttft_vs_rate.svg",
                  vs_rate("P99 time to first token", "P99 TTFT (ms)",
                          [](const Run& r) { return Percentile(r.ttft_ms, 99); })));
        FERRY_RETURN_IF_ERROR(
            write("p99_tpot_vs_rate.svg",
                  vs_rate("P99 time per output token", "P99 TPOT (ms)",
                          [](const Run& r) { return Percentile(r.tpot_ms, 99); })));
    }
    return written;
}

}  // namespace ferry::bench
