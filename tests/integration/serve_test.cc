// Black-box tests of `ferry serve`: the real binary on a loopback port, driven over HTTP.
#include <arpa/inet.h>
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "model/model.h"
#include "testing/process.h"
#include "testing/testing.h"
#include "testing/tiny_model.h"

namespace ferry {
namespace {

using Json = nlohmann::json;
using ::testing::HasSubstr;

class ServeTest : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        model_ = (std::filesystem::temp_directory_path() /
                  ("serve-test-" + std::to_string(getpid()) + ".gguf"))
                     .string();
        model::RandomModelSpec s = testing::TinyModelSpec(4096);
        s.name = "serve-test";
        ASSERT_TRUE(model::WriteRandomModel(s, 3, model_).ok());
        std::string line;
        auto child = testing::ChildProcess::Start(
            {FERRY_BIN, "serve", "--model", model_, "--port", "0", "--block-size", "8",
             "--num-kv-blocks", "1024", "--max-model-len", "4096", "--request-deadline-ms", "2000"},
            "ferry serve: listening on ", &line, std::chrono::seconds(30));
        ASSERT_TRUE(child.ok()) << child.status().ToString();
        server_ = new testing::ChildProcess(std::move(child).value());
        port_ = testing::PortAfter(line);
        // Ready when /health answers (llama.cpp's server tests do the same).
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (std::chrono::steady_clock::now() < deadline) {
            auto h = Get("/health");
            if (h && h->status == 200) return;
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        FAIL() << "ferry serve did not answer /health";
    }
    static void TearDownTestSuite() {
        delete server_;
        std::remove(model_.c_str());
    }

    static httplib::Result Post(const std::string& path, const std::string& body) {
        httplib::Client c("127.0.0.1", port_);
        c.set_read_timeout(60, 0);
        return c.Post(path.c_str(), body, "application/json");
    }
    static httplib::Result Get(const std::string& path) {
        httplib::Client c("127.0.0.1", port_);
        return c.Get(path.c_str());
    }
    // The data: payloads of an SSE body, [DONE] included.
    static std::vector<std::string> Events(const std::string& body) {
        std::vector<std::string> out;
        size_t pos = 0;
        while ((pos = body.find("data: ", pos)) != std::string::npos) {
            size_t end = body.find("\n\n", pos);
            out.push_back(body.substr(pos + 6, end - pos - 6));
            pos = end;
        }
        return out;
    }
    static double Metric(const std::string& name) {
        auto r = Get("/metrics");
        if (!r) return -1;
        size_t at = r->body.find("\n" + name + " ");
        if (at == std::string::npos) at = r->body.find("\n" + name + "{");
        if (at == std::string::npos) return -1;
        size_t sp = r->body.find(' ', at + 1);
        return std::stod(r->body.substr(sp + 1));
    }

