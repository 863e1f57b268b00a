// Named objects: descriptor lists an agent published under a key, for peers to pull by key
// (Agent::Publish, Agent::PullByKey). Checked against the region table when published and again
// when a peer pulls (a region may have gone since).
#pragma once

#include <sys/uio.h>

#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/agent.h"
#include "transfer/region_table.h"

namespace ferry::internal {

class ObjectDirectory {
  public:
    explicit ObjectDirectory(RegionTable& regions) : regions_(regions) {}

    // The key (1..kMaxKeyLen bytes), descriptors within memory regions, at most kMaxPayload bytes.
    Status Publish(std::string key, std::vector<Descriptor> descriptors);
    Status Unpublish(std::string_view key);
    // Pins the object's regions and says where its bytes are. NotFound: no such key, or one of its
    // regions is gone.
    Status Resolve(std::string_view key, std::vector<RegionPin>* pins, std::vector<iovec>* iov,
                   uint64_t* size) const;

  private:
    RegionTable& regions_;
    mutable std::mutex mu_;
    std::map<std::string, std::vector<Descriptor>, std::less<>> objects_;
};

}  // namespace ferry::internal
