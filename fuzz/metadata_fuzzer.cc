// Agent metadata blobs (from peers and from discovery stores).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "transfer/metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    std::string_view blob(reinterpret_cast<const char*>(data), size);
    auto md = ferry::DecodeMetadata(blob);
    if (md.ok() && !ferry::DecodeMetadata(ferry::EncodeMetadata(*md)).ok()) std::abort();
    return 0;
}
