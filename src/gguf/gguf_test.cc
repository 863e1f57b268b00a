#include "gguf/gguf.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "testing/testing.h"

namespace ferry::gguf {
namespace {

using ::ferry::testing::StatusIs;
using ::ferry::testing::ValueOrDie;

class Gguf : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/ferry-gguf-XXXXXX";
        dir_ = mkdtemp(tmpl);
    }
    void TearDown() override { std::filesystem::remove_all(dir_); }

    std::string Path(const std::string& name) const { return dir_ + "/" + name; }

    static std::string Floats(std::initializer_list<float> v) {
        std::string s(v.size() * 4, '\0');
        std::memcpy(s.data(), std::data(v), s.size());
        return s;
    }

    // A small but complete file: every scalar type the writer has, arrays, three tensor types.
    std::string WriteSample() {
        GgufWriter w;
        w.SetString("general.architecture", "llama");
        w.SetUint32("llama.block_count", 4);
        w.SetUint64("big", uint64_t{1} << 40);
        w.SetInt32("neg", -7);
        w.SetFloat32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
        w.SetBool("flag", true);
        w.SetStringArray("tokenizer.ggml.tokens", {"<s>", "</s>", "a", ""});
        w.SetInt32Array("tokenizer.ggml.token_type", {3, 3, 1, 1});
        w.SetFloat32Array("tokenizer.ggml.scores", {0.f, 0.f, -1.5f, -2.f});
        EXPECT_TRUE(
            w.AddTensor("a.weight", {3, 2}, TensorType::kF32, Floats({1, 2, 3, 4, 5, 6})).ok());
        EXPECT_TRUE(w.AddTensor("b.weight", {5}, TensorType::kF16, std::string(10, '\x3c')).ok());
        EXPECT_TRUE(w.AddTensor("c.weight", {1, 1, 3}, TensorType::kBF16,
                                std::string("\x80\x3f\x00\x40\x40\x40", 6))
                        .ok());
        std::string p = Path("sample.gguf");
        EXPECT_TRUE(w.Write(p).ok());
        return p;
    }

    static std::string Slurp(const std::string& p) {
        std::ifstream in(p, std::ios::binary);
        return std::string(std::istreambuf_iterator<char>(in), {});
    }
    std::string Spit(const std::string& name, const std::string& bytes) {
        std::string p = Path(name);
        std::ofstream(p, std::ios::binary)
            .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
        return p;
    }

    std::string dir_;
};

TEST_F(Gguf, WriteThenReadRoundTrip) {
    auto f = ValueOrDie(GgufFile::Open(WriteSample()));
    EXPECT_EQ(f->version(), 3u);
    EXPECT_EQ(f->alignment(), 32u);
    EXPECT_EQ(ValueOrDie(f->GetString("general.architecture")), "llama");
    EXPECT_EQ(ValueOrDie(f->GetUint("llama.block_count")), 4u);
    EXPECT_EQ(ValueOrDie(f->GetUint("big")), uint64_t{1} << 40);
    EXPECT_THAT(f->GetUint("neg"), StatusIs(Code::kInvalidArgument));
    EXPECT_FLOAT_EQ(
        static_cast<float>(ValueOrDie(f->GetFloat("llama.attention.layer_norm_rms_epsilon"))),
        1e-5f);
    EXPECT_EQ(std::get<bool>(f->Find("flag")->scalar), true);
    EXPECT_EQ(ValueOrDie(f->GetStringArray("tokenizer.ggml.tokens")),
              (std::vector<std::string>{"<s>", "</s>", "a", ""}));
    EXPECT_EQ(f->Find("tokenizer.ggml.token_type")->array.size(), 4u);
    EXPECT_DOUBLE_EQ(std::get<double>(f->Find("tokenizer.ggml.scores")->array[2].scalar), -1.5);
    EXPECT_THAT(f->GetString("missing"), StatusIs(Code::kNotFound));
    EXPECT_THAT(f->GetString("llama.block_count"), StatusIs(Code::kInvalidArgument));

    ASSERT_EQ(f->tensors().size(), 3u);
    const GgufTensor* a = f->FindTensor("a.weight");
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(a->dims, (std::vector<uint64_t>{3, 2}));
    EXPECT_EQ(a->bytes, 24u);
    float got[6];
    std::memcpy(got, a->data, sizeof(got));
    EXPECT_EQ(got[5], 6.f);
    const GgufTensor* c = f->FindTensor("c.weight");
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->type, TensorType::kBF16);
    EXPECT_EQ(c->elements(), 3u);
    EXPECT_EQ(std::memcmp(c->data, "\x80\x3f\x00\x40\x40\x40", 6), 0);
    for (const GgufTensor& t : f->tensors()) {
        EXPECT_EQ((t.data - f->tensors()[0].data) % 32, 0) << t.name;
    }
}

