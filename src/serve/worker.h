// One worker process's parts, assembled in one place for every role: the engine, and for a
// disaggregated role the transfer agent and the KV connector bound to the engine's caches, and
// the OpenAI server in front. `ferry serve` and the tests build workers with it.
//
//   colocated  engine + server; refuses kv_transfer_params
//   prefill    agent + connector + engine + server; holds (pull) or pushes its requests' KV
//   decode     the same; loads KV from prefill workers; with remote prefill workers, decode-first
//   encode     the vision encoder alone (EPD): publishes each image's embeddings through its
//              encoder-cache connector and answers where they are; the language model does
//              not run
//
// Any role but encode may also load embeddings through an encoder-cache connector
// (serve/ec_connector.h; `transfer` gives a colocated worker an agent too).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "discovery/worker_directory.h"
#include "engine/engine.h"
#include "ferry/agent.h"
#include "ferry/status.h"
#include "kv/agent_connector.h"
#include "kv/connector_registry.h"
#include "model/model.h"
#include "serve/kv_events.h"
#include "serve/openai_server.h"

namespace ferry::serve {

enum class WorkerRole { kColocated, kPrefill, kDecode, kEncode };
const char* WorkerRoleName(WorkerRole role);
// "colocated", "prefill", "decode" or "encode"; InvalidArgument naming the choices otherwise.
Result<WorkerRole> ParseWorkerRole(std::string_view name);

struct WorkerConfig {
    WorkerRole role = WorkerRole::kColocated;
    std::shared_ptr<model::Model> model;  // required
    // The engine's settings; the assembly sets its connector and allocator.
    engine::EngineConfig engine;
    // Disaggregated roles only. The agent's name defaults to "ferry-ROLE-PID"; its secret also
    // makes the server's router token, and with its store makes the peers the deployment's
    // (PeerTrust).
    AgentConfig agent;
    // The KV connector's kind (kv/connector_registry.h) and its options: a JSON object only the
    // kind reads (vLLM's kv_connector_extra_config; the built-in kind's are
    // kv::AgentConnectorOptions, AgentConnectorOptionsJson). The assembly adds the model's
    // identity and the trust below (kv::KvConnectorContext).
    std::string kv_connector = kv::kDefaultKvConnector;
    nlohmann::json kv_connector_options = nlohmann::json::object();
    // The only peer agents ("host:port") this worker dials, for KV and image embeddings alike;
    // empty: with a store, those found there by name, else any the params name
    // (docs/security.md).
    std::vector<std::string> allowed_agents;
    // The OpenAI server; the assembly sets kv_agent_info, extra_metrics, router_token and
    // parse_kv_params. Decode-first prefill workers (server.remote_prefill) need role decode.
    ServerConfig server;
    bool serve_http = true;  // false: no server (tests that drive the engine directly)
    // KV events in vLLM's wire format (serve/kv_events.h); an empty endpoint: none. Its block
    // size is the engine's.
    KvEventsConfig kv_events;
    // The encoder-cache connector (EPD): its kind ("transfer", "disk"; "": none; required for
    // role encode) and settings. The assembly sets its agent, producer side, entry shape and
    // trust (the KV connector's).
    EcConnectorConfig ec;
    // With a store (agent.store) and a server: how long the worker's record there outlives it.
    std::chrono::milliseconds registration_ttl{10000};
};

// Owns the parts; stops them in the safe order (its store record, server, engine, connector,
// agent). A disaggregated worker with a store and a server puts its record there
// (discovery/worker_directory.h: HTTP address, role, model, TP size, agent), so that a router
// finds its agent without asking it.
class Worker {
  public:
    // InvalidArgument for a config that cannot work (no model, remote prefill workers on a role
    // other than decode), NotFound for an unknown connector kind; otherwise the first part's
    // error that failed, with what failed.
    static Result<std::unique_ptr<Worker>> Start(WorkerConfig config);
    ~Worker();
    Worker(const Worker&) = delete;
    Worker& operator=(const Worker&) = delete;

    WorkerRole role() const { return role_; }
    engine::Engine& engine() { return *engine_; }
    const std::shared_ptr<engine::Engine>& shared_engine() const { return engine_; }
    // Null for a colocated worker (unless its encoder-cache connector is `transfer`).
    const std::shared_ptr<Agent>& agent() const { return agent_; }
    const std::shared_ptr<kv::KvConnector>& connector() const { return connector_; }
    // Null without serve_http.
    OpenAiServer* server() { return server_.get(); }
    // Null without kv_events.endpoint.
    KvEventPublisher* kv_events() { return kv_events_.get(); }
    int port() const;  // the server's; 0 without one
    // Stops serving (open streams end), then aborts what is in flight. Idempotent.
    void Stop();

    // A graceful stop's first half (SIGTERM): the worker leaves the store (routers stop sending
    // here within a store event), answers /health with 503, and serves what is in flight and
    // what still arrives. Returns once nothing has been in flight for `quiet` (a router that
    // picked this worker just before its record went has sent by then), after `timeout`, or
    // when `interrupted` says so (a second signal); true if it drained. Stop() follows.
    struct DrainResult {
        bool drained = false;
        size_t in_flight = 0;  // left when it returned
        std::chrono::milliseconds took{0};
    };
    DrainResult Drain(std::chrono::milliseconds timeout,
                      std::chrono::milliseconds quiet = std::chrono::milliseconds(500),
                      const std::function<bool()>& interrupted = {});
    // Requests the engine holds in any state: waiting, running, parked or loading KV, or
    // finished with blocks a remote worker still reads (a prefill worker's held KV).
    size_t InFlight() const;

  private:
    Worker() = default;
    WorkerRole role_ = WorkerRole::kColocated;
    std::shared_ptr<Agent> agent_;
    std::shared_ptr<kv::KvConnector> connector_;
    std::shared_ptr<EcConnector> ec_connector_;
    std::shared_ptr<KvEventPublisher> kv_events_;  // outlives the engine that publishes to it
    std::shared_ptr<engine::Engine> engine_;
    std::unique_ptr<OpenAiServer> server_;
    std::unique_ptr<WorkerRegistration> registration_;  // its record in the store
    // decode with a store: the workers' records, where decode-first finds prefill agents
    std::shared_ptr<WorkerDirectory> directory_;
};

}  // namespace ferry::serve
