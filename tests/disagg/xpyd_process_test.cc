// XpYd with real processes: prefill and decode workers register in a discovery store and
// `ferry proxy --store` routes to what is registered (no worker flags). Answers equal a colocated
// worker's token for token under every policy; workers that die, drain (SIGTERM) or join mid-run
// are followed without a request lost to a worker that left.
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <cmath>
#include <map>
#include <thread>

#include "core/child_process.h"
#include "core/sanitizers.h"
#include "disagg/pd_harness.h"
#include "ferry/discovery.h"
#include "serve/proxy.h"

namespace ferry {
namespace {

using namespace pd_test;  // NOLINT: the harness is this test's own vocabulary
using testing::ServerProcess;

constexpr int kRequests = 16;

std::string Addr(const ServerProcess& p) { return fmt::format("127.0.0.1:{}", p.port()); }

std::string WorkerLabel(const char* role, const ServerProcess& w) {
    return fmt::format("{{role=\"{}\",worker=\"{}\"}}", role, Addr(w));
}

class XpYd : public PdProcess {
  protected:
    void SetUp() override {
        store_ = testing::ValueOrDie(StoreServer::Start({}), "store");
        url_ = store_->url();
    }
    std::unique_ptr<ServerProcess> Worker(const std::string& role,
                                          std::vector<std::string> extra = {}) {
        extra.insert(extra.begin(), {"--store", url_});
        return StartOrDie(WorkerArgs(role, "shm", 1, extra));
    }
    std::unique_ptr<ServerProcess> Proxy(const std::string& policy) {
        return StartOrDie(
            {"proxy", "--port", "0", "--store", url_, "--policy", policy, "--load-poll-ms", "100"});
    }
    // The first kRequests prompts' bodies, and their colocated answers (this test's own: the
    // fixture's Reference computes all of Prompts()).
    std::vector<Json> Bodies(int max_tokens = 6) const {
        std::vector<Json> b;
        const auto prompts = Prompts();
        for (int i = 0; i < kRequests; ++i) {
            b.push_back(CompletionBody(prompts[size_t(i)], max_tokens, i % 2 == 1));
        }
        return b;
    }
    static const std::vector<Answer>& Want() {
        static std::vector<Answer> want;
        if (want.empty()) {
            auto colocated = StartOrDie(WorkerArgs("colocated", "", 1));
            std::vector<Json> b;
            const auto prompts = Prompts();
            for (int i = 0; i < kRequests; ++i) {
                b.push_back(CompletionBody(prompts[size_t(i)], 6, i % 2 == 1));
            }
            want = SendAll(colocated->port(), b);
        }
        return want;
    }
    void ExpectColocated(const std::vector<Answer>& got, const std::string& what) {
        const std::vector<Answer>& want = Want();
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
            EXPECT_EQ(got[i].status, 200) << what << " " << i << ": " << got[i].body.substr(0, 300)
                                          << got[i].error.ToString();
            EXPECT_EQ(got[i].tokens, want[i].tokens) << what << " request " << i;
        }
    }
    // Waits until `proxy` routes to exactly these workers (members that answer its polls).
    static bool Routes(const ServerProcess& proxy, const std::vector<ServerProcess*>& prefill,
                       const std::vector<ServerProcess*>& decode) {
        return testing::WaitUntil(
            [&] {
                for (auto [role, list] : {std::pair{"prefill", &prefill}, {"decode", &decode}}) {
                    for (ServerProcess* w : *list) {
                        if (proxy.Metric("ferry_router_worker_answering" + WorkerLabel(role, *w)) !=
                            1) {
                            return false;
                        }
                    }
                }
                auto h = http::Fetch(http::GetRequest("127.0.0.1", proxy.port(), "/health",
                                                      std::chrono::seconds(5)));
                if (!h.ok()) return false;
                Json j = Json::parse(h->body, nullptr, false);
                return j.is_object() && j["prefill_instances"] == prefill.size() &&
                       j["decode_instances"] == decode.size();
            },
            std::chrono::seconds(20));
    }
    // One prefill and two decode workers that publish their KV events (`decode_extra`: more
    // flags for the decode workers).
    struct EventFleet {
        std::unique_ptr<ServerProcess> p, d0, d1;
        bool ok() const { return p && d0 && d1; }
    };
    EventFleet StartEventFleet(const std::vector<std::string>& decode_extra = {}) {
        std::vector<std::string> events = {"--kv-events-endpoint", "tcp://*:0",
                                           "--kv-events-replay-endpoint", "tcp://*:0"};
        EventFleet f;
        f.p = Worker("prefill", events);
        events.insert(events.end(), decode_extra.begin(), decode_extra.end());
        f.d0 = Worker("decode", events);
        f.d1 = Worker("decode", events);
        return f;
    }
    // Routes(...), and every decode worker's KV events followed (in step).
    static bool FollowsEvents(const ServerProcess& proxy,
                              const std::vector<ServerProcess*>& prefill,
                              const std::vector<ServerProcess*>& decode) {
        if (!Routes(proxy, prefill, decode)) return false;
        for (ServerProcess* w : decode) {
            if (!proxy.WaitMetric("ferry_router_worker_kv_in_sync" + WorkerLabel("decode", *w), 1,
                                  std::chrono::seconds(10))) {
                return false;
            }
        }
        return true;
    }
    // `np` prefill and `nd` decode workers registered in the store; false if one did not start.
    struct Fleet {
        std::vector<std::unique_ptr<ServerProcess>> owned;
        std::vector<ServerProcess*> prefill, decode;
    };
    bool StartFleet(int np, int nd, Fleet* f) {
        for (int i = 0; i < np + nd; ++i) {
            f->owned.push_back(Worker(i < np ? "prefill" : "decode"));
            if (!f->owned.back()) return false;
            (i < np ? f->prefill : f->decode).push_back(f->owned.back().get());
        }
        return true;
    }
    // A proxy of each policy over the store's workers, each routing to all of them.
    std::vector<std::unique_ptr<ServerProcess>> Proxies(const std::vector<std::string>& policies,
                                                        const Fleet& f) {
        std::vector<std::unique_ptr<ServerProcess>> out;
        for (const std::string& policy : policies) {
            out.push_back(Proxy(policy));
            if (!out.back() || !Routes(*out.back(), f.prefill, f.decode)) {
                ADD_FAILURE() << "proxy " << policy << " does not route to the fleet";
                return {};
            }
        }
        return out;
    }
    static double Succeeded(const ServerProcess& proxy, const char* role, const ServerProcess& w) {
        double v = proxy.Metric(fmt::format(
            "ferry_router_worker_requests_total{{role=\"{}\",worker=\"{}\",outcome=\"succeeded\"}}",
            role, Addr(w)));
        return v < 0 ? 0 : v;
    }

