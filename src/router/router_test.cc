// The router library alone: its binary links ferry_router (http, core, discovery) and GoogleTest,
// nothing else, so the router is proven to need no model, KV or engine.
#include "router/router.h"

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <zmq.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <thread>

#include "core/msgpack.h"
#include "discovery/worker_directory.h"
#include "ferry/discovery.h"
#include "router/driver.h"
#include "router/kv_index.h"
#include "router/membership.h"
#include "router/protocol.h"
#include "router/quarantine.h"
#include "router/worker_call.h"
#include "schema/kv_transfer_params.h"
#include "testing/zmtp_liar.h"

namespace ferry::router {
namespace {

using Json = nlohmann::json;

http::Endpoint Ep(int port) { return {"127.0.0.1", static_cast<uint16_t>(port)}; }

TEST(Router, RoundRobinTakesEachRolesWorkersInTurn) {
    Router r;
    for (int i = 0; i < 3; ++i) r.AddWorker(Role::kPrefill, Ep(1000 + i));
    for (int i = 0; i < 2; ++i) r.AddWorker(Role::kDecode, Ep(2000 + i));
    EXPECT_EQ(r.AddWorker(Role::kPrefill, Ep(1001)), 1u) << "a known worker is not added twice";
    std::vector<size_t> p, d;
    for (int i = 0; i < 6; ++i) {
        Result<Ticket> tp = r.Route(Role::kPrefill, {"x", 0});
        Result<Ticket> td = r.Route(Role::kDecode, {"x", 0});
        ASSERT_TRUE(tp.ok() && td.ok());
        p.push_back(tp->worker());
        d.push_back(td->worker());
        tp->End(Outcome::kSucceeded);
        td->End(Outcome::kSucceeded);
    }
    EXPECT_EQ(p, (std::vector<size_t>{0, 1, 2, 0, 1, 2}));
    EXPECT_EQ(d, (std::vector<size_t>{0, 1, 0, 1, 0, 1}));
    EXPECT_STREQ(r.policy_name(), "round-robin");
}

TEST(Router, ATicketCountsItsRequestUntilItEndsOnEveryPath) {
    Router r;
    r.AddWorker(Role::kDecode, Ep(2000));
    {
        Result<Ticket> a = r.Route(Role::kDecode, {"a", 100});
        Result<Ticket> b = r.Route(Role::kDecode, {"b", 20});
        ASSERT_TRUE(a.ok() && b.ok());
        EXPECT_EQ(r.Workers(Role::kDecode)[0].in_flight, 2u);
        EXPECT_EQ(r.Workers(Role::kDecode)[0].in_flight_tokens, 120u);
        Ticket moved = std::move(*a);  // a move carries the count, it does not end it
        EXPECT_FALSE(a->valid());
        EXPECT_EQ(r.Workers(Role::kDecode)[0].in_flight, 2u);
        moved.End(Outcome::kClientGone);
        moved.End(Outcome::kSucceeded);  // ends once
        EXPECT_EQ(r.Workers(Role::kDecode)[0].in_flight, 1u);
        EXPECT_EQ(r.Workers(Role::kDecode)[0].in_flight_tokens, 20u);
        EXPECT_EQ(r.Workers(Role::kDecode)[0].succeeded, 0u);
    }  // b is dropped without an ending: still released, counted as abandoned
    WorkerState w = r.Workers(Role::kDecode)[0];
    EXPECT_EQ(w.in_flight, 0u);
    EXPECT_EQ(w.in_flight_tokens, 0u);
    EXPECT_EQ(w.routed, 2u);
    const std::string m = r.RenderMetrics();
    EXPECT_NE(m.find("ferry_router_worker_requests_total{role=\"decode\",worker=\"127.0.0.1:2000\","
                     "outcome=\"abandoned\"} 1"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("outcome=\"client_gone\"} 1"), std::string::npos) << m;
    EXPECT_NE(m.find("ferry_router_worker_requests_in_flight{role=\"decode\",worker=\"127.0.0.1:"
                     "2000\"} 0"),
              std::string::npos)
        << m;
}

TEST(Router, LeastLoadedPicksTheFewestRequestsThenTheFewestTokens) {
    RouterConfig c;
    c.policy = MakeLeastLoaded();
    Router r(std::move(c));
    for (int i = 0; i < 3; ++i) r.AddWorker(Role::kPrefill, Ep(1000 + i));
    Result<Ticket> a = r.Route(Role::kPrefill, {"a", 5000});  // worker 0: a long prompt
    Result<Ticket> b = r.Route(Role::kPrefill, {"b", 10});    // worker 1
    Result<Ticket> c2 = r.Route(Role::kPrefill, {"c", 10});   // worker 2
    ASSERT_TRUE(a.ok() && b.ok() && c2.ok());
    EXPECT_EQ(a->worker(), 0u);
    EXPECT_NE(b->worker(), 0u);
    EXPECT_NE(c2->worker(), 0u);
    // All hold one request; worker 0 the most tokens: the next goes elsewhere.
    Result<Ticket> d = r.Route(Role::kPrefill, {"d", 10});
    ASSERT_TRUE(d.ok());
    EXPECT_NE(d->worker(), 0u);
    // Worker 0's long request ends: it is now the least loaded.
    a->End(Outcome::kSucceeded);
    Result<Ticket> e = r.Route(Role::kPrefill, {"e", 10});
    ASSERT_TRUE(e.ok());
    EXPECT_EQ(e->worker(), 0u);
    // A burst of long one-token requests spreads: never two on one worker while one is idle.
    RouterConfig c3;
    c3.policy = MakeLeastLoaded();
    Router burst(std::move(c3));
    for (int i = 0; i < 3; ++i) burst.AddWorker(Role::kPrefill, Ep(1000 + i));
    std::vector<Ticket> held;
    for (int i = 0; i < 9; ++i) held.push_back(*burst.Route(Role::kPrefill, {"x", 32000}));
    for (const WorkerState& w : burst.Workers(Role::kPrefill)) EXPECT_EQ(w.in_flight, 3u);
}

TEST(Router, AWorkerThatKeepsFailingIsSkippedUntilItsProbeAndBackOnASuccess) {
    RouterConfig c;
    c.unhealthy_after = 2;
    c.probe_after = std::chrono::hours(1);
    auto r = std::make_shared<Router>(std::move(c));
    r->AddWorker(Role::kDecode, Ep(2000));
    r->AddWorker(Role::kDecode, Ep(2001));
    // Worker 0 fails twice in a row; a 4xx in between does not count against it.
    for (Outcome o : {Outcome::kWorkerFailed, Outcome::kRefused, Outcome::kWorkerFailed,
                      Outcome::kWorkerFailed}) {
        Result<Ticket> t = r->Route(Role::kDecode, {"x", 0});
        while (t->worker() != 0) {
            t->End(Outcome::kSucceeded);
            t = r->Route(Role::kDecode, {"x", 0});
        }
        t->End(o);
    }
    EXPECT_FALSE(r->Workers(Role::kDecode)[0].healthy);
    EXPECT_EQ(r->Workers(Role::kDecode)[0].failed, 3u);
    EXPECT_EQ(r->Workers(Role::kDecode)[0].refused, 1u);
    for (int i = 0; i < 5; ++i) {
        Result<Ticket> t = r->Route(Role::kDecode, {"x", 0});
        EXPECT_EQ(t->worker(), 1u) << "an unhealthy worker gets nothing while another is healthy";
        t->End(Outcome::kSucceeded);
    }
    // With no healthy worker left, requests still go somewhere.
    Router alone({.policy = nullptr, .unhealthy_after = 1, .probe_after = std::chrono::hours(1)});
    alone.AddWorker(Role::kDecode, Ep(2000));
    alone.Route(Role::kDecode, {"x", 0})->End(Outcome::kWorkerFailed);
    EXPECT_FALSE(alone.Workers(Role::kDecode)[0].healthy);
    Result<Ticket> t = alone.Route(Role::kDecode, {"x", 0});
    ASSERT_TRUE(t.ok());
    t->End(Outcome::kSucceeded);
    EXPECT_TRUE(alone.Workers(Role::kDecode)[0].healthy) << "a success makes it healthy again";
    // Past its probe time an unhealthy worker is tried again.
    Router probed({.policy = nullptr, .unhealthy_after = 1, .probe_after = std::chrono::hours(0)});
    probed.AddWorker(Role::kDecode, Ep(2000));
    probed.AddWorker(Role::kDecode, Ep(2001));
    probed.Route(Role::kDecode, {"x", 0})->End(Outcome::kWorkerFailed);
    EXPECT_TRUE(probed.Workers(Role::kDecode)[0].healthy);
}

TEST(Router, NoWorkerAndUnknownPoliciesAreErrorsThatSaySo) {
    Router r;
    Result<Ticket> t = r.Route(Role::kPrefill, {"x", 0});
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), Code::kUnavailable);
    EXPECT_NE(t.status().message().find("no prefill worker"), std::string::npos);
    auto p = MakePolicy("random");
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), Code::kInvalidArgument);
    EXPECT_NE(p.status().message().find("round-robin, least-loaded, power-of-two"),
              std::string::npos);
    EXPECT_STREQ((*MakePolicy("least-loaded"))->name(), "least-loaded");
    EXPECT_STREQ((*MakePolicy("power-of-two"))->name(), "power-of-two");
}

