#include "serve/openai_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fmt/core.h>
#include <httplib.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/log.h"
#include "discovery/http_guard.h"
#include "serve/openai_request.h"

namespace ferry::serve {

namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

int64_t UnixSeconds() {
    return std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// --- metrics ----------------------------------------------------------------------------------

class Histogram {
  public:
    explicit Histogram(std::vector<double> bounds)
        : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
    void Observe(double v) {
        size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
        ++counts_[i];
        sum_ += v;
        ++count_;
    }
    void Render(const std::string& name, const std::string& help, std::string* out) const {
        *out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
        uint64_t acc = 0;
        for (size_t i = 0; i < bounds_.size(); ++i) {
            acc += counts_[i];
            *out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], acc);
        }
        *out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_,
                            name, sum_, name, count_);
    }

  private:
    std::vector<double> bounds_;
    std::vector<uint64_t> counts_;
    double sum_ = 0;
    uint64_t count_ = 0;
};

// What the server adds to the engine's counters: latencies as the client sees them.
struct Metrics {
    std::mutex mu;
    Histogram ttft{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0}};
    Histogram itl{
        {0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5}};
    Histogram e2e{{0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0}};
    std::map<std::string, uint64_t> finished;  // by finish reason
    uint64_t bad_requests = 0;
    // Generated tokens per second over the last 10 s, in one-second buckets.
    std::array<uint64_t, 10> token_buckets{};
    int64_t bucket_second = 0;

    void AddTokens(uint64_t n, int64_t now_s) {
        Roll(now_s);
        token_buckets[now_s % 10] += n;
    }
    double TokensPerSecond(int64_t now_s) {
        Roll(now_s);
        uint64_t sum = 0;
        for (size_t i = 0; i < 10; ++i) {
            if (static_cast<int64_t>(i) != now_s % 10) sum += token_buckets[i];  // full seconds
        }
        return sum / 9.0;
    }

  private:
    void Roll(int64_t now_s) {
        if (bucket_second == 0) bucket_second = now_s;
        for (int64_t s = bucket_second + 1; s <= now_s && s <= bucket_second + 10; ++s) {
            token_buckets[s % 10] = 0;
        }
        bucket_second = std::max(bucket_second, now_s);
    }
};

// --- client liveness --------------------------------------------------------------------------

// The accepted socket of the request's connection, found by its peer address among our fds:
// cpp-httplib does not expose it, and a closed connection must abort its request even while
// nothing is being written to it.
int FindClientSocket(const std::string& addr, int port, int local_port) {
    const std::string want = addr + "|" + std::to_string(port);
    DIR* d = opendir("/proc/self/fd");
    if (!d) return -1;
    int found = -1;
    while (dirent* e = readdir(d)) {
        int fd = atoi(e->d_name);
        if (fd > 2 && discovery::AcceptedPeer(fd, static_cast<uint16_t>(local_port)) == want) {
            found = fd;
            break;
        }
    }
    closedir(d);
    return found;
}

