// Prefill/decode disaggregation with real processes: `ferry serve --role prefill|decode` behind
// `ferry proxy`, against a colocated `ferry serve` on the same model file. Answers must equal the
// colocated ones token for token (token ids, via vLLM's return_tokens_as_token_ids), and the
// decode worker must compute no prompt token itself (its ferry_prompt_tokens_total stays 0).
// Then the failures of issue 17: a prefill worker SIGKILLed mid-transfer, a client that leaves,
// a decode worker killed; after each, every worker's KV blocks return to their baseline.
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "disagg/pd_harness.h"
#include "ferry/discovery.h"
#include "http/http.h"
#include "schema/kv_transfer_params.h"
#include "testing/images.h"
#include "testing/testing.h"
#include "testing/tiny_model.h"
#include "testing/worker_process.h"

namespace ferry {
namespace {

using namespace pd_test;  // NOLINT: the harness is this test's own vocabulary
using Json = nlohmann::json;
using testing::ServerProcess;

struct Deployment {
    std::unique_ptr<ServerProcess> prefill, decode, proxy_pull, proxy_push;
};

Deployment Deploy(const std::vector<std::string>& prefill_args,
                  const std::vector<std::string>& decode_args,
                  const std::vector<std::string>& proxy_args = {}) {
    Deployment d;
    d.prefill = StartOrDie(prefill_args);
    d.decode = StartOrDie(decode_args);
    if (!d.prefill || !d.decode) return d;
    std::string p = fmt::format("127.0.0.1:{}", d.prefill->port());
    std::string q = fmt::format("127.0.0.1:{}", d.decode->port());
    std::vector<std::string> pull = {"proxy", "--prefill", p,   "--decode",
                                     q,       "--port",    "0", "--no-store"};
    pull.insert(pull.end(), proxy_args.begin(), proxy_args.end());
    std::vector<std::string> push = pull;
    push.insert(push.end(), {"--kv-transfer", "push"});
    d.proxy_pull = StartOrDie(pull);
    d.proxy_push = StartOrDie(push);
    return d;
}

class PdMatrix : public PdProcess,
                 public ::testing::WithParamInterface<std::tuple<std::string, int>> {};

TEST_P(PdMatrix, HundredPromptsThroughTheProxyEqualColocatedForPullAndPush) {
    const auto [backend, tp] = GetParam();
    const std::vector<Answer>& want = Reference(tp);
    ASSERT_EQ(want.size(), static_cast<size_t>(kPrompts));
    for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(want[i].status, 200) << i << " " << want[i].body << want[i].error.ToString();
    }
    Deployment d = Deploy(WorkerArgs("prefill", backend, tp), WorkerArgs("decode", backend, tp));
    ASSERT_TRUE(d.proxy_pull && d.proxy_push);
    const auto prompts = Prompts();
    int64_t total = 0;
    for (const auto& p : prompts) total += static_cast<int64_t>(p.size());
    for (ServerProcess* proxy : {d.proxy_pull.get(), d.proxy_push.get()}) {
        const bool push = proxy == d.proxy_push.get();
        std::vector<Json> bodies;
        for (size_t i = 0; i < prompts.size(); ++i) {
            bodies.push_back(CompletionBody(prompts[i], 6, i % 2 == 1));  // half streamed
        }
        const double external_before = d.decode->Metric("ferry_kv_external_tokens_total");
        auto got = SendAll(proxy->port(), bodies);
        for (size_t i = 0; i < prompts.size(); ++i) {
            EXPECT_EQ(got[i].status, 200) << (push ? "push " : "pull ") << i << ": "
                                          << got[i].body.substr(0, 300) << got[i].error.ToString();
            EXPECT_EQ(got[i].tokens, want[i].tokens) << (push ? "push" : "pull") << " prompt " << i
                                                     << " of " << prompts[i].size() << " tokens";
        }
        // Every prompt token came over the wire (push: less what the decoder's prefix cache
        // already held from the pull round, which saw the same prompts).
        const double external =
            d.decode->Metric("ferry_kv_external_tokens_total") - external_before;
        if (push) {
            EXPECT_GT(external, 0);
            EXPECT_LE(external, double(total));
        } else {
            EXPECT_EQ(external, double(total));
        }
    }
    EXPECT_EQ(d.decode->Metric("ferry_prompt_tokens_total"), 0);
    EXPECT_GT(d.prefill->Metric("ferry_prompt_tokens_total"), 0);
    EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(d.decode->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_EQ(d.decode->Metric("ferry_kv_connector_failed_total"), -1);  // no failure reason seen
    // A 2000-token prompt is 125 blocks per rank: one descriptor per run of blocks adjacent on
    // both sides (the pools reuse freed blocks, so a few runs), not one per block. How many runs
    // depends on how the concurrent requests' frees interleaved (34 seen at TP 2 on a loaded
    // machine; 51 at TP 1 once decoders stopped caching KV from unknown peers, which fragments
    // the pool more), so the bound is 96 per rank, which still fails if runs are not merged.
    EXPECT_LE(d.decode->Metric("ferry_kv_connector_descriptors_max"), 96 * tp);
}

std::vector<std::tuple<std::string, int>> MatrixCases() {
    std::vector<std::tuple<std::string, int>> out;
    for (const auto& b : AvailableBackends()) {
        for (int tp : {1, 2}) out.emplace_back(b, tp);
    }
    return out;
}
INSTANTIATE_TEST_SUITE_P(Backends, PdMatrix, ::testing::ValuesIn(MatrixCases()), [](const auto& i) {
    return fmt::format("{}_tp{}", std::get<0>(i.param), std::get<1>(i.param));
});

// Heterogeneous TP between processes, through the proxy, pull and push: a prefill worker of
// TP p and a decode worker of TP d (the in-process matrix in kv_connector_test covers every p, d
// in {1, 2, 4}); answers equal a colocated worker's of the decoder's TP.
class PdHeteroTp : public PdProcess,
                   public ::testing::WithParamInterface<std::tuple<std::string, int, int>> {};
TEST_P(PdHeteroTp, ThroughTheProxyEqualColocated) {
    const auto [backend, ptp, dtp] = GetParam();
    const std::vector<Answer>& want = Reference(dtp);
    Deployment d = Deploy(WorkerArgs("prefill", backend, ptp), WorkerArgs("decode", backend, dtp));
    ASSERT_TRUE(d.proxy_pull && d.proxy_push);
    const auto prompts = Prompts();
    ASSERT_EQ(want.size(), prompts.size());
    // Different prompts per protocol: the decoder's prefix cache does not help the second.
    const size_t half = std::min<size_t>(30, prompts.size() / 2);
    for (ServerProcess* proxy : {d.proxy_pull.get(), d.proxy_push.get()}) {
        const bool push = proxy == d.proxy_push.get();
        std::vector<Json> bodies;
        for (size_t i = push ? half : 0; i < (push ? 2 * half : half); ++i) {
            bodies.push_back(CompletionBody(prompts[i], 6, i % 2 == 1));
        }
        auto got = SendAll(proxy->port(), bodies);
        for (size_t k = 0; k < bodies.size(); ++k) {
            const size_t i = k + (push ? half : 0);
            EXPECT_EQ(got[k].status, 200) << (push ? "push " : "pull ") << i << ": "
                                          << got[k].body.substr(0, 300) << got[k].error.ToString();
            EXPECT_EQ(got[k].tokens, want[i].tokens) << (push ? "push" : "pull") << " prompt " << i;
        }
    }
    EXPECT_EQ(d.decode->Metric("ferry_prompt_tokens_total"), 0);
    EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(d.decode->WaitMetric("ferry_kv_blocks_used", 0));
}
INSTANTIATE_TEST_SUITE_P(Backends, PdHeteroTp,
                         ::testing::Values(std::tuple<std::string, int, int>{"tcp", 2, 1},
                                           std::tuple<std::string, int, int>{"shm", 1, 2}),
                         [](const auto& i) {
                             return fmt::format("{}_tp{}to{}", std::get<0>(i.param),
                                                std::get<1>(i.param), std::get<2>(i.param));
                         });

TEST_F(PdProcess, SixtyFourInFlightAndSeededSamplingMatchColocated) {
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 1));
    Deployment d = Deploy(WorkerArgs("prefill", "shm", 1), WorkerArgs("decode", "shm", 1));
    ASSERT_TRUE(colocated && d.proxy_pull && d.proxy_push);
    std::vector<Json> bodies;
    for (int i = 0; i < 64; ++i) {
        bodies.push_back(
            CompletionBody(RandomPrompt(30 + 7 * i, 900 + i), 8, i % 2 == 0,
                           i % 4 == 0 ? std::optional<uint64_t>(77 + i) : std::nullopt));
    }
    auto want = SendAll(colocated->port(), bodies, 64);
    for (ServerProcess* proxy : {d.proxy_pull.get(), d.proxy_push.get()}) {
        auto got = SendAll(proxy->port(), bodies, 64);
        for (size_t i = 0; i < bodies.size(); ++i) {
            EXPECT_EQ(got[i].status, 200) << got[i].body.substr(0, 300);
            EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
        }
    }
    EXPECT_EQ(d.decode->Metric("ferry_prompt_tokens_total"), 0);
    // /tokenize and /detokenize through the proxy answer as a worker does.
    const Json tok = {{"prompt", "tokens, through the proxy"}};
    auto direct = http::Fetch(Post(colocated->port(), tok, "/tokenize"));
    auto proxied = http::Fetch(Post(d.proxy_pull->port(), tok, "/tokenize"));
    ASSERT_TRUE(direct.ok() && proxied.ok());
    EXPECT_EQ(proxied->status, 200) << proxied->body;
    EXPECT_EQ(proxied->body, direct->body);
    auto back =
        http::Fetch(Post(d.proxy_push->port(),
                         Json{{"tokens", Json::parse(direct->body)["tokens"]}}, "/detokenize"));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(Json::parse(back->body)["prompt"], "tokens, through the proxy");
}

