// Scheduling must never change what a sequence produces: greedy outputs are compared token for
// token between chunked and whole prefill, batched and single decode, prefix-cache hits and
// misses, runs with and without preemption, and TP 2 and TP 1.
#include "engine/engine.h"

#include <fmt/core.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <thread>

#include "engine/output_text.h"
#include "ferry/agent.h"
#include "testing/testing.h"
#include "testing/tiny_model.h"

namespace ferry::engine {
namespace {

using ::ferry::testing::StatusHas;
using ::ferry::testing::StatusIs;

struct Collected {
    std::vector<int32_t> tokens;
    std::string text;
    std::vector<float> logprobs;
    FinishReason finish = FinishReason::kNone;
    int events = 0;
    int cached_tokens = 0;
    int prompt_tokens = 0;
    int completion_tokens = 0;
};

class EngineTest : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        path_ = (std::filesystem::temp_directory_path() /
                 ("engine-test-" + std::to_string(getpid()) + ".gguf"))
                    .string();
        model::RandomModelSpec s = testing::TinyModelSpec(512);
        s.name = "engine-test";
        ASSERT_TRUE(model::WriteRandomModel(s, 11, path_).ok());
        model1_ = std::shared_ptr<model::Model>(std::move(model::Model::Load(path_)).value());
        model2_ =
            std::shared_ptr<model::Model>(std::move(model::Model::Load(path_, {.tp = 2})).value());
    }
    static void TearDownTestSuite() {
        model1_.reset();
        model2_.reset();
        std::remove(path_.c_str());
    }

    static EngineConfig Config() {
        EngineConfig c;
        c.manual_steps = true;
        c.block_tokens = 8;
        c.num_blocks = 256;
        c.max_batched_tokens = 512;
        return c;
    }
    static std::unique_ptr<Engine> Make(const EngineConfig& c, int tp = 1) {
        return std::move(Engine::Create(tp == 1 ? model1_ : model2_, c)).value();
    }
    static std::vector<int32_t> Prompt(int n, int salt) {
        std::vector<int32_t> t;
        for (int i = 0; i < n; ++i) t.push_back((i * 31 + salt * 17 + 3) % 256);
        return t;
    }
    // Submits (id, prompt, max_tokens) greedily and returns what each produced.
    std::map<std::string, Collected> Run(
        Engine* e, const std::vector<std::pair<std::string, std::vector<int32_t>>>& reqs,
        int max_tokens, model::SamplingParams sp = Greedy()) {
        std::map<std::string, Collected> out;
        for (const auto& [id, prompt] : reqs) {
            out[id];
            Request r;
            r.id = id;
            r.prompt = prompt;
            r.sampling = sp;
            r.sampling.max_tokens = max_tokens;
            r.on_output = [&out, id = id](const RequestOutput& o) { Add(&out[id], o); };
            EXPECT_TRUE(e->Submit(std::move(r)).ok());
        }
        e->RunUntilIdle();
        return out;
    }
    static void Add(Collected* c, const RequestOutput& o) {
        c->tokens.insert(c->tokens.end(), o.tokens.begin(), o.tokens.end());
        c->logprobs.insert(c->logprobs.end(), o.logprobs.begin(), o.logprobs.end());
        c->text += o.text;
        c->finish = o.finish;
        c->cached_tokens = o.cached_tokens;
        c->prompt_tokens = o.prompt_tokens;
        c->completion_tokens = o.completion_tokens;
        ++c->events;
    }
    static model::SamplingParams Greedy() {
        model::SamplingParams sp;
        sp.temperature = 0;
        sp.ignore_eos = true;
        return sp;
    }

    static std::string path_;
    static std::shared_ptr<model::Model> model1_, model2_;
};
std::string EngineTest::path_;
std::shared_ptr<model::Model> EngineTest::model1_, EngineTest::model2_;

