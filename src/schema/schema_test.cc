// The schema layer (src/schema/): each message's codec reads back what it writes, names a bad
// field, and ignores a field it does not know.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "schema/agent_address.h"
#include "schema/ec_transfer_params.h"
#include "schema/kv_transfer_params.h"
#include "schema/openai_error.h"
#include "schema/sglang_pd.h"

namespace ferry::schema {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

// One agent address for every place that names one: from an agent's name and listen address
// (IPv6 without its brackets), written as GET /v1/kv/agent and ec_transfer_params write it.
TEST(AgentAddress, IsMadeFromAListenAddressAndWrittenAsJson) {
    const AgentAddress v4 = AgentAt("prefill-0", "10.0.0.5:7301");
    EXPECT_EQ(v4, (AgentAddress{"prefill-0", "10.0.0.5", 7301}));
    EXPECT_EQ(v4.HostPort(), "10.0.0.5:7301");
    const AgentAddress v6 = AgentAt("p", "[::1]:9");
    EXPECT_EQ(v6.host, "::1");
    EXPECT_EQ(v6.HostPort(), "[::1]:9");
    EXPECT_EQ(AgentAddressJson(v6).dump(), R"({"engine_id":"p","host":"::1","port":9})");
    const AgentAddress bad = AgentAt("p", "no port");
    EXPECT_EQ(bad.port, 0);
    EXPECT_TRUE(bad.host.empty());
    EXPECT_FALSE(bad.empty());
    EXPECT_TRUE(AgentAddress{}.empty());
}

TEST(AgentAddress, ReadsBackWhatItWritesNamesABadFieldAndIgnoresAnUnknownOne) {
    for (const AgentAddress& a : {AgentAddress{"p", "::1", 9}, AgentAddress{"e", "h.example", 1}}) {
        Result<AgentAddress> back = ParseAgentAddress(AgentAddressJson(a), "agent");
        ASSERT_TRUE(back.ok()) << back.status().ToString();
        EXPECT_EQ(*back, a);
    }
    Json newer = AgentAddressJson({"p", "10.0.0.1", 7});
    newer["rails"] = {1, 2};
    EXPECT_TRUE(ParseAgentAddress(newer, "agent").ok()) << "a newer peer's field is ignored";
    Result<AgentAddress> own = ParseAgentAddress(Json{{"engine_id", "p"}, {"port", 7}}, "a", "w");
    ASSERT_TRUE(own.ok());
    EXPECT_EQ(own->host, "w") << "no host: the default";
    const std::pair<Json, const char*> cases[] = {
        {Json::array(), "agent: must be an object, not an array"},
        {{{"port", 7}, {"host", "h"}}, "field 'agent.engine_id' is missing"},
        {{{"engine_id", ""}, {"host", "h"}, {"port", 7}}, "field 'agent.engine_id' must not be"},
        {{{"engine_id", "p"}, {"port", 7}}, "field 'agent.host' is missing"},
        {{{"engine_id", "p"}, {"host", ""}, {"port", 7}}, "field 'agent.host' must not be empty"},
        {{{"engine_id", "p"}, {"host", "h"}, {"port", "7"}},
         "field 'agent.port' must be an integer"},
        {{{"engine_id", "p"}, {"host", "h"}, {"port", 0}}, "field 'agent.port' = 0 is outside"},
        {{{"engine_id", "p"}, {"host", "h"}, {"port", 65536}}, "is outside 1..65535"},
        {{{"engine_id", std::string(300, 'x')}, {"host", "h"}, {"port", 7}}, "longer than 256"},
    };
    for (const auto& [j, want] : cases) {
        Result<AgentAddress> r = ParseAgentAddress(j, "agent");
        ASSERT_FALSE(r.ok()) << j.dump();
        EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
        EXPECT_THAT(r.status().message(), HasSubstr(want)) << j.dump();
    }
}

// What a router writes into its requests is what the workers read.
TEST(KvTransferParams, TheRoutersRequestsParseAsTheWorkersReadThem) {
    Result<KvTransferParams> pull =
        ParseKvTransferParams(PullPrefillRequestParams(), KvTransferMode::kPull);
    ASSERT_TRUE(pull.ok());
    EXPECT_TRUE(pull->do_remote_decode);
    EXPECT_TRUE(PullPrefillRequestParams()["remote_engine_id"].is_null())
        << "vLLM's proxy writes its nulls";

    Result<KvTransferParams> pp =
        ParseKvTransferParams(PushPrefillRequestParams("x1"), KvTransferMode::kPull);
    ASSERT_TRUE(pp.ok());
    EXPECT_EQ(pp->mode, KvTransferMode::kPush);
    EXPECT_TRUE(pp->do_remote_decode);
    EXPECT_EQ(pp->transfer_id, "x1");

    Result<KvTransferParams> pd = ParseKvTransferParams(
        PushDecodeRequestParams("x1", {"p0", "::1", 7001}, 2), KvTransferMode::kPull);
    ASSERT_TRUE(pd.ok()) << pd.status().ToString();
    EXPECT_EQ(pd->mode, KvTransferMode::kPush);
    EXPECT_TRUE(pd->do_remote_prefill);
    EXPECT_EQ(pd->remote_agent(), (AgentAddress{"p0", "::1", 7001}));
    EXPECT_EQ(pd->tp_size, 2);
    EXPECT_EQ(KvTransferParamsJson(*pd), PushDecodeRequestParams("x1", {"p0", "::1", 7001}, 2));

    Json newer = PushPrefillRequestParams("x2");
    newer["lmcache_hint"] = "yes";
    EXPECT_TRUE(ParseKvTransferParams(newer, KvTransferMode::kPull).ok())
        << "a router's own fields are carried, not refused";
}

TEST(EcTransferParams, ReadsBackWhatItWritesNamesABadFieldAndIgnoresAnUnknownOne) {
    EcTransferParams p;
    static_cast<AgentAddress&>(p) = {"enc-0", "::1", 7400};
    p.encoder = "vit-abc";
    Result<EcTransferParams> back = ParseEcTransferParams(EcTransferParamsJson(p));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(static_cast<const AgentAddress&>(*back), static_cast<const AgentAddress&>(p));
    EXPECT_EQ(back->encoder, "vit-abc");
    Result<EcTransferParams> text = ParseEcTransferParamsText(EcTransferParamsJson(p).dump());
    ASSERT_TRUE(text.ok());
    EXPECT_EQ(text->encoder, "vit-abc");

    Json newer = EcTransferParamsJson(p);
    newer["a_later_field"] = {"a", "b"};
    EXPECT_TRUE(ParseEcTransferParams(newer).ok()) << "unknown fields are ignored";
    EXPECT_FALSE(EcTransferParamsJson(p).contains("mm_hashes")) << "written only when there are";
    p.mm_hashes = {std::string(64, 'a'), std::string(64, '0')};
    back = ParseEcTransferParams(EcTransferParamsJson(p));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->mm_hashes, p.mm_hashes);
    Json no_encoder = AgentAddressJson(p);
    ASSERT_TRUE(ParseEcTransferParams(no_encoder).ok());
    EXPECT_EQ(ParseEcTransferParams(no_encoder)->encoder, "");