// Decode-first (Dynamo style): the client talks to the decode worker, which sends prompts of at
// least --remote-prefill-min-tokens to a prefill worker added at run time and gets their KV
// pushed; shorter prompts it prefills itself.
TEST_F(PdProcess, DecodeFirstRemotePrefillEqualsColocated) {
    // The admin route is the router's: served only with the deployment's router token.
    testing::SecretFile secret("pd-decode-first");
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 1));
    auto prefill = StartOrDie(WorkerArgs("prefill", "shm", 1, {"--secret-file", secret.path()}));
    auto decode = StartOrDie(WorkerArgs(
        "decode", "shm", 1, {"--remote-prefill-min-tokens", "64", "--secret-file", secret.path()}));
    ASSERT_TRUE(colocated && prefill && decode);
    http::ClientRequest add =
        Post(decode->port(), Json{{"endpoints", {fmt::format("127.0.0.1:{}", prefill->port())}}},
             "/add_remote_prefill_eps");
    auto anonymous = http::Fetch(add);
    ASSERT_TRUE(anonymous.ok());
    EXPECT_EQ(anonymous->status, 401) << anonymous->body;
    add.headers.push_back({"Authorization", "Bearer " + secret.router_token()});
    auto added = http::Fetch(add);
    ASSERT_TRUE(added.ok());
    EXPECT_EQ(added->status, 200) << added->body;
    http::ClientRequest bad_body =
        Post(decode->port(), Json{{"endpoints", "x"}}, "/add_remote_prefill_eps");
    bad_body.headers = add.headers;
    auto bad = http::Fetch(bad_body);
    ASSERT_TRUE(bad.ok());
    EXPECT_EQ(bad->status, 400);
    std::vector<Json> bodies;
    int64_t remote = 0, local = 0;
    const auto prompts = Prompts();
    for (size_t i = 0; i < prompts.size() && i < 40; ++i) {
        bodies.push_back(CompletionBody(prompts[i], 6, i % 2 == 0));
        (prompts[i].size() >= 64 ? remote : local) += static_cast<int64_t>(prompts[i].size());
    }
    ExpectSameTokens(SendAll(decode->port(), bodies), SendAll(colocated->port(), bodies));
    EXPECT_EQ(decode->Metric("ferry_kv_external_tokens_total"), double(remote));
    EXPECT_EQ(decode->Metric("ferry_prompt_tokens_total"), double(local));
    // A prefill worker that is gone: the request fails with an error naming it, no hang.
    prefill->Kill();
    auto dead = SendAll(decode->port(), {CompletionBody(RandomPrompt(300, 9), 4, false)});
    EXPECT_EQ(dead[0].status, 503) << dead[0].body;
    EXPECT_NE(dead[0].body.find("remote prefill worker"), std::string::npos) << dead[0].body;
    EXPECT_TRUE(decode->WaitMetric("ferry_kv_blocks_used", 0));
}

