// `python3 -m sglang.launch_server`'s command line as `ferry serve` takes it
// (serve/sglang_cli.h): seed 003's commands as written, each SGLang spelling, what is refused.
#include "serve/sglang_cli.h"

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

ServeFlags Flags(const Args& in) {
    Result<TranslatedArgs> t = TranslateSglangServeArgs(in);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    Result<TranslatedArgs> v = TranslateVllmServeArgs(t.ok() ? t->args : Args{});
    EXPECT_TRUE(v.ok()) << v.status().ToString();
    ServeFlags f;
    Status st = ParseServeArgs(v.ok() ? v->args : Args{}, &f);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return f;
}

// Seed 003 (SGLang + NIXL), both deployments, with a GGUF file for the model.
TEST(SglangCli, SeedThreesCommandsParseAsWritten) {
    ServeFlags p = Flags({"--model-path", "/m.gguf", "--disaggregation-mode", "prefill", "--port",
                          "30001", "--disaggregation-transfer-backend", "nixl"});
    EXPECT_EQ(p.model, "/m.gguf");
    EXPECT_EQ(p.served_model_name, "/m.gguf");
    EXPECT_EQ(p.role, "prefill");
    EXPECT_EQ(p.port, 30001);
    EXPECT_EQ(p.bootstrap_port, 8998);  // SGLang's default bootstrap server
    ServeFlags d = Flags({"--model-path", "/m.gguf", "--disaggregation-mode", "decode", "--port",
                          "30002", "--base-gpu-id", "2", "--disaggregation-transfer-backend",
                          "nixl", "--tp-size", "2"});
    EXPECT_EQ(d.role, "decode");
    EXPECT_EQ(d.tp, 2);
    EXPECT_EQ(d.port, 30002);
    EXPECT_EQ(d.bootstrap_port, -1);  // requests' null port: 8998
}

TEST(SglangCli, EverySpellingMapsAndTheRestPassesThrough) {
    ServeFlags f = Flags({"--model-path=/m.gguf",
                          "--tp",
                          "2",
                          "--context-length",
                          "2048",
                          "--page-size",
                          "32",
                          "--max-running-requests",
                          "64",
                          "--chunked-prefill-size",
                          "-1",
                          "--disable-radix-cache",
                          "--disaggregation-mode",
                          "null",
                          "--dp-size",
                          "1",
                          "--trust-remote-code",
                          "--mem-fraction-static",
                          "0.9",
                          "--served-model-name",
                          "llama",
                          "--num-kv-blocks",
                          "100"});
    EXPECT_EQ(f.tp, 2);
    EXPECT_EQ(f.max_model_len, 2048);
    EXPECT_EQ(f.block_size, 32);
    EXPECT_EQ(f.max_num_seqs, 64);
    EXPECT_TRUE(f.no_chunked_prefill);
    EXPECT_TRUE(f.no_prefix_caching);
    EXPECT_EQ(f.role, "colocated");
    EXPECT_EQ(f.served_model_name, "llama");
    EXPECT_EQ(f.port, 30000);  // SGLang's default
    EXPECT_EQ(f.num_kv_blocks, 100);
    ServeFlags b =
        Flags({"--model-path", "/m.gguf", "--disaggregation-mode", "prefill",
               "--disaggregation-bootstrap-port", "9000", "--chunked-prefill-size", "4096"});
    EXPECT_EQ(b.bootstrap_port, 9000);
    EXPECT_EQ(b.max_num_batched_tokens, 4096);
    // ferry's own command lines are untouched.
    Result<TranslatedArgs> plain = TranslateSglangServeArgs({"--model", "/m.gguf", "--tp", "2"});
    ASSERT_TRUE(plain.ok());
    EXPECT_EQ(plain->args, (Args{"--model", "/m.gguf", "--tp", "2"}));
}

TEST(SglangCli, WhatHasNoEquivalentIsRefusedByName) {
    EXPECT_THAT(TranslateSglangServeArgs({"--model-path", "m", "--disaggregation-mode", "encode"})
                    .status()
                    .message(),
                HasSubstr("--disaggregation-mode 'encode'"));
    EXPECT_THAT(
        TranslateSglangServeArgs({"--model-path", "m", "--dp-size", "2"}).status().message(),
        HasSubstr("--dp-size 2"));
    EXPECT_THAT(
        TranslateSglangServeArgs({"--model-path", "m", "--disaggregation-transfer-backend", "fake"})
            .status()
            .message(),
        HasSubstr("fake"));
    EXPECT_THAT(TranslateSglangServeArgs({"--model-path"}).status().message(),
                HasSubstr("--model-path needs a value"));
    // An unknown flag reaches ferry's parser, which names it.
    Result<TranslatedArgs> t = TranslateSglangServeArgs({"--model-path", "m", "--no-such-flag"});
    ASSERT_TRUE(t.ok());
    ServeFlags f;
    EXPECT_THAT(ParseServeArgs(t->args, &f).message(), HasSubstr("--no-such-flag"));
}

}  // namespace
}  // namespace ferry::serve
