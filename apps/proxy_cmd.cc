#include "proxy_cmd.h"

#include <fmt/core.h>
#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "core/crypto.h"
#include "core/host_port.h"
#include "discovery_cmd.h"
#include "ferry/discovery.h"
#include "gguf/gguf.h"
#include "serve/proxy.h"
#include "tokenizer/tokenizer.h"

namespace ferry::cli {

void AddProxyCommand(CLI::App& app, int* rc) {
    CLI::App* px = app.add_subcommand(
        "proxy",
        "Serve the OpenAI API in front of prefill and decode workers (pull: vLLM's NixlConnector "
        "protocol; push: layer-wise), and the discovery store the workers' agents register in");
    // Each default is the config's own (serve::ProxyConfig and the router configs it nests).
    static const serve::ProxyConfig defaults;
    static std::vector<std::string> prefill, decode, encode;
    static std::string host = defaults.host, mode = router::ProtocolName(defaults.driver.protocol),
                       store, store_listen = "127.0.0.1:0", policy = "round-robin", prefill_policy,
                       decode_policy, model;
    static int64_t load_poll_ms = defaults.membership.poll.count();
    static int pd_min_uncached = defaults.driver.pd_min_uncached_tokens;
    static router::CacheAwareWeights weights;
    static int port = defaults.port;
    static bool no_store = false;
    static std::string secret_file, tokenizer;
    static int64_t timeout_ms = defaults.driver.worker_timeout.count();
    px->add_option("--prefill", prefill,
                   "prefill workers' OpenAI servers (HOST:PORT or URL), beside those registered "
                   "in the store");
    px->add_option("--decode", decode,
                   "decode workers' OpenAI servers (HOST:PORT or URL), beside those registered "
                   "in the store");
    px->add_option("--encode", encode,
                   "encode workers' OpenAI servers (HOST:PORT or URL; `ferry serve --role "
                   "encode`): chat requests with images go to one of them first (EPD)");
    px->add_option("--host", host, "address to listen on")->capture_default_str();
    px->add_option("--port", port, "port (0: any free port, printed)")
        ->check(CLI::Range(0, 65535))
        ->capture_default_str();
    px->add_option("--kv-transfer", mode, "pull or push")
        ->check(CLI::IsMember({"pull", "push"}))
        ->capture_default_str();
    const std::vector<std::string> policies = {"round-robin", "least-loaded", "power-of-two",
                                               "cache-aware"};
    px->add_option("--policy", policy,
                   "how a worker of each kind is picked: round-robin (in turn), least-loaded "
                   "(lowest load: max(requests in flight, the worker's reported waiting + "
                   "running), then prompt tokens in flight, then KV usage), power-of-two (the "
                   "less loaded of two at random) or cache-aware (the prompt's blocks a worker "
                   "holds, from its KV events, against its load); docs/routing.md")
        ->check(CLI::IsMember(policies))
        ->capture_default_str();
    px->add_option("--prefill-policy", prefill_policy, "prefill workers' policy (default --policy)")
        ->check(CLI::IsMember(policies));
    px->add_option("--decode-policy", decode_policy, "decode workers' policy (default --policy)")
        ->check(CLI::IsMember(policies));
    px->add_option("--cache-prefix-weight", weights.prefix,
                   "cache-aware: weight of the prompt's fraction a worker holds")
        ->check(CLI::Range(0.0, 1000.0))
        ->capture_default_str();
    px->add_option("--cache-queue-weight", weights.queue,
                   "cache-aware: weight of a worker's load relative to the busiest candidate's")
        ->check(CLI::Range(0.0, 1000.0))
        ->capture_default_str();
    px->add_option("--cache-kv-weight", weights.kv,
                   "cache-aware: weight of a worker's reported KV cache usage")
        ->check(CLI::Range(0.0, 1000.0))
        ->capture_default_str();
    px->add_option("--pd-min-uncached-tokens", pd_min_uncached,
                   "skip the prefill worker when the chosen decode worker's cache (its KV events) "
                   "holds all but fewer than this many prompt tokens: it prefills the rest itself "
                   "(multi-turn chat); 0: never")
        ->check(CLI::Range(0, 1 << 20))
        ->capture_default_str();
    px->add_option("--tokenizer", tokenizer,
                   "the workers' model file (GGUF; only its tokenizer is read): text prompts and "
                   "chat messages are tokenized as the workers do, so that cache-aware routing "
                   "and the P/D decision score them too (without it, only prompts given as token "
                   "ids are)");
    px->add_option("--model", model,
                   "the model the workers serve: workers registered with another are ignored "
                   "(default: that of the first one registered)");
    px->add_option("--load-poll-ms", load_poll_ms,
                   "how often each worker's /metrics is read for its load")
        ->check(CLI::Range(int64_t{10}, int64_t{60000}))
        ->capture_default_str();
    px->add_option("--store", store,
                   "a discovery store the workers use instead of the embedded one");
    px->add_option("--store-listen", store_listen, "where the embedded store listens")
        ->capture_default_str();
    px->add_flag("--no-store", no_store, "run no embedded store");
    px->add_option("--secret-file", secret_file,
                   "deployment secret (default $FERRY_SECRET): the embedded store requires it, "
                   "and the workers' router token is derived from it");
    px->add_option("--worker-timeout-ms", timeout_ms,
                   "fail a request whose decode worker has not finished its answer by then (504); "
                   "that worker gets no new request until it answers again")
        ->check(CLI::Range(int64_t{100}, int64_t{86400000}))
        ->capture_default_str();
    static int64_t prefill_timeout_ms = defaults.driver.prefill_timeout.count(),
                   encode_timeout_ms = defaults.driver.encode_timeout.count(),
                   agent_lookup_timeout_ms = defaults.driver.agent_timeout.count();
    px->add_option("--prefill-timeout-ms", prefill_timeout_ms,
                   "fail a request whose prefill worker has not answered by then (504); that "
                   "worker gets no new request until it answers again")
        ->check(CLI::Range(int64_t{100}, int64_t{86400000}))
        ->capture_default_str();
    px->add_option("--encode-timeout-ms", encode_timeout_ms,
                   "EPD: an encode worker that has not answered by then costs only the encoding "
                   "(the workers encode) and gets no request until it answers a probe")
        ->check(CLI::Range(int64_t{100}, int64_t{86400000}))
        ->capture_default_str();
    px->add_option("--agent-lookup-timeout-ms", agent_lookup_timeout_ms,
                   "push: asking a prefill worker where its agent is (GET /v1/kv/agent) fails the "
                   "request (502) after this long")
        ->check(CLI::Range(int64_t{100}, int64_t{600000}))
        ->capture_default_str();
    static int64_t stream_idle_timeout_ms = defaults.driver.stream_idle_timeout.count();
    px->add_option("--stream-idle-timeout-ms", stream_idle_timeout_ms,
                   "once a decode worker's answer started, the longest silence between its "
                   "pieces: past it the worker counts as lost (its stream migrates to another; "
                   "0: no limit but --worker-timeout-ms)")
        ->check(CLI::Range(int64_t{0}, int64_t{86400000}))
        ->capture_default_str();
    static int max_attempts = defaults.driver.max_attempts;
    static bool no_prefill_fallback = false;
    px->add_option("--max-attempts", max_attempts,
                   "tries per stage of a request: a prefill worker that fails has it prefilled by "
                   "another, a decode worker lost before the first byte has it sent to another, "
                   "one lost mid-stream has the stream migrated (1: none again)")
        ->check(CLI::Range(1, 16))
        ->capture_default_str();
    px->add_flag("--no-prefill-fallback", no_prefill_fallback,
                 "with no prefill worker left to try, fail the request (502/504) instead of "
                 "letting the decode worker prefill it");
    px->callback([rc] {
        auto fail = [rc](const Status& st) {
            fmt::print(stderr, "ferry proxy: {}\n", st.ToString());
            *rc = 1;
        };
        serve::ProxyConfig pc;
        std::string secret;
        try {
            secret = LoadSecret(secret_file);
        } catch (const CLI::ValidationError& e) {
            return fail(InvalidArgumentError(e.what()));
        }
        router::DriverConfig& dc = pc.driver;
        dc.router_token = RouterToken(secret);
        pc.host = host;
        pc.port = port;
        dc.protocol = mode == "push" ? router::Protocol::kPush : router::Protocol::kPull;
        dc.worker_timeout = std::chrono::milliseconds(timeout_ms);
        dc.prefill_timeout = std::chrono::milliseconds(prefill_timeout_ms);
        dc.encode_timeout = std::chrono::milliseconds(encode_timeout_ms);
        dc.agent_timeout = std::chrono::milliseconds(agent_lookup_timeout_ms);
        dc.max_attempts = max_attempts;
        dc.stream_idle_timeout = std::chrono::milliseconds(stream_idle_timeout_ms);
        dc.prefill_fallback = !no_prefill_fallback;
        auto picked = router::MakePolicy(prefill_policy.empty() ? policy : prefill_policy, weights);
        if (!picked.ok()) return fail(picked.status());
        pc.routing.policy = std::move(picked).value();
        auto picked_decode =
            router::MakePolicy(decode_policy.empty() ? policy : decode_policy, weights);
        if (!picked_decode.ok()) return fail(picked_decode.status());
        pc.routing.decode_policy = std::move(picked_decode).value();
        pc.membership.model = model;
        pc.membership.poll = std::chrono::milliseconds(load_poll_ms);
        dc.pd_min_uncached_tokens = pd_min_uncached;
        if (!tokenizer.empty()) {
            auto file = gguf::GgufFile::Open(tokenizer);
            if (!file.ok()) return fail(file.status().WithContext("--tokenizer"));
            auto tk = tokenizer::Tokenizer::FromGguf(**file);
            if (!tk.ok()) return fail(tk.status().WithContext("--tokenizer " + tokenizer));
            dc.tokenizer = std::move(tk).value();
        }
        for (const auto& [list, dst] :
             {std::pair{&prefill, &pc.prefill}, {&decode, &pc.decode}, {&encode, &dc.encode}}) {
            for (const std::string& u : *list) {
                auto ep = http::ParseEndpoint(u);
                if (!ep.ok()) return fail(ep.status());
                dst->push_back(*ep);
            }
        }
        sigset_t signals;
        sigemptyset(&signals);
        sigaddset(&signals, SIGINT);
        sigaddset(&signals, SIGTERM);
        pthread_sigmask(SIG_BLOCK, &signals, nullptr);
        std::unique_ptr<StoreServer> embedded;
        if (store.empty() && !no_store) {
            StoreServerConfig sc;
            sc.secret = secret;
            auto listen = http::ParseListenAddress(store_listen);
            if (!listen.ok()) return fail(listen.status().WithContext("--store-listen"));
            sc.listen_host = listen->host;
            sc.listen_port = static_cast<uint16_t>(listen->port);
            auto s = StoreServer::Start(sc);
            if (!s.ok()) return fail(s.status().WithContext("--store-listen"));
            embedded = std::move(s).value();
            fmt::print("ferry proxy: discovery store at {}\n", embedded->url());
        }
        // The workers' records (where each one's agent is) come from the same store.
        pc.store_url = embedded ? embedded->url() : store;
        pc.store_secret = secret;
        auto proxy = serve::Proxy::Start(std::move(pc));
        if (!proxy.ok()) return fail(proxy.status());
        fmt::print("ferry proxy: {}{} prefill, {} decode workers given{}, {} protocol\n",
                   encode.empty() ? "" : fmt::format("{} encode, ", encode.size()), prefill.size(),
                   decode.size(),
                   embedded || !store.empty() ? " (and those registered in the store)" : "", mode);
        fmt::print("ferry proxy: listening on http://{}\n", FormatHostPort(host, (*proxy)->port()));
        std::fflush(stdout);
        int sig = 0;
        sigwait(&signals, &sig);
        fmt::print("ferry proxy: signal {}, stopping\n", sig);
        (*proxy)->Stop();
        if (embedded) embedded->Stop();
    });
}

}  // namespace ferry::cli
