// Images of multimodal requests: where their bytes come from (an image_url's data: or file://
// URL), their decoding (PNG through libpng, JPEG through libjpeg-turbo) into 8-bit RGB, and their
// mm_hash, the key every role (router, encode, prefill, decode) derives the same way from the
// request body to name an image's embeddings.
//
// Everything here takes outside input: each limit is checked before the memory it bounds is
// taken (the encoded size before base64 decoding or reading a file, width x height from the
// header before any pixel is decoded), and every refusal is an InvalidArgument naming what was
// wrong, so the server answers 400 and keeps serving.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/crypto.h"
#include "ferry/status.h"

namespace ferry::media {

struct ImageLimits {
    // Bytes of one encoded image (the file, or a data: URL's payload after base64).
    uint64_t max_encoded_bytes = 20ull << 20;
    // width x height of one decoded image (3 bytes each in memory).
    uint64_t max_pixels = 16ull << 20;
    // Images in one request (vLLM's --limit-mm-per-prompt '{"image": N}').
    int max_images = 8;
};

struct MediaOptions {
    ImageLimits limits;
    // file:// URLs are read only from under this directory (vLLM's --allowed-local-media-path);
    // empty: every file:// URL is refused.
    std::string allowed_local_media_path;
};

// Decoded pixels: rows top to bottom, 3 bytes (R, G, B) per pixel, no padding.
struct Image {
    int width = 0;
    int height = 0;
    std::vector<uint8_t> rgb;
    Digest mm_hash{};  // MmHash of the above

    // The mm_hash as 64 lower-case hex characters.
    std::string HashHex() const;
};

// SHA-256 of "ferry-mm-image-v1", width and height (little-endian u32) and the RGB bytes: equal
// for equal pixels whatever file format, compression or URL carried them, different when one
// pixel differs (a changed image behind the same URL gets new embeddings).
Digest MmHash(int width, int height, const uint8_t* rgb);

// The encoded bytes an image URL names: "data:image/<type>;base64,<payload>", or
// "file:///path" (host empty or "localhost", percent-escapes decoded) of a regular file under
// options.allowed_local_media_path, resolved after opening (a symlink or ".." that leads
// outside is refused). http(s) URLs are refused: the server fetches nothing from the network.
Result<std::string> ReadImageUrl(std::string_view url, const MediaOptions& options);

// Decodes a PNG or JPEG (told apart by their signatures; the data: URL's media type is not
// trusted) into RGB: grey and palette images expanded, 16-bit samples reduced to 8, alpha
// composited over white (as vLLM converts RGBA), interlaced and progressive files read whole.
// Refused: other formats, CMYK JPEG, width x height over limits.max_pixels (checked from the
// header, before decoding), and a truncated or corrupt file (a JPEG's "corrupt data" warnings
// included: no grey-filled guesses).
Result<Image> DecodeImage(std::string_view encoded, const ImageLimits& limits);

// Encodes 8-bit RGB pixels (rows top to bottom, no padding) as a PNG, through libpng.
// InvalidArgument for a size outside 1..65535 or pixels that do not match it.
Result<std::string> EncodePng(int width, int height, std::span<const uint8_t> rgb);

}  // namespace ferry::media
