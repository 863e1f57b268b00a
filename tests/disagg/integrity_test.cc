// Integrity on the surfaces of rounds 2-3, tried with real processes as an attacker would
// (issue 49, docs/security.md): a request id names a request and never changes what it computes;
// the encoder's identity travels with its embeddings; a stuck worker costs a bounded time; a
// client that left costs nothing more; ZeroMQ sockets bound what a peer may send.
#include <arpa/inet.h>
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <png.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "disagg/epd_harness.h"
#include "http/http.h"
#include "testing/images.h"
#include "testing/testing.h"
#include "testing/zmtp_liar.h"

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

// Sends `body` and returns the answer with how long it took.
struct Timed {
    Answer answer;
    double seconds = 0;
};
Timed SendTimed(int port, const Json& body) {
    const auto t0 = std::chrono::steady_clock::now();
    Timed t{SendAll(port, {body}, 1)[0], 0};
    t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return t;
}

// The deadlines the stuck-worker tests give (ms): an honest call must fit well within them, also
// under the sanitizers.
constexpr const char* kDeadline = testing::kSanitized ? "4000" : "1500";
// Far above those deadlines, far below what a stuck worker cost before (60 s to forever): a bound
// on waiting, not a performance figure.
constexpr double kWaitBound = 30;

// A stopped (SIGSTOP) or black-hole encode worker costs an image request at most the encode
// deadline, after which the images are encoded by the worker that serves it (the colocated
// answer); the next requests do not go to it at all, until it answers a probe again. The same
// for --encoder-urls.
TEST_F(Integrity, AStuckEncodeWorkerCostsItsDeadlineOnceAndIsLeftOutUntilItAnswers) {
    testing::SecretFile secret("integrity-stuck-encoder");
    const std::vector<std::string> ec = {"--ec-connector", "transfer", "--secret-file",
                                         secret.path()};
    auto colocated = StartOrDie(Args("colocated", ""));
    auto encode = StartOrDie(Args("encode", "tcp", ec));
    auto consumer = StartOrDie(Args("colocated", "", ec));
    testing::Blackhole hole("tcp");
    std::vector<std::string> self = ec;
    self.insert(self.end(), {"--encoder-urls", hole.address(), "--encoder-timeout-ms", kDeadline});
    auto self_encoding = StartOrDie(Args("colocated", "", self));
    ASSERT_TRUE(colocated && encode && consumer && self_encoding);
    auto px = StartOrDie({"proxy", "--encode", Addr(*encode), "--decode", Addr(*consumer), "--port",
                          "0", "--no-store", "--secret-file", secret.path(), "--encode-timeout-ms",
                          kDeadline});
    ASSERT_TRUE(px);
    std::vector<Json> bodies = Bodies(8, 8100);
    for (Json& b : bodies) b["stream"] = false;
    const std::vector<Answer> want = SendAll(colocated->port(), bodies, 4);
    ExpectSameTokens({SendTimed(px->port(), bodies[0]).answer}, {want[0]}, "before");
    EXPECT_EQ(px->Metric("ferry_proxy_encoded_total"), 1);

    ASSERT_TRUE(encode->Stop());  // SIGSTOP: connections open, nothing answers
    const Timed stuck = SendTimed(px->port(), bodies[1]);
    ExpectSameTokens({stuck.answer}, {want[1]}, "behind a stopped encode worker");
    EXPECT_LT(stuck.seconds, kWaitBound);
    EXPECT_EQ(px->Metric("ferry_proxy_worker_timeouts_total"), 1);
    EXPECT_EQ(px->Metric("ferry_proxy_encoders_quarantined"), 1);
    // Left out: the next requests do not wait for it.
    ExpectSameTokens(SendAll(px->port(), {bodies[2], bodies[3]}, 2), {want[2], want[3]}, "after");
    EXPECT_EQ(px->Metric("ferry_proxy_worker_timeouts_total"), 1);
    EXPECT_EQ(px->Metric("ferry_proxy_encoded_total"), 1);

    encode->Signal(SIGCONT);  // it answers its probe: back in rotation
    size_t next = 4;
    EXPECT_TRUE(testing::WaitUntil(
        [&] {
            ExpectSameTokens({SendTimed(px->port(), bodies[next % 8]).answer}, {want[next % 8]},
                             "resumed");
            ++next;
            return px->Metric("ferry_proxy_encoded_total") > 1;
        },
        std::chrono::seconds(20)));
    EXPECT_EQ(px->Metric("ferry_proxy_encoders_quarantined"), 0);

    // --encoder-urls at a black hole: one request waits for the deadline, the next none.
    const Timed first = SendTimed(self_encoding->port(), bodies[5]);
    ExpectSameTokens({first.answer}, {want[5]}, "--encoder-urls at a black hole");
    EXPECT_LT(first.seconds, kWaitBound);
    ExpectSameTokens({SendTimed(self_encoding->port(), bodies[6]).answer}, {want[6]},
                     "--encoder-urls, the black hole left out");
    EXPECT_EQ(self_encoding->Metric("ferry_ec_encoder_call_failures_total"), 1);
    EXPECT_EQ(self_encoding->Metric("ferry_mm_images_encoded_total"), 5);  // 2 + 3 images
}

