// Base64 (RFC 4648, the standard alphabet with '=' padding): the store's keys and values, and
// images sent inline as data: URLs.
#pragma once

#include <string>
#include <string_view>

#include "ferry/status.h"

namespace ferry {

std::string Base64Encode(std::string_view in);
// InvalidArgument for a length that is not a multiple of 4 or a character outside the alphabet
// (padding only at the end), naming its offset.
Result<std::string> Base64Decode(std::string_view in);

}  // namespace ferry
