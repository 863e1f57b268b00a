#include "bench/serve_bench.h"

#include <fmt/core.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "bench/datasets.h"
#include "core/base64.h"
#include "core/host_port.h"
#include "core/json_fields.h"
#include "core/utf8.h"
#include "discovery/http_json.h"
#include "gguf/gguf.h"
#include "http/http.h"
#include "schema/openai_error.h"
#include "tokenizer/tokenizer.h"

namespace ferry::bench {

namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

using Url = http::Endpoint;

// --- the client --------------------------------------------------------------------------------

// One streamed request. Its callbacks run on the HTTP client's I/O thread; each piece of the
// body is timed as it arrives, before it is split into server-sent events.
struct Conn {
    size_t index = 0;
    std::shared_ptr<http::ClientCall> call;
    int status = 0;
    std::string body;  // not yet split into events (an error answer: all of it)
    std::string error_body;
    Clock::time_point sent_at;
    Clock::time_point last_chunk;
    bool first = true;
    bool done = false;
    int content_chunks = 0;
    int usage_prompt = -1, usage_completion = -1, usage_cached = -1;
};

class StreamingRun {
  public:
    StreamingRun(const ServeBenchOptions& o, const Url& url, std::string model,
                 std::vector<BenchPrompt> prompts)
        : o_(o), url_(url), model_(std::move(model)), prompts_(std::move(prompts)) {}

    Result<std::vector<RequestRecord>> Run(double* duration);

  private:
    std::string RequestBody(const BenchPrompt& p, size_t i) const;
    void Start(size_t i);
    // Under mu_, on the I/O thread.
    void ParseEvents(Conn* c, Clock::time_point now);
    void Finish(Conn* c, const Status& st);
    void Progress(bool final);

    const ServeBenchOptions& o_;
    Url url_;
    std::string model_;
    std::vector<BenchPrompt> prompts_;
    std::vector<RequestRecord> records_;
    std::unique_ptr<http::Client> client_;
    std::vector<std::unique_ptr<Conn>> conns_;
    Clock::time_point t0_;
    std::mutex mu_;
    std::condition_variable cv_;  // a request finished
    int active_ = 0;
    int done_ = 0;
    Clock::time_point last_progress_;
    int last_decile_ = -1;
};

std::string StreamingRun::RequestBody(const BenchPrompt& p, size_t i) const {
    const bool chat = o_.endpoint.find("chat") != std::string::npos;
    Json body = {{"model", model_},
                 {"stream", true},
                 {"stream_options", {{"include_usage", true}}},
                 {"temperature", o_.temperature}};
    if (o_.ignore_eos) body["ignore_eos"] = true;
    if (chat) {
        Json content;
        if (p.images > 0) {
            content = Json::array({{{"type", "text"}, {"text", p.text}}});
            for (int k = 0; k < p.images; ++k) {
                const uint64_t n = i * uint64_t(p.images) + k;
                std::string png =
                    RandomPng(o_.mm_width, o_.mm_height,
                              o_.seed * 1000003 + (o_.mm_distinct > 0 ? n % o_.mm_distinct : n));
                content.push_back(
                    {{"type", "image_url"},
                     {"image_url", {{"url", "data:image/png;base64," + Base64Encode(png)}}}});
            }
        } else {
            content = p.text;
        }
        body["messages"] = Json::array({{{"role", "user"}, {"content", content}}});
        body["max_completion_tokens"] = p.output_len;
    } else {
        body["prompt"] = p.text;
        body["max_tokens"] = p.output_len;
    }
    return DumpJson(body);
}

void StreamingRun::Start(size_t i) {
    auto owned = std::make_unique<Conn>();
    Conn* c = owned.get();
    c->index = i;
    http::ClientRequest req;
    req.host = url_.host;
    req.port = url_.port;
    req.target = o_.endpoint;
    req.body = RequestBody(prompts_[i], i);
    req.headers.push_back({"Accept", "text/event-stream"});
    req.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::duration<double>(o_.request_timeout));
    http::ClientCallbacks cb;
    cb.on_head = [this, c](const http::ClientHead& h) {
        std::lock_guard lock(mu_);
        c->status = h.status;
    };
    cb.on_data = [this, c](std::string_view d) {
        const Clock::time_point now = Clock::now();
        std::lock_guard lock(mu_);
        c->body.append(d);
        if (c->status == 200) ParseEvents(c, now);
    };
    cb.on_done = [this, c](const Status& st) {
        std::lock_guard lock(mu_);
        Finish(c, st);
    };
    {
        std::lock_guard lock(mu_);
        c->sent_at = Clock::now();
        records_[i].start = std::chrono::duration<double>(c->sent_at - t0_).count();
        records_[i].prompt_tokens = prompts_[i].prompt_len;
        ++active_;
        conns_.push_back(std::move(owned));
    }
    auto call = client_->Call(std::move(req), std::move(cb));
    std::lock_guard lock(mu_);
    c->call = std::move(call);
}

