#include "transfer/registrar.h"

#include <algorithm>

#include "core/log.h"
#include "transfer/metadata.h"

namespace ferry::internal {

Registrar::Registrar(const AgentConfig& config, uint64_t epoch, Callbacks callbacks)
    : config_(config), epoch_(epoch), callbacks_(std::move(callbacks)) {}

Registrar::~Registrar() { Stop(); }

Status Registrar::Start() {
    FERRY_RETURN_IF_ERROR(Register());
    thread_ = std::thread([this] { Loop(); });
    return Status::Ok();
}

Status Registrar::Register() {
    if (!store_) {
        StoreOptions options;
        options.secret = config_.secret;
        options.timeout = std::chrono::seconds(5);
        FERRY_ASSIGN_OR_RETURN(store_, MetadataStore::Open(config_.store, options));
    }
    FERRY_ASSIGN_OR_RETURN(LeaseId lease, store_->GrantLease(config_.store_ttl));
    {
        std::lock_guard<std::mutex> put(put_mu_);
        Status s = store_->Put(AgentKey(config_.name), callbacks_.metadata(), lease);
        if (!s.ok()) {
            (void)store_->RevokeLease(lease);
            return s;
        }
        lease_ = lease;
    }
    FERRY_LOG(kInfo, "agent {} registered at {} (lease {}, ttl {} ms)", config_.name, config_.store,
              lease, config_.store_ttl.count());
    return Status::Ok();
}

void Registrar::MarkChanged() {
    std::lock_guard<std::mutex> lock(mu_);
    changed_ = true;
    cv_.notify_all();
}

void Registrar::PublishNow() {
    {
        std::lock_guard<std::mutex> put(put_mu_);
        const LeaseId lease = lease_.load();
        if (store_ && lease != 0 &&
            store_->Put(AgentKey(config_.name), callbacks_.metadata(), lease).ok()) {
            return;
        }
    }
    MarkChanged();
}

void Registrar::Stop() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        stop_ = true;
        cv_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> put(put_mu_);
    if (store_ && lease_ != 0) {
        // Clean shutdown: leave at once instead of at the end of the lease.
        Status s = store_->Delete(AgentKey(config_.name));
        (void)store_->RevokeLease(lease_);
        if (!s.ok() && s.code() != Code::kNotFound) {
            FERRY_LOG(kWarn, "agent {}: could not remove its discovery entry: {}", config_.name,
                      s.ToString());
        }
        lease_ = 0;
    }
}

void Registrar::Loop() {
    const auto renew_every = std::max(config_.store_ttl / 3, std::chrono::milliseconds(100));
    const auto poll = std::min(renew_every, std::chrono::milliseconds(500));
    auto next_renew = Clock::now() + renew_every;
    uint64_t after = 0;
    bool listed = false;
    bool warned = false;
    for (;;) {
        bool changed = false;
        {
            std::unique_lock<std::mutex> lock(mu_);
            if (stop_) return;
            changed = std::exchange(changed_, false);
        }
        Status s;
        if (lease_ == 0) {
            s = Register();  // the store lost us (or never had us since it came back)
        } else if (changed) {
            {
                std::lock_guard<std::mutex> put(put_mu_);
                s = store_->Put(AgentKey(config_.name), callbacks_.metadata(), lease_);
            }
            if (s.code() == Code::kNotFound) {
                lease_ = 0;  // lease gone: register afresh (Register takes put_mu_)
                s = Register();
            }
        }
        if (s.ok() && lease_ != 0 && Clock::now() >= next_renew) {
            s = store_->KeepAlive(lease_);
            if (s.code() == Code::kNotFound) {
                FERRY_LOG(kWarn, "agent {}: the store lost lease {}; registering again",
                          config_.name, lease_);
                lease_ = 0;
                s = Register();
            }
            next_renew = Clock::now() + renew_every;
        }
        if (!s.ok()) {
            if (!warned) {
                FERRY_LOG(kWarn, "agent {}: discovery store {}: {} (retrying)", config_.name,
                          config_.store, s.ToString());
                warned = true;
            }
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait_for(lock, poll, [&] { return stop_; });
            continue;
        }
        if (warned) {
            FERRY_LOG(kInfo, "agent {}: discovery store {} reachable again", config_.name,
                      config_.store);
            warned = false;
        }
        // Watch the other agents until the next renewal is due.
        if (!listed) {
            uint64_t rev = 0;
            if (store_->List(kAgentPrefix, &rev).ok()) {
                after = rev;
                listed = true;
            }
            continue;
        }
        auto wait = std::clamp(
            std::chrono::duration_cast<std::chrono::milliseconds>(next_renew - Clock::now()),
            std::chrono::milliseconds(1), poll);
        Result<WatchResult> w = store_->Watch(kAgentPrefix, after, wait);
        if (!w.ok()) {
            // Logged by the next store call that fails; no busy loop while the store is down.
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait_for(lock, wait, [&] { return stop_; });
            continue;
        }
        if (w->compacted || w->revision < after) {
            listed = false;  // history gone, or a new store: start over from a listing
            continue;
        }
        for (const StoreEvent& e : w->events) {
            OnEvent(e);
        }
        after = std::max(after, w->revision);
    }
}

void Registrar::OnEvent(const StoreEvent& e) {
    std::string name = e.key.substr(kAgentPrefix.size());
    if (name != config_.name) {
        callbacks_.on_peer(name, e);
        return;
    }
    if (e.type == StoreEvent::Type::kDelete) {
        MarkChanged();  // someone removed us: put the entry back (Stop ends the thread first)
    } else if (e.type == StoreEvent::Type::kPut) {
        Result<AgentMetadata> md = DecodeMetadata(e.value);
        if (md.ok() && md->epoch != epoch_) {
            FERRY_LOG(kWarn,
                      "agent {}: another process registered under this name "
                      "(epoch {:016x}); names must be unique",
                      config_.name, md->epoch);
        }
    }
}

}  // namespace ferry::internal