// A request's text as it streams: whole characters only, a stop string found across tokens and
// cut off, what could begin one held back, an unfinished character at the end made U+FFFD.
TEST(OutputText, StreamsWholeCharactersAndStopsBeforeAStopString) {
    OutputText plain({});
    EXPECT_FALSE(plain.Append("h\xc3"));  // "hé" split inside the é
    EXPECT_EQ(plain.TakeReady(), "h");
    EXPECT_FALSE(plain.Append("\xa9!"));
    EXPECT_EQ(plain.TakeReady(), "\xc3\xa9!");
    EXPECT_FALSE(plain.Append("\xe4\xb8"));
    EXPECT_EQ(plain.TakeReady(), "");
    EXPECT_EQ(plain.TakeRest(), "\xef\xbf\xbd") << "an unfinished character at the end";
    EXPECT_FALSE(plain.Append("\xff"));
    EXPECT_EQ(plain.TakeReady(), "\xef\xbf\xbd") << "a byte that never starts a character";

    OutputText stop({"END", "\n\n"});
    EXPECT_FALSE(stop.Append("abc E"));
    EXPECT_EQ(stop.TakeReady(), "abc") << "the longest stop's length less one is held back";
    EXPECT_FALSE(stop.Append("N"));
    EXPECT_EQ(stop.TakeReady(), " ");
    EXPECT_TRUE(stop.Append("Dxyz")) << "END completed across three tokens";
    EXPECT_EQ(stop.TakeRest(), "") << "the text ends before the stop string";

    OutputText miss({"END"});
    EXPECT_FALSE(miss.Append("EN"));
    EXPECT_FALSE(miss.Append("x"));
    EXPECT_EQ(miss.TakeReady(), "E") << "no longer a stop string's start but the last 2 bytes";
    EXPECT_EQ(miss.TakeRest(), "Nx");
}

// The token budget of a step: 2048 unless set, and never under the max model length without
// chunked prefill (vLLM's rule: a whole prompt fits one step); one set under it is refused.
// (A model longer than 2048 tokens raises the default: PdProcess.SeedFourCommandLines...)
TEST_F(EngineTest, TheDefaultBatchLimitFitsAWholePromptWithoutChunkedPrefill) {
    EngineConfig c = Config();
    c.max_batched_tokens = 0;
    EXPECT_EQ(Make(c)->config().max_batched_tokens, 2048);
    c.chunked_prefill = false;
    EXPECT_EQ(Make(c)->config().max_batched_tokens, 2048);
    c.max_batched_tokens = 100;
    Result<std::unique_ptr<Engine>> small = Engine::Create(model1_, c);
    ASSERT_FALSE(small.ok());
    EXPECT_NE(small.status().message().find("must be at least the max model length (512)"),
              std::string::npos)
        << small.status().ToString();
}

TEST_F(EngineTest, ChunkedPrefillMatchesWholePrefill) {
    auto whole_cfg = Config();
    whole_cfg.chunked_prefill = false;
    auto whole = Make(whole_cfg);
    auto chunked_cfg = Config();
    chunked_cfg.max_batched_tokens = 24;  // a 150-token prompt takes 7 steps
    auto chunked = Make(chunked_cfg);
    auto prompt = Prompt(150, 1);
    auto a = Run(whole.get(), {{"r", prompt}}, 24);
    auto b = Run(chunked.get(), {{"r", prompt}}, 24);
    ASSERT_EQ(a["r"].tokens.size(), 24u);
    EXPECT_EQ(a["r"].tokens, b["r"].tokens);
    EXPECT_EQ(whole->Stats().steps, 24u);
    EXPECT_EQ(chunked->Stats().steps, 7u + 23u);
}

TEST_F(EngineTest, BatchedDecodeMatchesOneSequenceAtATime) {
    std::vector<std::pair<std::string, std::vector<int32_t>>> reqs;
    for (int i = 0; i < 6; ++i) reqs.push_back({"r" + std::to_string(i), Prompt(5 + 13 * i, i)});
    std::map<std::string, Collected> single;
    for (const auto& r : reqs) {
        auto e = Make(Config());
        single[r.first] = Run(e.get(), {r}, 20)[r.first];
    }
    auto e = Make(Config());
    auto batched = Run(e.get(), reqs, 20);
    EXPECT_EQ(e->Stats().steps, 20u);  // all six in every step
    for (const auto& r : reqs) {
        ASSERT_EQ(single[r.first].tokens.size(), 20u);
        EXPECT_EQ(batched[r.first].tokens, single[r.first].tokens) << r.first;
    }
}

