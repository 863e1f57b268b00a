// Integrity on the surfaces of rounds 2-3, tried with real processes as an attacker would
// (issue 49, docs/security.md): a request id names a request and never changes what it computes;
// the encoder's identity travels with its embeddings; a stuck worker costs a bounded time; a
// client that left costs nothing more; ZeroMQ sockets bound what a peer may send.
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "disagg/epd_harness.h"
#include "http/http.h"
#include "testing/testing.h"

namespace ferry {
namespace {

using namespace pd_test;   // NOLINT: the harnesses are this test's own vocabulary
using namespace epd_test;  // NOLINT
using Json = nlohmann::json;
using testing::ServerProcess;

class Integrity : public EpdProcess {};

// Text completions (some long enough for decode-first) and chats with images, streamed or not.
std::vector<Json> MixedBodies(int n, uint32_t seed) {
    std::vector<Json> out;
    const std::vector<Json> chats = EpdProcess::Bodies(n, seed);
    std::mt19937 g(seed);
    for (int i = 0; i < n; ++i) {
        if (i % 2 == 0) {
            out.push_back(chats[size_t(i)]);
        } else {
            out.push_back(
                CompletionBody(RandomPrompt(8 + int(g() % 200), seed + i), 5, i % 4 == 1));
        }
    }
    return out;
}

// ids drawn from a pool of two (and none): every request shares its id with others in flight,
// and reuses one that a finished request had (its hold may still be there).
std::vector<std::string> SharedIds(size_t n, uint32_t seed) {
    std::mt19937 g(seed);
    const std::vector<std::string> pool = {"shared-id", "shared-id", "other:id", ""};
    std::vector<std::string> ids;
    for (size_t i = 0; i < n; ++i) ids.push_back(pool[g() % pool.size()]);
    return ids;
}

// A request id names a request and never changes what it computes: concurrent requests that
// share an id, and later requests that reuse it, each equal their colocated answer on every path
// where an id is renamed or reused (colocated, 1P1D pull and push, 1E1P1D, decode-first; text
// and images, streamed or not).
TEST_F(Integrity, SharedAndReusedRequestIdsNeverChangeAnAnswer) {
    testing::SecretFile secret("integrity-ids");
    const std::vector<std::string> ec = {"--ec-connector", "transfer", "--secret-file",
                                         secret.path()};
    auto reference = StartOrDie(Args("colocated", ""));
    auto colocated = StartOrDie(Args("colocated", ""));
    auto encode = StartOrDie(Args("encode", "shm", ec));
    auto prefill = StartOrDie(Args("prefill", "shm", ec));
    std::vector<std::string> d = ec;
    d.insert(d.end(), {"--remote-prefill-min-tokens", "64"});
    auto decode = StartOrDie(Args("decode", "shm", d));
    ASSERT_TRUE(reference && colocated && encode && prefill && decode);
    auto [pull, push] = PullAndPushProxies(*prefill, *decode, secret.path());
    auto epd =
        StartOrDie({"proxy", "--encode", Addr(*encode), "--prefill", Addr(*prefill), "--decode",
                    Addr(*decode), "--port", "0", "--no-store", "--secret-file", secret.path()});
    ASSERT_TRUE(pull && push && epd);
    http::ClientRequest add =
        Post(decode->port(), Json{{"endpoints", {Addr(*prefill)}}}, "/add_remote_prefill_eps");
    add.headers.push_back({"Authorization", "Bearer " + secret.router_token()});
    auto added = http::Fetch(add);
    ASSERT_TRUE(added.ok() && added->status == 200);

    const int n = testing::kSanitized ? 8 : 24;
    const std::vector<Json> bodies = MixedBodies(n, 4100);
    const std::vector<Answer> want = SendAll(reference->port(), bodies, 8);
    struct Path {
        std::string name;
        int port;
        bool text_only;  // decode-first: images are prefilled on the decode worker itself
    };
    const std::vector<Path> paths = {{"colocated", colocated->port(), false},
                                     {"1P1D pull", pull->port(), false},
                                     {"1P1D push", push->port(), false},
                                     {"1E1P1D", epd->port(), false},
                                     {"decode-first", decode->port(), false}};
    for (const Path& p : paths) {
        for (uint32_t round = 0; round < 2; ++round) {
            const std::vector<std::string> ids = SharedIds(bodies.size(), 17 * round + p.port);
            ExpectSameTokens(SendAll(p.port, bodies, 8, ids), want,
                             fmt::format("{} round {}", p.name, round));
        }
    }
    // Decode-first really prefilled remotely, the encode worker really encoded.
    EXPECT_GT(decode->Metric("ferry_kv_external_tokens_total"), 0);
    EXPECT_GT(encode->Metric("ferry_mm_images_encoded_total"), 0);
    EXPECT_GT(epd->Metric("ferry_proxy_encoded_total"), 0);
}

// Without a secret a client may reach a prefill worker itself (vLLM's proxies do): a second
// prefill under an id whose hold still waits for its reader gets an id of its own, so the first
// hold is not replaced, and its reader gets the first prompt's answer.
TEST_F(Integrity, AnIdWhoseHoldWaitsIsNotTakenOver) {
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 1));
    auto prefill = StartOrDie(WorkerArgs("prefill", "tcp", 1));
    auto decode = StartOrDie(WorkerArgs("decode", "tcp", 1));
    ASSERT_TRUE(colocated && prefill && decode);
    auto prefill_as = [&](const std::vector<int32_t>& prompt, const std::string& id) {
        Json b = CompletionBody(prompt, 4, false);
        b["kv_transfer_params"] = {{"do_remote_decode", true}};
        http::ClientRequest r = Post(prefill->port(), b);
        r.headers.push_back({"X-Request-Id", id});
        auto got = http::Fetch(r);
        EXPECT_TRUE(got.ok() && got->status == 200) << (got.ok() ? got->body : "");
        return got.ok() ? Json::parse(got->body, nullptr, false) : Json();
    };
    const std::vector<int32_t> victim = RandomPrompt(90, 5), attacker = RandomPrompt(70, 6);
    const Json first = prefill_as(victim, "victim-id");
    const Json second = prefill_as(attacker, "victim-id");
    ASSERT_TRUE(first.contains("kv_transfer_params") && second.contains("kv_transfer_params"));
    EXPECT_NE(first["kv_transfer_params"]["remote_request_id"],
              second["kv_transfer_params"]["remote_request_id"]);
    for (const auto& [prompt, answer] : {std::pair{victim, first}, std::pair{attacker, second}}) {
        Json d = CompletionBody(prompt, 4, false);
        d["kv_transfer_params"] = answer["kv_transfer_params"];
        http::ClientRequest r = Post(decode->port(), d);
        r.headers.push_back({"X-Request-Id", "victim-id"});
        auto got = http::Fetch(r);
        ASSERT_TRUE(got.ok());
        EXPECT_EQ(got->status, 200) << got->body;
        EXPECT_EQ(TokensOf(got->body, false),
                  SendAll(colocated->port(), {CompletionBody(prompt, 4, false)})[0].tokens);
    }
    EXPECT_EQ(decode->Metric("ferry_kv_external_tokens_total"), 90 + 70);
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
}

