// The inside of OpenAiServer (openai_server.h), shared by its files, one job each:
//
//   openai_server.cc    routes, authentication, the completions entry, start and stop
//   openai_dispatch.cc  a parsed request into the engine, its answer streamed or whole
//   image_pipeline.cc   the images of a request (ImagePipeline, image_pipeline.h)
//   remote_prefill.cc   decode-first: prompts sent to prefill workers (RemotePrefill,
//                       remote_prefill.h)
//   server_metrics.cc   /metrics
//
// Internal: included by those files only. The parts' types are in server_parts (the .cc files
// name them unqualified).
#pragma once

#include <fmt/core.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "core/crypto.h"
#include "core/log.h"
#include "core/prometheus.h"
#include "http/http.h"
#include "media/encoder_cache.h"
#include "router/protocol.h"
#include "router/quarantine.h"
#include "router/router.h"
#include "router/worker_call.h"
#include "serve/ec_connector.h"
#include "serve/openai_request.h"
#include "serve/openai_server.h"

namespace ferry::serve {

namespace server_parts {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

inline int64_t UnixSeconds() {
    return std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// --- metrics ----------------------------------------------------------------------------------

class Histogram {
  public:
    explicit Histogram(std::vector<double> bounds)
        : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
    void Observe(double v) {
        size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
        ++counts_[i];
        sum_ += v;
        ++count_;
    }
    void Render(const std::string& name, const std::string& help, PrometheusWriter* w) const {
        std::vector<uint64_t> cumulative(bounds_.size());
        uint64_t acc = 0;
        for (size_t i = 0; i < bounds_.size(); ++i) cumulative[i] = acc += counts_[i];
        w->Histogram(name, help, bounds_, cumulative, sum_, count_);
    }

  private:
    std::vector<double> bounds_;
    std::vector<uint64_t> counts_;
    double sum_ = 0;
    uint64_t count_ = 0;
};

// What the server adds to the engine's counters: latencies as the client sees them.
struct Metrics {
    std::mutex mu;
    Histogram ttft{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0}};
    Histogram itl{
        {0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5}};
    Histogram e2e{{0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0}};
    std::map<std::string, uint64_t> finished;  // by finish reason
    uint64_t bad_requests = 0;
    // Generated tokens per second over the last 10 s, in one-second buckets.
    std::array<uint64_t, 10> token_buckets{};
    int64_t bucket_second = 0;

    void AddTokens(uint64_t n, int64_t now_s) {
        Roll(now_s);
        token_buckets[now_s % 10] += n;
    }
    double TokensPerSecond(int64_t now_s) {
        Roll(now_s);
        uint64_t sum = 0;
        for (size_t i = 0; i < 10; ++i) {
            if (static_cast<int64_t>(i) != now_s % 10) sum += token_buckets[i];  // full seconds
        }
        return sum / 9.0;
    }

  private:
    void Roll(int64_t now_s) {
        if (bucket_second == 0) bucket_second = now_s;
        for (int64_t s = bucket_second + 1; s <= now_s && s <= bucket_second + 10; ++s) {
            token_buckets[s % 10] = 0;
        }
        bucket_second = std::max(bucket_second, now_s);
    }
};

// One request's state between the engine's step thread and the connection.
struct Pending {
    std::mutex mu;
    engine::RequestOutput all;  // non-streamed: everything so far
    bool finished = false;
    // Streamed.
    bool stream_started = false;
    bool sent_role = false;
    size_t text_offset = 0;
};

// A request's id from its X-Request-Id (1..128 of [A-Za-z0-9._:-]), else 128 random bits.
inline std::string RequestIdOf(const http::Request& req) {
    const std::string* x = req.Find("X-Request-Id");
    return x && ValidRequestId(*x) ? *x : RandomId128();
}

// The HTTP status of an error that ends a request: whose fault it is (docs/disaggregation.md).
inline int HttpStatusOf(const Status& st) {
    switch (st.code()) {
        case Code::kInvalidArgument:
        case Code::kOutOfRange:
            return 400;
        case Code::kPermissionDenied:
            return 403;
        case Code::kFailedPrecondition:
        case Code::kAlreadyExists:
        case Code::kAborted:
            return 409;
        case Code::kResourceExhausted:
            return 429;
        case Code::kUnavailable:
        case Code::kDeadlineExceeded:
        case Code::kCancelled:
        case Code::kNotFound:
            return 503;
        default:
            return 500;
    }
}

}  // namespace server_parts

class ImagePipeline;
class RemotePrefill;
class SglangPd;

struct OpenAiServer::Impl {
    Impl();
    ~Impl();

