// ferry_soak_pd: a disaggregated deployment under load while its workers are killed, stopped and
// restarted, with every answer checked against the colocated one (docs/soak.md, "PD soak").
//
// The orchestrator writes a tiny model and vision projector, computes the colocated answers of a
// pool of requests (token-id prompts of 16..600 tokens, 16..64 output tokens or every fourth
// 300..500, greedy and seeded sampling, streamed and whole; with --images-every N, every Nth a
// chat with one or two images) on a colocated worker, then starts 2 prefill and 2 decode workers
// (and, for the images, 1 encode worker whose embeddings the others load over the encoder-cache
// connector) and `ferry proxy` over them. Client
// threads send the pool's requests through the proxy, round and round, each with a deadline,
// and classify every answer:
//   completed  200, whole (a stream ended with [DONE] and no error event), the colocated tokens;
//   failed     an error status, an error event, or the connection failed;
//   wrong      complete, with other tokens than colocated (must be 0);
//   hung       no answer by its deadline (must be 0).
// Every --chaos-every-ms one worker, at random, is SIGKILLed (and restarted on its port) or
// SIGSTOPped for 1-4 s (and resumed); one at a time, so that a deployment with retries can keep
// answering. At the end the load stops, every worker runs again, and each must give back every
// KV block it used (`ferry_kv_blocks_used` 0, no hold left) within 30 s, and the encode worker
// every encoder-cache slot it leased (`ferry_ec_leased` 0, within its lease): the rest are
// leaks.
// The report: the counts above, how many were retried or migrated (the proxy's counters),
// latency p50/p99 of the completed, and the leaks. Exit 1 on any wrong, hung or leaked.
//
//   ferry_soak_pd --duration-s 60                     what `make test` runs (pull)
//   ferry_soak_pd --duration-s 3600 --mode push       the hour in docs/soak.md
//   ferry_soak_pd --max-attempts 1 --no-prefill-fallback --kv-load-failure fail
//                                                     the same kills without retries (goodput)
//   ferry_soak_pd --chaos-every-ms 0                  no kills (the goodput reference)
#include <fmt/core.h>
#include <signal.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "http/http.h"
#include "serve/serve_flags.h"
#include "testing/completions.h"
#include "testing/images.h"
#include "testing/tiny_model.h"
#include "testing/worker_process.h"