// A worker that leaves gets no new request while its requests in flight end on it as usual; back,
// it is a fresh worker (nothing of its health, agent or report kept). With every member gone the
// router says so instead of routing to a worker that left.
TEST(Router, AWorkerThatLeftGetsNothingNewAndComesBackFresh) {
    Router r({.policy = nullptr, .unhealthy_after = 1, .probe_after = std::chrono::hours(1)});
    r.AddWorker(Role::kDecode, Ep(2000));
    r.AddWorker(Role::kDecode, Ep(2001));
    r.SetAgent(Role::kDecode, 0, {{"d0", "127.0.0.1", 7000}, 1});
    r.Route(Role::kDecode, {"x", 0})->End(Outcome::kWorkerFailed);  // worker 0 unhealthy
    Result<Ticket> held = r.Route(Role::kDecode, {"held", 10});
    ASSERT_EQ(held->worker(), 1u);
    EXPECT_TRUE(r.RemoveWorker(Role::kDecode, Ep(2001)));
    EXPECT_FALSE(r.RemoveWorker(Role::kDecode, Ep(2001))) << "not a member any more";
    EXPECT_EQ(r.members(Role::kDecode), 1u);
    EXPECT_EQ(r.size(Role::kDecode), 2u) << "its slot stays while its ticket lives";
    for (int i = 0; i < 4; ++i) {
        Result<Ticket> t = r.Route(Role::kDecode, {"x", 0});
        EXPECT_EQ(t->worker(), 0u) << "the unhealthy member, not the one that left";
        t->End(Outcome::kRefused);
    }
    held->End(Outcome::kSucceeded);
    EXPECT_EQ(r.Workers(Role::kDecode)[1].in_flight, 0u);
    EXPECT_EQ(r.Workers(Role::kDecode)[1].succeeded, 1u);
    r.RemoveWorker(Role::kDecode, Ep(2000));
    Result<Ticket> none = r.Route(Role::kDecode, {"x", 0});
    ASSERT_FALSE(none.ok());
    EXPECT_EQ(none.status().code(), Code::kUnavailable);
    EXPECT_EQ(r.AddWorker(Role::kDecode, Ep(2000)), 0u) << "back in its old slot";
    WorkerState back = r.Workers(Role::kDecode)[0];
    EXPECT_TRUE(back.member);
    EXPECT_TRUE(back.healthy);
    EXPECT_EQ(back.consecutive_failures, 0);
    EXPECT_FALSE(back.agent) << "a restarted worker's agent is read again";
    // Added as not answering (as from the store): not routed to while another answers.
    r.AddWorker(Role::kDecode, Ep(2001), /*answering=*/false);
    for (int i = 0; i < 3; ++i) {
        Result<Ticket> t = r.Route(Role::kDecode, {"x", 0});
        EXPECT_EQ(t->worker(), 0u);
        t->End(Outcome::kSucceeded);
    }
    r.ReportAnswered(Role::kDecode, 1, std::nullopt);
    std::set<size_t> seen;
    for (int i = 0; i < 4; ++i) seen.insert(r.Route(Role::kDecode, {"x", 0})->worker());
    EXPECT_EQ(seen, (std::set<size_t>{0, 1})) << "answering, it takes requests";
    // Three unanswered polls in a row and it is avoided again.
    for (int i = 0; i < 3; ++i) r.ReportUnanswered(Role::kDecode, 1);
    EXPECT_FALSE(r.Workers(Role::kDecode)[1].answering);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(r.Route(Role::kDecode, {"x", 0})->worker(), 0u);
}

// The load a policy compares reconciles the router's own count with what the worker reports:
// requests sent by another router (or straight to the worker) count, and a report that went
// stale stops counting.
TEST(Router, LeastLoadedWeighsWhatWorkersReportBesideItsOwnCount) {
    RouterConfig rc;
    rc.policy = MakeLeastLoaded();
    rc.report_ttl = std::chrono::milliseconds(300);
    Router r(std::move(rc));
    for (int i = 0; i < 3; ++i) r.AddWorker(Role::kPrefill, Ep(1000 + i));
    // Worker 0 is busy with another router's requests; worker 1 reports a fuller KV cache.
    r.ReportAnswered(Role::kPrefill, 0, ReportedLoad{3, 2, 0.5});
    r.ReportAnswered(Role::kPrefill, 1, ReportedLoad{0, 0, 0.9});
    r.ReportAnswered(Role::kPrefill, 2, ReportedLoad{0, 0, 0.1});
    EXPECT_EQ(r.Workers(Role::kPrefill)[0].Load(), 5.0);
    std::vector<Ticket> t;
    t.push_back(std::move(*r.Route(Role::kPrefill, {"a", 0})));
    EXPECT_EQ(t.back().worker(), 2u) << "the lower KV usage breaks the tie";
    t.push_back(std::move(*r.Route(Role::kPrefill, {"b", 0})));
    EXPECT_EQ(t.back().worker(), 1u);
    // Both now hold one of ours; a report of 1 running there is the same request, not another.
    r.ReportAnswered(Role::kPrefill, 1, ReportedLoad{0, 1, 0.9});
    EXPECT_EQ(r.Workers(Role::kPrefill)[1].Load(), 1.0);
    for (int i = 0; i < 4; ++i) {
        t.push_back(std::move(*r.Route(Role::kPrefill, {"c", 0})));
        EXPECT_NE(t.back().worker(), 0u) << "worker 0's own report keeps it last";
    }
    // Its report goes stale (no poll answered since): its load is the router's count alone (0).
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    EXPECT_FALSE(r.Workers(Role::kPrefill)[0].reported);
    EXPECT_EQ(r.Route(Role::kPrefill, {"d", 0})->worker(), 0u);
    const std::string m = r.RenderMetrics();
    EXPECT_NE(m.find("ferry_router_worker_load{role=\"prefill\",worker=\"127.0.0.1:1001\"} 3"),
              std::string::npos)
        << m;
}

// Power of two: always the less loaded of the two it draws, so the most loaded worker never gets a
// request while two others are less loaded, and every other worker gets some.
TEST(Router, PowerOfTwoNeverPicksTheMostLoadedOfItsTwo) {
    RouterConfig rc;
    rc.policy = MakePowerOfTwo(42);
    Router r(std::move(rc));
    for (int i = 0; i < 4; ++i) r.AddWorker(Role::kDecode, Ep(2000 + i));
    r.ReportAnswered(Role::kDecode, 3, ReportedLoad{50, 8, 1.0});
    std::map<size_t, int> count;
    std::vector<Ticket> held;
    for (int i = 0; i < 60; ++i) {
        held.push_back(std::move(*r.Route(Role::kDecode, {"x", 1})));
        ++count[held.back().worker()];
    }
    EXPECT_EQ(count[3], 0) << "58 reported requests: never the less loaded of two";
    for (size_t w = 0; w < 3; ++w) {
        EXPECT_GE(count[w], 10) << "worker " << w;
        EXPECT_LE(count[w], 30) << "worker " << w;
    }
}

TEST(RouterMembership, ParsesVllmsLoadGaugesAndRefusesWhatIsNotANumber) {
    const char* text =
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        "vllm:num_requests_running{engine=\"0\",model_name=\"m}\"} 3.0\n"
        "vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2\n"
        "vllm:num_requests_running_created 1.7e9\n"
        "vllm:num_requests_waiting{engine=\"0\"} 4 1700000000000\n"
        "vllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n"
        "vllm:kv_cache_usage_perc{engine=\"1\"} 0.75\n"
        "vllm:gpu_cache_usage_perc 0.99\n"
        "ferry_num_requests_running 100\n";
    Result<ReportedLoad> l = ParseWorkerLoad(text);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    EXPECT_EQ(l->running, 5.0) << "summed over engines; a label value with '}' is no end";
    EXPECT_EQ(l->waiting, 4.0) << "a timestamp after the value is not the value";
    EXPECT_EQ(l->kv_usage, 0.75) << "the fullest engine's";
    EXPECT_EQ(ParseWorkerLoad("ferry_num_requests_running 1\n").status().code(), Code::kNotFound);
    for (const char* bad : {"vllm:num_requests_running NaN\n", "vllm:num_requests_running -1\n",
                            "vllm:num_requests_waiting{a=\"b\" 1\n",
                            "vllm:num_requests_waiting 1x\n", "vllm:kv_cache_usage_perc \n"}) {
        Result<ReportedLoad> b = ParseWorkerLoad(bad);
        ASSERT_FALSE(b.ok()) << bad;
        EXPECT_EQ(b.status().code(), Code::kInvalidArgument) << bad;
        EXPECT_NE(b.status().message().find("vllm:"), std::string::npos) << b.status().ToString();
    }
}

TEST(RouterProtocol, BodiesAndParamsAreVllmsAndFerrysFields) {
    Json pb = PrefillBody({{"prompt", "hi"},
                           {"stream", true},
                           {"max_tokens", 50},
                           {"max_completion_tokens", 50},
                           {"stream_options", {{"include_usage", true}}},
                           {"min_tokens", 3}});
    EXPECT_EQ(pb["stream"], false);
    EXPECT_EQ(pb["max_tokens"], 1);
    EXPECT_EQ(pb["max_completion_tokens"], 1);
    EXPECT_FALSE(pb.contains("stream_options"));
    EXPECT_FALSE(pb.contains("min_tokens"));
    EXPECT_EQ(pb["prompt"], "hi");
    Result<AgentInfo> ok = ParseAgentInfo(200, R"({"engine_id":"e","port":7001})", Ep(9000));
    ASSERT_TRUE(ok.ok());
    EXPECT_EQ(ok->host, "127.0.0.1") << "no host: the worker's";
    EXPECT_EQ(ok->tp_size, 1);
    for (auto [status, body] : std::vector<std::pair<int, std::string>>{
             {404, R"({"engine_id":"e","port":7001})"},
             {200, "not json"},
             {200, R"({"port":7001})"},
             {200, R"({"engine_id":"e","port":"7001"})"},
             {200, R"({"engine_id":"e","port":70000})"},
             {200, R"({"engine_id":"e","port":7001,"tp_size":0})"}}) {
        Result<AgentInfo> bad = ParseAgentInfo(status, body, Ep(9000));
        ASSERT_FALSE(bad.ok()) << body;
        EXPECT_EQ(bad.status().code(), Code::kUnavailable);
        EXPECT_NE(bad.status().message().find("127.0.0.1:9000"), std::string::npos);
    }
    EXPECT_EQ(OutcomeOfStatus(200), Outcome::kSucceeded);
    EXPECT_EQ(OutcomeOfStatus(400), Outcome::kRefused);
    EXPECT_EQ(OutcomeOfStatus(429), Outcome::kWorkerFailed);
    EXPECT_EQ(OutcomeOfStatus(503), Outcome::kWorkerFailed);
    http::Reply e = ErrorReply(502, "boom", "rid-1");
    Json ej = Json::parse(e.body);
    EXPECT_EQ(ej["error"]["request_id"], "rid-1");
    EXPECT_EQ(ej["error"]["type"], "server_error");
    EXPECT_EQ(ej["error"]["code"], 502);
    EXPECT_TRUE(ej["error"]["param"].is_null());
    ASSERT_NE(http::FindHeader(e.headers, "X-Request-Id"), nullptr);
    // One writer for every server: the type follows the status, a named code and param stay.
    for (auto [status, type] :
         std::vector<std::pair<int, std::string>>{{400, "invalid_request_error"},
                                                  {401, "authentication_error"},
                                                  {403, "permission_error"},
                                                  {404, "not_found_error"},
                                                  {409, "conflict_error"},
                                                  {413, "invalid_request_error"},
                                                  {422, "invalid_request_error"},
                                                  {429, "rate_limit_error"},
                                                  {503, "service_unavailable"},
                                                  {504, "server_error"}}) {
        EXPECT_EQ(Json::parse(ErrorReply(status, "x").body)["error"]["type"], type) << status;
    }
    e = ErrorReply(400, OpenAiError{"bad image", "messages[0].content[1].url", "invalid_image"});
    ej = Json::parse(e.body);
    EXPECT_EQ(ej["error"]["param"], "messages[0].content[1].url");
    EXPECT_EQ(ej["error"]["code"], "invalid_image");
    EXPECT_FALSE(ej["error"].contains("request_id"));
    EXPECT_EQ(http::FindHeader(e.headers, "X-Request-Id"), nullptr);
    // Mid-stream: the same body as one event, then the stream's end.
    const std::string ev = ErrorEvent(504, {"decode worker h:1: too slow"}, "rid-2");
    const std::string data = "data: ";
    ASSERT_EQ(ev.rfind(data, 0), 0u) << ev;
    const std::string tail = "\n\ndata: [DONE]\n\n";
    ASSERT_GT(ev.size(), data.size() + tail.size());
    ASSERT_EQ(ev.substr(ev.size() - tail.size()), tail) << ev;
    EXPECT_EQ(Json::parse(ev.substr(data.size(), ev.size() - data.size() - tail.size())),
              Json::parse(ErrorReply(504, "decode worker h:1: too slow", "rid-2").body));
}