TEST_F(EngineTest, PrefixCacheHitMatchesMiss) {
    auto prefix = Prompt(64, 7);
    auto longer = prefix;
    for (int32_t t : Prompt(21, 8)) longer.push_back(t);
    auto cold_cfg = Config();
    cold_cfg.prefix_caching = false;
    auto cold = Make(cold_cfg);
    auto want = Run(cold.get(), {{"b", longer}}, 16)["b"];

    auto warm = Make(Config());
    Run(warm.get(), {{"a", prefix}}, 4);
    auto got = Run(warm.get(), {{"b", longer}}, 16)["b"];
    EXPECT_EQ(got.cached_tokens, 64);
    EXPECT_EQ(got.tokens, want.tokens);
    EngineStats st = warm->Stats();
    EXPECT_EQ(st.prefix_hit_tokens, 64u);
    EXPECT_EQ(st.prefix_query_tokens, 64u + 85u);
    // The same prompt again: everything but the last block comes from the cache.
    auto again = Run(warm.get(), {{"c", longer}}, 16)["c"];
    EXPECT_EQ(again.cached_tokens, 80);
    EXPECT_EQ(again.tokens, want.tokens);
}

TEST_F(EngineTest, PreemptionByRecomputeMatchesAnUnconstrainedRun) {
    std::vector<std::pair<std::string, std::vector<int32_t>>> reqs;
    for (int i = 0; i < 4; ++i) reqs.push_back({"r" + std::to_string(i), Prompt(30, 20 + i)});
    auto roomy = Make(Config());
    auto want = Run(roomy.get(), reqs, 40);
    auto tight_cfg = Config();
    tight_cfg.num_blocks = 20;  // 160 tokens for 4 x 70
    tight_cfg.prefix_caching = false;
    auto tight = Make(tight_cfg);
    auto got = Run(tight.get(), reqs, 40);
    EXPECT_GT(tight->Stats().preemptions, 0u);
    for (const auto& r : reqs) {
        ASSERT_EQ(want[r.first].tokens.size(), 40u);
        EXPECT_EQ(got[r.first].tokens, want[r.first].tokens) << r.first;
        EXPECT_EQ(got[r.first].finish, FinishReason::kLength);
    }
    EXPECT_EQ(tight->Stats().kv_blocks_used, 0);
}

TEST_F(EngineTest, TensorParallelTwoMatchesOne) {
    // TP 2 sums partial products in another order: logits agree to ~1e-5 (model_test), which
    // leaves greedy choices unchanged on this model.
    std::vector<std::pair<std::string, std::vector<int32_t>>> reqs = {
        {"a", Prompt(33, 1)}, {"b", Prompt(70, 2)}, {"c", Prompt(9, 3)}};
    auto tp1 = Make(Config(), 1);
    auto tp2 = Make(Config(), 2);
    auto a = Run(tp1.get(), reqs, 24);
    auto b = Run(tp2.get(), reqs, 24);
    for (const auto& r : reqs) EXPECT_EQ(a[r.first].tokens, b[r.first].tokens) << r.first;
    EXPECT_EQ(tp2->caches().size(), 2u);
    // TP 4 on the model's 2 kv heads: each head on two ranks (each rank's query heads attend to
    // its copy).
    auto tp4 =
        std::move(Engine::Create(std::shared_ptr<model::Model>(
                                     std::move(model::Model::Load(path_, {.tp = 4})).value()),
                                 Config()))
            .value();
    auto c = Run(tp4.get(), reqs, 24);
    for (const auto& r : reqs) EXPECT_EQ(a[r.first].tokens, c[r.first].tokens) << r.first;
    ASSERT_EQ(tp4->caches().size(), 4u);
    EXPECT_EQ(tp4->caches()[0]->spec().kv_heads, 1);
}

