// `ferry serve`'s flags: defaults that are the configs' own, argv that parses back to the same
// flags, and flags that need one another refused by name.
#include "serve/serve_flags.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "testing/testing.h"
#include "testing/tiny_model.h"

namespace ferry::serve {
namespace {

using ::ferry::testing::StatusHas;

const testing::TinyModelFile& Model() {
    static const auto* m = new testing::TinyModelFile("serve-flags", testing::TinyModelSpec(), 5);
    return *m;
}

// Parses `args` (what follows `ferry serve`) as the command does.
Result<ServeFlags> Parse(const std::vector<std::string>& args) {
    CLI::App app("serve");
    ServeFlags flags;
    AddServeFlags(app, flags);
    std::vector<std::string> reversed(args.rbegin(), args.rend());
    try {
        app.parse(reversed);
    } catch (const CLI::ParseError& e) {
        return InvalidArgumentError(e.what());
    }
    return flags;
}

TEST(ServeFlags, TheDefaultsAreTheConfigsOwn) {
    ServeFlags flags;
    flags.model = Model().path();
    auto got = ToWorkerConfig(flags);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    const WorkerConfig want;
    const ServerConfig& s = got->server;
    EXPECT_EQ(s.host, want.server.host);
    EXPECT_EQ(s.port, want.server.port);
    EXPECT_EQ(s.max_connections, want.server.max_connections);
    EXPECT_EQ(s.max_inflight_body_bytes, want.server.max_inflight_body_bytes);
    EXPECT_EQ(s.request_deadline, want.server.request_deadline);
    EXPECT_EQ(s.media.limits.max_encoded_bytes, want.server.media.limits.max_encoded_bytes);
    EXPECT_EQ(s.media.limits.max_pixels, want.server.media.limits.max_pixels);
    EXPECT_EQ(s.media.limits.max_images, want.server.media.limits.max_images);
    EXPECT_EQ(s.encoder_cache_bytes, want.server.encoder_cache_bytes);
    EXPECT_EQ(s.encoder_cache_disk_bytes, want.server.encoder_cache_disk_bytes);
    EXPECT_EQ(s.max_pending_image_requests, want.server.max_pending_image_requests);
    EXPECT_EQ(s.encoder_timeout, want.server.encoder_timeout);
    EXPECT_EQ(s.remote_prefill_timeout, want.server.remote_prefill_timeout);
    EXPECT_EQ(s.agent_timeout, want.server.agent_timeout);
    EXPECT_EQ(s.remote_prefill_min_tokens, want.server.remote_prefill_min_tokens);
    const engine::EngineConfig& e = got->engine;
    EXPECT_EQ(e.block_tokens, want.engine.block_tokens);
    EXPECT_EQ(e.num_blocks, want.engine.num_blocks);
    EXPECT_EQ(e.kv_cache_bytes, 512ull << 20);  // the command's own default
    EXPECT_EQ(e.kv_dtype, want.engine.kv_dtype);
    EXPECT_EQ(e.max_num_seqs, want.engine.max_num_seqs);
    EXPECT_EQ(e.max_batched_tokens, want.engine.max_batched_tokens);
    EXPECT_EQ(e.max_prefill_chunk, want.engine.max_prefill_chunk);
    EXPECT_EQ(e.chunked_prefill, want.engine.chunked_prefill);
    EXPECT_EQ(e.prefix_caching, want.engine.prefix_caching);
    EXPECT_EQ(e.max_model_len, want.engine.max_model_len);
    EXPECT_EQ(got->role, WorkerRole::kColocated);
    EXPECT_EQ(got->kv_connector, want.kv_connector);
    EXPECT_EQ(got->kv_events.replays_per_second, want.kv_events.replays_per_second);
    EXPECT_EQ(got->kv_events.layout, want.kv_events.layout);
    EXPECT_EQ(got->ec.buffer_bytes, want.ec.buffer_bytes);
    EXPECT_EQ(got->ec.lease, want.ec.lease);
    EXPECT_EQ(got->ec.pull_timeout, want.ec.pull_timeout);
    EXPECT_EQ(got->registration_ttl, want.registration_ttl);
    EXPECT_TRUE(got->agent.secret.empty());
    ASSERT_NE(got->model, nullptr);

    // A prefill worker gets the agent and the connector's settings, also the configs' own.
    flags.role = "prefill";
    got = ToWorkerConfig(flags);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->kv_connector_options, kv::AgentConnectorOptionsJson({}))
        << "the built-in kind's own defaults";
    EXPECT_EQ(got->agent.listen_host, "127.0.0.1");
    EXPECT_FALSE(got->agent.backends.empty());
    EXPECT_TRUE(got->allowed_agents.empty());
}

// The KV connector's options: the built-in kind's flags, --kv-connector-config over them, and
// --kv-peers as the worker's trust (no option sets it).
TEST(ServeFlags, TheKvConnectorsOptionsComeFromItsFlagsAndItsJson) {
    ServeFlags flags;
    flags.model = Model().path();
    flags.role = "decode";
    flags.kv_transfer = "push";
    flags.kv_hold_lease_ms = 2000;
    flags.kv_verify = "all";
    flags.kv_peers = {"127.0.0.1:7000", "[::1]:7001"};
    flags.kv_connector_config = R"({"hold_lease_ms": 3000, "liveness_interval_ms": 250})";
    Result<WorkerConfig> got = ToWorkerConfig(flags);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    kv::AgentConnectorOptions o =
        testing::ValueOrDie(kv::ParseAgentConnectorOptions(got->kv_connector_options));
    EXPECT_EQ(o.default_mode, kv::KvTransferMode::kPush);
    EXPECT_EQ(o.verify, kv::KvVerifyMode::kAll);
    EXPECT_EQ(o.hold_lease, std::chrono::milliseconds(3000)) << "the JSON's key wins";
    EXPECT_EQ(o.liveness_interval, std::chrono::milliseconds(250));
    EXPECT_EQ(got->allowed_agents, (std::vector<std::string>{"127.0.0.1:7000", "[::1]:7001"}));

    for (const char* bad : {"[1]", "{not json", "\"x\""}) {
        flags.kv_connector_config = bad;
        Result<WorkerConfig> r = ToWorkerConfig(flags);
        ASSERT_FALSE(r.ok()) << bad;
        EXPECT_NE(r.status().message().find("--kv-connector-config"), std::string::npos)
            << r.status().message();
    }
    // An unknown option is named when the worker starts, before anything does.
    flags.kv_connector_config = R"({"hold_lease": 5})";
    got = ToWorkerConfig(flags);
    ASSERT_TRUE(got.ok());
    got->serve_http = false;
    Result<std::unique_ptr<Worker>> w = Worker::Start(std::move(*got));
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.status().message().find("unknown option 'hold_lease'"), std::string::npos)
        << w.status().message();
    EXPECT_NE(w.status().message().find("--kv-connector ferry"), std::string::npos)
        << w.status().message();
}

