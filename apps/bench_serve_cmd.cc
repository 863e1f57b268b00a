#include "bench_serve_cmd.h"

#include <fmt/core.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench/datasets.h"
#include "bench/plot.h"
#include "bench/serve_bench.h"
#include "bench/transfer_bench.h"
#include "core/base64.h"
#include "core/child_process.h"
#include "core/crypto.h"
#include "http/http.h"
#include "model/model.h"
#include "model/vision.h"
#include "serve/serve_flags.h"

namespace ferry::cli {

namespace {

double ParseRate(const std::string& s) {
    if (s == "inf") return std::numeric_limits<double>::infinity();
    char* end = nullptr;
    double v = std::strtod(s.c_str(), &end);
    if (s.empty() || *end != '\0' || !(v > 0)) {
        throw CLI::ValidationError("--request-rate", "'" + s + "' is not a positive number or inf");
    }
    return v;
}

std::vector<double> ParsePercentiles(const std::string& s) {
    std::vector<double> out;
    size_t start = 0;
    while (true) {
        size_t comma = s.find(',', start);
        std::string item =
            s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        char* end = nullptr;
        double v = std::strtod(item.c_str(), &end);
        if (item.empty() || *end != '\0' || !(v > 0) || v > 100) {
            throw CLI::ValidationError("--percentiles", "'" + item + "' is not in (0, 100]");
        }
        out.push_back(v);
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    return out;
}

bench::GoodputLimits ParseGoodput(const std::vector<std::string>& items) {
    bench::GoodputLimits g;
    for (const std::string& it : items) {
        size_t colon = it.find(':');
        std::string key = it.substr(0, colon);
        char* end = nullptr;
        double v = colon == std::string::npos ? -1 : std::strtod(it.c_str() + colon + 1, &end);
        if (colon == std::string::npos || *end != '\0' || !(v > 0)) {
            throw CLI::ValidationError("--goodput", "'" + it + "' is not KEY:MS (ttft:500)");
        }
        if (key == "ttft") {
            g.ttft_ms = v;
        } else if (key == "tpot") {
            g.tpot_ms = v;
        } else if (key == "e2el") {
            g.e2el_ms = v;
        } else {
            throw CLI::ValidationError("--goodput", "'" + key + "' is not ttft, tpot or e2el");
        }
    }
    return g;
}

// A `ferry serve` or `ferry proxy` child: stopped with SIGTERM (SIGKILL after 5 s) when this
// object goes, and by the kernel if this process dies first.
class ServerProcess {
  public:
    static pid_t live_pid;  // for the SIGINT handler

    ~ServerProcess() { Stop(); }

    bool Start(const std::vector<std::string>& args, std::string* url, std::string* error) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        std::string line;
        ChildOptions options;
        options.die_with_parent = true;
        auto child = ChildProcess::Start(args, "", &line, std::chrono::seconds(60), options);
        if (!child.ok()) {
            *error = args[1] + " did not start: " + child.status().ToString();
            return false;
        }
        child_ = std::move(child).value();
        live_pid = child_.pid();
        for (;;) {
            const size_t at = line.find("listening on ");
            if (at != std::string::npos) {
                *url = line.substr(at + 13);
                return true;
            }
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now());
            auto next = child_.ReadLine("", std::max(left, std::chrono::milliseconds(1)));
            if (!next.ok()) {
                *error = args[1] + " did not start: " + next.status().ToString();
                Stop();
                return false;
            }
            line = std::move(next).value();
        }
    }

    void Stop() {
        child_.Terminate(std::chrono::seconds(5));
        live_pid = -1;
    }

  private:
    ChildProcess child_;
};
pid_t ServerProcess::live_pid = -1;

void OnInterrupt(int) {
    if (ServerProcess::live_pid > 0) kill(ServerProcess::live_pid, SIGKILL);
    _exit(130);
}

std::string SelfExe() {
    std::error_code ec;
    auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
    return ec ? "ferry" : p.string();
}

}  // namespace

