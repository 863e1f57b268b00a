// A private etcd server for tests: its own data directory and free loopback ports, stopped
// and removed with the object. Tests that need etcd start one; nothing else is assumed to run.
#pragma once

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "testing/process.h"

namespace ferry::testing {

inline uint16_t FreePort() {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    socklen_t len = sizeof(a);
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    close(fd);
    return ntohs(a.sin_port);
}

inline bool HaveEtcd() { return std::system("command -v etcd > /dev/null 2>&1") == 0; }

// A private etcd: its own data directory and ports, gone with the object.
class PrivateEtcd {
  public:
    static std::unique_ptr<PrivateEtcd> Start() {
        auto e = std::unique_ptr<PrivateEtcd>(new PrivateEtcd);
        if (!e->Launch()) return nullptr;
        return e;
    }
    ~PrivateEtcd() {
        process_.Kill();
        std::error_code ec;
        std::filesystem::remove_all(dir_, ec);
    }
    std::string url() const { return "etcd://127.0.0.1:" + std::to_string(client_port_); }
    // Kills it and starts it again on the same ports and data (an operator's restart).
    bool Restart() {
        process_.Kill();
        return Launch();
    }

  private:
    PrivateEtcd() {
        char tmpl[] = "/tmp/ferry-etcd-XXXXXX";
        dir_ = mkdtemp(tmpl);
        client_port_ = FreePort();
        peer_port_ = FreePort();
    }
    bool Launch() {
        std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
        std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
        std::string cmd =
            "echo READY; exec etcd --name ferry-test --data-dir '" + dir_ +
            "/data' --listen-client-urls " + client + " --advertise-client-urls " + client +
            " --listen-peer-urls " + peer + " --initial-advertise-peer-urls " + peer +
            " --initial-cluster ferry-test=" + peer + " > '" + dir_ + "/etcd.log' 2>&1";
        std::string line;
        auto p = ChildProcess::Start({"/bin/sh", "-c", cmd}, "READY", &line);
        if (!p.ok()) return false;
        process_ = std::move(*p);
        httplib::Client c("127.0.0.1", client_port_);
        c.set_connection_timeout(std::chrono::milliseconds(200));
        auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (std::chrono::steady_clock::now() < end) {
            auto r = c.Get("/health");
            if (r && r->status == 200) return true;
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        return false;
    }

    std::string dir_;
    uint16_t client_port_ = 0;
    uint16_t peer_port_ = 0;
    ChildProcess process_;
};

}  // namespace ferry::testing
