#include "media/image.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <sys/stat.h>
#include <unistd.h>

// clang-format off: jpeglib.h needs stdio's FILE and size_t declared first.
#include <jerror.h>
#include <jpeglib.h>

#include <csetjmp>
#include <cstdio>
// clang-format on
#include <png.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "core/base64.h"
#include "core/fd.h"

namespace ferry::media {
namespace {

// A progressive JPEG may carry any number of scans, each a pass over the whole image: past this
// many the file is refused (libjpeg-turbo's own tools stop at 500 with -maxscans).
constexpr int kMaxJpegScans = 500;

std::string Lower(std::string_view s) {
    std::string out(s);
    std::transform(out.begin(), out.end(), out.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return out;
}

std::string SizeText(uint64_t bytes) {
    if (bytes >= (1ull << 20)) return fmt::format("{:.1f} MiB", bytes / double(1ull << 20));
    if (bytes >= (1ull << 10)) return fmt::format("{:.1f} KiB", bytes / double(1ull << 10));
    return fmt::format("{} bytes", bytes);
}

Status TooLarge(uint64_t bytes, uint64_t limit) {
    return InvalidArgumentError(
        fmt::format("the image is {} encoded, over the limit of {} (--max-image-bytes)",
                    SizeText(bytes), SizeText(limit)));
}

Status TooManyPixels(uint64_t width, uint64_t height, uint64_t limit) {
    return InvalidArgumentError(
        fmt::format("the image is {} x {} = {} pixels, over the limit of {} (--max-image-pixels)",
                    width, height, width * height, limit));
}

// --- URLs -----------------------------------------------------------------------------------

Result<std::string> DataUrlBytes(std::string_view url, const ImageLimits& limits) {
    std::string_view rest = url.substr(5);  // after "data:"
    const size_t comma = rest.find(',');
    if (comma == std::string_view::npos) {
        return InvalidArgumentError("the data: URL has no ',' before its payload");
    }
    std::string_view meta = rest.substr(0, comma);
    std::string_view payload = rest.substr(comma + 1);
    const size_t semi = meta.find(';');
    const std::string type = Lower(meta.substr(0, semi));
    if (semi == std::string_view::npos || Lower(meta.substr(meta.rfind(';') + 1)) != "base64") {
        return InvalidArgumentError(
            "the data: URL is not base64 (expected data:image/<type>;base64,<payload>)");
    }
    if (type.rfind("image/", 0) != 0) {
        return InvalidArgumentError(
            fmt::format("the data: URL's media type '{}' is not an image (image/png or image/jpeg)",
                        type.substr(0, 64)));
    }
    // Refused before decoding: the payload is 4/3 of the bytes it carries.
    const uint64_t approx = payload.size() / 4 * 3;
    if (approx > limits.max_encoded_bytes + 2) return TooLarge(approx, limits.max_encoded_bytes);
    Result<std::string> bytes = Base64Decode(payload);
    if (!bytes.ok()) {
        return InvalidArgumentError("the data: URL's payload is not valid " +
                                    bytes.status().message());
    }
    if (bytes->size() > limits.max_encoded_bytes) {
        return TooLarge(bytes->size(), limits.max_encoded_bytes);
    }
    if (bytes->empty()) return InvalidArgumentError("the data: URL's image is empty");
    return bytes;
}

Result<std::string> PercentDecode(std::string_view s) {
    std::string out;
    out.reserve(s.size());
    auto hex = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
    };
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] != '%') {
            out += s[i];
            continue;
        }
        const int hi = i + 2 < s.size() ? hex(s[i + 1]) : -1;
        const int lo = i + 2 < s.size() ? hex(s[i + 2]) : -1;
        if (hi < 0 || lo < 0) {
            return InvalidArgumentError("the file:// URL has a malformed %-escape");
        }
        out += static_cast<char>(hi << 4 | lo);
        i += 2;
    }
    if (out.find('\0') != std::string::npos) {
        return InvalidArgumentError("the file:// URL's path contains a NUL byte");
    }
    return out;
}

// `path` (absolute) with "." and ".." and repeated slashes resolved by text alone.
std::string LexicalNormal(std::string_view path) {
    std::vector<std::string_view> parts;
    size_t i = 0;
    while (i <= path.size()) {
        size_t j = path.find('/', i);
        if (j == std::string_view::npos) j = path.size();
        std::string_view p = path.substr(i, j - i);
        if (p == "..") {
            if (!parts.empty()) parts.pop_back();
        } else if (!p.empty() && p != ".") {
            parts.push_back(p);
        }
        i = j + 1;
    }
    std::string out;
    for (std::string_view p : parts) out.append("/").append(p);
    return out.empty() ? "/" : out;
}

