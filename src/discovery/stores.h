// The MetadataStore implementations behind MetadataStore::Open.
#pragma once

#include <memory>
#include <string>

#include "discovery/http_json.h"
#include "ferry/discovery.h"

namespace ferry::discovery {

std::unique_ptr<MetadataStore> MakeHttpStore(std::string url, Endpoint ep, StoreOptions options);
std::unique_ptr<MetadataStore> MakeEtcdStore(std::string url, Endpoint ep, StoreOptions options);
Status SetUpEtcdAuthAt(const Endpoint& ep, const std::string& url, std::string_view secret,
                       std::string_view root_password);

}  // namespace ferry::discovery
