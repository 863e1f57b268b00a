// What the multi-process P/D tests share: a tiny model file, the colocated reference answers,
// request bodies whose answers carry token ids, and a client that sends many at once.
#pragma once

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/sanitizers.h"
#include "http/http.h"
#include "serve/serve_flags.h"
#include "testing/completions.h"
#include "testing/testing.h"
#include "testing/tiny_model.h"
#include "testing/worker_process.h"

namespace ferry::pd_test {

using Json = nlohmann::json;
using testing::ServerProcess;

#if defined(FERRY_SANITIZED)
constexpr int kPrompts = 24;  // sanitizer builds run every step several times slower
constexpr int kMaxPromptLen = 600;
#else
constexpr int kPrompts = 100;
constexpr int kMaxPromptLen = 2000;
#endif

inline std::vector<int32_t> RandomPrompt(int n, uint32_t seed) {
    std::mt19937 g(seed);
    std::vector<int32_t> p(n);
    for (auto& t : p) t = static_cast<int32_t>(g() % 256);
    return p;
}

// Lengths 1..kMaxPromptLen: the edges of blocks and a spread between.
inline std::vector<std::vector<int32_t>> Prompts() {
    std::vector<std::vector<int32_t>> out;
    std::mt19937 g(7);
    for (int i = 0; i < kPrompts; ++i) {
        int n = i < 6 ? std::vector<int>{1, 15, 16, 17, 31, kMaxPromptLen}[i]
                      : 1 + static_cast<int>(g() % kMaxPromptLen);
        out.push_back(RandomPrompt(n, 100 + i));
    }
    return out;
}

struct Answer {
    int status = 0;
    std::vector<int32_t> tokens;
    std::string body;
    Status error;
};

inline Json CompletionBody(const std::vector<int32_t>& prompt, int max_tokens, bool stream,
                           std::optional<uint64_t> seed = std::nullopt) {
    Json b = {{"prompt", prompt}, {"max_tokens", max_tokens},
              {"temperature", 0}, {"ignore_eos", true},
              {"logprobs", 0},    {"return_tokens_as_token_ids", true},
              {"stream", stream}};
    if (seed) {
        b["temperature"] = 0.8;
        b["seed"] = *seed;
    }
    return b;
}

using testing::TokensOf;

inline http::ClientRequest Post(int port, const Json& body,
                                const std::string& path = "/v1/completions") {
    http::ClientRequest r;
    r.port = port;
    r.target = path;
    r.body = body.dump();
    r.timeout = std::chrono::seconds(120);
    return r;
}

// Sends every body at once (at most `parallel` in flight) and collects the answers; a body with
// "messages" goes to /v1/chat/completions. `ids`, if given, are the bodies' X-Request-Id headers
// ("": none).
inline std::vector<Answer> SendAll(int port, const std::vector<Json>& bodies, int parallel = 16,
                                   const std::vector<std::string>& ids = {}) {
    auto client = http::Client::Create(2);
    std::vector<Answer> out(bodies.size());
    std::mutex mu;
    std::condition_variable cv;
    size_t next = 0, done = 0;
    int inflight = 0;
    std::function<void()> launch = [&] {
        // mu held
        while (inflight < parallel && next < bodies.size()) {
            size_t i = next++;
            ++inflight;
            auto status = std::make_shared<int>(0);
            auto body = std::make_shared<std::string>();
            http::ClientCallbacks cb;
            cb.on_head = [status](const http::ClientHead& h) { *status = h.status; };
            cb.on_data = [body](std::string_view d) { body->append(d); };
            const bool stream = bodies[i]["stream"].get<bool>();
            cb.on_done = [&, i, status, body, stream](const Status& st) {
                std::lock_guard lock(mu);
                out[i].status = *status;
                out[i].body = *body;
                out[i].error = st;
                out[i].tokens = TokensOf(*body, stream);
                --inflight;
                ++done;
                launch();
                cv.notify_all();
            };
            const char* path =
                bodies[i].contains("messages") ? "/v1/chat/completions" : "/v1/completions";
            http::ClientRequest r = Post(port, bodies[i], path);
            if (i < ids.size() && !ids[i].empty()) r.headers.push_back({"X-Request-Id", ids[i]});
            client->Call(std::move(r), std::move(cb));
        }
    };
    std::unique_lock lock(mu);
    launch();
    cv.wait_for(lock, std::chrono::seconds(600), [&] { return done == bodies.size(); });
    lock.unlock();
    client.reset();  // its threads are joined before what the callbacks touch goes
    return out;
}

// Every answer 200 and with the reference's tokens.
inline void ExpectSameTokens(const std::vector<Answer>& got, const std::vector<Answer>& want,
                             const std::string& what = "prompt") {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].status, 200)
            << what << " " << i << ": " << got[i].body.substr(0, 300) << got[i].error.ToString();
        EXPECT_EQ(got[i].tokens, want[i].tokens) << what << " " << i;
    }
}