// Seed 004's deployment as its commands say: the decode worker at TP 2, the prefill worker at
// TP 1, both with block size 128, decode-first (the decode worker sends long prompts to the
// prefill worker it was given by POST /add_remote_prefill_eps, which pushes the KV back). Each
// decode rank receives its kv head from the one prefill rank; answers equal a colocated worker's
// of the decoder's shape, and the decoder computes none of the long prompts.
TEST_F(PdProcess, SeedFourDeploymentDecodeTp2PrefillTp1BlockSize128EqualsColocated) {
    testing::SecretFile secret("pd-seed-004");
    const std::vector<std::string> big_blocks = {"--block-size", "128", "--num-kv-blocks", "800"};
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 2, big_blocks));
    std::vector<std::string> p = big_blocks, d = big_blocks;
    p.insert(p.end(), {"--secret-file", secret.path()});
    // Every unit of every request's KV checked on arrival (the default checks a sample).
    d.insert(d.end(), {"--remote-prefill-min-tokens", "64", "--secret-file", secret.path(),
                       "--kv-verify", "all"});
    auto prefill = StartOrDie(WorkerArgs("prefill", "shm", 1, p));
    auto decode = StartOrDie(WorkerArgs("decode", "shm", 2, d));
    ASSERT_TRUE(colocated && prefill && decode);
    http::ClientRequest add = Post(
        decode->port(), Json{{"endpoints", {fmt::format("http://127.0.0.1:{}", prefill->port())}}},
        "/add_remote_prefill_eps");
    add.headers.push_back({"Authorization", "Bearer " + secret.router_token()});
    auto added = http::Fetch(add);
    ASSERT_TRUE(added.ok() && added->status == 200) << (added.ok() ? added->body : "");
    std::vector<Json> bodies;
    int64_t remote = 0;
    const auto prompts = Prompts();
    for (size_t i = 0; i < prompts.size() && i < 24; ++i) {
        if (prompts[i].size() < 64) continue;
        bodies.push_back(CompletionBody(prompts[i], 6, i % 2 == 0));
        remote += static_cast<int64_t>(prompts[i].size());
    }
    ASSERT_GE(bodies.size(), 8u);
    ExpectSameTokens(SendAll(decode->port(), bodies), SendAll(colocated->port(), bodies));
    EXPECT_EQ(decode->Metric("ferry_kv_external_tokens_total"), double(remote));
    EXPECT_EQ(decode->Metric("ferry_prompt_tokens_total"), 0);
    EXPECT_TRUE(decode->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
    // The KV of each request summed the same on both sides, across TP 1 -> 2 and blocks of 128;
    // each side checked the other's canary once.
    EXPECT_EQ(decode->Metric("ferry_kv_connector_verified_total"), double(bodies.size()));
    EXPECT_EQ(decode->Metric("ferry_kv_connector_verify_mismatches_total"), 0);
    EXPECT_GE(decode->Metric("ferry_kv_connector_canaries_total"), 1);
    EXPECT_GE(prefill->Metric("ferry_kv_connector_canaries_total"), 1);
    EXPECT_EQ(decode->Metric("ferry_kv_connector_canary_failures_total") +
                  prefill->Metric("ferry_kv_connector_canary_failures_total"),
              0);
}

// Seed 004's commands as its author wrote them for `vllm serve` (vLLM's flag spellings, its
// --kv-transfer-config, flags with no meaning here, chunked prefill off with the default batch
// limit), with `ferry serve`, the model file and a free port; then its curl of
// /add_remote_prefill_eps without a token, from this host. Answers equal a colocated worker's and
// the decode worker computes no prompt token.
TEST_F(PdProcess, SeedFourCommandLinesRunAsVllmsWordsSayThem) {
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 2, {"--block-size", "128"}));
    auto decode = StartOrDie({"serve", model_->path(), "--tensor_parallel-size", "2", "--port", "0",
                              "--max-model-len", "131072", "--swap-space", "0", "--block-size",
                              "128", "--trust-remote-code", "--kv-transfer-config",
                              R"({"kv_connector":"DynamoNixlConnector"})",
                              "--enable-chunked-prefill", "false"});
    auto prefill = StartOrDie(
        {"serve",
         model_->path(),
         "--tensor_parallel-size",
         "1",
         "--port",
         "0",
         "--max-model-len",
         "65536",
         "--swap-space",
         "0",
         "--block-size",
         "128",
         "--gpu-memory-utilization",
         "0.95",
         "--trust-remote-code",
         "--enforce-eager",
         "--kv-transfer-config",
         R"({"kv_connector":"DynamoNixlConnector", "kv_connector_extra_config":{"skip_sampling":true}})",
         "--enable-chunked-prefill",
         "false"});
    ASSERT_TRUE(colocated && decode && prefill);
    EXPECT_NE(decode->agent(), "") << "a decode worker with a KV agent";
    EXPECT_NE(prefill->agent(), "");
    auto added = http::Fetch(Post(
        decode->port(), Json{{"endpoints", {fmt::format("http://127.0.0.1:{}", prefill->port())}}},
        "/add_remote_prefill_eps"));
    ASSERT_TRUE(added.ok() && added->status == 200) << (added.ok() ? added->body : "");
    std::vector<Json> bodies;
    int64_t prompt_tokens = 0;
    const auto prompts = Prompts();
    for (size_t i = 0; i < prompts.size() && i < 12; ++i) {
        bodies.push_back(CompletionBody(prompts[i], 6, i % 2 == 0));
        prompt_tokens += static_cast<int64_t>(prompts[i].size());
    }
    ExpectSameTokens(SendAll(decode->port(), bodies), SendAll(colocated->port(), bodies));
    EXPECT_EQ(decode->Metric("ferry_kv_external_tokens_total"), double(prompt_tokens));
    EXPECT_EQ(decode->Metric("ferry_prompt_tokens_total"), 0);
    // The seed's own request: a chat completion at temperature 0.
    const Json chat = {{"model", model_->path()},
                       {"temperature", 0},
                       {"messages", {{{"role", "user"}, {"content", "San Francisco is "}}}},
                       {"max_tokens", 12},
                       {"stream", false}};
    Json unnamed = chat;  // the colocated worker is served under the model's own name
    unnamed.erase("model");
    auto a = http::Fetch(Post(decode->port(), chat, "/v1/chat/completions"));
    auto b = http::Fetch(Post(colocated->port(), unnamed, "/v1/chat/completions"));
    ASSERT_TRUE(a.ok() && b.ok() && a->status == 200 && b->status == 200)
        << (a.ok() ? a->body : a.status().ToString());
    EXPECT_EQ(Json::parse(a->body)["choices"][0]["message"]["content"],
              Json::parse(b->body)["choices"][0]["message"]["content"]);
    EXPECT_EQ(decode->Metric("ferry_prompt_tokens_total"), 0);
    EXPECT_TRUE(decode->WaitMetric("ferry_kv_blocks_used", 0));
}

