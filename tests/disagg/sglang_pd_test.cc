// SGLang's PD protocol on ferry's workers, with real processes (serve/sglang_pd.h): a prefill and
// a decode worker started with SGLang's own flags, driven by a client that does what SGLang's
// mini_lb does (sglang/srt/disaggregation/mini_lb.py): the same body, plus bootstrap_host,
// bootstrap_port and a random 63-bit bootstrap_room (lists for a batch), sent to both workers at
// once, on the OpenAI routes and /generate, streamed and not; the decode worker's answer is the
// client's. The answers equal a colocated worker's token for token, the decode worker computes no
// prompt token, a lone half expires and frees its blocks, and a room is no capability.
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "disagg/pd_harness.h"
#include "http/http.h"
#include "testing/testing.h"
#include "testing/worker_process.h"

namespace ferry {
namespace {

using namespace pd_test;  // NOLINT: the harness is this test's own vocabulary
using Json = nlohmann::json;
using testing::ServerProcess;

uint64_t RandomRoom() {
    static std::mt19937_64 rng(std::random_device{}());
    return rng() >> 1;  // 0..2^63-1, as mini_lb's random.randint(0, 2**63 - 1)
}

http::ClientReply PostOrDie(int port, const std::string& path, const Json& body) {
    http::ClientRequest r;
    r.port = port;
    r.target = path;
    r.body = body.dump();
    r.timeout = std::chrono::seconds(60);
    auto got = http::Fetch(r);
    EXPECT_TRUE(got.ok()) << got.status().ToString();
    return got.ok() ? *got : http::ClientReply{};
}

// The data events of an SSE body, parsed ("[DONE]" left out).
std::vector<Json> Events(const std::string& body) {
    std::vector<Json> out;
    size_t pos = 0;
    while ((pos = body.find("data: ", pos)) != std::string::npos) {
        const size_t end = body.find("\n\n", pos);
        const std::string ev = body.substr(pos + 6, end - pos - 6);
        pos = end;
        if (ev != "[DONE]") out.push_back(Json::parse(ev, nullptr, false));
    }
    return out;
}

// /generate's output ids: per prompt (a batch's in order).
std::vector<std::vector<int32_t>> GenerateIds(const std::string& body, bool stream) {
    std::vector<std::vector<int32_t>> out;
    if (!stream) {
        Json j = Json::parse(body, nullptr, false);
        if (j.is_object()) j = Json::array({j});
        if (!j.is_array()) return out;
        for (const Json& e : j) out.push_back(e.value("output_ids", std::vector<int32_t>{}));
        return out;
    }
    for (const Json& e : Events(body)) {
        if (!e.is_object() || !e.contains("output_ids")) continue;
        const size_t i = e.value("index", 0);
        if (out.size() <= i) out.resize(i + 1);
        out[i] = e["output_ids"].get<std::vector<int32_t>>();  // each chunk: all so far
    }
    return out;
}

class SglangPd : public PdProcess, public ::testing::WithParamInterface<std::pair<int, int>> {
  protected:
    // The two workers in SGLang's words (`python3 -m sglang.launch_server` -> `ferry serve`),
    // the prefill worker's bootstrap server on a free port it reports.
    void StartPair(int prefill_tp, int decode_tp, const std::vector<std::string>& extra = {}) {
        auto sglang = [&](const char* mode, int tp) {
            std::vector<std::string> a = {"serve",
                                          "--model-path",
                                          model_->path(),
                                          "--disaggregation-mode",
                                          mode,
                                          "--disaggregation-transfer-backend",
                                          "nixl",
                                          "--tp-size",
                                          std::to_string(tp),
                                          "--host",
                                          "127.0.0.1",
                                          "--port",
                                          "0",
                                          "--page-size",
                                          "16",
                                          "--trust-remote-code",
                                          "--mem-fraction-static",
                                          "0.8",
                                          "--num-kv-blocks",
                                          "2000",
                                          "--kv-backend",
                                          "tcp"};
            if (std::string(mode) == "prefill") {
                a.insert(a.end(), {"--disaggregation-bootstrap-port", "0"});
            }
            a.insert(a.end(), extra.begin(), extra.end());
            return a;
        };
        prefill_ = StartOrDie(sglang("prefill", prefill_tp));
        decode_ = StartOrDie(sglang("decode", decode_tp));
        colocated_ = StartOrDie(WorkerArgs("colocated", "", 1));
        ASSERT_TRUE(prefill_ && decode_ && colocated_);
        auto info = http::Fetch(http::GetRequest("127.0.0.1", prefill_->port(), "/get_server_info",
                                                 std::chrono::seconds(5)));
        ASSERT_TRUE(info.ok() && info->status == 200);
        const Json j = Json::parse(info->body);
        ASSERT_EQ(j["disaggregation_mode"], "prefill") << info->body;
        bootstrap_port_ = j["disaggregation_bootstrap_port"].get<int>();
        ASSERT_GT(bootstrap_port_, 0);
    }

