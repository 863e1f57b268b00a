// Prefix-cache block hashes anyone can recompute: vLLM's reproducible form (`sha256_cbor` in
// vllm/v1/core/kv_cache_utils.py), so that a router, another worker, or a KV-aware router written
// for vLLM (llm-d, Dynamo) gets the same hash of the same tokens.
//
//   root        = SHA-256(CBOR(seed as a text string))         vLLM's NONE_HASH,
//   PYTHONHASHSEED=seed hash(block) = SHA-256(CBOR([parent, [token ids...], extra keys]))
//
// CBOR in its canonical (shortest) form; `parent` a 32-byte byte string (the root for a
// prompt's first block); the token ids an array of integers; the extra keys null, or, for a
// block that overlaps multimodal inputs (an image's placeholder tokens), an array of their
// mm_hashes as hex text strings in prompt order (vLLM's _gen_mm_extra_hash_keys: the mm
// feature's identifier), so equal placeholder tokens of different images never share a hash.
// ferry has no LoRA adapters or cache salts. Only full blocks are hashed.
// docs/routing.md states the versioned spec workers publish (algorithm, seed, block size,
// extra keys).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/crypto.h"

namespace ferry {

using BlockHash = Digest;  // 32 bytes

inline constexpr int kBlockHashSpecVersion = 1;
inline constexpr std::string_view kBlockHashAlgorithm = "sha256_cbor";

// What a worker states about its block hashes (in its store record and its KV events' topic
// documentation), so that anyone recomputes them.
struct BlockHashSpec {
    int version = kBlockHashSpecVersion;
    std::string algorithm = std::string(kBlockHashAlgorithm);
    std::string seed = "0";  // vLLM's PYTHONHASHSEED
    int block_size = 16;
    std::string extra_keys = "none";
};

// A multimodal input's place in a prompt: `length` placeholder tokens from `offset`, whose
// content `hash` names (an image's mm_hash, 64 hex characters).
struct MmSpan {
    int64_t offset = 0;
    int64_t length = 0;
    std::string hash;
};
// The extra keys of the block of positions [start, end): the hashes of the inputs that overlap
// it, in order (`mm` sorted by offset).
std::vector<std::string_view> MmExtraKeys(std::span<const MmSpan> mm, int64_t start, int64_t end);

// The hash chain's root for `seed` (vLLM's NONE_HASH with PYTHONHASHSEED=seed).
BlockHash RootBlockHash(std::string_view seed);
// The hash of one full block of `tokens` after a block hashed `parent` (the root for the first).
// `extra_keys` empty: CBOR null.
BlockHash HashBlockTokens(const BlockHash& parent, std::span<const int32_t> tokens,
                          std::span<const std::string_view> extra_keys = {});
// The hashes of every full block of `tokens`, chained from `root`, with the extra keys of the
// multimodal inputs `mm`.
std::vector<BlockHash> HashFullBlocks(const BlockHash& root, std::span<const int32_t> tokens,
                                      int block_size, std::span<const MmSpan> mm = {});
// vLLM's integer form of a block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): its last 8 bytes,
// big-endian.
uint64_t BlockHashToInt(const BlockHash& h);

// For unordered containers keyed by a block hash (its first 8 bytes: already uniform).
struct BlockHashKey {
    size_t operator()(const BlockHash& h) const;
};

}  // namespace ferry