// A stopped prefill worker costs a request at most the prefill deadline (through the proxy the
// request is then prefilled by the other prefill worker; decode-first answers 503), and gets no
// new request until it answers again: the others serve meanwhile (the proxy's other prefill
// worker; decode-first prefills here).
TEST_F(Integrity, AStuckPrefillWorkerCostsItsDeadlineOnceAndIsLeftOutUntilItAnswers) {
    testing::SecretFile secret("integrity-stuck-prefill");
    const std::vector<std::string> s = {"--secret-file", secret.path()};
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 1));
    auto p1 = StartOrDie(WorkerArgs("prefill", "tcp", 1, s));
    auto p2 = StartOrDie(WorkerArgs("prefill", "tcp", 1, s));
    auto decode = StartOrDie(WorkerArgs("decode", "tcp", 1, s));
    std::vector<std::string> df = s;
    df.insert(df.end(), {"--remote-prefill", Addr(*p1), "--remote-prefill-min-tokens", "32",
                         "--remote-prefill-timeout-ms", kDeadline});
    auto decode_first = StartOrDie(WorkerArgs("decode", "tcp", 1, df));
    ASSERT_TRUE(colocated && p1 && p2 && decode && decode_first);
    auto px =
        StartOrDie({"proxy", "--prefill", Addr(*p1), "--prefill", Addr(*p2), "--decode",
                    Addr(*decode), "--port", "0", "--no-store", "--secret-file", secret.path(),
                    "--prefill-timeout-ms", kDeadline, "--load-poll-ms", "100"});
    ASSERT_TRUE(px);
    std::vector<Json> bodies;
    for (int i = 0; i < 10; ++i)
        bodies.push_back(CompletionBody(RandomPrompt(60 + i, 90 + i), 4, false));
    const std::vector<Answer> want = SendAll(colocated->port(), bodies, 4);
    ExpectSameTokens(SendAll(px->port(), {bodies[0], bodies[1]}, 1), {want[0], want[1]}, "before");

    const std::string answering =
        fmt::format("ferry_router_worker_answering{{role=\"prefill\",worker=\"{}\"}}", Addr(*p1));
    ASSERT_TRUE(p1->Stop());
    // Round robin: within two requests one goes to the stopped worker; at its deadline the
    // proxy has it prefilled by the other (--max-attempts), so both are answered right.
    for (int i = 2; i < 4; ++i) {
        const Timed t = SendTimed(px->port(), bodies[size_t(i)]);
        EXPECT_LT(t.seconds, kWaitBound);
        ExpectSameTokens({t.answer}, {want[size_t(i)]}, "the other prefill worker");
    }
    EXPECT_EQ(px->Metric("ferry_proxy_prefill_retried_total"), 1);
    EXPECT_EQ(px->Metric(answering), 0);
    // Left out: every request goes to the other one.
    std::vector<Json> rest(bodies.begin() + 4, bodies.end());
    ExpectSameTokens(SendAll(px->port(), rest, 2),
                     std::vector<Answer>(want.begin() + 4, want.end()), "while it is stopped");
    EXPECT_EQ(px->Metric("ferry_proxy_worker_timeouts_total"), 1);

    // Decode-first to the stopped worker: one 503, then prefilled here.
    const Timed df_stuck = SendTimed(decode_first->port(), bodies[0]);
    EXPECT_EQ(df_stuck.answer.status, 503) << df_stuck.answer.body;
    EXPECT_LT(df_stuck.seconds, kWaitBound);
    ExpectSameTokens(SendAll(decode_first->port(), {bodies[1], bodies[2]}, 1), {want[1], want[2]},
                     "decode-first, prefilled here");
    EXPECT_EQ(decode_first->Metric("ferry_kv_external_tokens_total"), 0);

    p1->Signal(SIGCONT);
    EXPECT_TRUE(px->WaitMetric(answering, 1));
    EXPECT_TRUE(testing::WaitUntil(
        [&] {
            ExpectSameTokens(SendAll(decode_first->port(), {bodies[3]}, 1), {want[3]},
                             "decode-first, resumed");
            return decode_first->Metric("ferry_kv_external_tokens_total") > 0;
        },
        std::chrono::seconds(20)));
}

