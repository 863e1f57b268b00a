#include "serve/sglang_cli.h"

#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <span>
#include <string_view>

namespace ferry::serve {

namespace {

// SGLang flags that mark a command as SGLang's (none of them is ferry's or vLLM's).
constexpr std::string_view kSglangOnly[] = {"--model-path",
                                            "--tp-size",
                                            "--disaggregation-mode",
                                            "--disaggregation-transfer-backend",
                                            "--disaggregation-bootstrap-port",
                                            "--context-length",
                                            "--page-size",
                                            "--max-running-requests",
                                            "--chunked-prefill-size",
                                            "--disable-radix-cache",
                                            "--mem-fraction-static",
                                            "--dp-size",
                                            "--pp-size"};

// Flags with a value that mean nothing here.
constexpr std::string_view kSglangIgnoredWithValue[] = {
    "--mem-fraction-static", "--tokenizer-path",
    "--log-level",           "--attention-backend",
    "--cuda-graph-max-bs",   "--disaggregation-ib-device",
    "--random-seed",         "--dtype",
    "--load-format",         "--base-gpu-id",
    "--load-balance-method", "--schedule-policy",
    "--kv-cache-dtype",      "--quantization",
    "--dist-init-addr",      "--nnodes",
    "--node-rank",           "--watchdog-timeout",
    "--max-total-tokens",    "--stream-interval",
    "--decode-log-interval"};
// Switches that mean nothing here.
constexpr std::string_view kSglangIgnoredFlags[] = {
    "--trust-remote-code",   "--disable-cuda-graph",   "--enable-metrics",
    "--skip-server-warmup",  "--enable-torch-compile", "--disable-overlap-schedule",
    "--enable-dp-attention", "--log-requests"};

bool SglangIn(std::string_view s, std::span<const std::string_view> set) {
    return std::find(set.begin(), set.end(), s) != set.end();
}

}  // namespace

Result<TranslatedArgs> TranslateSglangServeArgs(const std::vector<std::string>& in) {
    TranslatedArgs out;
    // "--flag=value" as two arguments.
    std::vector<std::string> args;
    for (const std::string& a : in) {
        const size_t eq = a.find('=');
        if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
            args.push_back(a.substr(0, eq));
            args.push_back(a.substr(eq + 1));
        } else {
            args.push_back(a);
        }
    }
    const bool sglang = std::any_of(args.begin(), args.end(),
                                    [](const std::string& a) { return SglangIn(a, kSglangOnly); });
    if (!sglang) {
        out.args = in;
        return out;
    }
    const std::map<std::string_view, std::string_view> renamed = {
        {"--model-path", "--model"},
        {"--tp-size", "--tp"},
        {"--context-length", "--max-model-len"},
        {"--page-size", "--block-size"},
        {"--max-running-requests", "--max-num-seqs"},
        {"--disaggregation-bootstrap-port", "--bootstrap-port"}};
    std::string model, mode, served, bootstrap;
    bool port_given = false;
    for (size_t i = 0; i < args.size(); ++i) {
        const std::string& a = args[i];
        auto value = [&]() -> Result<std::string> {
            if (i + 1 >= args.size()) {
                return InvalidArgumentError(fmt::format("{} needs a value", a));
            }
            return args[++i];
        };
        if (a == "--port") port_given = true;
        if (a == "--served-model-name") {
            FERRY_ASSIGN_OR_RETURN(served, value());
            out.args.insert(out.args.end(), {a, served});
            continue;
        }
        if (auto r = renamed.find(a); r != renamed.end()) {
            FERRY_ASSIGN_OR_RETURN(std::string v, value());
            if (a == "--model-path") model = v;
            if (a == "--disaggregation-bootstrap-port") bootstrap = v;
            out.args.insert(out.args.end(), {std::string(r->second), v});
            out.notes.push_back(fmt::format("{} {}: {} {}", a, v, r->second, v));
            continue;
        }
        if (a == "--disaggregation-mode") {
            FERRY_ASSIGN_OR_RETURN(mode, value());
            if (mode == "prefill" || mode == "decode") {
                out.args.insert(out.args.end(), {"--role", mode});
            } else if (mode != "null") {
                return InvalidArgumentError(fmt::format(
                    "--disaggregation-mode '{}' is not one of null, prefill, decode", mode));
            }
            out.notes.push_back(
                fmt::format("--disaggregation-mode {}: {}", mode,
                            mode == "null" ? "a colocated worker" : "--role " + mode));
            continue;
        }
        if (a == "--disaggregation-transfer-backend") {
            FERRY_ASSIGN_OR_RETURN(std::string b, value());
            if (b == "fake") {
                return InvalidArgumentError(
                    "--disaggregation-transfer-backend fake (no KV moved) has no equivalent "
                    "here: ferry's prefill and decode workers always move the KV");
            }
            out.notes.push_back(fmt::format(
                "--disaggregation-transfer-backend {}: ferry's transfer engine moves the KV "
                "(shm on one host, tcp or ucx between hosts; --kv-backend to choose)",
                b));
            continue;
        }
        if (a == "--dp-size" || a == "--dp" || a == "--pp-size") {
            FERRY_ASSIGN_OR_RETURN(std::string v, value());
            if (v != "1") {
                return InvalidArgumentError(fmt::format(
                    "{} {}: data and pipeline parallelism are not implemented (only 1)", a, v));
            }
            out.notes.push_back(fmt::format("{} 1: the default", a));
            continue;
        }
        if (a == "--chunked-prefill-size") {
            FERRY_ASSIGN_OR_RETURN(std::string v, value());
            if (v == "-1") {
                out.args.push_back("--no-chunked-prefill");
            } else {
                out.args.insert(out.args.end(), {"--max-num-batched-tokens", v});
            }
            out.notes.push_back(
                fmt::format("--chunked-prefill-size {}: {}", v,
                            v == "-1" ? "--no-chunked-prefill" : "--max-num-batched-tokens " + v));
            continue;
        }
        if (a == "--disable-radix-cache") {
            out.args.push_back("--no-prefix-caching");
            out.notes.push_back("--disable-radix-cache: --no-prefix-caching");
            continue;
        }
        if (SglangIn(a, kSglangIgnoredWithValue)) {
            FERRY_ASSIGN_OR_RETURN(std::string v, value());
            out.notes.push_back(fmt::format("{} {}: no meaning here, ignored", a, v));
            continue;
        }
        if (SglangIn(a, kSglangIgnoredFlags)) {
            out.notes.push_back(fmt::format("{}: no meaning here, ignored", a));
            continue;
        }
        out.args.push_back(a);
    }
    if (!model.empty() && served.empty()) {
        // SGLang serves a model under its path.
        out.args.insert(out.args.end(), {"--served-model-name", model});
    }
    if (mode == "prefill" && bootstrap.empty()) {
        out.args.insert(out.args.end(), {"--bootstrap-port", "8998"});
        out.notes.push_back("bootstrap server on SGLang's default port 8998");
    }
    if (!port_given) {
        out.args.insert(out.args.end(), {"--port", "30000"});
        out.notes.push_back("port 30000, SGLang's default");
    }
    return out;
}

}  // namespace ferry::serve
