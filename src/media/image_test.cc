#include "media/image.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

// clang-format off: jpeglib.h needs stdio's FILE and size_t declared first.
#include <jpeglib.h>

#include <cstdio>
// clang-format on
#include <png.h>
#include <zlib.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/base64.h"
#include "testing/images.h"

namespace ferry::media {
namespace {

using testing::DataUrl;
using testing::Jpeg;
using testing::Png;
using testing::RandomPixels;

std::string ErrorOf(const Result<Image>& r) { return r.ok() ? "" : r.status().message(); }
std::string ErrorOf(const Result<std::string>& r) { return r.ok() ? "" : r.status().message(); }

TEST(Image, APngDecodesToItsPixelsAndTheirHash) {
    const auto px = RandomPixels(37, 23, 3, 1);
    auto img = DecodeImage(Png(37, 23, PNG_FORMAT_RGB, px), {});
    ASSERT_TRUE(img.ok()) << img.status().message();
    EXPECT_EQ(img->width, 37);
    EXPECT_EQ(img->height, 23);
    EXPECT_EQ(img->rgb, px);
    EXPECT_EQ(img->mm_hash, MmHash(37, 23, px.data()));
    EXPECT_EQ(img->HashHex().size(), 64u);
}

TEST(Image, TheHashIsOfThePixelsNotTheFile) {
    // Grey pixels as a grey PNG, an RGB PNG, an opaque RGBA PNG and a palette PNG: one hash.
    const int w = 19, h = 11;
    const auto grey = RandomPixels(w, h, 1, 2);
    std::vector<uint8_t> rgb, rgba;
    for (uint8_t g : grey) {
        rgb.insert(rgb.end(), {g, g, g});
        rgba.insert(rgba.end(), {g, g, g, 255});
    }
    std::vector<uint8_t> palette;
    for (int i = 0; i < 256; ++i)
        palette.insert(palette.end(), {uint8_t(i), uint8_t(i), uint8_t(i)});
    const std::string files[] = {Png(w, h, PNG_FORMAT_GRAY, grey), Png(w, h, PNG_FORMAT_RGB, rgb),
                                 Png(w, h, PNG_FORMAT_RGBA, rgba),
                                 Png(w, h, PNG_FORMAT_RGB_COLORMAP, grey, palette.data())};
    for (const std::string& f : files) {
        auto img = DecodeImage(f, {});
        ASSERT_TRUE(img.ok()) << img.status().message();
        EXPECT_EQ(img->rgb, rgb);
        EXPECT_EQ(img->mm_hash, MmHash(w, h, rgb.data()));
    }
    EXPECT_NE(files[0], files[1]);
}

TEST(Image, OnePixelOrTheShapeChangesTheHash) {
    auto px = RandomPixels(6, 4, 3, 3);
    const Digest a = MmHash(6, 4, px.data());
    EXPECT_NE(a, MmHash(4, 6, px.data()));  // the same bytes in another shape
    EXPECT_NE(a, MmHash(12, 2, px.data()));
    px[40] ^= 1;
    EXPECT_NE(a, MmHash(6, 4, px.data()));
}

TEST(Image, AlphaIsCompositedOverWhite) {
    std::vector<uint8_t> rgba = {10, 20, 30, 0, 10, 20, 30, 255, 200, 100, 0, 128};
    auto img = DecodeImage(Png(3, 1, PNG_FORMAT_RGBA, rgba), {});
    ASSERT_TRUE(img.ok()) << img.status().message();
    EXPECT_EQ(std::vector<uint8_t>(img->rgb.begin(), img->rgb.begin() + 6),
              (std::vector<uint8_t>{255, 255, 255, 10, 20, 30}));
    // Half-transparent: between the colour and white in every channel.
    EXPECT_GT(img->rgb[7], 100);
    EXPECT_LT(img->rgb[7], 255);
}

TEST(Image, JpegsDecodeBaselineProgressiveAndGrey) {
    const int w = 64, h = 48;
    // A smooth picture: JPEG keeps it close.
    std::vector<uint8_t> px;
    for (int y = 0; y < h; ++y) {
        for (int x = 0; x < w; ++x) {
            px.insert(px.end(), {uint8_t(x * 4), uint8_t(y * 5), uint8_t(128)});
        }
    }
    for (bool progressive : {false, true}) {
        auto img = DecodeImage(Jpeg(w, h, 3, px, progressive), {});
        ASSERT_TRUE(img.ok()) << img.status().message();
        ASSERT_EQ(img->width, w);
        ASSERT_EQ(img->height, h);
        double err = 0;
        for (size_t i = 0; i < px.size(); ++i) err += std::abs(int(px[i]) - int(img->rgb[i]));
        EXPECT_LT(err / px.size(), 4.0) << "progressive " << progressive;
        EXPECT_EQ(img->mm_hash, MmHash(w, h, img->rgb.data()));
    }
    std::vector<uint8_t> grey(size_t(w) * h, 77);
    auto g = DecodeImage(Jpeg(w, h, 1, grey, false), {});
    ASSERT_TRUE(g.ok()) << g.status().message();
    for (size_t i = 0; i < g->rgb.size(); i += 3) {
        ASSERT_EQ(g->rgb[i], g->rgb[i + 1]);
        ASSERT_EQ(g->rgb[i], g->rgb[i + 2]);
    }
}

TEST(Image, WhatCannotBeDecodedIsNamed) {
    const auto px = RandomPixels(40, 40, 3, 4);
    const std::string png = Png(40, 40, PNG_FORMAT_RGB, px);
    const std::string jpeg = Jpeg(40, 40, 3, px, false);

    EXPECT_NE(ErrorOf(DecodeImage(png.substr(0, png.size() / 2), {})).find("PNG is truncated"),
              std::string::npos);
    EXPECT_NE(ErrorOf(DecodeImage(png.substr(0, 20), {})).find("PNG is not readable"),
              std::string::npos);
    std::string flipped = png;
    flipped[flipped.size() / 2] ^= 0x55;  // inside IDAT: its CRC no longer matches
    EXPECT_NE(ErrorOf(DecodeImage(flipped, {})), "");
    EXPECT_NE(
        ErrorOf(DecodeImage(jpeg.substr(0, jpeg.size() / 2), {})).find("JPEG is not readable"),
        std::string::npos);
    EXPECT_NE(ErrorOf(DecodeImage(jpeg.substr(0, 3), {})).find("JPEG is not readable"),
              std::string::npos);
    EXPECT_NE(ErrorOf(DecodeImage("GIF89a\x01\x00\x01\x00", {})).find("neither PNG nor JPEG"),
              std::string::npos);
    EXPECT_NE(ErrorOf(DecodeImage("", {})).find("neither PNG nor JPEG"), std::string::npos);
    std::vector<uint8_t> cmyk(size_t(16) * 16 * 4, 9);
    EXPECT_NE(ErrorOf(DecodeImage(Jpeg(16, 16, 4, cmyk, false), {})).find("CMYK"),
              std::string::npos);
    ImageLimits small;
    small.max_encoded_bytes = png.size() - 1;
    EXPECT_NE(ErrorOf(DecodeImage(png, small)).find("over the limit"), std::string::npos);
}

// A file that claims more pixels than allowed is refused from its header, before any pixel is
// decoded: a decompression bomb (a small file of a huge, uniform image) never gets its buffer.
TEST(Image, PixelLimitsAreCheckedBeforeDecoding) {
    ImageLimits limits;
    limits.max_pixels = 256 * 256;
    std::vector<uint8_t> zeros(size_t(1000) * 1000 * 3, 0);
    const std::string png = Png(1000, 1000, PNG_FORMAT_RGB, zeros);
    const std::string jpeg = Jpeg(1000, 1000, 3, zeros, true);
    EXPECT_LT(png.size(), 10000u);
    for (const std::string& f : {png, jpeg}) {
        std::string e = ErrorOf(DecodeImage(f, limits));
        EXPECT_NE(e.find("1000 x 1000 = 1000000 pixels, over the limit of 65536"),
                  std::string::npos)
            << e;
    }
    // A header that lies: 1x1 pixels of data under an IHDR claiming 60000 x 60000.
    std::string liar = Png(1, 1, PNG_FORMAT_RGB, {1, 2, 3});
    const uint32_t big = 60000;
    for (int k = 0; k < 2; ++k) {
        for (int b = 0; b < 4; ++b) liar[16 + 4 * k + b] = char((big >> (24 - 8 * b)) & 255);
    }
    // The IHDR's CRC over type and data, so that libpng reads as far as the dimensions.
    uint32_t crc = png_uint_32(crc32(0, reinterpret_cast<const Bytef*>(liar.data() + 12), 17));
    for (int b = 0; b < 4; ++b) liar[29 + b] = char((crc >> (24 - 8 * b)) & 255);
    std::string e = ErrorOf(DecodeImage(liar, {}));
    EXPECT_NE(e.find("60000 x 60000"), std::string::npos) << e;
}

TEST(ImageUrl, DataUrlsCarryBase64Images) {
    const std::string png = Png(2, 2, PNG_FORMAT_RGB, RandomPixels(2, 2, 3, 5));
    auto bytes = ReadImageUrl(DataUrl("image/png", png), {});
    ASSERT_TRUE(bytes.ok()) << bytes.status().message();
    EXPECT_EQ(*bytes, png);
    // The declared type does not decide the decoder; the signature does.
    EXPECT_TRUE(ReadImageUrl(DataUrl("image/jpeg", png), {}).ok());
    EXPECT_TRUE(ReadImageUrl("DATA:Image/PNG;BASE64," + Base64Encode(png), {}).ok());

    auto err = [](const std::string& url, MediaOptions o = {}) {
        return ErrorOf(ReadImageUrl(url, o));
    };
    EXPECT_NE(err("data:image/png," + png).find("not base64"), std::string::npos);
    EXPECT_NE(err("data:image/png;base64").find("no ','"), std::string::npos);
    EXPECT_NE(err(DataUrl("text/plain", png)).find("'text/plain' is not an image"),
              std::string::npos);
    EXPECT_NE(err("data:image/png;base64,ab$d").find("not valid base64"), std::string::npos);
    EXPECT_NE(err("data:image/png;base64,").find("empty"), std::string::npos);
    MediaOptions small;
    small.limits.max_encoded_bytes = 1000;
    // Refused by the payload's length, before it is decoded.
    EXPECT_NE(err("data:image/png;base64," + std::string(4000, 'A'), small).find("over the limit"),
              std::string::npos);
}

TEST(ImageUrl, NetworkAndUnknownSchemesAreRefused) {
    for (std::string url : {"http://example.com/a.png", "HTTPS://example.com/a.png"}) {
        EXPECT_NE(ErrorOf(ReadImageUrl(url, {})).find("not fetched"), std::string::npos) << url;
    }
    EXPECT_NE(ErrorOf(ReadImageUrl("ftp://x/a.png", {})).find("scheme 'ftp'"), std::string::npos);
    EXPECT_NE(ErrorOf(ReadImageUrl("a.png", {})).find("scheme ''"), std::string::npos);
}

class FileUrls : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/ferry-media-XXXXXX";
        ASSERT_NE(mkdtemp(tmpl), nullptr);
        root_ = tmpl;
        allowed_ = root_ + "/allowed";
        std::filesystem::create_directories(allowed_ + "/sub dir");
        png_ = Png(3, 3, PNG_FORMAT_RGB, RandomPixels(3, 3, 3, 6));
        Write(allowed_ + "/sub dir/a.png", png_);
        Write(root_ + "/secret.png", png_);
        options_.allowed_local_media_path = allowed_;
    }
    void TearDown() override { std::filesystem::remove_all(root_); }
    static void Write(const std::string& path, const std::string& bytes) {
        std::ofstream(path, std::ios::binary) << bytes;
    }
    std::string Err(const std::string& url) { return ErrorOf(ReadImageUrl(url, options_)); }

