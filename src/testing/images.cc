#include "testing/images.h"

#include <gtest/gtest.h>

// clang-format off: jpeglib.h needs stdio's FILE and size_t declared first.
#include <jpeglib.h>

#include <cstdio>
// clang-format on
#include <png.h>

#include <cstdlib>
#include <cstring>
#include <random>

#include "core/base64.h"

namespace ferry::testing {

std::vector<uint8_t> RandomPixels(int w, int h, int channels, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t> px(size_t(w) * h * channels);
    for (auto& b : px) b = static_cast<uint8_t>(rng());
    return px;
}

std::string Png(int w, int h, uint32_t format, const std::vector<uint8_t>& px,
                const void* colormap) {
    png_image img;
    std::memset(&img, 0, sizeof(img));
    img.version = PNG_IMAGE_VERSION;
    img.width = w;
    img.height = h;
    img.format = format;
    if (colormap != nullptr) img.colormap_entries = 256;
    png_alloc_size_t size = 0;
    EXPECT_TRUE(png_image_write_get_memory_size(img, size, 0, px.data(), 0, colormap));
    std::string out(size, '\0');
    EXPECT_TRUE(png_image_write_to_memory(&img, out.data(), &size, 0, px.data(), 0, colormap))
        << img.message;
    out.resize(size);
    return out;
}

std::string Jpeg(int w, int h, int components, const std::vector<uint8_t>& px, bool progressive,
                 int quality) {
    jpeg_compress_struct c;
    jpeg_error_mgr err;
    c.err = jpeg_std_error(&err);
    jpeg_create_compress(&c);
    unsigned char* buf = nullptr;
    unsigned long size = 0;
    jpeg_mem_dest(&c, &buf, &size);
    c.image_width = w;
    c.image_height = h;
    c.input_components = components;
    c.in_color_space = components == 1 ? JCS_GRAYSCALE : components == 3 ? JCS_RGB : JCS_CMYK;
    jpeg_set_defaults(&c);
    jpeg_set_quality(&c, quality, TRUE);
    if (progressive) jpeg_simple_progression(&c);
    jpeg_start_compress(&c, TRUE);
    while (c.next_scanline < c.image_height) {
        JSAMPROW row = const_cast<uint8_t*>(px.data()) + size_t(c.next_scanline) * w * components;
        jpeg_write_scanlines(&c, &row, 1);
    }
    jpeg_finish_compress(&c);
    jpeg_destroy_compress(&c);
    std::string out(reinterpret_cast<char*>(buf), size);
    std::free(buf);
    return out;
}

std::string DataUrl(const std::string& type, const std::string& bytes) {
    return "data:" + type + ";base64," + Base64Encode(bytes);
}

std::string RandomPngUrl(int w, int h, uint32_t seed) {
    return DataUrl("image/png", Png(w, h, PNG_FORMAT_RGB, RandomPixels(w, h, 3, seed)));
}

}  // namespace ferry::testing