// MLA between processes: a TP-1 prefill worker and a TP-2 decode worker of an MLA model (each
// with one latent cache), pull and push through the proxy, then decode-first; every answer equals
// a colocated TP-2 worker's, the decoder computes no prompt token, every request's latent is
// checked on arrival (`--kv-verify all`: one unit a layer) and one copy moves per request.
TEST_F(PdProcess, MlaPullPushAndDecodeFirstEqualColocated) {
    testing::TinyModelFile mla("pd-process-mla", testing::TinyMlaModelSpec(4096), 23);
    auto on_mla = [&](std::vector<std::string> a) {
        *(std::find(a.begin(), a.end(), "--model") + 1) = mla.path();
        return a;
    };
    testing::SecretFile secret("pd-mla");
    const std::vector<std::string> p = {"--secret-file", secret.path()};
    const std::vector<std::string> d = {
        "--secret-file", secret.path(), "--kv-verify", "all", "--remote-prefill-min-tokens", "64"};
    auto colocated = StartOrDie(on_mla(WorkerArgs("colocated", "", 2)));
    auto prefill = StartOrDie(on_mla(WorkerArgs("prefill", "shm", 1, p)));
    auto decode = StartOrDie(on_mla(WorkerArgs("decode", "shm", 2, d)));
    ASSERT_TRUE(colocated && prefill && decode);
    const std::string pe = fmt::format("127.0.0.1:{}", prefill->port());
    auto [pull, push] = PullAndPushProxies(*prefill, *decode, secret.path());
    ASSERT_TRUE(pull && push);
    // Different prompts per way in, so that the decoder's prefix cache helps none of them; only
    // prompts decode-first prefills remotely (64 tokens or more), a third for each way.
    std::vector<std::vector<int32_t>> long_prompts;
    for (const auto& prompt : Prompts()) {
        if (prompt.size() >= 64) long_prompts.push_back(prompt);
    }
    // Under the sanitizers two a way take every path (MLA's math runs 40x slower under TSan).
    const size_t each = std::min<size_t>(testing::kSanitized ? 2 : 8, long_prompts.size() / 3);
    ASSERT_GE(each, 2u) << "of " << long_prompts.size() << " long prompts";
    std::vector<std::vector<Json>> bodies(3);
    int64_t long_tokens = 0;
    for (size_t k = 0; k < 3 * each; ++k) {
        bodies[k / each].push_back(CompletionBody(long_prompts[k], 6, k % 2 == 0));
        long_tokens += static_cast<int64_t>(long_prompts[k].size());
    }
    ExpectSameTokens(SendAll(pull->port(), bodies[0]), SendAll(colocated->port(), bodies[0]));
    ExpectSameTokens(SendAll(push->port(), bodies[1]), SendAll(colocated->port(), bodies[1]));
    http::ClientRequest add =
        Post(decode->port(), Json{{"endpoints", {"http://" + pe}}}, "/add_remote_prefill_eps");
    add.headers.push_back({"Authorization", "Bearer " + secret.router_token()});
    auto added = http::Fetch(add);
    ASSERT_TRUE(added.ok() && added->status == 200) << (added.ok() ? added->body : "");
    ExpectSameTokens(SendAll(decode->port(), bodies[2]), SendAll(colocated->port(), bodies[2]));
    EXPECT_EQ(decode->Metric("ferry_prompt_tokens_total"), 0);
    EXPECT_EQ(decode->Metric("ferry_kv_external_tokens_total"), double(long_tokens));
    EXPECT_EQ(decode->Metric("ferry_kv_connector_verified_total"), double(3 * each));
    EXPECT_EQ(decode->Metric("ferry_kv_connector_verify_mismatches_total"), 0);
    // One latent row per token and layer, [latent | rope] f32, once: not once per decode rank.
    const model::RandomModelSpec spec = testing::TinyMlaModelSpec(4096);
    const double row = double(spec.num_layers) * (spec.kv_lora_rank + spec.qk_rope_dim) * 4;
    const double moved = std::max(0.0, decode->Metric("ferry_kv_connector_bytes_read_total")) +
                         std::max(0.0, prefill->Metric("ferry_kv_connector_bytes_written_total"));
    EXPECT_GE(moved, double(long_tokens) * row);
    EXPECT_LT(moved, double(long_tokens + 16 * 3 * each) * row);  // at most a block's slack each
    EXPECT_TRUE(decode->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
}

// One request id from the client (or the proxy) through the proxy and both workers: the id a
// client gives in X-Request-Id comes back in the header and names the request ("cmpl-" + it) on
// the prefill worker (its hold) and the decode worker (the answer); an id still in use gets a
// random tail rather than a refusal.
TEST_F(PdProcess, OneRequestIdThroughTheProxyAndBothWorkers) {
    Deployment d = Deploy(WorkerArgs("prefill", "shm", 1), WorkerArgs("decode", "shm", 1));
    ASSERT_TRUE(d.proxy_pull && d.proxy_push);
    for (ServerProcess* proxy : {d.proxy_pull.get(), d.proxy_push.get()}) {
        const std::string rid = proxy == d.proxy_pull.get() ? "trace-pull-1" : "trace-push-1";
        http::ClientRequest r = Post(proxy->port(), CompletionBody(RandomPrompt(50, 3), 3, false));
        r.headers.push_back({"X-Request-Id", rid});
        auto got = http::Fetch(r);
        ASSERT_TRUE(got.ok());
        ASSERT_EQ(got->status, 200) << got->body;
        const std::string* echoed = http::FindHeader(got->headers, "X-Request-Id");
        ASSERT_NE(echoed, nullptr);
        EXPECT_EQ(*echoed, rid);
        EXPECT_EQ(Json::parse(got->body)["id"], "cmpl-" + rid);
    }
    // Straight to the prefill worker, as a router sends it: the hold is named by the same id;
    // the same id again while that hold lives gets a tail.
    Json p = CompletionBody(RandomPrompt(50, 4), 1, false);
    p["kv_transfer_params"] = {{"do_remote_decode", true}};
    http::ClientRequest r = Post(d.prefill->port(), p);
    r.headers.push_back({"X-Request-Id", "trace-hold"});
    auto first = http::Fetch(r), second = http::Fetch(r);
    ASSERT_TRUE(first.ok() && second.ok());
    ASSERT_EQ(first->status, 200) << first->body;
    ASSERT_EQ(second->status, 200) << second->body;
    EXPECT_EQ(Json::parse(first->body)["kv_transfer_params"]["remote_request_id"],
              "cmpl-trace-hold");
    const std::string again =
        Json::parse(second->body)["kv_transfer_params"]["remote_request_id"].get<std::string>();
    EXPECT_EQ(again.rfind("cmpl-trace-hold-", 0), 0u) << again;
    EXPECT_EQ(again.size(), std::string("cmpl-trace-hold-").size() + 8) << again;
}

// With a discovery store, a worker puts its record (HTTP address, role, agent) there and the proxy
// finds a prefill worker's agent in it: push then never asks the worker (GET /v1/kv/agent), and
// the answers are still the colocated ones.
TEST_F(PdProcess, APushProxyFindsThePrefillWorkersAgentInTheStore) {
    auto store = testing::ValueOrDie(StoreServer::Start({}), "store");
    const std::string url = store->url();
    auto prefill = StartOrDie(WorkerArgs("prefill", "shm", 1, {"--store", url}));
    auto decode = StartOrDie(WorkerArgs("decode", "shm", 1, {"--store", url}));
    ASSERT_TRUE(prefill && decode);
    const std::string p = fmt::format("127.0.0.1:{}", prefill->port());
    auto rec = testing::ValueOrDie(MetadataStore::Open(url), "open")->Get("ferry/workers/" + p);
    ASSERT_TRUE(rec.ok()) << rec.status().ToString();
    EXPECT_NE(rec->value.find("\"role\":\"prefill\""), std::string::npos) << rec->value;
    auto proxy = StartOrDie({"proxy", "--prefill", p, "--decode",
                             fmt::format("127.0.0.1:{}", decode->port()), "--port", "0", "--store",
                             url, "--kv-transfer", "push"});
    ASSERT_TRUE(proxy);
    const std::vector<Answer>& want = Reference(1);
    const auto prompts = Prompts();
    std::vector<Json> bodies;
    for (size_t i = 0; i < 4; ++i) bodies.push_back(CompletionBody(prompts[i], 6, false));
    auto got = SendAll(proxy->port(), bodies);
    for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i].status, 200) << got[i].body;
        EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
    }
    EXPECT_EQ(proxy->Metric("ferry_router_agent_lookups_total{source=\"store\"}"), 1);
    EXPECT_EQ(proxy->Metric("ferry_router_agent_lookups_total{source=\"worker\"}"), 0);
    EXPECT_EQ(decode->Metric("ferry_prompt_tokens_total"), 0);
    // A worker that stops (SIGTERM) takes its record with it, before its lease would lapse.
    prefill->Signal(SIGTERM);
    auto reader = testing::ValueOrDie(MetadataStore::Open(url), "open");
    EXPECT_TRUE(testing::WaitUntil(
        [&] { return reader->Get("ferry/workers/" + p).status().code() == Code::kNotFound; },
        std::chrono::seconds(5)));
}