// An MLA model through the engine: one latent cache whatever the TP, chunked prefill, batching,
// prefix-cache hits and preemption give the tokens of one sequence alone at TP 1.
TEST_F(EngineTest, MlaServesChunksBatchesPrefixHitsAndTpAlike) {
    testing::TinyModelFile mla("engine-test-mla", testing::TinyMlaModelSpec(512), 13);
    std::vector<std::pair<std::string, std::vector<int32_t>>> reqs = {
        {"a", Prompt(33, 1)}, {"b", Prompt(70, 2)}, {"c", Prompt(9, 3)}};
    auto make = [&](int tp, EngineConfig c) {
        return std::move(Engine::Create(mla.Load(tp), c)).value();
    };
    std::map<std::string, std::vector<int32_t>> alone;
    {
        auto e = make(1, Config());
        ASSERT_EQ(e->caches().size(), 1u);
        EXPECT_TRUE(e->caches()[0]->spec().latent);
        for (const auto& r : reqs) alone[r.first] = Run(e.get(), {r}, 20)[r.first].tokens;
    }
    EngineConfig chunked = Config();
    chunked.max_batched_tokens = 16;  // prompts in chunks, beside the others' decode steps
    for (int tp : {1, 2, 4}) {
        auto e = make(tp, chunked);
        EXPECT_EQ(e->caches().size(), 1u) << "tp " << tp;  // one latent cache for all ranks
        auto got = Run(e.get(), reqs, 20);
        for (const auto& r : reqs) EXPECT_EQ(got[r.first].tokens, alone[r.first]) << r.first;
        // The same prompts again hit the prefix cache: the latents found equal the ones computed.
        auto again = Run(e.get(), reqs, 20);
        for (const auto& r : reqs) {
            EXPECT_EQ(again[r.first].tokens, alone[r.first]) << r.first;
            EXPECT_GT(again[r.first].cached_tokens, 0) << r.first;
        }
    }
}

TEST_F(EngineTest, StopTokensStopStringsAndLogprobs) {
    auto e = Make(Config());
    auto base = Run(e.get(), {{"a", Prompt(12, 5)}}, 12)["a"];
    ASSERT_EQ(base.tokens.size(), 12u);
    // Stop token: the 5th token produced.
    model::SamplingParams sp = Greedy();
    sp.stop_token_ids = {base.tokens[4]};
    auto st = Run(e.get(), {{"b", Prompt(12, 5)}}, 12, sp)["b"];
    size_t first =
        std::find(base.tokens.begin(), base.tokens.end(), base.tokens[4]) - base.tokens.begin();
    EXPECT_EQ(st.tokens.size(), first + 1);
    EXPECT_EQ(st.finish, FinishReason::kStop);
    // Stop string: text up to it, without it (random bytes make replacement characters, so the
    // stop string is cut from the engine's own text).
    ASSERT_GT(base.text.size(), 8u);
    std::string stop = base.text.substr(base.text.size() / 2, 3);
    sp = Greedy();
    sp.logprobs = 0;
    sp.stop = {stop};
    auto ss = Run(e.get(), {{"c", Prompt(12, 5)}}, 12, sp)["c"];
    EXPECT_EQ(ss.finish, FinishReason::kStop);
    EXPECT_EQ(ss.text, base.text.substr(0, base.text.find(stop)));
    ASSERT_EQ(ss.logprobs.size(), ss.tokens.size());
    for (float lp : ss.logprobs) {
        EXPECT_LE(lp, 0.0f);
        EXPECT_GT(lp, -30.0f);
    }
    EXPECT_EQ(ss.prompt_tokens, 12);
}

TEST_F(EngineTest, SeededSamplingIsReproducible) {
    model::SamplingParams sp;
    sp.temperature = 1.0f;
    sp.top_p = 0.9f;
    sp.top_k = 50;
    sp.ignore_eos = true;
    sp.seed = 1234;
    auto e = Make(Config());
    auto a = Run(e.get(), {{"a", Prompt(10, 1)}, {"b", Prompt(10, 1)}}, 30, sp);
    EXPECT_EQ(a["a"].tokens, a["b"].tokens);
    sp.seed = 99;
    auto c = Run(e.get(), {{"c", Prompt(10, 1)}}, 30, sp);
    EXPECT_NE(a["a"].tokens, c["c"].tokens);
}