    std::shared_ptr<engine::Engine> engine;
    ServerConfig config;
    std::string model_name;
    int64_t created = server_parts::UnixSeconds();
    std::unique_ptr<http::Server> http;
    // The same, for handlers: they may run before Start has stored `http`.
    std::atomic<http::Server*> http_ready{nullptr};
    std::atomic<bool> stopping{false};
    std::atomic<bool> draining{false};
    std::mutex stop_mu;
    std::condition_variable stop_cv;
    bool stopped = false;
    server_parts::Metrics metrics;

    std::unique_ptr<http::Client> client;  // for the prefill and encode workers
    // Workers whose calls ran past their deadline: --encoder-urls encode workers, and
    // decode-first prefill workers (back in remote_prefill when they answer a probe).
    std::unique_ptr<router::Quarantine> quarantine;
    // Decode-first: the prefill workers this decoder sends its prompts to (remote_prefill.h).
    std::unique_ptr<RemotePrefill> remote_prefill;
    // Images (with config.vision): reading, decoding, the encoder cache, the encoder or the
    // encode workers (image_pipeline.h).
    std::unique_ptr<ImagePipeline> images;
    // SGLang's PD protocol: the bootstrap server, the decode side's lookups (sglang_pd.h).
    std::unique_ptr<SglangPd> sglang;

    std::vector<http::Route> Routes();
    // An OpenAI error body; with `request_id` (the X-Request-Id a request goes by here) the body
    // names it ("request_id") and the X-Request-Id header carries it.
    http::Reply Error(int status, const BadRequest& e, const std::string& request_id = "");
    void Completions(const std::shared_ptr<http::Exchange>& ex, bool chat);
    // The rest of a completion once its SGLang bootstrap fields (if any) became its
    // kv_transfer_params: the params' checks, images, routing.
    void Continue(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr);
    // A request's kv_transfer_params read by the connector and checked against who sent them
    // (pr->kv_transfer set); the error reply if they are refused.
    std::optional<http::Reply> TakeKvParams(const http::Exchange& ex, ParsedRequest* pr);
    // SGLang's native API (sglang_generate.cc): POST /generate, one prompt or a batch.
    void Generate(const std::shared_ptr<http::Exchange>& ex);
    // SGLang's server routes mini_lb calls: /health_generate, /get_server_info,
    // /get_model_info, /flush_cache (sglang_generate.cc).
    void AddSglangRoutes(std::vector<http::Route>* routes);
    // A parsed request (its images encoded) to a remote prefill worker (decode-first) or here.
    void Route(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr);
    // Submits a parsed request and streams or returns its answer; the engine request id.
    // `retry`, if given, sees an error that ends the request before anything was sent to the
    // client and may take the request over (true: nothing is answered here).
    // `base` is the request's id without its "cmpl-" prefix ("": the X-Request-Id it came with,
    // or a random one).
    std::string Dispatch(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                         std::function<bool(const Status&)> retry = nullptr, std::string base = "");
    // Who is asking: kRouterRequester for a holder of the router token, else the client's
    // address. An error reply if the request must be refused (a wrong token, or a token where
    // one is required).
    std::optional<http::Reply> Authenticate(const http::Request& req, bool internal,
                                            std::string* requester);
    std::string RenderMetrics();
};

}  // namespace ferry::serve