// Decode-first with a store: the decode worker finds its prefill worker's agent in the worker's
// store record (it never asks the worker), and the answers equal colocated ones.
TEST_F(PdProcess, DecodeFirstFindsThePrefillWorkersAgentInTheStore) {
    auto store = testing::ValueOrDie(StoreServer::Start({}), "store");
    const std::string url = store->url();
    auto prefill = StartOrDie(WorkerArgs("prefill", "shm", 1, {"--store", url}));
    ASSERT_TRUE(prefill);
    const std::string p = fmt::format("127.0.0.1:{}", prefill->port());
    // A worker files its record as it starts; the decode worker's directory lists the store
    // before it serves.
    auto reader = testing::ValueOrDie(MetadataStore::Open(url), "open");
    ASSERT_TRUE(reader->Get("ferry/workers/" + p).ok());
    auto decode = StartOrDie(
        WorkerArgs("decode", "shm", 1,
                   {"--store", url, "--remote-prefill", p, "--remote-prefill-min-tokens", "1"}));
    ASSERT_TRUE(decode);
    const std::vector<Answer>& want = Reference(1);
    const auto prompts = Prompts();
    std::vector<Json> bodies;
    for (size_t i = 0; i < 4; ++i) bodies.push_back(CompletionBody(prompts[i], 6, false));
    auto got = SendAll(decode->port(), bodies);
    for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i].status, 200) << got[i].body;
        EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
    }
    // Requests sent at once may each look the agent up before one caches it: at least one store
    // lookup, never one asking the worker.
    EXPECT_GE(decode->Metric("ferry_router_agent_lookups_total{source=\"store\"}"), 1);
    EXPECT_EQ(decode->Metric("ferry_router_agent_lookups_total{source=\"worker\"}"), 0);
    EXPECT_EQ(decode->Metric("ferry_prompt_tokens_total"), 0);  // every prompt went remote
    EXPECT_GT(decode->Metric("ferry_kv_external_tokens_total"), 0);
}

// The logs of one request are joined across processes by one grep of its id: the proxy's, the
// prefill worker's and the decode worker's (FERRY_LOG_LEVEL=info), for pull and push; and an
// error answer names the request too (body and X-Request-Id).
TEST_F(PdProcess, OneGrepOfTheRequestIdFindsItInEveryProcesssLog) {
    setenv("FERRY_LOG_LEVEL", "info", 1);
    const std::string dir = ::testing::TempDir() + fmt::format("ferry-logs-{}", getpid());
    std::filesystem::create_directories(dir);
    auto log = [&](const std::string& name) { return dir + "/" + name + ".log"; };
    auto read = [](const std::string& path) {
        std::ifstream in(path);
        return std::string((std::istreambuf_iterator<char>(in)), {});
    };
    auto prefill = StartOrDie(WorkerArgs("prefill", "shm", 1), log("prefill"));
    auto decode = StartOrDie(WorkerArgs("decode", "shm", 1), log("decode"));
    ASSERT_TRUE(prefill && decode);
    const std::string p = fmt::format("127.0.0.1:{}", prefill->port());
    const std::string q = fmt::format("127.0.0.1:{}", decode->port());
    auto pull = StartOrDie({"proxy", "--prefill", p, "--decode", q, "--port", "0", "--no-store"},
                           log("proxy-pull"));
    auto push = StartOrDie({"proxy", "--prefill", p, "--decode", q, "--port", "0", "--no-store",
                            "--kv-transfer", "push"},
                           log("proxy-push"));
    ASSERT_TRUE(pull && push);
    for (ServerProcess* proxy : {pull.get(), push.get()}) {
        const std::string rid = fmt::format("grep-{}-{}", proxy == pull.get() ? "pull" : "push",
                                            RandomId128().substr(0, 12));
        http::ClientRequest r = Post(proxy->port(), CompletionBody(RandomPrompt(40, 9), 2, false));
        r.headers.push_back({"X-Request-Id", rid});
        auto got = http::Fetch(r);
        ASSERT_TRUE(got.ok());
        ASSERT_EQ(got->status, 200) << got->body;
        const std::string proxy_log = log(proxy == pull.get() ? "proxy-pull" : "proxy-push");
        for (const std::string& path : {proxy_log, log("prefill"), log("decode")}) {
            // The lines may still be on their way to the file.
            EXPECT_TRUE(testing::WaitUntil(
                [&] { return read(path).find(rid) != std::string::npos; }, std::chrono::seconds(5)))
                << rid << " is not in " << path << ":\n"
                << read(path);
        }
    }
    // An error: a prompt longer than the model takes, refused by the prefill worker (400) and
    // relayed by the proxy; both name the request.
    const std::string rid = "grep-error-" + RandomId128().substr(0, 12);
    http::ClientRequest r = Post(pull->port(), CompletionBody(RandomPrompt(5000, 1), 2, false));
    r.headers.push_back({"X-Request-Id", rid});
    auto got = http::Fetch(r);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->status, 400) << got->body;
    Json err = Json::parse(got->body, nullptr, false);
    ASSERT_TRUE(err.is_object() && err.contains("error")) << got->body;
    EXPECT_EQ(err["error"].value("request_id", ""), rid) << got->body;
    const std::string* echoed = http::FindHeader(got->headers, "X-Request-Id");
    ASSERT_NE(echoed, nullptr);
    EXPECT_EQ(*echoed, rid);
    EXPECT_TRUE(
        testing::WaitUntil([&] { return read(log("proxy-pull")).find(rid) != std::string::npos; },
                           std::chrono::seconds(5)));
    std::filesystem::remove_all(dir);
}

