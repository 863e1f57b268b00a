// Backend: how an agent reaches peers over one kind of link. The stream machinery (framing,
// handshake, requests) is shared; a backend contributes its sockets, its locality rule and how
// payload bytes travel (on the stream, or copied by the target across address spaces).
//
// Backends are listed in backends/registry.cc, one line each.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/fd.h"
#include "ferry/agent.h"
#include "transfer/metadata.h"
#include "transfer/wire.h"

namespace ferry {

struct BackendCapabilities {
    bool notifications = true;
    bool pull_by_key = true;
    bool cross_host = false;
};

class Backend {
  public:
    virtual ~Backend() = default;

    virtual std::string_view name() const = 0;
    virtual BackendCapabilities capabilities() const = 0;
    virtual wire::DataMode data_mode() const = 0;
    // Parallel connections per peer.
    virtual int streams() const = 0;
    // Binds the listener (non-blocking) and returns the address to publish in metadata.
    virtual Result<std::string> Listen(ScopedFd* listener) = 0;
    // Whether this agent can use the backend for `peer` (which must publish an endpoint for it).
    virtual bool CanReach(const AgentMetadata& self, const AgentMetadata& peer) const = 0;
    // Starts a non-blocking connect to a published address. `*in_progress` tells whether the
    // connect completes later (the socket becomes writable).
    virtual Result<ScopedFd> Dial(std::string_view address, bool* in_progress) const = 0;
    // Socket options for a connected or accepted socket.
    virtual void Configure(int fd) const { (void)fd; }
    // The server side of this backend checks cross-memory access in the handshake.
    virtual bool verify_cma() const { return false; }
    // false: the backend moves bytes itself (ucx) and has no sockets for the stream machinery.
    virtual bool stream_based() const { return true; }
};

// Creates the backend called `name` ("tcp", "shm"), or NotFound listing the known ones.
Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, const AgentConfig& config,
                                               const std::string& host_id);
std::vector<std::string> KnownBackends();

// "<boot id>/net:<netns inode>/pid:<pidns inode>": equal on two agents iff they share memory.
std::string LocalHostId();

// Parses "host:port" / "[v6]:port".
Status SplitHostPort(std::string_view address, std::string* host, uint16_t* port);

}  // namespace ferry