// A worker's OpenAI server as the driver sees it: records what it got, answers as told.
struct FakeWorker {
    std::mutex mu;
    std::vector<http::Request> got;
    int status = 200;
    Json answer = Json::object();
    // Runs before each answer, outside the lock (a push decoder waits for its prefill here);
    // the answer is read after it.
    std::function<void(const http::Request&)> before_answer;
    // When set and it returns true, it answered the exchange itself (a stream).
    std::function<bool(const std::shared_ptr<http::Exchange>&)> take_over;
    std::unique_ptr<http::Server> server;

    explicit FakeWorker(std::string name) {
        http::ServerConfig c;
        c.name = std::move(name);
        c.io_threads = 1;
        auto handler = [this](std::shared_ptr<http::Exchange> ex) {
            {
                std::lock_guard lock(mu);
                got.push_back(ex->request());
            }
            if (before_answer) before_answer(ex->request());
            if (take_over && take_over(ex)) return;
            int s;
            Json a;
            {
                std::lock_guard lock(mu);
                s = status;
                a = answer;
            }
            ex->Reply({s, "application/json", a.dump(), {}});
        };
        std::vector<http::Route> routes = {{"POST", "/v1/completions", handler, 0},
                                           {"GET", "/v1/kv/agent", handler, 0}};
        server = std::move(http::Server::Start(c, routes)).value();
    }
    http::Endpoint ep() const { return Ep(server->port()); }
    std::vector<http::Request> Got() {
        std::lock_guard lock(mu);
        return got;
    }
};

struct DriverHarness {
    FakeWorker prefill{"prefill"}, decode{"decode"};
    std::shared_ptr<Router> router;
    std::unique_ptr<http::Client> client = http::Client::Create(1);
    std::shared_ptr<Driver> driver;
    std::unique_ptr<http::Server> front;

    explicit DriverHarness(Protocol protocol, RouterConfig rc = {},
                           std::function<void(DriverConfig*)> tweak = nullptr)
        : router(std::make_shared<Router>(std::move(rc))) {
        router->AddWorker(Role::kPrefill, prefill.ep());
        router->AddWorker(Role::kDecode, decode.ep());
        DriverConfig dc;
        dc.protocol = protocol;
        dc.worker_timeout = dc.prefill_timeout = std::chrono::seconds(10);
        dc.router_token = "tok";
        if (tweak) tweak(&dc);
        driver = Driver::Create(std::move(dc), router, client.get());
        http::ServerConfig c;
        c.name = "front";
        c.io_threads = 1;
        front = std::move(http::Server::Start(c, {{"POST", "/v1/completions",
                                                   [this](std::shared_ptr<http::Exchange> ex) {
                                                       driver->Handle(ex, "/v1/completions");
                                                   },
                                                   0}}))
                    .value();
    }
    ~DriverHarness() {
        front->Stop();
        client.reset();
    }
    Result<http::ClientReply> Post(Json body, std::string request_id = "") {
        http::ClientRequest r;
        r.method = "POST";
        r.host = "127.0.0.1";
        r.port = front->port();
        r.target = "/v1/completions";
        r.body = body.dump();
        r.timeout = std::chrono::seconds(10);
        if (!request_id.empty()) r.headers.push_back({"X-Request-Id", request_id});
        return http::Fetch(r);
    }
    // Tickets end just after the client's answer is sent: wait for them.
    void ExpectNothingInFlight() {
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        for (Role role : {Role::kPrefill, Role::kDecode}) {
            while (router->Workers(role)[0].in_flight != 0 &&
                   std::chrono::steady_clock::now() < deadline) {
                std::this_thread::yield();
            }
            EXPECT_EQ(router->Workers(role)[0].in_flight, 0u) << RoleName(role);
        }
    }
};

const std::string* Header(const http::Request& r, const char* name) { return r.Find(name); }

// A push decoder answers only once its KV came, i.e. after the prefill worker got the request of
// the same transfer id (else the proxy, done, would cancel a prefill call not yet sent).
void DecoderWaitsForItsPrefill(DriverHarness& h) {
    h.decode.before_answer = [&h](const http::Request& r) {
        const Json xid = Json::parse(r.body)["kv_transfer_params"]["transfer_id"];
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (std::chrono::steady_clock::now() < deadline) {
            for (const http::Request& p : h.prefill.Got()) {
                if (p.method != "POST") continue;
                if (Json::parse(p.body)["kv_transfer_params"]["transfer_id"] == xid) return;
            }
            std::this_thread::yield();
        }
    };
}

TEST(RouterDriver, PullSendsThePrefillWorkersParamsToTheDecoderUnderOneRequestId) {
    DriverHarness h(Protocol::kPull);
    h.prefill.answer = {{"kv_transfer_params", {{"remote_engine_id", "p0"}, {"nonce", "n"}}}};
    h.decode.answer = {{"choices", Json::array({{{"text", "ok"}}})}};
    Result<http::ClientReply> got = h.Post({{"prompt", {1, 2, 3}}, {"max_tokens", 4}}, "req-7");
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->status, 200);
    EXPECT_EQ(Json::parse(got->body)["choices"][0]["text"], "ok");
    std::vector<http::Request> p = h.prefill.Got(), d = h.decode.Got();
    ASSERT_EQ(p.size(), 1u);
    ASSERT_EQ(d.size(), 1u);
    Json pb = Json::parse(p[0].body), db = Json::parse(d[0].body);
    EXPECT_EQ(pb["max_tokens"], 1);
    EXPECT_EQ(pb["kv_transfer_params"], schema::PullPrefillRequestParams());
    EXPECT_EQ(db["max_tokens"], 4);
    EXPECT_EQ(db["kv_transfer_params"]["remote_engine_id"], "p0");
    for (const http::Request& r : {p[0], d[0]}) {
        ASSERT_NE(Header(r, "X-Request-Id"), nullptr);
        EXPECT_EQ(*Header(r, "X-Request-Id"), "req-7");
        ASSERT_NE(Header(r, "Authorization"), nullptr);
        EXPECT_EQ(*Header(r, "Authorization"), "Bearer tok");
    }
    h.ExpectNothingInFlight();
    EXPECT_EQ(h.router->Workers(Role::kPrefill)[0].succeeded, 1u);
    EXPECT_EQ(h.router->Workers(Role::kDecode)[0].succeeded, 1u);
    EXPECT_EQ(h.driver->Stats().succeeded, 1u);
}

TEST(RouterDriver, PushAsksTheAgentOnceAndSendsBothWorkersOneTransferId) {
    DriverHarness h(Protocol::kPush);
    DecoderWaitsForItsPrefill(h);
    h.prefill.answer = {{"engine_id", "p0"}, {"host", "127.0.0.9"}, {"port", 7100}};
    for (int i = 0; i < 2; ++i) {
        Result<http::ClientReply> got = h.Post({{"prompt", "hello"}});
        ASSERT_TRUE(got.ok());
        EXPECT_EQ(got->status, 200);
    }
    std::vector<http::Request> p = h.prefill.Got(), d = h.decode.Got();
    ASSERT_EQ(p.size(), 3u) << "one GET /v1/kv/agent, then two prefill requests";
    EXPECT_EQ(p[0].method, "GET");
    ASSERT_EQ(d.size(), 2u);
    std::set<std::string> ids;
    for (int i = 0; i < 2; ++i) {
        Json pb = Json::parse(p[1 + i].body);
        const std::string xid = pb["kv_transfer_params"]["transfer_id"];
        EXPECT_EQ(xid.size(), 32u);
        ids.insert(xid);
        bool found = false;
        for (const http::Request& r : d) {
            Json db = Json::parse(r.body);
            if (db["kv_transfer_params"]["transfer_id"] != xid) continue;
            found = true;
            EXPECT_EQ(db["kv_transfer_params"]["remote_host"], "127.0.0.9");
            EXPECT_EQ(db["kv_transfer_params"]["remote_port"], 7100);
        }
        EXPECT_TRUE(found) << xid;
    }
    EXPECT_EQ(ids.size(), 2u) << "a transfer id per request";
    h.ExpectNothingInFlight();
}

TEST(RouterDriver, AFailingDecoderCountsAgainstItAndNotThePrefillWorker) {
    DriverHarness h(Protocol::kPull, {}, [](DriverConfig* c) { c->prefill_fallback = false; });
    h.decode.status = 500;
    h.decode.answer = {{"error", {{"message", "boom"}}}};
    Result<http::ClientReply> got = h.Post({{"prompt", "hi"}}, "req-9");
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->status, 500);
    h.ExpectNothingInFlight();
    EXPECT_EQ(h.router->Workers(Role::kDecode)[0].failed, 1u);
    EXPECT_EQ(h.router->Workers(Role::kPrefill)[0].failed, 0u);
    EXPECT_EQ(h.router->Workers(Role::kPrefill)[0].succeeded, 1u);
    // An unreachable prefill worker: 502 naming it and the request, and counted against it.
    h.prefill.server->Stop();
    got = h.Post({{"prompt", "hi"}}, "req-10");
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->status, 502);
    Json e = Json::parse(got->body);
    EXPECT_EQ(e["error"]["request_id"], "req-10");
    EXPECT_NE(e["error"]["message"].get<std::string>().find("prefill worker"), std::string::npos);
    h.ExpectNothingInFlight();
    EXPECT_EQ(h.router->Workers(Role::kPrefill)[0].failed, 1u);
    // A client's kv_transfer_params are refused before any worker is asked.
    got = h.Post({{"prompt", "hi"}, {"kv_transfer_params", {{"do_remote_prefill", true}}}});
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->status, 400);
}