// Waits until `pred` (bounded).
bool Eventually(const std::function<bool()>& pred,
                std::chrono::milliseconds limit = std::chrono::seconds(20)) {
    return testing::WaitUntil(pred, limit);
}

// A complete answer: HTTP 200 and a stream that ended with [DONE] and no error event.
bool Succeeded(Background& b) {
    std::string body = b.body();
    return b.status() == 200 && body.find("\"error\"") == std::string::npos &&
           body.find("[DONE]") != std::string::npos;
}

class PdFailure : public PdProcess, public ::testing::WithParamInterface<std::string> {};

// The prefill worker is SIGKILLed while the decode worker waits for its KV: the client gets an
// error (never a 200 with tokens), within seconds, and the decoder's blocks come back. (With
// the proxy's prefill fallback, on by default, the decode worker would prefill the request:
// pd_failover_test.cc.)
TEST_P(PdFailure, APrefillWorkerKilledMidTransferFailsTheRequestAndFreesTheBlocks) {
    const std::string mode = GetParam();
    Deployment d = Deploy(WorkerArgs("prefill", "shm", 1), WorkerArgs("decode", "shm", 1),
                          {"--no-prefill-fallback"});
    ASSERT_TRUE(d.proxy_pull && d.proxy_push);
    ServerProcess* proxy = mode == "push" ? d.proxy_push.get() : d.proxy_pull.get();
    // One request first, so the handshake is done and cached.
    auto warm = SendAll(proxy->port(), {CompletionBody(RandomPrompt(40, 1), 2, false)});
    ASSERT_EQ(warm[0].status, 200) << warm[0].body;
    const double blocks = d.decode->Metric("ferry_kv_blocks_used");
    if (mode == "push") {
        // The prefill worker stops before it writes anything; the decoder names its blocks and
        // waits for them.
        ASSERT_TRUE(d.prefill->Stop());
        Background b(proxy->port(), CompletionBody(RandomPrompt(700, 2), 50, true));
        ASSERT_TRUE(Eventually([&] {
            return d.decode->Metric("ferry_kv_connector_requests{state=\"waiting_for_input\"}") ==
                   1;
        }));
        const auto killed = std::chrono::steady_clock::now();
        // SIGKILL while stopped: it never runs again (Kill() resumes it first, and a resumed
        // prefill worker could still answer).
        d.prefill->Signal(SIGKILL);
        d.prefill->Kill();
        ASSERT_TRUE(b.Wait(std::chrono::seconds(20)));
        EXPECT_FALSE(Succeeded(b)) << b.status() << " " << b.body().substr(0, 400);
        EXPECT_EQ(TokensOf(b.body(), true).size(), 0u) << "tokens sent for a request without KV";
        EXPECT_LT(b.end() - killed, std::chrono::seconds(5));
    } else {
        // pull: the prefill worker holds the KV and stops before it answers the decoder's claim.
        Json body = CompletionBody(RandomPrompt(700, 3), 50, false);
        Json p = body;
        p["kv_transfer_params"] = {{"do_remote_decode", true}};
        p["max_tokens"] = 1;
        auto pr = http::Fetch(Post(d.prefill->port(), p));
        ASSERT_TRUE(pr.ok() && pr->status == 200);
        body["kv_transfer_params"] = Json::parse(pr->body)["kv_transfer_params"];
        ASSERT_TRUE(d.prefill->Stop());
        Background b(d.decode->port(), body);
        ASSERT_TRUE(Eventually([&] {
            return d.decode->Metric("ferry_kv_connector_requests{state=\"transferring\"}") == 1;
        }));
        const auto killed = std::chrono::steady_clock::now();
        // SIGKILL while stopped: it never runs again (Kill() resumes it first, and a resumed
        // prefill worker could still answer).
        d.prefill->Signal(SIGKILL);
        d.prefill->Kill();
        ASSERT_TRUE(b.Wait(std::chrono::seconds(20)));
        EXPECT_NE(b.status(), 200) << b.body().substr(0, 400);
        EXPECT_NE(b.body().find("prefill"), std::string::npos) << b.body();
        EXPECT_LT(b.end() - killed, std::chrono::seconds(5));
    }
    EXPECT_TRUE(d.decode->WaitMetric("ferry_kv_blocks_used", blocks));
    EXPECT_TRUE(d.decode->WaitMetric("ferry_kv_requests_loading", 0));
    // The decoder goes on serving once a prefill worker is back. The restarted worker has a
    // new agent (name and port): push may fail the first request while the proxy learns it.
    ASSERT_TRUE(d.prefill->Restart().ok());
    int status = 0;
    std::string body;
    for (int attempt = 0; attempt < 2 && status != 200; ++attempt) {
        auto again = SendAll(proxy->port(), {CompletionBody(RandomPrompt(40, 4), 3, false)});
        status = again[0].status;
        body = again[0].body;
    }
    EXPECT_EQ(status, 200) << body;
}