    std::unique_ptr<StoreServer> store_;
    std::string url_;
};

class XpYdShapes : public XpYd, public ::testing::WithParamInterface<std::pair<int, int>> {};

// `ferry proxy`'s flags default to the configs it fills (serve::ProxyConfig and the router's
// configs it nests): each default is written once, and --help shows that one.
TEST(ProxyFlags, DefaultToTheConfigsTheyFill) {
    FILE* f = popen(FERRY_BIN " proxy --help 2>&1", "r");
    ASSERT_NE(f, nullptr);
    std::string help;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof(buf), f)) help.append(buf, n);
    ASSERT_EQ(pclose(f), 0) << help;
    const serve::ProxyConfig d;
    auto shows = [&](const std::string& flag, const std::string& value) {
        const size_t at = help.find(flag + " ");
        if (at == std::string::npos) return ::testing::AssertionFailure() << flag << " not found";
        // Debian's CLI11 prints the default as "=VALUE" after the flag's type and range.
        const std::string line = help.substr(at, help.find('\n', at) - at);
        const size_t eq = line.rfind('=');
        if (eq == std::string::npos || line.substr(eq + 1, line.find(' ', eq) - eq - 1) != value) {
            return ::testing::AssertionFailure() << line << " does not show =" << value;
        }
        return ::testing::AssertionSuccess();
    };
    EXPECT_TRUE(shows("--port", std::to_string(d.port)));
    EXPECT_TRUE(shows("--host", d.host));
    EXPECT_TRUE(shows("--kv-transfer", router::ProtocolName(d.driver.protocol)));
    EXPECT_TRUE(shows("--worker-timeout-ms", std::to_string(d.driver.worker_timeout.count())));
    EXPECT_TRUE(shows("--prefill-timeout-ms", std::to_string(d.driver.prefill_timeout.count())));
    EXPECT_TRUE(shows("--encode-timeout-ms", std::to_string(d.driver.encode_timeout.count())));
    EXPECT_TRUE(shows("--agent-lookup-timeout-ms", std::to_string(d.driver.agent_timeout.count())));
    EXPECT_TRUE(shows("--pd-min-uncached-tokens", std::to_string(d.driver.pd_min_uncached_tokens)));
    EXPECT_TRUE(shows("--load-poll-ms", std::to_string(d.membership.poll.count())));
}