bool ClientGone(int fd) {
    if (fd < 0) return false;
    pollfd p{fd, POLLRDHUP, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

// One request's outputs, handed from the engine thread to the HTTP thread.
struct Stream {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<engine::RequestOutput> events;
    bool done = false;
};

}  // namespace

struct OpenAiServer::Impl {
    std::shared_ptr<engine::Engine> engine;
    ServerConfig config;
    std::string model_name;
    int64_t created = UnixSeconds();
    httplib::Server http;
    std::unique_ptr<discovery::HttpGuard> guard;
    std::thread thread;
    int port = 0;
    std::atomic<bool> stopping{false};
    std::mutex stop_mu;
    std::condition_variable stop_cv;
    bool stopped = false;
    Metrics metrics;
    std::atomic<uint64_t> next_id{0};
    uint64_t id_salt = std::random_device{}();

    void Install();
    void Error(httplib::Response& res, int status, const BadRequest& e);
    void Completions(const httplib::Request& req, httplib::Response& res, bool chat);
    std::string RenderMetrics();
};

void OpenAiServer::Impl::Error(httplib::Response& res, int status, const BadRequest& e) {
    Json err = {{"message", e.message},
                {"type", status == 400 || status == 413 ? "invalid_request_error"
                         : status == 404                ? "not_found_error"
                         : status == 503                ? "service_unavailable"
                                                        : "server_error"},
                {"param", e.param.empty() ? Json() : Json(e.param)},
                {"code", e.code.empty() ? Json() : Json(e.code)}};
    res.status = status;
    res.set_content(Dump({{"error", err}}), "application/json");
    if (status == 400) {
        std::lock_guard lock(metrics.mu);
        ++metrics.bad_requests;
    }
}

void OpenAiServer::Impl::Install() {
    http.new_task_queue = [n = config.max_connections] {
        return new httplib::ThreadPool(static_cast<size_t>(n));
    };
    http.set_payload_max_length(config.max_body_bytes);
    http.set_read_timeout(30, 0);
    http.set_keep_alive_timeout(5);
    guard = std::make_unique<discovery::HttpGuard>(config.request_deadline);
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response&) {
        guard->RequestStarted(req.remote_addr, req.remote_port);
        return httplib::Server::HandlerResponse::Unhandled;
    });
    http.set_logger([this](const httplib::Request& req, const httplib::Response&) {
        guard->ResponseDone(req.remote_addr, req.remote_port);
    });

    http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
        res.set_content("{\"status\":\"ok\"}", "application/json");
    });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
        Json m = {{"id", model_name},   {"object", "model"},
                  {"created", created}, {"owned_by", "ferry"},
                  {"root", model_name}, {"max_model_len", engine->max_model_len()}};
        res.set_content(Dump({{"object", "list"}, {"data", Json::array({m})}}), "application/json");
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
        res.set_content(RenderMetrics(), "text/plain; version=0.0.4");
    });
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
        Completions(req, res, false);
    });
    http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
        Completions(req, res, true);
    });
    http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
        if (res.status == 404) {
            Error(res, 404, {fmt::format("no route {} {}", req.method, req.path), "", ""});
        } else if (res.status == 413) {
            Error(res, 413,
                  {fmt::format("the body is larger than {} bytes", config.max_body_bytes), "", ""});
        }
    });
    http.set_exception_handler(
        [this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
            std::string what = "internal error";
            try {
                std::rethrow_exception(ep);
            } catch (const std::exception& e) {
                what = e.what();
            } catch (...) {
            }
            Error(res, 500, {what, "", ""});
        });
}

