// The prompt of a request body as token ids (model/prompt.h): what the worker computes and the
// router hashes.
#include "tokenizer/prompt.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/tiny_model.h"

namespace ferry::tokenizer {
namespace {

using Json = nlohmann::json;

std::unique_ptr<Tokenizer> PresetTokenizer() {
    testing::TinyModelFile file("prompt-test", testing::TinyModelSpec(256), 1);
    auto gguf = std::move(gguf::GgufFile::Open(file.path())).value();
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
    auto user = [](Json parts) {
        return Json{{"messages", {{{"role", "user"}, {"content", parts}}}}};
    };
    EXPECT_EQ(refused(user({{{"type", "audio"}}}), true),
              "messages[0].content[0]: messages[0].content[0]: part type 'audio' is not "
              "supported (text or image_url)");
    EXPECT_EQ(refused(user({{{"type", "text"}, {"text", 3}}}), true),
              "messages[0].content[0]: messages[0].content[0]: a text part needs a string 'text'");
    EXPECT_EQ(refused(user({{{"type", "image_url"}}}), true),
              "messages[0].content[0].image_url: messages[0].content[0]: an image_url part needs "
              "an object 'image_url' with a 'url'");
    EXPECT_EQ(refused(user({{{"type", "text"}, {"text", "a"}},
                            {{"type", "image_url"}, {"image_url", {{"url", ""}}}}}),
                      true),
              "messages[0].content[1].image_url.url: messages[0].content[1].image_url.url must "
              "be a non-empty string");
    EXPECT_EQ(refused(user({{{"type", "image_url"},
                             {"image_url", {{"url", "data:x"}, {"detail", "ultra"}}}}}),
                      true),
              "messages[0].content[0].image_url.detail: messages[0].content[0].image_url.detail "
              "must be \"auto\", \"low\" or \"high\"");
    // A well-formed image to a model without a vision encoder.
    EXPECT_EQ(refused(user({{{"type", "image_url"}, {"image_url", {{"url", "data:x"}}}}}), true),
              "messages[0].content[0]: messages[0].content[0]: this model takes no images (it "
              "has no vision encoder); send text parts only");
    EXPECT_TRUE(got.empty());
}

// Image parts are collected with the message they belong to and where in its text they stood.
TEST(ChatMessages, ImagePartsAreCollectedInOrderWithTheirPlace) {
    const Json body = {
        {"messages",
         {{{"role", "system"}, {"content", "look"}},
          {{"role", "user"},
           {"content",
            {{{"type", "text"}, {"text", "first "}},
             {{"type", "image_url"}, {"image_url", {{"url", "data:a"}, {"detail", "low"}}}},
             {{"type", "text"}, {"text", "then"}},
             {{"type", "image_url"},
              {"image_url", {{"url", "file:///b.png"}, {"detail", nullptr}}}}}}}}}};
    std::vector<ChatMessage> msgs;
    std::vector<ImagePart> images;
    PromptError e;
    ASSERT_TRUE(ChatMessages(body, &msgs, &e, &images)) << e.message;
    ASSERT_EQ(msgs.size(), 2u);
    EXPECT_EQ(msgs[1].content, "first <__media__>then<__media__>");
    ASSERT_EQ(images.size(), 2u);
    EXPECT_EQ(images[0].message, 1u);
    EXPECT_EQ(images[0].offset, 6u);
    EXPECT_EQ(images[0].url, "data:a");
    EXPECT_EQ(images[0].detail, "low");
    EXPECT_EQ(images[0].param, "messages[1].content[1].image_url");
    EXPECT_EQ(images[1].offset, 21u);
    EXPECT_EQ(images[1].url, "file:///b.png");
    EXPECT_EQ(images[1].detail, "auto");
}

TEST(PromptTokens, ImagesBecomePlaceholderTokensWhereTheTemplatePutsThem) {
    auto tk = PresetTokenizer();
    auto image = [](std::string url) {
        return Json{{"type", "image_url"}, {"image_url", {{"url", std::move(url)}}}};
    };
    const Json body = {{"messages",
                        {{{"role", "system"}, {"content", "be brief"}},
                         {{"role", "user"},
                          {"content",
                           {{{"type", "text"}, {"text", "see "}},
                            image("data:a"),
                            {{"type", "text"}, {"text", " and "}},
                            image("data:b")}}}}}};
    const ImageTokens it{.tokens_per_image = 5, .placeholder = ImagePlaceholder(*tk)};
    EXPECT_EQ(it.placeholder, tk->eos_id());  // the byte vocabulary has no <image>
    std::vector<int32_t> got;
    std::vector<ImagePart> images;
    PromptError e;
    ASSERT_TRUE(PromptTokens(body, true, *tk, &got, &e, &it, &images)) << e.message;
    // The rendered prompt split at the markers, each piece encoded alone.
    const std::string text =
        tk->ApplyChatTemplate(std::vector<ChatMessage>{{"system", "be brief"},
                                                       {"user", "see <__media__> and <__media__>"}},
                              true)
            .value();
    const size_t m0 = text.find("<__media__>"), m1 = text.find("<__media__>", m0 + 1);
    std::vector<int32_t> want = tk->Encode(text.substr(0, m0), false);
    const size_t at0 = want.size();
    want.insert(want.end(), 5, it.placeholder);
    auto mid = tk->Encode(text.substr(m0 + 11, m1 - m0 - 11), false);
    want.insert(want.end(), mid.begin(), mid.end());
    const size_t at1 = want.size();
    want.insert(want.end(), 5, it.placeholder);
    auto tail = tk->Encode(text.substr(m1 + 11), false);
    want.insert(want.end(), tail.begin(), tail.end());
    EXPECT_EQ(got, want);
    ASSERT_EQ(images.size(), 2u);
    EXPECT_EQ(images[0].token_offset, at0);
    EXPECT_EQ(images[1].token_offset, at1);
    EXPECT_EQ(images[1].url, "data:b");

    // The marker typed as text cannot pose as an image, in a string or a part.
    Json typed = body;
    typed["messages"][0]["content"] = "a <__media__> b";
    EXPECT_FALSE(PromptTokens(typed, true, *tk, &got, &e, &it, &images));
    EXPECT_EQ(e.param, "messages[0].content");
    EXPECT_THAT(e.message, ::testing::HasSubstr("contains '<__media__>', which marks an image"));
    typed = body;
    typed["messages"][1]["content"][2]["text"] = "<__media__>";
    EXPECT_FALSE(PromptTokens(typed, true, *tk, &got, &e, &it, &images));
    EXPECT_EQ(e.param, "messages[1].content[2].text");
    // Without a vision encoder the marker is only text, and image parts are refused.
    EXPECT_FALSE(PromptTokens(body, true, *tk, &got, &e));
    EXPECT_THAT(e.message, ::testing::HasSubstr("this model takes no images"));
    typed["messages"][1]["content"] = "<__media__>";
    ASSERT_TRUE(PromptTokens(typed, true, *tk, &got, &e)) << e.message;
}

}  // namespace
}  // namespace ferry::tokenizer