// 2P2D and 1P3D from the store alone, each policy in a proxy of its own over the same workers:
// every answer equals colocated, every worker takes a share, no decoder computes a prompt token.
TEST_P(XpYdShapes, EveryPolicyRoutesTheStoresWorkersAndEqualsColocated) {
    const auto [np, nd] = GetParam();
    Fleet fleet;
    ASSERT_TRUE(StartFleet(np, nd, &fleet));
    const std::vector<ServerProcess*>&ps = fleet.prefill, &ds = fleet.decode;
    const std::vector<std::string> policies = {"round-robin", "least-loaded", "power-of-two"};
    std::vector<std::unique_ptr<ServerProcess>> proxies = Proxies(policies, fleet);
    ASSERT_EQ(proxies.size(), policies.size());
    Want();
    for (size_t k = 0; k < proxies.size(); ++k) {
        const ServerProcess& proxy = *proxies[k];
        ExpectColocated(SendAll(proxy.port(), Bodies(), 8), policies[k]);
        for (auto [role, list] : {std::pair{"prefill", &ps}, {"decode", &ds}}) {
            double total = 0;
            for (ServerProcess* w : *list) {
                const double n = Succeeded(proxy, role, *w);
                total += n;
                // A generous bound: every worker takes a share (round robin: exactly its share).
                EXPECT_GE(n, 1) << policies[k] << " " << role << " " << Addr(*w);
                if (policies[k] == "round-robin") {
                    const double share = double(kRequests) / double(list->size());
                    EXPECT_GE(n, std::floor(share)) << role << " " << Addr(*w);
                    EXPECT_LE(n, std::ceil(share)) << role << " " << Addr(*w);
                }
            }
            EXPECT_EQ(total, kRequests) << policies[k] << " " << role;
        }
    }
    for (ServerProcess* w : ds) EXPECT_EQ(w->Metric("ferry_prompt_tokens_total"), 0);
    // The workers export vLLM's load gauges (which the proxies read), labelled as vLLM does.
    auto models = http::Fetch(
        http::GetRequest("127.0.0.1", ds[0]->port(), "/v1/models", std::chrono::seconds(5)));
    ASSERT_TRUE(models.ok());
    const std::string model = Json::parse(models->body)["data"][0]["id"];
    const std::string labels = fmt::format("{{model_name=\"{}\",engine=\"0\"}}", model);
    EXPECT_EQ(ds[0]->Metric("vllm:num_requests_running" + labels), 0);
    EXPECT_EQ(ds[0]->Metric("vllm:num_requests_waiting" + labels), 0);
    EXPECT_EQ(ds[0]->Metric("vllm:kv_cache_usage_perc" + labels), 0);
    EXPECT_GT(ps[0]->Metric("vllm:prefix_cache_queries_total" + labels), 0);
}

// Both shapes take the same paths; under the sanitizers 2P2D alone.
INSTANTIATE_TEST_SUITE_P(
    Shapes, XpYdShapes,
    ::testing::ValuesIn(testing::kSanitized ? std::vector<std::pair<int, int>>{{2, 2}}
                                            : std::vector<std::pair<int, int>>{{2, 2}, {1, 3}}),
    [](const auto& i) { return fmt::format("{}P{}D", i.param.first, i.param.second); });

