// A position inside a list of iovecs: which buffer, and how far into it.
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ferry {

struct IovCursor {
    size_t index = 0;
    size_t offset = 0;

    bool AtEnd(const std::vector<iovec>& v) const { return index >= v.size(); }
    // Bytes left in the current buffer.
    size_t Contiguous(const std::vector<iovec>& v) const { return v[index].iov_len - offset; }
    char* Pointer(const std::vector<iovec>& v) const {
        return static_cast<char*>(v[index].iov_base) + offset;
    }
    // Moves forward by `n` bytes (stops at the end of the list).
    void Advance(const std::vector<iovec>& v, uint64_t n) {
        while (n > 0 && index < v.size()) {
            size_t k = static_cast<size_t>(std::min<uint64_t>(n, v[index].iov_len - offset));
            n -= k;
            offset += k;
            if (offset == v[index].iov_len) {
                ++index;
                offset = 0;
            }
        }
        while (index < v.size() && v[index].iov_len == 0) {
            ++index;  // empty buffers hold no position
        }
    }
};

}  // namespace ferry
