// Kinds registered by name (KV connectors, encoder-cache connectors): one map behind a mutex,
// each name once, lookups that name the known kinds. `Kind` has a `std::string name`.
#pragma once

#include <fmt/core.h>

#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"

namespace ferry {

template <class Kind>
class NamedRegistry {
  public:
    // `what` names the kind in errors ("kv connector").
    explicit NamedRegistry(std::string what) : what_(std::move(what)) {}

    // AlreadyExists for a known name. Thread-safe.
    Status Add(Kind kind) {
        std::lock_guard lock(mu_);
        if (kinds_.count(kind.name)) {
            return AlreadyExistsError(fmt::format("{} '{}' is registered", what_, kind.name));
        }
        std::string name = kind.name;
        kinds_.emplace(std::move(name), std::move(kind));
        return Status::Ok();
    }
    // NotFound naming the known kinds.
    Result<Kind> Find(std::string_view name) const {
        std::lock_guard lock(mu_);
        auto it = kinds_.find(name);
        if (it == kinds_.end()) {
            std::string known;
            for (const auto& [n, k] : kinds_) known += (known.empty() ? "" : ", ") + n;
            return NotFoundError(
                fmt::format("{} '{}' is not one of: {}", what_, name.substr(0, 64), known));
        }
        return it->second;
    }
    // The registered names, sorted.
    std::vector<std::string> Names() const {
        std::lock_guard lock(mu_);
        std::vector<std::string> out;
        for (const auto& [n, k] : kinds_) out.push_back(n);
        return out;
    }

  private:
    const std::string what_;
    mutable std::mutex mu_;
    std::map<std::string, Kind, std::less<>> kinds_;
};

}  // namespace ferry