// Membership under churn. A decode worker SIGKILLed is avoided within a few polls and gone from
// the router once its lease lapses; a new one takes requests within a second of registering; one
// drained with SIGTERM mid-load finishes what it has (every answer is 200 and equals colocated),
// takes nothing new, and exits by itself.
TEST_F(XpYd, KilledDrainedAndNewWorkersAreFollowedWithoutLosingARequest) {
    auto p = Worker("prefill");
    auto a = Worker("decode", {"--store-ttl-ms", "1500"});
    auto b = Worker("decode");
    ASSERT_TRUE(p && a && b);
    auto proxy = Proxy("least-loaded");
    ASSERT_TRUE(proxy);
    ASSERT_TRUE(Routes(*proxy, {p.get()}, {a.get(), b.get()}));
    Want();

    // Killed: no more answers to the proxy's polls, so no request goes there; the lease lapses.
    const std::string a_label = WorkerLabel("decode", *a);
    a->Kill();
    EXPECT_TRUE(
        proxy->WaitMetric("ferry_router_worker_answering" + a_label, 0, std::chrono::seconds(5)));
    ExpectColocated(SendAll(proxy->port(), Bodies(), 4), "after a kill");
    EXPECT_TRUE(
        proxy->WaitMetric("ferry_router_worker_member" + a_label, 0, std::chrono::seconds(10)));
    EXPECT_EQ(proxy->Metric("ferry_router_membership_left_total"), 1);
    EXPECT_EQ(proxy->Metric("ferry_router_worker_requests_total{role=\"decode\",worker=\"" +
                            Addr(*a) + "\",outcome=\"worker_failed\"}"),
              0)
        << "no request was sent to the dead worker";

    // New: routed to within a second of its registering (it registers as it starts serving).
    auto c = Worker("decode");
    ASSERT_TRUE(c);
    const auto joined = std::chrono::steady_clock::now();
    ASSERT_TRUE(proxy->WaitMetric("ferry_router_worker_answering" + WorkerLabel("decode", *c), 1,
                                  std::chrono::seconds(5)));
#if defined(FERRY_SANITIZED)
    const auto within = std::chrono::seconds(3);  // every process runs several times slower
#else
    const auto within = std::chrono::seconds(1);
#endif
    EXPECT_LT(std::chrono::steady_clock::now() - joined, within);

    // Drained mid-load: SIGTERM b once it has requests in flight.
    std::vector<Answer> got;
    std::thread load([&] { got = SendAll(proxy->port(), Bodies(), 8); });
    const std::string b_flight =
        "ferry_router_worker_requests_in_flight" + WorkerLabel("decode", *b);
    EXPECT_TRUE(
        testing::WaitUntil([&] { return proxy->Metric(b_flight) > 0; }, std::chrono::seconds(20)));
    b->Signal(SIGTERM);
    load.join();
    ExpectColocated(got, "while draining");
    Result<std::string> line = b->ReadLine("ferry serve: drained", std::chrono::seconds(30));
    EXPECT_TRUE(line.ok()) << line.status().ToString();
    EXPECT_EQ(b->WaitExit(std::chrono::seconds(30)), std::optional<int>(0));
    // It left at once (its record went with the SIGTERM); what follows goes to c alone.
    EXPECT_EQ(proxy->Metric("ferry_router_worker_member" + WorkerLabel("decode", *b)), 0);
    const double c_before = Succeeded(*proxy, "decode", *c);
    ExpectColocated(SendAll(proxy->port(), Bodies(), 4), "after the drain");
    EXPECT_EQ(Succeeded(*proxy, "decode", *c) - c_before, kRequests);
    EXPECT_EQ(c->Metric("ferry_prompt_tokens_total"), 0);
}

