// How deeply a JSON text nests arrays and objects, found by scanning it (strings skipped), so that
// outside input can be refused before any parser builds a tree of it.
#pragma once

#include <cstddef>
#include <string_view>

namespace ferry {

// False if `text` nests deeper than `max_depth`.
inline bool JsonDepthWithin(std::string_view text, size_t max_depth) {
    size_t depth = 0;
    bool in_string = false, escaped = false;
    for (char c : text) {
        if (in_string) {
            if (escaped) {
                escaped = false;
            } else if (c == '\\') {
                escaped = true;
            } else if (c == '"') {
                in_string = false;
            }
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            if (++depth > max_depth) return false;
        } else if ((c == ']' || c == '}') && depth > 0) {
            --depth;
        }
    }
    return true;
}

}  // namespace ferry
