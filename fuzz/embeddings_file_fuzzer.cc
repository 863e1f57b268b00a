// Encoder-cache files (media/embeddings_file.h): what the disk encoder-cache connector reads from a
// directory other hosts write, and the encoder cache's disk tier reads back. The first two bytes
// give the shape the reader expects (rows, width); the rest is the file.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "media/embeddings_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 2) return 0;
    const size_t rows = data[0], width = data[1];
    const std::string_view file(reinterpret_cast<const char*>(data + 2), size - 2);
    ferry::media::FileMetadata meta;
    auto e = ferry::media::ParseEmbeddingsFile(file, "fuzz", rows * width, width, &meta);
    if (e.ok() && (*e)->size() != rows * width) __builtin_trap();
    return 0;
}