// The hotspots of other routers (vLLM router #179, SGLang gateway #1714). One decode worker of
// three stalls (SIGSTOP for 2 s at a time): round robin keeps sending it a third of the requests,
// the load-aware policies see its requests pile up (and its polls go unanswered) and send it fewer.
// Then a burst of long-prompt, one-token requests: every prefill worker takes a share under every
// policy (load is counted on the prefill path too, until the prefill worker answers). Prints the
// spread per policy (docs/benchmarks.md quotes it); the bounds are generous.
TEST_F(XpYd, AStalledWorkerAndALongPromptBurstMakeNoHotspot) {
    // Its bounds count where requests went while one worker is stopped for seconds at a time: a
    // measure of timing. Under a sanitizer each worker runs several times slower, the stalled
    // worker's held KV can outlive its lease (a 503, as it should be), and the counts say how
    // slow the build is, not how good the policy is. The release run checks it; the routing
    // paths it uses run under the sanitizers in the other XpYd tests.
    if (testing::kSanitized) GTEST_SKIP() << "a timing measure; the release build checks it";
    Fleet fleet;
    ASSERT_TRUE(StartFleet(2, 3, &fleet));
    const std::vector<ServerProcess*>&ps = fleet.prefill, &ds = fleet.decode;
    const std::vector<std::string> policies = {"round-robin", "least-loaded", "power-of-two"};
    std::vector<std::unique_ptr<ServerProcess>> proxies = Proxies(policies, fleet);
    ASSERT_EQ(proxies.size(), policies.size());
    ServerProcess& slow = *ds[2];
    std::map<std::string, double> to_slow;
    for (size_t k = 0; k < proxies.size(); ++k) {
        std::atomic<bool> done{false};
        std::thread staller([&] {
            while (!done) {
                slow.Signal(SIGSTOP);
                for (int i = 0; i < 40 && !done; ++i) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(50));
                }
                slow.Signal(SIGCONT);
                std::this_thread::sleep_for(std::chrono::milliseconds(300));
            }
        });
        std::vector<Json> bodies;
        for (int i = 0; i < 30; ++i)
            bodies.push_back(CompletionBody(RandomPrompt(64, 500 + i), 4, false));
        auto got = SendAll(proxies[k]->port(), bodies, 6);
        done = true;
        staller.join();
        slow.Signal(SIGCONT);
        for (const Answer& a : got) EXPECT_EQ(a.status, 200) << a.body.substr(0, 200);
        to_slow[policies[k]] = Succeeded(*proxies[k], "decode", slow);
    }
    for (const std::string& p : policies) {
        fmt::print("stalled decode worker, {}: {} of 30 requests sent to it\n", p, to_slow[p]);
    }
    EXPECT_EQ(to_slow["round-robin"], 10);
    EXPECT_LE(to_slow["least-loaded"], 6);
    EXPECT_LE(to_slow["power-of-two"], 8);

    // The burst: 12 prompts of 1500 tokens (600 under the sanitizers, where their prefill took
    // most of the test's time; all 12 are in flight at once either way), one token each.
    std::vector<Json> burst;
    const int burst_len = testing::kSanitized ? 600 : 1500;
    for (int i = 0; i < 12; ++i)
        burst.push_back(CompletionBody(RandomPrompt(burst_len, 700 + i), 1, false));
    std::string line = "prefill requests of a 12-request burst per worker:";
    for (size_t k = 0; k < proxies.size(); ++k) {
        std::vector<double> before;
        for (ServerProcess* w : ps) before.push_back(Succeeded(*proxies[k], "prefill", *w));
        auto got = SendAll(proxies[k]->port(), burst, 12);
        for (const Answer& a : got) EXPECT_EQ(a.status, 200) << a.body.substr(0, 200);
        line += " " + policies[k];
        for (size_t i = 0; i < ps.size(); ++i) {
            const double n = Succeeded(*proxies[k], "prefill", *ps[i]) - before[i];
            line += fmt::format(" {}", n);
            EXPECT_GE(n, 3) << policies[k] << " prefill " << i;
        }
    }
    fmt::print("{}\n", line);
}

