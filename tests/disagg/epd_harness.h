// What the multi-process EPD tests share: the P/D harness, a tiny vision projector, worker
// arguments for the encode role, and chat bodies with 1 to 4 images drawn from a small pool.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "disagg/pd_harness.h"
#include "testing/images.h"
#include "testing/tiny_model.h"

namespace ferry::epd_test {

using Json = nlohmann::json;
using pd_test::PdProcess;
using testing::ServerProcess;

std::string Addr(const ServerProcess& p) { return fmt::format("127.0.0.1:{}", p.port()); }

class EpdProcess : public PdProcess {
  public:
    static void SetUpTestSuite() {
        PdProcess::SetUpTestSuite();
        mmproj_ = new std::string(testing::WriteTinyMmproj("epd-process", 37));
    }
    static void TearDownTestSuite() {
        std::remove(mmproj_->c_str());
        delete mmproj_;
        mmproj_ = nullptr;
        PdProcess::TearDownTestSuite();
    }
    static std::vector<std::string> Args(const std::string& role, const std::string& backend,
                                         const std::vector<std::string>& extra = {}) {
        serve::ServeFlags f = WorkerFlags(role == "encode" ? "colocated" : role, backend, 1);
        if (role == "encode") {
            f.role = "encode";
            if (!backend.empty()) f.kv_backend = backend;
            f.num_kv_blocks = 300;  // the language model does not run there: a small cache
        }
        f.mmproj = *mmproj_;
        Status parsed = serve::ParseServeArgs(extra, &f);
        EXPECT_TRUE(parsed.ok()) << parsed.ToString();
        std::vector<std::string> a = {"serve"};
        for (std::string& arg : serve::ServeArgs(f)) a.push_back(std::move(arg));
        return a;
    }
    // 1 to 4 images a request from a pool of 7 (repeated across requests), text around them.
    static std::vector<Json> Bodies(int n, uint32_t seed) {
        std::vector<std::string> pool;
        for (int i = 0; i < 7; ++i) {
            pool.push_back(testing::RandomPngUrl(16 + 7 * i, 40 - 3 * i, seed + i));
        }
        std::vector<Json> out;
        for (int k = 0; k < n; ++k) {
            Json content = Json::array();
            const int images = 1 + k % 4;
            for (int j = 0; j < images; ++j) {
                content.push_back({{"type", "text"},
                                   {"text", std::string(2 + (k * 5 + j * 11) % 30, 'a' + k % 26)}});
                content.push_back(
                    {{"type", "image_url"}, {"image_url", {{"url", pool[(k * 3 + j) % 7]}}}});
            }
            content.push_back({{"type", "text"}, {"text", fmt::format("prompt {}?", k)}});
            out.push_back({{"messages", {{{"role", "user"}, {"content", content}}}},
                           {"max_tokens", 5},
                           {"temperature", 0},
                           {"ignore_eos", true},
                           {"logprobs", true},
                           {"return_tokens_as_token_ids", true},
                           {"stream", k % 3 == 1}});
        }
        return out;
    }
    inline static std::string* mmproj_ = nullptr;
};

}  // namespace ferry::epd_test
