// The MetadataStore implementations behind MetadataStore::Open.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "discovery/http_json.h"
#include "ferry/discovery.h"

namespace ferry::discovery {

// The embedded store's longest watch poll (POST /v1/watch's timeout_ms): the server refuses more,
// the client asks for no more.
inline constexpr std::chrono::milliseconds kMaxWatchPoll = std::chrono::seconds(60);

std::unique_ptr<MetadataStore> MakeHttpStore(std::string url, Endpoint ep, StoreOptions options);
std::unique_ptr<MetadataStore> MakeEtcdStore(std::string url, Endpoint ep, StoreOptions options);
Status SetUpEtcdAuthAt(const Endpoint& ep, const std::string& url, std::string_view secret,
                       std::string_view root_password);

}  // namespace ferry::discovery
