// `vllm serve`'s command line as `ferry serve` takes it (serve/vllm_cli.h): seed 004's two
// commands as written, each vLLM spelling, and what is refused by name.
#include "serve/vllm_cli.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "serve/serve_flags.h"
#include "testing/testing.h"

namespace ferry::serve {
namespace {

using ::testing::HasSubstr;
using Args = std::vector<std::string>;

Args Translate(const Args& in) {
    Result<TranslatedArgs> t = TranslateVllmServeArgs(in);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? t->args : Args{};
}

// What ferry serve parses from vLLM's words.
ServeFlags Flags(const Args& in) {
    ServeFlags f;
    Status st = ParseServeArgs(Translate(in), &f);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return f;
}

// Seed 004, as its author ran it, with a GGUF file for the model.
TEST(VllmCli, SeedFoursTwoCommandsParseAsWritten) {
    const Args decode = {"/m.gguf",
                         "--tensor_parallel-size",
                         "2",
                         "--port",
                         "8080",
                         "--max-model-len",
                         "131072",
                         "--swap-space",
                         "0",
                         "--block-size",
                         "128",
                         "--trust-remote-code",
                         "--kv-transfer-config",
                         R"({"kv_connector":"DynamoNixlConnector"})",
                         "--enable-chunked-prefill",
                         "false"};
    ServeFlags d = Flags(decode);
    EXPECT_EQ(d.model, "/m.gguf");
    EXPECT_EQ(d.served_model_name, "/m.gguf") << "vLLM's name for it: what its clients send";
    EXPECT_EQ(d.tp, 2);
    EXPECT_EQ(d.port, 8080);
    EXPECT_EQ(d.max_model_len, 131072);
    EXPECT_EQ(d.block_size, 128);
    EXPECT_TRUE(d.no_chunked_prefill);
    EXPECT_EQ(d.role, "decode");
    EXPECT_EQ(d.kv_transfer, "pull");

    const Args prefill = {
        "/m.gguf",
        "--tensor_parallel-size",
        "1",
        "--port",
        "8090",
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
        "false"};
    Result<TranslatedArgs> t = TranslateVllmServeArgs(prefill);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ServeFlags p;
    FERRY_ASSERT_OK(ParseServeArgs(t->args, &p));
    EXPECT_EQ(p.tp, 1);
    EXPECT_EQ(p.role, "prefill") << "skip_sampling: the worker prefills for another";
    EXPECT_TRUE(p.no_chunked_prefill);
    // Each vLLM setting with no meaning here is said once.
    std::string notes;
    for (const std::string& n : t->notes) notes += n + "\n";
    for (const char* said :
         {"--swap-space 0: no meaning", "--gpu-memory-utilization 0.95",
          "--trust-remote-code: no meaning", "--enforce-eager: no meaning",
          "DynamoNixlConnector is ferry's transfer engine, protocol pull", "skip_sampling"}) {
        EXPECT_THAT(notes, HasSubstr(said));
    }
}

TEST(VllmCli, EachSpellingMeansFerrysFlag) {
    EXPECT_EQ(Flags({"--model", "m", "-tp", "2"}).tp, 2);
    EXPECT_EQ(Flags({"--model", "m", "--tensor-parallel-size=4"}).tp, 4);
    EXPECT_EQ(Flags({"--model", "m", "--max_model_len", "512"}).max_model_len, 512);
    EXPECT_EQ(Flags({"--model=m", "--served_model_name", "a_b"}).served_model_name, "a_b")
        << "a value keeps its underscores";
    EXPECT_TRUE(Flags({"m", "--no-enable-chunked-prefill"}).no_chunked_prefill);
    EXPECT_FALSE(Flags({"m", "--enable-chunked-prefill"}).no_chunked_prefill);
    EXPECT_FALSE(Flags({"m", "--enable-chunked-prefill", "true"}).no_chunked_prefill);
    EXPECT_TRUE(Flags({"m", "--enable-chunked-prefill=False"}).no_chunked_prefill);
    EXPECT_TRUE(Flags({"m", "--no-enable-prefix-caching"}).no_prefix_caching);
    EXPECT_TRUE(Flags({"m", "--enable-prefix-caching", "false"}).no_prefix_caching);
    EXPECT_EQ(Flags({"m", "-pp", "1", "--seed", "0"}).model, "m");
    // KVTransferConfig's kv_load_failure_policy is --kv-load-failure.
    EXPECT_EQ(Flags({"m", "--kv-transfer-config",
                     R"({"kv_connector":"NixlConnector","kv_role":"kv_consumer",)"
                     R"("kv_load_failure_policy":"recompute"})"})
                  .kv_load_failure,
              "recompute");
    EXPECT_FALSE(TranslateVllmServeArgs({"m", "--kv-transfer-config",
                                         R"({"kv_connector":"NixlConnector",)"
                                         R"("kv_load_failure_policy":"retry"})"})
                     .ok());
    // The connectors and roles of KVTransferConfig.
    ServeFlags mooncake = Flags(
        {"m", "--kv-transfer-config",
         R"({"kv_connector":"MooncakeConnector","kv_role":"kv_producer","engine_id":"p-0"})"});
    EXPECT_EQ(mooncake.kv_transfer, "push");
    EXPECT_EQ(mooncake.role, "prefill");
    EXPECT_EQ(mooncake.agent_name, "p-0");
    ServeFlags nixl =
        Flags({"m", "--kv-transfer-config",
               R"({"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cuda",
             "kv_connector_extra_config":{"backends":["TCP"]}})"});
    EXPECT_EQ(nixl.kv_transfer, "pull");
    EXPECT_EQ(nixl.role, "decode");
    EXPECT_EQ(nixl.kv_backend, "tcp");
    EXPECT_EQ(Flags({"m", "--kv-transfer-config", R"({"kv_connector":"NixlConnector",
                     "kv_role":"kv_consumer"})",
                     "--role", "decode"})
                  .role,
              "decode");
    // ferry's own flags pass through unchanged.
    const Args ferry = {"--model", "m", "--role", "prefill", "--kv-peers", "127.0.0.1:7000"};
    EXPECT_EQ(Translate(ferry), ferry);
}

