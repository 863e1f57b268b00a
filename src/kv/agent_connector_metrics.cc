// The connector's counters and their Prometheus text.
#include "kv/agent_connector_parts.h"

namespace ferry::kv {

void AgentKvConnector::Impl::CountFailure(const Status& s, const std::string& reason) {
    ++stats.failed;
    ++stats.failures[reason.empty() ? std::string(CodeName(s.code())) : reason];
}

void AgentKvConnector::Impl::RecordTime(SteadyClock::time_point started) {
    double sec = std::chrono::duration<double>(SteadyClock::now() - started).count();
    ++stats.transfer_seconds_count;
    stats.transfer_seconds_sum += sec;
    size_t i = 0;
    while (i < std::size(kTransferSecondsBuckets) && sec > kTransferSecondsBuckets[i]) ++i;
    for (size_t k = i; k < stats.transfer_seconds_buckets.size(); ++k) {
        ++stats.transfer_seconds_buckets[k];
    }
}

void AgentKvConnector::Impl::CountPosted(size_t descriptors) {
    ++stats.transfers;
    stats.descriptors += descriptors;
    stats.max_descriptors = std::max<uint64_t>(stats.max_descriptors, descriptors);
}

KvConnectorStats AgentKvConnector::Stats() const {
    Impl& m = *impl_;
    std::lock_guard lock(m.mu);
    KvConnectorStats s = m.stats;
    for (auto& [id, ld] : m.loads) {
        switch (ld.state) {
            case Load::State::kBootstrapping:
                ++s.bootstrapping;
                break;
            case Load::State::kWaitingForInput:
                ++s.waiting_for_input;
                break;
            case Load::State::kTransferring:
            case Load::State::kCancelling:
                ++s.transferring;
                break;
        }
    }
    for (auto& [id, ps] : m.pushes) {
        (ps.state == Push::State::kBootstrapping ? s.bootstrapping : s.transferring)++;
    }
    s.holding = static_cast<int>(m.holds.size());
    return s;
}

std::string RenderKvConnectorMetrics(const KvConnectorStats& s) {
    std::string out;
    out +=
        "# HELP ferry_kv_connector_requests Requests in each KV transfer state.\n"
        "# TYPE ferry_kv_connector_requests gauge\n";
    for (auto [state, n] : {std::pair{"bootstrapping", s.bootstrapping},
                            {"waiting_for_input", s.waiting_for_input},
                            {"transferring", s.transferring},
                            {"holding", s.holding}}) {
        out += fmt::format("ferry_kv_connector_requests{{state=\"{}\"}} {}\n", state, n);
    }
    auto counter = [&](const char* name, const char* help, double v) {
        out += fmt::format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, v);
    };
    counter("ferry_kv_connector_succeeded_total", "KV transfers that completed.",
            double(s.succeeded));
    out +=
        "# HELP ferry_kv_connector_failed_total KV transfers that failed, by reason.\n"
        "# TYPE ferry_kv_connector_failed_total counter\n";
    for (const auto& [reason, n] : s.failures) {
        out += fmt::format("ferry_kv_connector_failed_total{{reason=\"{}\"}} {}\n", reason, n);
    }
    counter("ferry_kv_connector_bytes_read_total", "KV bytes READ from other workers.",
            double(s.bytes_read));
    counter("ferry_kv_connector_bytes_written_total", "KV bytes WRITTEN to other workers.",
            double(s.bytes_written));
    counter("ferry_kv_connector_transfers_total", "READs and WRITEs posted.", double(s.transfers));
    counter("ferry_kv_connector_descriptors_total", "Local descriptors over all transfers.",
            double(s.descriptors));
    out += fmt::format(
        "# HELP ferry_kv_connector_descriptors_max Most descriptors in one transfer.\n"
        "# TYPE ferry_kv_connector_descriptors_max gauge\nferry_kv_connector_descriptors_max "
        "{}\n",
        s.max_descriptors);
    counter("ferry_kv_connector_handshakes_total", "Peer handshakes completed.",
            double(s.handshakes));
    counter("ferry_kv_connector_transfer_exposed_seconds_sum",
            "push: transfer time after the prefill's compute ended (not hidden by it).",
            s.transfer_exposed_seconds_sum);
    counter("ferry_kv_connector_transfer_exposed_seconds_count", "push: requests timed so.",
            double(s.transfer_exposed_count));
    out +=
        "# HELP ferry_kv_connector_transfer_seconds KV transfer time per request.\n"
        "# TYPE ferry_kv_connector_transfer_seconds histogram\n";
    for (size_t i = 0; i < std::size(kTransferSecondsBuckets); ++i) {
        out +=
            fmt::format("ferry_kv_connector_transfer_seconds_bucket{{le=\"{}\"}} {}\n",
                        kTransferSecondsBuckets[i],
                        i < s.transfer_seconds_buckets.size() ? s.transfer_seconds_buckets[i] : 0);
    }
    out += fmt::format(
        "ferry_kv_connector_transfer_seconds_bucket{{le=\"+Inf\"}} {}\n"
        "ferry_kv_connector_transfer_seconds_sum {}\nferry_kv_connector_transfer_seconds_count "
        "{}\n",
        s.transfer_seconds_count, s.transfer_seconds_sum, s.transfer_seconds_count);
    return out;
}

std::string AgentKvConnector::RenderMetrics() const { return RenderKvConnectorMetrics(Stats()); }

}  // namespace ferry::kv
