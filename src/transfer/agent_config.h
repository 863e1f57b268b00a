// The checks an AgentConfig passes before an agent starts, and the sizes it derives from it.
#pragma once

#include "ferry/agent.h"
#include "ferry/status.h"

namespace ferry::internal {

// Every field an agent reads at start, each error naming the field.
Status ValidateAgentConfig(const AgentConfig& config);

// I/O loop threads: AgentConfig.io_threads, else one per usable core (the process's CPU
// affinity), 1..8.
int IoThreadsFor(const AgentConfig& config);

}  // namespace ferry::internal