// vLLM's EPD example (disagg_1e1p1d_example.sh): the encode worker's and a consumer's
// --ec-transfer-config with the shared-storage connector.
TEST(VllmCli, TheEpdExamplesEcTransferConfigIsTheDiskConnector) {
    const std::string producer = R"({"ec_connector": "ECSharedStorageConnector",
        "ec_role": "ec_producer", "ec_connector_extra_config": {"shared_storage_path": "/tmp/ec"}})";
    ServeFlags e =
        Flags({"m", "--mmproj", "v.gguf", "--gpu-memory-utilization", "0.0", "--port", "19534",
               "--enable-request-id-headers", "--no-enable-prefix-caching", "--max-num-seqs", "128",
               "--max-num-batched-tokens", "4096", "--ec-transfer-config", producer});
    EXPECT_EQ(e.role, "encode");
    EXPECT_EQ(e.ec_connector, "disk");
    EXPECT_EQ(e.ec_dir, "/tmp/ec");
    EXPECT_TRUE(e.no_prefix_caching);
    EXPECT_EQ(e.max_num_batched_tokens, 4096);
    const std::string consumer = R"({"ec_connector": "ECExampleConnector",
        "ec_role": "ec_consumer", "ec_connector_extra_config": {"shared_storage_path": "/tmp/ec"}})";
    ServeFlags p = Flags({"m", "--ec-transfer-config", consumer, "--kv-transfer-config",
                          R"({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})"});
    EXPECT_EQ(p.role, "prefill");
    EXPECT_EQ(p.ec_connector, "disk");
    EXPECT_EQ(p.ec_dir, "/tmp/ec");
    ServeFlags pd = Flags({"m", "--ec-transfer-config", consumer});
    EXPECT_EQ(pd.role, "colocated") << "1E1PD: the PD worker is colocated";
    EXPECT_EQ(pd.ec_connector, "disk");
}

