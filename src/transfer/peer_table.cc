#include "transfer/peer_table.h"

namespace ferry::internal {

Result<std::string> SelectBackend(const std::vector<std::string>& ranked,
                                  const std::function<Backend*(std::string_view)>& find,
                                  const std::string& force, const AgentMetadata& self,
                                  const AgentMetadata& peer) {
    if (!force.empty()) {
        Backend* b = find(force);
        if (b == nullptr || !b->CanReach(self, peer)) {
            return FailedPreconditionError("forced backend " + force + " cannot reach peer " +
                                           peer.name);
        }
        return force;
    }
    for (const std::string& n : ranked) {
        Backend* b = find(n);
        if (b != nullptr && b->CanReach(self, peer)) {
            return n;
        }
    }
    return FailedPreconditionError("no common backend with peer " + peer.name);
}

std::shared_ptr<Peer> PeerTable::Find(std::string_view name) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(name);
    return it == peers_.end() ? nullptr : it->second;
}

void PeerTable::Upsert(AgentMetadata md, std::string backend, std::shared_ptr<Peer>* replaced) {
    std::string name = md.name;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(name);
    if (it != peers_.end()) {
        std::lock_guard<std::mutex> plock(it->second->mu);
        if (it->second->md.epoch == md.epoch) {
            // Refreshed regions of the same process, unless this copy is older than the one
            // held (a store event can arrive after the side channel's answer).
            if (md.revision >= it->second->md.revision) it->second->md = std::move(md);
            return;
        }
        *replaced = it->second;
    }
    auto peer = std::make_shared<Peer>();
    peer->name = name;
    peer->md = std::move(md);
    peer->backend = std::move(backend);
    peers_[name] = std::move(peer);
}

std::shared_ptr<Peer> PeerTable::Remove(std::string_view name) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return nullptr;
    std::shared_ptr<Peer> peer = std::move(it->second);
    peers_.erase(it);
    return peer;
}

void PeerTable::Clear() {
    std::map<std::string, std::shared_ptr<Peer>, std::less<>> gone;
    {
        std::lock_guard<std::mutex> lock(mu_);
        gone.swap(peers_);
    }
}

}  // namespace ferry::internal