    const std::pair<Json, const char*> cases[] = {
        {Json("x"), "ec_transfer_params: must be an object, not a string"},
        {{{"host", "h"}, {"port", 1}}, "field 'ec_transfer_params.engine_id' is missing"},
        {{{"engine_id", "e"}, {"port", 1}}, "field 'ec_transfer_params.host' is missing"},
        {{{"engine_id", "e"}, {"host", "h"}, {"port", 0}}, "'ec_transfer_params.port' = 0"},
        {{{"engine_id", "e"}, {"host", "h"}, {"port", 1}, {"encoder", 5}},
         "'ec_transfer_params.encoder' must be a string"},
        {{{"engine_id", "e"}, {"host", "h"}, {"port", 1}, {"encoder", std::string(200, 'v')}},
         "'ec_transfer_params.encoder' is longer than 128"},
        {{{"engine_id", "e"}, {"host", "h"}, {"port", 1}, {"mm_hashes", "x"}},
         "'ec_transfer_params.mm_hashes' must be an array"},
        {{{"engine_id", "e"}, {"host", "h"}, {"port", 1}, {"mm_hashes", {std::string(63, 'a')}}},
         "'ec_transfer_params.mm_hashes[0]' must be 64 lowercase hex digits"},
        {{{"engine_id", "e"},
          {"host", "h"},
          {"port", 1},
          {"mm_hashes", {std::string(64, 'a'), std::string(64, 'A')}}},
         "'ec_transfer_params.mm_hashes[1]' must be 64 lowercase hex digits"},
        {{{"engine_id", "e"},
          {"host", "h"},
          {"port", 1},
          {"mm_hashes", std::vector<std::string>(257, std::string(64, 'a'))}},
         "'ec_transfer_params.mm_hashes' has more than 256 elements"},
    };
    for (const auto& [j, want] : cases) {
        Result<EcTransferParams> r = ParseEcTransferParams(j);
        ASSERT_FALSE(r.ok()) << j.dump();
        EXPECT_THAT(r.status().message(), HasSubstr(want)) << j.dump();
    }
    EXPECT_FALSE(ParseEcTransferParamsText("{not json").ok());
    EXPECT_FALSE(ParseEcTransferParamsText(std::string(50, '[') + std::string(50, ']')).ok());
}

