// The OpenAI-compatible HTTP API of a worker: POST /v1/completions and /v1/chat/completions
// (streamed as server-sent events or whole, with usage), GET /v1/models, /health and /metrics
// (Prometheus text). Requests go to an Engine; a client that goes away has its request aborted and
// its KV blocks freed. Bad input gets HTTP 400 with an OpenAI-style error object naming the field.
//
// Served on the event-driven HTTP layer (src/http): a few I/O threads for any number of
// connections; engine outputs are formatted on the engine's thread and handed to the connection.
// Requests may carry vLLM's kv_transfer_params (prefill and decode roles, docs/disaggregation.md);
// a held request's response carries them back. Who may send them: ServerConfig::router_token.
//
// Thread-safety: Start/Stop from one thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "ferry/status.h"
#include "http/http.h"
#include "media/image.h"
#include "model/vision.h"
#include "router/router.h"
#include "schema/sglang_pd.h"
#include "serve/ec_connector.h"

namespace ferry::serve {

struct ServerConfig {
    std::string host = "127.0.0.1";
    int port = 8000;                // 0: any free port (see OpenAiServer::port())
    std::string served_model_name;  // default: the model's name
    int max_connections = 65536;    // open connections at most
    int io_threads = 0;             // 0: one per core, 1..4
    size_t max_body_bytes = 16u << 20;
    // Request bodies held at once (http::ServerConfig::max_inflight_body_bytes), with the
    // copies of image URLs that requests keep while they wait for the encoder.
    size_t max_inflight_body_bytes = 256u << 20;
    // A connection must deliver a complete request within this long of connecting or of its
    // previous response, else it is closed (slowloris).
    std::chrono::milliseconds request_deadline{10000};
    // Parses a request's kv_transfer_params (the text of a JSON object) as the worker's KV
    // connector defines them (KvConnector::ParseParams; a colocated worker checks them the
    // default connector's way, then refuses them for want of a connector). Null: the params are
    // refused.
    std::function<Result<std::shared_ptr<kv::ConnectorParams>>(const nlohmann::json&)>
        parse_kv_params;
    // GET /v1/kv/agent: where this worker's transfer agent is (JSON: engine_id, host, port,
    // tp_size), for a proxy that drives push; absent without a connector.
    std::function<std::string()> kv_agent_info;
    // Decode-first (Dynamo style; needs kv_agent_info): prompts of at least
    // remote_prefill_min_tokens are prefilled by one of these prefill workers (round robin),
    // which push the KV here; shorter ones locally. More can be added at run time with
    // POST /add_remote_prefill_eps {"endpoints": ["HOST:PORT", ...]}.
    std::vector<http::Endpoint> remote_prefill;
    int remote_prefill_min_tokens = 0;
    // Decode-first: where a prefill worker's agent is, from the workers' records in the store
    // (router::AgentsFromDirectory), before asking the worker; null: ask it.
    std::function<std::optional<router::AgentInfo>(const http::Endpoint&)> remote_prefill_agents;
    // Appended to /metrics (e.g. the KV connector's families).
    std::function<std::string()> extra_metrics;
    // The deployment's router token (core/crypto.h RouterToken of its secret; "" = none). With
    // one, kv_transfer_params and the internal routes (/add_remote_prefill_eps, /v1/kv/agent)
    // are honoured only with "Authorization: Bearer <token>" (401 without it, 403 for a wrong
    // one), and decode-first calls to prefill workers carry it. Without one, kv_transfer_params
    // are taken from anyone (vLLM's behaviour) and /add_remote_prefill_eps only from this host (a
    // loopback peer; 403 for any other): docs/security.md.
    std::string router_token;
    // Images in chat requests (docs/inference.md): the vision encoder that turns each into
    // embedding rows of the model's width (null: image parts are refused by name), how image
    // URLs are read and how large an image or how many a request may have, how many requests
    // with images may wait for the encoder (more get 503), and the encoder cache's capacity
    // (embeddings by mm_hash: a repeated image is not encoded again).
    std::shared_ptr<model::VisionEncoder> vision;
    media::MediaOptions media;
    int max_pending_image_requests = 64;
    uint64_t encoder_cache_bytes = 256ull << 20;
    // The encoder cache's disk tier (media/encoder_cache.h): entries evicted from memory are kept
    // in files in this directory (one worker a directory), up to encoder_cache_disk_bytes, and
    // found there again after a restart. "": none.
    std::string encoder_cache_dir = {};
    uint64_t encoder_cache_disk_bytes = 4ull << 30;
    // EPD (serve/ec_connector.h): the encoder-cache connector (null: none). On an encode worker
    // (encode_only) it publishes each image's embeddings and the server answers with where they
    // are instead of running the language model; elsewhere it loads them (from the encode worker
    // that ec_transfer_params names, or the shared directory) before encoding locally, or fails
    // the request when it cannot (ec_load_failure kFail).
    std::shared_ptr<EcConnector> ec_connector = {};
    EcLoadFailure ec_load_failure = EcLoadFailure::kEncode;
    // EPD consumer: how often the encode worker's entries of a request waiting in the media
    // queue are renewed (each time for three intervals; 0: never, they last the producer's
    // lease).
    std::chrono::milliseconds ec_renew_interval{1000};
    bool encode_only = false;
    // SGLang's --encoder-urls (with an ec_connector): encode workers this worker sends its
    // image requests to itself before loading their embeddings, when the request does not
    // already say where they are (no router step). A failed call costs only the encoding.
    std::vector<http::Endpoint> encoder_urls = {};
    // Deadlines of this worker's calls to other workers (router/quarantine.h): an encode worker
    // (encoder_urls) that has not answered within `encoder_timeout` costs only the encoding
    // (done here) and is left out until it answers a probe; a decode-first prefill call not
    // answered within `remote_prefill_timeout` fails its request (503) and that prefill worker
    // gets no new prompt until it answers again; a prefill worker's agent lookup gives up after
    // `agent_timeout`.
    // SGLang's PD protocol (serve/sglang_pd.h): this worker's PD role ("prefill", "decode",
    // "": none); a prefill worker's bootstrap server port (-1: none; 0: any free port), and the
    // default for requests that name none on a decode worker (-1 or 0: SGLang's 8998); what
    // the bootstrap server says of this worker (its agent, TP size, block size).
    std::string pd_role = {};
    int sglang_bootstrap_port = -1;
    std::function<schema::SglangPrefillInfo()> sglang_prefill_info = {};
    std::chrono::milliseconds encoder_timeout{10000};
    std::chrono::milliseconds remote_prefill_timeout{60000};
    std::chrono::milliseconds agent_timeout{5000};
};

class OpenAiServer {
  public:
    // Binds and starts serving in the background. Unavailable if the port cannot be bound.
    static Result<std::unique_ptr<OpenAiServer>> Start(std::shared_ptr<engine::Engine> engine,
                                                       const ServerConfig& config);
    ~OpenAiServer();  // Stop()
    OpenAiServer(const OpenAiServer&) = delete;
    OpenAiServer& operator=(const OpenAiServer&) = delete;

    int port() const;
    const std::string& model_name() const;
    // Stops accepting, ends open streams and joins the server threads.
    void Stop();
    // Blocks until Stop() is called from another thread (or a signal handler's thread).
    void Wait();
    // From now on GET /health answers 503 {"status": "draining"} (load balancers and routers
    // stop sending); requests that still come are served as before.
    void SetDraining();

    // The inside (openai_server_parts.h), named by its parts (ImagePipeline).
    struct Impl;

  private:
    explicit OpenAiServer(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::serve
