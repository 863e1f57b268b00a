// "host:port", the one parser: every flag, record, URL authority and peer address that names a
// host and a port goes through ParseHostPort, and every one written for others to read through
// FormatHostPort. IPv6 hosts are in brackets ("[::1]:8000"); the brackets are not part of `host`.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ferry/status.h"

namespace ferry {

struct HostPort {
    std::string host;
    uint16_t port = 0;
};

// InvalidArgument naming the text and what is wrong with it: no colon, an empty host, a port
// that is not a decimal number or is outside min_port..65535, an unclosed bracket.
Result<HostPort> ParseHostPort(std::string_view text, int min_port = 1);

// "host:port", with brackets around a host that holds a colon (IPv6).
std::string FormatHostPort(std::string_view host, int port);

// The host part of a peer address as a socket reports it ("10.0.0.7:51234" -> "10.0.0.7",
// "[::1]:51234" -> "::1"); the whole text when it has no port.
std::string HostOf(std::string_view address);

// Whether a peer's host (as HostOf gives it: a numeric address) is this machine's loopback:
// 127.0.0.0/8, ::1, or 127.0.0.0/8 mapped into IPv6 (::ffff:127.x.y.z). Names are not resolved:
// "localhost" is not a peer address.
bool IsLoopbackHost(std::string_view host);

}  // namespace ferry
