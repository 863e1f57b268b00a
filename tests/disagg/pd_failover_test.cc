// Failures across many workers, with real processes behind `ferry proxy` (docs/failures.md): a
// prefill worker killed or stopped has its requests prefilled by another, or with none left by
// the decode worker; a decode worker killed mid-stream has the stream migrated to another, the
// client's stream going on with no token missing or doubled. Every answer equals colocated token
// for token, greedy and seeded, and every worker's blocks come back.
#include <gtest/gtest.h>
#include <signal.h>

#include <optional>
#include <string>
#include <vector>

#include "disagg/pd_harness.h"
#include "schema/kv_transfer_params.h"
#include "testing/testing.h"

namespace ferry::pd_test {
namespace {

std::string Addr(const ServerProcess& p) { return fmt::format("127.0.0.1:{}", p.port()); }

// A proxy over the given workers ("pull" or "push").
std::unique_ptr<ServerProcess> Proxy(const std::string& mode,
                                     const std::vector<const ServerProcess*>& prefill,
                                     const std::vector<const ServerProcess*>& decode,
                                     const std::vector<std::string>& extra = {}) {
    std::vector<std::string> a = {"proxy",       "--port",        "0", "--no-store", "--policy",
                                  "round-robin", "--kv-transfer", mode};
    a.push_back("--prefill");
    for (const ServerProcess* p : prefill) a.push_back(Addr(*p));
    a.push_back("--decode");
    for (const ServerProcess* p : decode) a.push_back(Addr(*p));
    a.insert(a.end(), extra.begin(), extra.end());
    return StartOrDie(a);
}

int DataEvents(const std::string& body) {
    int n = 0;
    for (size_t pos = 0; (pos = body.find("data: ", pos)) != std::string::npos; pos += 6) ++n;
    return n;
}

class PdFailover : public PdProcess, public ::testing::WithParamInterface<std::string> {
  protected:
    // A colocated reference, one prefill and two decode workers, and a proxy over them.
    struct OnePrefillTwoDecode {
        explicit OnePrefillTwoDecode(const std::string& mode,
                                     const std::vector<std::string>& proxy_args = {}) {
            colocated = StartOrDie(WorkerArgs("colocated", "", 1));
            prefill = StartOrDie(WorkerArgs("prefill", "shm", 1));
            for (int i = 0; i < 2; ++i)
                decode.push_back(StartOrDie(WorkerArgs("decode", "shm", 1)));
            if (colocated && prefill && decode[0] && decode[1]) {
                proxy =
                    Proxy(mode, {prefill.get()}, {decode[0].get(), decode[1].get()}, proxy_args);
            }
        }
        bool up() const { return proxy != nullptr; }
        std::unique_ptr<ServerProcess> colocated, prefill;
        std::vector<std::unique_ptr<ServerProcess>> decode;
        std::unique_ptr<ServerProcess> proxy;
    };
    // The decode worker running the (one) request now; -1 when none is.
    static int Running(const std::vector<std::unique_ptr<ServerProcess>>& decode) {
        int running = -1;
        for (int i = 0; i < int(decode.size()); ++i) {
            if (decode[size_t(i)]->Metric("ferry_num_requests_running") == 1) running = i;
        }
        return running;
    }
};

// A decode worker SIGKILLed mid-stream: the proxy migrates the stream to the other decode
// worker with the tokens already sent, and the client's stream goes on: the whole answer equals
// colocated (greedy, seeded sampling with the same seed, and a chat), each token once, the usage
// counts the original prompt and every output token, and no token id field the client did not
// ask for.
TEST_P(PdFailover, ADecodeWorkerKilledMidStreamHasItsStreamMigrated) {
    OnePrefillTwoDecode d(GetParam());
    ASSERT_TRUE(d.up());
    constexpr int kTokens = 600;
    Json chat = {{"messages", {{{"role", "user"}, {"content", "where does the next ferry go?"}}}},
                 {"max_tokens", kTokens},
                 {"temperature", 0},
                 {"ignore_eos", true},
                 {"logprobs", true},
                 {"return_tokens_as_token_ids", true},
                 {"stream", true}};
    int round = 0;
    for (Json body : {CompletionBody(RandomPrompt(300, 11), kTokens, true),
                      CompletionBody(RandomPrompt(300, 12), kTokens, true, 42), chat}) {
        SCOPED_TRACE(body.dump().substr(0, 80));
        const bool is_chat = body.contains("messages");
        body["stream_options"] = {{"include_usage", true}};
        const auto want = SendAll(d.colocated->port(), {body});
        ASSERT_EQ(want[0].tokens.size(), size_t(kTokens)) << want[0].body.substr(0, 300);
        Background b(d.proxy->port(), body);
        ASSERT_TRUE(testing::WaitUntil([&] { return DataEvents(b.body()) >= 20; }));
        // The decode worker running it, killed.
        const int victim = Running(d.decode);
        ASSERT_GE(victim, 0) << "no decode worker runs the request";
        d.decode[victim]->Signal(SIGKILL);
        ASSERT_TRUE(b.Wait(std::chrono::seconds(120)));
        const std::string got = b.body();
        EXPECT_EQ(b.status(), 200);
        EXPECT_EQ(TokensOf(got, true), want[0].tokens);
        EXPECT_EQ(got.find("\"error\""), std::string::npos) << got.substr(0, 400);
        EXPECT_EQ(got.find("token_ids\":"), std::string::npos) << "ids the client did not ask for";
        EXPECT_EQ(got.find("[DONE]"), got.rfind("[DONE]"));
        const size_t usage = got.rfind("\"usage\"");
        ASSERT_NE(usage, std::string::npos);
        const size_t from = got.rfind("data: ", usage) + 6;
        const Json u = Json::parse(got.substr(from, got.find("\n\n", from) - from))["usage"];
        if (!is_chat) {
            EXPECT_EQ(u["prompt_tokens"], 300);
        }
        EXPECT_EQ(got.find("\"role\""), got.rfind("\"role\""));  // chat: one role chunk
        EXPECT_EQ(u["completion_tokens"], kTokens);
        EXPECT_EQ(d.proxy->Metric("ferry_proxy_streams_migrated_total"), ++round);
        // The survivor's blocks come back; the killed one starts again for the next round.
        EXPECT_TRUE(d.decode[1 - victim]->WaitMetric("ferry_kv_blocks_used", 0));
        ASSERT_TRUE(d.decode[victim]->Restart().ok());
        ASSERT_TRUE(testing::WaitUntil([&] {
            return d.proxy->Metric(
                       fmt::format("ferry_router_worker_answering{{role=\"decode\",worker=\"{}\"}}",
                                   Addr(*d.decode[victim]))) == 1;
        }));
    }
    EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_EQ(d.proxy->Metric("ferry_proxy_requests_failed_total"), 0);
}

// A decode worker SIGSTOPped mid-stream: at the proxy's idle deadline (--stream-idle-timeout-ms)
// the stream migrates to the other decode worker and the answer equals colocated; the stopped
// worker, resumed, finds its client gone and frees the request's blocks.
TEST_P(PdFailover, ADecodeWorkerStalledMidStreamHasItsStreamMigratedAtTheIdleDeadline) {
    OnePrefillTwoDecode d(GetParam(), {"--stream-idle-timeout-ms", "1000"});
    ASSERT_TRUE(d.up());
    Json body = CompletionBody(RandomPrompt(200, 71), 400, true, 5);
    const auto want = SendAll(d.colocated->port(), {body});
    Background b(d.proxy->port(), body);
    ASSERT_TRUE(testing::WaitUntil([&] { return DataEvents(b.body()) >= 10; }));
    const int victim = Running(d.decode);
    ASSERT_GE(victim, 0) << "no decode worker runs the request";
    ASSERT_TRUE(d.decode[victim]->Stop());
    ASSERT_TRUE(b.Wait(std::chrono::seconds(120)));
    EXPECT_EQ(b.status(), 200);
    EXPECT_EQ(TokensOf(b.body(), true), want[0].tokens);
    EXPECT_EQ(d.proxy->Metric("ferry_proxy_streams_migrated_total"), 1);
    EXPECT_GE(d.proxy->Metric("ferry_proxy_worker_timeouts_total"), 1);
    d.decode[victim]->Signal(SIGCONT);
    EXPECT_TRUE(d.decode[victim]->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(d.decode[1 - victim]->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_blocks_used", 0));
}

// Prefill workers that fail: one SIGKILLed (its calls refused) and then one SIGSTOPped past the
// prefill deadline have their requests prefilled by the other; with none left, the decode worker
// prefills them (the proxy's fallback). Every answer equals colocated.
TEST_P(PdFailover, FailedPrefillWorkersHaveTheirRequestsPrefilledElsewhere) {
    const std::string mode = GetParam();
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 1));
    std::vector<std::unique_ptr<ServerProcess>> prefill;
    for (int i = 0; i < 2; ++i) prefill.push_back(StartOrDie(WorkerArgs("prefill", "shm", 1)));
    auto decode = StartOrDie(WorkerArgs("decode", "shm", 1));
    ASSERT_TRUE(colocated && prefill[0] && prefill[1] && decode);
    auto proxy = Proxy(mode, {prefill[0].get(), prefill[1].get()}, {decode.get()},
                       {"--prefill-timeout-ms", "2000"});
    ASSERT_TRUE(proxy);
    std::vector<Json> bodies;
    for (int i = 0; i < 6; ++i) {
        bodies.push_back(CompletionBody(RandomPrompt(200 + 90 * i, 30 + i), 8, i % 2 == 1));
    }
    const auto want = SendAll(colocated->port(), bodies);
    auto round = [&](const char* what, int offset) {
        SCOPED_TRACE(what);
        std::vector<Json> b = bodies;
        for (Json& x : b) x["prompt"].push_back(offset);  // no prefix-cache help between rounds
        std::vector<Answer> w = SendAll(colocated->port(), b);
        ExpectSameTokens(SendAll(proxy->port(), b), w);
    };
    // Killed: round-robin sends half of the requests to it before the proxy knows.
    prefill[0]->Signal(SIGKILL);
    round("one prefill worker killed", 1);
    EXPECT_GE(proxy->Metric("ferry_proxy_prefill_retried_total"), 1);
    ASSERT_TRUE(prefill[0]->Restart().ok());
    ASSERT_TRUE(testing::WaitUntil([&] {
        return proxy->Metric(
                   fmt::format("ferry_router_worker_answering{{role=\"prefill\",worker=\"{}\"}}",
                               Addr(*prefill[0]))) == 1;
    }));
    // Stopped: its calls run past the 2 s deadline, then go to the other.
    const double retried = proxy->Metric("ferry_proxy_prefill_retried_total");
    ASSERT_TRUE(prefill[1]->Stop());
    round("one prefill worker stopped", 2);
    EXPECT_GE(proxy->Metric("ferry_proxy_prefill_retried_total"), retried + 1);
    EXPECT_GE(proxy->Metric("ferry_proxy_worker_timeouts_total"), 1);
    // None left: the decode worker prefills.
    prefill[0]->Signal(SIGKILL);
    prefill[1]->Signal(SIGKILL);
    round("no prefill worker", 3);
    EXPECT_GE(proxy->Metric("ferry_proxy_prefill_fallback_total"), 1);
    EXPECT_EQ(proxy->Metric("ferry_proxy_requests_failed_total"), 0);
    EXPECT_TRUE(decode->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(decode->WaitMetric("ferry_kv_requests_loading", 0));
}

// A decode worker SIGKILLed before the requests come: those routed to it before the proxy
// knows go to the other decode worker (pull: with the same kv_transfer_params, the prefill
// worker's hold read by the other; push: the hand-off planned again), and the prefill worker
// holds nothing afterwards.
TEST_P(PdFailover, ADecodeWorkerLostBeforeItsFirstByteHasTheRequestSentToAnother) {
    OnePrefillTwoDecode d(GetParam());
    ASSERT_TRUE(d.up());
    std::vector<Json> bodies;
    for (int i = 0; i < 6; ++i) {
        bodies.push_back(CompletionBody(RandomPrompt(150 + 70 * i, 50 + i), 8, i % 2 == 0));
    }
    // ferry_continue is the proxy's to set.
    Json forged = bodies[0];
    forged["ferry_continue"] = {{"token_ids", {1, 2}}};
    EXPECT_EQ(SendAll(d.proxy->port(), {forged})[0].status, 400);
    d.decode[0]->Signal(SIGKILL);
    ExpectSameTokens(SendAll(d.proxy->port(), bodies), SendAll(d.colocated->port(), bodies));
    EXPECT_GE(d.proxy->Metric("ferry_proxy_decode_retried_total"), 1);
    EXPECT_EQ(d.proxy->Metric("ferry_proxy_requests_failed_total"), 0);
    EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_requests_held", 0));
    EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(d.decode[1]->WaitMetric("ferry_kv_blocks_used", 0));
}

// The router (`ferry proxy`) SIGKILLed with requests in flight at every stage (streams being
// decoded, long prompts being prefilled or handed off, and for pull holds no decoder came for
// yet) and started again on its port: its clients' connections end with it, since nothing else
// holds state for them; every worker aborts the requests whose caller went away and gives their
// blocks back (a pull hold nobody claims, by its lease); the new router serves as colocated at
// once.
TEST_P(PdFailover, ARouterKilledMidRequestLeavesNothingBehindAndItsSuccessorServes) {
    const std::string mode = GetParam();
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 1));
    auto prefill = StartOrDie(WorkerArgs("prefill", "shm", 1, {"--kv-hold-lease-ms", "2000"}));
    std::vector<std::unique_ptr<ServerProcess>> decode;
    for (int i = 0; i < 2; ++i) decode.push_back(StartOrDie(WorkerArgs("decode", "shm", 1)));
    ASSERT_TRUE(colocated && prefill && decode[0] && decode[1]);
    auto proxy = Proxy(mode, {prefill.get()}, {decode[0].get(), decode[1].get()});
    ASSERT_TRUE(proxy);
    std::vector<std::unique_ptr<Background>> inflight;
    for (int i = 0; i < 4; ++i) {
        inflight.push_back(std::make_unique<Background>(
            proxy->port(), CompletionBody(RandomPrompt(100, 200 + i), 3000, true)));
    }
    ASSERT_TRUE(testing::WaitUntil([&] { return DataEvents(inflight[0]->body()) >= 10; }));
    for (int i = 0; i < 6; ++i) {
        inflight.push_back(std::make_unique<Background>(
            proxy->port(), CompletionBody(RandomPrompt(1500, 210 + i), 8, i % 2 == 0)));
    }
    ASSERT_TRUE(
        testing::WaitUntil([&] { return prefill->Metric("ferry_num_requests_running") >= 1; }));
    proxy->Signal(SIGKILL);
    for (size_t i = 0; i < inflight.size(); ++i) {
        ASSERT_TRUE(inflight[i]->Wait(std::chrono::seconds(30)));
        // The long streams were cut (a short request may have finished before the kill).
        if (i < 4) {
            EXPECT_EQ(inflight[i]->body().find("[DONE]"), std::string::npos)
                << "a cut stream is not complete";
        }
    }
    ASSERT_TRUE(proxy->Restart().ok());
    // The streams were aborted (not run to their end), and nothing is left on the workers for
    // the requests of the dead router.
    const std::string aborted = "ferry_request_success_total{finished_reason=\"abort\"}";
    EXPECT_TRUE(testing::WaitUntil([&] {
        return decode[0]->Metric(aborted) + decode[1]->Metric(aborted) >= 4;
    })) << decode[0]->Metric(aborted)
        << " + " << decode[1]->Metric(aborted);
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_num_requests_running", 0));
    for (auto& w : decode) {
        EXPECT_TRUE(w->WaitMetric("ferry_kv_blocks_used", 0));
        EXPECT_TRUE(w->WaitMetric("ferry_num_requests_running", 0));
        EXPECT_TRUE(w->WaitMetric("ferry_kv_requests_loading", 0));
    }
    // The router that took its place serves at once, as colocated does.
    std::vector<Json> bodies;
    for (int i = 0; i < 6; ++i) {
        bodies.push_back(CompletionBody(RandomPrompt(120 + 40 * i, 230 + i), 8, i % 2 == 1));
    }
    ExpectSameTokens(SendAll(proxy->port(), bodies), SendAll(colocated->port(), bodies));
    EXPECT_EQ(proxy->Metric("ferry_proxy_requests_failed_total"), 0);
}

// Decode-first (`--remote-prefill`, Dynamo style) with prefill workers that fail: a SIGKILLed
// one has its prompts prefilled by the other; with none left, a decode worker started with
// --kv-load-failure recompute prefills them itself and one without answers 503. Every 200
// equals colocated.
TEST_F(PdProcess, DecodeFirstRetriesAnotherPrefillWorkerThenPrefillsHere) {
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 1));
    std::vector<std::unique_ptr<ServerProcess>> prefill;
    for (int i = 0; i < 2; ++i) prefill.push_back(StartOrDie(WorkerArgs("prefill", "shm", 1)));
    ASSERT_TRUE(colocated && prefill[0] && prefill[1]);
    const std::vector<std::string> remote = {"--remote-prefill",
                                             Addr(*prefill[0]),
                                             "--remote-prefill",
                                             Addr(*prefill[1]),
                                             "--remote-prefill-min-tokens",
                                             "32"};
    std::vector<std::string> recompute = remote;
    recompute.insert(recompute.end(), {"--kv-load-failure", "recompute"});
    auto lenient = StartOrDie(WorkerArgs("decode", "shm", 1, recompute));
    auto strict = StartOrDie(WorkerArgs("decode", "shm", 1, remote));
    ASSERT_TRUE(lenient && strict);
    auto bodies = [](int offset) {
        std::vector<Json> b;
        for (int i = 0; i < 6; ++i) {
            b.push_back(
                CompletionBody(RandomPrompt(100 + 30 * i, 300 + 10 * offset + i), 6, i % 2 == 0));
        }
        return b;
    };
    const char* retried = "ferry_remote_prefill_retried_total";
    const char* fallback = "ferry_remote_prefill_fallback_total";
    ExpectSameTokens(SendAll(lenient->port(), bodies(0), 1), SendAll(colocated->port(), bodies(0)));
    EXPECT_EQ(lenient->Metric(retried), 0);
    EXPECT_EQ(lenient->Metric("ferry_prompt_tokens_total"), 0) << "prefilled remotely";
    // One prefill worker gone: round robin sends every other prompt to it first.
    prefill[0]->Signal(SIGKILL);
    for (ServerProcess* d : {lenient.get(), strict.get()}) {
        SCOPED_TRACE(d == lenient.get() ? "lenient" : "strict");
        ExpectSameTokens(SendAll(d->port(), bodies(1), 1), SendAll(colocated->port(), bodies(1)));
        EXPECT_GE(d->Metric(retried), 1);
        EXPECT_EQ(d->Metric(fallback), 0);
    }
    // None left: prefilled here with recompute, else refused.
    prefill[1]->Signal(SIGKILL);
    ExpectSameTokens(SendAll(lenient->port(), bodies(2), 1), SendAll(colocated->port(), bodies(2)));
    EXPECT_GE(lenient->Metric(fallback), 1);
    for (const Answer& a : SendAll(strict->port(), bodies(2), 1)) {
        EXPECT_EQ(a.status, 503) << a.body.substr(0, 300);
        EXPECT_TRUE(a.tokens.empty());
    }
    EXPECT_EQ(strict->Metric(fallback), 0);
    for (ServerProcess* d : {lenient.get(), strict.get()}) {
        EXPECT_TRUE(d->WaitMetric("ferry_kv_blocks_used", 0));
        EXPECT_TRUE(d->WaitMetric("ferry_kv_requests_loading", 0));
    }
}