// A stream continued from output produced elsewhere (a migrated stream, Request::continued)
// goes on exactly as the uninterrupted run: the same tokens and text after the cut, greedy and
// seeded, with the usage of the whole request; continued tokens that already end the request or
// leave nothing of max_tokens are refused.
TEST_F(EngineTest, AContinuedStreamGoesOnAsTheUninterruptedRun) {
    auto e = Make(Config());
    model::SamplingParams seeded;
    seeded.temperature = 0.9f;
    seeded.top_k = 40;
    seeded.ignore_eos = true;
    seeded.seed = 77;
    for (const model::SamplingParams& sp : {Greedy(), seeded}) {
        SCOPED_TRACE(sp.seed ? "seeded" : "greedy");
        const Collected whole = Run(e.get(), {{"whole", Prompt(40, 9)}}, 24, sp)["whole"];
        ASSERT_EQ(whole.tokens.size(), 24u);
        for (size_t cut : {1u, 7u, 23u}) {
            auto fresh = Make(Config());  // no prefix cache from the whole run
            Collected rest;
            Request r;
            r.id = "rest";
            r.prompt = Prompt(40, 9);
            r.sampling = sp;
            r.sampling.max_tokens = 24;
            r.continued.assign(whole.tokens.begin(), whole.tokens.begin() + cut);
            r.on_output = [&rest](const RequestOutput& o) { Add(&rest, o); };
            FERRY_ASSERT_OK(fresh->Submit(std::move(r)));
            fresh->RunUntilIdle();
            EXPECT_EQ(rest.tokens,
                      std::vector<int32_t>(whole.tokens.begin() + cut, whole.tokens.end()))
                << "cut " << cut;
            // What the first worker held back (part of a character) comes from this one.
            ASSERT_LE(rest.text.size(), whole.text.size());
            EXPECT_EQ(whole.text.substr(whole.text.size() - rest.text.size()), rest.text);
            EXPECT_EQ(rest.prompt_tokens, 40);
            EXPECT_EQ(rest.completion_tokens, 24);
            EXPECT_EQ(rest.finish, FinishReason::kLength);
        }
    }
    Request bad;
    bad.id = "bad";
    bad.prompt = Prompt(10, 1);
    bad.sampling = Greedy();
    bad.sampling.max_tokens = 3;
    bad.on_output = [](const RequestOutput&) {};
    bad.continued = {1, 2, 3};
    EXPECT_THAT(e->Submit(bad), StatusHas(Code::kInvalidArgument, "nothing of max_tokens"));
    bad.continued = {1, 2};
    bad.sampling.stop_token_ids = {2};
    EXPECT_THAT(e->Submit(bad), StatusHas(Code::kInvalidArgument, "already end"));
    bad.sampling.stop_token_ids.clear();
    bad.continued = {1, 9999};
    EXPECT_THAT(e->Submit(bad), StatusHas(Code::kInvalidArgument, "outside the vocabulary"));
}

TEST_F(EngineTest, SubmitRefusesBadRequests) {
    auto e = Make(Config());
    auto make = [&](std::vector<int32_t> prompt, int max_tokens) {
        Request r;
        r.id = "x";
        r.prompt = std::move(prompt);
        r.sampling.max_tokens = max_tokens;
        r.on_output = [](const RequestOutput&) {};
        return r;
    };
    EXPECT_THAT(e->Submit(make({}, 4)), StatusHas(Code::kInvalidArgument, "empty"));
    EXPECT_THAT(e->Submit(make({1, 5000}, 4)), StatusHas(Code::kInvalidArgument, "token id 5000"));
    EXPECT_THAT(e->Submit(make(Prompt(500, 1), 20)),
                StatusHas(Code::kInvalidArgument, "maximum context length is 512"));
    EXPECT_THAT(e->Submit(make({1}, 0)), StatusHas(Code::kInvalidArgument, "max_tokens"));
    auto small_cfg = Config();
    small_cfg.num_blocks = 4;
    auto small = Make(small_cfg);
    EXPECT_THAT(small->Submit(make(Prompt(30, 1), 10)),
                StatusHas(Code::kInvalidArgument, "the whole cache holds 32"));
    FERRY_EXPECT_OK(e->Submit(make({1, 2}, 4)));
    EXPECT_THAT(e->Submit(make({1, 2}, 4)), StatusIs(Code::kAlreadyExists));
    e->RunUntilIdle();
    FERRY_EXPECT_OK(e->Submit(make({1, 2}, 4)));  // the id is free again
    e->RunUntilIdle();
}