// With its only prefill worker unreachable, the request goes to the decode worker as the client
// sent it (no kv_transfer_params): it prefills it itself (DriverConfig::prefill_fallback).
TEST(RouterDriver, WithNoPrefillWorkerLeftTheDecodeWorkerPrefills) {
    for (Protocol protocol : {Protocol::kPull, Protocol::kPush}) {
        SCOPED_TRACE(ProtocolName(protocol));
        DriverHarness h(protocol);
        h.decode.answer = {{"choices", Json::array()}};
        h.prefill.server->Stop();
        Result<http::ClientReply> got = h.Post({{"prompt", "hi"}, {"max_tokens", 5}}, "req-f");
        ASSERT_TRUE(got.ok());
        EXPECT_EQ(got->status, 200) << got->body;
        const std::vector<http::Request> seen = h.decode.Got();
        ASSERT_EQ(seen.size(), 1u);
        const Json body = Json::parse(seen[0].body);
        EXPECT_FALSE(body.contains("kv_transfer_params")) << body.dump();
        EXPECT_EQ(body["max_tokens"], 5);
        EXPECT_EQ(h.driver->Stats().prefill_fallback, 1u);
        EXPECT_EQ(h.router->Workers(Role::kPrefill)[0].failed, 1u);
        h.ExpectNothingInFlight();
    }
}

// A prefill worker that answers 5xx (its own failure: overloaded, shutting down) has the request
// prefilled by another; one that answers 4xx (the request's fault) is relayed to the client and
// not retried anywhere.
TEST(RouterDriver, APrefillWorkers5xxIsRetriedOnAnotherAndA4xxIsRelayed) {
    DriverHarness h(Protocol::kPull);
    FakeWorker other("prefill-2");
    h.router->AddWorker(Role::kPrefill, other.ep());
    h.prefill.status = other.status = 503;
    h.prefill.answer = other.answer = {{"error", {{"message", "busy"}}}};
    h.decode.answer = {{"choices", Json::array({{{"text", "ok"}}})}};
    // Whichever the router picks first answers 503; the other then answers 200.
    std::atomic<int> calls{0};
    auto second_succeeds = [&](FakeWorker& w) {
        w.before_answer = [&calls, &w](const http::Request&) {
            if (calls++ == 1) {
                std::lock_guard lock(w.mu);
                w.status = 200;
                w.answer = {{"kv_transfer_params", {{"remote_engine_id", "p"}, {"nonce", "n"}}}};
            }
        };
    };
    second_succeeds(h.prefill);
    second_succeeds(other);
    Result<http::ClientReply> got = h.Post({{"prompt", {1, 2, 3}}, {"max_tokens", 4}}, "req-5xx");
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->status, 200) << got->body;
    EXPECT_EQ(h.prefill.Got().size() + other.Got().size(), 2u);
    EXPECT_EQ(h.prefill.Got().size(), 1u) << "each tried once";
    EXPECT_EQ(h.driver->Stats().prefill_retried, 1u);
    EXPECT_EQ(h.driver->Stats().prefill_fallback, 0u);
    ASSERT_EQ(h.decode.Got().size(), 1u);
    EXPECT_EQ(Json::parse(h.decode.Got()[0].body)["kv_transfer_params"]["remote_engine_id"], "p");

    // 400 from a prefill worker: the client's request is at fault; relayed, nothing retried.
    for (FakeWorker* w : {&h.prefill, &other}) {
        w->before_answer = nullptr;
        std::lock_guard lock(w->mu);
        w->status = 400;
        w->answer = {{"error", {{"message", "prompt too long"}}}};
    }
    got = h.Post({{"prompt", {1, 2, 3}}, {"max_tokens", 4}}, "req-4xx");
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->status, 400) << got->body;
    EXPECT_NE(got->body.find("prompt too long"), std::string::npos) << got->body;
    EXPECT_EQ(h.prefill.Got().size() + other.Got().size(), 3u);
    EXPECT_EQ(h.driver->Stats().prefill_retried, 1u);
    EXPECT_EQ(h.driver->Stats().prefill_fallback, 0u);
    EXPECT_EQ(h.decode.Got().size(), 1u);
}

// A stream whose decode worker goes silent mid-stream migrates; when the decode worker it
// migrates to refuses the continuation (here 400), the client's stream, already started, ends
// with an error event naming the refusal and [DONE]: the tokens it had stay, none is invented.
TEST(RouterDriver, AMigratedStreamWhoseNewDecoderRefusesEndsWithAnErrorEvent) {
    DriverHarness h(Protocol::kPull, {}, [](DriverConfig* c) {
        c->stream_idle_timeout = std::chrono::milliseconds(300);
    });
    FakeWorker other("decode-2");
    h.router->AddWorker(Role::kDecode, other.ep());
    h.prefill.answer = {{"kv_transfer_params", {{"remote_engine_id", "p0"}, {"nonce", "n"}}}};
    std::mutex mu;
    std::vector<std::shared_ptr<http::Exchange>> stalled;  // kept open, silent
    std::vector<Json> continued;
    std::atomic<int> calls{0};
    auto decoder = [&](const std::shared_ptr<http::Exchange>& ex) {
        if (calls++ == 0) {
            // The first: two tokens, then nothing more.
            ex->StartStream(200, "text/event-stream");
            for (int t : {11, 12}) {
                ex->Write(
                    "data: " +
                    Json{{"choices", {{{"index", 0}, {"text", "x"}, {"token_ids", {t}}}}}}.dump() +
                    "\n\n");
            }
            std::lock_guard lock(mu);
            stalled.push_back(ex);
            return true;
        }
        std::lock_guard lock(mu);
        continued.push_back(Json::parse(ex->request().body));
        ex->Reply({400,
                   "application/json",
                   Json{{"error", {{"message", "the continuation ends the request"}}}}.dump(),
                   {}});
        return true;
    };
    h.decode.take_over = decoder;
    other.take_over = decoder;
    Result<http::ClientReply> got =
        h.Post({{"prompt", {1, 2, 3}}, {"max_tokens", 8}, {"stream", true}}, "req-refused");
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->status, 200);
    const std::string& b = got->body;
    EXPECT_NE(b.find("\"text\":\"x\""), std::string::npos) << b;
    EXPECT_EQ(b.find("token_ids"), std::string::npos) << "ids the client did not ask for: " << b;
    EXPECT_NE(b.find("the continuation ends the request"), std::string::npos) << b;
    EXPECT_LT(b.find("\"text\":\"x\""), b.find("\"error\"")) << b;
    EXPECT_EQ(b.find("[DONE]"), b.rfind("[DONE]")) << b;
    {
        std::lock_guard lock(mu);
        ASSERT_EQ(continued.size(), 1u);
        EXPECT_EQ(continued[0]["ferry_continue"]["token_ids"], Json({11, 12}));
    }
    EXPECT_EQ(h.driver->Stats().migrated, 1u);
    std::lock_guard lock(mu);
    for (auto& ex : stalled) ex->End();
}

TEST(RouterDriver, AnAgentInTheDirectoryIsUsedWithoutAskingTheWorker) {
    std::atomic<int> asked{0};
    RouterConfig rc;
    rc.agent_directory = [&asked](const http::Endpoint&) -> std::optional<AgentInfo> {
        ++asked;
        return AgentInfo{{"p-store", "127.0.0.8", 7200}, 1};
    };
    DriverHarness h(Protocol::kPush, std::move(rc));
    DecoderWaitsForItsPrefill(h);
    for (int i = 0; i < 2; ++i) {
        Result<http::ClientReply> got = h.Post({{"prompt", "hello"}});
        ASSERT_TRUE(got.ok());
        EXPECT_EQ(got->status, 200);
    }
    for (const http::Request& r : h.prefill.Got()) {
        EXPECT_NE(r.method, "GET") << "the worker was asked where its agent is";
    }
    ASSERT_EQ(h.decode.Got().size(), 2u);
    Json db = Json::parse(h.decode.Got()[0].body);
    EXPECT_EQ(db["kv_transfer_params"]["remote_engine_id"], "p-store");
    EXPECT_EQ(db["kv_transfer_params"]["remote_port"], 7200);
    EXPECT_EQ(asked.load(), 1) << "remembered once found";
    const std::string m = h.router->RenderMetrics();
    EXPECT_NE(m.find("ferry_router_agent_lookups_total{source=\"store\"} 1"), std::string::npos)
        << m;
    EXPECT_NE(m.find("ferry_router_agent_lookups_total{source=\"worker\"} 0"), std::string::npos)
        << m;
}

TEST(WorkerDirectory, FollowsTheWorkersRecordsInTheStoreAndIgnoresBadOnes) {
    auto store = std::move(StoreServer::Start({})).value();
    WorkerRecord rec{"127.0.0.1:9001", "prefill", "tiny", 2, {"p0", "127.0.0.1", 7301}};
    auto back = DecodeWorkerRecord(EncodeWorkerRecord(rec));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(back->agent.engine_id, "p0");
    EXPECT_EQ(back->tp_size, 2);
    // A newer worker's block hashes: the record stands, its blocks get no prefix credit.
    auto newer = DecodeWorkerRecord(
        R"({"url":"127.0.0.1:1","role":"decode","model":"tiny","tp_size":1,"engine_id":"d",)"
        R"("agent_host":"127.0.0.1","agent_port":2,"block_hash":{"version":2,)"
        R"("algorithm":"sha512_cbor","seed":"0","block_size":16},"kv_events":"tcp://x:1"})");
    ASSERT_TRUE(newer.ok()) << newer.status().ToString();
    EXPECT_EQ(newer->block_size, 0);
    EXPECT_EQ(newer->block_hash_unknown,
              "'block_hash' is version 2 of 'sha512_cbor'; this router knows version 1 of "
              "'sha256_cbor'");
    auto bad = DecodeWorkerRecord(R"({"url":"x","role":"prefill"})");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("'model'"), std::string::npos) << bad.status().ToString();

    auto dir = std::move(WorkerDirectory::Start(store->url(), {})).value();
    auto reg =
        std::move(WorkerRegistration::Start(store->url(), {}, rec, std::chrono::milliseconds(3000)))
            .value();
    auto raw = std::move(MetadataStore::Open(store->url())).value();
    // A record whose key names another worker, and one that is not a record: both ignored.
    ASSERT_TRUE(raw->Put("ferry/workers/127.0.0.1:9002", EncodeWorkerRecord(rec)).ok());
    ASSERT_TRUE(raw->Put("ferry/workers/127.0.0.1:9003", "{").ok());
    auto until = [](auto pred) {
        auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!pred() && std::chrono::steady_clock::now() < end) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        return pred();
    };
    EXPECT_TRUE(until([&] { return dir->Find("127.0.0.1:9001").has_value(); }));
    EXPECT_EQ(dir->Find("127.0.0.1:9001")->agent.port, 7301);
    EXPECT_FALSE(dir->Find("127.0.0.1:9002"));
    EXPECT_FALSE(dir->Find("127.0.0.1:9003"));
    // A clean stop removes the record; the directory follows.
    reg->Stop();
    EXPECT_TRUE(until([&] { return !dir->Find("127.0.0.1:9001").has_value(); }));
}

