// `ferry bench plot`: charts from `ferry bench serve --save-result` files, as SVG written here
// (no plotting dependency): TTFT and ITL CDFs for every run, and, given runs at several request
// rates, output throughput and p99 latencies against the rate, one line per run label.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "ferry/status.h"

namespace ferry::bench {

struct PlotSeries {
    std::string label;
    std::vector<std::pair<double, double>> points;
    bool markers = false;
};

struct PlotChart {
    std::string title;
    std::string x_label;
    std::string y_label;
    std::vector<PlotSeries> series;
    // Tick labels that replace the number at an x position (e.g. "inf").
    std::vector<std::pair<double, std::string>> x_names;
    bool x_from_zero = false;
};

// A complete SVG document (720 x 440).
std::string RenderSvg(const PlotChart& chart);

// Reads the result files and writes the charts into `out_dir`; returns the files written.
Result<std::vector<std::string>> PlotServeResults(const std::vector<std::string>& results,
                                                  const std::string& out_dir);

}  // namespace ferry::bench
