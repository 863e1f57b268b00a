// The trust boundaries of disaggregated serving (docs/security.md), tried from outside as an
// attacker would, against real `ferry serve` prefill and decode workers (and `ferry proxy`): a
// client that reaches the workers' HTTP ports forges block ids, swaps prompts, mutates params,
// calls the admin route, names strangers' ports for the decoder to dial, floods holds from
// another address than the router's, and a prefill worker restarts under its name. Each time
// the victim's tokens never appear, honest requests afterwards equal colocated, nothing answers
// 500, and the workers' blocks come back.
#include <arpa/inet.h>
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "core/fd.h"
#include "core/sanitizers.h"
#include "testing/testing.h"
#include "testing/tiny_model.h"
#include "testing/worker_process.h"

namespace ferry {
namespace {

using Json = nlohmann::json;
using testing::SecretFile;
using testing::ServerProcess;

std::vector<int32_t> Prompt(int n, uint32_t seed) {
    std::mt19937 g(seed);
    std::vector<int32_t> p(n);
    for (auto& t : p) t = static_cast<int32_t>(g() % 256);
    return p;
}

Json Body(const std::vector<int32_t>& prompt, int max_tokens = 6) {
    return {{"prompt", prompt},   {"max_tokens", max_tokens},           {"temperature", 0},
            {"ignore_eos", true}, {"return_tokens_as_token_ids", true}, {"logprobs", 0}};
}

struct Reply {
    int status = 0;
    std::string body;
    Json json() const { return Json::parse(body, nullptr, false); }
    std::vector<int32_t> tokens() const {
        std::vector<int32_t> out;
        Json j = json();
        if (!j.is_object() || !j.contains("choices")) return out;
        for (const Json& t : j["choices"][0]["logprobs"]["tokens"]) {
            std::string s = t.get<std::string>();
            out.push_back(std::stoi(s.substr(s.find(':') + 1)));
        }
        return out;
    }
};

// One HTTP exchange from a chosen loopback source address (127.0.0.2 is a client elsewhere than
// the router at 127.0.0.1), over a plain socket.
Reply PostFrom(const std::string& source, int port, const std::string& path, const Json& body,
               const std::string& token = "", const char* method = "POST") {
    Reply r;
    ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in src{}, dst{};
    src.sin_family = dst.sin_family = AF_INET;
    inet_pton(AF_INET, source.c_str(), &src.sin_addr);
    inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
    dst.sin_port = htons(static_cast<uint16_t>(port));
    timeval tv{120, 0};
    setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (bind(fd.get(), reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0 ||
        connect(fd.get(), reinterpret_cast<sockaddr*>(&dst), sizeof(dst)) != 0) {
        return r;
    }
    std::string text = std::string(method) == "GET" ? "" : body.dump();
    std::string req = fmt::format(
        "{} {} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Content-Length: {}\r\nConnection: close\r\n{}\r\n{}",
        method, path, text.size(),
        token.empty() ? "" : fmt::format("Authorization: Bearer {}\r\n", token), text);
    if (!testing::SendAll(fd.get(), req)) return r;
    std::string got;
    char buf[65536];
    for (;;) {
        ssize_t n = recv(fd.get(), buf, sizeof(buf), 0);
        if (n <= 0) break;
        got.append(buf, static_cast<size_t>(n));
    }
    if (got.size() < 12) return r;
    r.status = std::atoi(got.c_str() + 9);
    size_t end = got.find("\r\n\r\n");
    if (end != std::string::npos) r.body = got.substr(end + 4);
    return r;
}

Reply Post(int port, const std::string& path, const Json& body, const std::string& token = "") {
    return PostFrom("127.0.0.1", port, path, body, token);
}

// A listener that is not a ferry agent: it answers every connection with a banner (or says
// nothing, `silent`), and counts connections.
class Stranger {
  public:
    explicit Stranger(bool silent) : silent_(silent) {
        fd_ = ScopedFd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_in a{};
        a.sin_family = AF_INET;
        inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
        bind(fd_.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a));
        socklen_t len = sizeof(a);
        getsockname(fd_.get(), reinterpret_cast<sockaddr*>(&a), &len);
        port_ = ntohs(a.sin_port);
        listen(fd_.get(), 64);
        thread_ = std::thread([this] {
            for (;;) {
                int c = accept(fd_.get(), nullptr, nullptr);
                if (c < 0 || stop_) {
                    if (c >= 0) close(c);
                    return;
                }
                ++connections_;
                if (!silent_) {
                    const char banner[] =
                        "SSH-2.0-OpenSSH_9.2 BANNER-7f3a secret-internal-host\r\n";
                    (void)!write(c, banner, sizeof(banner) - 1);
                }
                held_.push_back(c);
            }
        });
    }
    ~Stranger() {
        stop_ = true;
        shutdown(fd_.get(), SHUT_RDWR);
        thread_.join();
        for (int c : held_) close(c);
    }
    int port() const { return port_; }
    int connections() const { return connections_; }

  private:
    bool silent_;
    ScopedFd fd_;
    int port_ = 0;
    std::atomic<bool> stop_{false};
    std::atomic<int> connections_{0};
    std::vector<int> held_;
    std::thread thread_;
};

class Trust : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        setenv("UCX_TLS", "tcp", 1);
        model_ = new testing::TinyModelFile("trust-test", testing::TinyModelSpec(4096), 29);
    }
    static void TearDownTestSuite() {
        delete model_;
        model_ = nullptr;
    }
    static std::vector<std::string> Args(const std::string& role,
                                         std::vector<std::string> extra = {}) {
        std::vector<std::string> a = {"serve", "--model",         model_->path(), "--port",
                                      "0",     "--block-size",    "16",           "--num-kv-blocks",
                                      "2048",  "--max-model-len", "4096",         "--role",
                                      role};
        if (role != "colocated") a.insert(a.end(), {"--kv-backend", "shm"});
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
    }
    static std::unique_ptr<ServerProcess> Start(std::vector<std::string> args) {
        auto p = ServerProcess::Start(FERRY_BIN, std::move(args));
        if (!p.ok()) {
            ADD_FAILURE() << p.status().ToString();
            return nullptr;
        }
        return std::move(p).value();
    }
    // The colocated answer of `prompt` (the reference every answer is compared with).
    std::vector<int32_t> Colocated(const std::vector<int32_t>& prompt, int max_tokens = 6) {
        if (!colocated_) colocated_ = Start(Args("colocated"));
        if (!colocated_) return {};
        Reply r = Post(colocated_->port(), "/v1/completions", Body(prompt, max_tokens));
        EXPECT_EQ(r.status, 200) << r.body;
        return r.tokens();
    }
    // A prefill worker's hold for `prompt`: the kv_transfer_params of its answer.
    static Json Hold(ServerProcess& prefill, const std::vector<int32_t>& prompt,
                     const std::string& token = "", const std::string& from = "127.0.0.1") {
        Json b = Body(prompt, 1);
        b["kv_transfer_params"] = {{"do_remote_decode", true}};
        Reply r = PostFrom(from, prefill.port(), "/v1/completions", b, token);
        EXPECT_EQ(r.status, 200) << r.body;
        Json j = r.json();
        return j.is_object() && j.contains("kv_transfer_params") ? j["kv_transfer_params"] : Json();
    }
    static Reply Decode(ServerProcess& decode, const std::vector<int32_t>& prompt,
                        const Json& params, const std::string& token = "") {
        Json b = Body(prompt);
        b["kv_transfer_params"] = params;
        return Post(decode.port(), "/v1/completions", b, token);
    }
    static testing::TinyModelFile* model_;
    std::unique_ptr<ServerProcess> colocated_;
};
testing::TinyModelFile* Trust::model_ = nullptr;

