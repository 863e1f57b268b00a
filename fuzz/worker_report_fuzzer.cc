// What a router takes from its workers: the text of a worker's /metrics (vLLM's load gauges,
// router/membership.h), a worker's record in the discovery store, and a batch of its KV events
// (msgpack, schema/kv_events.h). The first byte picks which.
// A parsed load must be finite and non-negative with a KV usage in 0..1; a decoded record must
// have the bounds its decoder promises; neither may crash or read out of bounds.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "core/msgpack.h"
#include "discovery/worker_directory.h"
#include "router/kv_index.h"
#include "router/membership.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
    if (data[0] % 3 == 2) {
        size_t unknown = 0;
        auto events = ferry::schema::DecodeKvEventBatch(text, &unknown);
        if (events.ok()) {
            for (const auto& e : *events) {
                if (e.hashes.size() > text.size()) std::abort();  // 32 bytes each, at least
            }
        } else if (events.status().message().empty()) {
            std::abort();
        }
        ferry::MsgpackReader r(text);  // any value skips or fails, never overruns
        while (!r.done() && r.Skip().ok()) {
        }
        if (r.position() > text.size()) std::abort();
    } else if (data[0] % 3 == 0) {
        ferry::Result<ferry::router::ReportedLoad> l = ferry::router::ParseWorkerLoad(text);
        if (l.ok()) {
            for (double v : {l->waiting, l->running, l->kv_usage}) {
                if (!std::isfinite(v) || v < 0) std::abort();
            }
            if (l->kv_usage > 1) std::abort();
        } else if (l.status().message().empty()) {
            std::abort();
        }
    } else {
        ferry::Result<ferry::WorkerRecord> r = ferry::DecodeWorkerRecord(text);
        if (r.ok()) {
            if (r->tp_size < 1 || r->agent.port < 0 || r->agent.port > 65535) std::abort();
            if (r->url.size() > 300 || r->model.size() > 1024) std::abort();
        } else if (r.status().message().empty()) {
            std::abort();
        }
    }
    return 0;
}
