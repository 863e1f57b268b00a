#include "transfer/agent_config.h"

#include <algorithm>
#include <string>

#include "core/cpu.h"
#include "transfer/backend.h"
#include "transfer/metadata.h"

namespace ferry::internal {

Status ValidateAgentConfig(const AgentConfig& config) {
    FERRY_RETURN_IF_ERROR(ValidateAgentName(config.name).WithContext("AgentConfig.name"));
    if (config.backends.empty()) {
        return InvalidArgumentError("AgentConfig.backends: no backend enabled");
    }
    if (config.stalled_frame_timeout.count() <= 0) {
        return InvalidArgumentError("AgentConfig.stalled_frame_timeout: must be positive");
    }
    const std::vector<std::string> known = KnownBackends();
    for (const std::string& b : config.backends) {
        if (std::find(known.begin(), known.end(), b) == known.end()) {
            std::string names;
            for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
            return InvalidArgumentError("AgentConfig.backends: unknown backend '" + b +
                                        "' (known in this build: " + names + ")");
        }
    }
    if (!config.force_backend.empty() && std::find(config.backends.begin(), config.backends.end(),
                                                   config.force_backend) == config.backends.end()) {
        return InvalidArgumentError("AgentConfig.force_backend '" + config.force_backend +
                                    "' is not among the enabled backends");
    }
    if (config.default_timeout.count() <= 0) {
        return InvalidArgumentError("AgentConfig.default_timeout must be positive");
    }
    if (config.file_io != "io_uring" && config.file_io != "pread") {
        return InvalidArgumentError("AgentConfig.file_io '" + config.file_io +
                                    "' is neither io_uring nor pread");
    }
    if (config.file_queue_depth == 0 || config.file_queue_depth > 1024) {
        return InvalidArgumentError("AgentConfig.file_queue_depth must be 1..1024, not " +
                                    std::to_string(config.file_queue_depth));
    }
    return Status::Ok();
}

int IoThreadsFor(const AgentConfig& config) {
    return config.io_threads > 0 ? std::min(config.io_threads, 64)
                                 : std::clamp(UsableCores(), 1, 8);
}

}  // namespace ferry::internal
