// The worker's /metrics: the engine's counters, the connector's, the HTTP layer's and the
// latencies clients saw.
#include "serve/image_pipeline.h"
#include "serve/openai_server_parts.h"
#include "serve/remote_prefill.h"

namespace ferry::serve {

using namespace server_parts;  // NOLINT(build/namespaces): the server's own parts

std::string OpenAiServer::Impl::RenderMetrics() {
    engine::EngineStats s = engine->Stats();
    PrometheusWriter w;
    auto gauge = [&](const char* name, const char* help, double v) { w.Gauge(name, help, v); };
    auto counter = [&](const char* name, const char* help, double v) { w.Counter(name, help, v); };
    gauge("ferry_num_requests_running", "Requests in the running batch.", s.running);
    gauge("ferry_num_requests_waiting", "Requests waiting to be scheduled.", s.waiting);
    gauge("ferry_kv_blocks_total", "KV cache blocks.", s.kv_blocks_total);
    gauge("ferry_kv_blocks_used", "KV cache blocks in use.", s.kv_blocks_used);
    gauge("ferry_kv_blocks_free", "KV cache blocks free (cached or empty).",
          s.kv_blocks_total - s.kv_blocks_used);
    gauge("ferry_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.",
          s.kv_blocks_total ? double(s.kv_blocks_used) / s.kv_blocks_total : 0.0);
    counter("ferry_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
            double(s.prefix_query_tokens));
    counter("ferry_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
            double(s.prefix_hit_tokens));
    gauge("ferry_prefix_cache_hit_rate", "Prefix cache hits / queries (tokens) since start.",
          s.prefix_query_tokens ? double(s.prefix_hit_tokens) / s.prefix_query_tokens : 0.0);
    counter("ferry_prompt_tokens_total", "Prompt tokens computed (prefix hits excluded).",
            double(s.prompt_tokens));
    counter("ferry_generation_tokens_total", "Tokens generated.", double(s.generation_tokens));
    counter("ferry_num_preemptions_total", "Sequences preempted (recomputed later).",
            double(s.preemptions));
    counter("ferry_engine_steps_total", "Engine steps run.", double(s.steps));
    gauge("ferry_kv_requests_parked", "Requests waiting for a decoder's block ids (push).",
          s.kv_parked);
    gauge("ferry_kv_requests_loading", "Requests holding blocks while their KV arrives.",
          s.kv_loading);
    gauge("ferry_kv_requests_held", "Finished requests whose blocks a remote worker still uses.",
          s.kv_held);
    counter("ferry_kv_external_tokens_total", "Prompt tokens whose KV came from another worker.",
            double(s.kv_external_tokens));
    counter("ferry_kv_load_failures_total", "Requests whose remote KV did not arrive.",
            double(s.kv_load_failures));
    counter("ferry_kv_load_recomputed_total",
            "Of those, requests that computed their prompt here (--kv-load-failure recompute).",
            double(s.kv_load_recomputed));
    // The same figures under the names routers scrape from vLLM workers (llm-d's scorers, vLLM's
    // router, Dynamo; labelled as vLLM's V1 engine labels them), so that they route over ferry
    // workers unchanged; ferry's router reads them too (router/membership.h).
    {
        const PrometheusWriter::Labels labels = {{"model_name", model_name}, {"engine", "0"}};
        auto vllm = [&](const char* name, const char* type, const char* help, double v) {
            w.Family(name, type, help);
            w.Sample(name, labels, v);
        };
        vllm("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
             s.running);
        vllm("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
             s.waiting);
        vllm("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             s.kv_blocks_total ? double(s.kv_blocks_used) / s.kv_blocks_total : 0.0);
        vllm("vllm:prefix_cache_queries_total", "counter",
             "Prefix cache queries, in terms of number of queried tokens.",
             double(s.prefix_query_tokens));
        vllm("vllm:prefix_cache_hits_total", "counter",
             "Prefix cache hits, in terms of number of cached tokens.",
             double(s.prefix_hit_tokens));
    }
    static const ImageMetrics kNoImages;
    const ImageMetrics& image_metrics = images ? images->metrics() : kNoImages;
    if (images) {
        const media::EncoderCacheStats ec = images->cache().Stats();
        const ImageMetrics& im = image_metrics;
        counter("ferry_mm_images_total", "Images read and decoded.", double(im.images.load()));
        counter("ferry_mm_images_encoded_total", "Images run through the vision encoder.",
                double(im.encoded.load()));
        counter("ferry_mm_requests_dropped_total",
                "Requests with images dropped unfinished: their client had gone.",
                double(im.dropped.load()));
        counter("ferry_mm_requests_refused_total", "Requests refused for one of their images.",
                double(im.refused.load()));
        counter("ferry_mm_requests_busy_total",
                "Requests with images refused (503): the encoder's queue was full.",
                double(im.busy.load()));
        counter("ferry_mm_decode_seconds_total", "Time reading and decoding images.",
                double(im.decode_micros.load()) / 1e6);
        counter("ferry_mm_encode_seconds_total", "Time in the vision encoder.",
                double(im.encode_micros.load()) / 1e6);
        gauge("ferry_mm_requests_waiting", "Requests with images waiting for the encoder.",
              double(images->waiting()));
        // Per tier (memory; disk with --encoder-cache-dir): a miss is one in both.
        auto tiers = [&](const char* name, const char* type, const char* help, double memory,
                         double disk) {
            w.Family(name, type, help);
            w.Sample(name, {{"tier", "memory"}}, memory);
            if (!config.encoder_cache_dir.empty()) w.Sample(name, {{"tier", "disk"}}, disk);
        };
        tiers("ferry_encoder_cache_hits_total", "counter",
              "Images whose embeddings the encoder cache held, by the tier they were found in.",
              double(ec.hits), double(ec.disk_hits));
        counter("ferry_encoder_cache_misses_total", "Images the encoder cache did not hold.",
                double(ec.misses));
        tiers("ferry_encoder_cache_evictions_total", "counter",
              "Encoder cache entries evicted (least recently used first): from memory (to disk "
              "with a disk tier), from disk (removed).",
              double(ec.evictions), double(ec.disk_evictions));
        tiers("ferry_encoder_cache_entries", "gauge", "Images in the encoder cache.",
              double(ec.entries), double(ec.disk_entries));
        tiers("ferry_encoder_cache_bytes", "gauge",
              "Bytes of embeddings in the encoder cache (on disk: its files).", double(ec.bytes),
              double(ec.disk_bytes));
        tiers("ferry_encoder_cache_capacity_bytes", "gauge", "The encoder cache's capacity.",
              double(ec.capacity_bytes), double(ec.disk_capacity_bytes));
        if (!config.encoder_cache_dir.empty()) {
            counter("ferry_encoder_cache_disk_read_seconds_total",
                    "Time reading the disk tier's hits back (checks included).",
                    double(ec.disk_read_micros) / 1e6);
            counter("ferry_encoder_cache_disk_writes_total",
                    "Files written to the disk tier for entries evicted from memory.",
                    double(ec.disk_writes));
            counter("ferry_encoder_cache_disk_write_errors_total",
                    "Entries evicted from memory that could not be written to disk (lost).",
                    double(ec.disk_write_errors));
            counter("ferry_encoder_cache_disk_bad_files_total",
                    "Disk-tier files that failed a check when read (torn, corrupt, another "
                    "encoder's): removed, a miss.",
                    double(ec.disk_bad_files));
        }
    }
    if (config.ec_connector) {
        // EPD (serve/ec_connector.h): the producer's published entries and leases, the
        // consumer's loads.
        const EcConnectorStats s = config.ec_connector->Stats();
        counter("ferry_ec_saved_total", "Encode role: image embeddings published for consumers.",
                double(s.saved));
        counter("ferry_ec_save_refused_total",
                "Encode role: requests refused (503): every slot was leased.",
                double(s.save_refused));
        counter("ferry_ec_leases_released_total",
                "Encode role: consumers' releases of their leases (after a pull, or cached there).",
                double(s.released));
        counter("ferry_ec_leases_lapsed_total", "Encode role: leases that ran out unpulled.",
                double(s.lapsed));
        counter("ferry_ec_leases_renewed_total",
                "Encode role: leases set anew by the renewal of a consumer whose request waits "
                "to load them.",
                double(s.renewed));
        counter("ferry_ec_lease_renewals_sent_total",
                "Renewals sent for the entries of requests waiting here to load them.",
                double(s.renewals_sent));
        gauge("ferry_ec_leased", "Encode role: entries leased to consumers now.", double(s.leased));
        gauge("ferry_ec_entries", "Encode role: entries published now.", double(s.entries));
        gauge("ferry_ec_slots", "Encode role: slots of the transfer buffer.", double(s.slots));
        counter("ferry_ec_loads_total", "Image embeddings loaded from an encode worker.",
                double(s.loads));
        counter("ferry_ec_loads_by_hash_total",
                "Of the loads, those found by the image's hash with no encode worker named "
                "(vLLM's EPD proxy: asked of the deployment's encode workers).",
                double(s.found_by_hash));
        counter("ferry_ec_load_misses_total", "Images the encoder-cache connector did not have.",
                double(s.load_misses));
        counter("ferry_ec_load_failures_total",
                "Loads that failed (encode worker unreachable, a bad entry, a timeout).",
                double(s.load_failures));
        counter("ferry_ec_load_foreign_total",
                "Loads refused: another vision encoder computed the embeddings (also failures).",
                double(s.load_foreign));
        counter("ferry_ec_load_bytes_total", "Bytes of embeddings loaded.", double(s.load_bytes));
        counter("ferry_ec_released_unpulled_total",
                "Encode workers' leases ended without a pull: the image was cached here.",
                double(s.released_unpulled));
        counter("ferry_ec_load_seconds_total", "Time loading embeddings (pull latency).",
                double(s.load_micros) / 1e6);
        counter("ferry_ec_encoder_calls_total",
                "--encoder-urls: requests whose images an encode worker took.",
                double(image_metrics.encoder_calls.load()));
        counter("ferry_ec_encoder_call_failures_total",
                "--encoder-urls: calls to an encode worker that failed (encoded here).",
                double(image_metrics.encoder_call_failures.load()));
        counter("ferry_ec_local_encodes_total",
                "Images encoded here because the connector could not load them.",
                double(image_metrics.ec_fallbacks.load()));
    }
    if (config.extra_metrics) w.Append(config.extra_metrics());
    // Decode-first: the prefill workers this decoder routes to, as a proxy reports them.
    if (std::string workers = remote_prefill->RenderMetrics(); !workers.empty()) {
        w.Append(workers);
    }
    if (http::Server* server = http_ready.load()) {
        http::ServerStats hs = server->Stats();
        gauge("ferry_http_connections_open", "Open HTTP connections.", double(hs.connections_open));
        counter("ferry_http_requests_total", "HTTP requests read.", double(hs.requests));
        gauge("ferry_http_inflight_body_bytes",
              "Request bodies held now (and the image copies of those waiting), of the budget.",
              double(hs.inflight_body_bytes));
        counter("ferry_http_busy_total", "Requests refused (503): the body budget was spent.",
                double(hs.busy));
        counter("ferry_http_timed_out_total",
                "Connections closed for not sending a whole request in time.",
                double(hs.timed_out));
    }
    std::lock_guard lock(metrics.mu);
    int64_t now_s =
        std::chrono::duration_cast<std::chrono::seconds>(Clock::now().time_since_epoch()).count();
    gauge("ferry_generation_tokens_per_second", "Tokens generated per second over the last 10 s.",
          metrics.TokensPerSecond(now_s));
    w.Family("ferry_request_success_total", "counter", "Finished requests by finish reason.");
    for (const char* r : {"stop", "length", "abort", "error"}) {
        w.Sample("ferry_request_success_total", {{"finished_reason", r}},
                 double(metrics.finished[r]));
    }
    counter("ferry_request_bad_total", "Requests refused with HTTP 400.",
            double(metrics.bad_requests));
    metrics.ttft.Render("ferry_time_to_first_token_seconds", "Time to first token.", &w);
    metrics.itl.Render("ferry_inter_token_latency_seconds", "Time between output tokens.", &w);
    metrics.e2e.Render("ferry_e2e_request_latency_seconds", "Request latency, end to end.", &w);
    return w.Take();
}

}  // namespace ferry::serve
