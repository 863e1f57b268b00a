#include "transfer/handshake.h"

#include <fmt/core.h>

#include <cstring>
#include <utility>

#include "transfer/metadata.h"

namespace ferry::internal {

Handshake::Handshake(Side side, const HandshakeConfig& config, std::string label,
                     std::function<Status(const wire::Hello&)> verify_cma)
    : config_(config),
      label_(std::move(label)),
      verify_cma_(std::move(verify_cma)),
      state_(side == Side::kServer ? State::kAwaitHello : State::kAwaitHelloAck),
      my_nonce_(RandomNonce()),
      purpose_(config.purpose) {}

std::string Handshake::Hello() const {
    wire::Hello hello;
    hello.name = config_.name;
    hello.epoch = config_.epoch;
    hello.nonce = my_nonce_;
    hello.purpose = config_.purpose;
    hello.wants_auth = config_.secret.empty() ? 0 : 1;
    hello.probe_addr = config_.probe_addr;
    hello.probe_value = config_.probe_value;
    return wire::MakeFrame(wire::FrameType::kHello, 0, wire::EncodeHello(hello));
}

Handshake::Step Handshake::OnFrame(const wire::FrameHeader& h, std::string_view body) {
    if (h.payload_len > 0) return ProtocolError("payload during the handshake");
    switch (state_) {
        case State::kAwaitHello:
            return OnHello(h, body);
        case State::kAwaitAuth:
            return OnAuth(h, body);
        case State::kAwaitHelloAck:
            return OnHelloAck(h, body);
        case State::kAwaitReady:
            if (h.type != wire::FrameType::kReady) {
                return ProtocolError("expected ready, got " +
                                     std::string(wire::FrameTypeName(h.type)));
            }
            return Ready({});
        case State::kDone:
            break;
    }
    return ProtocolError("frame in an unexpected state");
}

// Server: the client names itself, says what the connection is for and whether it expects the
// secret; the answer carries this side's proof of the secret when there is one.
Handshake::Step Handshake::OnHello(const wire::FrameHeader& h, std::string_view body) {
    if (h.type != wire::FrameType::kHello) {
        return ProtocolError("expected hello, got " + std::string(wire::FrameTypeName(h.type)));
    }
    Result<wire::Hello> hello = wire::DecodeHello(body);
    if (!hello.ok()) return ProtocolError(hello.status().message());
    if (Status named = CheckPeerName(hello->name); !named.ok()) return Refuse(named, true);
    peer_name_ = hello->name;
    peer_epoch_ = hello->epoch;
    purpose_ = hello->purpose;
    peer_nonce_ = hello->nonce;
    if (hello->wants_auth && config_.secret.empty()) {
        return Refuse(
            PermissionDeniedError("agent " + config_.name + " has no deployment secret, but " +
                                  peer_name_ + " expects one"),
            true);
    }
    if (config_.verify_cma && hello->purpose == wire::Purpose::kData && verify_cma_) {
        if (Status s = verify_cma_(*hello); !s.ok()) return Refuse(s, true);
    }
    wire::HelloAck ack;
    ack.name = config_.name;
    ack.epoch = config_.epoch;
    ack.nonce = my_nonce_;
    ack.auth_required = config_.secret.empty() ? 0 : 1;
    if (ack.auth_required) ack.proof = wire::ServerProof(config_.secret, peer_nonce_, my_nonce_);
    std::vector<std::string> send = {
        wire::MakeFrame(wire::FrameType::kHelloAck, 0, wire::EncodeHelloAck(ack))};
    if (ack.auth_required) {
        state_ = State::kAwaitAuth;
        return Send(std::move(send));
    }
    send.push_back(wire::MakeFrame(wire::FrameType::kReady, 0, {}));
    return Ready(std::move(send));
}

// Server: the client's proof that it knows the secret, bound to both nonces.
Handshake::Step Handshake::OnAuth(const wire::FrameHeader& h, std::string_view body) {
    Digest proof{};
    if (h.type != wire::FrameType::kAuth || body.size() != proof.size()) {
        return Refuse(
            PermissionDeniedError("peer " + peer_name_ + " did not answer the secret challenge"),
            true);
    }
    std::memcpy(proof.data(), body.data(), proof.size());
    if (!DigestEqual(proof, wire::ClientProof(config_.secret, peer_nonce_, my_nonce_))) {
        return Refuse(
            PermissionDeniedError("peer " + peer_name_ + " does not know the deployment secret"),
            true);
    }
    return Ready({wire::MakeFrame(wire::FrameType::kReady, 0, {})});
}

// Client: the server names itself (the process this side expected, if it expected one) and
// proves the secret; this side proves it back.
Handshake::Step Handshake::OnHelloAck(const wire::FrameHeader& h, std::string_view body) {
    if (h.type != wire::FrameType::kHelloAck) {
        return ProtocolError("expected hello-ack, got " + std::string(wire::FrameTypeName(h.type)));
    }
    Result<wire::HelloAck> ack = wire::DecodeHelloAck(body);
    if (!ack.ok()) return ProtocolError(ack.status().message());
    if (Status named = CheckPeerName(ack->name); !named.ok()) return Refuse(named, false);
    peer_name_ = ack->name;
    peer_epoch_ = ack->epoch;
    peer_nonce_ = ack->nonce;
    if (config_.expect_epoch != 0 && ack->epoch != config_.expect_epoch) {
        return Refuse(UnavailableError(fmt::format(
                          "peer {} restarted (epoch {:016x} -> {:016x}): transfers to the old "
                          "process fail; refresh its metadata",
                          peer_name_, config_.expect_epoch, ack->epoch)),
                      false);
    }
    if (ack->auth_required && config_.secret.empty()) {
        return Refuse(PermissionDeniedError("peer " + peer_name_ +
                                            " requires a deployment secret and this agent "
                                            "has none"),
                      false);
    }
    std::vector<std::string> send;
    if (!config_.secret.empty()) {
        if (!ack->auth_required ||
            !DigestEqual(ack->proof, wire::ServerProof(config_.secret, my_nonce_, peer_nonce_))) {
            return Refuse(PermissionDeniedError("peer " + peer_name_ +
                                                " could not prove the deployment secret"),
                          false);
        }
        Digest proof = wire::ClientProof(config_.secret, my_nonce_, peer_nonce_);
        send.push_back(wire::MakeFrame(
            wire::FrameType::kAuth, 0,
            std::string_view(reinterpret_cast<const char*>(proof.data()), proof.size())));
    }
    state_ = State::kAwaitReady;
    return Send(std::move(send));
}

Status Handshake::CheckPeerName(std::string_view name) const {
    // Names end up in logs, metrics and maps: only the documented alphabet.
    if (Status ok = ValidateAgentName(name); !ok.ok()) {
        return InvalidArgumentError("handshake from " + label_ +
                                    ": peer name refused: " + ok.message());
    }
    if (name == config_.name) {
        return InvalidArgumentError("handshake from " + label_ +
                                    ": the peer claims this agent's own name '" +
                                    std::string(name) + "'");
    }
    return Status::Ok();
}

Handshake::Step Handshake::ProtocolError(const std::string& why) const {
    return Refuse(InvalidArgumentError("protocol error from " + label_ + ": " + why), true);
}

Handshake::Step Handshake::Refuse(Status why, bool tell_peer) {
    Step s;
    s.error = std::move(why);
    s.tell_peer = tell_peer;
    return s;
}

Handshake::Step Handshake::Send(std::vector<std::string> frames) {
    Step s;
    s.send = std::move(frames);
    return s;
}

Handshake::Step Handshake::Ready(std::vector<std::string> send) {
    state_ = State::kDone;
    Step s;
    s.send = std::move(send);
    s.ready = true;
    return s;
}

}  // namespace ferry::internal
