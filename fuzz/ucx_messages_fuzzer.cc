// The ucx backend's active-message headers from a peer, on arbitrary bytes: every decoder. A
// header that decodes must encode to the very same bytes (the layouts are canonical), and
// decode again to the same message.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "transfer/backends/ucx/ucx_messages.h"

namespace ucx = ferry::ucx;

namespace {

template <typename M, typename Decode, typename Encode>
void RoundTrip(std::string_view in, Decode decode, Encode encode) {
    auto m = decode(in);
    if (!m.ok()) return;
    const std::string out = encode(*m);
    if (out != in) std::abort();
    auto again = decode(out);
    if (!again.ok() || encode(*again) != out) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
    switch (data[0] % 12) {
        case 0:
            (void)ucx::DecodeEnvelope(in);
            (void)ucx::DecodeRequestHead(in);
            break;
        case 1:
            RoundTrip<ucx::Announce>(in, ucx::DecodeAnnounce,
                                     [](const ucx::Announce& m) { return ucx::Encode(m); });
            break;
        case 2:
            RoundTrip<ucx::Revoke>(
                in, [](std::string_view s) { return ucx::DecodeRevoke(s, false); },
                [](const ucx::Revoke& m) { return ucx::Encode(m, false); });
            break;
        case 3:
            RoundTrip<ucx::Revoke>(
                in, [](std::string_view s) { return ucx::DecodeRevoke(s, true); },
                [](const ucx::Revoke& m) { return ucx::Encode(m, true); });
            break;
        case 4:
            RoundTrip<ucx::NotifyHeader>(in, ucx::DecodeNotify,
                                         [](const ucx::NotifyHeader& m) { return ucx::Encode(m); });
            break;
        case 5:
            RoundTrip<ucx::DataRequest>(in, ucx::DecodeDataRequest,
                                        [](const ucx::DataRequest& m) { return ucx::Encode(m); });
            break;
        case 6:
            RoundTrip<ucx::GrantRequest>(in, ucx::DecodeGrantRequest,
                                         [](const ucx::GrantRequest& m) { return ucx::Encode(m); });
            break;
        case 7:
            RoundTrip<ucx::PullRequest>(in, ucx::DecodePullRequest,
                                        [](const ucx::PullRequest& m) { return ucx::Encode(m); });
            break;
        case 8:
            RoundTrip<ucx::Reply>(in, ucx::DecodeReply,
                                  [](const ucx::Reply& m) { return ucx::Encode(m); });
            break;
        case 9:
            RoundTrip<ucx::GrantAnswer>(in, ucx::DecodeGrantAnswer,
                                        [](const ucx::GrantAnswer& m) { return ucx::Encode(m); });
            break;
        case 10: {
            uint64_t id = 0, proof = 0;
            (void)ucx::DecodeReplyHead(in, &id, &proof);
            break;
        }
        case 11: {
            std::string worker;
            uint64_t token = 0;
            if (ucx::ParseAddress(in, &worker, &token).ok()) {
                std::string again;
                uint64_t token2 = 0;
                if (!ucx::ParseAddress(ucx::FormatAddress(worker, token), &again, &token2).ok() ||
                    again != worker || token2 != token) {
                    std::abort();
                }
            }
            break;
        }
    }
    return 0;
}