bool Under(const std::string& path, const std::string& dir) {
    if (dir == "/") return true;
    return path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 &&
           path[dir.size()] == '/';
}

std::string RealPath(const std::string& path) {
    char* r = ::realpath(path.c_str(), nullptr);
    if (r == nullptr) return {};
    std::string out(r);
    std::free(r);
    return out;
}

Result<std::string> FileUrlBytes(std::string_view url, const MediaOptions& options) {
    if (options.allowed_local_media_path.empty()) {
        return InvalidArgumentError(
            "file:// image URLs are refused: the server was started without "
            "--allowed-local-media-path");
    }
    std::string_view rest = url.substr(5);  // after "file:"
    if (rest.substr(0, 2) != "//") {
        return InvalidArgumentError("a file URL must be file:///absolute/path");
    }
    rest.remove_prefix(2);
    const size_t slash = rest.find('/');
    const std::string host = Lower(rest.substr(0, slash));
    if (slash == std::string_view::npos || (!host.empty() && host != "localhost")) {
        return InvalidArgumentError(
            fmt::format("the file:// URL names host '{}': only local files (file:///path) are read",
                        host.substr(0, 64)));
    }
    FERRY_ASSIGN_OR_RETURN(std::string path, PercentDecode(rest.substr(slash)));
    // The allowed directory as given and as resolved: a path must lie under one of them by its
    // text before anything is opened (so nothing outside can be probed), and under the resolved
    // one once opened (so no symlink leads outside).
    const std::string& allowed = options.allowed_local_media_path;
    const std::string allowed_real = RealPath(allowed);
    if (allowed_real.empty()) {
        return InvalidArgumentError(
            fmt::format("--allowed-local-media-path '{}' cannot be resolved: {}", allowed,
                        std::strerror(errno)));
    }
    const std::string normal = LexicalNormal(path);
    const std::string shown = normal.substr(0, 256);
    if (!Under(normal, LexicalNormal(allowed)) && !Under(normal, allowed_real)) {
        return InvalidArgumentError(
            fmt::format("the image file '{}' is not under --allowed-local-media-path", shown));
    }
    ScopedFd fd(::open(normal.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
    if (!fd.valid()) {
        return InvalidArgumentError(
            fmt::format("cannot open the image file '{}': {}", shown, std::strerror(errno)));
    }
    const std::string opened = RealPath(fmt::format("/proc/self/fd/{}", fd.get()));
    if (opened.empty() || !Under(opened, allowed_real)) {
        return InvalidArgumentError(
            fmt::format("the image file '{}' leads outside --allowed-local-media-path", shown));
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
        return InvalidArgumentError(fmt::format("'{}' is not a regular file", shown));
    }
    const uint64_t max = options.limits.max_encoded_bytes;
    if (static_cast<uint64_t>(st.st_size) > max) return TooLarge(st.st_size, max);
    std::string bytes(static_cast<size_t>(st.st_size), '\0');
    size_t got = 0;
    while (got < bytes.size()) {
        const ssize_t n = ::read(fd.get(), bytes.data() + got, bytes.size() - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            return InvalidArgumentError(fmt::format("cannot read the image file '{}': {}", shown,
                                                    n < 0 ? std::strerror(errno) : "it shrank"));
        }
        got += static_cast<size_t>(n);
    }
    if (bytes.empty()) return InvalidArgumentError(fmt::format("'{}' is empty", shown));
    return bytes;
}

// --- PNG --------------------------------------------------------------------------------------

Status DecodePng(std::string_view encoded, const ImageLimits& limits, Image* out) {
    png_image png;
    std::memset(&png, 0, sizeof(png));
    png.version = PNG_IMAGE_VERSION;
    if (!png_image_begin_read_from_memory(&png, encoded.data(), encoded.size())) {
        std::string why = png.message;
        png_image_free(&png);
        return InvalidArgumentError("the PNG is not readable: " + why);
    }
    if (uint64_t(png.width) * png.height > limits.max_pixels) {
        png_image_free(&png);
        return TooManyPixels(png.width, png.height, limits.max_pixels);
    }
    png.format = PNG_FORMAT_RGB;  // alpha is composited over the background below
    out->width = static_cast<int>(png.width);
    out->height = static_cast<int>(png.height);
    out->rgb.assign(PNG_IMAGE_SIZE(png), 0);
    const png_color white{255, 255, 255};
    if (!png_image_finish_read(&png, &white, out->rgb.data(), 0, nullptr)) {
        std::string why = png.message;
        png_image_free(&png);
        out->rgb.clear();
        return InvalidArgumentError("the PNG is truncated or corrupt: " + why);
    }
    png_image_free(&png);
    return Status::Ok();
}

// --- JPEG -------------------------------------------------------------------------------------

struct JpegErrors {
    jpeg_error_mgr mgr;  // first: libjpeg's callbacks get a pointer to it
    std::jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void JpegFail(j_common_ptr c) {
    auto* e = reinterpret_cast<JpegErrors*>(c->err);
    (*c->err->format_message)(c, e->message);
    std::longjmp(e->jump, 1);
}

// Corrupt-data warnings (level -1: a truncated file, a bad Huffman code) fail the decode; libjpeg
// would fill what it could not read with grey. Stray bytes between markers, which some cameras
// write, are let through, as other decoders do.
void JpegMessage(j_common_ptr c, int level) {
    if (level < 0 && c->err->msg_code != JWRN_EXTRANEOUS_DATA) JpegFail(c);
}

void JpegProgress(j_common_ptr c) {
    auto* d = reinterpret_cast<j_decompress_ptr>(c);
    if (c->is_decompressor && d->input_scan_number > kMaxJpegScans) {
        auto* e = reinterpret_cast<JpegErrors*>(c->err);
        std::snprintf(e->message, sizeof(e->message), "more than %d progressive scans",
                      kMaxJpegScans);
        std::longjmp(e->jump, 1);
    }
}

enum class JpegOutcome { kOk, kFailed, kTooManyPixels };

// kFailed with what went wrong in `why` (JMSG_LENGTH_MAX bytes); kTooManyPixels with the header's
// size in out->width and out->height. Nothing with a destructor is made in this frame: libjpeg's
// errors longjmp back to the setjmp below.
JpegOutcome DecodeJpegInto(const uint8_t* data, size_t size, const ImageLimits& limits, Image* out,
                           char* why) {
    jpeg_decompress_struct cinfo;
    JpegErrors errors;
    jpeg_progress_mgr progress;
    cinfo.err = jpeg_std_error(&errors.mgr);
    errors.mgr.error_exit = JpegFail;
    errors.mgr.emit_message = JpegMessage;
    errors.message[0] = '\0';
    progress.progress_monitor = JpegProgress;
    if (setjmp(errors.jump) != 0) {
        jpeg_destroy_decompress(&cinfo);
        std::snprintf(why, JMSG_LENGTH_MAX, "%s",
                      errors.message[0] != '\0' ? errors.message : "unknown libjpeg error");
        return JpegOutcome::kFailed;
    }
    jpeg_create_decompress(&cinfo);
    cinfo.progress = &progress;
    // Working memory past what the pixels need fails the decode instead of growing (a
    // progressive file keeps every coefficient: 2 bytes per sample).
    cinfo.mem->max_memory_to_use = static_cast<long>(
        std::min<uint64_t>(limits.max_pixels * 8 + (64ull << 20), uint64_t(LONG_MAX)));
    jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
    jpeg_read_header(&cinfo, TRUE);
    if (uint64_t(cinfo.image_width) * cinfo.image_height > limits.max_pixels) {
        out->width = static_cast<int>(cinfo.image_width);
        out->height = static_cast<int>(cinfo.image_height);
        jpeg_destroy_decompress(&cinfo);
        return JpegOutcome::kTooManyPixels;
    }
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        jpeg_destroy_decompress(&cinfo);
        std::snprintf(why, JMSG_LENGTH_MAX,
                      "a CMYK JPEG (only greyscale and colour JPEGs are read)");
        return JpegOutcome::kFailed;
    }
    cinfo.out_color_space = JCS_RGB;
    jpeg_start_decompress(&cinfo);
    out->width = static_cast<int>(cinfo.output_width);
    out->height = static_cast<int>(cinfo.output_height);
    out->rgb.assign(size_t(cinfo.output_width) * cinfo.output_height * 3, 0);
    while (cinfo.output_scanline < cinfo.output_height) {
        JSAMPROW row = out->rgb.data() + size_t(cinfo.output_scanline) * cinfo.output_width * 3;
        jpeg_read_scanlines(&cinfo, &row, 1);
    }
    jpeg_finish_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    return JpegOutcome::kOk;
}

Status DecodeJpeg(std::string_view encoded, const ImageLimits& limits, Image* out) {
    char why[JMSG_LENGTH_MAX] = "";
    switch (DecodeJpegInto(reinterpret_cast<const uint8_t*>(encoded.data()), encoded.size(), limits,
                           out, why)) {
        case JpegOutcome::kOk:
            return Status::Ok();
        case JpegOutcome::kTooManyPixels:
            return TooManyPixels(uint64_t(out->width), uint64_t(out->height), limits.max_pixels);
        case JpegOutcome::kFailed:
            break;
    }
    out->rgb.clear();
    return InvalidArgumentError(std::string("the JPEG is not readable: ") + why);
}

}  // namespace

std::string Image::HashHex() const { return HexEncode(mm_hash.data(), mm_hash.size()); }

Digest MmHash(int width, int height, const uint8_t* rgb) {
    std::string text = "ferry-mm-image-v1";
    for (uint32_t v : {uint32_t(width), uint32_t(height)}) {
        for (int b = 0; b < 4; ++b) text += static_cast<char>((v >> (8 * b)) & 255);
    }
    text.append(reinterpret_cast<const char*>(rgb), size_t(width) * height * 3);
    return Sha256(text);
}

Result<std::string> ReadImageUrl(std::string_view url, const MediaOptions& options) {
    const size_t colon = url.find(':');
    const std::string scheme = colon == std::string_view::npos ? "" : Lower(url.substr(0, colon));
    if (scheme == "data") return DataUrlBytes(url, options.limits);
    if (scheme == "file") return FileUrlBytes(url, options);
    if (scheme == "http" || scheme == "https") {
        return InvalidArgumentError(
            "http(s) image URLs are not fetched (the server makes no network requests): send "
            "the image inline as a data:image/...;base64 URL");
    }
    return InvalidArgumentError(fmt::format(
        "the image URL's scheme '{}' is not supported (data: or file://)", scheme.substr(0, 32)));
}

Result<Image> DecodeImage(std::string_view encoded, const ImageLimits& limits) {
    if (encoded.size() > limits.max_encoded_bytes) {
        return TooLarge(encoded.size(), limits.max_encoded_bytes);
    }
    Image image;
    static constexpr std::string_view kPng("\x89PNG\r\n\x1a\n", 8);
    if (encoded.substr(0, 8) == kPng) {
        FERRY_RETURN_IF_ERROR(DecodePng(encoded, limits, &image));
    } else if (encoded.size() >= 3 && uint8_t(encoded[0]) == 0xFF && uint8_t(encoded[1]) == 0xD8 &&
               uint8_t(encoded[2]) == 0xFF) {
        FERRY_RETURN_IF_ERROR(DecodeJpeg(encoded, limits, &image));
    } else {
        return InvalidArgumentError(
            "the image is neither PNG nor JPEG (its first bytes match neither signature)");
    }
    if (image.width <= 0 || image.height <= 0) {
        return InvalidArgumentError("the image has no pixels");
    }
    image.mm_hash = MmHash(image.width, image.height, image.rgb.data());
    return image;
}

Result<std::string> EncodePng(int width, int height, std::span<const uint8_t> rgb) {
    if (width < 1 || height < 1 || width > 65535 || height > 65535 ||
        rgb.size() != size_t(width) * size_t(height) * 3) {
        return InvalidArgumentError(fmt::format(
            "png: {} bytes of pixels for {}x{} RGB (1..65535 each side, 3 bytes a pixel)",
            rgb.size(), width, height));
    }
    png_image img;
    std::memset(&img, 0, sizeof(img));
    img.version = PNG_IMAGE_VERSION;
    img.width = static_cast<png_uint_32>(width);
    img.height = static_cast<png_uint_32>(height);
    img.format = PNG_FORMAT_RGB;
    png_alloc_size_t size = 0;
    if (!png_image_write_get_memory_size(img, size, 0, rgb.data(), 0, nullptr)) {
        return InternalError(fmt::format("png: {}", img.message));
    }
    std::string out(size, '\0');
    if (!png_image_write_to_memory(&img, out.data(), &size, 0, rgb.data(), 0, nullptr)) {
        return InternalError(fmt::format("png: {}", img.message));
    }
    out.resize(size);
    return out;
}

}  // namespace ferry::media