namespace {

namespace http = ferry::http;
using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;
using ferry::testing::ServerProcess;
using std::chrono::milliseconds;
using std::chrono::seconds;

struct Options {
    int duration_s = 60;
    std::string mode = "pull";
    std::string backend = "shm";
    int chaos_every_ms = 3000;
    int clients = 6;
    int pool = 48;
    int max_attempts = 3;
    bool no_prefill_fallback = false;
    std::string kv_load_failure = "recompute";
    uint64_t seed = 1;
    int slo_ms = 2000;
    int failover_probes = 0;
    int images_every = 4;
    std::string log_dir;
};

struct Request {
    Json body;
    bool stream = false;
    std::string path = "/v1/completions";
    std::vector<int32_t> want;
};

std::vector<Request> Pool(const Options& o) {
    std::mt19937_64 g(o.seed);
    std::vector<Request> out;
    for (int i = 0; i < o.pool; ++i) {
        const int len = 16 + int(g() % 585);
        std::vector<int32_t> prompt(size_t(len), 0);
        for (auto& t : prompt) t = int32_t(g() % 256);
        Request r;
        r.stream = i % 2 == 0;
        r.body = {{"prompt", prompt},
                  // Every fourth a long stream, so that kills and stops land mid-stream.
                  {"max_tokens", i % 4 == 0 ? 300 + int(g() % 200) : 16 + int(g() % 49)},
                  {"temperature", 0},
                  {"ignore_eos", true},
                  {"logprobs", 0},
                  {"return_tokens_as_token_ids", true},
                  {"stream", r.stream}};
        if (i % 3 == 1) {  // seeded sampling: a migrated stream must go on with the same draws
            r.body["temperature"] = 0.8;
            r.body["seed"] = int64_t(g() % 100000);
        }
        if (o.images_every > 0 && i % o.images_every == o.images_every - 1) {
            // A chat with one or two images from a pool of 6 (repeated across requests, as an
            // encoder cache sees them), text around them.
            Json content = Json::array();
            for (int j = 0; j < 1 + i % 2; ++j) {
                const int k = int(g() % 6);
                content.push_back({{"type", "text"}, {"text", std::string(3 + j, 'a' + i % 26)}});
                content.push_back({{"type", "image_url"},
                                   {"image_url",
                                    {{"url", ferry::testing::RandomPngUrl(
                                                 16 + 5 * k, 40 - 3 * k, uint32_t(o.seed) + k)}}}});
            }
            content.push_back({{"type", "text"}, {"text", fmt::format("image prompt {}?", i)}});
            r.body.erase("prompt");
            r.body["messages"] = {{{"role", "user"}, {"content", content}}};
            r.body["logprobs"] = true;
            r.path = "/v1/chat/completions";
        }
        out.push_back(std::move(r));
    }
    return out;
}

http::ClientRequest Post(int port, const Request& req, milliseconds timeout) {
    http::ClientRequest r;
    r.port = port;
    r.target = req.path;
    r.body = req.body.dump();
    r.timeout = timeout;
    return r;
}

// Tokens of an answer; none when it cannot be read.
std::vector<int32_t> Tokens(const std::string& body, bool stream) {
    try {
        return ferry::testing::TokensOf(body, stream);
    } catch (const std::exception&) {
        return {};
    }
}

std::unique_ptr<ServerProcess> Start(std::vector<std::string> args, const std::string& log) {
    auto p = ServerProcess::Start(FERRY_BIN, std::move(args), seconds(120), log);
    if (!p.ok()) {
        fmt::print(stderr, "ferry_soak_pd: {}\n", p.status().ToString());
        return nullptr;
    }
    return std::move(p).value();
}

// `mmproj` ("": none) the vision projector of every worker when the pool has images; the
// consumers then load what the encode worker publishes (the encoder-cache connector).
std::vector<std::string> WorkerArgs(const std::string& model, const std::string& mmproj,
                                    const std::string& role, const Options& o) {
    ferry::serve::ServeFlags f;
    f.model = model;
    f.port = 0;
    f.block_size = 16;
    f.num_kv_blocks = role == "encode" ? 300 : 4000;  // the language model does not run there
    f.max_model_len = 2048;
    f.role = role;
    f.mmproj = mmproj;
    std::vector<std::string> extra;
    if (role != "colocated") f.kv_backend = o.backend;
    if (role == "decode") extra = {"--kv-load-failure", o.kv_load_failure};
    if (!mmproj.empty() && role != "colocated") {
        extra.insert(extra.end(), {"--ec-connector", "transfer"});
    }
    if (!extra.empty()) {
        const ferry::Status st = ferry::serve::ParseServeArgs(extra, &f);
        if (!st.ok()) fmt::print(stderr, "ferry_soak_pd: {}\n", st.ToString());
    }
    std::vector<std::string> a = {"serve"};
    for (std::string& s : ferry::serve::ServeArgs(f)) a.push_back(std::move(s));
    return a;
}

// --failover-probes: a stream that runs on a decode worker SIGKILLed after 20 events; the
// longest silence of the stream around the kill (what the client saw of its migration), and the
// time from the kill to the proxy's no longer counting the worker as answering. The worker is
// restarted after each probe. Empty: a probe failed (named on stderr).
struct Failover {
    std::vector<double> next_event_s, left_out_s;
};
Failover ProbeFailover(int probes, ServerProcess& proxy,
                       std::vector<std::unique_ptr<ServerProcess>>& workers, const Request& r) {
    Failover out;
    auto client = http::Client::Create(1);
    for (int i = 0; i < probes; ++i) {
        struct State {
            std::mutex mu;
            int events = 0;
            std::vector<Clock::time_point> at;  // each piece's arrival
            bool done = false;
        };
        auto st = std::make_shared<State>();
        http::ClientCallbacks cb;
        cb.on_data = [st](std::string_view d) {
            std::lock_guard lock(st->mu);
            for (size_t pos = 0; (pos = d.find("data: ", pos)) != std::string_view::npos;
                 pos += 6) {
                ++st->events;
            }
            st->at.push_back(Clock::now());
        };
        cb.on_done = [st](const ferry::Status&) {
            std::lock_guard lock(st->mu);
            st->done = true;
        };
        auto call = client->Call(Post(proxy.port(), r, seconds(120)), cb);
        auto events = [&] {
            std::lock_guard lock(st->mu);
            return st->events;
        };
        const auto until = Clock::now() + seconds(60);
        while (events() < 20 && Clock::now() < until) std::this_thread::sleep_for(milliseconds(1));
        ServerProcess* victim = nullptr;
        for (size_t w = 2; w < 4; ++w) {  // the decode workers
            if (workers[w]->Metric("ferry_num_requests_running") >= 1) victim = workers[w].get();
        }
        if (!victim) {
            fmt::print(stderr, "ferry_soak_pd: failover probe {}: no decode worker runs it\n", i);
            call->Cancel();
            continue;
        }
        const int before = events();
        const auto killed = Clock::now();
        victim->Signal(SIGKILL);
        const std::string answering =
            fmt::format("ferry_router_worker_answering{{role=\"decode\",worker=\"127.0.0.1:{}\"}}",
                        victim->port());
        (void)before;
        std::optional<double> left;
        while (!left && Clock::now() < killed + seconds(30)) {
            if (proxy.Metric(answering) == 0) {
                left = std::chrono::duration<double>(Clock::now() - killed).count();
            }
            std::this_thread::sleep_for(milliseconds(1));
        }
        if (left) out.left_out_s.push_back(*left);
        auto done = [&] {
            std::lock_guard lock(st->mu);
            return st->done;
        };
        while (!done() && Clock::now() < until) std::this_thread::sleep_for(milliseconds(5));
        {
            // The stream's longest silence around the kill: what the client saw of the failover
            // (pieces sent before the kill may still arrive after it).
            std::lock_guard lock(st->mu);
            double gap = 0;
            for (size_t k = 1; k < st->at.size(); ++k) {
                if (st->at[k] < killed) continue;
                gap = std::max(gap, std::chrono::duration<double>(
                                        st->at[k] - std::max(st->at[k - 1], killed - seconds(1)))
                                        .count());
            }
            if (st->done && !st->at.empty()) out.next_event_s.push_back(gap);
        }
        (void)victim->Restart();
        const auto back = Clock::now() + seconds(30);
        while (proxy.Metric(answering) != 1 && Clock::now() < back) {
            std::this_thread::sleep_for(milliseconds(20));
        }
    }
    return out;
}

double Percentile(std::vector<double> v, double q) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, size_t(q * double(v.size())))];
}

}  // namespace