// Cache-aware routing over the workers' own KV events: a prompt sent again goes to the decode
// worker whose cache holds its blocks (least-loaded would alternate), and a worker restarted under
// the same address keeps no stale credit (the router forgets its blocks and follows its new
// events).
TEST_F(XpYd, CacheAwareFollowsTheBlocksAndForgetsARestartedWorker) {
    EventFleet fleet = StartEventFleet();
    ASSERT_TRUE(fleet.ok());
    // References, not a structured binding: clang 14 (the sanitizer builds) cannot capture a
    // binding in a lambda.
    auto &p = fleet.p, &d0 = fleet.d0, &d1 = fleet.d1;
    auto proxy = Proxy("cache-aware");
    ASSERT_TRUE(proxy && FollowsEvents(*proxy, {p.get()}, {d0.get(), d1.get()}));
    const std::vector<int32_t> prompt = RandomPrompt(100, 4242);  // 6 full blocks of 16
    const Json body = CompletionBody(prompt, 4, false);
    const std::vector<Answer> initial = SendAll(proxy->port(), {body}, 1);  // through prefill
    ASSERT_EQ(initial[0].status, 200) << initial[0].body;
    ASSERT_FALSE(initial[0].tokens.empty());
    ServerProcess* holder = Succeeded(*proxy, "decode", *d0) == 1 ? d0.get() : d1.get();
    ServerProcess* other = holder == d0.get() ? d1.get() : d0.get();
    const std::string held = "ferry_router_worker_cached_blocks" + WorkerLabel("decode", *holder);
    ASSERT_TRUE(
        testing::WaitUntil([&] { return proxy->Metric(held) >= 6; }, std::chrono::seconds(10)))
        << proxy->Metric(held);
    for (int i = 0; i < 6; ++i) {
        auto got = SendAll(proxy->port(), {body}, 1);
        ASSERT_EQ(got[0].status, 200) << got[0].body;
        EXPECT_EQ(got[0].tokens, initial[0].tokens) << "repeat " << i;
    }
    EXPECT_EQ(Succeeded(*proxy, "decode", *holder), 7) << "every repeat went where its blocks are";
    EXPECT_EQ(Succeeded(*proxy, "decode", *other), 0);
    // The P/D decision: the holder lacked 4 of 100 prompt tokens (fewer than 16), so the
    // repeats skipped the prefill worker; the holder prefilled the 4 itself, and the answers
    // are the disaggregated one's token for token.
    EXPECT_EQ(proxy->Metric("ferry_proxy_prefill_skipped_total"), 6);
    EXPECT_EQ(Succeeded(*proxy, "prefill", *p), 1);
    EXPECT_GT(holder->Metric("ferry_prompt_tokens_total"), 0);
    EXPECT_LE(holder->Metric("ferry_prompt_tokens_total"), 6 * 16) << "the tails only";
    // Restarted under the same address (a new process, its cache empty, its events elsewhere):
    // its old blocks are forgotten, and the router is in step with its new events.
    ASSERT_TRUE(holder->Restart().ok());
    EXPECT_TRUE(
        testing::WaitUntil([&] { return proxy->Metric(held) == 0; }, std::chrono::seconds(15)))
        << proxy->Metric(held);
    EXPECT_TRUE(proxy->WaitMetric("ferry_router_worker_kv_in_sync" + WorkerLabel("decode", *holder),
                                  1, std::chrono::seconds(15)));
    EXPECT_EQ(proxy->Metric("ferry_router_kv_event_malformed_total"), 0);
}

// The discovery store (`ferry discovery`, a process) SIGKILLed under a running P/D deployment
// and started again on its address, empty, as a store without persistence comes back: while it
// is down the proxy routes to the workers it knew and every answer equals colocated; the workers
// register again, the proxy follows the new store, and a decode worker that starts after the
// restart is routed to.
TEST_F(XpYd, AStoreRestartedUnderARunningDeploymentLosesNoRequest) {
    auto start_store = [](const std::string& listen) {
        std::string line;
        auto p = ChildProcess::Start({FERRY_BIN, "discovery", "--listen", listen},
                                     "ferry discovery: store at ", &line);
        EXPECT_TRUE(p.ok()) << p.status().ToString();
        return std::make_pair(p.ok() ? std::move(p).value() : ChildProcess(),
                              line.substr(0, line.find(' ')));
    };
    auto [first, url] = start_store("127.0.0.1:0");
    ASSERT_FALSE(url.empty());
    ChildProcess store = std::move(first);
    url_ = url;  // the workers and the proxy use this store, not the fixture's
    Fleet fleet;
    ASSERT_TRUE(StartFleet(1, 2, &fleet));
    auto proxy = Proxy("round-robin");
    ASSERT_TRUE(proxy && Routes(*proxy, fleet.prefill, fleet.decode));
    Want();
    ExpectColocated(SendAll(proxy->port(), Bodies(), 8), "before the restart");
    store.Kill();
    ExpectColocated(SendAll(proxy->port(), Bodies(), 8), "the store down");
    auto [second, again] = start_store(url.substr(url.find("//") + 2));
    ASSERT_EQ(again, url);
    store = std::move(second);
    ExpectColocated(SendAll(proxy->port(), Bodies(), 8), "the store back, empty");
    // The workers are in the new store again (they register again), and a newcomer is routed to.
    auto late = Worker("decode");
    ASSERT_TRUE(late);
    std::vector<ServerProcess*> decode = fleet.decode;
    decode.push_back(late.get());
    ASSERT_TRUE(Routes(*proxy, fleet.prefill, decode));
    ExpectColocated(SendAll(proxy->port(), Bodies(), 8), "with a worker that came later");
    EXPECT_GE(Succeeded(*proxy, "decode", *late), 1);
    EXPECT_EQ(proxy->Metric("ferry_proxy_requests_failed_total"), 0);
    for (ServerProcess* w : fleet.prefill) EXPECT_TRUE(w->WaitMetric("ferry_kv_blocks_used", 0));
    for (ServerProcess* w : decode) EXPECT_EQ(w->Metric("ferry_prompt_tokens_total"), 0);
}