void OpenAiServer::Impl::Completions(const httplib::Request& req, httplib::Response& res,
                                     bool chat) {
    const model::Tokenizer& tk = engine->model().tokenizer();
    ParsedRequest pr;
    BadRequest bad;
    if (!ParseOpenAiRequest(req.body, chat, tk, model_name, engine->max_model_len(), &pr, &bad)) {
        return Error(res, 400, bad);
    }

    const std::string id =
        fmt::format("{}-{:x}{:08x}", chat ? "chatcmpl" : "cmpl", id_salt, next_id.fetch_add(1));
    auto stream = std::make_shared<Stream>();
    const Clock::time_point submitted = Clock::now();
    auto last = std::make_shared<Clock::time_point>(submitted);
    auto first = std::make_shared<bool>(true);
    engine::Request er;
    er.id = id;
    er.prompt = pr.prompt;
    er.sampling = pr.sampling;
    er.on_output = [this, stream, submitted, last, first](const engine::RequestOutput& o) {
        Clock::time_point now = Clock::now();
        {
            std::lock_guard lock(metrics.mu);
            if (!o.tokens.empty()) {
                if (*first) {
                    metrics.ttft.Observe(std::chrono::duration<double>(now - submitted).count());
                    *first = false;
                } else {
                    metrics.itl.Observe(std::chrono::duration<double>(now - *last).count());
                }
                metrics.AddTokens(o.tokens.size(), std::chrono::duration_cast<std::chrono::seconds>(
                                                       now.time_since_epoch())
                                                       .count());
            }
            *last = now;
            if (o.finish != engine::FinishReason::kNone) {
                metrics.e2e.Observe(std::chrono::duration<double>(now - submitted).count());
                ++metrics.finished[engine::FinishReasonName(o.finish)];
            }
        }
        std::lock_guard lock(stream->mu);
        stream->events.push_back(o);
        if (o.finish != engine::FinishReason::kNone) stream->done = true;
        stream->cv.notify_all();
    };
    Status st = engine->Submit(std::move(er));
    if (!st.ok()) {
        int status = st.code() == Code::kUnavailable ? 503 : 400;
        return Error(res, status,
                     {st.message(), st.code() == Code::kInvalidArgument ? "prompt" : "", ""});
    }
    const int client_fd = FindClientSocket(req.remote_addr, req.remote_port, port);
    const std::string object = chat ? "chat.completion" : "text_completion";
    const int64_t created_at = UnixSeconds();

    auto usage_json = [](const engine::RequestOutput& o) {
        return Json{{"prompt_tokens", o.prompt_tokens},
                    {"completion_tokens", o.completion_tokens},
                    {"total_tokens", o.prompt_tokens + o.completion_tokens},
                    {"prompt_tokens_details", {{"cached_tokens", o.cached_tokens}}}};
    };
    // Log-probabilities of one output event, in the endpoint's format.
    auto logprobs_json = [&tk, chat](const engine::RequestOutput& o, size_t* text_offset) {
        if (chat) {
            Json content = Json::array();
            for (size_t i = 0; i < o.tokens.size() && i < o.logprobs.size(); ++i) {
                std::string t = tk.TokenBytes(o.tokens[i]);
                Json top = Json::array();
                for (auto [tid, lp] : o.top_logprobs[i]) {
                    std::string tt = tk.TokenBytes(tid);
                    top.push_back({{"token", tt},
                                   {"logprob", lp},
                                   {"bytes", std::vector<uint8_t>(tt.begin(), tt.end())}});
                }
                content.push_back({{"token", t},
                                   {"logprob", o.logprobs[i]},
                                   {"bytes", std::vector<uint8_t>(t.begin(), t.end())},
                                   {"top_logprobs", top}});
            }
            return Json{{"content", content}};
        }
        Json tokens = Json::array(), lps = Json::array(), tops = Json::array(),
             offsets = Json::array();
        for (size_t i = 0; i < o.tokens.size() && i < o.logprobs.size(); ++i) {
            std::string t = tk.TokenBytes(o.tokens[i]);
            tokens.push_back(t);
            lps.push_back(o.logprobs[i]);
            Json top = Json::object();
            for (auto [tid, lp] : o.top_logprobs[i]) top[tk.TokenBytes(tid)] = lp;
            tops.push_back(o.top_logprobs[i].empty() ? Json() : top);
            offsets.push_back(*text_offset);
            *text_offset += t.size();
        }
        return Json{{"tokens", tokens},
                    {"token_logprobs", lps},
                    {"top_logprobs", tops},
                    {"text_offset", offsets}};
    };

    if (!pr.stream) {
        engine::RequestOutput all;
        {
            std::unique_lock lock(stream->mu);
            for (;;) {
                stream->cv.wait_for(lock, std::chrono::milliseconds(100),
                                    [&] { return stream->done; });
                if (stream->done) break;
                if (ClientGone(client_fd) || stopping) {
                    lock.unlock();
                    engine->Abort(id);
                    lock.lock();
                    stream->cv.wait(lock, [&] { return stream->done; });
                    break;
                }
            }
            for (engine::RequestOutput& o : stream->events) {
                all.tokens.insert(all.tokens.end(), o.tokens.begin(), o.tokens.end());
                all.logprobs.insert(all.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
                all.top_logprobs.insert(all.top_logprobs.end(), o.top_logprobs.begin(),
                                        o.top_logprobs.end());
                all.text += o.text;
                all.finish = o.finish;
                all.error = o.error;
                all.prompt_tokens = o.prompt_tokens;
                all.completion_tokens = o.completion_tokens;
                all.cached_tokens = o.cached_tokens;
            }
        }
        if (all.finish == engine::FinishReason::kError) {
            return Error(res, 500, {all.error.message(), "", ""});
        }
        size_t offset = 0;
        Json choice = {{"index", 0}, {"finish_reason", engine::FinishReasonName(all.finish)}};
        if (chat) {
            choice["message"] = {{"role", "assistant"}, {"content", all.text}};
        } else {
            choice["text"] = all.text;
        }
        choice["logprobs"] = pr.want_logprobs ? logprobs_json(all, &offset) : Json();
        Json out = {{"id", id},
                    {"object", object},
                    {"created", created_at},
                    {"model", model_name},
                    {"choices", Json::array({choice})},
                    {"usage", usage_json(all)}};
        res.set_content(Dump(out), "application/json");
        return;
    }

    // Streaming: one SSE event per engine output.
    struct StreamState {
        bool sent_role = false;
        bool finished = false;
        size_t text_offset = 0;
    };
    auto state = std::make_shared<StreamState>();
    const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, stream, state, id, chat, chunk_object, created_at, client_fd, pr, usage_json,
         logprobs_json](size_t, httplib::DataSink& sink) {
            auto send = [&](const Json& j) {
                std::string line = "data: " + Dump(j) + "\n\n";
                return sink.write(line.data(), line.size());
            };
            auto chunk = [&](Json choice) {
                return Json{{"id", id},
                            {"object", chunk_object},
                            {"created", created_at},
                            {"model", model_name},
                            {"choices", Json::array({std::move(choice)})}};
            };
            if (chat && !state->sent_role) {
                state->sent_role = true;
                Json c = {{"index", 0},
                          {"delta", {{"role", "assistant"}, {"content", ""}}},
                          {"logprobs", Json()},
                          {"finish_reason", Json()}};
                if (!send(chunk(c))) return false;
            }
            std::deque<engine::RequestOutput> events;
            {
                std::unique_lock lock(stream->mu);
                stream->cv.wait_for(lock, std::chrono::milliseconds(100),
                                    [&] { return !stream->events.empty(); });
                events.swap(stream->events);
            }
            if (events.empty() && (ClientGone(client_fd) || stopping)) return false;
            for (const engine::RequestOutput& o : events) {
                const bool last = o.finish != engine::FinishReason::kNone;
                if (o.finish == engine::FinishReason::kError) {
                    Json err = {
                        {"error", {{"message", o.error.message()}, {"type", "server_error"}}}};
                    send(err);
                    break;
                }
                Json c = {{"index", 0}};
                if (chat) {
                    c["delta"] =
                        o.text.empty() && last ? Json::object() : Json{{"content", o.text}};
                } else {
                    c["text"] = o.text;
                }
                c["logprobs"] = pr.want_logprobs ? logprobs_json(o, &state->text_offset) : Json();
                c["finish_reason"] = last ? Json(engine::FinishReasonName(o.finish)) : Json();
                if (!send(chunk(c))) return false;
                if (last && pr.include_usage) {
                    Json u = {{"id", id},
                              {"object", chunk_object},
                              {"created", created_at},
                              {"model", model_name},
                              {"choices", Json::array()},
                              {"usage", usage_json(o)}};
                    if (!send(u)) return false;
                }
                if (last) state->finished = true;
            }
            if (state->finished ||
                (!events.empty() && events.back().finish == engine::FinishReason::kError)) {
                static const char kDone[] = "data: [DONE]\n\n";
                sink.write(kDone, sizeof(kDone) - 1);
                state->finished = true;
                sink.done();
            }
            return true;
        },
        [this, state, id](bool) {
            if (!state->finished) engine->Abort(id);  // the client went away mid-stream
        });
}

