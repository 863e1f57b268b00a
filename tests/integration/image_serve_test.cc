// Images through `ferry serve --mmproj`: the real binary on a loopback port, driven over HTTP.
// The answer to a chat with an image is checked against the pieces computed here, outside the
// server: the image decoded, the prompt's placeholder tokens, the encoder's embeddings at them,
// an engine run greedily. Repeated images hit the encoder cache (by the pixels' hash, whatever
// file carried them) and the prefix cache (keyed on that hash); another image behind the same
// placeholder tokens hits neither. Bad images are 400s naming the part, and the server serves on.
#include <fmt/core.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <png.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "engine/engine.h"
#include "media/image.h"
#include "model/model.h"
#include "model/vision.h"
#include "testing/images.h"
#include "testing/process.h"
#include "testing/testing.h"
#include "testing/tiny_model.h"
#include "tokenizer/prompt.h"

namespace ferry {
namespace {

using Json = nlohmann::json;
using ::testing::HasSubstr;

class ImageServeTest : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        const std::string base = (std::filesystem::temp_directory_path() /
                                  ("image-serve-test-" + std::to_string(getpid())))
                                     .string();
        model_ = base + ".gguf";
        mmproj_ = base + "-mmproj.gguf";
        model::RandomModelSpec s = testing::TinyModelSpec(2048);
        s.name = "image-serve-test";
        ASSERT_TRUE(model::WriteRandomModel(s, 5, model_).ok());
        ASSERT_TRUE(model::WriteRandomMmproj(testing::TinyVisionSpec(), 6, mmproj_).ok());
        std::string line;
        auto child = testing::ChildProcess::Start(
            {FERRY_BIN, "serve", "--model", model_, "--mmproj", mmproj_, "--port", "0",
             "--block-size", "8", "--num-kv-blocks", "512", "--limit-mm-per-prompt",
             R"({"image": 3})", "--max-image-pixels", "100000"},
            "ferry serve: listening on ", &line, std::chrono::seconds(30));
        ASSERT_TRUE(child.ok()) << child.status().ToString();
        server_ = new testing::ChildProcess(std::move(child).value());
        port_ = testing::PortAfter(line);
    }
    static void TearDownTestSuite() {
        delete server_;
        std::remove(model_.c_str());
        std::remove(mmproj_.c_str());
    }