int main(int argc, char** argv) {
    signal(SIGPIPE, SIG_IGN);
    Options o;
    CLI::App app{"ferry_soak_pd: a P/D deployment under load while its workers die and stall"};
    app.add_option("--duration-s", o.duration_s, "how long the load runs")->capture_default_str();
    app.add_option("--mode", o.mode, "pull or push")
        ->check(CLI::IsMember({"pull", "push"}))
        ->capture_default_str();
    app.add_option("--backend", o.backend, "the workers' KV backend")->capture_default_str();
    app.add_option("--chaos-every-ms", o.chaos_every_ms,
                   "a worker killed or stopped this often (0: never)")
        ->capture_default_str();
    app.add_option("--clients", o.clients, "requests in flight")->capture_default_str();
    app.add_option("--pool", o.pool, "distinct requests (their colocated answers are computed)")
        ->capture_default_str();
    app.add_option("--max-attempts", o.max_attempts, "the proxy's --max-attempts")
        ->capture_default_str();
    app.add_flag("--no-prefill-fallback", o.no_prefill_fallback, "the proxy's flag");
    app.add_option("--kv-load-failure", o.kv_load_failure, "the decode workers' policy")
        ->check(CLI::IsMember({"fail", "recompute"}))
        ->capture_default_str();
    app.add_option("--seed", o.seed, "requests and chaos")->capture_default_str();
    app.add_option("--slo-ms", o.slo_ms, "goodput: completed within this latency")
        ->capture_default_str();
    app.add_option("--failover-probes", o.failover_probes,
                   "before the load: this many streams whose decode worker is killed mid-stream, "
                   "timed (the stream's longest silence; kill to the proxy leaving the worker out)")
        ->capture_default_str();
    app.add_option("--images-every", o.images_every,
                   "every Nth request of the pool a chat with images, through an encode worker "
                   "(0: no images, no encode worker)")
        ->capture_default_str();
    app.add_option("--log-dir", o.log_dir, "the processes' logs (default: this one's stderr)");
    CLI11_PARSE(app, argc, argv);
    auto log = [&](const std::string& name) {
        return o.log_dir.empty() ? std::string() : o.log_dir + "/" + name + ".log";
    };

    ferry::testing::TinyModelFile model("soak-pd", ferry::testing::TinyModelSpec(2048), 31);
    const std::string mmproj =
        o.images_every > 0 ? ferry::testing::WriteTinyMmproj("soak-pd", 37) : std::string();
    struct Cleanup {
        std::string path;
        ~Cleanup() {
            if (!path.empty()) std::remove(path.c_str());
        }
    } cleanup{mmproj};
    std::vector<Request> pool = Pool(o);
    {
        auto colocated = Start(WorkerArgs(model.path(), mmproj, "colocated", o), log("colocated"));
        if (!colocated) return 2;
        for (Request& r : pool) {
            auto got = http::Fetch(Post(colocated->port(), r, seconds(120)));
            if (!got.ok() || got->status != 200) {
                fmt::print(stderr, "ferry_soak_pd: the colocated reference failed\n");
                return 2;
            }
            r.want = Tokens(got->body, r.stream);
        }
    }

    // prefill 0, 1, decode 0, 1, and with images encode 0.
    std::vector<std::unique_ptr<ServerProcess>> workers;
    std::vector<std::string> roles = {"prefill", "prefill", "decode", "decode"};
    if (!mmproj.empty()) roles.push_back("encode");
    for (const std::string& role : roles) {
        workers.push_back(Start(WorkerArgs(model.path(), mmproj, role, o),
                                log(fmt::format("{}{}", role, workers.size() % 2))));
        if (!workers.back()) return 2;
    }
    std::vector<std::string> px = {"proxy",
                                   "--port",
                                   "0",
                                   "--no-store",
                                   "--kv-transfer",
                                   o.mode,
                                   "--prefill-timeout-ms",
                                   "3000",
                                   "--stream-idle-timeout-ms",
                                   "3000",
                                   "--worker-timeout-ms",
                                   "60000",
                                   "--load-poll-ms",
                                   "200",
                                   "--max-attempts",
                                   std::to_string(o.max_attempts)};
    if (o.no_prefill_fallback) px.push_back("--no-prefill-fallback");
    if (!mmproj.empty()) {
        px.insert(px.end(), {"--encode", fmt::format("127.0.0.1:{}", workers[4]->port()),
                             "--encode-timeout-ms", "3000"});
    }
    px.push_back("--prefill");
    for (int i = 0; i < 2; ++i) px.push_back(fmt::format("127.0.0.1:{}", workers[i]->port()));
    px.push_back("--decode");
    for (int i = 2; i < 4; ++i) px.push_back(fmt::format("127.0.0.1:{}", workers[i]->port()));
    auto proxy = Start(px, log("proxy"));
    if (!proxy) return 2;

    if (o.failover_probes > 0) {
        const Request* longest = &pool[0];
        for (const Request& r : pool) {
            if (r.stream && r.body["max_tokens"] > longest->body["max_tokens"]) longest = &r;
        }
        Failover f = ProbeFailover(o.failover_probes, *proxy, workers, *longest);
        fmt::print(
            "ferry_soak_pd: failover of a stream whose decode worker was SIGKILLed ({} probes): "
            "the stream's longest silence p50 {:.3f} s (max {:.3f}); kill to the proxy leaving "
            "the worker out p50 {:.3f} s (max {:.3f})\n",
            f.next_event_s.size(), Percentile(f.next_event_s, 0.5), Percentile(f.next_event_s, 1),
            Percentile(f.left_out_s, 0.5), Percentile(f.left_out_s, 1));
    }

    // The load.
    std::mutex mu;
    uint64_t completed = 0, failed = 0, wrong = 0, hung = 0, images_completed = 0;
    std::vector<double> latencies;
    std::map<std::string, uint64_t> why_failed;
    std::atomic<bool> stop{false};
    const milliseconds deadline = seconds(120);
    std::vector<std::thread> clients;
    for (int c = 0; c < o.clients; ++c) {
        clients.emplace_back([&, c] {
            for (size_t i = size_t(c); !stop.load(); i += size_t(o.clients)) {
                const Request& r = pool[i % pool.size()];
                const auto t0 = Clock::now();
                auto got = http::Fetch(Post(proxy->port(), r, deadline));
                const double s = std::chrono::duration<double>(Clock::now() - t0).count();
                std::lock_guard lock(mu);
                if (!got.ok()) {
                    if (got.status().code() == ferry::Code::kDeadlineExceeded) {
                        ++hung;
                    } else {
                        ++failed;
                        ++why_failed["connection: " + got.status().message().substr(0, 60)];
                    }
                    continue;
                }
                const bool whole =
                    got->status == 200 &&
                    (!r.stream || (got->body.find("[DONE]") != std::string::npos &&
                                   got->body.find("\"error\"") == std::string::npos));
                if (!whole) {
                    ++failed;
                    ++why_failed[got->status == 200 ? std::string("an error event mid-stream")
                                                    : fmt::format("status {}", got->status)];
                    continue;
                }
                if (Tokens(got->body, r.stream) != r.want) {
                    ++wrong;
                    fmt::print(stderr, "ferry_soak_pd: WRONG answer to pool request {}: {}\n",
                               i % pool.size(), got->body.substr(0, 300));
                    continue;
                }
                ++completed;
                if (r.body.contains("messages")) ++images_completed;
                latencies.push_back(s);
            }
        });
    }

    // The chaos: one worker at a time, killed and restarted, or stopped and resumed.
    std::mt19937_64 g(o.seed * 7919 + 1);
    uint64_t kills = 0, stops = 0;
    const auto end = Clock::now() + seconds(o.duration_s);
    auto next = Clock::now() + milliseconds(std::max(o.chaos_every_ms, 1));
    while (Clock::now() < end) {
        std::this_thread::sleep_for(milliseconds(50));
        if (o.chaos_every_ms <= 0 || Clock::now() < next) continue;
        ServerProcess& w = *workers[g() % workers.size()];
        if (g() % 2 == 0) {
            w.Signal(SIGKILL);
            ++kills;
            std::this_thread::sleep_for(milliseconds(300));
            const ferry::Status st = w.Restart();
            if (!st.ok()) fmt::print(stderr, "ferry_soak_pd: restart: {}\n", st.ToString());
        } else {
            (void)w.Stop();
            ++stops;
            std::this_thread::sleep_for(milliseconds(1000 + int(g() % 3000)));
            w.Signal(SIGCONT);
        }
        next = Clock::now() + milliseconds(o.chaos_every_ms);
    }
    stop = true;
    for (auto& t : clients) t.join();

    // Every block given back, and every encoder-cache lease (a consumer that died before it
    // pulled leaves one until the lease, 30 s, lapses).
    int leaks = 0;
    if (!mmproj.empty() && !workers[4]->WaitMetric("ferry_ec_leased", 0, seconds(40))) {
        ++leaks;
        fmt::print(stderr, "ferry_soak_pd: encode kept ferry_ec_leased = {}\n",
                   workers[4]->Metric("ferry_ec_leased"));
    }
    for (size_t i = 0; i < 4; ++i) {
        const bool prefill = i < 2;
        for (const char* m : {"ferry_kv_blocks_used", "ferry_kv_requests_held"}) {
            if (!prefill && std::string(m) == "ferry_kv_requests_held") continue;
            if (!workers[i]->WaitMetric(m, 0, seconds(30))) {
                ++leaks;
                fmt::print(stderr, "ferry_soak_pd: {} {} kept {} = {}\n",
                           prefill ? "prefill" : "decode", i % 2, m, workers[i]->Metric(m));
            }
        }
    }
    auto metric = [&](const char* name) { return uint64_t(std::max(0.0, proxy->Metric(name))); };
    const uint64_t total = completed + failed + wrong + hung;
    const auto good = uint64_t(std::count_if(latencies.begin(), latencies.end(),
                                             [&](double s) { return s * 1000 <= o.slo_ms; }));
    fmt::print(
        "ferry_soak_pd: {} {} s, {} kills, {} stops, --max-attempts {}: {} requests: {} completed "
        "({:.2f}%; within {} ms: {:.2f}%), {} failed, {} wrong, {} hung; retried: prefill {}, "
        "decode {}, fallback {}, migrated {}; latency p50 {:.3f} s, p99 {:.3f} s; leaks {}\n",
        o.mode, o.duration_s, kills, stops,
        fmt::format("{}{}", o.max_attempts, o.no_prefill_fallback ? " (no fallback)" : ""), total,
        completed, total ? 100.0 * double(completed) / double(total) : 0.0, o.slo_ms,
        total ? 100.0 * double(good) / double(total) : 0.0, failed, wrong, hung,
        metric("ferry_proxy_prefill_retried_total"), metric("ferry_proxy_decode_retried_total"),
        metric("ferry_proxy_prefill_fallback_total"), metric("ferry_proxy_streams_migrated_total"),
        Percentile(latencies, 0.5), Percentile(latencies, 0.99), leaks);
    if (!mmproj.empty()) {
        fmt::print(
            "  with images: {} completed; the proxy's encode step: {} encoded, {} retried "
            "on another encode worker, {} left to the consumers\n",
            images_completed, metric("ferry_proxy_encoded_total"),
            metric("ferry_proxy_encode_retried_total"), metric("ferry_proxy_encode_failed_total"));
    }
    for (const auto& [why, n] : why_failed) fmt::print("  failed {}: {}\n", n, why);
    return wrong == 0 && hung == 0 && leaks == 0 && completed > 0 ? 0 : 1;
}
