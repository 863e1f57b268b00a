// push (layer-wise), both sides: the decode worker names its blocks under a transfer id; the
// prefill worker binds them to its request, WRITEs each layer as the step stores it, and ends
// the push. The pushes, the targets that came before their requests, the cancelled transfer ids
// and one step's planned writes are this object's. Part of AgentKvConnector
// (agent_connector_parts.h); its methods run with the connector's lock held, but for
// OnLayerStored (a rank thread, within a step) and BeginStep/EndStep (which take it).
#pragma once

#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kv/agent_connector_parts.h"

namespace ferry::kv {

class PushProtocol final : public TransferProtocol, public LayerHook {
  public:
    explicit PushProtocol(AgentKvConnector::Impl& connector) : m_(connector) {}

    // The prefill side: a request runs once the decoder's blocks are known (its target may
    // have come first); until then it is parked.
    bool ReadyToSchedule(const ConnectorRequest& r, const KvTransferParams& p) override;
    // The prefill side: the request ended. If it went well the push finishes (its last writes
    // land, then the decoder hears of it) and the blocks stay until then; else it fails now.
    FinishAction Finished(const ConnectorRequest& r, std::span<const BlockId> blocks, bool ok,
                          const FirstToken* first) override;
    // Every prompt token not already here is written by the prefill worker.
    int ExternalTokens(const KvTransferParams&, int prompt_len, int num_computed) const override {
        return prompt_len - num_computed;
    }
    // The decode side: name our blocks to the prefill worker under the transfer id, then wait
    // for its writes.
    void Proceed(const std::string& id, connector_parts::Load& ld,
                 connector_parts::Peer& p) override;
    // Pushes finished or failed, deadlines passed; targets and cancelled transfer ids nobody
    // came for.
    void Pump(connector_parts::SteadyClock::time_point now) override;

    // One engine step (AgentKvConnector::BeginStep/EndStep): plans the writes of the step's
    // push chunks, posts each layer's as a rank stores it, then files the transfers.
    LayerHook* BeginStep(std::span<const StepChunk> chunks);
    void OnLayerStored(int rank, int layer) override;
    void EndStep();

    // The peer messages of this protocol.
    Status On(const std::string& from, msg::PushTarget& m);
    Status On(const std::string& from, msg::PushAlive& m);
    Status On(const std::string& from, msg::PushCancel& m);
    Status On(const std::string& from, msg::PushEnd& m);

    // Bind: the step's write lists for `tp` ranks of `layers` layers.
    void Bind(int tp, int layers);
    // Unbind: stops every write, then forgets every push.
    void CancelAll();
    void Clear();
    // Requests by state, for KvConnectorStats.
    void Count(int* bootstrapping, int* transferring) const;

  private:
    Status SendPushFailed(const std::string& peer, const std::string& xid, const std::string& lid,
                          std::string error);
    // Binds a decoder's block list to a prefill request. Returns false if they do not belong
    // together: a target for another prompt is refused (its decoder is told) and the request
    // keeps waiting for its own (*mismatch set: a transfer id is not a capability, so whoever
    // learns one cannot fail another's request); other faults fail the request.
    bool BindTarget(const std::string& id, connector_parts::Push& ps, connector_parts::Target t,
                    bool* mismatch);
    // Prefill side, from Pump: push-alive to the decoders of bound pushes, each interval.
    void RenewBound(connector_parts::SteadyClock::time_point now);
    // A finished push: tell the decoder, free the blocks.
    void EndPush(const std::string& id, bool ok, const Status& err);

    AgentKvConnector::Impl& m_;
    std::map<std::string, connector_parts::Push> pushes_;
    std::map<std::string, std::string> push_by_xid_;
    // Decoders' targets that came before their prefill request, by transfer id: one per peer,
    // at most kMaxEarlyTargets (a stranger's target cannot displace the rightful decoder's).
    std::map<std::string, std::vector<connector_parts::Target>> targets_;
    static constexpr size_t kMaxEarlyTargets = 4;
    // The decoder waits at most this long in all, however often the prefill worker renews.
    static constexpr std::chrono::minutes kMaxPushWait{10};
    // Transfer ids a decoder cancelled before its prefill request came, until the bootstrap
    // timeout (the request then fails at once instead of waiting for it).
    std::map<std::string, connector_parts::SteadyClock::time_point> cancelled_xids_;
    // One step's writes: planned on the step thread, posted on the rank threads.
    std::vector<std::vector<std::vector<connector_parts::PlannedWrite>>>
        step_writes_;                                                // [rank][layer]
    std::vector<std::vector<connector_parts::Posted>> step_posted_;  // [rank]
    std::vector<std::pair<std::string, int>> step_advance_;
};

}  // namespace ferry::kv