    static std::string model_;
    static testing::ChildProcess* server_;
    static int port_;
};
std::string ServeTest::model_;
testing::ChildProcess* ServeTest::server_ = nullptr;
int ServeTest::port_ = 0;

TEST_F(ServeTest, HealthAndModels) {
    auto h = Get("/health");
    ASSERT_TRUE(h);
    EXPECT_EQ(h->status, 200);
    auto m = Get("/v1/models");
    ASSERT_TRUE(m);
    Json j = Json::parse(m->body);
    EXPECT_EQ(j["data"][0]["id"], "serve-test");
    EXPECT_EQ(j["data"][0]["max_model_len"], 4096);
}

TEST_F(ServeTest, CompletionStreamedAndWholeAgree) {
    std::string req = R"({"model":"serve-test","prompt":"The quick brown fox jumps","max_tokens":12,
                          "temperature":0,"ignore_eos":true)";
    auto whole = Post("/v1/completions", req + "}");
    ASSERT_TRUE(whole);
    ASSERT_EQ(whole->status, 200) << whole->body;
    Json w = Json::parse(whole->body);
    EXPECT_EQ(w["object"], "text_completion");
    EXPECT_EQ(w["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(w["usage"]["prompt_tokens"], 25);
    EXPECT_EQ(w["usage"]["completion_tokens"], 12);
    EXPECT_EQ(w["usage"]["total_tokens"], 37);

    auto streamed =
        Post("/v1/completions", req + R"(,"stream":true,"stream_options":{"include_usage":true}})");
    ASSERT_TRUE(streamed);
    ASSERT_EQ(streamed->status, 200);
    EXPECT_EQ(streamed->get_header_value("Content-Type"), "text/event-stream");
    auto events = Events(streamed->body);
    ASSERT_GE(events.size(), 3u);
    EXPECT_EQ(events.back(), "[DONE]");
    std::string text;
    for (size_t i = 0; i + 2 < events.size(); ++i) {
        Json e = Json::parse(events[i]);
        text += e["choices"][0]["text"].get<std::string>();
    }
    EXPECT_EQ(text, w["choices"][0]["text"].get<std::string>());
    Json usage = Json::parse(events[events.size() - 2]);
    EXPECT_TRUE(usage["choices"].empty());
    EXPECT_EQ(usage["usage"]["completion_tokens"], 12);
    // The second identical prompt found its full blocks in the prefix cache.
    EXPECT_EQ(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 24);
}

TEST_F(ServeTest, ChatStreamStartsWithTheRoleAndEndsWithAFinishReason) {
    auto r = Post("/v1/chat/completions",
                  R"({"messages":[{"role":"system","content":"Be brief."},
                                  {"role":"user","content":[{"type":"text","text":"Hello"}]}],
                      "max_tokens":5,"stream":true,"temperature":0,"ignore_eos":true,
                      "logprobs":true,"top_logprobs":2})");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    auto events = Events(r->body);
    ASSERT_GE(events.size(), 3u);
    Json first = Json::parse(events[0]);
    EXPECT_EQ(first["object"], "chat.completion.chunk");
    EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
    Json last = Json::parse(events[events.size() - 2]);
    EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
    int logprobs = 0;
    for (size_t i = 1; i + 1 < events.size(); ++i) {
        Json e = Json::parse(events[i]);
        for (const Json& lp : e["choices"][0]["logprobs"]["content"]) {
            EXPECT_LE(lp["logprob"].get<double>(), 0.0);
            EXPECT_EQ(lp["top_logprobs"].size(), 2u);
            ++logprobs;
        }
    }
    EXPECT_EQ(logprobs, 5);
}

// A field of the OpenAI API (or vLLM's) that ferry does not implement is refused naming it
// when it asks for something (docs/inference.md), never answered as if it had not been asked; its
// no-op values, and fields unknown to the API, are served.
TEST_F(ServeTest, UnimplementedFieldsAreRefusedByNameAndTheirNoOpValuesServed) {
    const std::vector<std::pair<std::string, std::string>> refused = {
        {"response_format", R"({"type":"json_object"})"},
        {"response_format", R"({"type":"json_schema","json_schema":{"name":"x","schema":{}}})"},
        {"tools", R"([{"type":"function","function":{"name":"f","parameters":{}}}])"},
        {"tool_choice", R"("required")"},
        {"functions", R"([{"name":"f"}])"},
        {"logit_bias", R"({"5":100})"},
        {"best_of", "2"},
        {"min_p", "0.1"},
        {"repetition_penalty", "1.2"},
        {"min_tokens", "3"},
        {"guided_json", R"({"type":"object"})"},
        {"guided_choice", R"(["a","b"])"},
        {"structured_outputs", R"({"regex":"a+"})"},
        {"prompt_logprobs", "1"},
        {"allowed_token_ids", "[1,2]"},
        {"bad_words", R"(["x"])"},
        {"modalities", R"(["text","audio"])"},
        {"include_stop_str_in_output", "true"},
        {"skip_special_tokens", "false"},
        {"use_beam_search", "true"},
    };
    for (const auto& [field, value] : refused) {
        const std::string body =
            R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":2,")" + field + R"(":)" +
            value + "}";
        auto r = Post("/v1/chat/completions", body);
        ASSERT_TRUE(r) << body;
        EXPECT_EQ(r->status, 400) << body;
        Json j = Json::parse(r->body, nullptr, false);
        ASSERT_TRUE(j.is_object()) << r->body;
        EXPECT_EQ(j["error"]["param"], field) << r->body;
        EXPECT_EQ(j["error"]["code"], "unsupported_parameter") << r->body;
        EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr("'" + field + "'"));
    }
    const std::string served =
        R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":2,)"
        R"("response_format":{"type":"text"},"tools":[],"tool_choice":"none","logit_bias":{},)"
        R"("repetition_penalty":1,"min_p":0,"skip_special_tokens":true,"modalities":["text"],)"
        R"("best_of":1,"min_tokens":0,"user":"someone","metadata":{"k":"v"},"not_a_field":7})";
    auto ok = Post("/v1/chat/completions", served);
    ASSERT_TRUE(ok);
    EXPECT_EQ(ok->status, 200) << ok->body;
    auto completion = Post("/v1/completions", R"({"prompt":"hi","max_tokens":2,"best_of":3})");
    ASSERT_TRUE(completion);
    EXPECT_EQ(completion->status, 400) << completion->body;
}

