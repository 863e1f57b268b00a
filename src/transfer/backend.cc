#include "transfer/backend.h"

#include <sys/stat.h>

#include <charconv>
#include <fstream>

namespace ferry {

std::string LocalHostId() {
    std::string boot;
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::getline(in, boot);
    auto ns = [](const char* path) -> std::string {
        struct stat st {};
        if (stat(path, &st) != 0) {
            return "?";
        }
        return std::to_string(st.st_ino);
    };
    return boot + "/net:" + ns("/proc/self/ns/net") + "/pid:" + ns("/proc/self/ns/pid");
}

Status SplitHostPort(std::string_view address, std::string* host, uint16_t* port) {
    size_t colon = address.rfind(':');
    if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) {
        return InvalidArgumentError("address '" + std::string(address) +
                                    "' is not of the form host:port");
    }
    std::string_view h = address.substr(0, colon);
    if (h.size() >= 2 && h.front() == '[' && h.back() == ']') {
        h = h.substr(1, h.size() - 2);
    }
    std::string_view p = address.substr(colon + 1);
    unsigned value = 0;
    auto [ptr, ec] = std::from_chars(p.data(), p.data() + p.size(), value);
    if (ec != std::errc() || ptr != p.data() + p.size() || value > 65535) {
        return InvalidArgumentError("address '" + std::string(address) + "': bad port '" +
                                    std::string(p) + "'");
    }
    *host = std::string(h);
    *port = static_cast<uint16_t>(value);
    return Status::Ok();
}

}  // namespace ferry