// The token embedding rows of `tokens` (from the file, as the model reads them).
std::shared_ptr<const std::vector<float>> EmbeddingRows(const std::string& path,
                                                        std::span<const int32_t> tokens) {
    auto f = std::move(gguf::GgufFile::Open(path)).value();
    const int dim = model::ModelConfig::FromGguf(*f)->dim;
    const int vocab = model::ModelConfig::FromGguf(*f)->vocab_size;
    auto table =
        std::move(model::TensorF32(*f, "token_embd.weight", {uint64_t(dim), uint64_t(vocab)}))
            .value();
    auto rows = std::make_shared<std::vector<float>>();
    for (int32_t t : tokens) {
        rows->insert(rows->end(), table.begin() + size_t(t) * dim,
                     table.begin() + size_t(t + 1) * dim);
    }
    return rows;
}

// A request whose prompt has `mm` inputs.
Request MmRequest(const std::string& id, std::vector<int32_t> prompt, std::vector<MmInput> mm,
                  int max_tokens, std::map<std::string, Collected>* out) {
    Request r;
    r.id = id;
    r.prompt = std::move(prompt);
    r.mm = std::move(mm);
    r.sampling.temperature = 0;
    r.sampling.ignore_eos = true;
    r.sampling.max_tokens = max_tokens;
    r.sampling.logprobs = 0;
    (*out)[id];
    r.on_output = [out, id](const RequestOutput& o) {
        Collected& c = (*out)[id];
        c.tokens.insert(c.tokens.end(), o.tokens.begin(), o.tokens.end());
        c.logprobs.insert(c.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
        c.finish = o.finish;
        c.cached_tokens = o.cached_tokens;
    };
    return r;
}

TEST_F(EngineTest, InputEmbeddingsStandInForTheirPlaceholderTokens) {
    // Embeddings equal to the tokens' own rows behind placeholder tokens (id 0) give exactly
    // the plain prompt's output, whole or with the image split over prefill chunks: the rows
    // are used at their positions and nowhere else.
    const auto prompt = Prompt(70, 3);
    auto holes = prompt;
    std::fill(holes.begin() + 13, holes.begin() + 37, 0);
    std::fill(holes.begin() + 40, holes.begin() + 48, 0);
    std::vector<MmInput> mm = {
        {13, 24, std::string(64, 'a'), EmbeddingRows(path_, std::span(prompt).subspan(13, 24))},
        {40, 8, std::string(64, 'b'), EmbeddingRows(path_, std::span(prompt).subspan(40, 8))}};
    auto plain_engine = Make(Config());
    auto want = Run(plain_engine.get(), {{"p", prompt}}, 12)["p"];
    ASSERT_EQ(want.tokens.size(), 12u);
    for (int chunk : {512, 16, 5}) {
        auto c = Config();
        c.max_batched_tokens = chunk;
        auto e = Make(c);
        std::map<std::string, Collected> got;
        FERRY_ASSERT_OK(e->Submit(MmRequest("m", holes, mm, 12, &got)));
        e->RunUntilIdle();
        EXPECT_EQ(got["m"].tokens, want.tokens) << "chunk " << chunk;
        EXPECT_EQ(got["m"].finish, FinishReason::kLength);
    }
    // Without the embeddings the placeholders are just tokens: another answer.
    auto e = Make(Config());
    auto bare = Run(e.get(), {{"h", holes}}, 12)["h"];
    EXPECT_NE(bare.tokens, want.tokens);
}

TEST_F(EngineTest, ThePrefixCacheKeysImageBlocksOnTheImageHash) {
    // Two images behind the same placeholder tokens: the second finds only the blocks before
    // the image in the cache; the first again finds everything but the last block, and both
    // answer as they did from an empty cache.
    auto prompt = Prompt(64, 5);
    std::fill(prompt.begin() + 20, prompt.begin() + 36, 0);  // blocks 2..4 of 8 tokens
    auto image = [&](int salt) { return EmbeddingRows(path_, Prompt(16, salt)); };
    const MmInput x{20, 16, std::string(64, '1'), image(40)};
    const MmInput y{20, 16, std::string(64, '2'), image(41)};
    std::map<std::string, Collected> cold;
    for (const auto& [id, m] : {std::pair{"x", x}, {"y", y}}) {
        auto e = Make(Config());
        FERRY_ASSERT_OK(e->Submit(MmRequest(id, prompt, {m}, 10, &cold)));
        e->RunUntilIdle();
    }
    ASSERT_NE(cold["x"].logprobs, cold["y"].logprobs);

    auto warm = Make(Config());
    std::map<std::string, Collected> got;
    for (const auto& [id, m] : {std::pair{"x1", x}, {"y1", y}, {"x2", x}, {"y2", y}}) {
        FERRY_ASSERT_OK(warm->Submit(MmRequest(id, prompt, {m}, 10, &got)));
        warm->RunUntilIdle();
    }
    EXPECT_EQ(got["x1"].cached_tokens, 0);
    EXPECT_EQ(got["y1"].cached_tokens, 16);  // blocks 0 and 1 hold no image
    EXPECT_EQ(got["x2"].cached_tokens, 56);
    EXPECT_EQ(got["y2"].cached_tokens, 56);
    for (const char* id : {"x1", "x2"}) EXPECT_EQ(got[id].tokens, cold["x"].tokens) << id;
    for (const char* id : {"y1", "y2"}) EXPECT_EQ(got[id].tokens, cold["y"].tokens) << id;
    // A text prompt of the same token ids shares nothing past the image's start either.
    auto text = Run(warm.get(), {{"t", prompt}}, 4)["t"];
    EXPECT_EQ(text.cached_tokens, 16);
}

TEST_F(EngineTest, SubmitRefusesMultimodalInputsThatDoNotFit) {
    auto e = Make(Config());
    const auto prompt = Prompt(40, 1);
    const std::string h(64, 'c');
    std::map<std::string, Collected> out;
    auto refused = [&](std::vector<MmInput> mm) {
        return e->Submit(MmRequest("bad", prompt, std::move(mm), 4, &out));
    };
    const int dim = model1_->config().dim;
    auto fit = [&](int n) { return std::make_shared<std::vector<float>>(size_t(n) * dim, 0.f); };
    EXPECT_THAT(refused({{30, 20, h, fit(20)}}), StatusHas(Code::kInvalidArgument, "does not fit"));
    EXPECT_THAT(refused({{5, 10, h, fit(10)}, {10, 4, h, fit(4)}}),
                StatusHas(Code::kInvalidArgument, "multimodal input 1"));
    EXPECT_THAT(refused({{5, 10, h, fit(9)}}),
                StatusHas(Code::kInvalidArgument, "576 embedding values for width 64"));
    EXPECT_THAT(refused({{5, 10, "", fit(10)}}), StatusHas(Code::kInvalidArgument, "no hash"));
    EXPECT_THAT(refused({{5, 0, h, fit(0)}}), StatusHas(Code::kInvalidArgument, "input 0"));
    EXPECT_THAT(refused({{5, 10, h, nullptr}}), StatusHas(Code::kInvalidArgument, "input 0"));
    FERRY_EXPECT_OK(e->Submit(MmRequest("ok", prompt, {{5, 10, h, fit(10)}}, 4, &out)));
    e->RunUntilIdle();
    EXPECT_EQ(out["ok"].finish, FinishReason::kLength);
}

TEST_F(EngineTest, AbortFreesBlocksAndEndsTheStream) {
    auto e = Make(Config());
    Collected c;
    Request r;
    r.id = "long";
    r.prompt = Prompt(40, 3);
    r.sampling = Greedy();
    r.sampling.max_tokens = 400;
    r.on_output = [&](const RequestOutput& o) { Add(&c, o); };
    FERRY_ASSERT_OK(e->Submit(std::move(r)));
    for (int i = 0; i < 5; ++i) e->Step();
    EXPECT_GT(e->Stats().kv_blocks_used, 0);
    e->Abort("long");
    e->Step();
    EXPECT_EQ(c.finish, FinishReason::kAbort);
    EXPECT_EQ(c.tokens.size(), 5u);  // one from the prefill step, one per decode step
    EXPECT_EQ(e->Stats().kv_blocks_used, 0);
    EXPECT_EQ(e->Stats().running, 0);
}

// A client that got its final output finds the request gone from the stats (ferry serve's
// /metrics reads them right after answering).
TEST_F(EngineTest, WhenTheFinalOutputArrivesTheStatsNoLongerCountTheRequest) {
    auto e = Make(Config());
    std::map<std::string, EngineStats> seen;  // by request, from inside its final callback
    for (auto [id, max_tokens] : {std::pair<std::string, int>{"short", 2}, {"long", 6}}) {
        Request r;
        r.id = id;
        r.prompt = Prompt(20, max_tokens);
        r.sampling = Greedy();
        r.sampling.max_tokens = max_tokens;
        r.on_output = [&, id = id](const RequestOutput& o) {
            if (o.finish != FinishReason::kNone) seen[id] = e->Stats();
        };
        FERRY_ASSERT_OK(e->Submit(std::move(r)));
    }
    e->RunUntilIdle();
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_EQ(seen["short"].running, 1);  // only "long"
    EXPECT_EQ(seen["short"].requests_finished, 1);
    EXPECT_EQ(seen["long"].running, 0);
    EXPECT_EQ(seen["long"].kv_blocks_used, 0);
}

TEST_F(EngineTest, StepThreadServesConcurrentSubmitters) {
    auto cfg = Config();
    cfg.manual_steps = false;
    cfg.max_num_seqs = 4;
    auto e = Make(cfg);
    std::mutex mu;
    std::condition_variable cv;
    std::map<std::string, Collected> out;
    int done = 0;
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
            for (int i = 0; i < 3; ++i) {
                std::string id = fmt::format("t{}-{}", t, i);
                Request r;
                r.id = id;
                r.prompt = Prompt(10 + i * 7, t);
                r.sampling = Greedy();
                r.sampling.max_tokens = 8;
                r.on_output = [&, id](const RequestOutput& o) {
                    std::lock_guard lock(mu);
                    Add(&out[id], o);
                    if (o.finish != FinishReason::kNone) {
                        ++done;
                        cv.notify_all();
                    }
                };
                EXPECT_TRUE(e->Submit(std::move(r)).ok());
            }
        });
    }
    for (auto& t : threads) t.join();
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return done == 12; }));
    for (auto& [id, c] : out) {
        EXPECT_EQ(c.tokens.size(), 8u) << id;
        EXPECT_EQ(c.finish, FinishReason::kLength) << id;
    }
}