// Sends `body` as a POST of `path` to 127.0.0.1:`port` and does not read the answer: the socket,
// for the caller to close (a client that leaves).
int SendAndLeave(int port, const std::string& path, const std::string& body) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return fd;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return fd;
    const std::string req = fmt::format(
        "POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: {}\r\n\r\n{}",
        path, body.size(), body);
    size_t off = 0;
    while (off < req.size()) {
        const ssize_t n = send(fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
        if (n <= 0) break;
        off += size_t(n);
    }
    return fd;
}

// Clients that send requests with many large images and leave all at once cost nothing more than
// what had started: their requests are dropped from the media queue (and between images), so an
// honest request behind them waits for its own work only.
// A chat body of `images` copies of one image URL.
Json ImagesBody(const std::string& url, int images) {
    Json content = Json::array();
    for (int j = 0; j < images; ++j) {
        content.push_back({{"type", "image_url"}, {"image_url", {{"url", url}}}});
    }
    content.push_back({{"type", "text"}, {"text", "describe"}});
    return {{"messages", {{{"role", "user"}, {"content", content}}}},
            {"max_tokens", 4},
            {"stream", false}};
}

// A PNG near the pixel limit (16 Mi) and small on the wire: it takes a while to decode.
std::string SlowPngUrl() {
    const int side = 4000;
    std::vector<uint8_t> px(size_t(side) * side * 3);
    for (size_t i = 0; i < px.size(); ++i) {
        px[i] = uint8_t((i / 3 / 64 + i / 3 / side / 64) % 2 * 200);
    }
    return testing::DataUrl("image/png", testing::Png(side, side, PNG_FORMAT_RGB, px));
}

TEST_F(Integrity, RequestsWhoseClientsLeftAreDroppedWhereTheyWait) {
    auto worker = StartOrDie(Args("colocated", ""));
    ASSERT_TRUE(worker);
    const int images = 2, requests = testing::kSanitized ? 4 : 8;
    const std::string text = ImagesBody(SlowPngUrl(), images).dump();
    std::vector<int> fds;
    for (int i = 0; i < requests; ++i) {
        fds.push_back(SendAndLeave(worker->port(), "/v1/chat/completions", text));
    }
    for (int fd : fds) close(fd);      // all at once, while the first is being decoded
    Json honest = Bodies(1, 9100)[0];  // one small image
    honest["stream"] = false;
    const Answer got = SendAll(worker->port(), {honest}, 1)[0];
    EXPECT_EQ(got.status, 200) << got.body;
    EXPECT_TRUE(testing::WaitUntil(
        [&] {
            return worker->Metric("ferry_mm_requests_dropped_total") +
                       worker->Metric("ferry_request_success_total{finished_reason=\"abort\"}") ==
                   requests;
        },
        std::chrono::seconds(20)))
        << worker->Metric("ferry_mm_requests_dropped_total");
    // At most the image being decoded when the clients left (the check is between images), and
    // the honest request's.
    EXPECT_LE(worker->Metric("ferry_mm_images_total"), 2);
}

