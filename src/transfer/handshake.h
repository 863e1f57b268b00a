// A stream connection's handshake, as a state machine with no socket: hello, hello-ack, the
// deployment secret's challenge both ways, ready (docs/wire-protocol.md). The connection feeds
// it the frames that arrive before the handshake is done and does what each step says: send
// frames, become ready, or close, telling the peer why first when the peer is the one at fault.
// Testable frame by frame (handshake_test.cc); one object per connection, used on its loop
// thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/crypto.h"
#include "ferry/status.h"
#include "transfer/wire.h"

namespace ferry::internal {

struct ReceiveBudget;
struct WireCounters;

struct HandshakeConfig {
    std::string backend;  // "tcp", "shm": for messages
    std::string name;     // ours
    uint64_t epoch = 0;
    std::string secret;
    wire::Purpose purpose = wire::Purpose::kData;  // client
    bool verify_cma = false;                       // server: probe the client's memory
    uint64_t probe_addr = 0;                       // client
    uint64_t expect_epoch = 0;  // client: refuse a peer whose epoch differs (0 = any)
    uint64_t probe_value = 0;
    std::shared_ptr<ReceiveBudget> budget;   // null: unbounded (tests)
    std::shared_ptr<WireCounters> counters;  // null: not counted
    std::string source;  // server: the peer's address ("ip" or "pid N"), for per-source bounds
};

class Handshake {
  public:
    enum class Side { kClient, kServer };

    // What the connection does after a frame.
    struct Step {
        std::vector<std::string> send;  // whole frames, in order
        bool ready = false;             // the handshake is done: the connection is ready
        // Not OK: close with this status. `tell_peer`: send it to the peer in an error frame
        // first (the peer broke the protocol or failed the secret); otherwise the peer is simply
        // not one this side accepts (another process now, no secret where one is needed).
        Status error;
        bool tell_peer = false;
    };

    // `label` names the peer in messages until it has named itself. `verify_cma` (server, for
    // data connections when config.verify_cma): checks that the client is the process it says
    // it is, by reading its memory; PermissionDenied refuses it.
    Handshake(Side side, const HandshakeConfig& config, std::string label,
              std::function<Status(const wire::Hello&)> verify_cma = {});

    // Client: the hello frame, sent once the socket is connected.
    std::string Hello() const;
    // A frame received before the handshake is done (its header and body).
    Step OnFrame(const wire::FrameHeader& h, std::string_view body);

    bool done() const { return state_ == State::kDone; }
    // The peer as it named itself (empty before its hello or hello-ack).
    const std::string& peer_name() const { return peer_name_; }
    uint64_t peer_epoch() const { return peer_epoch_; }
    // What the connection is for: the client's, as configured or as its hello said.
    wire::Purpose purpose() const { return purpose_; }

  private:
    enum class State { kAwaitHello, kAwaitAuth, kAwaitHelloAck, kAwaitReady, kDone };

    Step OnHello(const wire::FrameHeader& h, std::string_view body);
    Step OnAuth(const wire::FrameHeader& h, std::string_view body);
    Step OnHelloAck(const wire::FrameHeader& h, std::string_view body);
    Status CheckPeerName(std::string_view name) const;
    Step ProtocolError(const std::string& why) const;
    static Step Refuse(Status why, bool tell_peer);
    static Step Send(std::vector<std::string> frames);
    Step Ready(std::vector<std::string> send);

    const HandshakeConfig& config_;
    const std::string label_;
    const std::function<Status(const wire::Hello&)> verify_cma_;
    State state_;
    Nonce my_nonce_{};
    Nonce peer_nonce_{};
    std::string peer_name_;
    uint64_t peer_epoch_ = 0;
    wire::Purpose purpose_;
};

}  // namespace ferry::internal