void AddServeBenchCommands(CLI::App& bench, int* rc) {
    CLI::App* sb = bench.add_subcommand(
        "serve",
        "Serving benchmark against an OpenAI-compatible endpoint, with vllm bench serve's "
        "metrics and layout");
    static bench::ServeBenchOptions o;
    static std::string rate = "inf", percentiles = "99", mm_size = "64x64";
    static std::vector<std::string> goodput;
    static bool no_progress = false;
    sb->add_option("--base-url", o.base_url, "server root, http://host:port")
        ->capture_default_str();
    sb->add_option("--endpoint", o.endpoint, "/v1/completions or /v1/chat/completions")
        ->check(CLI::IsMember({"/v1/completions", "/v1/chat/completions"}))
        ->capture_default_str();
    sb->add_option("--model", o.model, "model name (default: the server's first)");
    sb->add_option("--tokenizer", o.tokenizer,
                   "GGUF file whose tokenizer makes and counts prompts (default: one ASCII "
                   "character per token)");
    sb->add_option("--dataset-name", o.dataset_name,
                   "random, sharegpt, random-mm or prefix_repetition")
        ->check(CLI::IsMember({"random", "sharegpt", "random-mm", "prefix_repetition"}))
        ->capture_default_str();
    sb->add_option("--dataset-path", o.dataset_path, "ShareGPT-format JSON file");
    sb->add_option("--random-input-len", o.random_input_len, "prompt tokens")
        ->check(CLI::Range(1, 1 << 24))
        ->capture_default_str();
    sb->add_option("--random-output-len", o.random_output_len, "output tokens (max_tokens)")
        ->check(CLI::Range(1, 1 << 24))
        ->capture_default_str();
    sb->add_option("--random-range-ratio", o.random_range_ratio,
                   "lengths uniform in [len*(1-r), len*(1+r)]")
        ->check(CLI::Range(0.0, 0.999));
    sb->add_option("--random-prefix-len", o.random_prefix_len, "tokens shared by every prompt")
        ->check(CLI::Range(0, 1 << 24));
    sb->add_option("--random-mm-images", o.mm_images, "random-mm: images per request")
        ->check(CLI::Range(1, 64));
    sb->add_option("--random-mm-size", mm_size, "random-mm: image size WxH");
    sb->add_option("--random-mm-distinct", o.mm_distinct,
                   "random-mm: draw the images from a pool of this many, in turn (repeats hit "
                   "the encoder cache; 0: every image distinct)")
        ->check(CLI::Range(0, 1 << 20))
        ->capture_default_str();
    sb->add_option("--prefix-repetition-prefix-len", o.prefix_repetition_prefix_len,
                   "prefix_repetition: tokens of each shared prefix")
        ->check(CLI::Range(0, 1 << 24))
        ->capture_default_str();
    sb->add_option("--prefix-repetition-suffix-len", o.prefix_repetition_suffix_len,
                   "prefix_repetition: random tokens after the prefix")
        ->check(CLI::Range(0, 1 << 24))
        ->capture_default_str();
    sb->add_option("--prefix-repetition-num-prefixes", o.prefix_repetition_num_prefixes,
                   "prefix_repetition: distinct prefixes (num-prompts / this prompts each)")
        ->check(CLI::Range(1, 1 << 24))
        ->capture_default_str();
    sb->add_option("--prefix-repetition-output-len", o.prefix_repetition_output_len,
                   "prefix_repetition: output tokens (max_tokens)")
        ->check(CLI::Range(1, 1 << 24))
        ->capture_default_str();
    sb->add_option("--sharegpt-output-len", o.sharegpt_output_len, "override output lengths")
        ->check(CLI::Range(0, 1 << 24));
    sb->add_option("--num-prompts", o.num_prompts, "requests to send")
        ->check(CLI::Range(1, 10000000))
        ->capture_default_str();
    sb->add_option("--request-rate", rate, "requests per second (Poisson), or inf")
        ->capture_default_str();
    sb->add_option("--burstiness", o.burstiness, "gamma shape of the arrivals (1 = Poisson)")
        ->check(CLI::Range(0.001, 1000.0));
    sb->add_option("--max-concurrency", o.max_concurrency, "most requests in flight (0: no cap)")
        ->check(CLI::Range(0, 1000000));
    sb->add_flag("--ignore-eos", o.ignore_eos, "ask the server to ignore end-of-sequence");
    sb->add_option("--temperature", o.temperature, "sampling temperature")
        ->check(CLI::Range(0.0, 2.0));
    sb->add_option("--seed", o.seed, "dataset and arrival seed");
    sb->add_option("--goodput", goodput, "SLOs: ttft:MS tpot:MS e2el:MS");
    sb->add_option("--percentiles,--metric-percentiles", percentiles, "e.g. 50,90,99")
        ->capture_default_str();
    sb->add_option("--save-result", o.save_result, "write metrics and per-request records (JSON)");
    sb->add_option("--label", o.label, "name of this run in the JSON and in plots");
    sb->add_option("--request-timeout", o.request_timeout, "seconds per request")
        ->check(CLI::Range(0.1, 86400.0));
    sb->add_flag("--no-progress", no_progress, "no progress bar on stderr");
    sb->callback([rc] {
        o.request_rate = ParseRate(rate);
        o.percentiles = ParsePercentiles(percentiles);
        o.goodput = ParseGoodput(goodput);
        o.progress = !no_progress;
        if (std::sscanf(mm_size.c_str(), "%dx%d", &o.mm_width, &o.mm_height) != 2 ||
            o.mm_width < 1 || o.mm_height < 1 || o.mm_width > 4096 || o.mm_height > 4096) {
            throw CLI::ValidationError("--random-mm-size", "'" + mm_size + "' is not WxH");
        }
        *rc = bench::RunServeBenchCommand(o);
    });

    CLI::App* plot =
        bench.add_subcommand("plot", "SVG charts from `ferry bench serve --save-result` files");
    static std::vector<std::string> files;
    static std::string out = "plots";
    plot->add_option("results", files, "result JSON files")->required();
    plot->add_option("--out", out, "output directory")->capture_default_str();
    plot->callback([rc] {
        auto written = bench::PlotServeResults(files, out);
        if (!written.ok()) {
            fmt::print(stderr, "ferry bench plot: {}\n", written.status().ToString());
            *rc = 1;
            return;
        }
        for (const std::string& f : *written) fmt::print("wrote {}\n", f);
    });
}

