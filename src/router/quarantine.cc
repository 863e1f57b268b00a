#include "router/quarantine.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "core/host_port.h"
#include "core/log.h"

namespace ferry::router {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

struct Quarantine::State : std::enable_shared_from_this<Quarantine::State> {
    struct Entry {
        http::Endpoint ep;
        Clock::time_point next_probe;
        bool probing = false;
        std::function<void()> on_back;
    };
    http::Client* client = nullptr;
    QuarantineConfig config;
    mutable std::mutex mu;
    std::map<std::string, Entry> entries;  // by host:port
    uint64_t added = 0, released = 0;

    // Sends the probes that are due; mu not held.
    void ProbeDue() {
        std::vector<http::Endpoint> due;
        {
            std::lock_guard lock(mu);
            if (entries.empty()) return;
            const Clock::time_point now = Clock::now();
            for (auto& [key, e] : entries) {
                if (e.probing || now < e.next_probe) continue;
                e.probing = true;
                due.push_back(e.ep);
            }
        }
        for (const http::Endpoint& ep : due) {
            http::ClientRequest r =
                http::GetRequest(ep.host, ep.port, "/health", config.probe_timeout);
            std::weak_ptr<State> weak = weak_from_this();
            client->CallWhole(std::move(r), [weak, ep](Result<http::ClientReply> got) {
                std::shared_ptr<State> s = weak.lock();
                if (!s) return;
                std::function<void()> on_back;
                const std::string key = FormatHostPort(ep.host, ep.port);
                {
                    std::lock_guard lock(s->mu);
                    auto it = s->entries.find(key);
                    if (it == s->entries.end()) return;
                    if (!got.ok()) {  // any HTTP answer is an answer
                        it->second.probing = false;
                        it->second.next_probe = Clock::now() + s->config.probe_every;
                        return;
                    }
                    on_back = std::move(it->second.on_back);
                    s->entries.erase(it);
                    ++s->released;
                }
                FERRY_LOG(kInfo, "router: worker {} answers again; back in rotation", key);
                if (on_back) on_back();
            });
        }
    }
};

Quarantine::Quarantine(http::Client* client, QuarantineConfig config)
    : state_(std::make_shared<State>()) {
    state_->client = client;
    state_->config = config;
}

Quarantine::~Quarantine() = default;

void Quarantine::Add(const http::Endpoint& ep, std::function<void()> on_back) {
    const std::string key = FormatHostPort(ep.host, ep.port);
    {
        std::lock_guard lock(state_->mu);
        auto [it, fresh] = state_->entries.try_emplace(key);
        if (!fresh) return;
        it->second.ep = ep;
        it->second.next_probe = Clock::now() + state_->config.probe_every;
        it->second.on_back = std::move(on_back);
        ++state_->added;
    }
    FERRY_LOG(kWarn, "router: worker {} timed out; no requests go to it until it answers again",
              key);
}

bool Quarantine::Contains(const http::Endpoint& ep) {
    state_->ProbeDue();
    std::lock_guard lock(state_->mu);
    return state_->entries.count(FormatHostPort(ep.host, ep.port)) > 0;
}

std::vector<http::Endpoint> Quarantine::Filter(const std::vector<http::Endpoint>& eps) {
    state_->ProbeDue();
    std::lock_guard lock(state_->mu);
    std::vector<http::Endpoint> out;
    for (const http::Endpoint& ep : eps) {
        if (!state_->entries.count(FormatHostPort(ep.host, ep.port))) out.push_back(ep);
    }
    return out;
}

size_t Quarantine::size() const {
    std::lock_guard lock(state_->mu);
    return state_->entries.size();
}

uint64_t Quarantine::added() const {
    std::lock_guard lock(state_->mu);
    return state_->added;
}

uint64_t Quarantine::released() const {
    std::lock_guard lock(state_->mu);
    return state_->released;
}

}  // namespace ferry::router
