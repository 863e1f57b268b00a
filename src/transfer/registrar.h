// Discovery registration (AgentConfig.store): puts the agent's metadata under its name with a
// lease, keeps the lease alive and the entry current, and watches the other agents' entries, on
// one thread of its own. The agent's own entry is defended here (put back if someone deletes it,
// a second process under the same name is logged); every other agent's change goes to `on_peer`.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "ferry/agent.h"
#include "ferry/discovery.h"

namespace ferry::internal {

class Registrar {
  public:
    struct Callbacks {
        std::function<std::string()> metadata{};  // the agent's current metadata blob
        // Another agent's entry changed (`name` is its agent name). On the registrar's thread.
        std::function<void(const std::string& name, const StoreEvent& e)> on_peer{};
    };
    Registrar(const AgentConfig& config, uint64_t epoch, Callbacks callbacks);
    ~Registrar();

    // Opens the store and registers (an error names what failed), then starts the thread.
    Status Start();
    // The metadata changed (regions): put it again soon. Any thread.
    void MarkChanged();
    // The metadata changed: put it now, on the caller's thread, so that a peer that looks this
    // agent up once this returns finds what it holds (a peer without a side channel has only the
    // store entry). If the put fails, the thread retries (MarkChanged). Any thread.
    void PublishNow();
    // Stops the thread and removes the entry (a clean leave, not a lapsed lease).
    void Stop();
    // Null before Start succeeded.
    MetadataStore* store() const { return store_.get(); }

  private:
    Status Register();
    void Loop();
    void OnEvent(const StoreEvent& e);

    const AgentConfig& config_;
    const uint64_t epoch_;
    const Callbacks callbacks_;
    std::unique_ptr<MetadataStore> store_;
    std::atomic<LeaseId> lease_{0};  // written by Register and Stop
    std::mutex put_mu_;              // orders the puts of this agent's entry
    std::thread thread_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;     // under mu_
    bool changed_ = false;  // under mu_
};

}  // namespace ferry::internal