void AddDemoCommand(CLI::App& app, int* rc) {
    CLI::App* demo = app.add_subcommand(
        "demo",
        "The main job behind `make demo`: serve a model on loopback, run the serving benchmark "
        "at several request rates, run the transfer benchmark on every backend, print the "
        "tables and write the plots");
    static std::string model_path, preset = "tiny", out_dir = "demo-results", rates = "4,16,inf";
    static int num_prompts = 48, input_len = 256, output_len = 64;
    static double transfer_duration = 1.0;
    demo->add_option("--model", model_path, "GGUF model (default: a random-weight preset)");
    demo->add_option("--preset", preset, "preset made when no model is given: tiny or small")
        ->check(CLI::IsMember({"tiny", "small"}))
        ->capture_default_str();
    demo->add_option("--out", out_dir, "directory for results and plots")->capture_default_str();
    demo->add_option("--rates", rates, "request rates to run, comma list (inf allowed)")
        ->capture_default_str();
    demo->add_option("--num-prompts", num_prompts, "requests per rate")
        ->check(CLI::Range(1, 100000))
        ->capture_default_str();
    demo->add_option("--input-len", input_len, "prompt tokens")->check(CLI::Range(1, 100000));
    demo->add_option("--output-len", output_len, "output tokens")->check(CLI::Range(1, 100000));
    demo->add_option("--duration", transfer_duration, "seconds per transfer benchmark row")
        ->check(CLI::Range(0.1, 60.0));
    demo->callback([rc] {
        signal(SIGINT, OnInterrupt);
        signal(SIGTERM, OnInterrupt);
        std::filesystem::create_directories(out_dir);
        const bool preset_model = model_path.empty();
        if (model_path.empty()) {
            model_path = (std::filesystem::path(out_dir) / (preset + ".gguf")).string();
            if (!std::filesystem::exists(model_path)) {
                Status st = model::WriteRandomModel(*model::PresetSpec(preset), 1, model_path);
                if (!st.ok()) {
                    fmt::print(stderr, "ferry demo: {}\n", st.ToString());
                    *rc = 1;
                    return;
                }
            }
            fmt::print("ferry demo: model {} (random weights, {} preset)\n", model_path, preset);
        }
        // Deployments to compare: colocated, and prefill + decode workers behind the proxy (pull:
        // vLLM's NixlConnector protocol; push: layer-wise). "{N}" in an argument is the
        // host:port of the deployment's N-th process; the last process is the one served.
        struct Deployment {
            std::string label;
            std::vector<std::vector<std::string>> procs;
            bool images = false;  // chat requests with an image each (random-mm)
        };
        // A deployment secret, as in production: the workers take kv_transfer_params only
        // from the proxy, which proves it with the router token (docs/security.md).
        const std::string secret_path = (std::filesystem::path(out_dir) / "secret").string();
        {
            std::ofstream(secret_path) << RandomId128() << RandomId128() << "\n";
            std::filesystem::permissions(secret_path, std::filesystem::perms::owner_read |
                                                          std::filesystem::perms::owner_write);
        }
        // Each worker's command line from its flags (serve/serve_flags.h: what differs from
        // `ferry serve`'s defaults).
        auto worker = [&](const std::string& role,
                          const std::function<void(serve::ServeFlags&)>& more = {}) {
            serve::ServeFlags f;
            f.model = model_path;
            f.port = 0;
            f.max_model_len = 4096;
            f.role = role;
            if (role != "colocated") f.secret_file = secret_path;
            if (more) more(f);
            std::vector<std::string> a = {SelfExe(), "serve"};
            for (std::string& arg : serve::ServeArgs(f)) a.push_back(std::move(arg));
            return a;
        };
        auto proxy = [&](const std::string& mode) {
            return std::vector<std::string>{
                SelfExe(), "proxy",         "--prefill", "{0}",        "--decode",
                "{1}",     "--port",        "0",         "--no-store", "--kv-transfer",
                mode,      "--secret-file", secret_path};
        };
        std::vector<Deployment> deployments = {
            {"colocated", {worker("colocated")}},
            {"pull", {worker("prefill"), worker("decode"), proxy("pull")}},
            {"push", {worker("prefill"), worker("decode"), proxy("push")}}};
        // EPD (a preset's model: its random vision projector is written beside it): images
        // encoded by the language-model worker itself, against an encode worker whose
        // embeddings reach the worker over the transfer connector (vLLM's 1e1pd).
        std::string mmproj;
        if (preset_model) {
            mmproj = (std::filesystem::path(out_dir) / (preset + "-mmproj.gguf")).string();
            auto vs = model::PresetVisionSpec(preset + "-vl");
            Status st = vs.ok() ? model::WriteRandomMmproj(*vs, 1, mmproj) : vs.status();
            if (!st.ok()) {
                fmt::print(stderr, "ferry demo: {}\n", st.ToString());
                *rc = 1;
                return;
            }
        }
        if (!mmproj.empty()) {
            auto images = [&](serve::ServeFlags& f) {
                f.mmproj = mmproj;
                f.max_pending_image_requests = 1024;
            };
            // The encoder-cache connector over the transfer engine, on shm.
            auto ec = [&](serve::ServeFlags& f) {
                images(f);
                f.ec_connector = "transfer";
                f.kv_backend = "shm";
                f.secret_file = secret_path;
            };
            deployments.push_back({"colocated-mm", {worker("colocated", images)}, true});
            deployments.push_back({"epd",
                                   {worker("encode", ec),
                                    worker("colocated", ec),
                                    {SelfExe(), "proxy", "--encode", "{0}", "--decode", "{1}",
                                     "--port", "0", "--no-store", "--secret-file", secret_path}},
                                   true});
        }
        // The check before the benchmark: greedy answers of every deployment, token ids.
        std::vector<std::vector<int32_t>> check_prompts;
        for (int i = 0; i < 16; ++i) {
            std::vector<int32_t> p;
            for (int k = 0; k < 8 + i * 97; ++k) p.push_back((k * 31 + i * 7 + k * k) % 256);
            check_prompts.push_back(std::move(p));
        }
        std::vector<std::vector<int32_t>> reference, reference_mm;
        std::vector<std::string> results;
        std::vector<double> rate_list;
        {
            size_t start = 0;
            while (true) {
                size_t c = rates.find(',', start);
                std::string item =
                    rates.substr(start, c == std::string::npos ? std::string::npos : c - start);
                rate_list.push_back(ParseRate(item));
                if (c == std::string::npos) break;
                start = c + 1;
            }
        }
        std::string summary = fmt::format("{:<12} {:>8} {:>9} {:>12} {:>12} {:>12} {:>12} {:>12}\n",
                                          "deployment", "rate", "req/s", "out tok/s", "mean TTFT",
                                          "P99 TTFT", "mean TPOT", "P99 TPOT");
        for (const Deployment& d : deployments) {
            std::vector<std::unique_ptr<ServerProcess>> procs;
            std::vector<std::string> addrs;
            std::string url, error;
            for (std::vector<std::string> args : d.procs) {
                for (std::string& a : args) {
                    if (a.size() == 3 && a[0] == '{' && a[2] == '}') a = addrs.at(a[1] - '0');
                }
                procs.push_back(std::make_unique<ServerProcess>());
                if (!procs.back()->Start(args, &url, &error)) {
                    fmt::print(stderr, "ferry demo: {}\n", error);
                    *rc = 1;
                    return;
                }
                addrs.push_back(url.substr(url.find("//") + 2));
            }
            fmt::print("ferry demo: {} deployment serving at {} ({} processes)\n", d.label, url,
                       procs.size());
            {
                // Token for token against the colocated answers (with images: the colocated
                // worker's that encodes them itself).
                auto ep = http::ParseEndpoint(url);
                std::vector<std::vector<int32_t>> got;
                for (size_t i = 0; i < check_prompts.size(); ++i) {
                    const auto& p = check_prompts[i];
                    http::ClientRequest req;
                    req.host = ep->host;
                    req.port = ep->port;
                    req.target = d.images ? "/v1/chat/completions" : "/v1/completions";
                    req.timeout = std::chrono::seconds(120);
                    nlohmann::json body = {{"max_tokens", 16},
                                           {"temperature", 0},
                                           {"ignore_eos", true},
                                           {"return_tokens_as_token_ids", true}};
                    if (d.images) {
                        // Text, then an image (4 distinct, repeated), then text.
                        const std::string png = bench::RandomPng(48 + 8 * int(i % 4), 40, i % 4);
                        body["messages"] = {
                            {{"role", "user"},
                             {"content",
                              {{{"type", "text"},
                                {"text", std::string(1 + i * 13, char('a' + i % 26))}},
                               {{"type", "image_url"},
                                {"image_url",
                                 {{"url", "data:image/png;base64," + Base64Encode(png)}}}},
                               {{"type", "text"}, {"text", "what is it?"}}}}}};
                        body["logprobs"] = true;
                    } else {
                        body["prompt"] = p;
                        body["logprobs"] = 0;
                    }
                    req.body = body.dump();
                    std::vector<int32_t> tokens;
                    auto r = http::Fetch(req);
                    if (r.ok() && r->status == 200) {
                        auto j = nlohmann::json::parse(r->body, nullptr, false);
                        if (j.is_object()) {
                            const nlohmann::json& lp = j["choices"][0]["logprobs"];
                            for (const auto& t : d.images ? lp["content"] : lp["tokens"]) {
                                std::string s =
                                    d.images ? t["token"].get<std::string>() : t.get<std::string>();
                                tokens.push_back(std::stoi(s.substr(s.find(':') + 1)));
                            }
                        }
                    }
                    got.push_back(std::move(tokens));
                }
                std::vector<std::vector<int32_t>>& want = d.images ? reference_mm : reference;
                if (want.empty()) {
                    want = got;
                    fmt::print(
                        "ferry demo: {} answers to {} {} are the reference\n\n", d.label,
                        got.size(),
                        d.images ? "chat requests with an image each" : "prompts (8..1463 tokens)");
                } else {
                    int equal = 0;
                    for (size_t i = 0; i < got.size(); ++i) {
                        equal += !got[i].empty() && got[i] == want[i];
                    }
                    fmt::print(
                        "ferry demo: {}: {}/{} answers equal the colocated ones token for "
                        "token\n\n",
                        d.label, equal, got.size());
                    if (equal != static_cast<int>(got.size())) *rc = 1;
                }
            }
            for (double r : rate_list) {
                bench::ServeBenchOptions o;
                o.base_url = url;
                o.dataset_name = d.images ? "random-mm" : "random";
                if (d.images) o.endpoint = "/v1/chat/completions";
                o.random_input_len = input_len;
                o.random_output_len = output_len;
                o.num_prompts = num_prompts;
                o.request_rate = r;
                o.ignore_eos = true;
                o.label = d.label;
                o.percentiles = {50, 99};
                o.tokenizer = model_path;
                std::string rate_name = std::isfinite(r) ? fmt::format("{:g}", r) : "inf";
                o.save_result = (std::filesystem::path(out_dir) /
                                 fmt::format("serve-{}-rate-{}.json", d.label, rate_name))
                                    .string();
                fmt::print("--- {} at request rate {} ({} prompts, {} in / {} out tokens)\n",
                           d.label, rate_name, num_prompts, input_len, output_len);
                std::fflush(stdout);
                auto res = bench::RunServeBench(o);
                if (!res.ok()) {
                    fmt::print(stderr, "ferry demo: {}\n", res.status().ToString());
                    *rc = 1;
                    return;
                }
                fmt::print("{}\n", bench::FormatServeResult(o, *res));
                if (Status st = bench::SaveServeResult(o, *res, o.save_result); !st.ok()) {
                    fmt::print(stderr, "ferry demo: {}\n", st.ToString());
                }
                results.push_back(o.save_result);
                const bench::ServeMetrics& m = res->metrics;
                summary += fmt::format(
                    "{:<12} {:>8} {:>9.2f} {:>12.1f} {:>10.1f}ms {:>10.1f}ms {:>10.2f}ms "
                    "{:>10.2f}ms\n",
                    d.label, rate_name, m.request_throughput, m.output_throughput, m.ttft_ms.mean,
                    m.ttft_ms.percentiles.back().second, m.tpot_ms.mean,
                    m.tpot_ms.percentiles.back().second);
                if (m.failed > 0) *rc = 1;
            }
            for (auto it = procs.rbegin(); it != procs.rend(); ++it) (*it)->Stop();
        }
        fmt::print("=== Serving, side by side\n{}\n", summary);

        fmt::print(
            "=== Transfer engine: two processes, each row beside its same-run reference\n"
            "(memcpy between pre-faulted buffers for shm, one plain TCP stream for tcp)\n\n");
        std::fflush(stdout);
        bench::TransferBenchOptions t;
        t.duration = transfer_duration;
        struct Sweep {
            std::vector<uint64_t> blocks, batches;
        };
        for (const Sweep& sw :
             {Sweep{{4u << 20}, {1}}, Sweep{{64u << 10}, {32}}, Sweep{{16u << 10}, {1024}}}) {
            t.block_sizes = sw.blocks;
            t.batches = sw.batches;
            *rc |= bench::RunTransferBench(t);
            fmt::print("\n");
        }

        auto written = bench::PlotServeResults(results, out_dir);
        if (!written.ok()) {
            fmt::print(stderr, "ferry demo: plots: {}\n", written.status().ToString());
            *rc = 1;
            return;
        }
        fmt::print("=== Plots\n");
        for (const std::string& f : *written) fmt::print("  {}\n", f);
        fmt::print("Results (JSON, every request): {}/serve-*.json\n", out_dir);
    });
}

}  // namespace ferry::cli
