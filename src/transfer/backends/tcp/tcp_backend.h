// tcp: any host. Several connections per peer (spread over the I/O threads), large transfers
// split across them, payloads written from and read into registered memory with
// sendmsg/readv (no staging copy), TCP keepalive and user timeout so a vanished host is noticed.
#pragma once

#include "transfer/backend.h"

namespace ferry {

class TcpBackend final : public Backend {
  public:
    explicit TcpBackend(const AgentConfig& config);

    std::string_view name() const override { return "tcp"; }
    BackendCapabilities capabilities() const override;
    wire::DataMode data_mode() const override { return wire::DataMode::kInline; }
    int streams() const override { return streams_; }
    Result<std::string> Listen(ScopedFd* listener) override;
    bool CanReach(const AgentMetadata& self, const AgentMetadata& peer) const override;
    Result<ScopedFd> Dial(std::string_view address, bool* in_progress) const override;
    void Configure(int fd) const override;

  private:
    std::string host_;
    uint16_t port_;
    int streams_;
};

}  // namespace ferry