TEST_F(Gguf, WriterRefusesInconsistentTensors) {
    GgufWriter w;
    EXPECT_THAT(w.AddTensor("x", {4}, TensorType::kF32, std::string(15, '\0')),
                StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(w.AddTensor("x", {}, TensorType::kF32, ""), StatusIs(Code::kInvalidArgument));
    FERRY_EXPECT_OK(w.AddTensor("x", {1}, TensorType::kF32, std::string(4, '\0')));
    EXPECT_THAT(w.AddTensor("x", {1}, TensorType::kF32, std::string(4, '\0')),
                StatusIs(Code::kAlreadyExists));
}

TEST_F(Gguf, MalformedFilesAreRefusedWithAMessage) {
    std::string good = Slurp(WriteSample());
    auto expect_refused = [&](const std::string& bytes, const std::string& needle) {
        auto r = GgufFile::Open(Spit("bad.gguf", bytes));
        ASSERT_FALSE(r.ok());
        EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
        EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().ToString();
    };
    std::string b = good;
    b[0] = 'X';
    expect_refused(b, "bad magic");
    b = good;
    b[4] = 2;
    expect_refused(b, "version 2");
    expect_refused(good.substr(0, 10), "too short");
    expect_refused(good.substr(0, good.size() - 27), "runs past the end");  // into c.weight
    // A quantized tensor type is refused by name. The type of "a.weight" follows its name and
    // dims in the tensor table: patch it to Q8_0 (8).
    b = good;
    size_t at = b.find("a.weight") + 8 + 4 + 2 * 8;
    b[at] = 8;
    expect_refused(b, "ggml type 8 is not supported");
    // An array that claims more elements than the file holds.
    b = good;
    size_t arr = b.find("tokenizer.ggml.tokens") + 21 + 4 + 4;
    b[arr + 6] = 0x7f;
    expect_refused(b, "too long");
    EXPECT_THAT(GgufFile::Open(Path("nope.gguf")), StatusIs(Code::kNotFound));
}

TEST_F(Gguf, EveryTruncationAndRandomCorruptionFailsCleanly) {
    std::string good = Slurp(WriteSample());
    for (size_t n = 0; n < good.size(); ++n) {
        auto r = GgufFile::Open(Spit("t.gguf", good.substr(0, n)));
        // The last tensor's padding may be cut without harm; anything shorter must be refused.
        if (r.ok()) {
            EXPECT_GE(n, good.size() - 31) << n;
        }
    }
    std::mt19937 rng(7);
    for (int i = 0; i < 2000; ++i) {
        std::string b = good;
        for (int k = 0; k < 3; ++k) b[rng() % b.size()] = static_cast<char>(rng());
        auto r = GgufFile::Open(Spit("c.gguf", b));  // must not crash; ok or InvalidArgument
        if (!r.ok()) {
            EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
        }
    }
}

// Found by fuzz/gguf_fuzzer (a timeout): a 204-byte file claiming 4 million tensors made the
// parser allocate and destroy the whole table before finding out. Counts are now checked
// against the bytes left first, for tensors and for arrays of every element type.
TEST_F(Gguf, CountsLargerThanTheFileAreRefusedBeforeAllocating) {
    std::string header("GGUF\x03\x00\x00\x00", 8);
    auto u64 = [](uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); };
    auto u32 = [](uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); };
    std::string many_tensors = header + u64(0x400002) + u64(0) + std::string(150, '\0');
    std::ofstream(Path("t.gguf"), std::ios::binary) << many_tensors;
    auto t = GgufFile::Open(Path("t.gguf"));
    EXPECT_THAT(t.status(), StatusIs(Code::kInvalidArgument));
    EXPECT_NE(t.status().message().find("4194306 tensors cannot be described"), std::string::npos)
        << t.status().message();
    // An array of 50 strings in a 100-byte remainder: each needs at least 8 bytes.
    std::string many_strings = header + u64(0) + u64(1) + u64(3) + "key" + u32(9) + u32(8) +
                               u64(50) + std::string(100, '\0');
    std::ofstream(Path("a.gguf"), std::ios::binary) << many_strings;
    auto a = GgufFile::Open(Path("a.gguf"));
    EXPECT_THAT(a.status(), StatusIs(Code::kInvalidArgument));
    EXPECT_NE(a.status().message().find("50 elements is too long"), std::string::npos)
        << a.status().message();
    // The fuzzer's own input, kept in the seed corpus, fails the same way.
    std::ifstream seed(FERRY_SOURCE_DIR "/fuzz/corpus/gguf/regression-tensor-count",
                       std::ios::binary);
    ASSERT_TRUE(seed.good());
    std::string bytes((std::istreambuf_iterator<char>(seed)), {});
    std::ofstream(Path("seed.gguf"), std::ios::binary) << bytes;
    EXPECT_THAT(GgufFile::Open(Path("seed.gguf")).status(), StatusIs(Code::kInvalidArgument));
}

}  // namespace
}  // namespace ferry::gguf
