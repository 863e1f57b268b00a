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

#include "core/base64.h"
#include "core/host_port.h"
#include "core/json_fields.h"
#include "core/utf8.h"
#include "discovery/http_json.h"
#include "gguf/gguf.h"
#include "http/http.h"
#include "tokenizer/tokenizer.h"

namespace ferry::bench {

namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Url {
    std::string host;
    int port = 80;
};

Result<Url> ParseBaseUrl(const std::string& s) {
    const std::string prefix = "http://";
    if (s.compare(0, prefix.size(), prefix) != 0) {
        return InvalidArgumentError(
            fmt::format("--base-url '{}': only http://host:port is supported", s));
    }
    std::string rest = s.substr(prefix.size());
    while (!rest.empty() && rest.back() == '/') rest.pop_back();
    if (rest.find('/') != std::string::npos) {
        return InvalidArgumentError(
            fmt::format("--base-url '{}': give the server root; the path goes in --endpoint", s));
    }
    Url u;
    if (rest.empty()) return InvalidArgumentError(fmt::format("--base-url '{}': no host", s));
    if (rest.find(':') == std::string::npos) {
        u.host = rest;  // port 80
        return u;
    }
    auto hp = ParseHostPort(rest);
    if (!hp.ok()) return InvalidArgumentError(fmt::format("--base-url: {}", hp.status().message()));
    u.host = std::move(hp->host);
    u.port = hp->port;
    return u;
}

// --- PNG ----------------------------------------------------------------------------------------

uint32_t Crc32(const uint8_t* p, size_t n, uint32_t crc = 0) {
    crc = ~crc;
    for (size_t i = 0; i < n; ++i) {
        crc ^= p[i];
        for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}

void Be32(std::string* out, uint32_t v) {
    for (int i = 3; i >= 0; --i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void Chunk(std::string* png, const char* type, const std::string& data) {
    Be32(png, static_cast<uint32_t>(data.size()));
    std::string body = std::string(type, 4) + data;
    png->append(body);
    Be32(png, Crc32(reinterpret_cast<const uint8_t*>(body.data()), body.size()));
}

}  // namespace

std::string RandomPng(int width, int height, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::string raw;  // filter byte 0, then RGB per row
    for (int y = 0; y < height; ++y) {
        raw.push_back(0);
        for (int x = 0; x < width * 3; ++x) raw.push_back(static_cast<char>(rng() & 0xff));
    }
    // zlib stream of stored deflate blocks.
    std::string z = "\x78\x01";
    for (size_t off = 0; off < raw.size() || off == 0;) {
        size_t n = std::min<size_t>(65535, raw.size() - off);
        bool last = off + n == raw.size();
        z.push_back(last ? 1 : 0);
        z.push_back(static_cast<char>(n & 0xff));
        z.push_back(static_cast<char>(n >> 8));
        z.push_back(static_cast<char>(~n & 0xff));
        z.push_back(static_cast<char>((~n >> 8) & 0xff));
        z.append(raw, off, n);
        off += n;
        if (last) break;
    }
    uint32_t a = 1, b = 0;
    for (unsigned char c : raw) {
        a = (a + c) % 65521;
        b = (b + a) % 65521;
    }
    Be32(&z, (b << 16) | a);
    std::string png = "\x89PNG\r\n\x1a\n";
    std::string ihdr;
    Be32(&ihdr, static_cast<uint32_t>(width));
    Be32(&ihdr, static_cast<uint32_t>(height));
    ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8-bit RGB
    Chunk(&png, "IHDR", ihdr);
    Chunk(&png, "IDAT", z);
    Chunk(&png, "IEND", "");
    return png;
}

// --- datasets ------------------------------------------------------------------------------------

namespace {

bool IsPrintableUtf8(const std::string& s) {
    if (s.empty()) return false;
    for (size_t i = 0; i < s.size();) {
        auto c = static_cast<unsigned char>(s[i]);
        size_t n = Utf8SequenceLength(c);
        if (n == 0 || i + n > s.size()) return false;
        if (n == 1 && (c < 0x20 || c == 0x7f)) return false;
        for (size_t k = 1; k < n; ++k) {
            if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
        }
        i += n;
    }
    return true;
}

}  // namespace

std::vector<double> ArrivalTimes(int n, double rate, double burstiness, uint64_t seed) {
    std::vector<double> t(n, 0.0);
    if (!std::isfinite(rate) || rate <= 0) return t;
    std::mt19937_64 rng(seed ^ 0x5eed5eedull);
    std::gamma_distribution<double> gap(burstiness, 1.0 / (rate * burstiness));
    double now = 0;
    for (int i = 0; i < n; ++i) {
        t[i] = now;
        now += gap(rng);
    }
    return t;
}

Result<std::vector<BenchPrompt>> SampleDataset(const ServeBenchOptions& o,
                                               const tokenizer::Tokenizer* tk) {
    std::mt19937_64 rng(o.seed);
    std::vector<BenchPrompt> out;
    if (o.num_prompts <= 0) return InvalidArgumentError("--num-prompts must be positive");
    const bool prefix_repetition = o.dataset_name == "prefix_repetition";
    if (o.dataset_name == "random" || o.dataset_name == "random-mm" || prefix_repetition) {
        if (prefix_repetition &&
            (o.prefix_repetition_prefix_len < 0 || o.prefix_repetition_suffix_len < 0 ||
             o.prefix_repetition_prefix_len + o.prefix_repetition_suffix_len < 1 ||
             o.prefix_repetition_output_len < 1 || o.prefix_repetition_num_prefixes < 1)) {
            return InvalidArgumentError(
                "--prefix-repetition-prefix-len and --prefix-repetition-suffix-len must be >= 0 "
                "(not both 0), --prefix-repetition-output-len and "
                "--prefix-repetition-num-prefixes >= 1");
        }
        if (prefix_repetition && o.num_prompts < o.prefix_repetition_num_prefixes) {
            return InvalidArgumentError(fmt::format(
                "--num-prompts {} is fewer than --prefix-repetition-num-prefixes {}: each prefix "
                "needs a prompt",
                o.num_prompts, o.prefix_repetition_num_prefixes));
        }
        if (!prefix_repetition &&
            (o.random_input_len < 1 || o.random_output_len < 1 || o.random_range_ratio < 0 ||
             o.random_range_ratio >= 1 || o.random_prefix_len < 0)) {
            return InvalidArgumentError(
                "--random-input-len and --random-output-len must be >= 1, "
                "--random-range-ratio in [0, 1), --random-prefix-len >= 0");
        }
        // Token ids whose text is whole printable UTF-8 on its own: control tokens decode to
        // nothing, and a lone byte of a multi-byte character would reach the server as U+FFFD
        // (JSON carries only valid UTF-8) and change the prompt's length.
        std::vector<int32_t> ids;
        if (tk) {
            for (int32_t i = 0; i < tk->vocab_size(); ++i) {
                if (!tk->IsControl(i) && IsPrintableUtf8(tk->TokenBytes(i))) ids.push_back(i);
            }
            if (ids.empty()) return InvalidArgumentError("the tokenizer has no text tokens");
        }
        static const char kAlphabet[] =
            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,";
        auto random_text = [&](int len) {
            std::string text;
            if (tk) {
                std::vector<int32_t> t;
                for (int i = 0; i < len; ++i) t.push_back(ids[rng() % ids.size()]);
                text = tk->Decode(t);
            } else {
                for (int i = 0; i < len; ++i)
                    text.push_back(kAlphabet[rng() % (sizeof(kAlphabet) - 1)]);
            }
            return text;
        };
        auto range = [&](int len) {
            int lo = std::max(1, static_cast<int>(len * (1 - o.random_range_ratio)));
            int hi = std::max(lo, static_cast<int>(len * (1 + o.random_range_ratio)));
            return lo + static_cast<int>(rng() % uint64_t(hi - lo + 1));
        };
        auto count = [&](const std::string& text, int untokenized) {
            return tk ? static_cast<int>(tk->Encode(text, tk->add_bos()).size()) : untokenized;
        };
        if (prefix_repetition) {
            // As vLLM: num_prompts / num_prefixes prompts per prefix (the rest dropped), then
            // shuffled so that a prefix's prompts arrive spread over the run.
            const int per_prefix = o.num_prompts / o.prefix_repetition_num_prefixes;
            const int len = o.prefix_repetition_prefix_len + o.prefix_repetition_suffix_len;
            for (int k = 0; k < o.prefix_repetition_num_prefixes; ++k) {
                std::string prefix = random_text(o.prefix_repetition_prefix_len);
                for (int i = 0; i < per_prefix; ++i) {
                    BenchPrompt p;
                    p.text = prefix + random_text(o.prefix_repetition_suffix_len);
                    p.prompt_len = count(p.text, len);
                    p.output_len = o.prefix_repetition_output_len;
                    out.push_back(std::move(p));
                }
            }
            std::shuffle(out.begin(), out.end(), rng);
            return out;
        }
        std::string prefix = random_text(o.random_prefix_len);
        for (int i = 0; i < o.num_prompts; ++i) {
            BenchPrompt p;
            int in = range(o.random_input_len);
            p.output_len = range(o.random_output_len);
            p.text = prefix + random_text(in);
            p.prompt_len = count(p.text, o.random_prefix_len + in);
            p.images = o.dataset_name == "random-mm" ? o.mm_images : 0;
            out.push_back(std::move(p));
        }
        return out;
    }
    if (o.dataset_name == "sharegpt") {
        if (o.dataset_path.empty()) return InvalidArgumentError("sharegpt needs --dataset-path");
        std::ifstream f(o.dataset_path);
        if (!f) return NotFoundError(fmt::format("--dataset-path {}: cannot open", o.dataset_path));
        std::stringstream ss;
        ss << f.rdbuf();
        Json data = Json::parse(ss.str(), nullptr, false);
        if (!data.is_array()) {
            return InvalidArgumentError(fmt::format(
                "{}: not a ShareGPT file (a JSON array of {{\"conversations\": [...]}})",
                o.dataset_path));
        }
        // Conversations with at least two turns: the first is the prompt, the second's length is
        // the output length (vLLM's filter: prompt >= 4 tokens, output >= 4, prompt <= 1024,
        // prompt + output <= 2048).
        std::vector<std::pair<std::string, std::string>> pairs;
        for (const Json& e : data) {
            if (!e.is_object() || !e.contains("conversations") || !e["conversations"].is_array() ||
                e["conversations"].size() < 2) {
                continue;
            }
            const Json& c = e["conversations"];
            if (!c[0].is_object() || !c[1].is_object() || !c[0].contains("value") ||
                !c[1].contains("value") || !c[0]["value"].is_string() ||
                !c[1]["value"].is_string()) {
                continue;
            }
            pairs.emplace_back(c[0]["value"].get<std::string>(), c[1]["value"].get<std::string>());
        }
        std::shuffle(pairs.begin(), pairs.end(), rng);
        auto count = [&](const std::string& s) {
            return tk ? static_cast<int>(tk->Encode(s, false).size())
                      : std::max(1, static_cast<int>(s.size() / 4));
        };
        for (const auto& [prompt, answer] : pairs) {
            if (static_cast<int>(out.size()) == o.num_prompts) break;
            BenchPrompt p;
            p.text = prompt;
            p.prompt_len = count(prompt);
            p.output_len = o.sharegpt_output_len > 0 ? o.sharegpt_output_len : count(answer);
            if (p.prompt_len < 4 || p.output_len < 4 || p.prompt_len > 1024 ||
                p.prompt_len + p.output_len > 2048) {
                continue;
            }
            out.push_back(std::move(p));
        }
        if (out.empty()) {
            return InvalidArgumentError(fmt::format("{}: no usable conversations", o.dataset_path));
        }
        return out;
    }
    return InvalidArgumentError(fmt::format(
        "--dataset-name '{}' is not one of random, sharegpt, random-mm, prefix_repetition",
        o.dataset_name));
}

// --- the client ---------------------------------------------------------------------------------

namespace {

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
            Json j = Json::parse(c->body, nullptr, false);
            std::string msg = c->body;
            if (j.is_object() && j.contains("error") && j["error"].is_object() &&
                j["error"].contains("message")) {
                msg = DumpJson(j["error"]["message"]);
            }
            r.error = fmt::format("HTTP {}: {}", c->status, msg);
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
            const Json& e = j["error"];
            c->error_body =
                e.is_object() && e.contains("message") ? DumpJson(e["message"]) : DumpJson(e);
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
    FERRY_ASSIGN_OR_RETURN(Url url, ParseBaseUrl(o.base_url));
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

std::string FormatServeResult(const ServeBenchOptions& o, const ServeBenchResult& r) {
    const ServeMetrics& m = r.metrics;
    std::string s;
    auto line = [&](const std::string& k, const std::string& v) {
        s += fmt::format("{:<40} {:<10}\n", k, v);
    };
    auto f2 = [](double v) { return fmt::format("{:.2f}", v); };
    s += fmt::format("{:=^50}\n", " Serving Benchmark Result ");
    line("Successful requests:", std::to_string(m.completed));
    line("Failed requests:", std::to_string(m.failed));
    if (o.max_concurrency > 0)
        line("Maximum request concurrency:", std::to_string(o.max_concurrency));
    if (std::isfinite(o.request_rate)) line("Request rate configured (RPS):", f2(o.request_rate));
    line("Benchmark duration (s):", f2(m.duration));
    line("Total input tokens:", std::to_string(m.total_input));
    line("Total generated tokens:", std::to_string(m.total_output));
    if (m.prefix_cache_hit_rate) {
        line("Prefix cache hit rate (%):", f2(*m.prefix_cache_hit_rate * 100));
    }
    line("Request throughput (req/s):", f2(m.request_throughput));
    if (m.request_goodput) line("Request goodput (req/s):", f2(*m.request_goodput));
    line("Output token throughput (tok/s):", f2(m.output_throughput));
    line("Peak output token throughput (tok/s):", f2(m.peak_output_throughput));
    line("Peak concurrent requests:", f2(m.peak_concurrency));
    line("Total token throughput (tok/s):", f2(m.total_token_throughput));
    auto section = [&](const char* title, const char* name, const MetricStats& st) {
        s += fmt::format("{:-^50}\n", title);
        line(fmt::format("Mean {} (ms):", name), f2(st.mean));
        line(fmt::format("Median {} (ms):", name), f2(st.median));
        line(fmt::format("Std {} (ms):", name), f2(st.std));
        for (const auto& [p, v] : st.percentiles) {
            line(fmt::format("P{} {} (ms):", fmt::format("{:g}", p), name), f2(v));
        }
    };
    section("Time to First Token", "TTFT", m.ttft_ms);
    section("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms);
    section("Inter-token Latency", "ITL", m.itl_ms);
    section("End-to-end Latency", "E2EL", m.e2el_ms);
    s += std::string(50, '=') + "\n";
    int shown = 0;
    for (const RequestRecord& rec : r.records) {
        if (!rec.success && shown < 3) {
            s += fmt::format("error: {}\n", rec.error.substr(0, 300));
            ++shown;
        }
    }
    return s;
}

Status SaveServeResult(const ServeBenchOptions& o, const ServeBenchResult& r,
                       const std::string& path) {
    const ServeMetrics& m = r.metrics;
    Json j;
    std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof(date), "%Y%m%d-%H%M%S", std::gmtime(&now));
    j["date"] = date;
    j["label"] = o.label;
    j["backend"] = o.endpoint == "/v1/chat/completions" ? "openai-chat" : "openai";
    j["base_url"] = o.base_url;
    j["endpoint"] = o.endpoint;
    j["model_id"] = r.model;
    j["dataset_name"] = o.dataset_name;
    j["num_prompts"] = o.num_prompts;
    j["request_rate"] = std::isfinite(o.request_rate) ? Json(o.request_rate) : Json("inf");
    j["burstiness"] = o.burstiness;
    j["max_concurrency"] = o.max_concurrency > 0 ? Json(o.max_concurrency) : Json();
    j["seed"] = o.seed;
    j["duration"] = m.duration;
    j["completed"] = m.completed;
    j["failed"] = m.failed;
    j["total_input_tokens"] = m.total_input;
    j["total_output_tokens"] = m.total_output;
    j["request_throughput"] = m.request_throughput;
    j["request_goodput"] = m.request_goodput ? Json(*m.request_goodput) : Json();
    j["prefix_cache_hit_rate"] = m.prefix_cache_hit_rate ? Json(*m.prefix_cache_hit_rate) : Json();
    j["total_cached_tokens"] = m.total_cached;
    j["output_throughput"] = m.output_throughput;
    j["total_token_throughput"] = m.total_token_throughput;
    j["max_output_tokens_per_s"] = m.peak_output_throughput;
    j["max_concurrent_requests"] = m.peak_concurrency;
    auto put = [&](const char* name, const MetricStats& st) {
        j[fmt::format("mean_{}_ms", name)] = st.mean;
        j[fmt::format("median_{}_ms", name)] = st.median;
        j[fmt::format("std_{}_ms", name)] = st.std;
        for (const auto& [p, v] : st.percentiles) j[fmt::format("p{:g}_{}_ms", p, name)] = v;
    };
    put("ttft", m.ttft_ms);
    put("tpot", m.tpot_ms);
    put("itl", m.itl_ms);
    put("e2el", m.e2el_ms);
    Json reqs = Json::array();
    for (const RequestRecord& rec : r.records) {
        reqs.push_back(
            {{"success", rec.success},
             {"error", rec.error},
             {"start_s", rec.start},
             {"prompt_tokens", rec.prompt_tokens},
             {"output_tokens", rec.output_tokens},
             {"cached_tokens", rec.cached_tokens >= 0 ? Json(rec.cached_tokens) : Json()},
             {"ttft_s", rec.ttft},
             {"latency_s", rec.latency},
             {"itl_s", rec.itl}});
    }
    j["requests"] = reqs;
    std::string tmp = path + ".tmp";
    {
        std::ofstream f(tmp);
        if (!f) return UnavailableError(fmt::format("--save-result {}: cannot write", path));
        f << j.dump(1);
        if (!f) return UnavailableError(fmt::format("--save-result {}: write failed", path));
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        return UnavailableError(fmt::format("--save-result {}: {}", path, std::strerror(errno)));
    }
    return Status::Ok();
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