bool IsHex32(const Json& v) {
    return v.is_string() && v.get<std::string>().size() == 32 &&
           v.get<std::string>().find_first_not_of("0123456789abcdef") == std::string::npos;
}

// The forged-block read: a client takes a hold for its own prompt, then names the victim's
// block ids (or its own shifted) in the params it gives the decoder. The prefill worker refuses
// the claim (409), no token of the victim's appears, the victim's own hold still serves it, and
// the attacker's prompt afterwards equals colocated on the decoder (nothing poisoned).
TEST_F(Trust, APullClaimReadsOnlyTheBlocksItsHoldOwns) {
    auto prefill = Start(Args("prefill"));
    auto decode = Start(Args("decode"));
    ASSERT_TRUE(prefill && decode);
    const auto victim = Prompt(320, 1), attacker = Prompt(320, 2);
    const auto want_victim = Colocated(victim), want_attacker = Colocated(attacker);
    Json pv = Hold(*prefill, victim), pa = Hold(*prefill, attacker);
    ASSERT_TRUE(pv.is_object() && pa.is_object());
    EXPECT_TRUE(IsHex32(pv["ferry_hold_nonce"])) << pv.dump();
    // Its own hold, the victim's block ids; the victim's params with its own prompt; its own
    // ids shifted by one (blocks of other requests, or free ones still cached).
    Json victims_blocks = pa;
    victims_blocks["remote_block_ids"] = pv["remote_block_ids"];
    Json shifted = pa;
    for (Json& b : shifted["remote_block_ids"]) b = b.get<int>() + 1;
    for (const Json& forged : {victims_blocks, pv, shifted}) {
        Reply r = Decode(*decode, attacker, forged);
        EXPECT_EQ(r.status, 409) << r.body;
        EXPECT_TRUE(r.tokens().empty()) << r.body;
        EXPECT_EQ(r.body.find("choices"), std::string::npos) << r.body;
    }
    // The honest claims still work, and equal colocated.
    Reply v = Decode(*decode, victim, pv);
    EXPECT_EQ(v.status, 200) << v.body;
    EXPECT_EQ(v.tokens(), want_victim);
    Reply a = Decode(*decode, attacker, pa);
    EXPECT_EQ(a.status, 200) << a.body;
    EXPECT_EQ(a.tokens(), want_attacker);
    // Honest users of the attacker's prompt (and of one sharing its first 160 tokens) on the
    // decoder: colocated tokens.
    EXPECT_EQ(Post(decode->port(), "/v1/completions", Body(attacker)).tokens(), want_attacker);
    auto shared_prefix = attacker;
    shared_prefix.resize(200);
    EXPECT_EQ(Post(decode->port(), "/v1/completions", Body(shared_prefix)).tokens(),
              Colocated(shared_prefix));
    EXPECT_TRUE(decode->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
    EXPECT_EQ(decode->Metric("ferry_kv_connector_failed_total{reason=\"claim_refused\"}"), 3);
}

// KV from a peer the decoder cannot know (no secret, no store, no --kv-peers: vLLM's open mode)
// serves its own request and never enters the prefix cache; among a deployment's agents (a
// secret) it does.
TEST_F(Trust, LoadedKvIsCachedOnlyWhenItComesFromTheDeployment) {
    for (bool with_secret : {false, true}) {
        SecretFile secret("trust-cache");
        std::vector<std::string> extra;
        if (with_secret) extra = {"--secret-file", secret.path()};
        const std::string token = with_secret ? secret.router_token() : "";
        auto prefill = Start(Args("prefill", extra));
        auto decode = Start(Args("decode", extra));
        ASSERT_TRUE(prefill && decode);
        const auto prompt = Prompt(160, with_secret ? 4 : 3);
        Json p = Hold(*prefill, prompt, token);
        Reply r = Decode(*decode, prompt, p, token);
        ASSERT_EQ(r.status, 200) << r.body;
        EXPECT_EQ(r.tokens(), Colocated(prompt));
        const double hits = decode->Metric("ferry_prefix_cache_hits_total");
        Reply again = Post(decode->port(), "/v1/completions", Body(prompt));
        ASSERT_EQ(again.status, 200);
        EXPECT_EQ(again.tokens(), Colocated(prompt));
        const double got = decode->Metric("ferry_prefix_cache_hits_total") - hits;
        if (with_secret) {
            EXPECT_EQ(got, 144) << "9 whole blocks of the loaded KV are the prompt's own";
        } else {
            EXPECT_EQ(got, 0) << "KV from an unknown peer was cached";
        }
    }
}

// With a secret, kv_transfer_params and the internal routes need the router token: none 401, a
// wrong one 403; plain OpenAI requests are served as before. Without a secret the admin route
// is refused (403) outright.
TEST_F(Trust, InternalFieldsAndRoutesAreTheRoutersOnly) {
    SecretFile secret("trust-token"), other("trust-other");
    const std::vector<std::string> extra = {"--secret-file", secret.path()};
    auto prefill = Start(Args("prefill", extra));
    auto decode = Start(Args("decode", extra));
    auto open_decode = Start(Args("decode"));
    ASSERT_TRUE(prefill && decode && open_decode);
    const auto prompt = Prompt(100, 5);
    Json b = Body(prompt, 1);
    b["kv_transfer_params"] = {{"do_remote_decode", true}};
    EXPECT_EQ(Post(prefill->port(), "/v1/completions", b).status, 401);
    EXPECT_EQ(Post(prefill->port(), "/v1/completions", b, other.router_token()).status, 403);
    EXPECT_EQ(prefill->Metric("ferry_kv_requests_held"), 0);
    Json p = Hold(*prefill, prompt, secret.router_token());
    ASSERT_TRUE(p.is_object());
    Reply anonymous = Decode(*decode, prompt, p);
    EXPECT_EQ(anonymous.status, 401) << anonymous.body;
    EXPECT_NE(anonymous.body.find("router token"), std::string::npos) << anonymous.body;
    Reply ok = Decode(*decode, prompt, p, secret.router_token());
    EXPECT_EQ(ok.status, 200) << ok.body;
    EXPECT_EQ(ok.tokens(), Colocated(prompt));
    // Plain requests: no token needed.
    EXPECT_EQ(Post(decode->port(), "/v1/completions", Body(prompt)).tokens(), Colocated(prompt));
    // The admin route and the agent's whereabouts.
    const Json eps = {{"endpoints", {fmt::format("127.0.0.1:{}", prefill->port())}}};
    EXPECT_EQ(Post(decode->port(), "/add_remote_prefill_eps", eps).status, 401);
    EXPECT_EQ(Post(decode->port(), "/add_remote_prefill_eps", eps, other.router_token()).status,
              403);
    // Without a secret the admin route is this host's: a loopback peer may (seed 004's curl);
    // src/core/host_port_test.cc has which peers are loopback.
    EXPECT_EQ(Post(open_decode->port(), "/add_remote_prefill_eps", eps).status, 200);
    EXPECT_EQ(PostFrom("127.0.0.1", prefill->port(), "/v1/kv/agent", Json(), "", "GET").status,
              401);
    EXPECT_EQ(
        PostFrom("127.0.0.1", prefill->port(), "/v1/kv/agent", Json(), secret.router_token(), "GET")
            .status,
        200);
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
    // A migrated stream's ferry_continue (its output tokens so far) is the router's too: a client
    // would have its prompt counted as output. Malformed, it is named; the router's goes on
    // exactly where the colocated answer does.
    const std::vector<int32_t> whole = Colocated(prompt);
    ASSERT_GE(whole.size(), 3u);
    Json c = Body(prompt);
    c["ferry_continue"] = {{"token_ids", {whole[0], whole[1]}}};
    EXPECT_EQ(Post(decode->port(), "/v1/completions", c).status, 401);
    EXPECT_EQ(Post(decode->port(), "/v1/completions", c, other.router_token()).status, 403);
    Reply resumed = Post(decode->port(), "/v1/completions", c, secret.router_token());
    ASSERT_EQ(resumed.status, 200) << resumed.body;
    EXPECT_EQ(resumed.tokens(), std::vector<int32_t>(whole.begin() + 2, whole.end()));
    for (const Json& bad : {Json{{"token_ids", Json::array()}}, Json{{"token_ids", {-1}}},
                            Json{{"ids", {1}}}, Json("1,2")}) {
        Json x = Body(prompt);
        x["ferry_continue"] = bad;
        Reply r = Post(open_decode->port(), "/v1/completions", x);
        EXPECT_EQ(r.status, 400) << bad.dump();
        EXPECT_NE(r.body.find("ferry_continue"), std::string::npos) << r.body;
    }
}

// A decode worker dials only agents it knows. With --kv-peers a stranger's port is never
// dialed (403); in the open mode it is, but the error names it without echoing a byte of what
// it said; and silent strangers a client names hold up no one else's request.
TEST_F(Trust, StrangersAreNotDialedAndNeverEchoedAndSilentOnesDelayNoOne) {
    auto prefill = Start(Args("prefill"));
    ASSERT_TRUE(prefill);
    const std::string agent = prefill->agent();  // "NAME at HOST:PORT"
    const std::string agent_addr = agent.substr(agent.rfind(' ') + 1);
    const std::string agent_name = agent.substr(0, agent.find(' '));
    auto listed = Start(Args("decode", {"--kv-peers", agent_addr}));
    // The silent strangers below must still be waiting when the honest request is answered,
    // however slow the build: a long handshake deadline.
    auto open = Start(Args("decode", {"--kv-handshake-timeout-ms", "30000"}));
    ASSERT_TRUE(listed && open);
    Stranger banner(false);
    const auto prompt = Prompt(64, 6);
    Json p = Hold(*prefill, prompt);
    Json to_stranger = p;
    to_stranger["remote_port"] = banner.port();
    Reply refused = Decode(*listed, prompt, to_stranger);
    EXPECT_EQ(refused.status, 403) << refused.body;
    EXPECT_EQ(banner.connections(), 0);
    Reply unreachable = Decode(*open, prompt, to_stranger);
    EXPECT_EQ(unreachable.status, 503) << unreachable.body;
    EXPECT_EQ(unreachable.body.find("BANNER"), std::string::npos) << unreachable.body;
    EXPECT_EQ(unreachable.body.find("SSH"), std::string::npos) << unreachable.body;
    EXPECT_NE(unreachable.body.find(agent_name), std::string::npos) << unreachable.body;
    // The listed worker still loads from the real prefill worker.
    Reply fine = Decode(*listed, prompt, p);
    EXPECT_EQ(fine.status, 200) << fine.body;
    EXPECT_EQ(fine.tokens(), Colocated(prompt));
    // Silent strangers, each named under another agent name by a client at 127.0.0.2: their
    // handshakes run beside the honest one, which is answered while they still wait.
    std::vector<std::unique_ptr<Stranger>> silent;
    std::vector<std::thread> attackers;
    std::atomic<int> attacker_statuses_5xx{0};
    for (int i = 0; i < 4; ++i) {
        silent.push_back(std::make_unique<Stranger>(true));
        Json s = p;
        s["remote_engine_id"] = fmt::format("silent-{}", i);
        s["remote_port"] = silent.back()->port();
        attackers.emplace_back([&, s, i] {
            Json b = Body(Prompt(64, 100 + i));
            b["kv_transfer_params"] = s;
            Reply r = PostFrom("127.0.0.2", open->port(), "/v1/completions", b);
            if (r.status >= 500 || r.status == 429) ++attacker_statuses_5xx;
        });
    }
    ASSERT_TRUE(testing::WaitUntil(
        [&] {
            int n = 0;
            for (auto& s : silent) n += s->connections() > 0;
            return n == 4;
        },
        std::chrono::seconds(20)));
    const auto honest = Prompt(64, 7);
    Reply h = Decode(*open, honest, Hold(*prefill, honest));
    EXPECT_EQ(h.status, 200) << h.body;
    EXPECT_EQ(h.tokens(), Colocated(honest));
    // The strangers' loads were still waiting for their handshakes when it was answered.
    EXPECT_GE(open->Metric("ferry_kv_connector_requests{state=\"bootstrapping\"}"), 1);
    silent.clear();  // they hang up: the handshakes fail now, not at their deadline
    for (auto& t : attackers) t.join();
    EXPECT_EQ(attacker_statuses_5xx, 4);
    EXPECT_TRUE(open->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(listed->WaitMetric("ferry_kv_blocks_used", 0));
}

// A client at another address than the router floods the prefill worker with holds it never
// claims: beyond its share (a quarter of the cache) it gets 429, and an honest request through
// the proxy is served at once; the leases free what the flood held.
TEST_F(Trust, HoldFloodsAreCappedPerClient) {
    auto prefill = Start({"serve", "--model", model_->path(), "--port", "0", "--block-size", "16",
                          "--num-kv-blocks", "512", "--max-model-len", "4096", "--role", "prefill",
                          "--kv-backend", "shm", "--kv-hold-lease-ms", "3000"});
    auto decode = Start(Args("decode"));
    ASSERT_TRUE(prefill && decode);
    auto proxy =
        Start({"proxy", "--prefill", fmt::format("127.0.0.1:{}", prefill->port()), "--decode",
               fmt::format("127.0.0.1:{}", decode->port()), "--port", "0", "--no-store"});
    ASSERT_TRUE(proxy);
    int held = 0, limited = 0;
    for (int i = 0; i < 16; ++i) {
        Json b = Body(Prompt(500, 200 + i), 1);  // 32 blocks each
        b["kv_transfer_params"] = {{"do_remote_decode", true}};
        Reply r = PostFrom("127.0.0.2", prefill->port(), "/v1/completions", b);
        if (r.status == 200) ++held;
        if (r.status == 429) ++limited;
        EXPECT_TRUE(r.status == 200 || r.status == 429) << r.status << " " << r.body;
    }
    EXPECT_EQ(held, 4);  // 128 of 512 blocks
    EXPECT_EQ(limited, 12);
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
    // A shared prefix counts once: one prompt held twelve times pins its 31 full blocks once
    // and a fresh last block per hold (43 blocks, not 12 x 32: cache-aware routing sends one
    // prefix's requests to one worker, and they must not be refused for it).
    const auto shared = Prompt(500, 300);
    for (int i = 0; i < 12; ++i) {
        Json b = Body(shared, 1);
        b["kv_transfer_params"] = {{"do_remote_decode", true}};
        Reply r = PostFrom("127.0.0.2", prefill->port(), "/v1/completions", b);
        EXPECT_EQ(r.status, 200) << i << ": " << r.body;
    }
    // A prompt larger than the share alone is refused before it is computed, naming both.
    Json big = Body(Prompt(2100, 301), 1);  // 132 blocks
    big["kv_transfer_params"] = {{"do_remote_decode", true}};
    Reply too_big = PostFrom("127.0.0.3", prefill->port(), "/v1/completions", big);
    EXPECT_EQ(too_big.status, 429) << too_big.body;
    EXPECT_NE(too_big.body.find("a prompt of 132 KV blocks"), std::string::npos) << too_big.body;
    const auto honest = Prompt(500, 9);
    Reply h = Post(proxy->port(), "/v1/completions", Body(honest));
    EXPECT_EQ(h.status, 200) << h.body;
    EXPECT_EQ(h.tokens(), Colocated(honest));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_blocks_used", 0));
    // The same flood all at once: the share is checked again as each hold is made, so a burst
    // admitted together still holds no more than it.
    std::atomic<int> burst_held{0}, burst_limited{0};
    std::vector<std::thread> burst;
    for (int i = 0; i < 16; ++i) {
        burst.emplace_back([&, i] {
            Json b = Body(Prompt(500, 400 + i), 1);
            b["kv_transfer_params"] = {{"do_remote_decode", true}};
            Reply r = PostFrom("127.0.0.2", prefill->port(), "/v1/completions", b);
            if (r.status == 200) ++burst_held;
            if (r.status == 429) ++burst_limited;
        });
    }
    for (auto& t : burst) t.join();
    EXPECT_LE(burst_held, 4);
    EXPECT_EQ(burst_held + burst_limited, 16);
    Reply h2 = Post(proxy->port(), "/v1/completions", Body(honest));
    EXPECT_EQ(h2.status, 200) << h2.body;
    EXPECT_EQ(h2.tokens(), Colocated(honest));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_blocks_used", 0));
}

// push: a client pairs its own prefill request (prompt P) with a decode request for another
// prompt Q under one transfer id. The prefill worker sees the decoder's prompt is not its own:
// that decoder is refused at once, and the prefill request (which a transfer id's rightful
// decoder could still claim: a stranger who learns an id cannot fail it) expires unpaired at the
// bootstrap timeout. No 200, nothing of P lands in Q's cache, and Q afterwards equals colocated.
TEST_F(Trust, APushPairsOnlyOneAndTheSamePrompt) {
    auto prefill =
        Start(Args("prefill", {"--kv-connector-config", R"({"bootstrap_timeout_ms": 1500})"}));
    auto decode = Start(Args("decode"));
    ASSERT_TRUE(prefill && decode);
    Json agent = PostFrom("127.0.0.1", prefill->port(), "/v1/kv/agent", Json(), "", "GET").json();
    ASSERT_TRUE(agent.is_object());
    const auto p = Prompt(200, 21), q = Prompt(200, 22);
    const std::string xid = "a1b2c3d4e5f60718293a4b5c6d7e8f90";
    Json pb = Body(p, 1);
    pb["kv_transfer_params"] = {
        {"do_remote_decode", true}, {"transfer_mode", "push"}, {"transfer_id", xid}};
    Json qb = Body(q);
    qb["kv_transfer_params"] = {
        {"do_remote_prefill", true},    {"transfer_mode", "push"},
        {"transfer_id", xid},           {"remote_engine_id", agent["engine_id"]},
        {"remote_host", agent["host"]}, {"remote_port", agent["port"]}};
    Reply prefill_reply;
    std::thread t([&] { prefill_reply = Post(prefill->port(), "/v1/completions", pb); });
    Reply decode_reply = Post(decode->port(), "/v1/completions", qb);
    t.join();
    EXPECT_TRUE(decode_reply.status == 409 || decode_reply.status == 503) << decode_reply.body;
    EXPECT_TRUE(decode_reply.tokens().empty());
    EXPECT_NE(prefill_reply.status, 200) << prefill_reply.body;
    EXPECT_NE(prefill_reply.status, 500) << prefill_reply.body;
    const double hits = decode->Metric("ferry_prefix_cache_hits_total");
    EXPECT_EQ(Post(decode->port(), "/v1/completions", Body(q)).tokens(), Colocated(q));
    EXPECT_EQ(decode->Metric("ferry_prefix_cache_hits_total"), hits);
    EXPECT_TRUE(decode->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_blocks_used", 0));
}

// A router of our own that follows vLLM's protocol exactly as its toy_proxy_server.py does (not
// `ferry proxy`): the prefill request carries kv_transfer_params with do_remote_decode and the
// other fields null, max_tokens 1, stream false, and "Authorization: Bearer $OPENAI_API_KEY" (the
// router token where the workers have a secret, anything where they have none); the decode
// request carries the prefill answer's kv_transfer_params as they came.
TEST_F(Trust, AVllmStyleRouterWorksUnchangedWithAndWithoutASecret) {
    for (bool with_secret : {false, true}) {
        SecretFile secret("trust-vllm");
        std::vector<std::string> extra;
        if (with_secret) extra = {"--secret-file", secret.path()};
        auto prefill = Start(Args("prefill", extra));
        auto decode = Start(Args("decode", extra));
        ASSERT_TRUE(prefill && decode);
        const std::string key = with_secret ? secret.router_token() : "sk-anything";
        for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
            const bool chat = std::string(path) == "/v1/chat/completions";
            Json req = chat ? Json{{"messages", {{{"role", "user"}, {"content", "tell me more"}}}},
                                   {"max_tokens", 10},
                                   {"temperature", 0},
                                   {"ignore_eos", true}}
                            : Json{{"prompt", "a vLLM router in front"},
                                   {"max_tokens", 10},
                                   {"temperature", 0},
                                   {"ignore_eos", true}};
            if (!colocated_) colocated_ = Start(Args("colocated"));
            ASSERT_TRUE(colocated_);
            Reply want = Post(colocated_->port(), path, req);
            ASSERT_EQ(want.status, 200);
            Json p = req;
            p["kv_transfer_params"] = {{"do_remote_decode", true},    {"do_remote_prefill", false},
                                       {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                                       {"remote_host", nullptr},      {"remote_port", nullptr}};
            p["stream"] = false;
            p["max_tokens"] = 1;
            Reply pr = Post(prefill->port(), path, p, key);
            ASSERT_EQ(pr.status, 200) << pr.body;
            const Json answer = pr.json();
            const Json& kv = answer["kv_transfer_params"];
            EXPECT_EQ(kv["do_remote_prefill"], true);
            EXPECT_EQ(kv["do_remote_decode"], false);
            EXPECT_TRUE(kv["remote_engine_id"].is_string());
            EXPECT_TRUE(kv["remote_block_ids"].is_array());
            EXPECT_TRUE(kv["remote_host"].is_string());
            EXPECT_TRUE(kv["remote_port"].is_number_integer());
            EXPECT_TRUE(kv["remote_request_id"].is_string());
            EXPECT_EQ(kv["tp_size"], 1);
            Json dreq = req;
            dreq["kv_transfer_params"] = kv;
            Reply dr = Post(decode->port(), path, dreq, key);
            ASSERT_EQ(dr.status, 200) << dr.body;
            Json a = want.json(), b = dr.json();
            if (chat) {
                EXPECT_EQ(b["choices"][0]["message"]["content"],
                          a["choices"][0]["message"]["content"]);
            } else {
                EXPECT_EQ(b["choices"][0]["text"], a["choices"][0]["text"]);
            }
            EXPECT_EQ(b["usage"]["completion_tokens"], 10);
        }
        EXPECT_EQ(decode->Metric("ferry_prompt_tokens_total"), 0);
        EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0));
    }
}

// Ids a client sees tell nothing about others': response ids and hold nonces are 128 random
// bits, never a counter.
TEST_F(Trust, IdsAndNoncesAreRandom) {
    auto prefill = Start(Args("prefill"));
    ASSERT_TRUE(prefill);
    std::set<std::string> ids, nonces;
    for (int i = 0; i < 3; ++i) {
        Json b = Body(Prompt(20, 50 + i), 1);
        b["kv_transfer_params"] = {{"do_remote_decode", true}};
        Json j = Post(prefill->port(), "/v1/completions", b).json();
        ASSERT_TRUE(j.is_object());
        const std::string id = j["id"].get<std::string>();
        EXPECT_EQ(id.rfind("cmpl-", 0), 0u);
        EXPECT_TRUE(IsHex32(Json(id.substr(5)))) << id;
        EXPECT_TRUE(IsHex32(j["kv_transfer_params"]["ferry_hold_nonce"]));
        ids.insert(id);
        nonces.insert(j["kv_transfer_params"]["ferry_hold_nonce"].get<std::string>());
    }
    EXPECT_EQ(ids.size(), 3u);
    EXPECT_EQ(nonces.size(), 3u);
}

// The transfer-id guess: a client that sees response ids parks push prefill requests under the
// transfer ids it would guess from them (the old ids were a salt shown in every response id and
// a counter). The ids are random now: the next users of decode-first are served, and equal
// colocated.
TEST_F(Trust, ParkingUnderGuessedTransferIdsHarmsNoOne) {
    auto prefill = Start(Args("prefill"));
    ASSERT_TRUE(prefill);
    auto first =
        Start(Args("decode", {"--remote-prefill", fmt::format("127.0.0.1:{}", prefill->port()),
                              "--remote-prefill-min-tokens", "1"}));
    ASSERT_TRUE(first);
    const auto seen = Prompt(40, 60);
    Reply r = Post(first->port(), "/v1/completions", Body(seen));
    ASSERT_EQ(r.status, 200) << r.body;
    const std::string id = r.json()["id"].get<std::string>();  // cmpl-<32 hex>
    std::vector<std::thread> parked;
    for (int i = 0; i < 4; ++i) {
        for (const std::string& guess :
             {id.substr(5), fmt::format("df-{}-{:08x}", id.substr(5, 16), i + 1)}) {
            parked.emplace_back([&, guess, i] {
                Json b = Body(Prompt(40, 70 + i), 1);
                b["kv_transfer_params"] = {
                    {"do_remote_decode", true}, {"transfer_mode", "push"}, {"transfer_id", guess}};
                // Parked until its (never coming) decoder names blocks, or its client leaves.
                (void)PostFrom("127.0.0.2", prefill->port(), "/v1/completions", b);
            });
        }
    }
    ASSERT_TRUE(
        testing::WaitUntil([&] { return prefill->Metric("ferry_kv_requests_parked") >= 5; }));
    for (int i = 0; i < 4; ++i) {
        const auto prompt = Prompt(80, 80 + i);
        Reply h = Post(first->port(), "/v1/completions", Body(prompt));
        EXPECT_EQ(h.status, 200) << h.body;
        EXPECT_EQ(h.tokens(), Colocated(prompt));
    }
    prefill->Kill();  // ends the parked requests (their connections close)
    for (auto& t : parked) t.join();
}

// Random and mutated params against a live pair: never a 500, and every 200 carries exactly
// the colocated tokens of its prompt.
TEST_F(Trust, MutatedParamsNeverGiveWrongTokensOrA500) {
    // Refused claims leave their holds to the lease: no per-client cap here (another test's).
    auto prefill =
        Start(Args("prefill", {"--kv-client-hold-blocks", "0", "--kv-hold-lease-ms", "2000"}));
    auto decode = Start(Args("decode"));
    ASSERT_TRUE(prefill && decode);
    std::mt19937 g(29);
    const auto a = Prompt(90, 11), b = Prompt(90, 12);
    const auto want_a = Colocated(a), want_b = Colocated(b);
    int ok = 0;
#if defined(FERRY_SANITIZED)
    const int rounds = 24;
#else
    const int rounds = 60;
#endif
    for (int i = 0; i < rounds; ++i) {
        Json p = Hold(*prefill, a);
        ASSERT_TRUE(p.is_object());
        Json other = Hold(*prefill, b);
        const auto* prompt = &a;
        switch (g() % 12) {
            case 0:
                break;  // unchanged
            case 1:
                prompt = &b;
                break;
            case 2:
                p["remote_block_ids"] = other["remote_block_ids"];
                break;
            case 3:
                p["remote_block_ids"].erase(p["remote_block_ids"].size() - 1);
                break;
            case 4:
                p["remote_block_ids"].push_back(g() % 2048);
                break;
            case 5:
                p["ferry_hold_nonce"] = other["ferry_hold_nonce"];
                break;
            case 6:
                p["remote_request_id"] = other["remote_request_id"];
                break;
            case 7:
                p["ferry_first_token"]["token"] = static_cast<int>(g() % 256);
                break;
            case 8:
                p["remote_port"] = static_cast<int>(1 + g() % 65535);
                break;
            case 9:
                p["remote_engine_id"] = "ferry-nobody";
                break;
            case 10:
                p["ferry_hold_nonce"] = fmt::format("{:032x}", g());
                break;
            case 11:
                p["remote_block_ids"] = Json::array({g() % 2048, g() % 2048});
                break;
        }
        Reply r = Decode(*decode, *prompt, p);
        EXPECT_NE(r.status, 500) << r.body;
        EXPECT_NE(r.status, 0) << "no answer in round " << i;
        if (r.status == 200) {
            ++ok;
            EXPECT_EQ(r.tokens(), prompt == &a ? want_a : want_b) << "round " << i << " " << p;
        }
    }
    EXPECT_GT(ok, 0);
    EXPECT_TRUE(decode->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(prefill->WaitMetric("ferry_kv_requests_held", 0, std::chrono::seconds(30)));
}

// A prefill worker SIGKILLed and restarted under the same name (its agent on a new port): the
// very next pull and push requests succeed (the decoder and the proxy refresh what they had).
TEST_F(Trust, AfterAPrefillRestartTheVeryNextRequestsSucceed) {
    auto prefill = Start(Args("prefill", {"--agent-name", "prefill-restarts"}));
    ASSERT_TRUE(prefill);
    const std::string p = fmt::format("127.0.0.1:{}", prefill->port());
    auto decode = Start(Args("decode"));
    // decode-first: every prompt goes to the prefill worker, which pushes the KV here.
    auto first = Start(Args("decode", {"--remote-prefill", p, "--remote-prefill-min-tokens", "1"}));
    ASSERT_TRUE(decode && first);
    const std::string d = fmt::format("127.0.0.1:{}", decode->port());
    auto pull = Start({"proxy", "--prefill", p, "--decode", d, "--port", "0", "--no-store"});
    auto push = Start({"proxy", "--prefill", p, "--decode", d, "--port", "0", "--no-store",
                       "--kv-transfer", "push"});
    ASSERT_TRUE(pull && push);
    for (int round = 0; round < 2; ++round) {
        int k = 0;
        for (ServerProcess* entry : {pull.get(), push.get(), first.get()}) {
            const auto prompt = Prompt(120, 300 + round * 3 + k++);
            Reply r = Post(entry->port(), "/v1/completions", Body(prompt));
            EXPECT_EQ(r.status, 200) << "round " << round << " entry " << k << ": " << r.body;
            EXPECT_EQ(r.tokens(), Colocated(prompt));
        }
        if (round == 0) {
            prefill->Kill();
            ASSERT_TRUE(prefill->Restart().ok());
        }
    }
    EXPECT_EQ(first->Metric("ferry_prompt_tokens_total"), 0);
    EXPECT_TRUE(decode->WaitMetric("ferry_kv_blocks_used", 0));
    EXPECT_TRUE(first->WaitMetric("ferry_kv_blocks_used", 0));
}

}  // namespace
}  // namespace ferry
