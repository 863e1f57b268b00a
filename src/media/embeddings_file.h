// One image's embeddings as a file: a safetensors file holding one F32 tensor "ec_cache"
// [rows, width], as vLLM's ECExampleConnector writes it (DIR/<mm_hash>/encoder_cache.safetensors),
// with string metadata ("__metadata__"): ferry always writes "xxh3" (XXH3-64 of the data, 16 hex
// digits) and the caller's keys. The disk encoder-cache connector (serve/ec_connector.h) and the
// encoder cache's disk tier (media/encoder_cache.h) both use it.
//
// A file is written to a temporary name in its directory and renamed, so a reader sees a whole
// file or none; nothing is synced (both are caches: a file torn by a crash fails its checks).
#pragma once

#include <sys/types.h>

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "media/encoder_cache.h"

namespace ferry::media {

// An mm_hash as every role writes it: 64 lower-case hex digits (it names files and keys).
bool IsMmHash(std::string_view s);

// XXH3-64 of `n` bytes.
uint64_t EmbeddingsChecksum(const void* p, size_t n);

using FileMetadata = std::map<std::string, std::string>;

// The largest header a reader takes (ferry writes a few hundred bytes).
constexpr uint64_t kMaxEmbeddingsHeaderBytes = 1 << 20;

// Writes `floats` (a multiple of `width`) with `metadata` (plus "xxh3") to `path`, created with
// `mode`: the file's size. InternalError naming the file and the call that failed.
Result<uint64_t> WriteEmbeddingsFile(const std::string& path, const std::vector<float>& floats,
                                     size_t width, const FileMetadata& metadata,
                                     mode_t mode = 0644);

// Reads `path`, which must hold exactly `floats` floats as [floats / width, width]. NotFound when
// it does not exist, Unavailable when it cannot be opened or read, DataLoss naming what is wrong
// (its header, its shape, its size, its checksum when it carries one). A file larger than such
// a tensor with a header of kMaxEmbeddingsHeaderBytes is refused before it is read (memory
// stays bounded whatever a shared directory holds). `metadata`, when given,
// receives the file's string metadata.
Result<Embeddings> ReadEmbeddingsFile(const std::string& path, size_t floats, size_t width,
                                      FileMetadata* metadata = nullptr);
// The same checks over a file's bytes (`name` for the errors).
Result<Embeddings> ParseEmbeddingsFile(std::string_view data, std::string_view name, size_t floats,
                                       size_t width, FileMetadata* metadata = nullptr);

}  // namespace ferry::media
