// Images for tests: pixels, and PNG and JPEG files of them written by libpng and libjpeg-turbo.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ferry::testing {

// w x h pixels of `channels` random bytes from `seed`.
std::vector<uint8_t> RandomPixels(int w, int h, int channels, uint32_t seed);
// A PNG of `px` (`format`: PNG_FORMAT_RGB, _RGBA, _GRAY, ...) through libpng's writer.
std::string Png(int w, int h, uint32_t format, const std::vector<uint8_t>& px,
                const void* colormap = nullptr);
// A JPEG of `px` (`components` 1, 3 or 4 with their colour space) through libjpeg's encoder.
std::string Jpeg(int w, int h, int components, const std::vector<uint8_t>& px, bool progressive,
                 int quality = 95);
// "data:TYPE;base64,..." of `bytes`.
std::string DataUrl(const std::string& type, const std::string& bytes);
// A PNG data: URL of random RGB pixels.
std::string RandomPngUrl(int w, int h, uint32_t seed);

}  // namespace ferry::testing