// What ServeArgs writes, the command parses back to the same flags: every kind of field, and
// only the flags that differ from the defaults.
TEST(ServeFlags, ArgsParseBackToTheSameFlags) {
    ServeFlags defaults;
    defaults.model = "/m.gguf";
    EXPECT_EQ(ServeArgs(defaults), (std::vector<std::string>{"--model", "/m.gguf"}));

    ServeFlags f = defaults;
    f.host = "::1";
    f.port = 0;
    f.tp = 2;
    f.kv_cache_mib = 64;
    f.num_kv_blocks = 300;
    f.kv_dtype = "bf16";
    f.no_prefix_caching = true;
    f.kv_events_bind = true;
    f.kv_events_replays_per_second = 2.5;
    f.max_image_bytes = uint64_t{1} << 31;
    f.encoder_cache_mib = 0.5;
    f.request_deadline_ms = 1234;
    f.role = "decode";
    f.kv_transfer = "push";
    f.kv_peers = {"127.0.0.1:7000", "[::1]:7001"};
    f.remote_prefill = {"127.0.0.1:8001"};
    f.secret_file = "/run/secret";
    f.drain_timeout_ms = 0;
    const std::vector<std::string> args = ServeArgs(f);
    auto parsed = Parse(args);
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(ServeArgs(*parsed), args);
    EXPECT_EQ(parsed->kv_peers, f.kv_peers);
    EXPECT_EQ(parsed->encoder_cache_mib, 0.5);
    EXPECT_TRUE(parsed->no_prefix_caching);
    EXPECT_FALSE(parsed->no_chunked_prefill);
    EXPECT_EQ(parsed->drain_timeout_ms, 0);
    EXPECT_EQ(parsed->max_image_bytes, uint64_t{1} << 31);

    // The table's checks run on what it parses.
    EXPECT_THAT(Parse({"--model", "m", "--port", "70000"}).status(),
                StatusHas(Code::kInvalidArgument, "--port"));
    EXPECT_THAT(Parse({"--model", "m", "--role", "router"}).status(),
                StatusHas(Code::kInvalidArgument, "--role"));
    EXPECT_THAT(Parse({"--port", "1"}).status(), StatusHas(Code::kInvalidArgument, "--model"));

    // Over given flags: those named change, the others stay.
    ServeFlags over = f;
    FERRY_ASSERT_OK(ParseServeArgs({"--num-kv-blocks", "42", "--kv-peers", "h:1"}, &over));
    EXPECT_EQ(over.num_kv_blocks, 42);
    EXPECT_EQ(over.kv_peers, std::vector<std::string>{"h:1"});
    EXPECT_EQ(over.tp, 2);
    EXPECT_EQ(over.model, "/m.gguf");
    EXPECT_THAT(ParseServeArgs({"--no-such-flag"}, &over),
                StatusHas(Code::kInvalidArgument, "--no-such-flag"));
}