// The KV-event sockets bound what a peer may send (ZMQ_MAXMSGSIZE): a peer that reaches the PUB
// or the replay port and declares a 16 GiB frame is cut off on the header, and the worker holds
// nothing of it. --kv-events-bind binds one interface (vLLM's rule would dial it).
TEST_F(Integrity, KvEventSocketsCutAPeerThatDeclaresAHugeFrame) {
    auto worker =
        StartOrDie(WorkerArgs("colocated", "", 1,
                              {"--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-bind",
                               "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"}));
    ASSERT_TRUE(worker);
    int pub = 0, replay = 0;
    for (const std::string& line : worker->startup_lines()) {
        if (line.find("kv events at tcp://127.0.0.1:") == std::string::npos) continue;
        pub = std::stoi(line.substr(line.find("127.0.0.1:") + 10));
        replay = std::stoi(line.substr(line.rfind("127.0.0.1:") + 10));
    }
    ASSERT_GT(pub, 0);
    ASSERT_GT(replay, 0);
    ASSERT_NE(pub, replay);
    const size_t rss0 = testing::RssBytes(worker->pid());
    const uint64_t declared = 16ull << 30, sent = testing::kSanitized ? 128ull << 20 : 512ull << 20;
    for (auto [port, type] : {std::pair{pub, "SUB"}, std::pair{replay, "DEALER"}}) {
        const testing::ZmtpLie lie = testing::LieToZmtpServer(port, type, declared, sent);
        EXPECT_TRUE(lie.handshake) << type;
        EXPECT_TRUE(lie.cut) << type;
        EXPECT_LT(lie.accepted, 64ull << 20) << type;
    }
    const size_t rss1 = testing::RssBytes(worker->pid());
    EXPECT_LT(rss1, rss0 + (64u << 20)) << rss0 << " -> " << rss1;
    // It still serves, and still publishes.
    const Answer a = SendAll(worker->port(), {CompletionBody(RandomPrompt(40, 1), 2, false)})[0];
    EXPECT_EQ(a.status, 200) << a.body;
    EXPECT_TRUE(
        testing::WaitUntil([&] { return worker->Metric("ferry_kv_events_batches_total") >= 1; },
                           std::chrono::seconds(20)));

    // An address without '*' and without --kv-events-bind is dialed (vLLM's rule), and says so.
    auto dialing = StartOrDie(WorkerArgs(
        "colocated", "", 1, {"--kv-events-endpoint", fmt::format("tcp://127.0.0.1:{}", pub)}));
    ASSERT_TRUE(dialing);
    bool said = false;
    for (const std::string& line : dialing->startup_lines()) {
        said |= line.find("kv events connecting to tcp://127.0.0.1:") != std::string::npos;
    }
    EXPECT_TRUE(said);
}

// An encode worker whose every slot is leased to consumers that have not pulled yet answers 503
// (its capacity, as documented), not 429 (a client's rate), and says why.
TEST_F(Integrity, AnEncodeWorkerWithEverySlotLeasedAnswers503) {
    auto encode =
        StartOrDie(Args("encode", "tcp", {"--ec-connector", "transfer", "--ec-buffer-mib", "1"}));
    ASSERT_TRUE(encode);
    const double slots = encode->Metric("ferry_ec_slots");
    ASSERT_GT(slots, 8);
    int status = 0, sent_images = 0;
    std::string body;
    for (int r = 0; sent_images <= slots + 8; ++r) {
        Json content = Json::array();
        for (int j = 0; j < 8; ++j, ++sent_images) {
            content.push_back(
                {{"type", "image_url"},
                 {"image_url", {{"url", testing::RandomPngUrl(8, 8, 20000 + sent_images)}}}});
        }
        const Json b = {{"messages", {{{"role", "user"}, {"content", content}}}},
                        {"max_tokens", 1}};
        auto got = http::Fetch(Post(encode->port(), b, "/v1/chat/completions"));
        ASSERT_TRUE(got.ok());
        status = got->status;
        body = got->body;
        if (status != 200) break;
    }
    EXPECT_EQ(status, 503) << body;
    EXPECT_NE(body.find("leased"), std::string::npos) << body;
    EXPECT_EQ(encode->Metric("ferry_ec_save_refused_total"), 1);
}