// Streams a request through a proxy in the background; its outcome once done.
class Background {
  public:
    Background(int port, Json body) : client_(http::Client::Create(1)) {
        http::ClientCallbacks cb;
        cb.on_head = [this](const http::ClientHead& h) {
            std::lock_guard lock(mu_);
            status_ = h.status;
        };
        cb.on_data = [this](std::string_view d) {
            std::lock_guard lock(mu_);
            body_.append(d);
        };
        cb.on_done = [this](const Status& st) {
            std::lock_guard lock(mu_);
            done_ = true;
            error_ = st;
            end_ = std::chrono::steady_clock::now();
            cv_.notify_all();
        };
        const char* path = body.contains("messages") ? "/v1/chat/completions" : "/v1/completions";
        call_ = client_->Call(Post(port, body, path), std::move(cb));
    }
    bool Wait(std::chrono::milliseconds limit) {
        std::unique_lock lock(mu_);
        return cv_.wait_for(lock, limit, [&] { return done_; });
    }
    void Cancel() { call_->Cancel(); }
    int status() {
        std::lock_guard lock(mu_);
        return status_;
    }
    std::string body() {
        std::lock_guard lock(mu_);
        return body_;
    }
    std::chrono::steady_clock::time_point end() {
        std::lock_guard lock(mu_);
        return end_;
    }

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    int status_ = 0;
    std::string body_;
    bool done_ = false;
    Status error_;
    std::chrono::steady_clock::time_point end_;
    std::shared_ptr<http::ClientCall> call_;
    // Last: destroyed first, so its I/O thread is joined before the callbacks' state goes.
    std::unique_ptr<http::Client> client_;
};

inline std::unique_ptr<ServerProcess> StartOrDie(std::vector<std::string> args,
                                                 std::string log_path = "") {
    auto p = ServerProcess::Start(FERRY_BIN, std::move(args), std::chrono::seconds(60),
                                  std::move(log_path));
    if (!p.ok()) {
        ADD_FAILURE() << p.status().ToString();
        return nullptr;
    }
    return std::move(p).value();
}

class PdProcess : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        // UCX's shared-memory transports refuse peer error handling: tcp (docs/transfer-engine).
        setenv("UCX_TLS", "tcp", 1);
        model_ = new testing::TinyModelFile("pd-process-test", testing::TinyModelSpec(4096), 21);
    }
    static void TearDownTestSuite() {
        delete model_;
        model_ = nullptr;
    }
    // `ferry serve`'s flags for a worker of this suite; `extra` (flags as on the command line)
    // over them.
    static serve::ServeFlags WorkerFlags(const std::string& role, const std::string& backend,
                                         int tp, const std::vector<std::string>& extra = {}) {
        serve::ServeFlags f;
        f.model = model_->path();
        f.port = 0;
        f.block_size = 16;
        f.num_kv_blocks = 6000;
        f.tp = tp;
        f.max_model_len = 4096;
        f.role = role;
        if (role != "colocated") f.kv_backend = backend;
        Status parsed = serve::ParseServeArgs(extra, &f);
        EXPECT_TRUE(parsed.ok()) << parsed.ToString();
        return f;
    }
    static std::vector<std::string> WorkerArgs(const std::string& role, const std::string& backend,
                                               int tp, const std::vector<std::string>& extra = {}) {
        std::vector<std::string> a = {"serve"};
        for (std::string& arg : serve::ServeArgs(WorkerFlags(role, backend, tp, extra))) {
            a.push_back(std::move(arg));
        }
        return a;
    }
    // ferry proxy over `prefill` and `decode` (with the deployment's secret), pull and push.
    static std::pair<std::unique_ptr<ServerProcess>, std::unique_ptr<ServerProcess>>
    PullAndPushProxies(const ServerProcess& prefill, const ServerProcess& decode,
                       const std::string& secret_path) {
        const std::vector<std::string> common = {"proxy",
                                                 "--prefill",
                                                 fmt::format("127.0.0.1:{}", prefill.port()),
                                                 "--decode",
                                                 fmt::format("127.0.0.1:{}", decode.port()),
                                                 "--port",
                                                 "0",
                                                 "--no-store",
                                                 "--secret-file",
                                                 secret_path};
        std::vector<std::string> push = common;
        push.insert(push.end(), {"--kv-transfer", "push"});
        return {StartOrDie(common), StartOrDie(push)};
    }
    // The colocated answers of Prompts() (computed once per TP and sampling).
    static const std::vector<Answer>& Reference(int tp) {
        static std::map<int, std::vector<Answer>> cache;
        auto it = cache.find(tp);
        if (it != cache.end()) return it->second;
        auto colocated = StartOrDie(WorkerArgs("colocated", "", tp));
        std::vector<Json> bodies;
        for (const auto& p : Prompts()) bodies.push_back(CompletionBody(p, 6, false));
        return cache[tp] = SendAll(colocated->port(), bodies);
    }
    inline static testing::TinyModelFile* model_ = nullptr;
};

}  // namespace ferry::pd_test