    std::string root_, allowed_, png_;
    MediaOptions options_;
};

TEST_F(FileUrls, AFileUnderTheAllowedDirectoryIsRead) {
    for (std::string url : {"file://" + allowed_ + "/sub%20dir/a.png",
                            "file://localhost" + allowed_ + "/sub%20dir/./a.png",
                            "file://" + allowed_ + "/sub%20dir/../sub%20dir/a.png"}) {
        auto bytes = ReadImageUrl(url, options_);
        ASSERT_TRUE(bytes.ok()) << url << ": " << bytes.status().message();
        EXPECT_EQ(*bytes, png_);
    }
}

TEST_F(FileUrls, NothingOutsideItIsOpened) {
    EXPECT_NE(ErrorOf(ReadImageUrl("file://" + allowed_ + "/sub%20dir/a.png", {}))
                  .find("without --allowed-local-media-path"),
              std::string::npos);
    EXPECT_NE(Err("file://" + allowed_ + "/../secret.png").find("not under"), std::string::npos);
    EXPECT_NE(Err("file://" + allowed_ + "/%2e%2e/secret.png").find("not under"),
              std::string::npos);
    EXPECT_NE(Err("file:///etc/passwd").find("not under"), std::string::npos);
    // A sibling whose name starts with the allowed one's.
    std::filesystem::create_directories(allowed_ + "-other");
    Write(allowed_ + "-other/b.png", png_);
    EXPECT_NE(Err("file://" + allowed_ + "-other/b.png").find("not under"), std::string::npos);
    // A symlink inside that leads outside.
    ASSERT_EQ(symlink((root_ + "/secret.png").c_str(), (allowed_ + "/link.png").c_str()), 0);
    EXPECT_NE(Err("file://" + allowed_ + "/link.png").find("leads outside"), std::string::npos);
    EXPECT_NE(Err("file://otherhost" + allowed_ + "/sub%20dir/a.png").find("host 'otherhost'"),
              std::string::npos);
    EXPECT_NE(Err("file:" + allowed_ + "/sub%20dir/a.png").find("file:///"), std::string::npos);
    EXPECT_NE(Err("file://" + allowed_ + "/a%00.png").find("NUL"), std::string::npos);
    EXPECT_NE(Err("file://" + allowed_ + "/a%zz.png").find("%-escape"), std::string::npos);
    EXPECT_NE(Err("file://" + allowed_ + "/missing.png").find("cannot open"), std::string::npos);
}

TEST_F(FileUrls, OnlyRegularFilesWithinTheByteLimitAreRead) {
    // A FIFO would block a plain open or read: it is opened without waiting and refused.
    ASSERT_EQ(mkfifo((allowed_ + "/pipe.png").c_str(), 0600), 0);
    EXPECT_NE(Err("file://" + allowed_ + "/pipe.png").find("not a regular file"),
              std::string::npos);
    EXPECT_NE(Err("file://" + allowed_ + "/sub%20dir").find("not a regular file"),
              std::string::npos);
    options_.limits.max_encoded_bytes = png_.size() - 1;
    EXPECT_NE(Err("file://" + allowed_ + "/sub%20dir/a.png").find("over the limit"),
              std::string::npos);
    Write(allowed_ + "/empty.png", "");
    options_.limits.max_encoded_bytes = 1 << 20;
    EXPECT_NE(Err("file://" + allowed_ + "/empty.png").find("empty"), std::string::npos);
}

}  // namespace
}  // namespace ferry::media