// The encoder's identity travels with its embeddings: an encode worker started with another
// projector than its consumers (transfer and disk connectors) gets its embeddings refused by
// name; the consumers encode themselves (the colocated answers), keep nothing foreign (a later
// request is still right), or answer 503 under --ec-load-failure fail. A prefill and a decode
// worker with different projectors do not exchange KV.
TEST_F(Integrity, AForeignEncodersEmbeddingsAreRefusedByName) {
    const std::string other = testing::WriteTinyMmproj("integrity-other", 38);
    auto with_other = [&](std::vector<std::string> a) {
        *(std::find(a.begin(), a.end(), "--mmproj") + 1) = other;
        return a;
    };
    const std::string dir = (std::filesystem::temp_directory_path() /
                             fmt::format("ferry-integrity-foreign-{}", getpid()))
                                .string();
    std::filesystem::create_directories(dir);
    testing::SecretFile secret("integrity-foreign");
    const std::vector<std::string> transfer = {"--ec-connector", "transfer", "--secret-file",
                                               secret.path()};
    const std::vector<std::string> disk = {"--ec-connector", "disk", "--ec-dir", dir};
    auto colocated = StartOrDie(Args("colocated", ""));
    auto encode_t = StartOrDie(with_other(Args("encode", "tcp", transfer)));
    auto encode_d = StartOrDie(with_other(Args("encode", "", disk)));
    auto consumer_t = StartOrDie(Args("colocated", "", transfer));
    auto consumer_d = StartOrDie(Args("colocated", "", disk));
    std::vector<std::string> strict_args = transfer;
    strict_args.insert(strict_args.end(), {"--ec-load-failure", "fail"});
    auto strict = StartOrDie(Args("colocated", "", strict_args));
    ASSERT_TRUE(colocated && encode_t && encode_d && consumer_t && consumer_d && strict);
    auto px_t = StartOrDie({"proxy", "--encode", Addr(*encode_t), "--decode", Addr(*consumer_t),
                            "--port", "0", "--no-store", "--secret-file", secret.path()});
    auto px_d = StartOrDie({"proxy", "--encode", Addr(*encode_d), "--decode", Addr(*consumer_d),
                            "--port", "0", "--no-store"});
    auto px_strict = StartOrDie({"proxy", "--encode", Addr(*encode_t), "--decode", Addr(*strict),
                                 "--port", "0", "--no-store", "--secret-file", secret.path()});
    ASSERT_TRUE(px_t && px_d && px_strict);
    std::vector<Json> bodies = Bodies(4, 7100);
    const std::vector<Answer> want = SendAll(colocated->port(), bodies, 4);
    for (auto [px, consumer] :
         {std::pair{px_t.get(), consumer_t.get()}, std::pair{px_d.get(), consumer_d.get()}}) {
        ExpectSameTokens(SendAll(px->port(), bodies, 4), want, "through a foreign encoder");
        EXPECT_EQ(px->Metric("ferry_proxy_encoded_total"), double(bodies.size()));
        EXPECT_GT(consumer->Metric("ferry_ec_load_foreign_total"), 0);
        EXPECT_EQ(consumer->Metric("ferry_ec_loads_total"), 0);
        EXPECT_GT(consumer->Metric("ferry_mm_images_encoded_total"), 0);
        // What it keeps is its own encoder's: asked directly, the same answers.
        ExpectSameTokens(SendAll(consumer->port(), bodies, 4), want, "directly, afterwards");
    }
    Json one = Bodies(1, 7300)[0];
    one["stream"] = false;
    auto refused = http::Fetch(Post(px_strict->port(), one, "/v1/chat/completions"));
    ASSERT_TRUE(refused.ok());
    EXPECT_EQ(refused->status, 503) << refused->body;
    EXPECT_NE(refused->body.find("vision encoder"), std::string::npos) << refused->body;
    EXPECT_NE(refused->body.find("--mmproj differs"), std::string::npos) << refused->body;

    // Prefill and decode workers with different projectors: refused at the KV handshake.
    auto prefill = StartOrDie(Args("prefill", "tcp", {"--secret-file", secret.path()}));
    auto decode = StartOrDie(with_other(Args("decode", "tcp", {"--secret-file", secret.path()})));
    ASSERT_TRUE(prefill && decode);
    auto [pull, push] = PullAndPushProxies(*prefill, *decode, secret.path());
    ASSERT_TRUE(pull && push);
    for (const ServerProcess* px : {pull.get(), push.get()}) {
        auto got = http::Fetch(Post(px->port(), CompletionBody(RandomPrompt(40, 3), 3, false)));
        ASSERT_TRUE(got.ok());
        EXPECT_NE(got->status, 200) << got->body;
        EXPECT_NE(got->body.find("weights fingerprint"), std::string::npos) << got->body;
    }
    std::filesystem::remove_all(dir);
    std::remove(other.c_str());
}

}  // namespace
}  // namespace ferry
