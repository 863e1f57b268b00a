// The single `ferry` binary. Subcommands stay thin: parse flags, call into the libraries.
#include <fmt/core.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <string>
#include <vector>

#include "bench/transfer_bench.h"
#include "bench_serve_cmd.h"
#include "core/log.h"
#include "discovery_cmd.h"
#include "model_cmd.h"
#include "proxy_cmd.h"
#include "serve/sglang_cli.h"
#include "serve/vllm_cli.h"
#include "transfer/backend.h"

namespace {

// Parses "4K,64K,4M" into bytes; throws CLI::ValidationError naming the bad item.
std::vector<uint64_t> ParseSizeList(const std::string& flag, const std::string& text) {
    std::vector<uint64_t> out;
    size_t start = 0;
    while (start <= text.size()) {
        size_t comma = text.find(',', start);
        std::string item =
            text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        uint64_t v = 0;
        if (!ferry::bench::ParseSize(item, &v)) {
            throw CLI::ValidationError(
                flag, "'" + item + "' is not a size (examples: 4096, 64K, 4M, 1G)");
        }
        out.push_back(v);
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    // Servers and the proxy hold a socket per client connection (and relay streams): raise the
    // open-file limit to what the system allows, as vLLM does (Debian's soft default is 1024).
    {
        rlimit lim{};
        if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
            lim.rlim_cur = lim.rlim_max;
            setrlimit(RLIMIT_NOFILE, &lim);
        }
    }
    CLI::App app{"ferry: disaggregated LLM serving — transfer engine, connectors, serving"};
    app.require_subcommand(1);
    bool verbose = false;
    app.add_flag("-v,--verbose", verbose, "Log connection-level events to stderr");

    app.add_subcommand("version", "Print the version")->callback([] {
        fmt::print("ferry 0.1.0\n");
    });

    int rc = 0;
    ferry::cli::AddDemoCommand(app, &rc);

    ferry::cli::AddDiscoveryCommand(app, &rc);
    ferry::cli::AddRouterTokenCommand(app, &rc);
    ferry::cli::AddModelCommand(app, &rc);
    ferry::cli::AddServeCommand(app, &rc);
    ferry::cli::AddProxyCommand(app, &rc);

    CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
    bench->require_subcommand(1);
    ferry::cli::AddModelBenchCommand(*bench, &rc);
    ferry::cli::AddServeBenchCommands(*bench, &rc);
    CLI::App* transfer = bench->add_subcommand(
        "transfer",
        "Move batches of blocks between two processes through the transfer engine; print GB/s, "
        "descriptors/s and batch latency beside a same-run reference (memcpy for shm, a plain TCP "
        "stream for tcp)");
    ferry::bench::TransferBenchOptions o;
    std::string backends = "shm,tcp", ops = "write,read", blocks = "4M", batches = "1";
    transfer->add_option("--role", o.role, "both: spawn the target here; or target / initiator")
        ->check(CLI::IsMember({"both", "target", "initiator"}));
    transfer->add_option("--peer", o.peer, "initiator: the target's host:port");
    transfer->add_option("--listen", o.listen, "host:port of this side's agent (port 0 = any)");
    transfer->add_option("--backend", backends,
                         "shm, tcp, ucx (where built), file (memory <-> a file through io_uring), "
                         "or a comma list");
    transfer->add_option("--op", ops, "read, write, or a comma list");
    transfer->add_option("--block-size", blocks, "bytes per descriptor; a comma list sweeps");
    transfer->add_option("--batch", batches, "descriptors per transfer; a comma list sweeps");
    transfer->add_option("--streams", o.streams, "parallel connections per peer (0 = default)")
        ->check(CLI::Range(0, 64));
    transfer->add_option("--io-threads", o.io_threads, "I/O threads per agent (0 = default)")
        ->check(CLI::Range(0, 64));
    transfer->add_option("--inflight", o.inflight, "transfers in flight at once")
        ->check(CLI::Range(1, 64));
    transfer->add_option("--duration", o.duration, "seconds per row")
        ->check(CLI::Range(0.05, 3600.0));
    transfer->add_option("--warmup", o.warmup, "seconds of warm-up per row")
        ->check(CLI::Range(0.0, 60.0));
    transfer->add_flag("--json", o.json, "one JSON object per row");
    transfer->add_flag("--no-reference", o.no_reference, "skip the reference measurement");
    transfer->add_option("--secret", o.secret, "deployment secret for both agents");
    transfer->add_flag("--ucx-rma", o.ucx_rma,
                       "ucx: both agents grant and use one-sided access (ucp_put_nbx / "
                       "ucp_get_nbx; AgentConfig::ucx_rma)");
    transfer->add_flag("--ucx-reference-without-error-handling", o.ucx_reference_no_eh,
                       "ucx: run the ucx_perftest reference without -e (peer error handling, "
                       "which the backend uses and which costs UCX 1.13 half its tcp bandwidth)");
    transfer->add_option("--file", o.file_path,
                         "file backend: the file to read and write (default: "
                         "ferry-bench-file.bin here; created and filled)");
    std::string file_size = "1GiB";
    std::string working_set;
    transfer->add_option("--working-set", working_set,
                         "bytes the transfers walk through, batch after batch, on both sides and "
                         "in the memcpy reference (default: one batch, the same bytes each time; "
                         "above the last-level cache: from memory, as a KV load reads)");
    transfer->add_option("--file-size", file_size, "file backend: size of the file (default 1GiB)");
    transfer->add_flag("--direct", o.direct,
                       "file backend: O_DIRECT for ferry and the reference (default: buffered, "
                       "page cache dropped before each pass over the file)");
    transfer->add_option("--pattern", o.pattern, "file backend: seq (default) or random offsets")
        ->check(CLI::IsMember({"seq", "random"}));
    transfer->add_option("--file-io", o.file_io, "file backend: io_uring (default) or pread")
        ->check(CLI::IsMember({"io_uring", "pread"}));
    transfer->add_option("--queue-depth", o.queue_depth, "file backend: ios in the kernel at once")
        ->check(CLI::Range(1, 1024));
    transfer
        ->add_option("--repeat", o.repeat,
                     "rounds per row, each followed by its reference; figures are medians "
                     "(default 3)")
        ->check(CLI::Range(1, 100));
    transfer->callback([&] {
        auto split = [](const std::string& s) {
            std::vector<std::string> v;
            size_t start = 0;
            while (true) {
                size_t c = s.find(',', start);
                v.push_back(
                    s.substr(start, c == std::string::npos ? std::string::npos : c - start));
                if (c == std::string::npos) break;
                start = c + 1;
            }
            return v;
        };
        o.backends = split(backends);
        const std::vector<std::string> known = ferry::KnownBackends();
        for (const auto& b : o.backends) {
            if (b != "file" && std::find(known.begin(), known.end(), b) == known.end()) {
                std::string names;
                for (const auto& k : known) names += (names.empty() ? "" : ", ") + k;
                throw CLI::ValidationError(
                    "--backend", "unknown backend '" + b + "' (this build has: " + names + ")");
            }
        }
        o.ops = split(ops);
        for (const auto& op : o.ops) {
            if (op != "read" && op != "write") {
                throw CLI::ValidationError("--op", "unknown op '" + op + "' (read, write)");
            }
        }
        o.block_sizes = ParseSizeList("--block-size", blocks);
        std::vector<uint64_t> fs = ParseSizeList("--file-size", file_size);
        if (fs.size() != 1) throw CLI::ValidationError("--file-size", "one size");
        o.file_size = fs[0];
        if (!working_set.empty()) {
            std::vector<uint64_t> ws = ParseSizeList("--working-set", working_set);
            if (ws.size() != 1) throw CLI::ValidationError("--working-set", "one size");
            o.working_set = ws[0];
        }
        std::vector<uint64_t> b = ParseSizeList("--batch", batches);
        o.batches = b;
        if (o.role == "initiator" && o.peer.empty()) {
            throw CLI::ValidationError("--peer", "required with --role initiator");
        }
        if (o.role == "target" && o.backends.size() != 1) {
            throw CLI::ValidationError("--backend", "a target serves exactly one backend");
        }
        rc = ferry::bench::RunTransferBench(o);
    });

    // `ferry serve` also takes `vllm serve`'s command line (serve/vllm_cli.h): rewritten into
    // ferry's flags before they are parsed, each vLLM setting taken or ignored said on stderr.
    std::vector<std::string> args(argv, argv + argc);
    if (args.size() >= 2 && args[1] == "serve") {
        // SGLang's words first (python3 -m sglang.launch_server ...), then vLLM's.
        auto sglang = ferry::serve::TranslateSglangServeArgs({args.begin() + 2, args.end()});
        if (!sglang.ok()) {
            fmt::print(stderr, "ferry serve: {}\n", sglang.status().message());
            return 2;
        }
        for (const std::string& note : sglang->notes) {
            fmt::print(stderr, "ferry serve: SGLang's {}\n", note);
        }
        auto translated = ferry::serve::TranslateVllmServeArgs(sglang->args);
        if (!translated.ok()) {
            fmt::print(stderr, "ferry serve: {}\n", translated.status().message());
            return 2;
        }
        for (const std::string& note : translated->notes) {
            fmt::print(stderr, "ferry serve: vLLM's {}\n", note);
        }
        args.resize(2);
        args.insert(args.end(), translated->args.begin(), translated->args.end());
    }
    std::vector<char*> argv2;
    for (std::string& a : args) argv2.push_back(a.data());
    try {
        app.parse(static_cast<int>(argv2.size()), argv2.data());
    } catch (const CLI::ParseError& e) {
        return app.exit(e);
    }
    if (verbose) {
        ferry::SetLogLevel(ferry::LogLevel::kInfo);
    }
    return rc;
}
