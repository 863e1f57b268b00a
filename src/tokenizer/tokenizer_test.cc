// Tokenizers built from small hand-made GGUF vocabularies with known answers.
#include "tokenizer/tokenizer.h"

#include <fmt/core.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <set>

#include "model/model.h"
#include "testing/testing.h"

namespace ferry::tokenizer {
namespace {

using ::ferry::testing::StatusHas;
using ::testing::ElementsAre;

std::string TempPath(const std::string& name) {
    return (std::filesystem::temp_directory_path() /
            (name + "-" + std::to_string(getpid()) + ".gguf"))
        .string();
}

std::unique_ptr<Tokenizer> Load(const gguf::GgufWriter& w, const std::string& name) {
    std::string path = TempPath(name);
    EXPECT_TRUE(w.Write(path).ok());
    auto file = std::move(gguf::GgufFile::Open(path)).value();
    auto t = Tokenizer::FromGguf(*file);
    std::remove(path.c_str());
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return std::move(t).value();
}

// A SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens, then pieces with scores.
std::unique_ptr<Tokenizer> SpmTokenizer(std::vector<std::string>* tokens_out = nullptr) {
    std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
    std::vector<int32_t> types = {2, 3, 3};
    std::vector<float> scores = {0, 0, 0};
    for (int b = 0; b < 256; ++b) {
        tokens.push_back(fmt::format("<0x{:02X}>", b));
        types.push_back(6);
        scores.push_back(0);
    }
    // Higher score merges first.
    const std::vector<std::pair<std::string, float>> pieces = {{"\xe2\x96\x81", -1},
                                                               {"h", -2},
                                                               {"e", -2},
                                                               {"l", -2},
                                                               {"o", -2},
                                                               {"w", -2},
                                                               {"r", -2},
                                                               {"d", -2},
                                                               {"ll", -3},
                                                               {"he", -4},
                                                               {"\xe2\x96\x81h", -5},
                                                               {"llo", -6},
                                                               {"\xe2\x96\x81he", -7},
                                                               {"\xe2\x96\x81hello", -8},
                                                               {"\xe2\x96\x81w", -9},
                                                               {"or", -10},
                                                               {"ld", -11},
                                                               {"\xe2\x96\x81wor", -12},
                                                               {"\xe2\x96\x81world", -13}};
    for (const auto& [p, s] : pieces) {
        tokens.push_back(p);
        types.push_back(1);
        scores.push_back(s);
    }
    gguf::GgufWriter w;
    w.SetString("tokenizer.ggml.model", "llama");
    w.SetStringArray("tokenizer.ggml.tokens", tokens);
    w.SetInt32Array("tokenizer.ggml.token_type", types);
    w.SetFloat32Array("tokenizer.ggml.scores", scores);
    w.SetUint32("tokenizer.ggml.bos_token_id", 1);
    w.SetUint32("tokenizer.ggml.eos_token_id", 2);
    w.SetUint32("tokenizer.ggml.unknown_token_id", 0);
    if (tokens_out) *tokens_out = tokens;
    return Load(w, "spm");
}

std::vector<std::string> Pieces(const Tokenizer& t, const std::vector<int32_t>& ids) {
    std::vector<std::string> out;
    for (int32_t id : ids) out.push_back(t.token_text(id));
    return out;
}

TEST(SentencePiece, MergesByScoreWithSpacePrefixAndByteFallback) {
    auto t = SpmTokenizer();
    EXPECT_EQ(t->kind(), Tokenizer::Kind::kSentencePiece);
    EXPECT_TRUE(t->add_bos());
    auto ids = t->Encode("hello world", true);
    EXPECT_THAT(Pieces(*t, ids), ElementsAre("<s>", "\xe2\x96\x81hello", "\xe2\x96\x81world"));
    EXPECT_EQ(t->Decode(ids), " hello world");  // the space prefix decodes as a space
    // 'é' (C3 A9) is not a piece: byte fallback.
    ids = t->Encode("h\xc3\xa9", false);
    EXPECT_THAT(Pieces(*t, ids), ElementsAre("\xe2\x96\x81h", "<0xC3>", "<0xA9>"));
    EXPECT_EQ(t->Decode(ids), " h\xc3\xa9");
    // Control tokens in the text are single tokens.
    ids = t->Encode("hello</s>", false);
    EXPECT_THAT(Pieces(*t, ids), ElementsAre("\xe2\x96\x81hello", "</s>"));
    EXPECT_EQ(t->TokenBytes(ids.back()), "");
    EXPECT_THAT(t->stop_ids(), ElementsAre(2));
}

gguf::GgufWriter BpeWriter(const std::string& pre) {
    // Byte tokens in GPT-2's mapping, merges for " the", "he", "llo", specials.
    std::vector<std::string> tokens;
    std::vector<int32_t> types;
    for (int b = 0; b < 256; ++b) {
        tokens.push_back(ByteLevelToken(static_cast<uint8_t>(b)));
        types.push_back(1);
    }
    // U+0120 'Ġ' is the space byte.
    for (const char* t :
         {"\xc4\xa0t", "he", "\xc4\xa0the", "ll", "llo", "\xc4\xa0he", "\xc4\xa0hello"}) {
        tokens.emplace_back(t);
        types.push_back(1);
    }
    for (const char* s :
         {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}) {
        tokens.emplace_back(s);
        types.push_back(3);
    }
    gguf::GgufWriter w;
    w.SetString("tokenizer.ggml.model", "gpt2");
    w.SetString("tokenizer.ggml.pre", pre);
    w.SetStringArray("tokenizer.ggml.tokens", tokens);
    w.SetInt32Array("tokenizer.ggml.token_type", types);
    w.SetStringArray("tokenizer.ggml.merges", {"\xc4\xa0 t", "h e", "\xc4\xa0t he", "l l", "ll o",
                                               "\xc4\xa0 he", "\xc4\xa0he llo"});
    w.SetUint32("tokenizer.ggml.bos_token_id", 263);
    w.SetUint32("tokenizer.ggml.eos_token_id", 266);
    w.SetString("tokenizer.chat_template", "{{ '<|start_header_id|>' }} ...");
    return w;
}

TEST(ByteBpe, MergesByRankAndRoundTripsAnyBytes) {
    auto t = Load(BpeWriter("llama-bpe"), "bpe");
    EXPECT_EQ(t->kind(), Tokenizer::Kind::kByteBpe);
    EXPECT_FALSE(t->add_bos());
    auto ids = t->Encode("hello the", false);
    // "hello" has no leading space: h + e merge to "he", "llo" stays; " the" merges fully.
    EXPECT_THAT(Pieces(*t, ids), ElementsAre("he", "llo", "\xc4\xa0the"));
    ids = t->Encode(" hello", false);
    EXPECT_THAT(Pieces(*t, ids), ElementsAre("\xc4\xa0hello"));
    std::string any = "tab\there, newline\n\nunicode \xe4\xb8\xad\xe6\x96\x87 123456 it's ok";
    EXPECT_EQ(t->Decode(t->Encode(any, false)), any);
    std::string binary;
    for (int b = 0; b < 256; ++b) binary.push_back(static_cast<char>(b));
    EXPECT_EQ(t->Decode(t->Encode(binary, false)), binary);
    EXPECT_EQ(t->chat_template(), ChatTemplate::kLlama3);
    EXPECT_THAT(t->stop_ids(), ElementsAre(266));
}

TEST(ByteBpe, PreTokenizerSplitsLikeTheRegexes) {
    // With no merges the pieces are bytes; the splits show through words that merge inside but
    // never across a split: "he" merges in "he's" but the contraction stays apart.
    auto gpt2 = Load(BpeWriter("default"), "bpe-gpt2");
    EXPECT_THAT(Pieces(*gpt2, gpt2->Encode("he's", false)), ElementsAre("he", "'", "s"));
    // Llama 3 splits digits in groups of three; GPT-2 keeps the run.
    auto l3 = Load(BpeWriter("llama-bpe"), "bpe-l3");
    EXPECT_EQ(l3->Encode("1234567", false).size(), 7u);
    EXPECT_EQ(l3->Decode(l3->Encode("1234567", false)), "1234567");
    // SmolLM and Qwen2 split digits one by one; round trips stay exact everywhere.
    for (const char* pre : {"smollm", "qwen2", "default", "llama-bpe"}) {
        auto t = Load(BpeWriter(pre), std::string("bpe-") + pre);
        std::string text = "In 2024, 12 345 cats  ran\n\n  away 7x.";
        EXPECT_EQ(t->Decode(t->Encode(text, false)), text) << pre;
    }
}

TEST(ByteBpe, PreTokensMatchWhatTheRegexesGive) {
    using V = std::vector<std::string_view>;
    EXPECT_EQ(SplitPreTokens("Hello world's 123  abc\n", "gpt-2"),
              (V{"Hello", " world", "'s", " 123", " ", " abc", "\n"}));
    // llama.cpp's default list isolates punctuation and numbers before GPT-2's regex runs.
    EXPECT_EQ(SplitPreTokens("Hello world's 1234  abc\n", "default"),
              (V{"Hello", " world", "'", "s", " ", "123", "4", " ", " abc", "\n"}));
    // Falcon: punctuation first, then GPT-2's regex, then digits in threes from the left.
    EXPECT_EQ(SplitPreTokens("y'all 33333", "falcon"), (V{"y", "'", "all", " ", "333", "33"}));
    // DeepSeek Coder: newlines, \s?\p{L}+, \s?\p{P}+, CJK runs, then single numbers ('½' is one).
    EXPECT_EQ(SplitPreTokens("a\n 4 \xc2\xbd b.", "deepseek-coder"),
              (V{"a", "\n", " ", "4", " ", "\xc2\xbd", " b", "."}));
    EXPECT_EQ(SplitPreTokens("Hello world's 1234567  abc\n\n x", "llama-bpe"),
              (V{"Hello", " world", "'s", " ", "123", "456", "7", " ", " abc", "\n\n", " x"}));
    EXPECT_EQ(SplitPreTokens("IT'S ok!!\n", "llama-bpe"), (V{"IT", "'S", " ok", "!!\n"}));
    EXPECT_EQ(SplitPreTokens("a 12", "smollm"), (V{"a", " ", "1", "2"}));
    EXPECT_EQ(SplitPreTokens("a 12", "qwen2"), (V{"a", " ", "1", "2"}));
    EXPECT_EQ(SplitPreTokens("x  \t y", "gpt-2"), (V{"x", "  \t", " y"}));
}

TEST(ChatTemplates, RenderTheKnownFormats) {
    std::vector<ChatMessage> msgs = {{"system", "Be brief."}, {"user", "Hi!"}};
    auto t = Load(BpeWriter("llama-bpe"), "chat");
    t->set_chat_template(ChatTemplate::kLlama3);
    EXPECT_EQ(*t->ApplyChatTemplate(msgs, true),
              "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n");
    // The rendered control tokens become single tokens.
    auto ids = t->Encode(*t->ApplyChatTemplate(msgs, true), false);
    EXPECT_EQ(t->token_text(ids[0]), "<|begin_of_text|>");
    EXPECT_EQ(t->token_text(ids[1]), "<|start_header_id|>");
    t->set_chat_template(ChatTemplate::kChatMl);
    EXPECT_EQ(*t->ApplyChatTemplate(msgs, true),
              "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
              "<|im_start|>assistant\n");
    t->set_chat_template(ChatTemplate::kLlama2);
    EXPECT_EQ(*t->ApplyChatTemplate(msgs, true),
              "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi! [/INST]");
    EXPECT_THAT(t->ApplyChatTemplate({{{"wizard", "x"}}}, true).status(),
                StatusHas(Code::kInvalidArgument, "role 'wizard'"));
}

TEST(Tokenizer, PresetVocabularyIsBytesPlusChatMl) {
    std::string path = TempPath("preset");
    model::RandomModelSpec s;
    s.dim = 32;
    s.num_layers = 1;
    s.num_heads = 2;
    s.num_kv_heads = 1;
    s.ffn_dim = 32;
    ASSERT_TRUE(model::WriteRandomModel(s, 1, path).ok());
    auto file = std::move(gguf::GgufFile::Open(path)).value();
    auto t = std::move(Tokenizer::FromGguf(*file)).value();
    std::remove(path.c_str());
    EXPECT_EQ(t->vocab_size(), 259);
    EXPECT_EQ(t->chat_template(), ChatTemplate::kChatMl);
    auto ids = t->Encode("<|im_start|>user\nhi<|im_end|>", false);
    EXPECT_EQ(ids.size(), 1u + 7u + 1u);  // "user\nhi" is 7 byte tokens
    EXPECT_EQ(t->token_text(ids[0]), "<|im_start|>");
    EXPECT_THAT(t->stop_ids(), ElementsAre(256, 258));
}

TEST(Tokenizer, RefusesInconsistentMetadata) {
    gguf::GgufWriter w;
    w.SetString("tokenizer.ggml.model", "llama");
    w.SetStringArray("tokenizer.ggml.tokens", {"a", "b"});
    w.SetFloat32Array("tokenizer.ggml.scores", {0});
    std::string path = TempPath("bad-tok");
    ASSERT_TRUE(w.Write(path).ok());
    auto file = std::move(gguf::GgufFile::Open(path)).value();
    EXPECT_THAT(Tokenizer::FromGguf(*file).status(),
                StatusHas(Code::kInvalidArgument, "tokenizer.ggml.scores: 1 entries for 2 tokens"));
    gguf::GgufWriter w2;
    w2.SetString("tokenizer.ggml.model", "bert");
    ASSERT_TRUE(w2.Write(path).ok());
    file = std::move(gguf::GgufFile::Open(path)).value();
    EXPECT_THAT(Tokenizer::FromGguf(*file).status(),
                StatusHas(Code::kInvalidArgument, "tokenizer.ggml.model 'bert'"));
    gguf::GgufWriter w3;
    w3.SetString("tokenizer.ggml.model", "gpt2");
    w3.SetStringArray("tokenizer.ggml.tokens", {"a", "b"});
    w3.SetStringArray("tokenizer.ggml.merges", {"ab"});
    ASSERT_TRUE(w3.Write(path).ok());
    file = std::move(gguf::GgufFile::Open(path)).value();
    EXPECT_THAT(Tokenizer::FromGguf(*file).status(),
                StatusHas(Code::kInvalidArgument, "tokenizer.ggml.merges[0] 'ab'"));
    std::remove(path.c_str());
}

// Numbers that no token type or float score can hold are refused by name, before any conversion
// (the gguf fuzzer found a token type of 2^32 converted to int).
TEST(Tokenizer, RefusesTokenTypesAndScoresOutOfRange) {
    std::string path = TempPath("bad-tok-range");
    auto load = [&](gguf::GgufWriter& w) {
        w.SetString("tokenizer.ggml.model", "llama");
        w.SetStringArray("tokenizer.ggml.tokens", {"a", "b"});
        EXPECT_TRUE(w.Write(path).ok());
        auto file = std::move(gguf::GgufFile::Open(path)).value();
        return Tokenizer::FromGguf(*file).status();
    };
    for (double type : {4294967296.0, -1.0, 7.0, 1.5, std::nan("")}) {
        SCOPED_TRACE(type);
        gguf::GgufWriter w;
        w.SetFloat64Array("tokenizer.ggml.token_type", {1, type});
        w.SetFloat32Array("tokenizer.ggml.scores", {0, 0});
        EXPECT_THAT(load(w), StatusHas(Code::kInvalidArgument, "tokenizer.ggml.token_type[1] = "));
    }
    for (double score : {1e300, -1e39, std::nan("")}) {
        SCOPED_TRACE(score);
        gguf::GgufWriter w;
        w.SetFloat64Array("tokenizer.ggml.scores", {0, score});
        EXPECT_THAT(load(w), StatusHas(Code::kInvalidArgument, "tokenizer.ggml.scores[1] = "));
    }
    gguf::GgufWriter fine;
    fine.SetFloat64Array("tokenizer.ggml.token_type", {0, 6});
    fine.SetFloat64Array("tokenizer.ggml.scores",
                         {-1e30, -std::numeric_limits<double>::infinity()});
    FERRY_EXPECT_OK(load(fine));
    std::remove(path.c_str());
}

// --- Real vocabularies ---------------------------------------------------------------------------
// tests/data/tokenizers/: vocabulary-only GGUF files of five model families with llama.cpp's test
// strings and the ids the models' own (Hugging Face) tokenizers give for them. Every string must
// come out with exactly those ids, as llama.cpp's test-tokenizer-0 checks its tokenizers: no bos,
// special-token texts not parsed.
struct VocabCase {
    std::string name;
    std::vector<std::string> texts;
    std::vector<std::vector<int32_t>> ids;
};

std::string ReadAll(const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    EXPECT_NE(f, nullptr) << path;
    if (!f) return "";
    std::string out;
    char buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
    std::fclose(f);
    return out;
}

std::string VocabPath(const std::string& name) {
    return std::string(FERRY_SOURCE_DIR) + "/tests/data/tokenizers/ggml-vocab-" + name + ".gguf";
}

VocabCase LoadVocabCase(const std::string& name) {
    VocabCase c{name, {}, {}};
    const std::string inp = ReadAll(VocabPath(name) + ".inp");
    const std::string sep = "\n__ggml_vocab_test__\n";
    for (size_t at = 0; at < inp.size();) {
        size_t end = inp.find(sep, at);
        if (end == std::string::npos) break;
        c.texts.push_back(inp.substr(at, end - at));
        at = end + sep.size();
    }
    const std::string out = ReadAll(VocabPath(name) + ".out");
    for (size_t at = 0; at < out.size();) {
        size_t end = out.find('\n', at);
        if (end == std::string::npos) end = out.size();
        std::vector<int32_t> ids;
        const std::string line = out.substr(at, end - at);
        for (size_t i = 0; i < line.size();) {
            if (line[i] == ' ') {
                ++i;
                continue;
            }
            size_t used = 0;
            ids.push_back(std::stoi(line.substr(i), &used));
            i += used;
        }
        c.ids.push_back(std::move(ids));
        at = end + 1;
    }
    return c;
}

class RealVocab : public ::testing::TestWithParam<std::string> {};

TEST_P(RealVocab, EveryTestStringGivesTheModelsIds) {
    VocabCase c = LoadVocabCase(GetParam());
    ASSERT_GT(c.texts.size(), 20u);
    ASSERT_EQ(c.texts.size(), c.ids.size()) << "inp and out of " << c.name << " disagree";
    auto file = gguf::GgufFile::Open(VocabPath(c.name));
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    auto t = Tokenizer::FromGguf(**file);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    size_t wrong = 0;
    for (size_t i = 0; i < c.texts.size(); ++i) {
        std::vector<int32_t> got = (*t)->Encode(c.texts[i], /*add_bos=*/false,
                                                /*parse_special=*/false);
        if (got != c.ids[i]) {
            ++wrong;
            auto texts = [&](const std::vector<int32_t>& ids) {
                std::string s;
                for (int32_t id : ids) {
                    s += fmt::format(
                        "{}{}='{}'", s.empty() ? "" : " ", id,
                        id >= 0 && id < (*t)->vocab_size() ? (*t)->token_text(id) : "?");
                }
                return s;
            };
            ADD_FAILURE() << c.name << " string " << i << " '" << c.texts[i] << "':\n got  "
                          << texts(got) << "\n want " << texts(c.ids[i]);
        }
        // Decoding gives the text back (these vocabularies have no unknown bytes).
        EXPECT_EQ((*t)->Decode(got),
                  (*t)->kind() == Tokenizer::Kind::kSentencePiece && !c.texts[i].empty()
                      ? " " + c.texts[i]
                      : c.texts[i])
            << c.name << " string " << i;
    }
    EXPECT_EQ(wrong, 0u) << c.name;
}

INSTANTIATE_TEST_SUITE_P(Families, RealVocab,
                         ::testing::Values("gpt-2", "llama-spm", "phi-3", "deepseek-coder",
                                           "falcon"),
                         [](const auto& info) {
                             std::string s = info.param;
                             std::replace(s.begin(), s.end(), '-', '_');
                             return s;
                         });

TEST(Tokenizer, LogprobNamesAreDistinctForPartialCharactersAndControlTokens) {
    std::string path = TempPath("logprob-names");
    model::RandomModelSpec spec;
    spec.dim = 16;
    spec.num_layers = 1;
    spec.num_heads = 2;
    spec.num_kv_heads = 1;
    spec.ffn_dim = 16;
    ASSERT_TRUE(model::WriteRandomModel(spec, 1, path).ok());
    auto file = std::move(gguf::GgufFile::Open(path)).value();
    auto t = std::move(Tokenizer::FromGguf(*file)).value();
    std::remove(path.c_str());
    EXPECT_EQ(t->LogprobName('a'), "a");
    EXPECT_EQ(t->LogprobName(0xe2), "bytes:\\xe2");
    EXPECT_EQ(t->LogprobBytes(0xe2), "\xe2");
    EXPECT_EQ(t->LogprobName(0xff), "bytes:\\xff");
    EXPECT_EQ(t->LogprobName(258), "<|im_end|>");  // control: its own text
    EXPECT_EQ(t->TokenBytes(258), "");             // but no bytes of the answer
    std::set<std::string> names;
    for (int32_t id = 0; id < t->vocab_size(); ++id) names.insert(t->LogprobName(id));
    EXPECT_EQ(names.size(), static_cast<size_t>(t->vocab_size()));
    std::vector<int32_t> ids = {257, 'h', 'i', 258};
    EXPECT_EQ(t->Decode(ids), "hi");
    EXPECT_EQ(t->Decode(ids, /*specials=*/true), "<|im_start|>hi<|im_end|>");
}

TEST(Utf8, ValidityIsExact) {
    EXPECT_TRUE(IsValidUtf8(""));
    EXPECT_TRUE(IsValidUtf8("a\xc3\xbc\xe4\xb8\x96\xf0\x9f\xa6\x99"));
    EXPECT_FALSE(IsValidUtf8("\xe4\xb8"));          // truncated
    EXPECT_FALSE(IsValidUtf8("\x80"));              // lone continuation
    EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));          // overlong
    EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // surrogate
    EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // beyond U+10FFFF
}

}  // namespace
}  // namespace ferry::tokenizer