// What a request with images keeps while it waits (its body, and the copies of its images'
// URLs) counts in the body budget, until nothing holds it any more: a request of ~2.4 MiB of
// images parked on an encode worker that never answers counts twice its image bytes, so with an
// 8 MiB budget a second one (whose body alone would fit) is refused (503 naming the budget);
// when the first one's client leaves, all of it is given back.
TEST_F(Integrity, ImageCopiesCountInTheBodyBudgetWhileTheyWait) {
    const std::string dir = (std::filesystem::temp_directory_path() /
                             fmt::format("ferry-integrity-budget-{}", getpid()))
                                .string();
    std::filesystem::create_directories(dir);
    testing::Blackhole hole("tcp");
    auto worker = StartOrDie(
        Args("colocated", "",
             {"--ec-connector", "disk", "--ec-dir", dir, "--encoder-urls", hole.address(),
              "--encoder-timeout-ms", "60000", "--max-inflight-body-mib", "8"}));
    ASSERT_TRUE(worker);
    const std::string large = testing::RandomPngUrl(800, 800, 77);  // ~2.4 MiB of base64
    const std::string body = ImagesBody(large, 1).dump();
    // Three bodies fit the budget, four do not: the second request's body is taken, its copy
    // is what passes the budget.
    ASSERT_LE(3 * body.size(), 8u << 20);
    ASSERT_GT(3 * body.size() + large.size(), 8u << 20);
    const int parked = SendAndLeave(worker->port(), "/v1/chat/completions", body);
    ASSERT_GE(parked, 0);
    const auto held = [&] { return worker->Metric("ferry_http_inflight_body_bytes"); };
    ASSERT_TRUE(testing::WaitUntil([&] { return held() >= double(body.size() + large.size()); },
                                   std::chrono::seconds(30)))
        << held();
    EXPECT_LE(held(), double(body.size() + large.size()));
    auto second = http::Fetch(Post(worker->port(), ImagesBody(large, 1), "/v1/chat/completions"));
    ASSERT_TRUE(second.ok());
    EXPECT_EQ(second->status, 503) << second->body;
    EXPECT_NE(second->body.find("--max-inflight-body-mib"), std::string::npos) << second->body;
    close(parked);  // its client leaves: the encoder call is cancelled, the request dropped
    EXPECT_TRUE(worker->WaitMetric("ferry_http_inflight_body_bytes", 0)) << held();
    EXPECT_EQ(worker->Metric("ferry_mm_images_total"), 0);
    EXPECT_EQ(SendAll(worker->port(), {CompletionBody(RandomPrompt(30, 4), 2, false)})[0].status,
              200);
    std::filesystem::remove_all(dir);
}

// IPv6 end to end: prefill and decode workers whose HTTP servers and agents listen on ::1, the
// decoder allowed to dial only the prefill worker's agent (--kv-peers [::1]:PORT), behind a proxy
// that names them as [::1]:PORT: every host and port goes through the one formatter, and the
// answers equal colocated (the decoder read the prompt's KV).
TEST_F(Integrity, PrefillAndDecodeOverIpv6EqualColocated) {
    auto colocated = StartOrDie(WorkerArgs("colocated", "", 1));
    auto prefill =
        StartOrDie(WorkerArgs("prefill", "tcp", 1, {"--host", "::1", "--agent-listen", "[::1]:0"}));
    if (!prefill) GTEST_SKIP() << "no IPv6 loopback here";
    ASSERT_TRUE(colocated);
    // "NAME at [::1]:PORT"
    const std::string agent = prefill->agent().substr(prefill->agent().find(" at ") + 4);
    ASSERT_EQ(agent.rfind("[::1]:", 0), 0u) << prefill->agent();
    auto decode = StartOrDie(WorkerArgs(
        "decode", "tcp", 1, {"--host", "::1", "--agent-listen", "[::1]:0", "--kv-peers", agent}));
    ASSERT_TRUE(decode);
    auto px =
        StartOrDie({"proxy", "--prefill", fmt::format("[::1]:{}", prefill->port()), "--decode",
                    fmt::format("[::1]:{}", decode->port()), "--port", "0", "--no-store"});
    ASSERT_TRUE(px);
    std::vector<Json> bodies;
    for (int i = 0; i < 6; ++i)
        bodies.push_back(CompletionBody(RandomPrompt(40 + 9 * i, 60 + i), 4, i % 2 == 1));
    ExpectSameTokens(SendAll(px->port(), bodies, 3), SendAll(colocated->port(), bodies, 3), "ipv6");
    EXPECT_GT(px->Metric(fmt::format(
                  "ferry_router_worker_requests_total{{role=\"prefill\",worker=\"[::1]:{}\","
                  "outcome=\"succeeded\"}}",
                  prefill->port())),
              0);
}

}  // namespace
}  // namespace ferry
