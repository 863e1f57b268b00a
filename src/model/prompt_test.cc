// The prompt of a request body as token ids (model/prompt.h): what the worker computes and the
// router hashes.
#include "model/prompt.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/tiny_model.h"

namespace ferry::model {
namespace {

using Json = nlohmann::json;

std::unique_ptr<Tokenizer> PresetTokenizer() {
    testing::TinyModelFile file("prompt-test", testing::TinyModelSpec(256), 1);
    auto gguf = std::move(GgufFile::Open(file.path())).value();
    return std::move(Tokenizer::FromGguf(*gguf)).value();
}

TEST(PromptTokens, TextIdsAndChatAsTheWorkerComputesThem) {
    auto tk = PresetTokenizer();
    std::vector<int32_t> got;
    PromptError e;
    ASSERT_TRUE(PromptTokens(Json{{"prompt", "hello"}}, false, *tk, &got, &e));
    EXPECT_EQ(got, tk->Encode("hello", tk->add_bos()));
    ASSERT_TRUE(PromptTokens(Json{{"prompt", {"hello"}}}, false, *tk, &got, &e));
    EXPECT_EQ(got, tk->Encode("hello", tk->add_bos()));
    ASSERT_TRUE(PromptTokens(Json{{"prompt", {5, 6, 7}}}, false, *tk, &got, &e));
    EXPECT_THAT(got, ::testing::ElementsAre(5, 6, 7));
    const Json chat = {
        {"messages",
         {{{"role", "system"}, {"content", "be brief"}},
          {{"role", "user"},
           {"content",
            {{{"type", "text"}, {"text", "hi "}}, {{"type", "text"}, {"text", "there"}}}}}}}};
    ASSERT_TRUE(PromptTokens(chat, true, *tk, &got, &e));
    const std::vector<ChatMessage> msgs = {{"system", "be brief"}, {"user", "hi there"}};
    EXPECT_EQ(got, tk->Encode(tk->ApplyChatTemplate(msgs, true).value(), false));
}

TEST(PromptTokens, ABodyTheWorkerRefusesNamesItsField) {
    auto tk = PresetTokenizer();
    std::vector<int32_t> got;
    PromptError e;
    auto refused = [&](const Json& body, bool chat) {
        e = {};
        EXPECT_FALSE(PromptTokens(body, chat, *tk, &got, &e)) << body.dump();
        return e.param + ": " + e.message;
    };
    EXPECT_EQ(refused(Json::object(), false), "prompt: 'prompt' is required");
    EXPECT_EQ(refused(Json{{"prompt", ""}}, false), "prompt: the prompt is empty");
    EXPECT_EQ(refused(Json{{"prompt", {1, 9999}}}, false),
              "prompt: prompt token id 9999 is outside the vocabulary (0..258)");
    EXPECT_EQ(refused(Json{{"prompt", {"a", "b"}}}, false),
              "prompt: batched prompts are not supported: send one request per prompt");
    EXPECT_EQ(refused(Json{{"prompt", 3}}, false),
              "prompt: 'prompt' must be a string or an array of token ids");
    EXPECT_EQ(refused(Json{{"messages", Json::array()}}, true),
              "messages: 'messages' must be a non-empty array");
    EXPECT_EQ(
        refused(Json{{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}},
                true),
        "messages[0].content: messages[0].content: part type 'image_url' is not supported by "
        "this worker (text only)");
    EXPECT_TRUE(got.empty());
}

}  // namespace
}  // namespace ferry::model
