#include "core/host_port.h"

#include <arpa/inet.h>
#include <fmt/core.h>
#include <netinet/in.h>

namespace ferry {

Result<HostPort> ParseHostPort(std::string_view text, int min_port) {
    HostPort out;
    std::string_view port;
    if (!text.empty() && text.front() == '[') {
        const size_t close = text.find(']');
        if (close == std::string_view::npos || close == 1 || close + 1 >= text.size() ||
            text[close + 1] != ':') {
            return InvalidArgumentError(fmt::format("'{}' is not [ipv6-host]:port", text));
        }
        out.host = std::string(text.substr(1, close - 1));
        port = text.substr(close + 2);
    } else {
        const size_t colon = text.rfind(':');
        if (colon == std::string_view::npos || colon == 0) {
            return InvalidArgumentError(fmt::format("'{}' is not host:port", text));
        }
        out.host = std::string(text.substr(0, colon));
        if (out.host.find(':') != std::string::npos) {
            return InvalidArgumentError(
                fmt::format("'{}': an IPv6 host goes in brackets ([host]:port)", text));
        }
        port = text.substr(colon + 1);
    }
    if (port.empty() || port.size() > 5 ||
        port.find_first_not_of("0123456789") != std::string_view::npos) {
        return InvalidArgumentError(fmt::format("'{}': the port is not a number", text));
    }
    int value = 0;
    for (char c : port) value = value * 10 + (c - '0');
    if (value < min_port || value > 65535) {
        return InvalidArgumentError(
            fmt::format("'{}': port {} is not {}..65535", text, value, min_port));
    }
    out.port = static_cast<uint16_t>(value);
    return out;
}

std::string FormatHostPort(std::string_view host, int port) {
    if (host.find(':') != std::string_view::npos) return fmt::format("[{}]:{}", host, port);
    return fmt::format("{}:{}", host, port);
}

std::string HostOf(std::string_view address) {
    if (auto hp = ParseHostPort(address, 0); hp.ok()) return hp->host;
    return std::string(address);
}

bool IsLoopbackHost(std::string_view host) {
    in6_addr v6{};
    in_addr v4{};
    const std::string h(host);
    if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, h.c_str(), &v6) != 1) return false;
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

}  // namespace ferry