TEST_F(ServeTest, BadRequestsGet400WithAnOpenAiErrorAndTheServerKeepsServing) {
    struct Case {
        std::string path, body, message;
    };
    std::vector<Case> cases = {
        {"/v1/completions", "{not json", "not valid JSON"},
        {"/v1/completions", "[1,2]", "must be a JSON object"},
        {"/v1/completions", R"({"prompt":"x","max_tokens":"ten"})",
         "'max_tokens' must be an integer"},
        {"/v1/completions", R"({"prompt":"x","temperature":9})", "'temperature' is 9"},
        {"/v1/completions", R"({"prompt":"x","model":"gpt-4"})", "`gpt-4` does not exist"},
        {"/v1/completions", R"({"prompt":[1,2,99999]})", "token id 99999"},
        {"/v1/completions", R"({"prompt":[1,18446744073709551615]})",
         "token id 18446744073709551615"},
        {"/v1/completions", R"({"prompt":["a","b"]})", "batched prompts"},
        {"/v1/completions", R"({"max_tokens":3})", "'prompt' is required"},
        {"/v1/completions", R"({"prompt":")" + std::string(4090, 'a') + R"("})",
         "maximum context length is 4096"},
        {"/v1/completions", R"({"prompt":"x","stop":[1]})", "'stop' must be"},
        {"/v1/completions", R"({"prompt":"x","stop_token_ids":[2,4294967298]})",
         "stop_token_ids[1] = 4294967298 is outside the vocabulary"},
        {"/v1/completions", R"({"prompt":"x","stop_token_ids":[-1]})",
         "stop_token_ids[0] = -1 is outside"},
        {"/v1/chat/completions", R"({"messages":[]})", "'messages' must be a non-empty array"},
        {"/v1/chat/completions",
         R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})",
         "an image_url part needs an object 'image_url' with a 'url'"},
        // A text-only model names the image part it cannot take.
        {"/v1/chat/completions",
         R"({"messages":[{"role":"user","content":[{"type":"text","text":"see"},)"
         R"({"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}}]}]})",
         "messages[0].content[1]: this model takes no images (it has no vision encoder)"},
        {"/v1/chat/completions", R"({"messages":[{"role":"robot","content":"x"}]})",
         "role 'robot'"},
        // Disaggregation: malformed params name the field; well-formed ones on a colocated
        // worker say it has no connector.
        {"/v1/completions", R"({"prompt":"x","kv_transfer_params":[1]})",
         "'kv_transfer_params' must be an object"},
        {"/v1/completions",
         R"({"prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_port":70000}})",
         "'kv_transfer_params.remote_port' must be an integer in range"},
        {"/v1/completions",
         R"({"prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,-2]}})",
         "'kv_transfer_params.remote_block_ids' must be an array of block ids"},
        {"/v1/completions",
         R"({"prompt":"x","kv_transfer_params":{"do_remote_decode":true,"transfer_mode":"teleport"}})",
         "'kv_transfer_params.transfer_mode' must be"},
        {"/v1/completions", R"({"prompt":"x","kv_transfer_params":{"do_remote_decode":true}})",
         "no KV connector"},
        {"/v1/completions",
         "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]",
         "nests deeper than 64"},
    };
    for (const Case& c : cases) {
        auto r = Post(c.path, c.body);
        ASSERT_TRUE(r) << c.body;
        EXPECT_EQ(r->status, 400) << c.body;
        Json j = Json::parse(r->body, nullptr, false);
        ASSERT_TRUE(j.is_object()) << r->body;
        EXPECT_EQ(j["error"]["type"], "invalid_request_error") << r->body;
        EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr(c.message)) << c.body;
    }
    auto nf = Get("/v2/nothing");
    ASSERT_TRUE(nf);
    EXPECT_EQ(nf->status, 404);
    // Raw garbage on the socket.
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port_);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    std::string junk(5000, '\x01');
    junk += "\r\n\r\n";
    EXPECT_GT(write(fd, junk.data(), junk.size()), 0);
    close(fd);
    auto ok = Post("/v1/completions", R"({"prompt":"still here","max_tokens":2})");
    ASSERT_TRUE(ok);
    EXPECT_EQ(ok->status, 200);
    EXPECT_GE(Metric("ferry_request_bad_total"), double(cases.size()));
}

