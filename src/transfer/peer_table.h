// The peers an agent knows (AddPeer, Connect, discovery) and the backend chosen for each: their
// published metadata, their open streams and what this process mapped of their regions.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "transfer/backend.h"
#include "transfer/metadata.h"
#include "transfer/peer_memory.h"

namespace ferry::internal {

class Connection;

// One of the peer's regions as this process maps it (shm, one-sided copies).
struct RemoteMapping {
    enum class State { kPending, kGranted, kRefused };
    State state = State::kPending;
    uint64_t key = 0;  // the key the peer checked when it granted the mapping
    uint64_t share_id = 0;
    std::shared_ptr<PeerMapping> map;
};

struct Peer {
    std::string name;     // md.name, readable without mu
    AgentMetadata md;     // under mu
    std::string backend;  // chosen for this peer (fixed for its epoch)
    std::mutex mu;
    std::map<std::string, std::vector<std::shared_ptr<Connection>>> streams;  // by backend
    std::atomic<uint64_t> next_stream{0};
    std::unordered_map<RegionId, RemoteMapping> mapped;  // under mu
    std::condition_variable mapped_cv;                   // a mapping left kPending
};

// The backend for `peer`: `force` if set (it must reach the peer), else the first of `ranked`
// (RankBackends order) that can reach it. `find` maps a name to the agent's backend.
Result<std::string> SelectBackend(const std::vector<std::string>& ranked,
                                  const std::function<Backend*(std::string_view)>& find,
                                  const std::string& force, const AgentMetadata& self,
                                  const AgentMetadata& peer);

class PeerTable {
  public:
    std::shared_ptr<Peer> Find(std::string_view name) const;
    // Adds or refreshes the peer `md` describes. The same epoch refreshes its metadata (the
    // backend stays) unless `md` is of an older revision than the one held; a new epoch replaces
    // the old process's entry, which is returned in
    // `*replaced` for the caller to close.
    void Upsert(AgentMetadata md, std::string backend, std::shared_ptr<Peer>* replaced);
    // The removed peer, or null if unknown.
    std::shared_ptr<Peer> Remove(std::string_view name);
    void Clear();

  private:
    mutable std::mutex mu_;
    std::map<std::string, std::shared_ptr<Peer>, std::less<>> peers_;
};

}  // namespace ferry::internal
