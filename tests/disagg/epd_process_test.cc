// EPD with real processes: `ferry serve --role encode` behind `ferry proxy --encode`, its
// embeddings reaching the prefill, decode or colocated workers through each encoder-cache
// connector (serve/ec_connector.h). The answers equal a colocated worker's token for token, and
// the consumers encode no image themselves (their metrics say so); a dead encode worker costs
// only the encoding; the internal field is honoured only from the router.
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "disagg/epd_harness.h"
#include "ferry/discovery.h"
#include "http/http.h"
#include "testing/images.h"
#include "testing/testing.h"
#include "testing/tiny_model.h"
#include "testing/worker_process.h"

namespace ferry {
namespace {

using namespace pd_test;   // NOLINT: the harness is this test's own vocabulary
using namespace epd_test;  // NOLINT
using Json = nlohmann::json;
using testing::ServerProcess;

struct EpdCase {
    std::string name;
    std::string connector;  // transfer | disk
    std::string backend;    // the agents' (transfer)
    // pull | push (E + P + D behind the proxy), epd (E + a colocated worker behind the proxy),
    // self (a colocated worker calling the encode worker itself: --encoder-urls, no proxy)
    std::string drive;
};

void PrintTo(const EpdCase& c, std::ostream* os) { *os << c.name; }

class EpdMatrix : public EpdProcess, public ::testing::WithParamInterface<EpdCase> {};

// The verification: multimodal prompts with 1 to 4 images, some repeated, through an
// encode worker: the same tokens as colocated, the consumers encode nothing themselves, the
// encode worker encodes each distinct image once, and no lease is left behind.
TEST_P(EpdMatrix, PromptsWithImagesThroughAnEncodeWorkerEqualColocated) {
    const EpdCase& c = GetParam();
    testing::SecretFile secret("epd-" + c.name);
    const std::string dir =
        (std::filesystem::temp_directory_path() / fmt::format("ferry-epd-{}-{}", c.name, getpid()))
            .string();
    std::filesystem::create_directories(dir);
    std::vector<std::string> ec = {"--ec-connector", c.connector, "--secret-file", secret.path()};
    if (c.connector == "disk") ec.insert(ec.end(), {"--ec-dir", dir});
    std::vector<std::string> producer = ec;
    producer.insert(producer.end(), {"--ec-lease-ms", "1500"});
    auto colocated = StartOrDie(Args("colocated", ""));
    auto encode = StartOrDie(Args("encode", c.backend, producer));
    ASSERT_TRUE(colocated && encode);
    std::vector<std::unique_ptr<ServerProcess>> consumers;
    std::vector<std::string> proxy = {"proxy", "--encode",   Addr(*encode),   "--port",
                                      "0",     "--no-store", "--secret-file", secret.path()};
    if (c.drive == "epd" || c.drive == "self") {
        std::vector<std::string> e = ec;
        if (c.connector == "transfer") e.insert(e.end(), {"--kv-backend", c.backend});
        if (c.drive == "self") e.insert(e.end(), {"--encoder-urls", Addr(*encode)});
        consumers.push_back(StartOrDie(Args("colocated", "", e)));
        ASSERT_TRUE(consumers[0]);
        proxy.insert(proxy.end(), {"--decode", Addr(*consumers[0])});
    } else {
        std::vector<std::string> p = ec, d = ec;
        d.insert(d.end(), {"--kv-verify", "all"});
        consumers.push_back(StartOrDie(Args("prefill", c.backend, p)));
        consumers.push_back(StartOrDie(Args("decode", c.backend, d)));
        ASSERT_TRUE(consumers[0] && consumers[1]);
        proxy.insert(proxy.end(), {"--prefill", Addr(*consumers[0]), "--decode",
                                   Addr(*consumers[1]), "--kv-transfer", c.drive});
    }
    std::unique_ptr<ServerProcess> px;
    if (c.drive != "self") {
        px = StartOrDie(proxy);
        ASSERT_TRUE(px);
    }
    const int n = testing::kSanitized ? 8 : 50;
    const std::vector<Json> bodies = Bodies(n, 300);
    const int entry = c.drive == "self" ? consumers[0]->port() : px->port();
    ExpectSameTokens(SendAll(entry, bodies, 8), SendAll(colocated->port(), bodies, 8), c.name);
    if (px) {
        EXPECT_EQ(px->Metric("ferry_proxy_encoded_total"), n);
        EXPECT_EQ(px->Metric("ferry_proxy_encode_failed_total"), 0);
    } else {
        EXPECT_EQ(consumers[0]->Metric("ferry_ec_encoder_calls_total"), n);
        EXPECT_EQ(consumers[0]->Metric("ferry_ec_encoder_call_failures_total"), 0);
    }
    // The encode worker encoded each distinct image once (7 in the pool, all used), the
    // consumers none: they loaded every image they did not already hold.
    EXPECT_EQ(encode->Metric("ferry_mm_images_encoded_total"), 7);
    EXPECT_GE(encode->Metric("ferry_ec_saved_total"), n);
    for (const auto& w : consumers) {
        EXPECT_EQ(w->Metric("ferry_mm_images_encoded_total"), 0);
        EXPECT_EQ(w->Metric("ferry_ec_local_encodes_total"), 0);
        EXPECT_EQ(w->Metric("ferry_ec_load_failures_total"), 0);
        EXPECT_GE(w->Metric("ferry_ec_loads_total"), 1);
        EXPECT_LE(w->Metric("ferry_ec_loads_total"), 7);  // repeated images: the local cache
        EXPECT_GT(w->Metric("ferry_encoder_cache_hits_total{tier=\"memory\"}"), 0);
        if (c.connector == "transfer") {
            // Each image it held already: the encode worker's lease ended without a pull.
            EXPECT_EQ(w->Metric("ferry_ec_released_unpulled_total"),
                      w->Metric("ferry_encoder_cache_hits_total{tier=\"memory\"}"));
        }
    }
    if (c.connector == "transfer") {
        // Every lease ends: released by a consumer's pull or lapsed (1.5 s).
        EXPECT_TRUE(encode->WaitMetric("ferry_ec_leased", 0));
        EXPECT_GT(encode->Metric("ferry_ec_leases_released_total"), 0);
        EXPECT_EQ(encode->Metric("ferry_ec_entries"), 7);
        // The encode worker's answers named the images (ec_transfer_params' mm_hashes) and
        // the consumers renewed their leases as their requests arrived (those already connected
        // to it: all but the first few, which came together, 8 at a time).
        if (!testing::kSanitized) {
            double sent = 0;
            for (const auto& w : consumers) sent += w->Metric("ferry_ec_lease_renewals_sent_total");
            EXPECT_GE(sent, n / 2);
            EXPECT_GT(encode->Metric("ferry_ec_leases_renewed_total"), 0);
        }
    } else {
        size_t files = 0;
        for (const auto& e : std::filesystem::directory_iterator(dir)) {
            EXPECT_TRUE(std::filesystem::exists(e.path() / "encoder_cache.safetensors"));
            ++files;
        }
        EXPECT_EQ(files, 7u);
    }
    if (consumers.size() == 2) {
        EXPECT_LE(consumers[1]->Metric("ferry_prompt_tokens_total"), double(n));
        EXPECT_EQ(consumers[1]->Metric("ferry_kv_connector_verify_mismatches_total"), 0);
    }
    std::filesystem::remove_all(dir);
}

std::vector<EpdCase> Cases() {
    std::vector<EpdCase> v = {{"transfer_shm_pull", "transfer", "shm", "pull"},
                              {"transfer_tcp_epd", "transfer", "tcp", "epd"},
                              {"disk_push", "disk", "shm", "push"},
                              {"transfer_shm_self", "transfer", "shm", "self"},
                              {"disk_self", "disk", "", "self"}};
    return v;
}

INSTANTIATE_TEST_SUITE_P(Connectors, EpdMatrix, ::testing::ValuesIn(Cases()),
                         [](const auto& i) { return i.param.name; });

// The encode worker SIGKILLed: requests still complete with the colocated answer (the consumer
// encodes), whether the proxy finds it gone or a request names it after it died; with
// --ec-load-failure fail such a request is refused (503) rather than encoded.
// Encode workers are found in the discovery store as prefill and decode workers are: `ferry
// proxy --store` without --encode sends each request with images to the one registered, and
// follows it out when it drains (its requests then encode on the workers, same answers).
TEST_F(EpdProcess, EncodeWorkersAreFoundInTheStoreAndFollowedOut) {
    auto store = testing::ValueOrDie(StoreServer::Start({}), "store");
    const std::string url = store->url();
    const std::vector<std::string> ec = {"--store", url, "--ec-connector", "transfer"};
    auto colocated = StartOrDie(Args("colocated", ""));
    auto encode = StartOrDie(Args("encode", "shm", ec));
    auto prefill = StartOrDie(Args("prefill", "shm", ec));
    auto decode = StartOrDie(Args("decode", "shm", ec));
    ASSERT_TRUE(colocated && encode && prefill && decode);
    auto px = StartOrDie({"proxy", "--port", "0", "--store", url, "--load-poll-ms", "100"});
    ASSERT_TRUE(px);
    ASSERT_TRUE(px->WaitMetric("ferry_router_membership_encoders", 1));
    ASSERT_TRUE(testing::WaitUntil(
        [&] {
            auto h = http::Fetch(
                http::GetRequest("127.0.0.1", px->port(), "/health", std::chrono::seconds(5)));
            if (!h.ok()) return false;
            Json j = Json::parse(h->body, nullptr, false);
            return j.is_object() && j["prefill_instances"] == 1 && j["decode_instances"] == 1;
        },
        std::chrono::seconds(20)));
    const int n = testing::kSanitized ? 6 : 12;
    const std::vector<Json> bodies = Bodies(n, 500);
    ExpectSameTokens(SendAll(px->port(), bodies, 4), SendAll(colocated->port(), bodies, 4),
                     "store");
    EXPECT_EQ(px->Metric("ferry_proxy_encoded_total"), n);
    EXPECT_EQ(prefill->Metric("ferry_mm_images_encoded_total"), 0);
    EXPECT_EQ(decode->Metric("ferry_mm_images_encoded_total"), 0);
    EXPECT_GT(prefill->Metric("ferry_ec_loads_total"), 0);

    // Drained: its record goes, the proxy stops sending to it, the workers encode.
    encode->Signal(SIGTERM);
    ASSERT_TRUE(px->WaitMetric("ferry_router_membership_encoders", 0));
    const std::vector<Json> more = Bodies(4, 600);
    ExpectSameTokens(SendAll(px->port(), more, 4), SendAll(colocated->port(), more, 4),
                     "after the encode worker left");
    EXPECT_EQ(px->Metric("ferry_proxy_encoded_total"), n);
    EXPECT_EQ(px->Metric("ferry_proxy_encode_failed_total"), 0);
    EXPECT_GT(prefill->Metric("ferry_mm_images_encoded_total"), 0);
}

// With two encode workers, one SIGKILLed: a request whose images it was to take (the first
// body's owner, found by sending it once) is encoded by the other (the proxy's retry), none is
// left to the consumers, and every answer equals colocated.
TEST_F(EpdProcess, AKilledEncodeWorkersImagesAreEncodedByAnother) {
    testing::SecretFile secret("epd-retry");
    const std::vector<std::string> ec = {"--ec-connector", "transfer", "--secret-file",
                                         secret.path()};
    auto colocated = StartOrDie(Args("colocated", ""));
    auto e1 = StartOrDie(Args("encode", "tcp", ec));
    auto e2 = StartOrDie(Args("encode", "tcp", ec));
    auto consumer = StartOrDie(Args("colocated", "", ec));
    ASSERT_TRUE(colocated && e1 && e2 && consumer);
    auto px =
        StartOrDie({"proxy", "--encode", Addr(*e1), "--encode", Addr(*e2), "--decode",
                    Addr(*consumer), "--port", "0", "--no-store", "--secret-file", secret.path()});
    ASSERT_TRUE(px);
    const std::vector<Json> bodies = Bodies(testing::kSanitized ? 4 : 8, 300);
    const std::vector<Answer> want = SendAll(colocated->port(), bodies, 4);
    ExpectSameTokens(SendAll(px->port(), {bodies[0]}, 1), {want[0]}, "before");
    ServerProcess* owner = e1->Metric("ferry_mm_images_encoded_total") > 0 ? e1.get() : e2.get();
    ASSERT_GT(owner->Metric("ferry_mm_images_encoded_total"), 0);
    owner->Kill();  // SIGKILL
    ExpectSameTokens(SendAll(px->port(), bodies, 1), want, "one encode worker killed");
    EXPECT_EQ(px->Metric("ferry_proxy_encoded_total"), double(bodies.size() + 1));
    EXPECT_EQ(px->Metric("ferry_proxy_encode_failed_total"), 0);
    EXPECT_GE(px->Metric("ferry_proxy_encode_retried_total"), 1);
    EXPECT_EQ(px->Metric("ferry_proxy_encoders_quarantined"), 1);
    EXPECT_EQ(consumer->Metric("ferry_mm_images_encoded_total"), 0);
}

// An encode worker SIGKILLed costs only the encoding; restarted on its port it is a new epoch:
// taken back, its entries loaded, the old process's params never resolving to it.
TEST_F(EpdProcess, AKilledEncodeWorkerCostsOnlyTheEncoding) {
    testing::SecretFile secret("epd-kill");
    const std::vector<std::string> ec = {
        "--ec-connector",           "transfer", "--secret-file", secret.path(),
        "--ec-transfer-timeout-ms", "2000"};
    auto colocated = StartOrDie(Args("colocated", ""));
    auto encode = StartOrDie(Args("encode", "tcp", ec));
    auto consumer = StartOrDie(Args("colocated", "", ec));
    std::vector<std::string> strict_args = ec;
    strict_args.insert(strict_args.end(), {"--ec-load-failure", "fail"});
    auto strict = StartOrDie(Args("colocated", "", strict_args));
    ASSERT_TRUE(colocated && encode && consumer && strict);
    auto px = StartOrDie({"proxy", "--encode", Addr(*encode), "--decode", Addr(*consumer), "--port",
                          "0", "--no-store", "--secret-file", secret.path()});
    ASSERT_TRUE(px);
    const std::vector<Json> bodies = Bodies(testing::kSanitized ? 4 : 12, 700);
    const std::vector<Answer> want = SendAll(colocated->port(), bodies, 4);
    const size_t half = bodies.size() / 2;
    // Where the encode worker said the embeddings wait (its agent), for the requests below.
    Json first = bodies[0];
    first["stream"] = false;
    first["max_tokens"] = 1;
    http::ClientRequest er = Post(encode->port(), first, "/v1/chat/completions");
    er.headers.push_back({"Authorization", "Bearer " + secret.router_token()});
    auto e = http::Fetch(er);
    ASSERT_TRUE(e.ok() && e->status == 200) << (e.ok() ? e->body : e.status().ToString());
    const Json params = Json::parse(e->body)["ec_transfer_params"];
    ASSERT_TRUE(params.is_object()) << e->body;

    std::vector<Json> before(bodies.begin(), bodies.begin() + long(half));
    std::vector<Json> after(bodies.begin() + long(half), bodies.end());
    ExpectSameTokens(SendAll(px->port(), before, 4),
                     std::vector<Answer>(want.begin(), want.begin() + long(half)), "before");
    encode->Kill();  // SIGKILL
    ExpectSameTokens(SendAll(px->port(), after, 4),
                     std::vector<Answer>(want.begin() + long(half), want.end()), "after");
    // The first request to find it dead puts it in quarantine; the rest skip the encode step.
    EXPECT_GE(px->Metric("ferry_proxy_encode_failed_total"), 1);
    EXPECT_EQ(px->Metric("ferry_proxy_encoders_quarantined"), 1);
    // A request that names the dead agent: the consumer fails to pull and encodes (a fresh image,
    // so no cache holds it); the strict one refuses.
    Json named = Bodies(1, 900)[0];
    named["stream"] = false;
    named["ec_transfer_params"] = params;
    for (ServerProcess* w : {consumer.get(), strict.get()}) {
        http::ClientRequest r = Post(w->port(), named, "/v1/chat/completions");
        r.headers.push_back({"Authorization", "Bearer " + secret.router_token()});
        auto got = http::Fetch(r);
        ASSERT_TRUE(got.ok());
        if (w == consumer.get()) {
            EXPECT_EQ(got->status, 200) << got->body;
            Json plain = named;
            plain.erase("ec_transfer_params");
            EXPECT_EQ(TokensOf(got->body, false), SendAll(colocated->port(), {plain})[0].tokens);
            EXPECT_EQ(w->Metric("ferry_ec_local_encodes_total"), 1);
            EXPECT_EQ(w->Metric("ferry_ec_load_failures_total"), 1);
        } else {
            EXPECT_EQ(got->status, 503) << got->body;
            EXPECT_NE(got->body.find("ec_load_failed"), std::string::npos) << got->body;
        }
    }
    // Both still serve.
    EXPECT_EQ(SendAll(strict->port(), {bodies[0]})[0].tokens, want[0].tokens);

    // Restarted on its port: a new process with a new agent (a new epoch). The proxy takes it
    // back once it answers; what it publishes now is loaded; the dead process's params still
    // name nobody (the new one did not inherit its agent), so they cost a pull and an encoding.
    ASSERT_TRUE(encode->Restart().ok());
    const Json probe = Bodies(1, 940)[0];
    ASSERT_TRUE(testing::WaitUntil([&] {
        // The proxy probes a quarantined worker as requests come (no timer of its own).
        EXPECT_EQ(SendAll(px->port(), {probe}, 1)[0].status, 200);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        return px->Metric("ferry_proxy_encoders_quarantined") == 0;
    }));
    const double loads = consumer->Metric("ferry_ec_loads_total");
    const double local = consumer->Metric("ferry_ec_local_encodes_total");
    const std::vector<Json> fresh = Bodies(testing::kSanitized ? 2 : 6, 950);
    ExpectSameTokens(SendAll(px->port(), fresh, 4), SendAll(colocated->port(), fresh, 4),
                     "restarted");
    EXPECT_GT(consumer->Metric("ferry_ec_loads_total"), loads);
    EXPECT_EQ(consumer->Metric("ferry_ec_local_encodes_total"), local);
    Json stale = Bodies(1, 990)[0];
    stale["stream"] = false;
    stale["ec_transfer_params"] = params;
    http::ClientRequest r = Post(consumer->port(), stale, "/v1/chat/completions");
    r.headers.push_back({"Authorization", "Bearer " + secret.router_token()});
    auto got = http::Fetch(r);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->status, 200) << got->body;
    EXPECT_EQ(consumer->Metric("ferry_ec_local_encodes_total"), local + 1);
    EXPECT_EQ(consumer->Metric("ferry_ec_load_failures_total"), 2);
}

// ec_transfer_params is the router's to set: the proxy refuses it from a client, a worker with a
// secret honours it only with the router token, a malformed one is named; the encode role
// refuses what it cannot encode.
TEST_F(EpdProcess, EcTransferParamsAreTheRoutersAndTheEncodeRoleTakesImagesOnly) {
    testing::SecretFile secret("epd-trust");
    const std::vector<std::string> ec = {"--ec-connector", "transfer", "--secret-file",
                                         secret.path()};
    auto encode = StartOrDie(Args("encode", "tcp", ec));
    auto consumer = StartOrDie(Args("colocated", "", ec));
    ASSERT_TRUE(encode && consumer);
    auto px = StartOrDie({"proxy", "--encode", Addr(*encode), "--decode", Addr(*consumer), "--port",
                          "0", "--no-store", "--secret-file", secret.path()});
    ASSERT_TRUE(px);
    Json body = Bodies(1, 50)[0];
    body["stream"] = false;
    auto ok_body = [&] {
        Json b = Bodies(1, 80)[0];
        b["stream"] = false;
        return b;
    };
    body["ec_transfer_params"] = {{"engine_id", "x"}, {"host", "127.0.0.1"}, {"port", 1}};
    auto status_of = [&](int port, const Json& b, bool token, std::string* out = nullptr) {
        http::ClientRequest r = Post(port, b, "/v1/chat/completions");
        if (token) r.headers.push_back({"Authorization", "Bearer " + secret.router_token()});
        auto got = http::Fetch(r);
        if (!got.ok()) return -1;
        if (out) *out = got->body;
        return got->status;
    };
    std::string text;
    EXPECT_EQ(status_of(px->port(), body, false, &text), 400);
    EXPECT_NE(text.find("ec_transfer_params are the proxy's"), std::string::npos) << text;
    EXPECT_EQ(status_of(consumer->port(), body, false, &text), 401) << text;
    Json bad = body;
    bad["ec_transfer_params"]["port"] = "1";
    EXPECT_EQ(status_of(consumer->port(), bad, true, &text), 400);
    EXPECT_NE(text.find("field 'ec_transfer_params.port' must be an integer"), std::string::npos)
        << text;
    bad["ec_transfer_params"] = "somewhere";
    EXPECT_EQ(status_of(consumer->port(), bad, true, &text), 400);
    EXPECT_NE(text.find("'ec_transfer_params' must be an object"), std::string::npos) << text;
    // With a secret the encode role serves the router alone (a request there leases a slot).
    EXPECT_EQ(status_of(encode->port(), ok_body(), false, &text), 401) << text;
    // The encode role: text only and completions are refused by name.
    Json text_only = {{"messages", {{{"role", "user"}, {"content", "hello"}}}}, {"max_tokens", 1}};
    EXPECT_EQ(status_of(encode->port(), text_only, true, &text), 400);
    EXPECT_NE(text.find("encode role"), std::string::npos) << text;
    // The proxy relays a bad image's 400 from the encode worker, naming the part.
    Json broken = Bodies(1, 60)[0];
    broken["messages"][0]["content"][1]["image_url"]["url"] = "data:image/png;base64,iVBORw0KGgo=";
    EXPECT_EQ(status_of(px->port(), broken, false, &text), 400);
    EXPECT_NE(text.find("messages[0].content[1]"), std::string::npos) << text;
    // And everything still serves.
    Json ok = Bodies(1, 70)[0];
    ok["stream"] = false;
    EXPECT_EQ(status_of(px->port(), ok, false, &text), 200) << text;
    EXPECT_EQ(px->Metric("ferry_proxy_encoded_total"), 1);
}

// vLLM's EPD example as its commands write it (disagg_1e1pd_example.sh: an encode worker and a
// PD worker sharing ECSharedStorageConnector's directory), with `ferry serve`, the model file and
// ferry's --mmproj for the vision encoder a GGUF file does not hold. Driven as vLLM's
// disagg_epd_proxy.py drives it: the request to the encode worker with max_tokens 1, then the
// original request, no ec_transfer_params, to the PD worker, which finds every image's embeddings
// by its hash and encodes none; the answers equal a colocated worker's.
TEST_F(EpdProcess, VllmsEpdCommandLinesRunAsWrittenAndTheConsumerNeedsNoParams) {
    const std::string dir =
        (std::filesystem::temp_directory_path() / fmt::format("ferry-epd-vllm-{}", getpid()))
            .string();
    std::filesystem::create_directories(dir);
    auto ec_config = [&](const char* role) {
        return Json{{"ec_connector", "ECSharedStorageConnector"},
                    {"ec_role", role},
                    {"ec_connector_extra_config", {{"shared_storage_path", dir}}}}
            .dump();
    };
    auto encode = StartOrDie(
        {"serve", model_->path(), "--mmproj", *mmproj_, "--gpu-memory-utilization", "0.0", "--port",
         "0", "--enable-request-id-headers", "--no-enable-prefix-caching", "--max-num-seqs", "128",
         "--max-num-batched-tokens", "4096", "--ec-transfer-config", ec_config("ec_producer")});
    auto pd = StartOrDie({"serve", model_->path(), "--mmproj", *mmproj_, "--gpu-memory-utilization",
                          "0.7", "--port", "0", "--enable-request-id-headers", "--max-num-seqs",
                          "128", "--ec-transfer-config", ec_config("ec_consumer")});
    auto colocated = StartOrDie(Args("colocated", ""));
    ASSERT_TRUE(encode && pd && colocated);
    std::vector<Json> bodies = Bodies(6, 1300);
    for (const Json& b : bodies) {
        Json first = b;
        first["max_tokens"] = 1;
        first["stream"] = false;
        auto got = http::Fetch(Post(encode->port(), first, "/v1/chat/completions"));
        ASSERT_TRUE(got.ok() && got->status == 200) << (got.ok() ? got->body : "");
    }
    ExpectSameTokens(SendAll(pd->port(), bodies, 2), SendAll(colocated->port(), bodies, 2),
                     "vllm-epd");
    EXPECT_GE(pd->Metric("ferry_ec_loads_total"), 1);
    EXPECT_EQ(pd->Metric("ferry_ec_local_encodes_total"), 0) << "every image came from the disk";
    std::filesystem::remove_all(dir);
}

// vLLM's disagg_epd_proxy.py with the transfer connector: the encode worker gets the original
// request (max_tokens 1), then the prefill-decode worker (1E1PD), or the prefill worker with
// vLLM's NIXL P/D params and the decode worker with the prefill's answer's (1E1P1D), the original
// request with no ec_transfer_params. The consumers find each image's embeddings by its hash at
// the encode worker the store lists, one round trip each, and encode none; the answers equal a
// colocated worker's.
TEST_F(EpdProcess, VllmsEpdProxyFlowFindsEmbeddingsByHashWithTheTransferConnector) {
    auto store = testing::ValueOrDie(StoreServer::Start({}), "store");
    const std::string url = store->url();
    const std::vector<std::string> ec = {"--store", url, "--ec-connector", "transfer"};
    auto colocated = StartOrDie(Args("colocated", ""));
    auto encode = StartOrDie(Args("encode", "shm", ec));
    ASSERT_TRUE(colocated && encode);
    // The encode worker's record is in the store before its consumers start.
    auto md = testing::ValueOrDie(MetadataStore::Open(url), "open");
    ASSERT_TRUE(testing::WaitUntil([&] { return md->Get("ferry/workers/" + Addr(*encode)).ok(); },
                                   std::chrono::seconds(10)));
    std::vector<std::string> pd_args = ec, d_args = ec;
    pd_args.insert(pd_args.end(), {"--kv-backend", "shm"});
    d_args.insert(d_args.end(), {"--kv-verify", "all"});
    auto pd = StartOrDie(Args("colocated", "", pd_args));
    auto prefill = StartOrDie(Args("prefill", "shm", ec));
    auto decode = StartOrDie(Args("decode", "shm", d_args));
    ASSERT_TRUE(pd && prefill && decode);
    auto encode_first = [&](const std::vector<Json>& bodies) {
        for (const Json& b : bodies) {
            Json first = b;  // the proxy's encode request: the original, one token
            first["max_tokens"] = 1;
            first["stream"] = false;
            auto got = http::Fetch(Post(encode->port(), first, "/v1/chat/completions"));
            ASSERT_TRUE(got.ok() && got->status == 200) << (got.ok() ? got->body : "");
        }
    };

    // 1E1PD.
    const int n = testing::kSanitized ? 4 : 8;
    std::vector<Json> bodies = Bodies(n, 1700);
    encode_first(bodies);
    ExpectSameTokens(SendAll(pd->port(), bodies, 2), SendAll(colocated->port(), bodies, 2),
                     "1E1PD");
    EXPECT_GE(pd->Metric("ferry_ec_loads_by_hash_total"), 1);
    EXPECT_EQ(pd->Metric("ferry_ec_loads_by_hash_total"), pd->Metric("ferry_ec_loads_total"));
    EXPECT_EQ(pd->Metric("ferry_ec_local_encodes_total"), 0);
    EXPECT_EQ(pd->Metric("ferry_mm_images_encoded_total"), 0);

    // 1E1P1D: vLLM's proxy asks the prefill worker for the KV (do_remote_decode, max_tokens 1)
    // and hands its kv_transfer_params to the decode worker with the original request.
    bodies = Bodies(n, 1800);
    encode_first(bodies);
    std::vector<Json> decode_bodies;
    for (const Json& b : bodies) {
        Json p = b;
        p["max_tokens"] = 1;
        p["stream"] = false;
        p["kv_transfer_params"] = {{"do_remote_decode", true},    {"do_remote_prefill", false},
                                   {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                                   {"remote_host", nullptr},      {"remote_port", nullptr}};
        auto got = http::Fetch(Post(prefill->port(), p, "/v1/chat/completions"));
        ASSERT_TRUE(got.ok() && got->status == 200) << (got.ok() ? got->body : "");
        Json d = b;
        d["kv_transfer_params"] = Json::parse(got->body)["kv_transfer_params"];
        decode_bodies.push_back(std::move(d));
    }
    ExpectSameTokens(SendAll(decode->port(), decode_bodies, 2),
                     SendAll(colocated->port(), bodies, 2), "1E1P1D");
    for (ServerProcess* w : {prefill.get(), decode.get()}) {
        EXPECT_EQ(w->Metric("ferry_mm_images_encoded_total"), 0);
        EXPECT_EQ(w->Metric("ferry_ec_local_encodes_total"), 0);
        EXPECT_EQ(w->Metric("ferry_ec_load_failures_total"), 0);
    }
    EXPECT_GE(prefill->Metric("ferry_ec_loads_by_hash_total"), 1);
    // The decoder computed no prompt token: the KV came from the prefill worker.
    EXPECT_LE(decode->Metric("ferry_prompt_tokens_total"), double(n));
    EXPECT_EQ(decode->Metric("ferry_kv_connector_verify_mismatches_total"), 0);
    // Every lease ends, pulled or lapsed; the encode worker encoded each distinct image once.
    EXPECT_EQ(encode->Metric("ferry_mm_images_encoded_total"), 7 * 2);
}

// The disk connector's files are input like any other: a flipped byte or a truncated file is
// refused (its checksum, its size), the image encoded here with the colocated answer, or the
// request refused with --ec-load-failure fail; nothing crashes.
TEST_F(EpdProcess, ACorruptFileInTheSharedDirectoryIsEncodedHereNotUsed) {
    const std::string dir =
        (std::filesystem::temp_directory_path() / fmt::format("ferry-epd-corrupt-{}", getpid()))
            .string();
    std::filesystem::create_directories(dir);
    const std::vector<std::string> ec = {"--ec-connector", "disk", "--ec-dir", dir};
    auto colocated = StartOrDie(Args("colocated", ""));
    auto encode = StartOrDie(Args("encode", "", ec));
    ASSERT_TRUE(colocated && encode);
    std::vector<Json> bodies = Bodies(2, 1100);  // one image, then two
    for (Json& b : bodies) b["stream"] = false;
    for (const Json& b : bodies) {
        auto got = http::Fetch(Post(encode->port(), b, "/v1/chat/completions"));
        ASSERT_TRUE(got.ok() && got->status == 200) << (got.ok() ? got->body : "");
    }
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
        files.push_back(e.path() / "encoder_cache.safetensors");
    }
    ASSERT_EQ(files.size(), 3u);  // three distinct images
    {
        std::fstream f(files[0], std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(-5, std::ios::end);
        f.put('\x7f');  // a flipped payload byte: the checksum refuses it
    }
    std::filesystem::resize_file(files[1], std::filesystem::file_size(files[1]) - 12);
    auto consumer = StartOrDie(Args("colocated", "", ec));
    std::vector<std::string> strict_args = ec;
    strict_args.insert(strict_args.end(), {"--ec-load-failure", "fail"});
    auto strict = StartOrDie(Args("colocated", "", strict_args));
    ASSERT_TRUE(consumer && strict);
    ExpectSameTokens(SendAll(consumer->port(), bodies, 1), SendAll(colocated->port(), bodies, 1),
                     "corrupt");
    EXPECT_EQ(consumer->Metric("ferry_ec_load_failures_total"), 2);
    EXPECT_EQ(consumer->Metric("ferry_ec_local_encodes_total"), 2);
    EXPECT_EQ(consumer->Metric("ferry_ec_loads_total"), 1);  // the third file is whole
    // Each body has a corrupt image or two: the strict worker refuses at least one of them
    // (a body whose image is whole is served).
    auto refused = http::Fetch(Post(strict->port(), bodies[0], "/v1/chat/completions"));
    ASSERT_TRUE(refused.ok());
    if (refused->status == 200) {
        refused = http::Fetch(Post(strict->port(), bodies[1], "/v1/chat/completions"));
        ASSERT_TRUE(refused.ok());
    }
    EXPECT_EQ(refused->status, 503) << refused->body;
    EXPECT_NE(refused->body.find("ec_load_failed"), std::string::npos) << refused->body;
    EXPECT_TRUE(refused->body.find("checksum") != std::string::npos ||
                refused->body.find("size") != std::string::npos)
        << refused->body;
    std::filesystem::remove_all(dir);
}

// Without a secret, a store or --kv-peers, the agent that ec_transfer_params names may be
// anyone's: what it sends serves that request alone, never the encoder cache or the prefix
// cache (a client naming its own agent cannot plant embeddings under an image's hash).
TEST_F(EpdProcess, EmbeddingsFromOutsideTheDeploymentAreNeverCached) {
    const std::vector<std::string> ec = {"--ec-connector", "transfer"};
    auto colocated = StartOrDie(Args("colocated", ""));
    auto encode = StartOrDie(Args("encode", "tcp", ec));
    auto consumer = StartOrDie(Args("colocated", "", ec));
    ASSERT_TRUE(colocated && encode && consumer);
    auto px = StartOrDie({"proxy", "--encode", Addr(*encode), "--decode", Addr(*consumer), "--port",
                          "0", "--no-store"});
    ASSERT_TRUE(px);
    Json b = Bodies(1, 1300)[0];
    b["stream"] = false;
    const std::vector<Json> twice = {b, b};
    ExpectSameTokens(SendAll(px->port(), twice, 1), SendAll(colocated->port(), twice, 1), "twice");
    EXPECT_EQ(consumer->Metric("ferry_ec_loads_total"), 2);  // pulled again: nothing kept
    EXPECT_EQ(consumer->Metric("ferry_encoder_cache_entries{tier=\"memory\"}"), 0);
    EXPECT_EQ(consumer->Metric("ferry_prefix_cache_hits_total"), 0);
    EXPECT_EQ(consumer->Metric("ferry_mm_images_encoded_total"), 0);
}

}  // namespace
}  // namespace ferry
