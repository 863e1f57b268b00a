// pull (vLLM's NixlConnector protocol), both sides: the prefill worker holds a finished request's
// blocks under a lease for one reader and answers its claim; the decode worker claims them and
// READs. The holds are this object's: what a claim must name, whose cap they count against,
// their leases. Part of AgentKvConnector (agent_connector_parts.h); every method runs with the
// connector's lock held.
#pragma once

#include <map>
#include <span>
#include <string>
#include <vector>

#include "kv/agent_connector_parts.h"

namespace ferry::kv {

class PullProtocol final : public TransferProtocol {
  public:
    explicit PullProtocol(AgentKvConnector::Impl& connector) : m_(connector) {}

    // The prefill side runs at once: it holds the blocks when the request ends.
    bool ReadyToSchedule(const ConnectorRequest&, const KvTransferParams&) override { return true; }
    // The prefill side: a request that went well is held for its reader.
    FinishAction Finished(const ConnectorRequest& r, std::span<const BlockId> blocks, bool ok,
                          const FirstToken* first) override;
    // The held blocks cover the prompt (their size is the prefill worker's, learnt at the
    // handshake; Proceed fails a load whose blocks fall short); without the first token the
    // last prompt token is computed here, for its logits.
    int ExternalTokens(const KvTransferParams& p, int prompt_len, int num_computed) const override;
    // The decode side: claim the hold and READ at once (the data counts only once the claim is
    // acked).
    void Proceed(const std::string& id, connector_parts::Load& ld,
                 connector_parts::Peer& p) override;
    // Holds whose lease lapsed: their blocks go back to the engine.
    void Pump(connector_parts::SteadyClock::time_point now) override;

    // A client's share of blocks held for remote decoders (unclaimed holds pin the cache; an
    // honest router's are claimed within milliseconds).
    int HoldCap() const;
    // Whether `requester` may hold `blocks` more (those of its unclaimed holds count once) and
    // `unknown_blocks` whose ids are not known yet.
    Status HoldShareLeft(const std::string& requester, std::span<const BlockId> blocks,
                         int unknown_blocks) const;

    // The peer messages of this protocol.
    Status On(const std::string& from, msg::Claim& m);
    Status On(const std::string& from, msg::HoldEnd& m);
    Status On(const std::string& from, msg::HoldRenew& m);
    // The decode side: renews the holds of admitted requests that have not claimed them yet
    // (their peer ready), each every hold_renew_interval.
    void RenewWaiting(connector_parts::SteadyClock::time_point now);
    Status On(const std::string& from, msg::ClaimAck& m);

    int holding() const { return static_cast<int>(holds_.size()); }
    // Unbind: every hold goes (the blocks with the cache).
    void Clear() { holds_.clear(); }

  private:
    // Builds descriptor lists for moving `move` of every rank pair.
    Status PlanAllRanks(const connector_parts::Peer& p, const KvMove& move,
                        std::vector<Descriptor>* local, std::vector<Descriptor>* remote,
                        uint64_t* bytes) const;
    // A hold that exists under this nonce and is not another decoder's.
    connector_parts::Hold* FindHold(const std::string& from, const std::string& rid,
                                    const std::string& nonce, bool* exists);
    // Holds the finished request's blocks for a reader under a lease and says where they are
    // (the params of the answer).
    FinishAction HoldForReader(const ConnectorRequest& r, std::span<const BlockId> blocks,
                               const FirstToken& first);

    AgentKvConnector::Impl& m_;
    std::map<std::string, connector_parts::Hold> holds_;
};

}  // namespace ferry::kv