std::string OpenAiServer::Impl::RenderMetrics() {
    engine::EngineStats s = engine->Stats();
    std::string out;
    auto gauge = [&](const char* name, const char* help, double v) {
        out += fmt::format("# HELP {} {}\n# TYPE {} gauge\n{} {}\n", name, help, name, name, v);
    };
    auto counter = [&](const char* name, const char* help, double v) {
        out += fmt::format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, v);
    };
    gauge("ferry_num_requests_running", "Requests in the running batch.", s.running);
    gauge("ferry_num_requests_waiting", "Requests waiting to be scheduled.", s.waiting);
    gauge("ferry_kv_blocks_total", "KV cache blocks.", s.kv_blocks_total);
    gauge("ferry_kv_blocks_used", "KV cache blocks in use.", s.kv_blocks_used);
    gauge("ferry_kv_blocks_free", "KV cache blocks free (cached or empty).",
          s.kv_blocks_total - s.kv_blocks_used);
    gauge("ferry_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.",
          s.kv_blocks_total ? double(s.kv_blocks_used) / s.kv_blocks_total : 0.0);
    counter("ferry_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
            double(s.prefix_query_tokens));
    counter("ferry_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
            double(s.prefix_hit_tokens));
    gauge("ferry_prefix_cache_hit_rate", "Prefix cache hits / queries (tokens) since start.",
          s.prefix_query_tokens ? double(s.prefix_hit_tokens) / s.prefix_query_tokens : 0.0);
    counter("ferry_prompt_tokens_total", "Prompt tokens computed (prefix hits excluded).",
            double(s.prompt_tokens));
    counter("ferry_generation_tokens_total", "Tokens generated.", double(s.generation_tokens));
    counter("ferry_num_preemptions_total", "Sequences preempted (recomputed later).",
            double(s.preemptions));
    counter("ferry_engine_steps_total", "Engine steps run.", double(s.steps));
    std::lock_guard lock(metrics.mu);
    int64_t now_s =
        std::chrono::duration_cast<std::chrono::seconds>(Clock::now().time_since_epoch()).count();
    gauge("ferry_generation_tokens_per_second", "Tokens generated per second over the last 10 s.",
          metrics.TokensPerSecond(now_s));
    out +=
        "# HELP ferry_request_success_total Finished requests by finish reason.\n"
        "# TYPE ferry_request_success_total counter\n";
    for (const char* r : {"stop", "length", "abort", "error"}) {
        out += fmt::format("ferry_request_success_total{{finished_reason=\"{}\"}} {}\n", r,
                           metrics.finished[r]);
    }
    counter("ferry_request_bad_total", "Requests refused with HTTP 400.",
            double(metrics.bad_requests));
    metrics.ttft.Render("ferry_time_to_first_token_seconds", "Time to first token.", &out);
    metrics.itl.Render("ferry_inter_token_latency_seconds", "Time between output tokens.", &out);
    metrics.e2e.Render("ferry_e2e_request_latency_seconds", "Request latency, end to end.", &out);
    return out;
}