// push, a decode worker's blocks while its prefill worker has the request (push-alive): behind
// a prefill queue many times longer than the decoder's whole wait (0.3 s here; 1.5 s under the
// sanitizers, whose pump threads run late) the decoder goes
// on waiting and answers as colocated does; a prefill worker SIGSTOPped (on shm, where the
// decoder's liveness read still succeeds) stops renewing, and its decoder gives up three renewal
// intervals after the last instead of at its whole wait (21 s here, 40 s by default).
TEST_F(PdProcess, APushDecoderWaitsBehindALongPrefillQueueButNotForAStoppedPrefillWorker) {
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 1));
    // One request at a time; push-alive every 100 ms.
    auto prefill =
        StartOrDie(WorkerArgs("prefill", "shm", 1,
                              {"--max-num-seqs", "1", "--kv-connector-config",
                               testing::kSanitized ? R"({"hold_renew_interval_ms": 500})"
                                                   : R"({"hold_renew_interval_ms": 100})"}));
    auto impatient = StartOrDie(WorkerArgs(
        "decode", "shm", 1,
        {"--kv-connector-config",
         testing::kSanitized ? R"({"bootstrap_timeout_ms": 1000, "transfer_timeout_ms": 500})"
                             : R"({"bootstrap_timeout_ms": 100, "transfer_timeout_ms": 200})"}));
    auto patient =
        StartOrDie(WorkerArgs("decode", "shm", 1,
                              {"--kv-connector-config",
                               R"({"bootstrap_timeout_ms": 20000, "transfer_timeout_ms": 1000})"}));
    ASSERT_TRUE(colocated && prefill && impatient && patient);
    auto agent = http::Fetch(
        http::GetRequest("127.0.0.1", prefill->port(), "/v1/kv/agent", std::chrono::seconds(5)));
    ASSERT_TRUE(agent.ok() && agent->status == 200);
    const Json a = Json::parse(agent->body);
    const schema::AgentAddress where{a["engine_id"].get<std::string>(),
                                     a["host"].get<std::string>(), a["port"].get<int>()};
    // The prefill worker busy with long streams, one after the other; the hand-off's prefill
    // half queued behind them. The answer of the last is when the queue ended.
    struct Busy {
        std::vector<std::unique_ptr<Background>> streams;
        void Cancel() {
            for (auto& b : streams) b->Cancel();
        }
        std::chrono::steady_clock::time_point end() {
            for (auto& b : streams) b->Wait(std::chrono::seconds(60));
            std::chrono::steady_clock::time_point last{};
            for (auto& b : streams) last = std::max(last, b->end());
            return last;
        }
    };
    auto busy = [&] {
        auto b = std::make_unique<Busy>();
        for (int i = 0; i < 3; ++i) {
            b->streams.push_back(std::make_unique<Background>(
                prefill->port(),
                CompletionBody(RandomPrompt(20, 90 + i), testing::kSanitized ? 1500 : 4000, true)));
            if (i == 0) {
                EXPECT_TRUE(
                    testing::WaitUntil([&] { return DataEvents(b->streams[0]->body()) >= 3; }));
            }
        }
        // Queued first (first come, first served): the hand-off's prefill half comes after.
        EXPECT_TRUE(prefill->WaitMetric("ferry_num_requests_waiting", 2));
        return b;
    };
    auto hand_off = [&](ServerProcess& decode, const Json& body, const std::string& xid) {
        Json db = body;
        db["kv_transfer_params"] = schema::PushDecodeRequestParams(xid, where, 1);
        Json pb = body;
        pb["kv_transfer_params"] = schema::PushPrefillRequestParams(xid);
        pb["max_tokens"] = 1;
        return std::make_pair(std::make_unique<Background>(decode.port(), db),
                              std::make_unique<Background>(prefill->port(), pb));
    };
    const Json body = CompletionBody(RandomPrompt(300, 91), 12, false);
    const auto want = SendAll(colocated->port(), {body});
    {
        SCOPED_TRACE("a long prefill queue");
        auto long_stream = busy();
        const auto sent = std::chrono::steady_clock::now();
        auto [d, p] = hand_off(*impatient, body, "push-alive-test-queue-00000001");
        ASSERT_TRUE(d->Wait(std::chrono::seconds(120)));
        EXPECT_EQ(d->status(), 200) << d->body().substr(0, 300);
        EXPECT_EQ(TokensOf(d->body(), false), want[0].tokens);
        // It waited behind the stream, many times its whole wait, kept by push-alive.
        EXPECT_GE(d->end(), long_stream->end());
        EXPECT_GT(long_stream->end() - sent,
                  std::chrono::milliseconds(testing::kSanitized ? 4500 : 900))
            << "the queue was too short to tell";
        EXPECT_GE(impatient->Metric("ferry_kv_connector_pushes_renewed_total"), 3);
        ASSERT_TRUE(p->Wait(std::chrono::seconds(60)));
    }
    EXPECT_TRUE(impatient->WaitMetric("ferry_kv_blocks_used", 0));
    {
        SCOPED_TRACE("a stopped prefill worker");
        auto long_stream = busy();
        auto [d, p] = hand_off(*patient, body, "push-alive-test-stop-00000002");
        ASSERT_TRUE(testing::WaitUntil(
            [&] { return patient->Metric("ferry_kv_connector_pushes_renewed_total") >= 2; }));
        ASSERT_TRUE(prefill->Stop());
        const auto stopped = std::chrono::steady_clock::now();
        ASSERT_TRUE(d->Wait(std::chrono::seconds(60)));
        // 0.3 s after the last push-alive, then the cancel's wait (its transfer timeout and a
        // second, for a stopped worker that resumes mid-write): ~2.3 s, not 21 + 2.
        EXPECT_LT(d->end() - stopped, std::chrono::seconds(10));
        EXPECT_EQ(d->status(), 503) << d->body().substr(0, 300);
        EXPECT_NE(d->body().find("did not finish in time"), std::string::npos) << d->body();
        EXPECT_TRUE(patient->WaitMetric("ferry_kv_blocks_used", 0));
        prefill->Signal(SIGCONT);
        long_stream->Cancel();
        ASSERT_TRUE(p->Wait(std::chrono::seconds(60)));
    }
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_blocks_used", 0));
}

INSTANTIATE_TEST_SUITE_P(Protocols, PdFailover, ::testing::Values("pull", "push"),
                         [](const auto& i) { return i.param; });

}  // namespace
}  // namespace ferry::pd_test
