// The built-in connector's kv_transfer_params and the connector registry.
#include "kv/kv_transfer_params.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kv/connector_registry.h"
#include "testing/testing.h"

namespace ferry::kv {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

Result<std::shared_ptr<KvTransferParams>> Parse(const Json& j,
                                                KvTransferMode mode = KvTransferMode::kPull) {
    // The server hands the connector the parsed object; a peer's message or a fuzzer gives
    // text: both read the same.
    auto parsed = ParseConnectorKvParams(j, mode);
    auto text = ParseConnectorKvParamsText(j.dump(), mode);
    EXPECT_EQ(parsed.status().ToString(), text.status().ToString());
    if (parsed.ok() && text.ok() && *parsed && *text) {
        EXPECT_EQ((*parsed)->ToJson(), (*text)->ToJson());
    }
    return parsed;
}

TEST(KvTransferParams, WhatAPrefillWorkerAnswersParsesBackToTheSame) {
    KvTransferParams p;
    p.do_remote_prefill = true;
    p.remote_engine_id = "p0";
    p.remote_host = "10.0.0.2";
    p.remote_port = 7001;
    p.remote_block_ids = {4, 5, 9};
    p.remote_request_id = "cmpl-r1";
    p.tp_size = 2;
    p.hold_nonce = std::string(32, 'f');
    p.first_token = FirstToken{42, -0.5f, {{42, -0.5f}, {7, -1.25f}}};
    auto back = ParseConnectorKvParams(p.ToJson(), KvTransferMode::kPush);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    ASSERT_TRUE(*back);
    EXPECT_EQ((*back)->ToJson(), p.ToJson());
    EXPECT_EQ((*back)->mode, KvTransferMode::kPull) << "the params name their mode";
    EXPECT_TRUE((*back)->loads_kv());
    EXPECT_FALSE((*back)->prefill_only());
    EXPECT_EQ((*back)->first_token->top.size(), 2u);
}

TEST(KvTransferParams, VllmsProxyShapeIsPrefillOnlyAndTheModeDefaultsAsConfigured) {
    // vLLM's toy proxy sends its nulls; they count as absent.
    Json vllm = {{"do_remote_decode", true},    {"do_remote_prefill", false},
                 {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                 {"remote_host", nullptr},      {"remote_port", nullptr}};
    auto pull = Parse(vllm);
    ASSERT_TRUE(pull.ok() && *pull);
    EXPECT_TRUE((*pull)->prefill_only());
    EXPECT_EQ((*pull)->mode, KvTransferMode::kPull);
    auto push = Parse(vllm, KvTransferMode::kPush);
    ASSERT_TRUE(push.ok() && *push);
    EXPECT_EQ((*push)->mode, KvTransferMode::kPush);
    // Asking nothing of a connector is no error, and no params.
    auto none = Parse(Json{{"do_remote_decode", false}});
    ASSERT_TRUE(none.ok());
    EXPECT_FALSE(*none);
}

TEST(KvTransferParams, EveryBadFieldIsNamed) {
    const std::pair<Json, const char*> cases[] = {
        {Json::array({1}), "'kv_transfer_params' must be an object, not an array"},
        {{{"do_remote_decode", "yes"}}, "'kv_transfer_params.do_remote_decode' must be a boolean"},
        {{{"do_remote_prefill", true}, {"remote_port", 70000}},
         "'kv_transfer_params.remote_port' must be an integer in range"},
        {{{"do_remote_prefill", true}, {"remote_block_ids", {1, -2}}},
         "'kv_transfer_params.remote_block_ids' must be an array of block ids"},
        {{{"do_remote_decode", true}, {"transfer_mode", "teleport"}},
         "'kv_transfer_params.transfer_mode' must be \"pull\" or \"push\""},
        {{{"do_remote_decode", true}, {"remote_engine_id", std::string(2000, 'x')}},
         "'kv_transfer_params.remote_engine_id' must be a string of at most 1024 bytes"},
        {{{"do_remote_prefill", true}, {"ferry_hold_nonce", "short"}},
         "'kv_transfer_params.ferry_hold_nonce' must be 32 hex characters"},
        {{{"do_remote_prefill", true}}, "'kv_transfer_params.ferry_hold_nonce' must be present"},
        {{{"do_remote_prefill", true},
          {"ferry_hold_nonce", std::string(32, 'a')},
          {"ferry_first_token", {{"token", 1}}}},
         "'kv_transfer_params.ferry_first_token' must be an object with an integer token"},
        {{{"do_remote_prefill", true},
          {"ferry_hold_nonce", std::string(32, 'a')},
          {"ferry_first_token", {{"token", 1}, {"logprob", 1e300}}}},
         "with an integer token and a finite logprob"},
        {{{"do_remote_prefill", true},
          {"ferry_hold_nonce", std::string(32, 'a')},
          {"ferry_first_token", {{"token", 1}, {"logprob", -1}, {"top", {{1, -1e39}}}}}},
         "top: [[token, logprob], ...]"},
        {{{"do_remote_decode", true}, {"do_remote_prefill", true}, {"transfer_mode", "push"}},
         "do_remote_decode and do_remote_prefill are both true"},
        {{{"tp_size", 0}, {"do_remote_decode", true}},
         "'kv_transfer_params.tp_size' must be an integer in range"},
    };
    for (const auto& [j, want] : cases) {
        auto r = Parse(j);
        ASSERT_FALSE(r.ok()) << j.dump();
        EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
        EXPECT_THAT(r.status().message(), HasSubstr(want)) << j.dump();
    }
    EXPECT_FALSE(ParseConnectorKvParamsText("{not json", KvTransferMode::kPull).ok());
    EXPECT_FALSE(ParseConnectorKvParamsText(std::string(100, '[') + std::string(100, ']'),
                                            KvTransferMode::kPull)
                     .ok());
}

TEST(KvConnectorRegistry, TheBuiltInKindIsFoundAndAnUnknownOneNamesTheKnown) {
    auto k = FindKvConnector(kDefaultKvConnector);
    ASSERT_TRUE(k.ok());
    auto p = k->parse(Json::parse(R"({"do_remote_decode":true})"), {{"transfer_mode", "push"}});
    ASSERT_TRUE(p.ok() && *p);
    EXPECT_EQ(AsKvTransferParams(**p).mode, KvTransferMode::kPush) << "the options' default";
    auto bad = k->parse(Json::parse(R"({"do_remote_decode":true})"), {{"transfer_mod", "push"}});
    EXPECT_THAT(bad.status().message(), HasSubstr("unknown option 'transfer_mod'"));
    auto missing = FindKvConnector("LMCacheConnector");
    ASSERT_FALSE(missing.ok());
    EXPECT_EQ(missing.status().code(), Code::kNotFound);
    EXPECT_THAT(missing.status().message(), HasSubstr("is not one of: ferry"));
}

TEST(KvConnectorRegistry, AKindIsAddedOnceWithEverythingItNeeds) {
    KvConnectorKind k;
    k.name = "unit-test-kind";
    EXPECT_EQ(RegisterKvConnector(k).code(), Code::kInvalidArgument);
    k.parse = [](const Json&, const Json&) -> Result<std::shared_ptr<ConnectorParams>> {
        return InvalidArgumentError("unit-test-kind parsed it");
    };
    k.create = [](const KvConnectorContext&) -> Result<std::shared_ptr<KvConnector>> {
        return UnimplementedError("not here");
    };
    ASSERT_TRUE(RegisterKvConnector(k).ok());
    EXPECT_EQ(RegisterKvConnector(k).code(), Code::kAlreadyExists);
    auto names = KvConnectorNames();
    EXPECT_NE(std::find(names.begin(), names.end(), "unit-test-kind"), names.end());
    EXPECT_THAT(FindKvConnector("unit-test-kind")->parse("{}", {}).status().message(),
                HasSubstr("unit-test-kind parsed it"));
}

// The built-in kind's options: every one written reads back; the defaults are
// AgentConnectorOptions'; an unknown, mistyped or out-of-range one is named.
TEST(KvConnectorOptions, EveryOptionReadsBackAndABadOneIsNamed) {
    AgentConnectorOptions o;
    o.hold_lease = std::chrono::milliseconds(1234);
    o.transfer_timeout = std::chrono::milliseconds(2345);
    o.bootstrap_timeout = std::chrono::milliseconds(3456);
    o.handshake_timeout = std::chrono::milliseconds(4567);
    o.liveness_interval = std::chrono::milliseconds(78);
    o.default_mode = KvTransferMode::kPush;
    o.backend = "tcp";
    o.max_client_hold_blocks = 9;
    o.max_client_loads = 8;
    o.max_client_dials = 7;
    o.max_peer_loads = 6;
    o.connect_threads = 5;
    o.verify = KvVerifyMode::kAll;
    o.canary = false;
    Result<AgentConnectorOptions> back = ParseAgentConnectorOptions(AgentConnectorOptionsJson(o));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(AgentConnectorOptionsJson(*back), AgentConnectorOptionsJson(o));
    EXPECT_EQ(AgentConnectorOptionsJson(testing::ValueOrDie(ParseAgentConnectorOptions(Json()))),
              AgentConnectorOptionsJson(AgentConnectorOptions{}));
    EXPECT_EQ(
        AgentConnectorOptionsJson(testing::ValueOrDie(ParseAgentConnectorOptions(Json::object()))),
        AgentConnectorOptionsJson(AgentConnectorOptions{}));
    const std::pair<Json, const char*> cases[] = {
        {Json::array(), "must be a JSON object, not an array"},
        {{{"hold_lease", 5}}, "unknown option 'hold_lease' (the built-in kind's: hold_lease_ms"},
        {{{"hold_lease_ms", "5"}}, "'kv connector options.hold_lease_ms' must be an integer"},
        {{{"hold_lease_ms", 0}}, "'kv connector options.hold_lease_ms' = 0 is outside"},
        {{{"transfer_mode", "teleport"}}, "transfer_mode' must be \"pull\" or \"push\""},
        {{{"verify", "some"}}, "verify' must be \"off\", \"sample\" or \"all\""},
        {{{"connect_threads", 0}}, "connect_threads' = 0 is outside 1..256"},
        {{{"canary", 1}}, "canary' must be a boolean"},
        {{{"fault_head_offset_for_testing", 1}}, "unknown option 'fault_head_offset_for_testing'"},
    };
    for (const auto& [j, want] : cases) {
        Result<AgentConnectorOptions> r = ParseAgentConnectorOptions(j);
        ASSERT_FALSE(r.ok()) << j.dump();
        EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
        EXPECT_THAT(r.status().message(), HasSubstr(want)) << j.dump();
    }
}

// A context becomes the built-in connector's config: its options with the worker's model and
// trust, which no option can set.
TEST(KvConnectorOptions, AContextGivesTheBuiltInConfigItsModelAndTrust) {
    KvConnectorContext c;
    c.model_fingerprint = "fp";
    c.model_kv_heads = 4;
    c.model_tp = 2;
    c.trust.allowed_agents = {"10.0.0.1:7000"};
    c.options = {{"hold_lease_ms", 50}};
    AgentConnectorConfig config = testing::ValueOrDie(AgentConnectorConfigOf(c));
    EXPECT_EQ(config.model_fingerprint, "fp");
    EXPECT_EQ(config.model_kv_heads, 4);
    EXPECT_EQ(config.model_tp, 2);
    EXPECT_TRUE(config.trust.Listed("10.0.0.1:7000"));
    EXPECT_FALSE(config.trust.Listed("10.0.0.1:7001"));
    EXPECT_TRUE(config.trust.deployment_only());
    EXPECT_EQ(config.hold_lease, std::chrono::milliseconds(50));
    EXPECT_EQ(config.fault_head_offset_for_testing, 0);
    c.options = {{"allowed_agents", {"x:1"}}};
    EXPECT_THAT(AgentConnectorConfigOf(c).status().message(),
                HasSubstr("unknown option 'allowed_agents'"));
}

}  // namespace
}  // namespace ferry::kv