TEST(ServeFlags, FlagsThatNeedOneAnotherOrBadValuesAreRefusedByName) {
    struct Case {
        std::function<void(ServeFlags&)> set;
        std::string says;
        Code code = Code::kInvalidArgument;
    };
    const std::string missing =
        ::testing::TempDir() + "serve-flags-no-such-" + std::to_string(getpid());
    for (const Case& c : std::vector<Case>{
             {[](ServeFlags& f) { f.encoder_urls = {"127.0.0.1:9"}; }, "--encoder-urls needs"},
             {[](ServeFlags& f) {
                  f.encoder_urls = {"127.0.0.1:9"};
                  f.ec_connector = "disk";
                  f.role = "encode";
              },
              "--encoder-urls needs"},
             {[](ServeFlags& f) { f.encoder_cache_dir = "/tmp"; }, "--encoder-cache-dir needs"},
             {[](ServeFlags& f) { f.kv_events_replay_endpoint = "tcp://*:1"; },
              "--kv-events-replay-endpoint needs"},
             {[](ServeFlags& f) { f.limit_mm_per_prompt = R"({"image": 2000})"; },
              "--limit-mm-per-prompt"},
             {[](ServeFlags& f) { f.limit_mm_per_prompt = R"({"video": 1})"; },
              "--limit-mm-per-prompt"},
             {[](ServeFlags& f) { f.remote_prefill = {"nohostport"}; }, "--remote-prefill"},
             {[](ServeFlags& f) {
                  f.role = "prefill";
                  f.kv_peers = {"h:0"};
              },
              "--kv-peers"},
             {[](ServeFlags& f) {
                  f.role = "decode";
                  f.agent_listen = "nowhere";
              },
              "--agent-listen"},
             {[&](ServeFlags& f) { f.secret_file = missing; }, "--secret-file"},
             {[&](ServeFlags& f) { f.model = missing; }, "--model", Code::kNotFound},
             {[&](ServeFlags& f) { f.mmproj = missing; }, "--mmproj", Code::kNotFound},
         }) {
        SCOPED_TRACE(c.says);
        ServeFlags f;
        f.model = Model().path();
        c.set(f);
        EXPECT_THAT(ToWorkerConfig(f).status(), StatusHas(c.code, c.says));
    }
}

// A secret file is read without its newline; a colocated worker takes one only from the file.
TEST(ServeFlags, TheSecretComesFromItsFileOrTheEnvironment) {
    const std::string path =
        ::testing::TempDir() + "serve-flags-secret-" + std::to_string(getpid());
    std::ofstream(path) << "s3cret\n";
    ServeFlags f;
    f.model = Model().path();
    f.secret_file = path;
    auto got = ToWorkerConfig(f);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->agent.secret, "s3cret");
    f.secret_file.clear();
    ASSERT_EQ(setenv("FERRY_SECRET", "from-env", 1), 0);
    got = ToWorkerConfig(f);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->agent.secret, "");  // colocated: only --secret-file
    f.role = "prefill";
    got = ToWorkerConfig(f);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->agent.secret, "from-env");
    unsetenv("FERRY_SECRET");
    std::remove(path.c_str());
}

}  // namespace
}  // namespace ferry::serve