// With a deployment secret the store takes signed writes only: a client without the secret (or
// with another) can neither file a worker record nor replace a worker's, and a router's directory
// (which reads with the secret) sees only the deployment's own records.
TEST(WorkerDirectory, OnlyTheDeploymentFilesWorkerRecordsInASecretStore) {
    StoreServerConfig sc;
    sc.secret = "deployment-secret";
    auto store = std::move(StoreServer::Start(sc)).value();
    StoreOptions signed_opts;
    signed_opts.secret = sc.secret;
    WorkerRecord rec{"127.0.0.1:9101", "prefill", "tiny", 1, {"p0", "127.0.0.1", 7401}};
    auto dir = std::move(WorkerDirectory::Start(store->url(), signed_opts)).value();
    auto reg = std::move(WorkerRegistration::Start(store->url(), signed_opts, rec,
                                                   std::chrono::milliseconds(3000)))
                   .value();

    // An attacker's record pointing the router at an agent of its own: refused as it is filed.
    WorkerRecord evil = rec;
    evil.agent.host = "10.9.9.9";
    evil.agent.engine_id = "attacker";
    auto unsigned_reg =
        WorkerRegistration::Start(store->url(), {}, evil, std::chrono::milliseconds(3000));
    ASSERT_FALSE(unsigned_reg.ok());
    EXPECT_EQ(unsigned_reg.status().code(), Code::kPermissionDenied)
        << unsigned_reg.status().ToString();
    StoreOptions wrong;
    wrong.secret = "guessed";
    auto guessed = std::move(MetadataStore::Open(store->url(), wrong)).value();
    EXPECT_EQ(guessed->Put("ferry/workers/127.0.0.1:9101", EncodeWorkerRecord(evil)).code(),
              Code::kPermissionDenied);
    EXPECT_EQ(guessed->Put("ferry/workers/127.0.0.1:9102", EncodeWorkerRecord(evil)).code(),
              Code::kPermissionDenied);
    auto raw = std::move(MetadataStore::Open(store->url())).value();
    EXPECT_EQ(raw->Put("ferry/workers/127.0.0.1:9103", EncodeWorkerRecord(evil)).code(),
              Code::kPermissionDenied);
    auto until = [](auto pred) {
        auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!pred() && std::chrono::steady_clock::now() < end) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        return pred();
    };
    ASSERT_TRUE(until([&] { return dir->Find("127.0.0.1:9101").has_value(); }));
    EXPECT_EQ(dir->Find("127.0.0.1:9101")->agent.engine_id, "p0");
    EXPECT_EQ(dir->Find("127.0.0.1:9101")->agent.host, "127.0.0.1");
    EXPECT_FALSE(dir->Find("127.0.0.1:9102"));
    EXPECT_FALSE(dir->Find("127.0.0.1:9103"));
    EXPECT_EQ(dir->size(), 1u);
    EXPECT_GE(store->Stats().unauthorized, 2u);
}

// A worker serving /metrics with vLLM's load gauges (as ferry workers and vLLM's do).
struct MetricsWorker {
    std::mutex mu;
    double running = 0, waiting = 0;
    std::atomic<int> polled{0};
    std::unique_ptr<http::Server> server;
    MetricsWorker() {
        http::ServerConfig c;
        c.name = "metrics";
        c.io_threads = 1;
        std::vector<http::Route> routes = {
            {"GET", "/metrics", [this](std::shared_ptr<http::Exchange> ex) {
                 ++polled;
                 std::lock_guard lock(mu);
                 ex->Reply({200,
                            "text/plain",
                            fmt::format("vllm:num_requests_running{{model_name=\"tiny\"}} {}\n"
                                        "vllm:num_requests_waiting{{model_name=\"tiny\"}} {}\n"
                                        "vllm:kv_cache_usage_perc{{model_name=\"tiny\"}} 0.5\n",
                                        running, waiting),
                            {}});
             }}};
        server = std::move(http::Server::Start(c, routes)).value();
    }
    std::string url() const { return fmt::format("127.0.0.1:{}", server->port()); }
};