void StreamingRun::Finish(Conn* c, const Status& st) {
    if (c->done) return;
    c->done = true;
    RequestRecord& r = records_[c->index];
    Clock::time_point now = Clock::now();
    r.latency = std::chrono::duration<double>(now - c->sent_at).count();
    if (st.ok() && c->status == 200) {
        ParseEvents(c, now);  // an answer that ended without a blank line
    }
    if (st.ok() && c->status == 200 && c->error_body.empty()) {
        // A complete stream. One whose tokens carried no text at all (control tokens, bytes of
        // an unfinished character) still succeeded; its first token counts as arriving at the
        // end.
        r.success = true;
        r.output_tokens = c->usage_completion >= 0 ? c->usage_completion : c->content_chunks;
        if (c->usage_prompt >= 0) r.prompt_tokens = c->usage_prompt;
        r.cached_tokens = c->usage_cached;
        if (c->content_chunks == 0) r.ttft = r.latency;
    } else {
        r.success = false;
        if (st.code() == Code::kDeadlineExceeded) {
            r.error = fmt::format("no complete answer within {:g} s (--request-timeout)",
                                  o_.request_timeout);
        } else if (!st.ok()) {
            r.error = st.message();
        } else if (c->status != 200) {
            // The server's own words when it wrote OpenAI's error body, else the body as is.
            Result<schema::ParsedOpenAiError> e = schema::ParseOpenAiError(c->body);
            r.error = fmt::format("HTTP {}: {}", c->status, e.ok() ? e->message : c->body);
        } else {
            r.error = c->error_body;  // an error event in the stream
        }
    }
    c->body.clear();
    --active_;
    ++done_;
    cv_.notify_all();
}

void StreamingRun::ParseEvents(Conn* c, Clock::time_point now) {
    RequestRecord& r = records_[c->index];
    size_t pos;
    while ((pos = c->body.find("\n\n")) != std::string::npos) {
        std::string event = c->body.substr(0, pos);
        c->body.erase(0, pos + 2);
        if (event.compare(0, 5, "data:") != 0) continue;  // comments, other fields
        std::string data = event.substr(event.size() > 5 && event[5] == ' ' ? 6 : 5);
        if (data == "[DONE]") continue;
        Json j = Json::parse(data, nullptr, false);
        if (!j.is_object()) continue;
        if (j.contains("error")) {
            Result<schema::ParsedOpenAiError> e = schema::ParseOpenAiError(data);
            c->error_body = e.ok() ? e->message : DumpJson(j["error"]);
            continue;
        }
        if (j.contains("usage") && j["usage"].is_object()) {
            const Json& u = j["usage"];
            if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer()) {
                c->usage_completion = u["completion_tokens"].get<int>();
            }
            if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer()) {
                c->usage_prompt = u["prompt_tokens"].get<int>();
            }
            if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object()) {
                const Json& d = u["prompt_tokens_details"];
                if (d.contains("cached_tokens") && d["cached_tokens"].is_number_integer()) {
                    c->usage_cached = d["cached_tokens"].get<int>();
                }
            }
        }
        if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty()) continue;
        const Json& ch = j["choices"][0];
        std::string text;
        if (ch.contains("text") && ch["text"].is_string()) {
            text = ch["text"].get<std::string>();
        } else if (ch.contains("delta") && ch["delta"].is_object() &&
                   ch["delta"].contains("content") && ch["delta"]["content"].is_string()) {
            text = ch["delta"]["content"].get<std::string>();
        }
        if (text.empty()) continue;
        if (c->first) {
            r.ttft = std::chrono::duration<double>(now - c->sent_at).count();
            c->first = false;
        } else {
            r.itl.push_back(std::chrono::duration<double>(now - c->last_chunk).count());
        }
        r.chunk_times.push_back(std::chrono::duration<double>(now - t0_).count());
        c->last_chunk = now;
        ++c->content_chunks;
    }
}

void StreamingRun::Progress(bool final) {
    if (!o_.progress) return;
    const int n = static_cast<int>(prompts_.size());
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0_).count();
    if (isatty(2)) {
        if (!final && Clock::now() - last_progress_ < std::chrono::milliseconds(200)) return;
        last_progress_ = Clock::now();
        int width = 40, filled = n ? done_ * width / n : width;
        fmt::print(stderr, "\r[{}{}] {}/{} requests, {} in flight, {:.1f} s",
                   std::string(filled, '#'), std::string(width - filled, '.'), done_, n, active_,
                   elapsed);
        if (final) fmt::print(stderr, "\n");
    } else {
        int decile = n ? done_ * 10 / n : 10;
        if (decile == last_decile_ && !final) return;
        last_decile_ = decile;
        fmt::print(stderr, "bench serve: {}/{} requests done, {} in flight, {:.1f} s\n", done_, n,
                   active_, elapsed);
    }
}

