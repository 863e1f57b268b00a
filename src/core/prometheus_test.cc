#include "core/prometheus.h"

#include <gtest/gtest.h>

#include <vector>

namespace ferry {
namespace {

TEST(PrometheusWriter, WritesFamiliesSamplesAndHistogramsInTheTextFormat) {
    PrometheusWriter w;
    w.Counter("x_total", "Things.", 5);
    w.Gauge("y", "Ratio.", 0.25);
    w.Family("z", "gauge", "Labelled.");
    w.Sample("z", {{"role", "prefill"}, {"worker", "a\"b\\c\nd"}}, 3);
    const double bounds[] = {0.001, 0.5};
    const std::vector<uint64_t> cumulative = {1, 3};
    w.Histogram("h_seconds", "Time.", bounds, cumulative, 1.5, 4);
    EXPECT_EQ(w.text(),
              "# HELP x_total Things.\n# TYPE x_total counter\nx_total 5\n"
              "# HELP y Ratio.\n# TYPE y gauge\ny 0.25\n"
              "# HELP z Labelled.\n# TYPE z gauge\n"
              "z{role=\"prefill\",worker=\"a\\\"b\\\\c\\nd\"} 3\n"
              "# HELP h_seconds Time.\n# TYPE h_seconds histogram\n"
              "h_seconds_bucket{le=\"0.001\"} 1\nh_seconds_bucket{le=\"0.5\"} 3\n"
              "h_seconds_bucket{le=\"+Inf\"} 4\nh_seconds_sum 1.5\nh_seconds_count 4\n");
    EXPECT_EQ(w.Take().size() > 0, true);
    EXPECT_TRUE(w.text().empty());
}

}  // namespace
}  // namespace ferry
