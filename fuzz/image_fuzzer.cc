// Images of multimodal requests: PNG and JPEG decoding under limits (media/image.h), and the
// same bytes as a data: URL's payload and as an image URL of any form.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/base64.h"
#include "media/image.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    using namespace ferry::media;  // NOLINT
    const std::string bytes(reinterpret_cast<const char*>(data), size);
    // Small limits: a header that claims more is refused before any buffer is taken, which is
    // what keeps the fuzzer (and the server) within its memory.
    ImageLimits limits;
    limits.max_pixels = 1 << 20;
    limits.max_encoded_bytes = 1 << 20;
    auto image = DecodeImage(bytes, limits);
    if (image.ok() && image->rgb.size() != size_t(image->width) * image->height * 3)
        __builtin_trap();
    MediaOptions options;
    options.limits = limits;
    (void)ReadImageUrl("data:image/png;base64," + ferry::Base64Encode(bytes), options);
    (void)ReadImageUrl(bytes, options);  // refused schemes; file:// refused without a directory
    return 0;
}
