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
    struct Parts {
        std::unique_ptr<ServerProcess> colocated, prefill;
        std::vector<std::unique_ptr<ServerProcess>> decode;
        std::unique_ptr<ServerProcess> proxy;
    };
    class OnePrefillTwoDecode {
      public:
        explicit OnePrefillTwoDecode(const std::string& mode,
                                     const std::vector<std::string>& proxy_args = {}) {
            p_.colocated = StartOrDie(WorkerArgs("colocated", "", 1));
            p_.prefill = StartOrDie(WorkerArgs("prefill", "shm", 1));
            for (int i = 0; i < 2; ++i)
                p_.decode.push_back(StartOrDie(WorkerArgs("decode", "shm", 1)));
            if (p_.colocated && p_.prefill && p_.decode[0] && p_.decode[1]) {
                p_.proxy = Proxy(mode, {p_.prefill.get()}, {p_.decode[0].get(), p_.decode[1].get()},
                                 proxy_args);
            }
        }
        bool up() const { return p_.proxy != nullptr; }
        Parts& parts() { return p_; }

      private:
        Parts p_;
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
    // References, not a structured binding: clang 14 cannot capture those in a lambda.
    Parts& parts = d.parts();
    auto& colocated = parts.colocated;
    auto& prefill = parts.prefill;
    auto& decode = parts.decode;
    auto& proxy = parts.proxy;
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
        const auto want = SendAll(colocated->port(), {body});
        ASSERT_EQ(want[0].tokens.size(), size_t(kTokens)) << want[0].body.substr(0, 300);
        Background b(proxy->port(), body);
        ASSERT_TRUE(testing::WaitUntil([&] { return DataEvents(b.body()) >= 20; }));
        // The decode worker running it, killed.
        const int victim = Running(decode);
        ASSERT_GE(victim, 0) << "no decode worker runs the request";
        decode[victim]->Signal(SIGKILL);
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
        EXPECT_EQ(proxy->Metric("ferry_proxy_streams_migrated_total"), ++round);
        // The survivor's blocks come back; the killed one starts again for the next round.
        EXPECT_TRUE(decode[1 - victim]->WaitMetric("ferry_kv_blocks_used", 0));
        ASSERT_TRUE(decode[victim]->Restart().ok());
        ASSERT_TRUE(testing::WaitUntil([&] {
            return proxy->Metric(
                       fmt::format("ferry_router_worker_answering{{role=\"decode\",worker=\"{}\"}}",
                                   Addr(*decode[victim]))) == 1;
        }));
    }
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_EQ(proxy->Metric("ferry_proxy_requests_failed_total"), 0);
}

// A decode worker SIGSTOPped mid-stream: at the proxy's idle deadline (--stream-idle-timeout-ms)
// the stream migrates to the other decode worker and the answer equals colocated; the stopped
// worker, resumed, finds its client gone and frees the request's blocks.
TEST_P(PdFailover, ADecodeWorkerStalledMidStreamHasItsStreamMigratedAtTheIdleDeadline) {
    OnePrefillTwoDecode d(GetParam(), {"--stream-idle-timeout-ms", "1000"});
    ASSERT_TRUE(d.up());
    // References, not a structured binding: clang 14 cannot capture those in a lambda.
    Parts& parts = d.parts();
    auto& colocated = parts.colocated;
    auto& prefill = parts.prefill;
    auto& decode = parts.decode;
    auto& proxy = parts.proxy;
    Json body = CompletionBody(RandomPrompt(200, 71), 400, true, 5);
    const auto want = SendAll(colocated->port(), {body});
    Background b(proxy->port(), body);
    ASSERT_TRUE(testing::WaitUntil([&] { return DataEvents(b.body()) >= 10; }));
    const int victim = Running(decode);
    ASSERT_GE(victim, 0) << "no decode worker runs the request";
    ASSERT_TRUE(decode[victim]->Stop());
    ASSERT_TRUE(b.Wait(std::chrono::seconds(120)));
    EXPECT_EQ(b.status(), 200);
    EXPECT_EQ(TokensOf(b.body(), true), want[0].tokens);
    EXPECT_EQ(proxy->Metric("ferry_proxy_streams_migrated_total"), 1);
    EXPECT_GE(proxy->Metric("ferry_proxy_worker_timeouts_total"), 1);
    decode[victim]->Signal(SIGCONT);
    EXPECT_TRUE(decode[victim]->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(decode[1 - victim]->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_blocks_used", 0));
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
    // References, not a structured binding: clang 14 cannot capture those in a lambda.
    Parts& parts = d.parts();
    auto& colocated = parts.colocated;
    auto& prefill = parts.prefill;
    auto& decode = parts.decode;
    auto& proxy = parts.proxy;
    std::vector<Json> bodies;
    for (int i = 0; i < 6; ++i) {
        bodies.push_back(CompletionBody(RandomPrompt(150 + 70 * i, 50 + i), 8, i % 2 == 0));
    }
    // ferry_continue is the proxy's to set.
    Json forged = bodies[0];
    forged["ferry_continue"] = {{"token_ids", {1, 2}}};
    EXPECT_EQ(SendAll(proxy->port(), {forged})[0].status, 400);
    decode[0]->Signal(SIGKILL);
    ExpectSameTokens(SendAll(proxy->port(), bodies), SendAll(colocated->port(), bodies));
    EXPECT_GE(proxy->Metric("ferry_proxy_decode_retried_total"), 1);
    EXPECT_EQ(proxy->Metric("ferry_proxy_requests_failed_total"), 0);
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(decode[1]->WaitMetric("ferry_kv_blocks_used", 0));
}

INSTANTIATE_TEST_SUITE_P(Protocols, PdFailover, ::testing::Values("pull", "push"),
                         [](const auto& i) { return i.param; });

}  // namespace
}  // namespace ferry::pd_test