    // mini_lb: the body with the bootstrap fields to both workers at once; the decode
    // worker's answer (and the prefill worker's, for the logprob merge).
    std::pair<http::ClientReply, http::ClientReply> MiniLb(const std::string& path, Json body,
                                                           size_t batch = 0) {
        if (batch == 0) {
            body["bootstrap_host"] = "127.0.0.1";
            body["bootstrap_port"] = bootstrap_port_;
            body["bootstrap_room"] = RandomRoom();
        } else {
            body["bootstrap_host"] = std::vector<std::string>(batch, "127.0.0.1");
            body["bootstrap_port"] = std::vector<int>(batch, bootstrap_port_);
            Json rooms = Json::array();
            for (size_t i = 0; i < batch; ++i) rooms.push_back(RandomRoom());
            body["bootstrap_room"] = rooms;
        }
        http::ClientReply p, d;
        std::thread t([&] { p = PostOrDie(prefill_->port(), path, body); });
        d = PostOrDie(decode_->port(), path, body);
        t.join();
        return {std::move(p), std::move(d)};
    }

    std::unique_ptr<ServerProcess> prefill_, decode_, colocated_;
    int bootstrap_port_ = 0;
};

TEST_P(SglangPd, MiniLbsRequestsEqualColocatedOnEveryRoute) {
    const auto [ptp, dtp] = GetParam();
    StartPair(ptp, dtp);
    const auto prompts = Prompts();
    const int n = testing::kSanitized ? 2 : 4;
    // The OpenAI routes, whole and streamed.
    for (int i = 0; i < n; ++i) {
        for (bool stream : {false, true}) {
            const Json body = CompletionBody(prompts[i], 6, stream);
            auto [p, d] = MiniLb("/v1/completions", body);
            ASSERT_EQ(d.status, 200) << d.body;
            ASSERT_EQ(p.status, 200) << p.body;
            auto want = PostOrDie(colocated_->port(), "/v1/completions", body);
            EXPECT_EQ(TokensOf(d.body, stream), TokensOf(want.body, stream)) << i;
            // The prefill worker answers its one token, as SGLang's does.
            EXPECT_EQ(TokensOf(p.body, stream).size(), 1u) << p.body;
        }
    }
    Json chat = {{"messages", {{{"role", "user"}, {"content", "tell me about ferries"}}}},
                 {"max_tokens", 5},
                 {"temperature", 0},
                 {"logprobs", true},
                 {"return_tokens_as_token_ids", true}};
    auto [cp, cd] = MiniLb("/v1/chat/completions", chat);
    ASSERT_EQ(cd.status, 200) << cd.body;
    EXPECT_EQ(TokensOf(cd.body, false),
              TokensOf(PostOrDie(colocated_->port(), "/v1/chat/completions", chat).body, false));

    // SGLang's /generate: one prompt (ids and text), a batch of lists, streamed and not.
    Json one = {{"input_ids", prompts[0]},
                {"sampling_params", {{"max_new_tokens", 7}, {"temperature", 0}}},
                {"return_logprob", true}};
    Json text = {{"text", "the quick brown fox"},
                 {"sampling_params", {{"max_new_tokens", 5}, {"temperature", 0}}}};
    Json batch = {{"input_ids", {prompts[1], prompts[2], prompts[3]}},
                  {"sampling_params", {{"max_new_tokens", 4}, {"temperature", 0}}}};
    for (bool stream : {false, true}) {
        for (Json* b : {&one, &text, &batch}) {
            (*b)["stream"] = stream;
            const size_t size = b == &batch ? 3 : 0;
            auto [p, d] = MiniLb("/generate", *b, size);
            ASSERT_EQ(d.status, 200) << d.body;
            auto want = PostOrDie(colocated_->port(), "/generate", *b);
            const auto got = GenerateIds(d.body, stream);
            EXPECT_EQ(got, GenerateIds(want.body, stream)) << d.body;
            EXPECT_EQ(got.size(), size == 0 ? 1 : size);
            if (b == &one && !stream) {
                // mini_lb merges meta_info.input_token_logprobs from the prefill's answer.
                const Json pj = Json::parse(p.body), dj = Json::parse(d.body);
                EXPECT_TRUE(pj["meta_info"]["input_token_logprobs"].is_array()) << p.body;
                EXPECT_EQ(dj["meta_info"]["output_token_logprobs"].size(), 7u) << d.body;
                EXPECT_EQ(dj["meta_info"]["finish_reason"]["type"], "length");
            }
        }
    }
    // The decode worker computed no prompt token: all of it came from the prefill worker.
    EXPECT_EQ(decode_->Metric("ferry_prompt_tokens_total"), 0);
    EXPECT_GT(decode_->Metric("ferry_kv_connector_succeeded_total"), 0);
    // Nothing held once all is answered.
    EXPECT_TRUE(prefill_->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(decode_->WaitMetric("ferry_kv_blocks_used", 0));
}

INSTANTIATE_TEST_SUITE_P(Tp, SglangPd,
                         ::testing::Values(std::pair{1, 1}, std::pair{2, 2}, std::pair{1, 2}),
                         [](const auto& i) {
                             return fmt::format("P{}D{}", i.param.first, i.param.second);
                         });

class SglangPdOne : public SglangPd {};

// A half whose other half never comes expires (the push's bootstrap timeout) with an error and
// frees its blocks, on either side; a request that names a room of another prompt is refused
// and the rightful pair still completes; the routes mini_lb calls answer as SGLang's do.
TEST_F(SglangPdOne, LoneHalvesExpireARoomIsNoCapabilityAndTheRoutesAnswer) {
    StartPair(1, 1,
              {"--kv-connector-config",
               R"({"bootstrap_timeout_ms": 1500, "transfer_timeout_ms": 1500})"});
    const auto prompts = Prompts();
    Json body = CompletionBody(prompts[0], 4, false);
    body["bootstrap_host"] = "127.0.0.1";
    body["bootstrap_port"] = bootstrap_port_;
    body["bootstrap_room"] = RandomRoom();
    auto lone_p = PostOrDie(prefill_->port(), "/v1/completions", body);
    EXPECT_NE(lone_p.status, 200) << lone_p.body;
    body["bootstrap_room"] = RandomRoom();
    auto lone_d = PostOrDie(decode_->port(), "/v1/completions", body);
    EXPECT_NE(lone_d.status, 200) << lone_d.body;
    EXPECT_TRUE(prefill_->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(decode_->WaitMetric("ferry_kv_blocks_used", 0));

    // A stranger who learned a room sends another prompt under it to the decode worker first:
    // its target is refused, the rightful pair (which comes after) still completes.
    const uint64_t room = RandomRoom();
    Json rightful = CompletionBody(prompts[1], 5, false);
    Json forged = CompletionBody(prompts[2], 5, false);
    for (Json* b : {&rightful, &forged}) {
        (*b)["bootstrap_host"] = "127.0.0.1";
        (*b)["bootstrap_port"] = bootstrap_port_;
        (*b)["bootstrap_room"] = room;
    }
    http::ClientReply f, p, d;
    std::thread attacker([&] { f = PostOrDie(decode_->port(), "/v1/completions", forged); });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::thread pt([&] { p = PostOrDie(prefill_->port(), "/v1/completions", rightful); });
    d = PostOrDie(decode_->port(), "/v1/completions", rightful);
    pt.join();
    attacker.join();
    EXPECT_NE(f.status, 200) << f.body;
    ASSERT_EQ(d.status, 200) << d.body;
    Json plain = CompletionBody(prompts[1], 5, false);
    EXPECT_EQ(TokensOf(d.body, false),
              TokensOf(PostOrDie(colocated_->port(), "/v1/completions", plain).body, false));

    // Bad fields are named.
    Json bad = CompletionBody(prompts[0], 2, false);
    bad["bootstrap_host"] = "127.0.0.1";
    bad["bootstrap_room"] = -5;
    auto refused = PostOrDie(decode_->port(), "/v1/completions", bad);
    EXPECT_EQ(refused.status, 400);
    EXPECT_NE(refused.body.find("bootstrap_room"), std::string::npos) << refused.body;
    // A colocated worker has no PD role.
    bad["bootstrap_room"] = 5;
    EXPECT_EQ(PostOrDie(colocated_->port(), "/v1/completions", bad).status, 400);

    // What mini_lb calls on each worker.
    for (ServerProcess* w : {prefill_.get(), decode_.get()}) {
        for (const char* path : {"/health", "/health_generate", "/get_model_info", "/v1/models"}) {
            auto r = http::Fetch(
                http::GetRequest("127.0.0.1", w->port(), path, std::chrono::seconds(10)));
            ASSERT_TRUE(r.ok());
            EXPECT_EQ(r->status, 200) << path << " " << r->body;
        }
        auto health = PostOrDie(w->port(), "/health_generate", Json::object());
        EXPECT_EQ(health.status, 200) << health.body;
        auto flush = PostOrDie(w->port(), "/flush_cache", Json::object());
        EXPECT_EQ(flush.status, 200) << flush.body;
        EXPECT_EQ(flush.body.rfind("Cache flushed.", 0), 0u) << flush.body;
    }
    auto model = http::Fetch(
        http::GetRequest("127.0.0.1", decode_->port(), "/get_model_info", std::chrono::seconds(5)));
    EXPECT_EQ(Json::parse(model->body)["is_generation"], true);
    // The bootstrap server answers SGLang's queries.
    auto route = http::Fetch(http::GetRequest(
        "127.0.0.1", bootstrap_port_,
        "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
        std::chrono::seconds(5)));
    ASSERT_TRUE(route.ok());
    EXPECT_EQ(route->status, 200);
    EXPECT_GT(Json::parse(route->body)["rank_port"].get<int>(), 0);
    auto missing = http::Fetch(
        http::GetRequest("127.0.0.1", bootstrap_port_, "/route", std::chrono::seconds(5)));
    EXPECT_EQ(missing->status, 400);
}

// With a deployment secret the PD fields are the router's, as kv_transfer_params are: a client
// without the router token is refused (401), and so is a stranger asking the bootstrap server
// where the prefill worker's agent is; ferry's decode worker, which sends the token, is served.
TEST_F(SglangPdOne, WithASecretTheFieldsAndTheBootstrapServerAreTheRouters) {
    testing::SecretFile secret("sglang-pd");
    StartPair(1, 1, {"--secret-file", secret.path()});
    Json body = CompletionBody(Prompts()[0], 4, false);
    body["bootstrap_host"] = "127.0.0.1";
    body["bootstrap_port"] = bootstrap_port_;
    body["bootstrap_room"] = RandomRoom();
    EXPECT_EQ(PostOrDie(decode_->port(), "/v1/completions", body).status, 401);
    // Refused before the decode worker dials anything: a bootstrap host that would not answer
    // gives 401, not the 503 of a lookup that failed.
    Json elsewhere = body;
    elsewhere["bootstrap_port"] = 1;
    EXPECT_EQ(PostOrDie(decode_->port(), "/v1/completions", elsewhere).status, 401);
    EXPECT_EQ(PostOrDie(prefill_->port(), "/v1/completions", body).status, 401);
    auto route = http::Fetch(http::GetRequest(
        "127.0.0.1", bootstrap_port_,
        "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
        std::chrono::seconds(5)));
    ASSERT_TRUE(route.ok());
    EXPECT_EQ(route->status, 401) << route->body;
    // The router (with the token) is served, and the decode worker finds the agent.
    auto with_token = [&](int port) {
        http::ClientRequest r;
        r.port = port;
        r.target = "/v1/completions";
        r.body = body.dump();
        r.timeout = std::chrono::seconds(30);
        r.headers.push_back({"Authorization", "Bearer " + secret.router_token()});
        return http::Fetch(r);
    };
    Result<http::ClientReply> p = UnavailableError(""), d = UnavailableError("");
    std::thread t([&] { p = with_token(prefill_->port()); });
    d = with_token(decode_->port());
    t.join();
    ASSERT_TRUE(d.ok() && p.ok());
    EXPECT_EQ(d->status, 200) << d->body;
    Json plain = CompletionBody(Prompts()[0], 4, false);
    EXPECT_EQ(TokensOf(d->body, false),
              TokensOf(PostOrDie(colocated_->port(), "/v1/completions", plain).body, false));
}

}  // namespace
}  // namespace ferry