// vLLM's kv_load_failure_policy "recompute" (`--kv-load-failure recompute` on the decode
// worker): the same kill as above, and the request is answered anyway, token for token as
// colocated, its prompt computed on the decode worker; the blocks of the failed load come back.
TEST_P(PdFailure, WithRecomputeAKilledPrefillWorkersRequestIsComputedOnTheDecoder) {
    const std::string mode = GetParam();
    Deployment d = Deploy(WorkerArgs("prefill", "shm", 1),
                          WorkerArgs("decode", "shm", 1, {"--kv-load-failure", "recompute"}));
    ASSERT_TRUE(d.proxy_pull && d.proxy_push);
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 1));
    ASSERT_TRUE(colocated);
    ServerProcess* proxy = mode == "push" ? d.proxy_push.get() : d.proxy_pull.get();
    auto warm = SendAll(proxy->port(), {CompletionBody(RandomPrompt(40, 1), 2, false)});
    ASSERT_EQ(warm[0].status, 200) << warm[0].body;
    const double blocks = d.decode->Metric("ferry_kv_blocks_used");
    const double computed = d.decode->Metric("ferry_prompt_tokens_total");
    Json body = CompletionBody(RandomPrompt(700, 5), 20, mode == "push");
    std::unique_ptr<Background> b;
    if (mode == "push") {
        // Straight to the decode worker, as a router sends its half (ferry proxy would have the
        // request prefilled elsewhere instead: pd_failover_test.cc).
        auto agent = http::Fetch(http::GetRequest("127.0.0.1", d.prefill->port(), "/v1/kv/agent",
                                                  std::chrono::seconds(5)));
        ASSERT_TRUE(agent.ok() && agent->status == 200);
        const Json a = Json::parse(agent->body);
        Json db = body;
        db["kv_transfer_params"] = schema::PushDecodeRequestParams(
            "recompute-test-transfer-0001",
            {a["engine_id"].get<std::string>(), a["host"].get<std::string>(), a["port"].get<int>()},
            1);
        ASSERT_TRUE(d.prefill->Stop());
        b = std::make_unique<Background>(d.decode->port(), db);
        ASSERT_TRUE(Eventually([&] {
            return d.decode->Metric("ferry_kv_connector_requests{state=\"waiting_for_input\"}") ==
                   1;
        }));
    } else {
        Json p = body;
        p["kv_transfer_params"] = {{"do_remote_decode", true}};
        p["max_tokens"] = 1;
        auto pr = http::Fetch(Post(d.prefill->port(), p));
        ASSERT_TRUE(pr.ok() && pr->status == 200);
        Json db = body;
        db["kv_transfer_params"] = Json::parse(pr->body)["kv_transfer_params"];
        ASSERT_TRUE(d.prefill->Stop());
        b = std::make_unique<Background>(d.decode->port(), db);
        ASSERT_TRUE(Eventually([&] {
            return d.decode->Metric("ferry_kv_connector_requests{state=\"transferring\"}") == 1;
        }));
    }
    d.prefill->Signal(SIGKILL);
    d.prefill->Kill();
    ASSERT_TRUE(b->Wait(std::chrono::seconds(20)));
    const bool stream = mode == "push";
    auto want = SendAll(colocated->port(), {body});
    EXPECT_EQ(b->status(), 200) << b->body().substr(0, 400);
    EXPECT_EQ(TokensOf(b->body(), stream), want[0].tokens);
    EXPECT_EQ(TokensOf(b->body(), stream).size(), 20u);
    EXPECT_EQ(d.decode->Metric("ferry_kv_load_recomputed_total"), 1);
    EXPECT_GE(d.decode->Metric("ferry_prompt_tokens_total") - computed, 700 - 16);
    EXPECT_TRUE(d.decode->WaitMetric("ferry_kv_blocks_used", blocks));
    EXPECT_TRUE(d.decode->WaitMetric("ferry_kv_requests_loading", 0));
}

// A client that goes away at any stage: both workers free the request's blocks.
TEST_P(PdFailure, AClientThatLeavesFreesTheBlocksOnBothWorkers) {
    const std::string mode = GetParam();
    // pull: a client that leaves between the prefill answer and the decode request leaves a
    // hold no decoder claims; its lease frees it.
    Deployment d = Deploy(WorkerArgs("prefill", "tcp", 1, {"--kv-hold-lease-ms", "1500"}),
                          WorkerArgs("decode", "tcp", 1));
    ASSERT_TRUE(d.proxy_pull && d.proxy_push);
    ServerProcess* proxy = mode == "push" ? d.proxy_push.get() : d.proxy_pull.get();
    for (int delay_ms : {0, 5, 30, 200}) {
        Background b(proxy->port(), CompletionBody(RandomPrompt(1500, delay_ms), 3000, true));
        std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
        b.Cancel();
        EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_blocks_used", 0)) << "after " << delay_ms;
        EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_requests_held", 0)) << "after " << delay_ms;
        EXPECT_TRUE(d.decode->WaitMetric("ferry_kv_blocks_used", 0)) << "after " << delay_ms;
        EXPECT_TRUE(d.decode->WaitMetric("ferry_num_requests_running", 0));
    }
}

// The decode worker is killed: the prefill worker frees what it held for it (lease, or failed
// writes) within seconds.
TEST_P(PdFailure, ADecodeWorkerKilledLeavesNothingHeldOnThePrefillWorker) {
    const std::string mode = GetParam();
    Deployment d = Deploy(WorkerArgs("prefill", "shm", 1, {"--kv-hold-lease-ms", "1500"}),
                          WorkerArgs("decode", "shm", 1));
    ASSERT_TRUE(d.proxy_pull && d.proxy_push);
    auto warm = SendAll(d.proxy_push->port(), {CompletionBody(RandomPrompt(40, 1), 2, false)});
    ASSERT_EQ(warm[0].status, 200) << warm[0].body;
    if (mode == "pull") {
        // The prefill worker answered and holds the blocks; the decoder dies before reading.
        Json p = CompletionBody(RandomPrompt(900, 5), 1, false);
        p["kv_transfer_params"] = {{"do_remote_decode", true}};
        auto pr = http::Fetch(Post(d.prefill->port(), p));
        ASSERT_TRUE(pr.ok() && pr->status == 200);
        EXPECT_EQ(d.prefill->Metric("ferry_kv_requests_held"), 1);
        d.decode->Kill();
        const auto t0 = std::chrono::steady_clock::now();
        EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_requests_held", 0));
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
        EXPECT_EQ(d.prefill->Metric("ferry_kv_connector_failed_total{reason=\"lease_expired\"}"),
                  1);
    } else {
        // push: the decoder is stopped, so the prefill worker waits for its block ids; then it
        // is killed (the proxy sees its connection drop and ends the prefill request).
        ASSERT_TRUE(d.decode->Stop());
        Background b(d.proxy_push->port(), CompletionBody(RandomPrompt(1800, 6), 30, true));
        ASSERT_TRUE(Eventually([&] { return d.prefill->Metric("ferry_kv_requests_parked") == 1; }));
        d.decode->Kill();
        ASSERT_TRUE(b.Wait(std::chrono::seconds(20)));
        EXPECT_FALSE(Succeeded(b));
    }
    EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_requests_held", 0));
    EXPECT_TRUE(d.prefill->WaitMetric("ferry_kv_requests_parked", 0));
}