OpenAiServer::OpenAiServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<OpenAiServer>> OpenAiServer::Start(std::shared_ptr<engine::Engine> engine,
                                                          const ServerConfig& config) {
    if (!engine) return InvalidArgumentError("serve: no engine");
    if (config.max_connections < 1 || config.max_connections > 65536) {
        return InvalidArgumentError("serve: max connections must be 1..65536");
    }
    auto impl = std::make_unique<Impl>();
    impl->engine = std::move(engine);
    impl->config = config;
    impl->model_name = config.served_model_name.empty() ? impl->engine->model().config().name
                                                        : config.served_model_name;
    impl->Install();
    // cpp-httplib listens with a backlog of 5, compiled into Debian's library: a burst of
    // connections (a benchmark opening a thousand streams) overflows it and the kernel resets
    // some. Take the socket as it is made and listen again with the system's limit after bind.
    int listen_fd = -1;
    impl->http.set_socket_options([&listen_fd](int sock) {
        int yes = 1;
        setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
        if (listen_fd < 0) listen_fd = sock;
    });
    if (config.port == 0) {
        impl->port = impl->http.bind_to_any_port(config.host);
        if (impl->port <= 0) {
            return UnavailableError(fmt::format("serve: cannot bind {}:0", config.host));
        }
    } else {
        if (!impl->http.bind_to_port(config.host, config.port)) {
            return UnavailableError(
                fmt::format("serve: cannot bind {}:{} (in use?)", config.host, config.port));
        }
        impl->port = config.port;
    }
    if (listen_fd >= 0) ::listen(listen_fd, SOMAXCONN);
    impl->http.set_socket_options([](int sock) {
        int yes = 1;
        setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    });
    Impl* p = impl.get();
    impl->thread = std::thread([p] { p->http.listen_after_bind(); });
    while (!impl->http.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    impl->guard->Start(static_cast<uint16_t>(impl->port));
    return std::unique_ptr<OpenAiServer>(new OpenAiServer(std::move(impl)));
}

OpenAiServer::~OpenAiServer() { Stop(); }

int OpenAiServer::port() const { return impl_->port; }
const std::string& OpenAiServer::model_name() const { return impl_->model_name; }

void OpenAiServer::Stop() {
    if (impl_->stopping.exchange(true)) return;
    impl_->guard->Stop();
    impl_->http.stop();
    if (impl_->thread.joinable()) impl_->thread.join();
    std::lock_guard lock(impl_->stop_mu);
    impl_->stopped = true;
    impl_->stop_cv.notify_all();
}

void OpenAiServer::Wait() {
    std::unique_lock lock(impl_->stop_mu);
    impl_->stop_cv.wait(lock, [&] { return impl_->stopped; });
}

}  // namespace ferry::serve