// vLLM's --kv-events-config as ferry's --kv-events-* flags (docs/routing.md's events).
TEST(VllmCli, KvEventsConfigIsFerrysKvEventsFlags) {
    ServeFlags on = Flags({"m", "--kv-events-config",
                           R"({"enable_kv_cache_events": true, "publisher": "zmq",
                               "endpoint": "tcp://*:6557", "replay_endpoint": "tcp://*:6558",
                               "topic": "kv", "buffer_steps": 100})"});
    EXPECT_EQ(on.kv_events_endpoint, "tcp://*:6557");
    EXPECT_EQ(on.kv_events_replay_endpoint, "tcp://*:6558");
    EXPECT_EQ(on.kv_events_topic, "kv");
    ServeFlags defaults = Flags({"m", "--kv-events-config", R"({"enable_kv_cache_events": true})"});
    EXPECT_EQ(defaults.kv_events_endpoint, "tcp://*:5557") << "vLLM's default endpoint";
    EXPECT_TRUE(defaults.kv_events_replay_endpoint.empty());
    EXPECT_TRUE(Flags({"m", "--kv-events-config", R"({"endpoint": "tcp://*:1"})"})
                    .kv_events_endpoint.empty())
        << "not enabled: off, as vLLM";
    EXPECT_TRUE(Flags({"m", "--kv-events-config",
                       R"({"enable_kv_cache_events": true, "publisher": "null"})"})
                    .kv_events_endpoint.empty());
    for (const char* bad : {R"({"enable_kv_cache_events": true, "publisher": "kafka"})",
                            R"({"enable_kv_cache_events": "yes"})", R"({"endpont": "x"})", "[]"}) {
        Result<TranslatedArgs> t = TranslateVllmServeArgs({"m", "--kv-events-config", bad});
        EXPECT_FALSE(t.ok()) << bad;
        EXPECT_THAT(t.status().message(), HasSubstr("kv-events-config")) << bad;
    }
}

TEST(VllmCli, WhatHasNoEquivalentIsRefusedByName) {
    const std::pair<Args, const char*> cases[] = {
        {{"m", "--kv-transfer-config", "[1]"}, "--kv-transfer-config: must be a JSON object"},
        {{"m", "--kv-transfer-config", "{"}, "must be a JSON object"},
        {{"m", "--kv-transfer-config", R"({"kv_role":"kv_both"})"}, "kv_connector is required"},
        {{"m", "--kv-transfer-config", R"({"kv_connector":"LMCacheConnectorV1"})"},
         "kv_connector 'LMCacheConnectorV1' has no equivalent on ferry"},
        {{"m", "--kv-transfer-config", R"({"kv_connector":"NixlConnector","kv_rol":"x"})"},
         "unknown field 'kv_rol'"},
        {{"m", "--kv-transfer-config", R"({"kv_connector":"NixlConnector","kv_role":"kv_all"})"},
         "kv_role' must be kv_producer, kv_consumer or kv_both"},
        {{"m", "--kv-transfer-config",
          R"({"kv_connector":"NixlConnector","kv_connector_extra_config":{"backends":["RDMA"]}})"},
         "must name UCX, TCP or SHM"},
        {{"m", "--kv-transfer-config",
          R"({"kv_connector":"NixlConnector","kv_role":"kv_producer"})", "--role", "decode"},
         "asks for a prefill worker, --role for a decode one"},
        {{"m", "--pipeline-parallel-size", "2"}, "ferry has tensor parallelism only"},
        {{"m", "--kv-transfer-config"}, "--kv-transfer-config needs a value"},
        {{"m", "--enable-chunked-prefill=maybe"}, "true or false"},
        {{"m", "--ec-transfer-config",
          R"({"ec_connector":"SHMConnector","ec_role":"ec_producer"})"},
         "ec_connector 'SHMConnector' has no equivalent on ferry"},
        {{"m", "--ec-transfer-config", R"({"ec_connector":"ECExampleConnector"})"},
         "ec_role is required"},
        {{"m", "--ec-transfer-config",
          R"({"ec_connector":"ECExampleConnector","ec_role":"ec_consumer"})"},
         "'ec-transfer-config.ec_connector_extra_config' is missing"},
        {{"m", "--ec-transfer-config",
          R"({"ec_connector":"ECExampleConnector","ec_role":"ec_producer",
              "ec_connector_extra_config":{"shared_storage_path":"/d"}})",
          "--role", "decode"},
         "asks for an encode worker, --role for a decode one"},
        {{"m", "--ec-transfer-config", R"({"ec_connector":"ECExampleConnector","ec_rol":1})"},
         "unknown field 'ec_rol'"},
    };
    for (const auto& [args, want] : cases) {
        Result<TranslatedArgs> t = TranslateVllmServeArgs(args);
        ASSERT_FALSE(t.ok()) << args.back();
        EXPECT_EQ(t.status().code(), Code::kInvalidArgument);
        EXPECT_THAT(t.status().message(), HasSubstr(want)) << args.back();
    }
    // A flag neither ferry nor vLLM's table knows passes through, and ferry serve names it.
    ServeFlags f;
    const Status st = ParseServeArgs(Translate({"m", "--speculative-config", "{}"}), &f);
    EXPECT_FALSE(st.ok());
    EXPECT_THAT(st.message(), HasSubstr("--speculative-config"));
}

}  // namespace
}  // namespace ferry::serve