TEST_F(ServeTest, ClientDisconnectAbortsTheRequestAndFreesItsBlocks) {
    const double aborted_before = [] {
        auto r = Get("/metrics");
        size_t at = r->body.find("finished_reason=\"abort\"} ");
        return std::stod(r->body.substr(at + 25));
    }();
    for (bool stream : {true, false}) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(port_);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
        std::string body = fmt::format(
            R"({{"prompt":"go on and on","max_tokens":4000,"ignore_eos":true,"stream":{}}})",
            stream);
        std::string req = fmt::format(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: {}\r\n\r\n{}",
            body.size(), body);
        ASSERT_EQ(write(fd, req.data(), req.size()), static_cast<ssize_t>(req.size()));
        if (stream) {
            char buf[256];
            ASSERT_GT(read(fd, buf, sizeof(buf)), 0);  // the stream has started
        }
        close(fd);
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    double aborted = 0, used = -1;
    while (std::chrono::steady_clock::now() < deadline) {
        auto r = Get("/metrics");
        size_t at = r->body.find("finished_reason=\"abort\"} ");
        aborted = std::stod(r->body.substr(at + 25));
        used = Metric("ferry_kv_blocks_used");
        if (aborted >= aborted_before + 2 && used == 0) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(aborted, aborted_before + 2);
    EXPECT_EQ(used, 0);
}

TEST_F(ServeTest, ConcurrentRequestsAllComplete) {
    std::vector<std::thread> threads;
    std::atomic<int> ok{0};
    std::vector<std::string> errors(8);
    for (int i = 0; i < 8; ++i) {
        threads.emplace_back([&, i] {
            auto r = Post("/v1/completions",
                          fmt::format(R"({{"prompt":"request {}","max_tokens":8,"stream":{},
                                         "ignore_eos":true}})",
                                      i, i % 2 ? "true" : "false"));
            if (r && r->status == 200) {
                ++ok;
            } else {
                errors[i] = r ? fmt::format("status {}: {}", r->status, r->body)
                              : httplib::to_string(r.error());
            }
        });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(ok.load(), 8) << fmt::format("{}", fmt::join(errors, " | "));
    EXPECT_EQ(Metric("ferry_num_requests_running"), 0);
}

// docs/security.md: `ferry serve` without --host answers on loopback only.
TEST_F(ServeTest, ListensOnLoopbackByDefault) {
    std::string ip = testing::NonLoopbackAddress();
    if (ip.empty()) GTEST_SKIP() << "this machine has no non-loopback IPv4 address";
    EXPECT_TRUE(testing::CanConnect("127.0.0.1", static_cast<uint16_t>(port_)));
    EXPECT_FALSE(testing::CanConnect(ip, static_cast<uint16_t>(port_))) << ip;
}