bool Until(const std::function<bool()>& pred,
           std::chrono::seconds limit = std::chrono::seconds(10)) {
    auto end = std::chrono::steady_clock::now() + limit;
    while (!pred() && std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return pred();
}

// The router's workers follow the store: a registered worker joins and takes requests once its
// /metrics answered, with its load as reported; one whose record goes leaves; records of another
// model or role, or naming no address, are counted and ignored; a worker given as a flag stays.
TEST(RouterMembership, WorkersJoinAndLeaveWithTheirRecordsInTheStore) {
    auto store = std::move(StoreServer::Start({})).value();
    MetricsWorker p0, d0, d1, static_d;
    d0.running = 2;
    d0.waiting = 1;
    auto dir = std::shared_ptr<WorkerDirectory>(
        std::move(WorkerDirectory::Start(store->url(), {})).value());
    auto router = std::make_shared<Router>(RouterConfig{.policy = MakeLeastLoaded()});
    router->AddWorker(Role::kDecode, Ep(static_d.server->port()));
    const auto ttl = std::chrono::milliseconds(3000);
    auto reg = [&](const WorkerRecord& r) {
        return std::move(WorkerRegistration::Start(store->url(), {}, r, ttl)).value();
    };
    auto rp0 = reg({p0.url(), "prefill", "tiny", 1, {"p0", "127.0.0.1", 7301}});
    auto rd0 = reg({d0.url(), "decode", "tiny", 1, {"d0", "127.0.0.1", 7302}});
    auto other_model = reg({"127.0.0.1:9", "decode", "llama", 1, {"x", "127.0.0.1", 7303}});
    auto other_role = reg({"127.0.0.1:10", "encode", "tiny", 1, {"", "", 0}});
    auto no_address = reg({"nowhere", "prefill", "tiny", 1, {"", "", 0}});
    auto m = Membership::Start(
        {.directory = dir, .model = "tiny", .poll = std::chrono::milliseconds(50)}, router);
    // Every record seen: records come as store events, one at a time, so the two decode workers
    // can be in before the prefill worker's record or the ignored ones are read.
    ASSERT_TRUE(Until([&] {
        MembershipStats s = m->Stats();
        return s.joined == 2 && s.records_ignored.size() == 3 &&
               router->Agent(Role::kPrefill, 0).has_value();  // set just after it joins
    }));
    EXPECT_EQ(router->members(Role::kDecode), 2u);
    EXPECT_EQ(router->members(Role::kPrefill), 1u);
    ASSERT_TRUE(Until([&] {
        auto ws = router->Workers(Role::kDecode);
        return ws.size() == 2 && ws[1].reported && ws[1].reported->running == 2;
    }));
    EXPECT_EQ(router->Workers(Role::kDecode)[1].Load(), 3.0) << "waiting + running as reported";
    EXPECT_EQ(router->Agent(Role::kPrefill, 0)->engine_id, "p0") << "its agent from its record";
    MembershipStats st = m->Stats();
    EXPECT_EQ(st.joined, 2u);
    EXPECT_EQ(st.records_ignored["model"], 1u);
    EXPECT_EQ(st.records_ignored["role"], 1u);
    EXPECT_EQ(st.records_ignored["address"], 1u);
    // A new worker takes requests within moments of registering (a store event, then one poll).
    auto start = std::chrono::steady_clock::now();
    auto rd1 = reg({d1.url(), "decode", "tiny", 1, {"d1", "127.0.0.1", 7304}});
    ASSERT_TRUE(Until([&] {
        auto ws = router->Workers(Role::kDecode);
        return ws.size() == 3 && ws[2].member && ws[2].answering;
    }));
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
    // Least loaded: the static worker (0) and the new one (0) before d0 (3).
    std::set<size_t> got;
    for (int i = 0; i < 2; ++i) got.insert(router->Route(Role::kDecode, {"x", 0})->worker());
    EXPECT_EQ(got, (std::set<size_t>{0, 2}));
    // Its record goes (a drain, a clean stop, or its lease lapsing): it leaves; the static stays.
    rd1->Stop();
    ASSERT_TRUE(Until([&] { return !router->Workers(Role::kDecode)[2].member; }));
    EXPECT_TRUE(router->Workers(Role::kDecode)[0].member);
    EXPECT_EQ(m->Stats().left, 1u);
    // Back under the same address with a new agent (a restart): a member again, the new agent.
    auto rd1b = reg({d1.url(), "decode", "tiny", 1, {"d1-restarted", "127.0.0.1", 7305}});
    ASSERT_TRUE(Until([&] {
        auto a = router->Agent(Role::kDecode, 2);
        return router->Workers(Role::kDecode)[2].member && a && a->engine_id == "d1-restarted";
    }));
    const std::string text = m->RenderMetrics();
    EXPECT_NE(text.find("ferry_router_membership_records_ignored_total{reason=\"model\"} 1"),
              std::string::npos)
        << text;
    m->Stop();
}

// With an EncoderSet, records of role encode serving the model are the store's encode workers
// (EPD): kept there, never routed prefill or decode requests, and gone with their records.
TEST(RouterMembership, EncodeWorkersRecordsFeedTheEncoderSet) {
    auto store = std::move(StoreServer::Start({})).value();
    MetricsWorker d0;
    auto dir = std::shared_ptr<WorkerDirectory>(
        std::move(WorkerDirectory::Start(store->url(), {})).value());
    auto router = std::make_shared<Router>(RouterConfig{.policy = MakeLeastLoaded()});
    auto encoders = std::make_shared<EncoderSet>();
    const auto ttl = std::chrono::milliseconds(3000);
    auto reg = [&](const WorkerRecord& r) {
        return std::move(WorkerRegistration::Start(store->url(), {}, r, ttl)).value();
    };
    auto rd0 = reg({d0.url(), "decode", "tiny", 1, {"d0", "127.0.0.1", 7302}});
    auto e0 = reg({"127.0.0.1:7401", "encode", "tiny", 1, {"e0", "127.0.0.1", 7402}});
    auto e1 = reg({"127.0.0.1:7403", "encode", "tiny", 1, {"e1", "127.0.0.1", 7404}});
    auto other = reg({"127.0.0.1:7405", "encode", "llama", 1, {"e2", "127.0.0.1", 7406}});
    auto m = Membership::Start({.directory = dir,
                                .model = "tiny",
                                .poll = std::chrono::milliseconds(50),
                                .encoders = encoders},
                               router);
    // Records come as store events, one at a time.
    ASSERT_TRUE(Until([&] {
        MembershipStats s = m->Stats();
        return encoders->Get().size() == 2 && s.joined == 3 && s.records_ignored.size() == 1;
    }));
    std::vector<http::Endpoint> got = encoders->Get();
    EXPECT_EQ(got[0].port, 7401);
    EXPECT_EQ(got[1].port, 7403);
    EXPECT_EQ(router->Workers(Role::kDecode).size(), 1u);
    EXPECT_EQ(router->Workers(Role::kPrefill).size(), 0u);
    EXPECT_EQ(m->Stats().records_ignored["model"], 1u);
    e0->Stop();
    ASSERT_TRUE(Until([&] { return encoders->Get().size() == 1; }));
    EXPECT_EQ(encoders->Get()[0].port, 7403);
    EXPECT_EQ(m->Stats().left, 1u);
    EXPECT_NE(m->RenderMetrics().find("ferry_router_membership_encoders 1"), std::string::npos);
    m->Stop();
}

BlockHash H(int i) {
    BlockHash h{};
    h[0] = uint8_t(i);
    h[31] = uint8_t(i >> 8);
    return h;
}

// A batch in the "vllm" layout, as a worker writes it (serve/kv_events.h).
std::string Batch(const std::vector<std::pair<std::string, std::vector<int>>>& events,
                  bool extra_field = false) {
    MsgpackWriter m;
    m.Map(extra_field ? 4 : 3);
    m.Str("ts");
    m.Float(1.5);
    m.Str("events");
    m.Array(events.size());
    for (const auto& [type, hashes] : events) {
        m.Map(type == "AllBlocksCleared" ? 1 : 3);
        m.Str("type");
        m.Str(type);
        if (type == "AllBlocksCleared") continue;
        m.Str("block_hashes");
        m.Array(hashes.size());
        for (int i : hashes) {
            const BlockHash h = H(i);
            m.Bin(h.data(), h.size());
        }
        m.Str("medium");
        m.Str("GPU");
    }
    m.Str("data_parallel_rank");
    m.Uint(0);
    if (extra_field) {
        m.Str("a_field_from_a_later_vllm");
        m.Array(1);
        m.Nil();
    }
    return m.Take();
}

// The codec both ends use (schema/kv_events.h): what a worker's publisher encodes in vLLM's
// layout, the router's follower decodes to the same kinds and hashes, in order; the legacy
// layout (for vLLM's example subscriber) is one the follower refuses by name.
TEST(RouterKvEvents, WhatAWorkerEncodesTheRouterDecodes) {
    std::vector<schema::KvCacheEvent> events = {
        {schema::KvCacheEvent::Kind::kStored, {H(1), H(2)}, H(9), {1, 2, 3, 4}},
        {schema::KvCacheEvent::Kind::kStored, {H(3)}, std::nullopt, {5, 6}},
        {schema::KvCacheEvent::Kind::kRemoved, {H(2)}},
        {schema::KvCacheEvent::Kind::kAllCleared, {}},
    };
    const std::string payload =
        schema::EncodeKvEventBatch(12.5, events, schema::KvEventsLayout::kVllm, 2);
    size_t unknown = 0;
    auto back = schema::DecodeKvEventBatch(payload, &unknown);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    ASSERT_EQ(back->size(), events.size());
    for (size_t i = 0; i < events.size(); ++i) {
        EXPECT_EQ((*back)[i].kind, events[i].kind) << i;
        EXPECT_EQ((*back)[i].hashes, events[i].hashes) << i;
    }
    EXPECT_EQ(unknown, 0u);
    auto legacy = schema::DecodeKvEventBatch(
        schema::EncodeKvEventBatch(1, events, schema::KvEventsLayout::kLegacy, 2));
    EXPECT_EQ(legacy.status().code(), Code::kInvalidArgument);
    EXPECT_EQ(*schema::ParseKvEventsLayout("legacy"), schema::KvEventsLayout::kLegacy);
    EXPECT_EQ(schema::ParseKvEventsLayout("v1").status().code(), Code::kInvalidArgument);
}

TEST(RouterKvEvents, DecodesVllmsBatchAndRefusesWhatIsNotOne) {
    size_t unknown = 0;
    auto ev = schema::DecodeKvEventBatch(Batch({{"BlockStored", {1, 2}},
                                                {"BlockSomethingNew", {3}},
                                                {"BlockRemoved", {1}},
                                                {"AllBlocksCleared", {}}},
                                               true),
                                         &unknown);
    ASSERT_TRUE(ev.ok()) << ev.status().ToString();
    ASSERT_EQ(ev->size(), 3u);
    EXPECT_EQ((*ev)[0].kind, schema::KvCacheEvent::Kind::kStored);
    EXPECT_EQ((*ev)[0].hashes, (std::vector<BlockHash>{H(1), H(2)}));
    EXPECT_EQ((*ev)[1].kind, schema::KvCacheEvent::Kind::kRemoved);
    EXPECT_EQ((*ev)[2].kind, schema::KvCacheEvent::Kind::kAllCleared);
    EXPECT_EQ(unknown, 1u) << "an event type it does not know is skipped, not an error";
    // The legacy layout, a short hash, a truncated batch, trailing bytes, no events: each an
    // error that says what.
    MsgpackWriter legacy;
    legacy.Array(2);
    legacy.Float(1.0);
    legacy.Array(0);
    MsgpackWriter short_hash;
    short_hash.Map(1);
    short_hash.Str("events");
    short_hash.Array(1);
    short_hash.Map(2);
    short_hash.Str("type");
    short_hash.Str("BlockStored");
    short_hash.Str("block_hashes");
    short_hash.Array(1);
    short_hash.Bin(H(1).data(), 31);
    const std::string good = Batch({{"BlockStored", {1}}});
    const std::pair<std::string, std::string> bad[] = {
        {legacy.Take(), "not a map"},
        {short_hash.Take(), "31 bytes"},
        {good.substr(0, good.size() - 3), "msgpack"},
        {good + "x", "after the batch"},
        {std::string("\x81\xa2ts\x01", 5), "no 'events'"},
        {std::string("\xdd\xff\xff\xff\xff", 5), "not a map"},
        {"", "msgpack"}};
    for (const auto& [bytes, says] : bad) {
        auto r = schema::DecodeKvEventBatch(bytes);
        ASSERT_FALSE(r.ok()) << says;
        EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
        EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().ToString();
    }
}

TEST(RouterKvEvents, TheIndexKnowsEachWorkersBlocksAndForgetsAll) {
    KvIndex index(/*max_blocks_per_worker=*/8);
    index.Apply("w0", {{schema::KvCacheEvent::Kind::kStored, {H(1), H(2), H(3)}}});
    index.Apply("w1", {{schema::KvCacheEvent::Kind::kStored, {H(1)}}});
    const std::vector<BlockHash> prompt = {H(1), H(2), H(3), H(4)};
    EXPECT_EQ(index.Matched("w0", prompt), 3u);
    EXPECT_EQ(index.Matched("w1", prompt), 1u);
    EXPECT_EQ(index.Matched("nobody", prompt), 0u);
    index.Apply("w0", {{schema::KvCacheEvent::Kind::kRemoved, {H(2)}}});
    EXPECT_EQ(index.Matched("w0", prompt), 1u) << "a consecutive prefix only";
    index.Apply("w0", {{schema::KvCacheEvent::Kind::kAllCleared, {}}});
    EXPECT_EQ(index.Blocks("w0"), 0u);
    std::vector<BlockHash> many;
    for (int i = 0; i < 20; ++i) many.push_back(H(100 + i));
    index.Apply("liar", {{schema::KvCacheEvent::Kind::kStored, many}});
    EXPECT_LE(index.Blocks("liar"), 8u) << "bounded per worker";
    EXPECT_GE(index.overflows(), 1u);
    index.Clear("w1");
    EXPECT_EQ(index.Blocks("w1"), 0u);
}

// Cache-aware: the worker holding the prompt's blocks wins while its load is not much higher;
// a worker out of step with its events gets no credit; with no hashes it weighs load only.
TEST(RouterKvEvents, CacheAwareWeighsTheBlocksAWorkerHoldsAgainstItsLoad) {
    auto index = std::make_shared<KvIndex>();
    RouterConfig rc;
    rc.policy = MakeCacheAware();
    rc.kv_index = index;
    Router r(std::move(rc));
    r.AddWorker(Role::kDecode, Ep(2000));
    r.AddWorker(Role::kDecode, Ep(2001));
    const std::vector<BlockHash> prompt = {H(1), H(2), H(3), H(4)};
    index->Apply("127.0.0.1:2001", {{schema::KvCacheEvent::Kind::kStored, prompt}});
    const RouteRequest rq{"x", 64, prompt};
    EXPECT_EQ(r.Route(Role::kDecode, rq)->worker(), 0u) << "not in step: no credit, a tie in turn";
    r.SetKvInSync("127.0.0.1:2001", true);
    std::vector<Ticket> held;
    for (int i = 0; i < 3; ++i) {
        held.push_back(std::move(*r.Route(Role::kDecode, rq)));
        EXPECT_EQ(held.back().worker(), 1u) << "it holds all 4 blocks: 2 - 1 beats 0 - 0";
    }
    EXPECT_EQ(r.Workers(Role::kDecode)[1].prefix_blocks, 4u);
    // Worker 1 is busy now (3 in flight, worker 0 none) and reports a full cache: the load wins.
    r.ReportAnswered(Role::kDecode, 1, ReportedLoad{0, 3, 1.0});
    EXPECT_EQ(r.Route(Role::kDecode, rq)->worker(), 0u);
    const RouteRequest text{"y", 0};
    EXPECT_EQ(r.Route(Role::kDecode, text)->worker(), 0u) << "no hashes: the less loaded";
    // The prompt hashes the router computes are the workers' (core/block_hash.h).
    EXPECT_TRUE(r.PromptBlockHashes(std::vector<int32_t>(40, 1)).empty()) << "no spec yet";
    r.SetBlockHashSpec("0", 16);
    std::vector<int32_t> tokens(40);
    std::iota(tokens.begin(), tokens.end(), 0);
    EXPECT_EQ(r.PromptBlockHashes(tokens), HashFullBlocks(RootBlockHash("0"), tokens, 16));
}

// A publisher speaking the workers' protocol (PUB, and a ROUTER that replays its buffer), so that
// the follower meets gaps, restarts and lies on purpose.
struct FakePublisher {
    void* ctx = zmq_ctx_new();
    void* pub = zmq_socket(ctx, ZMQ_PUB);
    void* replay = zmq_socket(ctx, ZMQ_ROUTER);
    std::string pub_ep, replay_ep;
    std::vector<std::pair<uint64_t, std::string>> buffer;  // what replay answers with
    FakePublisher() {
        int linger = 0;
        zmq_setsockopt(pub, ZMQ_LINGER, &linger, sizeof linger);
        zmq_setsockopt(replay, ZMQ_LINGER, &linger, sizeof linger);
        zmq_bind(pub, "tcp://127.0.0.1:*");
        zmq_bind(replay, "tcp://127.0.0.1:*");
        char buf[256];
        size_t n = sizeof buf;
        zmq_getsockopt(pub, ZMQ_LAST_ENDPOINT, buf, &n);
        pub_ep = buf;
        n = sizeof buf;
        zmq_getsockopt(replay, ZMQ_LAST_ENDPOINT, buf, &n);
        replay_ep = buf;
    }
    ~FakePublisher() {
        zmq_close(pub);
        zmq_close(replay);
        zmq_ctx_term(ctx);
    }
    static std::string Seq(int64_t s) {
        std::string b(8, '\0');
        for (int i = 0; i < 8; ++i) b[7 - i] = char((uint64_t(s) >> (8 * i)) & 0xff);
        return b;
    }
    void Send(uint64_t seq, const std::string& payload, bool keep = true) {
        const std::string s = Seq(int64_t(seq));
        zmq_send(pub, "", 0, ZMQ_SNDMORE);
        zmq_send(pub, s.data(), 8, ZMQ_SNDMORE);
        zmq_send(pub, payload.data(), payload.size(), 0);
        if (keep) buffer.emplace_back(seq, payload);
    }
    // Answers the replay requests waiting (for `ms`).
    void ServeReplays(int ms) {
        const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
        while (std::chrono::steady_clock::now() < end) {
            zmq_pollitem_t item{replay, 0, ZMQ_POLLIN, 0};
            if (zmq_poll(&item, 1, 10) <= 0) continue;
            char id[256], empty[8], start[16];
            int idn = zmq_recv(replay, id, sizeof id, 0);
            zmq_recv(replay, empty, sizeof empty, 0);
            zmq_recv(replay, start, sizeof start, 0);
            uint64_t from = 0;
            for (int i = 0; i < 8; ++i) from = (from << 8) | uint8_t(start[i]);
            auto frame = [&](const std::string& seq, const std::string& payload) {
                zmq_send(replay, id, size_t(idn), ZMQ_SNDMORE);
                zmq_send(replay, "", 0, ZMQ_SNDMORE);
                zmq_send(replay, seq.data(), 8, ZMQ_SNDMORE);
                zmq_send(replay, payload.data(), payload.size(), 0);
            };
            for (const auto& [seq, payload] : buffer) {
                if (seq >= from) frame(Seq(int64_t(seq)), payload);
            }
            frame(Seq(-1), "");
        }
    }
};

TEST(RouterKvEvents, TheFollowerReplaysGapsAndForgetsARestartedWorker) {
    auto index = std::make_shared<KvIndex>();
    std::mutex mu;
    std::map<std::string, bool> sync;
    auto follower = KvEventFollower::Start(
        index,
        [&](const std::string& w, bool in_sync) {
            std::lock_guard lock(mu);
            sync[w] = in_sync;
        },
        std::chrono::milliseconds(3000));
    FakePublisher pub;
    // Published before anyone subscribed: found by the first replay.
    pub.buffer.emplace_back(0, Batch({{"BlockStored", {1, 2}}}));
    follower->SetWorkers({{"w", {pub.pub_ep, pub.replay_ep}}});
    pub.ServeReplays(500);
    auto in_sync = [&] {
        std::lock_guard lock(mu);
        return sync["w"];
    };
    ASSERT_TRUE(Until([&] { return in_sync() && index->Blocks("w") == 2; }));
    // Live batches (the subscription needs a moment to join).
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    pub.Send(1, Batch({{"BlockStored", {3}}}));
    ASSERT_TRUE(Until([&] { return index->Blocks("w") == 3; }));
    // A gap: batch 2 is lost on the wire (it is in the buffer); 3 arrives: the follower replays 2.
    zmq_unbind(pub.pub, pub.pub_ep.c_str());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    pub.Send(2, Batch({{"BlockRemoved", {1}}}));  // nobody hears it (kept for replay)
    zmq_bind(pub.pub, pub.pub_ep.c_str());
    std::this_thread::sleep_for(std::chrono::milliseconds(600));  // the subscriber reconnects
    pub.Send(3, Batch({{"BlockStored", {4}}}));
    pub.ServeReplays(800);
    ASSERT_TRUE(Until(
        [&] { return index->Blocks("w") == 3 && index->Matched("w", std::vector{H(2)}) == 1; }));
    EXPECT_EQ(index->Matched("w", std::vector{H(1)}), 0u) << "the lost removal was replayed";
    EXPECT_GE(follower->Stats().gaps, 1u);
    // A restart: the sequence starts again at 0 with an empty cache.
    pub.buffer.clear();
    pub.Send(0, Batch({{"BlockStored", {9}}}));
    pub.ServeReplays(800);
    ASSERT_TRUE(Until([&] { return index->Blocks("w") == 1; }));
    EXPECT_EQ(index->Matched("w", std::vector{H(9)}), 1u);
    EXPECT_EQ(index->Matched("w", std::vector{H(2)}), 0u) << "nothing of before the restart";
    EXPECT_GE(follower->Stats().restarts, 1u);
    // A malformed batch is counted and skipped; the worker stays in step.
    pub.Send(1, "not msgpack");
    ASSERT_TRUE(Until([&] { return follower->Stats().malformed >= 1; }));
    EXPECT_TRUE(in_sync());
    // Dropped from the set: its blocks are forgotten.
    follower->SetWorkers({});
    ASSERT_TRUE(Until([&] { return index->Blocks("w") == 0 && !in_sync(); }));
}

// A worker whose every batch is a gap and whose replay endpoint never answers cannot stall the
// follower (its one thread) for the other workers: after a slow replay its next gaps clear its
// blocks instead of waiting again, and an honest worker's events go on being applied.
TEST(RouterKvEvents, AWorkerWhoseReplaysStallCannotHoldUpTheOthers) {
    auto index = std::make_shared<KvIndex>();
    auto follower = KvEventFollower::Start(
        index, [](const std::string&, bool) {}, std::chrono::milliseconds(1000));
    FakePublisher liar, honest;
    follower->SetWorkers(
        {{"liar", {liar.pub_ep, liar.replay_ep}}, {"honest", {honest.pub_ep, honest.replay_ep}}});
    honest.ServeReplays(300);  // the subscriptions' first replays: honest answers, liar never
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    for (int i = 0; i < 30; ++i) liar.Send(uint64_t(2 * i + 5), Batch({{"BlockStored", {7}}}));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto t0 = std::chrono::steady_clock::now();
    honest.Send(0, Batch({{"BlockStored", {1, 2, 3}}}));
    ASSERT_TRUE(Until([&] { return index->Blocks("honest") == 3; }));
    // 30 gaps of the liar at 1 s each would have held it up 30 s; a bound, not a performance
    // figure.
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(8));
    EXPECT_GT(follower->Stats().replays_deferred, 0u);
}

