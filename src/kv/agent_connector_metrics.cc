// The connector's counters and their Prometheus text.
#include "core/prometheus.h"
#include "kv/agent_connector_parts.h"
#include "kv/pull_protocol.h"
#include "kv/push_protocol.h"

namespace ferry::kv {

using namespace connector_parts;  // NOLINT(build/namespaces): the connector's own parts

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
    m.push->Count(&s.bootstrapping, &s.transferring);
    s.holding = m.pull->holding();
    return s;
}

std::string RenderKvConnectorMetrics(const KvConnectorStats& s) {
    PrometheusWriter w;
    w.Family("ferry_kv_connector_requests", "gauge", "Requests in each KV transfer state.");
    for (auto [state, n] : {std::pair{"bootstrapping", s.bootstrapping},
                            {"waiting_for_input", s.waiting_for_input},
                            {"transferring", s.transferring},
                            {"holding", s.holding}}) {
        w.Sample("ferry_kv_connector_requests", {{"state", state}}, n);
    }
    w.Counter("ferry_kv_connector_succeeded_total", "KV transfers that completed.",
              double(s.succeeded));
    w.Family("ferry_kv_connector_failed_total", "counter", "KV transfers that failed, by reason.");
    for (const auto& [reason, n] : s.failures) {
        w.Sample("ferry_kv_connector_failed_total", {{"reason", reason}}, double(n));
    }
    w.Counter("ferry_kv_connector_bytes_read_total", "KV bytes READ from other workers.",
              double(s.bytes_read));
    w.Counter("ferry_kv_connector_bytes_written_total", "KV bytes WRITTEN to other workers.",
              double(s.bytes_written));
    w.Counter("ferry_kv_connector_transfers_total", "READs and WRITEs posted.",
              double(s.transfers));
    w.Counter("ferry_kv_connector_descriptors_total", "Local descriptors over all transfers.",
              double(s.descriptors));
    w.Gauge("ferry_kv_connector_descriptors_max", "Most descriptors in one transfer.",
            double(s.max_descriptors));
    w.Counter("ferry_kv_connector_handshakes_total", "Peer handshakes completed.",
              double(s.handshakes));
    w.Counter("ferry_kv_connector_hold_renewals_sent_total",
              "pull, decode side: renewals of holds whose requests wait to claim them.",
              double(s.holds_renewals_sent));
    w.Counter("ferry_kv_connector_holds_renewed_total",
              "pull, prefill side: renewals granted to the decoders of held requests.",
              double(s.holds_renewed));
    w.Counter("ferry_kv_connector_push_renewals_sent_total",
              "push, prefill side: push-alive messages to the decoders of bound requests.",
              double(s.push_renewals_sent));
    w.Counter("ferry_kv_connector_pushes_renewed_total",
              "push, decode side: waits for a prefill worker's writes extended by its push-alive.",
              double(s.pushes_renewed));
    w.Counter("ferry_kv_connector_messages_refused_total",
              "Peer messages refused after the handshake (each logged with its reason).",
              double(s.messages_refused));
    w.Counter("ferry_kv_connector_verified_total",
              "Received KV whose checksums were compared with the sender's (--kv-verify).",
              double(s.verified));
    w.Counter("ferry_kv_connector_verify_mismatches_total",
              "Received KV whose checksums differed from the sender's (the request failed).",
              double(s.verify_mismatches));
    w.Counter("ferry_kv_connector_verify_units_total",
              "Units (a layer's K or V of one kv head) checksummed on receipt.",
              double(s.verify_units));
    w.Counter("ferry_kv_connector_verify_seconds_total",
              "Time spent computing --kv-verify checksums (received KV, and KV sent).",
              s.verify_seconds);
    w.Counter("ferry_kv_connector_canaries_total", "Peers' handshake canaries checked.",
              double(s.canaries));
    w.Counter("ferry_kv_connector_canary_failures_total",
              "Peers' handshake canaries that arrived wrong (the peer was refused).",
              double(s.canary_failures));
    w.Counter("ferry_kv_connector_transfer_exposed_seconds_sum",
              "push: transfer time after the prefill's compute ended (not hidden by it).",
              s.transfer_exposed_seconds_sum);
    w.Counter("ferry_kv_connector_transfer_exposed_seconds_count", "push: requests timed so.",
              double(s.transfer_exposed_count));
    w.Histogram("ferry_kv_connector_transfer_seconds", "KV transfer time per request.",
                kTransferSecondsBuckets, s.transfer_seconds_buckets, s.transfer_seconds_sum,
                s.transfer_seconds_count);
    return w.Take();
}

std::string AgentKvConnector::RenderMetrics() const { return RenderKvConnectorMetrics(Stats()); }

}  // namespace ferry::kv