// Slow clients (a header byte every 200 ms; hundreds of them, far more than the server's I/O
// threads) are cut off after --request-deadline-ms and cannot starve it.
TEST_F(ServeTest, SlowClientsAreCutOffAndCannotStarveTheServer) {
    testing::SlowLoris loris(static_cast<uint16_t>(port_), 400, std::chrono::milliseconds(200));
    ASSERT_EQ(loris.connected(), 400);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto t0 = std::chrono::steady_clock::now();
    auto r = Post("/v1/completions", R"({"prompt":"still there?","max_tokens":4})");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
    EXPECT_EQ(loris.WaitClosed(std::chrono::seconds(15)), 400);
}

// `ferry bench serve` against the real server: the vLLM layout, and every request recorded.
TEST_F(ServeTest, BenchServeRunsAgainstTheServer) {
    for (const char* endpoint : {"/v1/completions", "/v1/chat/completions"}) {
        std::string result = (std::filesystem::temp_directory_path() /
                              ("bench-serve-" + std::to_string(getpid()) + ".json"))
                                 .string();
        std::string cmd = fmt::format(
            "{} bench serve --base-url http://127.0.0.1:{} --endpoint {} --num-prompts 6 "
            "--random-input-len 20 --random-output-len 5 --ignore-eos --request-rate 50 "
            "--percentiles 50,99 --goodput ttft:60000 --save-result {} --label test "
            "--no-progress 2>&1",
            FERRY_BIN, port_, endpoint, result);
        FILE* p = popen(cmd.c_str(), "r");
        ASSERT_NE(p, nullptr);
        std::string out;
        char buf[4096];
        while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
        EXPECT_EQ(pclose(p), 0) << out;
        EXPECT_THAT(out, HasSubstr("============ Serving Benchmark Result ============"));
        EXPECT_THAT(out, HasSubstr("Successful requests:                     6 "));
        EXPECT_THAT(out, HasSubstr("Failed requests:                         0 "));
        EXPECT_THAT(out, HasSubstr("Total generated tokens:                  30 "));
        EXPECT_THAT(out, HasSubstr("Request goodput (req/s):"));
        EXPECT_THAT(out, HasSubstr("P99 TTFT (ms):"));
        EXPECT_THAT(out, HasSubstr("Mean TPOT (ms):"));
        std::ifstream f(result);
        Json j = Json::parse(f, nullptr, false);
        ASSERT_TRUE(j.is_object());
        EXPECT_EQ(j["completed"], 6);
        EXPECT_EQ(j["model_id"], "serve-test");
        EXPECT_EQ(j["label"], "test");
        ASSERT_EQ(j["requests"].size(), 6u);
        size_t gaps = 0;
        for (const Json& r : j["requests"]) {
            EXPECT_TRUE(r["success"].get<bool>()) << r.dump();
            EXPECT_EQ(r["output_tokens"], 5);
            EXPECT_EQ(r["prompt_tokens"].get<int>() > 0, true);
            EXPECT_GT(r["ttft_s"].get<double>(), 0);
            // Chunks whose bytes do not finish a UTF-8 character carry no text and, as in
            // vLLM, no timing; the random model makes such bytes.
            EXPECT_LE(r["itl_s"].size(), 4u);
            gaps += r["itl_s"].size();
        }
        EXPECT_GT(gaps, 0u);
        std::remove(result.c_str());
    }
    // A burst of 300 connections at once: none is reset (cpp-httplib's own listen backlog is 5;
    // the server raises it).
    {
        std::string cmd = fmt::format(
            "{} bench serve --base-url http://127.0.0.1:{} --num-prompts 300 "
            "--random-input-len 8 --random-output-len 2 --ignore-eos --no-progress 2>&1",
            FERRY_BIN, port_);
        FILE* p = popen(cmd.c_str(), "r");
        std::string out;
        char buf[4096];
        while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
        EXPECT_EQ(pclose(p), 0) << out;
        EXPECT_THAT(out, HasSubstr("Successful requests:                     300 ")) << out;
        EXPECT_THAT(out, HasSubstr("Failed requests:                         0 ")) << out;
    }
    // A server that is not there: a clear error, exit code 1.
    std::string cmd = fmt::format(
        "{} bench serve --base-url http://127.0.0.1:1 --num-prompts 1 "
        "--no-progress 2>&1",
        FERRY_BIN);
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
    EXPECT_NE(pclose(p), 0);
    EXPECT_THAT(out, HasSubstr("is the server up"));
}