TEST_F(EngineTest, KvCacheInAgentMemoryIsReadableByAPeerOverTcp) {
    // The cache lives in a region the transfer Agent allocated, as a KV connector sets it up; a
    // peer reads it back byte for byte.
    for (kv::KvDtype dtype : {kv::KvDtype::kF32, kv::KvDtype::kBF16}) {
        testing::AgentPair pair = testing::MakePair("tcp");
        Agent* owner = pair.a.get();
        std::vector<RegionInfo> regions;
        auto cfg = Config();
        cfg.kv_dtype = dtype;
        cfg.num_blocks = 16;
        cfg.allocator.allocate = [&](size_t bytes) -> Result<std::span<std::byte>> {
            FERRY_ASSIGN_OR_RETURN(RegionInfo r, owner->AllocateRegion(bytes));
            regions.push_back(r);
            return std::span(static_cast<std::byte*>(r.base), r.length);
        };
        cfg.allocator.release = [&](std::span<std::byte> mem) {
            for (const RegionInfo& r : regions) {
                if (r.base == mem.data()) (void)owner->Deregister(r.id);
            }
        };
        auto e = Make(cfg);
        ASSERT_EQ(regions.size(), 1u);
        Run(e.get(), {{"a", Prompt(40, 9)}}, 1);
        std::span<std::byte> kv = e->caches()[0]->memory();
        ASSERT_NE(std::count(kv.begin(), kv.end(), std::byte{0}),
                  static_cast<ptrdiff_t>(kv.size()));

        auto local = std::move(pair.b->AllocateRegion(regions[0].length)).value();
        Descriptor l{local.id, 0, regions[0].length}, r{regions[0].id, 0, regions[0].length};
        auto connected = pair.b->Connect(pair.a->ListenAddress());
        FERRY_ASSERT_OK(connected.status());
        const std::string peer = *connected;
        auto x = pair.b->PostRead({&l, 1}, peer, {&r, 1});
        FERRY_ASSERT_OK(x.status());
        FERRY_ASSERT_OK(x->Wait(std::chrono::seconds(30)));
        EXPECT_EQ(std::memcmp(local.base, kv.data(), kv.size()), 0) << kv::KvDtypeName(dtype);
    }
}

}  // namespace
}  // namespace ferry::engine
