// Wire frames from a peer: the header and every body decoder, on arbitrary bytes. A body that
// decodes must encode and decode again to the same frame.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "transfer/wire.h"

using namespace ferry::wire;  // NOLINT: a fuzz harness over one namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
    switch (data[0] % 8) {
        case 0:
            (void)DecodeHeader(body);
            break;
        case 1:
            if (auto m = DecodeHello(body); m.ok()) {
                if (!DecodeHello(EncodeHello(*m)).ok()) std::abort();
            }
            break;
        case 2:
            if (auto m = DecodeHelloAck(body); m.ok()) {
                if (!DecodeHelloAck(EncodeHelloAck(*m)).ok()) std::abort();
            }
            break;
        case 3:
            if (auto m = DecodeDataRequest(body); m.ok()) {
                if (!DecodeDataRequest(EncodeDataRequest(*m)).ok()) std::abort();
            }
            break;
        case 4:
            if (auto m = DecodePullRequest(body); m.ok()) {
                if (!DecodePullRequest(EncodePullRequest(*m)).ok()) std::abort();
            }
            break;
        case 5:
            if (auto m = DecodeMapRequest(body); m.ok()) {
                if (!DecodeMapRequest(EncodeMapRequest(*m)).ok()) std::abort();
            }
            break;
        case 6:
            if (auto m = DecodeRegionGrant(body); m.ok()) {
                if (!DecodeRegionGrant(EncodeRegionGrant(*m)).ok()) std::abort();
            }
            break;
        case 7:
            if (auto m = DecodeResponse(body); m.ok()) {
                if (!DecodeResponse(EncodeResponse(*m)).ok()) std::abort();
            }
            break;
    }
    return 0;
}