TEST(OpenAiError, EveryStatusHasItsTypeAndAClientReadsTheBodyBack) {
    const std::pair<int, const char*> types[] = {
        {400, "invalid_request_error"}, {401, "authentication_error"},
        {403, "permission_error"},      {404, "not_found_error"},
        {409, "conflict_error"},        {413, "invalid_request_error"},
        {422, "invalid_request_error"}, {429, "rate_limit_error"},
        {500, "server_error"},          {503, "service_unavailable"},
    };
    for (auto [status, type] : types) {
        EXPECT_STREQ(OpenAiErrorType(status), type) << status;
        const Json j = OpenAiErrorJson(status, {"went wrong", "messages", ""}, "req-1");
        EXPECT_EQ(j["error"]["code"], status) << "no code: the status";
        Result<ParsedOpenAiError> back = ParseOpenAiError(j.dump());
        ASSERT_TRUE(back.ok()) << back.status().ToString();
        EXPECT_EQ(back->message, "went wrong");
        EXPECT_EQ(back->type, type);
        EXPECT_EQ(back->param, "messages");
        EXPECT_EQ(back->code, std::to_string(status));
        EXPECT_EQ(back->request_id, "req-1");
    }
    const Json coded = OpenAiErrorJson(400, {"too long", "", "context_length_exceeded"});
    EXPECT_TRUE(coded["error"]["param"].is_null());
    EXPECT_FALSE(coded["error"].contains("request_id"));
    Result<ParsedOpenAiError> back = ParseOpenAiError(coded.dump());
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(back->code, "context_length_exceeded");
    EXPECT_EQ(back->param, "");
    for (const char* bad : {"", "[]", R"({"error":"x"})", R"({"error":{"type":"x"}})",
                            R"({"error":{"message":1}})", "{{{{{{{{{{{{"}) {
        Result<ParsedOpenAiError> r = ParseOpenAiError(bad);
        EXPECT_FALSE(r.ok()) << bad;
        EXPECT_FALSE(r.status().message().empty());
    }
}

TEST(SglangPd, BootstrapFieldsAsMiniLbWritesThemScalarsListsAndRefusals) {
    using nlohmann::json;
    auto one = ParseSglangBootstrap(
        json::parse(
            R"({"bootstrap_host":"[::1]","bootstrap_port":8998,"bootstrap_room":9223372036854775807})"),
        0);
    ASSERT_TRUE(one.ok() && *one) << one.status().ToString();
    EXPECT_EQ((**one)[0].host, "::1");
    EXPECT_EQ((**one)[0].port, 8998);
    EXPECT_EQ((**one)[0].room, uint64_t(INT64_MAX));
    auto none = ParseSglangBootstrap(json::parse(R"({"bootstrap_room":null})"), 0);
    ASSERT_TRUE(none.ok());
    EXPECT_FALSE(*none);
    auto batch = ParseSglangBootstrap(
        json::parse(R"({"bootstrap_host":"h","bootstrap_port":[null,9],"bootstrap_room":[1,2]})"),
        2);
    ASSERT_TRUE(batch.ok() && *batch);
    EXPECT_EQ((**batch)[0].port, 0);  // null: the decode worker's default
    EXPECT_EQ((**batch)[1].port, 9);
    EXPECT_EQ((**batch)[1].host, "h");
    EXPECT_EQ(SglangTransferId(42), "sglang-room-42");
    for (const char* bad :
         {R"({"bootstrap_host":"h","bootstrap_room":-1})",
          R"({"bootstrap_host":"h","bootstrap_room":9223372036854775808})",
          R"({"bootstrap_host":"h","bootstrap_room":"7"})", R"({"bootstrap_room":7})",
          R"({"bootstrap_host":"","bootstrap_room":7})",
          R"({"bootstrap_host":"h","bootstrap_port":0,"bootstrap_room":7})",
          R"({"bootstrap_host":"h","bootstrap_room":[1,2]})"}) {
        auto r = ParseSglangBootstrap(json::parse(bad), 0);
        EXPECT_FALSE(r.ok()) << bad;
        EXPECT_NE(r.status().message().find("bootstrap_"), std::string::npos)
            << r.status().message();
    }
    EXPECT_FALSE(
        ParseSglangBootstrap(json::parse(R"({"bootstrap_host":"h","bootstrap_room":[1,2,3]})"), 2)
            .ok());
}

TEST(SglangPd, ThePrefillWorkersBootstrapAnswerReadsBack) {
    SglangPrefillInfo info;
    info.tp_size = 2;
    info.page_size = 16;
    info.http_port = 30001;
    info.agent = {"ferry-prefill-1", "127.0.0.1", 4711};
    const nlohmann::json j = SglangPrefillInfoJson(info);
    EXPECT_EQ(j["attn_tp_size"], 2);
    EXPECT_EQ(j["prefill_http_port"], 30001);
    auto back = ParseSglangPrefillInfo(j);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->agent, info.agent);
    EXPECT_EQ(back->tp_size, 2);
    EXPECT_EQ(SglangRankInfoJson(info, 1)["rank_port"], 4711);
    // An SGLang prefill worker's answer (no ferry agent) is named as such.
    nlohmann::json theirs = j;
    theirs.erase("ferry_agent");
    EXPECT_NE(ParseSglangPrefillInfo(theirs).status().message().find("ferry_agent"),
              std::string::npos);
}

}  // namespace
}  // namespace ferry::schema