    static httplib::Result Post(const Json& body, int port = 0) {
        httplib::Client c("127.0.0.1", port ? port : port_);
        c.set_read_timeout(60, 0);
        return c.Post("/v1/chat/completions", body.dump(), "application/json");
    }
    static Json ImagePart(const std::string& url) {
        return {{"type", "image_url"}, {"image_url", {{"url", url}}}};
    }
    static Json Chat(const Json& content, int max_tokens = 8) {
        return {{"messages", {{{"role", "user"}, {"content", content}}}},
                {"max_tokens", max_tokens},
                {"temperature", 0},
                {"logprobs", true},
                {"return_tokens_as_token_ids", true}};
    }
    // The answer's token ids ("token_id:N" logprob names) and its cached prompt tokens.
    struct Answer {
        std::vector<int32_t> tokens;
        std::vector<double> logprobs;
        int cached = -1;
        int prompt = -1;
    };
    static Answer Ask(const Json& content, int port = 0) {
        auto r = Post(Chat(content), port);
        EXPECT_TRUE(r);
        if (!r) return {};
        EXPECT_EQ(r->status, 200) << r->body;
        Json j = Json::parse(r->body);
        Answer a;
        for (const Json& t : j["choices"][0]["logprobs"]["content"]) {
            a.tokens.push_back(std::stoi(t["token"].get<std::string>().substr(9)));
            a.logprobs.push_back(t["logprob"].get<double>());
        }
        a.cached = j["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
        a.prompt = j["usage"]["prompt_tokens"].get<int>();
        return a;
    }
    static double Metric(const std::string& name, int port = 0) {
        httplib::Client c("127.0.0.1", port ? port : port_);
        auto r = c.Get("/metrics");
        if (!r) return -1;
        const size_t at = r->body.find("\n" + name + " ");
        return at == std::string::npos ? -1 : std::stod(r->body.substr(at + name.size() + 2));
    }

    static std::string model_, mmproj_;
    static testing::ChildProcess* server_;
    static int port_;
    std::map<testing::ChildProcess*, int> port_of_;
};
std::string ImageServeTest::model_, ImageServeTest::mmproj_;
testing::ChildProcess* ImageServeTest::server_ = nullptr;
int ImageServeTest::port_ = 0;

TEST_F(ImageServeTest, TheAnswerIsTheEncodersEmbeddingsAtThePlaceholderTokens) {
    const std::string url = testing::RandomPngUrl(45, 30, 1);
    const Json content = {{{"type", "text"}, {"text", "Describe "}},
                          ImagePart(url),
                          {{"type", "text"}, {"text", " briefly."}}};
    const Answer got = Ask(content);

    // The same, computed here: the prompt's tokens, the image decoded and encoded, an engine.
    std::shared_ptr<model::Model> m(std::move(model::Model::Load(model_)).value());
    auto vision = std::move(model::VisionEncoder::Load(mmproj_)).value();
    const tokenizer::ImageTokens it{vision->config().tokens_per_image(),
                                    tokenizer::ImagePlaceholder(m->tokenizer())};
    std::vector<int32_t> prompt;
    std::vector<tokenizer::ImagePart> parts;
    tokenizer::PromptError pe;
    ASSERT_TRUE(
        tokenizer::PromptTokens(Chat(content), true, m->tokenizer(), &prompt, &pe, &it, &parts))
        << pe.message;
    ASSERT_EQ(parts.size(), 1u);
    media::Image image = std::move(
        media::DecodeImage(media::ReadImageUrl(url, {}).value(), media::ImageLimits{}).value());
    engine::EngineConfig ec;
    ec.manual_steps = true;
    ec.block_tokens = 8;
    ec.num_blocks = 64;
    auto e = std::move(engine::Engine::Create(m, ec)).value();
    engine::Request r;
    r.id = "reference";
    r.prompt = prompt;
    r.mm = {{static_cast<int>(parts[0].token_offset), it.tokens_per_image, image.HashHex(),
             std::make_shared<const std::vector<float>>(
                 vision->Encode(image.rgb.data(), image.width, image.height))}};
    r.sampling.temperature = 0;
    r.sampling.max_tokens = 8;
    std::vector<int32_t> want;
    r.on_output = [&](const engine::RequestOutput& o) {
        want.insert(want.end(), o.tokens.begin(), o.tokens.end());
    };
    FERRY_ASSERT_OK(e->Submit(std::move(r)));
    e->RunUntilIdle();
    ASSERT_FALSE(want.empty());
    EXPECT_EQ(got.tokens, want);
    EXPECT_EQ(got.prompt, static_cast<int>(prompt.size()));
    EXPECT_GT(got.prompt, it.tokens_per_image);
}

TEST_F(ImageServeTest, RepeatedImagesHitBothCachesAndOtherImagesNeither) {
    const double encoded0 = Metric("ferry_mm_images_encoded_total");
    const double hits0 = Metric("ferry_encoder_cache_hits_total{tier=\"memory\"}");
    const std::vector<uint8_t> px = testing::RandomPixels(40, 24, 3, 7);
    const std::string a = testing::DataUrl("image/png", testing::Png(40, 24, PNG_FORMAT_RGB, px));
    auto content = [](const std::string& url) {
        return Json{{{"type", "text"}, {"text", "Look at this picture, please: "}},
                    ImagePart(url),
                    {{"type", "text"}, {"text", " What is in it?"}}};
    };
    const Answer first = Ask(content(a));
    EXPECT_EQ(first.cached, 0);
    // The same pixels in another file (RGBA, opaque): the same mm_hash, so the encoder is not
    // run again and the prefix cache serves every full block.
    std::vector<uint8_t> rgba;
    for (size_t i = 0; i < px.size(); i += 3)
        rgba.insert(rgba.end(), {px[i], px[i + 1], px[i + 2], 255});
    const std::string a2 =
        testing::DataUrl("image/png", testing::Png(40, 24, PNG_FORMAT_RGBA, rgba));
    const Answer again = Ask(content(a2));
    EXPECT_EQ(again.tokens, first.tokens);
    EXPECT_EQ(again.cached, (first.prompt - 1) / 8 * 8);
    EXPECT_EQ(Metric("ferry_mm_images_encoded_total"), encoded0 + 1);
    EXPECT_EQ(Metric("ferry_encoder_cache_hits_total{tier=\"memory\"}"), hits0 + 1);

    // Another image of the same size: the same placeholder tokens, but only the blocks before
    // the image are found, and the answer is its own.
    const Answer other = Ask(content(testing::RandomPngUrl(40, 24, 8)));
    EXPECT_EQ(other.prompt, first.prompt);
    auto m = std::move(model::Model::Load(model_)).value();
    const tokenizer::ImageTokens it{16, tokenizer::ImagePlaceholder(m->tokenizer())};
    std::vector<int32_t> prompt;
    std::vector<tokenizer::ImagePart> parts;
    tokenizer::PromptError pe;
    ASSERT_TRUE(
        tokenizer::PromptTokens(Chat(content(a)), true, m->tokenizer(), &prompt, &pe, &it, &parts));
    ASSERT_EQ(parts.size(), 1u);
    EXPECT_EQ(other.cached, static_cast<int>(parts[0].token_offset / 8 * 8));
    EXPECT_GT(other.cached, 0);
    EXPECT_NE(other.logprobs, first.logprobs);
    EXPECT_EQ(Metric("ferry_mm_images_encoded_total"), encoded0 + 2);
}

TEST_F(ImageServeTest, TheEncoderCachesDiskTierKeepsWhatMemoryEvictsAndOutlivesARestart) {
    // Memory for one image's embeddings (16 rows of 64 floats), the rest on disk.
    const std::string dir =
        (std::filesystem::temp_directory_path() / ("image-serve-ec-" + std::to_string(getpid())))
            .string();
    auto start = [&](std::string* err = nullptr) -> std::unique_ptr<testing::ChildProcess> {
        std::string line;
        auto child = testing::ChildProcess::Start(
            {FERRY_BIN, "serve", "--model", model_, "--mmproj", mmproj_, "--port", "0",
             "--block-size", "8", "--num-kv-blocks", "512", "--encoder-cache-mib", "0.005",
             "--encoder-cache-dir", dir, "--encoder-cache-disk-mib", "1"},
            "ferry serve: listening on ", &line, std::chrono::seconds(30), err ? dir + ".err" : "");
        if (!child.ok()) {
            if (err) *err = child.status().ToString();
            return nullptr;
        }
        auto p = std::make_unique<testing::ChildProcess>(std::move(child).value());
        port_of_[p.get()] = testing::PortAfter(line);
        return p;
    };
    const std::string a = testing::RandomPngUrl(40, 24, 71), b = testing::RandomPngUrl(24, 40, 72);
    auto content = [&](const std::string& url) {
        return Json{{{"type", "text"}, {"text", "What is this?"}}, ImagePart(url)};
    };
    auto w = start();
    ASSERT_NE(w, nullptr);
    int port = port_of_[w.get()];
    const Answer first_a = Ask(content(a), port);
    const Answer first_b = Ask(content(b), port);  // a's embeddings go to disk
    ASSERT_FALSE(first_a.tokens.empty());
    EXPECT_EQ(Metric("ferry_mm_images_encoded_total", port), 2);
    EXPECT_EQ(Metric("ferry_encoder_cache_disk_writes_total", port), 1);
    EXPECT_EQ(Metric("ferry_encoder_cache_entries{tier=\"memory\"}", port), 1);
    EXPECT_EQ(Metric("ferry_encoder_cache_entries{tier=\"disk\"}", port), 1);
    EXPECT_GT(Metric("ferry_encoder_cache_bytes{tier=\"disk\"}", port), 16 * 64 * 4);
    EXPECT_EQ(Metric("ferry_encoder_cache_capacity_bytes{tier=\"disk\"}", port), 1 << 20);
    // a again: read back from disk, not encoded, the same answer.
    EXPECT_EQ(Ask(content(a), port).tokens, first_a.tokens);
    EXPECT_EQ(Metric("ferry_encoder_cache_hits_total{tier=\"disk\"}", port), 1);
    EXPECT_EQ(Metric("ferry_encoder_cache_hits_total{tier=\"memory\"}", port), 0);
    EXPECT_EQ(Metric("ferry_mm_images_encoded_total", port), 2);
    // One worker a directory: a second one on it does not start, and says why.
    std::string err;
    EXPECT_EQ(start(&err), nullptr);
    {
        std::ifstream in(dir + ".err");
        const std::string log((std::istreambuf_iterator<char>(in)), {});
        EXPECT_THAT(log, HasSubstr("another process uses it")) << err;
    }

    // A restart (killed: nothing is written at exit) finds both images on disk.
    w.reset();
    w = start();
    ASSERT_NE(w, nullptr);
    port = port_of_[w.get()];
    EXPECT_EQ(Metric("ferry_encoder_cache_entries{tier=\"disk\"}", port), 2);
    EXPECT_EQ(Ask(content(b), port).tokens, first_b.tokens);
    EXPECT_EQ(Ask(content(a), port).tokens, first_a.tokens);
    EXPECT_EQ(Metric("ferry_encoder_cache_hits_total{tier=\"disk\"}", port), 2);
    EXPECT_EQ(Metric("ferry_mm_images_encoded_total", port), 0);
    EXPECT_EQ(Metric("ferry_encoder_cache_disk_bad_files_total", port), 0);
    w.reset();
    std::filesystem::remove_all(dir);
    std::filesystem::remove(dir + ".err");
}

TEST_F(ImageServeTest, BadImagesAre400sNamingThePartAndTheServerServesOn) {
    const double refused0 = Metric("ferry_mm_requests_refused_total");
    auto expect_400 = [](const Json& body, const std::string& message, const std::string& param) {
        auto r = Post(body);
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 400) << r->body;
        Json j = Json::parse(r->body, nullptr, false);
        ASSERT_TRUE(j.contains("error")) << r->body;
        EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr(message));
        EXPECT_EQ(j["error"]["param"], param) << r->body;
    };
    const std::string png =
        testing::Png(20, 20, PNG_FORMAT_RGB, testing::RandomPixels(20, 20, 3, 3));
    const Json text = {{"type", "text"}, {"text", "hi"}};
    const std::string part1 = "messages[0].content[1].image_url";
    // Truncated, not an image, too many pixels (100 000 allowed), fetched from the network,
    // a file where none may be read.
    expect_400(
        Chat({text, ImagePart(testing::DataUrl("image/png", png.substr(0, png.size() / 2)))}),
        part1 + ": ", part1 + ".url");
    expect_400(Chat({text, ImagePart(testing::DataUrl("image/png", "GIF89a....."))}),
               "neither PNG nor JPEG", part1 + ".url");
    expect_400(Chat({text, ImagePart(testing::RandomPngUrl(400, 300, 1))}), "100000",
               part1 + ".url");
    expect_400(Chat({text, ImagePart("http://127.0.0.1:1/x.png")}), "not fetched", part1 + ".url");
    expect_400(Chat({text, ImagePart("file:///etc/hostname")}), "file://", part1 + ".url");
    // Four images where three are allowed; the image marker typed as text.
    const std::string ok = testing::DataUrl("image/png", png);
    expect_400(Chat({ImagePart(ok), ImagePart(ok), ImagePart(ok), ImagePart(ok)}),
               "the request has 4 images; at most 3", "messages");
    expect_400(Chat({{{"type", "text"}, {"text", "<__media__>"}}, ImagePart(ok)}),
               "marks an image's place", "messages[0].content[0].text");
    // Disaggregated prompts with images are refused until the connectors bind transfers to
    // them (this colocated worker has no connector: it says so first).
    Json kv = Chat({text, ImagePart(ok)});
    kv["kv_transfer_params"] = {{"do_remote_decode", true}};
    auto r = Post(kv);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body;
    EXPECT_GE(Metric("ferry_mm_requests_refused_total"), refused0 + 6);
    // Still serving, images included.
    EXPECT_EQ(Ask({text, ImagePart(ok)}).tokens.size(), 8u);
}

}  // namespace
}  // namespace ferry
