#include "testing/worker_process.h"

#include <fmt/core.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <thread>

#include "core/crypto.h"
#include "http/http.h"
#include "testing/testing.h"

namespace ferry::testing {

namespace {

Result<http::ClientReply> Get(const std::string& host, int port, const std::string& path,
                              std::chrono::milliseconds timeout) {
    http::ClientRequest r;
    r.method = "GET";
    r.host = host;
    r.port = port;
    r.target = path;
    r.timeout = timeout;
    return http::Fetch(r);
}

}  // namespace

SecretFile::SecretFile(const std::string& tag, const std::string& secret)
    : path_(fmt::format("/tmp/ferry-secret-{}-{}-{}", tag, getpid(), RandomId128())),
      secret_(secret.empty() ? RandomId128() : secret) {
    std::ofstream(path_) << secret_ << "\n";
}

SecretFile::~SecretFile() { std::remove(path_.c_str()); }

std::string SecretFile::router_token() const { return RouterToken(secret_); }

Result<std::unique_ptr<ServerProcess>> ServerProcess::Start(std::string binary,
                                                            std::vector<std::string> args,
                                                            std::chrono::milliseconds timeout,
                                                            std::string log_path) {
    std::unique_ptr<ServerProcess> p(new ServerProcess());
    p->binary_ = std::move(binary);
    p->args_ = std::move(args);
    p->log_path_ = std::move(log_path);
    FERRY_RETURN_IF_ERROR(p->Launch(timeout));
    return p;
}

ServerProcess::~ServerProcess() { child_.Kill(); }

Status ServerProcess::Launch(std::chrono::milliseconds timeout) {
    std::vector<std::string> argv = {binary_};
    argv.insert(argv.end(), args_.begin(), args_.end());
    if (port_ != 0) {
        // A restart keeps its port: replace or add --port.
        bool replaced = false;
        for (size_t i = 1; i + 1 < argv.size(); ++i) {
            if (argv[i] == "--port") {
                argv[i + 1] = std::to_string(port_);
                replaced = true;
            }
        }
        if (!replaced) {
            argv.push_back("--port");
            argv.push_back(std::to_string(port_));
        }
    }
    std::string line;
    std::vector<std::string> before;
    FERRY_ASSIGN_OR_RETURN(child_, ChildProcess::Start(argv, "", &line, timeout, log_path_));
    // Read lines until the listening line, remembering the agent line.
    std::string rest = line;
    auto until = std::chrono::steady_clock::now() + timeout;
    startup_.clear();
    for (;;) {
        startup_.push_back(rest);
        if (rest.find("kv agent ") != std::string::npos) {
            agent_ = rest.substr(rest.find("kv agent ") + 9);
        }
        size_t at = rest.find("listening on http://");
        if (at != std::string::npos) {
            port_ = PortAfter(rest, "listening on ");
            // Where it listens: 127.0.0.1, or an address it was given (::1 for an IPv6 test).
            std::string_view a = std::string_view(rest).substr(at + 20);
            a = a.substr(0, a.find_first_of(" /\r\n"));
            auto hp = ParseHostPort(a, 1);
            host_ = hp.ok() && hp->host != "0.0.0.0" && hp->host != "::" ? hp->host : "127.0.0.1";
            break;
        }
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            until - std::chrono::steady_clock::now());
        if (left.count() <= 0) return DeadlineExceededError(binary_ + ": no listening line");
        FERRY_ASSIGN_OR_RETURN(rest, child_.ReadLine("", left));
    }
    while (std::chrono::steady_clock::now() < until) {
        auto h = Get(host_, port_, "/health", std::chrono::seconds(2));
        if (h.ok() && h->status == 200) return Status::Ok();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return DeadlineExceededError(
        fmt::format("{}: /health on port {} did not answer", binary_, port_));
}

Status ServerProcess::Restart() {
    child_.Kill();
    return Launch(std::chrono::seconds(60));
}

double ServerProcess::Metric(const std::string& name) const {
    auto m = Get(host_, port_, "/metrics", std::chrono::seconds(5));
    if (!m.ok() || m->status != 200) return -1;
    const std::string& body = m->body;
    size_t pos = 0;
    while ((pos = body.find(name, pos)) != std::string::npos) {
        const bool line_start = pos == 0 || body[pos - 1] == '\n';
        const size_t end = pos + name.size();
        if (line_start && end < body.size() && body[end] == ' ') {
            return std::stod(body.substr(end + 1, body.find('\n', end) - end - 1));
        }
        pos = end;
    }
    return -1;
}

bool ServerProcess::WaitMetric(const std::string& name, double value,
                               std::chrono::milliseconds limit) const {
    auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until) {
        if (Metric(name) == value) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return Metric(name) == value;
}

}  // namespace ferry::testing