// vLLM's /tokenize and /detokenize: a prompt, chat messages, token strings, and the errors.
TEST_F(ServeTest, TokenizeAndDetokenizeAsVllmDoes) {
    auto r = Post("/tokenize", R"({"model":"serve-test","prompt":"Hi there"})");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    Json j = Json::parse(r->body);
    // The byte vocabulary: one token per byte, no bos (the model does not want one).
    EXPECT_EQ(j["count"], 8);
    EXPECT_EQ(j["max_model_len"], 4096);
    EXPECT_EQ(j["tokens"], Json::parse("[72,105,32,116,104,101,114,101]"));
    EXPECT_TRUE(j["token_strs"].is_null());

    r = Post("/tokenize", R"({"prompt":"a b","return_token_strs":true})");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(Json::parse(r->body)["token_strs"], Json::parse(R"(["a","\u0120","b"])"));

    // Messages go through the chat template (ChatML here), its control tokens included.
    r = Post("/tokenize", R"({"messages":[{"role":"user","content":"hi"}]})");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    Json chat = Json::parse(r->body)["tokens"];
    EXPECT_EQ(chat[0], 257);  // <|im_start|>
    auto d = Post("/detokenize", Json{{"tokens", chat}}.dump());
    ASSERT_TRUE(d);
    ASSERT_EQ(d->status, 200) << d->body;
    EXPECT_EQ(Json::parse(d->body)["prompt"],
              "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    r = Post("/tokenize",
             R"({"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false})");
    ASSERT_TRUE(r);
    // Without the generation prompt: 11 tokens fewer (<|im_start|>, "assistant", "\n").
    EXPECT_EQ(Json::parse(r->body)["count"].get<size_t>() + 11, chat.size()) << r->body;

    // Text round trips through both, any bytes included.
    const std::string text = "Grüße, 世界! \xf0\x9f\xa6\x99 tabs\tand\nnewlines";
    r = Post("/tokenize", Json{{"prompt", text}}.dump());
    ASSERT_TRUE(r);
    d = Post("/detokenize", Json{{"tokens", Json::parse(r->body)["tokens"]}}.dump());
    ASSERT_TRUE(d);
    EXPECT_EQ(Json::parse(d->body)["prompt"], text);

    struct Case {
        const char* path;
        const char* body;
        const char* param;
    };
    for (const Case& c : {
             Case{"/tokenize", R"({"prompt":5})", "prompt"},
             Case{"/tokenize", R"({})", "prompt"},
             Case{"/tokenize", R"({"prompt":"a","messages":[{"role":"user","content":"b"}]})",
                  "prompt"},
             Case{"/tokenize", R"({"messages":[]})", "messages"},
             Case{"/tokenize", R"({"messages":[{"role":"user","content":"x"}],
                                  "continue_final_message":true})",
                  "continue_final_message"},
             Case{"/tokenize", R"({"prompt":"a","model":"other"})", "model"},
             Case{"/tokenize", R"({"prompt":"a","add_special_tokens":"yes"})",
                  "add_special_tokens"},
             Case{"/detokenize", R"({"tokens":[1,-1]})", "tokens"},
             Case{"/detokenize", R"({"tokens":[259]})", "tokens"},
             Case{"/detokenize", R"({"tokens":[1.5]})", "tokens"},
             Case{"/detokenize", R"({"tokens":"abc"})", "tokens"},
             Case{"/detokenize", R"([1,2])", ""},
             Case{"/detokenize", R"({"tokens":[1)", ""},
         }) {
        auto e = Post(c.path, c.body);
        ASSERT_TRUE(e) << c.body;
        EXPECT_EQ(e->status, 400) << c.path << " " << c.body << " -> " << e->body;
        Json err = Json::parse(e->body, nullptr, false);
        ASSERT_TRUE(err.is_object()) << e->body;
        EXPECT_EQ(err["error"]["type"], "invalid_request_error") << e->body;
        EXPECT_EQ(err["error"]["param"], *c.param ? Json(c.param) : Json()) << e->body;
    }
    auto h = Get("/health");
    ASSERT_TRUE(h);
    EXPECT_EQ(h->status, 200);
}

