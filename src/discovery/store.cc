#include "discovery/stores.h"

namespace ferry {

Result<std::unique_ptr<MetadataStore>> MetadataStore::Open(std::string_view url,
                                                           StoreOptions options) {
    if (options.timeout.count() <= 0) {
        return InvalidArgumentError("StoreOptions.timeout must be positive");
    }
    auto scheme_end = url.find("://");
    if (scheme_end == std::string_view::npos) {
        return InvalidArgumentError("store URL '" + std::string(url) +
                                    "': expected http://host:port or etcd://host:port");
    }
    std::string_view scheme = url.substr(0, scheme_end);
    std::string_view rest = url.substr(scheme_end + 3);
    if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
    auto ep = discovery::ParseHostPort(rest);
    if (!ep.ok()) {
        return InvalidArgumentError("store URL '" + std::string(url) +
                                    "': " + ep.status().message());
    }
    if (scheme == "http") {
        return discovery::MakeHttpStore(std::string(url), *ep, std::move(options));
    }
    if (scheme == "etcd") {
        return discovery::MakeEtcdStore(std::string(url), *ep, std::move(options));
    }
    return InvalidArgumentError("store URL '" + std::string(url) + "': unknown scheme '" +
                                std::string(scheme) + "' (http or etcd)");
}

Status SetUpEtcdAuth(std::string_view url, std::string_view secret,
                     std::string_view root_password) {
    constexpr std::string_view kScheme = "etcd://";
    if (url.substr(0, kScheme.size()) != kScheme) {
        return InvalidArgumentError("SetUpEtcdAuth: '" + std::string(url) +
                                    "' is not an etcd:// URL");
    }
    if (secret.empty() || root_password.empty()) {
        return InvalidArgumentError("SetUpEtcdAuth: the secret and the root password must be set");
    }
    std::string_view rest = url.substr(kScheme.size());
    if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
    FERRY_ASSIGN_OR_RETURN(discovery::Endpoint ep, discovery::ParseHostPort(rest));
    return discovery::SetUpEtcdAuthAt(ep, std::string(url), secret, root_password);
}

std::string AgentKey(std::string_view name) {
    return std::string(kAgentPrefix) + std::string(name);
}

}  // namespace ferry