// This process's resident set (bytes), from /proc/self/status.
size_t SelfRss() {
    FILE* f = std::fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    size_t kb = 0;
    while (std::fgets(line, sizeof line, f)) {
        if (std::sscanf(line, "VmRSS: %zu kB", &kb) == 1) break;
    }
    std::fclose(f);
    return kb << 10;
}

// The follower's SUB socket subscribes to whatever endpoint a worker record names: a "worker"
// that declares a 16 GiB frame is cut off on the header (ZMQ_MAXMSGSIZE), and the router holds
// nothing of it.
TEST(RouterKvEvents, APublisherThatDeclaresAHugeFrameIsCutOff) {
    auto index = std::make_shared<KvIndex>();
    auto follower = KvEventFollower::Start(index, [](const std::string&, bool) {});
    const size_t rss0 = SelfRss();
    testing::LyingZmtpServer liar("PUB", 16ull << 30, 256ull << 20);
    follower->SetWorkers({{"w", {fmt::format("tcp://127.0.0.1:{}", liar.port()), ""}}});
    liar.Join();
    EXPECT_TRUE(liar.result().handshake);
    EXPECT_TRUE(liar.result().cut);
    EXPECT_LT(liar.result().accepted, 64ull << 20);
    EXPECT_LT(SelfRss(), rss0 + (64u << 20));
    EXPECT_EQ(index->Blocks("w"), 0u);
}

// A worker that timed out stays out until it answers a probe (GET /health), which a read
// triggers without waiting for it; then its on_back runs.
TEST(RouterQuarantine, AWorkerIsOutUntilItAnswersAProbe) {
    auto client = http::Client::Create(1);
    std::atomic<bool> healthy{false};
    std::atomic<int> probes{0};
    auto server =
        http::Server::Start({}, {{"GET", "/health", [&](std::shared_ptr<http::Exchange> ex) {
                                      ++probes;
                                      if (healthy) ex->Reply({200, "application/json", "{}", {}});
                                      // else: no answer (a stuck worker)
                                  }}});
    ASSERT_TRUE(server.ok());
    const http::Endpoint ep{"127.0.0.1", uint16_t((*server)->port())};
    const http::Endpoint other{"127.0.0.1", 1};
    Quarantine q(client.get(), {std::chrono::milliseconds(100), std::chrono::milliseconds(300)});
    std::atomic<int> back{0};
    q.Add(ep, [&] { ++back; });
    q.Add(ep, [&] { back += 100; });  // already in: its first on_back stays
    EXPECT_EQ(q.size(), 1u);
    EXPECT_TRUE(q.Contains(ep));
    EXPECT_FALSE(q.Contains(other));
    EXPECT_EQ(q.Filter({other, ep}).size(), 1u);
    // Probed while it does not answer: still out.
    ASSERT_TRUE(Until([&] {
        q.Contains(ep);  // a read probes what is due
        return probes >= 2;
    }));
    EXPECT_TRUE(q.Contains(ep));
    EXPECT_EQ(back, 0);
    healthy = true;
    ASSERT_TRUE(Until([&] { return !q.Contains(ep); }));
    EXPECT_EQ(back, 1);
    EXPECT_EQ(q.added(), 1u);
    EXPECT_EQ(q.released(), 1u);
    (*server)->Stop();
}

