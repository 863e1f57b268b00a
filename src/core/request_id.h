// A request's id, the one every process of a deployment names it by: the router's X-Request-Id
// (or the client's, when valid), else 128 random bits.
#pragma once

#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>

#include "core/crypto.h"

namespace ferry {

// Whether an X-Request-Id may name a request in ferry's ids and logs: 1..128 characters of
// [A-Za-z0-9._:-].
inline bool ValidRequestId(std::string_view id) {
    return !id.empty() && id.size() <= 128 && std::all_of(id.begin(), id.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == ':' ||
               c == '-';
    });
}

// `given` (an X-Request-Id header, or null) if it is a valid id, else a new unguessable one.
inline std::string RequestIdOr(const std::string* given) {
    return given && ValidRequestId(*given) ? *given : RandomId128();
}

}  // namespace ferry