// A router restarted mid-run: it replays each worker's events from the start, so its credit is
// back at once (the repeat goes to the holder), and blocks evicted while it was down are not
// credited: its count equals that of a router that ran all along.
TEST_F(XpYd, ARestartedRouterHasItsCreditBackAndNoStaleCredit) {
    EventFleet fleet = StartEventFleet({"--num-kv-blocks", "24"});  // small decode caches
    ASSERT_TRUE(fleet.ok());
    // References, not a structured binding: clang 14 (the sanitizer builds) cannot capture a
    // binding in a lambda.
    auto &p = fleet.p, &d0 = fleet.d0, &d1 = fleet.d1;
    auto observer = Proxy("cache-aware");  // runs all along; sent nothing
    auto proxy = Proxy("cache-aware");
    ASSERT_TRUE(observer && proxy);
    auto in_sync = [&](const ServerProcess& px) {
        return FollowsEvents(px, {p.get()}, {d0.get(), d1.get()});
    };
    ASSERT_TRUE(in_sync(*observer) && in_sync(*proxy));
    const Json body = CompletionBody(RandomPrompt(100, 777), 4, false);  // 6 full blocks
    auto first = SendAll(proxy->port(), {body}, 1);
    ASSERT_EQ(first[0].status, 200) << first[0].body;
    ServerProcess* holder = Succeeded(*proxy, "decode", *d0) == 1 ? d0.get() : d1.get();
    const std::string held = "ferry_router_worker_cached_blocks" + WorkerLabel("decode", *holder);
    ASSERT_TRUE(
        testing::WaitUntil([&] { return observer->Metric(held) >= 6; }, std::chrono::seconds(10)));

    proxy.reset();  // the router goes; a new one starts with nothing but the workers' replay
    proxy = Proxy("cache-aware");
    ASSERT_TRUE(proxy && in_sync(*proxy));
    EXPECT_TRUE(testing::WaitUntil([&] { return proxy->Metric(held) == observer->Metric(held); },
                                   std::chrono::seconds(10)))
        << proxy->Metric(held) << " vs " << observer->Metric(held);
    auto again = SendAll(proxy->port(), {body}, 1);
    ASSERT_EQ(again[0].status, 200) << again[0].body;
    EXPECT_EQ(again[0].tokens, first[0].tokens);
    EXPECT_EQ(Succeeded(*proxy, "decode", *holder), 1) << "the repeat went where its blocks are";
    EXPECT_EQ(proxy->Metric("ferry_proxy_prefill_skipped_total"), 1);

    // Down again; meanwhile the holder evicts the prompt's blocks (other prompts sent to it
    // directly fill its 24 blocks). The next router credits what the holder has now, as the
    // router that ran all along does.
    proxy.reset();
    const double before = observer->Metric(held);
    for (int i = 0; i < 4; ++i) {
        auto r = SendAll(holder->port(), {CompletionBody(RandomPrompt(100, 900 + i), 4, false)}, 1);
        ASSERT_EQ(r[0].status, 200) << r[0].body;
    }
    proxy = Proxy("cache-aware");
    ASSERT_TRUE(proxy && in_sync(*proxy));
    EXPECT_TRUE(testing::WaitUntil([&] { return proxy->Metric(held) == observer->Metric(held); },
                                   std::chrono::seconds(10)))
        << proxy->Metric(held) << " vs " << observer->Metric(held) << " (before " << before << ")";
    // The four prompts' 24 full blocks filled the cache: the first prompt's are gone, and the
    // router credits none of them, so its repeat is prefilled by the prefill worker again (a
    // stale credit would skip it); the answer is still the same.
    auto last = SendAll(proxy->port(), {body}, 1);
    ASSERT_EQ(last[0].status, 200) << last[0].body;
    EXPECT_EQ(last[0].tokens, first[0].tokens);
    EXPECT_EQ(proxy->Metric("ferry_proxy_prefill_skipped_total"), 0);
    EXPECT_EQ(Succeeded(*proxy, "prefill", *p), 1);
    EXPECT_EQ(proxy->Metric("ferry_router_kv_event_malformed_total"), 0);
}