// Every token in the logprobs has a name no other token shares: a lone byte >= 0x80 is
// "bytes:\xNN" (vLLM's form; it used to be U+FFFD for all of them, so the top alternatives
// collided), and the chat form carries each token's bytes.
TEST_F(ServeTest, LogprobsNameEveryTokenDistinctlyAndCarryItsBytes) {
    // The random byte model puts bytes >= 0x80 (half its vocabulary) among its top choices.
    auto r = Post("/v1/completions", R"({"prompt":"The quick brown fox","max_tokens":12,
                                         "temperature":0,"ignore_eos":true,"logprobs":5})");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    Json lp = Json::parse(r->body)["choices"][0]["logprobs"];
    ASSERT_EQ(lp["tokens"].size(), 12u);
    size_t partial = 0;
    // "bytes:" then one or more \xNN, lowercase hex (std::regex trips GCC 12's
    // -Wmaybe-uninitialized in the sanitizer builds).
    auto is_bytes_name = [](const std::string& n) {
        if (n.rfind("bytes:", 0) != 0 || n.size() == 6 || (n.size() - 6) % 4 != 0) return false;
        for (size_t i = 6; i < n.size(); i += 4) {
            if (n[i] != '\\' || n[i + 1] != 'x') return false;
            for (size_t k = i + 2; k < i + 4; ++k) {
                if (!std::isdigit(static_cast<unsigned char>(n[k])) && (n[k] < 'a' || n[k] > 'f')) {
                    return false;
                }
            }
        }
        return true;
    };
    for (size_t i = 0; i < 12; ++i) {
        // top_logprobs is a dict keyed by name: 5 keys, or names collided. The chosen token is
        // among them (greedy).
        const Json& top = lp["top_logprobs"][i];
        EXPECT_EQ(top.size(), 5u) << top.dump();
        EXPECT_TRUE(top.contains(lp["tokens"][i].get<std::string>())) << top.dump();
        for (const auto& [name, _] : top.items()) {
            if (name.rfind("bytes:", 0) == 0) {
                ++partial;
                EXPECT_TRUE(is_bytes_name(name)) << name;
            }
        }
    }
    EXPECT_GT(partial, 0u) << "no lone byte among 60 alternatives: the check saw nothing";

    r = Post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"Hello"}],
                                         "max_tokens":8,"temperature":0,"ignore_eos":true,
                                         "logprobs":true,"top_logprobs":5})");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    Json content = Json::parse(r->body)["choices"][0]["logprobs"]["content"];
    ASSERT_EQ(content.size(), 8u);
    std::string joined;
    auto check = [&](const Json& e) {
        const std::string name = e["token"].get<std::string>();
        std::vector<uint8_t> bytes = e["bytes"].get<std::vector<uint8_t>>();
        ASSERT_FALSE(bytes.empty()) << e.dump();
        if (name.rfind("bytes:", 0) == 0) {
            std::string hex;
            for (uint8_t b : bytes) hex += fmt::format("\\x{:02x}", b);
            EXPECT_EQ(name, "bytes:" + hex);
        } else {
            EXPECT_EQ(name, std::string(bytes.begin(), bytes.end()));
        }
    };
    for (const Json& e : content) {
        check(e);
        std::set<std::string> names;
        for (const Json& t : e["top_logprobs"]) {
            check(t);
            names.insert(t["token"].get<std::string>());
        }
        EXPECT_EQ(names.size(), 5u) << e.dump();
        // A control token is named by its text; the answer's text leaves it out.
        const std::string name = e["token"].get<std::string>();
        if (name == "<|endoftext|>" || name == "<|im_start|>" || name == "<|im_end|>") continue;
        std::vector<uint8_t> b = e["bytes"].get<std::vector<uint8_t>>();
        joined.append(b.begin(), b.end());
    }
    // The bytes of the chosen tokens are the answer's text.
    std::string text = Json::parse(r->body)["choices"][0]["message"]["content"];
    Json fixed = Json::parse(Json(joined).dump(-1, ' ', false, Json::error_handler_t::replace));
    EXPECT_EQ(fixed.get<std::string>(), text);
}