// The encode step as the proxy and --encoder-urls both run it: the body an encode worker gets
// (one token, not streamed, no transfer params, the request's id and the router token), and what
// each kind of answer means; a worker past the deadline goes into quarantine.
TEST(RouterWorkerCall, TheEncodeStepSendsOneBodyAndReadsEachAnswer) {
    auto client = http::Client::Create(1);
    std::mutex mu;
    std::vector<Json> bodies;
    std::vector<std::string> ids, auths;
    std::atomic<int> mode{0};  // 0: params, 1: 400, 2: 500, 3: not JSON, 4: no answer, 5: huge
    auto server = http::Server::Start(
        {},
        {{"POST", "/v1/chat/completions", [&](std::shared_ptr<http::Exchange> ex) {
              {
                  std::lock_guard lock(mu);
                  bodies.push_back(Json::parse(ex->request().body));
                  const std::string* id = ex->request().Find("X-Request-Id");
                  const std::string* auth = ex->request().Find("Authorization");
                  ids.push_back(id ? *id : "");
                  auths.push_back(auth ? *auth : "");
              }
              switch (mode.load()) {
                  case 0:
                      return ex->Reply({200,
                                        "application/json",
                                        R"({"ec_transfer_params":{"mm_hashes":["h"]}})",
                                        {}});
                  case 1:
                      return ex->Reply({400, "application/json", R"({"error":"bad image"})", {}});
                  case 2:
                      return ex->Reply({500, "application/json", "{}", {}});
                  case 3:
                      return ex->Reply({200, "text/plain", "not json", {}});
                  case 5:  // a lying worker: an answer far larger than any real one
                      return ex->Reply({200,
                                        "application/json",
                                        R"({"ec_transfer_params":{"mm_hashes":["h"]},"pad":")" +
                                            std::string(kMaxEncodeAnswerBytes, 'x') + "\"}",
                                        {}});
                  default:
                      return;  // stuck
              }
          }}});
    ASSERT_TRUE(server.ok());
    const http::Endpoint ep{"127.0.0.1", uint16_t((*server)->port())};
    Quarantine q(client.get());
    EncodeStep step({"sekret", std::chrono::milliseconds(300)}, client.get(), &q);
    const Json body = {
        {"model", "m"},
        {"stream", true},
        {"max_tokens", 50},
        {"stream_options", {{"include_usage", true}}},
        {"kv_transfer_params", {{"do_remote_decode", true}}},
        {"messages",
         {{{"role", "user"},
           {"content", {{{"type", "image_url"}, {"image_url", {{"url", "data:x"}}}}}}}}}};
    auto run = [&](int m) {
        mode = m;
        std::promise<Encoded> got;
        auto fut = got.get_future();
        step.Call(body, step.Answering({ep}), "rid-1", [&](Encoded e) { got.set_value(e); });
        return fut.get();
    };
    Encoded e = run(0);
    EXPECT_EQ(e.kind, Encoded::Kind::kEncoded);
    EXPECT_EQ(e.ec_transfer_params, Json({{"mm_hashes", {"h"}}}));
    {
        std::lock_guard lock(mu);
        ASSERT_EQ(bodies.size(), 1u);
        EXPECT_EQ(bodies[0]["max_tokens"], 1);
        EXPECT_EQ(bodies[0]["stream"], false);
        EXPECT_FALSE(bodies[0].contains("stream_options"));
        EXPECT_FALSE(bodies[0].contains("kv_transfer_params"));
        EXPECT_EQ(bodies[0]["messages"], body["messages"]);
        EXPECT_EQ(ids[0], "rid-1");
        EXPECT_EQ(auths[0], "Bearer sekret");
    }
    e = run(1);
    EXPECT_EQ(e.kind, Encoded::Kind::kRefused);
    EXPECT_EQ(e.refused.status, 400);
    EXPECT_EQ(e.refused.body, R"({"error":"bad image"})");
    e = run(2);
    EXPECT_EQ(e.kind, Encoded::Kind::kFailed);
    EXPECT_NE(e.why.find("answered 500"), std::string::npos) << e.why;
    e = run(3);
    EXPECT_EQ(e.kind, Encoded::Kind::kFailed);
    e = run(5);
    EXPECT_EQ(e.kind, Encoded::Kind::kFailed) << "an oversized answer is not read";
    EXPECT_EQ(step.timeouts(), 0u);
    EXPECT_TRUE(step.Answering({ep}).size() == 1);
    e = run(4);
    EXPECT_EQ(e.kind, Encoded::Kind::kFailed);
    EXPECT_NE(e.why.find(fmt::format("encode worker 127.0.0.1:{}", ep.port)), std::string::npos)
        << e.why;
    EXPECT_EQ(step.timeouts(), 1u);
    EXPECT_TRUE(step.Answering({ep}).empty()) << "timed out: in quarantine";
    // A call cancelled by its caller says so (no failure of the worker's).
    std::promise<Encoded> got;
    auto fut = got.get_future();
    auto call = step.Call(body, {ep}, "rid-2", [&](Encoded e) { got.set_value(e); });
    ASSERT_TRUE(call);
    call->Cancel();
    EXPECT_EQ(fut.get().kind, Encoded::Kind::kCancelled);
    (*server)->Stop();
}

TEST(RouterWorkerCall, ARequestCarriesItsIdTokenAndDeadlineAndAFailureNamesTheWorker) {
    const http::ClientRequest r = WorkerRequest({"::1", 8000}, "/v1/completions", {{"a", 1}}, "rid",
                                                "tok", std::chrono::milliseconds(1234));
    EXPECT_EQ(r.method, "POST");
    EXPECT_EQ(r.host, "::1");
    EXPECT_EQ(r.port, 8000);
    EXPECT_EQ(r.target, "/v1/completions");
    EXPECT_EQ(Json::parse(r.body), Json({{"a", 1}}));
    EXPECT_EQ(r.timeout, std::chrono::milliseconds(1234));
    ASSERT_NE(http::FindHeader(r.headers, "X-Request-Id"), nullptr);
    EXPECT_EQ(*http::FindHeader(r.headers, "X-Request-Id"), "rid");
    ASSERT_NE(http::FindHeader(r.headers, "Authorization"), nullptr);
    EXPECT_EQ(*http::FindHeader(r.headers, "Authorization"), "Bearer tok");
    EXPECT_EQ(http::FindHeader(
                  WorkerRequest({"h", 1}, "/", {}, "rid", "", std::chrono::milliseconds(1)).headers,
                  "Authorization"),
              nullptr);
    CallFailure f = FailureOf("prefill", {"::1", 8000}, DeadlineExceededError("too slow"));
    EXPECT_EQ(f.status, 504);
    EXPECT_TRUE(f.timed_out);
    EXPECT_EQ(f.message, "prefill worker [::1]:8000: too slow");
    f = FailureOf("decode", {"10.0.0.1", 9}, UnavailableError("refused"));
    EXPECT_EQ(f.status, 502);
    EXPECT_FALSE(f.timed_out);
    EXPECT_EQ(f.message, "decode worker 10.0.0.1:9: refused");
}

// Push's plan as the proxy and decode-first both take it: one fresh transfer id in both sides'
// params, the decoder's naming the prefill worker's agent; a worker whose agent cannot be found
// is named in the error.
TEST(RouterWorkerCall, APushPlanGivesBothSidesOneFreshTransferIdAndTheAgent) {
    auto client = http::Client::Create(1);
    auto router = std::make_shared<Router>(RouterConfig{});
    router->AddWorker(Role::kPrefill, {"127.0.0.1", 1});  // nothing listens there
    router->SetAgent(Role::kPrefill, 0, AgentInfo{{"engine-7", "10.0.0.7", 7000}, 2});
    std::vector<PushPlan> plans;
    for (int i = 0; i < 2; ++i) {
        auto call = PlanPush(*client, router, 0, "", std::chrono::milliseconds(500),
                             [&](Result<PushPlan> p) {
                                 ASSERT_TRUE(p.ok()) << p.status().ToString();
                                 plans.push_back(*p);
                             });
        EXPECT_EQ(call, nullptr) << "a known agent is not asked for";
    }
    ASSERT_EQ(plans.size(), 2u);
    EXPECT_NE(plans[0].transfer_id, plans[1].transfer_id);
    EXPECT_EQ(plans[0].transfer_id.size(), 32u);
    for (const PushPlan& p : plans) {
        EXPECT_EQ(p.prefill_params, schema::PushPrefillRequestParams(p.transfer_id));
        EXPECT_EQ(p.decode_params,
                  schema::PushDecodeRequestParams(p.transfer_id, p.agent, p.agent.tp_size));
        EXPECT_EQ(p.decode_params["remote_engine_id"], "engine-7");
        EXPECT_EQ(p.decode_params["remote_host"], "10.0.0.7");
        EXPECT_EQ(p.decode_params["tp_size"], 2);
    }
    // Forgotten: asked of the worker, which is not there.
    router->ForgetAgent(Role::kPrefill, 0);
    std::promise<Status> failed;
    auto call = PlanPush(*client, router, 0, "", std::chrono::milliseconds(500),
                         [&](Result<PushPlan> p) { failed.set_value(p.status()); });
    EXPECT_NE(call, nullptr);
    const Status st = failed.get_future().get();
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("prefill worker 127.0.0.1:1"), std::string::npos) << st.ToString();
}

// Push's one retry: only a first attempt whose decoder could not reach the agent (Unavailable)
// forgets the agent and plans again; any other failure, or a second, ends the request.
TEST(RouterWorkerCall, OnlyAFirstUnreachableAgentIsForgottenAndPlannedAgain) {
    Router router(RouterConfig{});
    router.AddWorker(Role::kPrefill, {"127.0.0.1", 1});
    const AgentInfo agent{{"engine-7", "10.0.0.7", 7000}, 1};
    router.SetAgent(Role::kPrefill, 0, agent);
    EXPECT_FALSE(ReplanAfterUnreachableAgent(router, 0, 0, InternalError("boom")));
    EXPECT_FALSE(ReplanAfterUnreachableAgent(router, 0, 1, UnavailableError("again")));
    EXPECT_TRUE(router.KnownAgent(Role::kPrefill, 0).has_value()) << "kept: not its fault";
    EXPECT_TRUE(ReplanAfterUnreachableAgent(router, 0, 0, UnavailableError("unreachable")));
    EXPECT_FALSE(router.KnownAgent(Role::kPrefill, 0).has_value()) << "asked again next time";
}

}  // namespace
}  // namespace ferry::router