Result<std::vector<RequestRecord>> StreamingRun::Run(double* duration) {
    // A thousand streams need a thousand descriptors.
    rlimit lim{};
    if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
        lim.rlim_cur = lim.rlim_max;
        setrlimit(RLIMIT_NOFILE, &lim);
    }
    client_ = http::Client::Create(1);
    const size_t n = prompts_.size();
    records_.assign(n, RequestRecord{});
    conns_.reserve(n);
    std::vector<double> arrivals =
        ArrivalTimes(static_cast<int>(n), o_.request_rate, o_.burstiness, o_.seed);
    t0_ = Clock::now();
    size_t next = 0;
    for (;;) {
        {
            std::unique_lock lock(mu_);
            if (done_ >= static_cast<int>(n)) break;
        }
        const double elapsed = std::chrono::duration<double>(Clock::now() - t0_).count();
        for (;;) {
            {
                std::lock_guard lock(mu_);
                if (next >= n || arrivals[next] > elapsed ||
                    (o_.max_concurrency > 0 && active_ >= o_.max_concurrency)) {
                    break;
                }
            }
            Start(next++);
        }
        std::unique_lock lock(mu_);
        auto wait = std::chrono::milliseconds(100);
        if (next < n && (o_.max_concurrency <= 0 || active_ < o_.max_concurrency)) {
            wait = std::chrono::milliseconds(
                std::clamp(static_cast<int>((arrivals[next] - elapsed) * 1000), 0, 100));
        }
        const int done_before = done_;
        cv_.wait_for(lock, wait, [&] { return done_ != done_before; });
        Progress(false);
    }
    client_.reset();  // every call has ended; its threads go
    *duration = std::chrono::duration<double>(Clock::now() - t0_).count();
    std::lock_guard lock(mu_);
    Progress(true);
    return std::move(records_);
}

std::string FetchModel(const Url& url) {
    auto r =
        http::Fetch(http::GetRequest(url.host, url.port, "/v1/models", std::chrono::seconds(10)));
    if (!r.ok() || r->status != 200) return "";
    Json j = Json::parse(r->body, nullptr, false);
    if (!j.is_object() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
        !j["data"][0].contains("id") || !j["data"][0]["id"].is_string()) {
        return "";
    }
    return j["data"][0]["id"].get<std::string>();
}

}  // namespace

Result<ServeBenchResult> RunServeBench(const ServeBenchOptions& o) {
    auto parsed = http::ParseServerUrl(o.base_url);
    if (!parsed.ok()) {
        return InvalidArgumentError(fmt::format("--base-url {}", parsed.status().message()));
    }
    const Url url = std::move(*parsed);
    if (o.endpoint != "/v1/completions" && o.endpoint != "/v1/chat/completions") {
        return InvalidArgumentError(fmt::format(
            "--endpoint '{}' is not /v1/completions or /v1/chat/completions", o.endpoint));
    }
    if (o.dataset_name == "random-mm" && o.endpoint != "/v1/chat/completions") {
        return InvalidArgumentError("random-mm needs --endpoint /v1/chat/completions");
    }
    if (!(o.burstiness > 0)) return InvalidArgumentError("--burstiness must be positive");
    std::unique_ptr<gguf::GgufFile> file;
    std::unique_ptr<tokenizer::Tokenizer> tk;
    if (!o.tokenizer.empty()) {
        FERRY_ASSIGN_OR_RETURN(file, gguf::GgufFile::Open(o.tokenizer));
        FERRY_ASSIGN_OR_RETURN(tk, tokenizer::Tokenizer::FromGguf(*file));
    }
    FERRY_ASSIGN_OR_RETURN(std::vector<BenchPrompt> prompts, SampleDataset(o, tk.get()));
    ServeBenchResult result;
    result.model = o.model.empty() ? FetchModel(url) : o.model;
    if (result.model.empty()) {
        return UnavailableError(fmt::format(
            "{}: GET /v1/models gave no model; is the server up? (or pass --model)", o.base_url));
    }
    StreamingRun run(o, url, result.model, std::move(prompts));
    double duration = 0;
    FERRY_ASSIGN_OR_RETURN(result.records, run.Run(&duration));
    result.metrics = ComputeServeMetrics(result.records, duration, o.percentiles, o.goodput);
    return result;
}

int RunServeBenchCommand(const ServeBenchOptions& o) {
    fmt::print(
        "Traffic request rate: {}\nBurstiness factor: {}{}\nMaximum request concurrency: {}\n",
        std::isfinite(o.request_rate) ? fmt::format("{:g}", o.request_rate) : "inf", o.burstiness,
        o.burstiness == 1.0 ? " (Poisson process)" : "",
        o.max_concurrency > 0 ? std::to_string(o.max_concurrency) : "None");
    std::fflush(stdout);
    auto r = RunServeBench(o);
    if (!r.ok()) {
        fmt::print(stderr, "ferry bench serve: {}\n", r.status().ToString());
        return r.status().code() == Code::kInvalidArgument ? 2 : 1;
    }
    fmt::print("{}", FormatServeResult(o, *r));
    if (!o.save_result.empty()) {
        Status st = SaveServeResult(o, *r, o.save_result);
        if (!st.ok()) {
            fmt::print(stderr, "ferry bench serve: {}\n", st.ToString());
            return 1;
        }
        fmt::print("saved {}\n", o.save_result);
    }
    return r->metrics.completed > 0 ? 0 : 1;
}

}  // namespace ferry::bench
