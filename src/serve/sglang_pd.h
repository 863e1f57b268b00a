// SGLang's PD protocol on a ferry worker (schema/sglang_pd.h): a prefill worker runs SGLang's
// bootstrap server (GET /route, GET /health) on its bootstrap port; both roles take
// bootstrap_host / bootstrap_port / bootstrap_room on every generation route and turn them into
// push kv_transfer_params under the room's transfer id. The decode worker first asks the named
// bootstrap server where the prefill worker's agent is (one GET, remembered for a few seconds,
// with the server's agent deadline). Then the request runs as any push request: the decoder
// names its blocks and its prompt's digest, the prefill worker writes the KV layer by layer and
// sends its first token, and a room whose other half never comes expires with the push's
// bootstrap timeout, its blocks freed.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "http/http.h"
#include "schema/sglang_pd.h"
#include "serve/openai_request.h"
#include "serve/openai_server.h"

namespace ferry::serve {

class SglangPd {
  public:
    explicit SglangPd(OpenAiServer::Impl& server);
    ~SglangPd();  // Stop()
    // The prefill role's bootstrap server (config.sglang_bootstrap_port >= 0); no-op elsewhere.
    Status Start();
    void Stop();
    int bootstrap_port() const;

    // The request's bootstrap fields (`b`) as push kv_transfer_params, then `next(pr)`: at once
    // for a prefill worker (its answer is one token, as SGLang's prefill worker's), after the
    // bootstrap lookup for a decode worker. An error is answered here (400 for a worker with no
    // PD role, 503 for a bootstrap server that does not answer or is not a ferry prefill
    // worker's), and `next` is not called.
    void Apply(const std::shared_ptr<http::Exchange>& ex, ParsedRequest pr,
               const schema::SglangBootstrap& b, std::function<void(ParsedRequest)> next);
    // The prefill worker that bootstrap server `host:port` fronts (port 0: the default).
    void Resolve(const std::string& host, int port,
                 std::function<void(Result<schema::SglangPrefillInfo>)> done);

  private:
    std::vector<http::Route> BootstrapRoutes();

    OpenAiServer::Impl& s_;
    std::unique_ptr<http::Server> bootstrap_;
    struct Entry {
        schema::SglangPrefillInfo info;
        std::chrono::steady_clock::time_point until;
    };
    std::mutex mu_;
    std::map<std::string, Entry> known_;  // "host:port" of a bootstrap server
    std::map<std::string, std::vector<std::function<void(Result<schema::SglangPrefillInfo>)>>>
        asking_;  // lookups in flight, their waiters
};

}  // namespace ferry::serve
