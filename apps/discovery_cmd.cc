#include "discovery_cmd.h"

#include <fmt/core.h>
#include <signal.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/crypto.h"
#include "ferry/discovery.h"
#include "http/http.h"
#include "transfer/metadata.h"

namespace ferry::cli {
namespace {

// --secret-file, else $FERRY_SECRET: never on the command line, where `ps` shows it.
}  // namespace

std::string LoadSecret(const std::string& file) {
    auto secret = LoadDeploymentSecret(file);
    if (!secret.ok()) throw CLI::ValidationError(secret.status().message());
    return *secret;
}

void AddRouterTokenCommand(CLI::App& app, int* rc) {
    CLI::App* cmd = app.add_subcommand(
        "router-token",
        "Print the bearer token the deployment's router presents to its workers (derived from "
        "the secret; give it to vLLM's proxy as OPENAI_API_KEY)");
    static std::string secret_file;
    cmd->add_option("--secret-file", secret_file,
                    "file holding the deployment secret (default: $FERRY_SECRET)");
    cmd->callback([rc] {
        std::string secret = LoadSecret(secret_file);
        if (secret.empty()) {
            fmt::print(stderr, "ferry router-token: no secret (--secret-file or $FERRY_SECRET)\n");
            *rc = 1;
            return;
        }
        fmt::print("{}\n", RouterToken(secret));
    });
}

void AddDiscoveryCommand(CLI::App& app, int* rc) {
    CLI::App* cmd = app.add_subcommand(
        "discovery",
        "Run the embedded discovery store (agents register and find each other there), or "
        "`ferry discovery ls` to list the agents in a store");
    static std::string listen = "127.0.0.1:0";
    static std::string secret_file;
    cmd->add_option("--listen", listen,
                    "host:port to serve on (loopback by default; port 0 = any)");
    cmd->add_option("--secret-file", secret_file,
                    "file holding the deployment secret (default: $FERRY_SECRET, or none)");
    static int64_t request_deadline_ms = 10000;
    cmd->add_option("--request-deadline-ms", request_deadline_ms,
                    "close a connection that has not sent a complete request this long after "
                    "connecting or after its previous response (slowloris)")
        ->check(CLI::Range(int64_t{100}, int64_t{3600000}))
        ->capture_default_str();

    CLI::App* ls = cmd->add_subcommand("ls", "List the registered agents");
    static std::string store_url;
    ls->add_option("--store", store_url, "http://host:port or etcd://host:port")->required();
    ls->add_option("--secret-file", secret_file, "file holding the deployment secret");
    ls->callback([rc] {
        StoreOptions options;
        options.secret = LoadSecret(secret_file);
        auto store = MetadataStore::Open(store_url, options);
        if (!store.ok()) throw CLI::ValidationError("--store", store.status().message());
        uint64_t revision = 0;
        auto entries = (*store)->List(kAgentPrefix, &revision);
        if (!entries.ok()) {
            fmt::print(stderr, "ferry discovery ls: {}\n", entries.status().ToString());
            *rc = 1;
            return;
        }
        fmt::print("{:<24} {:<18} {:>8} {:>10}  {}\n", "name", "epoch", "regions", "lease left",
                   "endpoints");
        for (const StoreEntry& e : *entries) {
            std::string name = e.key.substr(kAgentPrefix.size());
            auto md = DecodeMetadata(e.value);
            std::string left = "-";
            if (e.lease != 0) {
                auto t = (*store)->LeaseTimeLeft(e.lease);
                left = t.ok() ? fmt::format("{:.1f} s", t->count() / 1000.0) : "expired";
            }
            if (!md.ok()) {
                fmt::print("{:<24} (unreadable entry: {})\n", name, md.status().message());
                continue;
            }
            std::string eps;
            for (const auto& ep : md->endpoints) {
                eps += (eps.empty() ? "" : " ") + ep.backend + "=" + ep.address;
            }
            fmt::print("{:<24} {:016x}   {:>8} {:>10}  {}\n", name, md->epoch, md->regions.size(),
                       left, eps);
        }
        fmt::print("({} agents at revision {} of {})\n", entries->size(), revision, store_url);
    });

    CLI::App* setup = cmd->add_subcommand(
        "etcd-setup",
        "Turn on etcd authentication for this deployment: a root user, and a user 'ferry' whose "
        "password derives from the deployment secret, limited to the keys under ferry/");
    static std::string etcd_url, root_password_file;
    setup->add_option("--store", etcd_url, "etcd://host:port")->required();
    setup->add_option("--secret-file", secret_file, "file holding the deployment secret");
    setup
        ->add_option("--root-password-file", root_password_file,
                     "file holding the password to give etcd's root user")
        ->required();
    setup->callback([rc] {
        std::string secret = LoadSecret(secret_file);
        if (secret.empty()) {
            throw CLI::ValidationError("--secret-file", "a deployment secret is required");
        }
        std::ifstream in(root_password_file);
        std::string root;
        if (!in || !std::getline(in, root) || root.empty()) {
            throw CLI::ValidationError("--root-password-file",
                                       "cannot read a password from '" + root_password_file + "'");
        }
        Status s = SetUpEtcdAuth(etcd_url, secret, root);
        if (!s.ok()) {
            fmt::print(stderr, "ferry discovery etcd-setup: {}\n", s.ToString());
            *rc = 1;
            return;
        }
        fmt::print(
            "etcd at {}: authentication on; agents with the deployment secret sign in as "
            "'ferry'\n",
            etcd_url);
    });

    cmd->callback([cmd, rc] {
        if (!cmd->get_subcommands().empty()) return;  // `ls` ran
        StoreServerConfig config;
        config.request_deadline = std::chrono::milliseconds(request_deadline_ms);
        auto address = http::ParseListenAddress(listen);
        if (!address.ok()) throw CLI::ValidationError("--listen", address.status().message());
        config.listen_host = address->host;
        config.listen_port = static_cast<uint16_t>(address->port);
        config.secret = LoadSecret(secret_file);
        config.validate = [](std::string_view key, std::string_view value) -> Status {
            if (key.substr(0, kAgentPrefix.size()) != kAgentPrefix) return Status::Ok();
            auto md = DecodeMetadata(value);
            if (!md.ok()) return md.status();
            if (md->name != key.substr(kAgentPrefix.size())) {
                return InvalidArgumentError("metadata of agent '" + md->name +
                                            "' under another agent's name");
            }
            return Status::Ok();
        };
        // Block the stop signals before any thread starts, then wait for one.
        sigset_t stop;
        sigemptyset(&stop);
        sigaddset(&stop, SIGINT);
        sigaddset(&stop, SIGTERM);
        pthread_sigmask(SIG_BLOCK, &stop, nullptr);
        auto server = StoreServer::Start(config);
        if (!server.ok()) {
            fmt::print(stderr, "ferry discovery: {}\n", server.status().ToString());
            *rc = 1;
            return;
        }
        fmt::print("ferry discovery: store at {}{} (Ctrl-C stops it)\n", (*server)->url(),
                   config.secret.empty() ? "" : ", deployment secret required");
        std::fflush(stdout);
        int sig = 0;
        sigwait(&stop, &sig);
        (*server)->Stop();
        fmt::print("ferry discovery: stopped\n");
    });
}

}  // namespace ferry::cli