INSTANTIATE_TEST_SUITE_P(Protocols, PdFailure, ::testing::Values("pull", "push"),
                         [](const auto& i) { return i.param; });

// Chat requests with images through pull and push (ferry proxy) equal a colocated worker's
// answers token for token; the decoder computes none of the images (their KV comes from the
// prefill worker, verified), and a decode request cannot claim KV held for another image behind
// the same placeholder tokens: the transfer is bound to the prompt's images, not only its ids.
TEST_F(PdProcess, ImagesPullAndPushEqualColocatedAndKvIsBoundToThePixels) {
    const std::string mmproj = testing::WriteTinyMmproj("pd-images", 31);
    testing::SecretFile secret("pd-images");
    auto with_images = [&](std::vector<std::string> a) {
        a.insert(a.end(), {"--mmproj", mmproj});
        return a;
    };
    auto colocated = StartOrDie(with_images(WorkerArgs("colocated", "", 1)));
    auto prefill =
        StartOrDie(with_images(WorkerArgs("prefill", "shm", 1, {"--secret-file", secret.path()})));
    auto decode = StartOrDie(with_images(
        WorkerArgs("decode", "shm", 1, {"--secret-file", secret.path(), "--kv-verify", "all"})));
    ASSERT_TRUE(colocated && prefill && decode);
    auto [pull, push] = PullAndPushProxies(*prefill, *decode, secret.path());
    ASSERT_TRUE(pull && push);
    // 1 to 3 images a request from a pool of 5 (repeats across requests), sizes that pad both
    // ways, text of several lengths around them.
    std::vector<std::string> pool;
    for (int i = 0; i < 5; ++i)
        pool.push_back(testing::RandomPngUrl(20 + 9 * i, 41 - 5 * i, 50 + i));
    auto body = [&](int k) {
        Json content = Json::array();
        const int images = 1 + k % 3;
        for (int j = 0; j < images; ++j) {
            content.push_back(
                {{"type", "text"}, {"text", std::string(3 + (k * 7 + j * 13) % 40, 'a' + k % 26)}});
            content.push_back(
                {{"type", "image_url"}, {"image_url", {{"url", pool[(k + 2 * j) % 5]}}}});
        }
        content.push_back(
            {{"type", "text"}, {"text", fmt::format("request {}: what is shown?", k)}});
        return Json{{"messages", {{{"role", "user"}, {"content", content}}}},
                    {"max_tokens", 6},
                    {"temperature", 0},
                    {"ignore_eos", true},
                    {"logprobs", true},
                    {"return_tokens_as_token_ids", true},
                    {"stream", k % 2 == 1}};
    };
    const int n = testing::kSanitized ? 4 : 16;
    std::vector<Json> via_pull, via_push;
    for (int k = 0; k < n; ++k) (k < n / 2 ? via_pull : via_push).push_back(body(k));
    ExpectSameTokens(SendAll(pull->port(), via_pull), SendAll(colocated->port(), via_pull), "pull");
    ExpectSameTokens(SendAll(push->port(), via_push), SendAll(colocated->port(), via_push), "push");
    // The decoder computed each prompt's last token only; every image's KV arrived, verified.
    EXPECT_LE(decode->Metric("ferry_prompt_tokens_total"), double(n));
    EXPECT_GT(decode->Metric("ferry_kv_external_tokens_total"), double(n * 16));
    EXPECT_EQ(decode->Metric("ferry_kv_connector_verify_mismatches_total"), 0);

    // A hold for image A claimed by a decode request for image B of the same size (the same
    // token ids): refused, never B's answer computed on A's KV.
    Json a = body(100), b = body(100);
    const std::string other = testing::RandomPngUrl(20, 41, 999);  // pool[0]'s size
    a["messages"][0]["content"] =
        Json::array({{{"type", "text"}, {"text", "look: "}},
                     {{"type", "image_url"}, {"image_url", {{"url", pool[0]}}}}});
    b["messages"][0]["content"] = a["messages"][0]["content"];
    b["messages"][0]["content"][1]["image_url"]["url"] = other;
    a["stream"] = b["stream"] = false;
    a["kv_transfer_params"] = {{"do_remote_decode", true}};
    http::ClientRequest held = Post(prefill->port(), a, "/v1/chat/completions");
    held.headers.push_back({"Authorization", "Bearer " + secret.router_token()});
    auto h = http::Fetch(held);
    ASSERT_TRUE(h.ok() && h->status == 200) << (h.ok() ? h->body : h.status().ToString());
    b["kv_transfer_params"] = Json::parse(h->body)["kv_transfer_params"];
    http::ClientRequest claim = Post(decode->port(), b, "/v1/chat/completions");
    claim.headers = held.headers;
    auto c = http::Fetch(claim);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->status, 409) << c->body;
    EXPECT_NE(c->body.find("held KV for another prompt"), std::string::npos) << c->body;
    // The control: the same image claims a fresh hold and gets the colocated answer.
    auto h2 = http::Fetch(held);
    ASSERT_TRUE(h2.ok() && h2->status == 200) << (h2.ok() ? h2->body : h2.status().ToString());
    Json a2 = a;
    a2["kv_transfer_params"] = Json::parse(h2->body)["kv_transfer_params"];
    http::ClientRequest same = Post(decode->port(), a2, "/v1/chat/completions");
    same.headers = held.headers;
    auto s2 = http::Fetch(same);
    ASSERT_TRUE(s2.ok());
    EXPECT_EQ(s2->status, 200) << s2->body;
    a.erase("kv_transfer_params");
    EXPECT_EQ(TokensOf(s2->body, false), SendAll(colocated->port(), {a})[0].tokens);
    EXPECT_TRUE(decode->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
    std::remove(mmproj.c_str());
}

}  // namespace
}  // namespace ferry