// Text prompts and chat messages: a proxy given the workers' model file (--tokenizer) tokenizes
// them as the workers do, so cache-aware routing and the P/D decision see their blocks; a proxy
// without it scores only token-id prompts, and the same repeats go through the prefill worker.
TEST_F(XpYd, CacheAwareScoresTextAndChatWithTheWorkersTokenizer) {
    EventFleet fleet = StartEventFleet();
    ASSERT_TRUE(fleet.ok());
    // References, not a structured binding: clang 14 (the sanitizer builds) cannot capture a
    // binding in a lambda.
    auto &p = fleet.p, &d0 = fleet.d0, &d1 = fleet.d1;
    auto plain = Proxy("cache-aware");
    auto tokenizing =
        StartOrDie({"proxy", "--port", "0", "--store", url_, "--policy", "cache-aware",
                    "--load-poll-ms", "100", "--tokenizer", model_->path()});
    ASSERT_TRUE(plain && tokenizing);
    for (ServerProcess* px : {plain.get(), tokenizing.get()}) {
        ASSERT_TRUE(FollowsEvents(*px, {p.get()}, {d0.get(), d1.get()}));
    }
    // The answer's text, and the decode worker that served it.
    auto send = [&](ServerProcess& px, const std::string& path, const Json& body) {
        const double before0 = Succeeded(px, "decode", *d0);
        auto r = http::Fetch(Post(px.port(), body, path));
        EXPECT_TRUE(r.ok() && r->status == 200) << (r.ok() ? r->body : r.status().ToString());
        Json j = r.ok() ? Json::parse(r->body, nullptr, false) : Json();
        std::string text;
        if (j.is_object() && j.contains("choices")) {
            const Json& c = j["choices"][0];
            text = c.contains("message") ? c["message"]["content"].get<std::string>()
                                         : c["text"].get<std::string>();
        }
        return std::pair{text, Succeeded(px, "decode", *d0) > before0 ? d0.get() : d1.get()};
    };
    std::string words;
    for (int i = 0; words.size() < 140; ++i) words += fmt::format("word{} ", i * 7919 % 1000);
    const Json text = {
        {"prompt", words}, {"max_tokens", 4}, {"temperature", 0}, {"ignore_eos", true}};
    const Json chat = {{"messages", {{{"role", "user"}, {"content", "chat: " + words}}}},
                       {"max_tokens", 4},
                       {"temperature", 0},
                       {"ignore_eos", true}};
    for (const auto& [path, body] :
         {std::pair{"/v1/completions", text}, std::pair{"/v1/chat/completions", chat}}) {
        SCOPED_TRACE(path);
        const double skipped = tokenizing->Metric("ferry_proxy_prefill_skipped_total");
        auto cached = [&](const ServerProcess& w) {
            return tokenizing->Metric("ferry_router_worker_cached_blocks" +
                                      WorkerLabel("decode", w));
        };
        // What the router knew each decoder held before: the first path's blocks are there
        // already, so the wait below is for this prompt's own blocks (waiting for an absolute
        // count let a repeat be routed before they were known: a flaky test, not a routing bug).
        const std::map<const ServerProcess*, double> before = {{d0.get(), cached(*d0)},
                                                               {d1.get(), cached(*d1)}};
        const auto [want, holder] = send(*tokenizing, path, body);
        EXPECT_EQ(tokenizing->Metric("ferry_proxy_prefill_skipped_total"), skipped)
            << "the first time, no worker holds it";
        const ServerProcess* const h = holder;  // clang 14 cannot capture a binding
        ASSERT_TRUE(testing::WaitUntil([&] { return cached(*h) >= before.at(h) + 8; },
                                       std::chrono::seconds(10)));
        for (int i = 0; i < 3; ++i) {
            const auto [got, served] = send(*tokenizing, path, body);
            EXPECT_EQ(got, want) << "repeat " << i;
            EXPECT_EQ(served, holder) << "repeat " << i << " went where its blocks are";
        }
        EXPECT_EQ(tokenizing->Metric("ferry_proxy_prefill_skipped_total"), skipped + 3);
        // Without the tokenizer the same repeats are not scored: through the prefill worker.
        const double plain_prefills = Succeeded(*plain, "prefill", *p);
        for (int i = 0; i < 2; ++i) EXPECT_EQ(send(*plain, path, body).first, want);
        EXPECT_EQ(plain->Metric("ferry_proxy_prefill_skipped_total"), 0);
        EXPECT_EQ(Succeeded(*plain, "prefill", *p), plain_prefills + 2);
    }
}

}  // namespace
}  // namespace ferry