// A model made with a real model's vocabulary (`ferry model init --vocab`) serves: /tokenize
// gives that model's own ids for llama.cpp's test strings, text round-trips, completions run.
class RealVocabServe : public ::testing::TestWithParam<std::string> {};

TEST_P(RealVocabServe, ServesAndRoundTripsText) {
    const std::string dir = std::string(FERRY_SOURCE_DIR) + "/tests/data/tokenizers/";
    const std::string vocab = dir + "ggml-vocab-" + GetParam() + ".gguf";
    const std::string model = (std::filesystem::temp_directory_path() /
                               ("vocab-" + GetParam() + "-" + std::to_string(getpid()) + ".gguf"))
                                  .string();
    std::string cmd =
        fmt::format("{} model init --preset tiny --dtype f16 --vocab {} --out {} 2>&1", FERRY_BIN,
                    vocab, model);
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::string line;
    auto child = testing::ChildProcess::Start(
        {FERRY_BIN, "serve", "--model", model, "--port", "0", "--num-kv-blocks", "256"},
        "ferry serve: listening on ", &line, std::chrono::seconds(60));
    std::remove(model.c_str());
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    const int port = testing::PortAfter(line);
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60, 0);

    // llama.cpp's strings and the ids the model's own tokenizer gives (no special tokens).
    std::ifstream inp(vocab + ".inp"), out(vocab + ".out");
    std::stringstream all;
    all << inp.rdbuf();
    const std::string sep = "\n__ggml_vocab_test__\n";
    std::string body = all.str();
    size_t checked = 0;
    for (size_t at = 0; at < body.size() && checked < 12;) {
        size_t end = body.find(sep, at);
        if (end == std::string::npos) break;
        std::string text = body.substr(at, end - at);
        at = end + sep.size();
        std::string ids_line;
        std::getline(out, ids_line);
        std::vector<int> want;
        std::istringstream ids(ids_line);
        for (int id; ids >> id;) want.push_back(id);
        if (text.empty()) continue;
        auto r = c.Post("/tokenize", Json{{"prompt", text}, {"add_special_tokens", false}}.dump(),
                        "application/json");
        ASSERT_TRUE(r);
        ASSERT_EQ(r->status, 200) << r->body;
        EXPECT_EQ(Json::parse(r->body)["tokens"].get<std::vector<int>>(), want) << text;
        auto d = c.Post("/detokenize", Json{{"tokens", want}}.dump(), "application/json");
        ASSERT_TRUE(d);
        std::string back = Json::parse(d->body)["prompt"];
        // SentencePiece puts a space before the text; it comes back with it.
        EXPECT_TRUE(back == text || back == " " + text) << "'" << back << "' for '" << text << "'";
        ++checked;
    }
    EXPECT_GE(checked, 10u);
    auto r = c.Post("/v1/completions",
                    R"({"prompt":"Hello world","max_tokens":6,"temperature":0,"ignore_eos":true})",
                    "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(Json::parse(r->body)["usage"]["completion_tokens"], 6);
    r = c.Post("/v1/chat/completions",
               R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"ignore_eos":true})",
               "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
}

// Every family's tokenizer serves; under the sanitizers one byte-level BPE and one
// SentencePiece vocabulary (the others take the same server paths; model_unit_test checks
// their tokenizers in every build).
std::vector<std::string> Families() {
    if (testing::kSanitized) return {"gpt-2", "llama-spm"};
    return {"gpt-2", "llama-spm", "phi-3", "deepseek-coder", "falcon"};
}
INSTANTIATE_TEST_SUITE_P(Families, RealVocabServe, ::testing::ValuesIn(Families()),
                         [](const auto& info) {
                             std::string s = info.param;
                             std::replace(s.begin(), s.end(), '-', '_');
                             return s;
                         });

}  // namespace
}  // namespace ferry
