// Checks that KV moved right, whatever the two sides' layouts (docs/disaggregation.md,
// "Verified transfers"):
//
// - Per-request checksums (`--kv-verify off|sample|all`). A unit is one global kv head's K or V at
//   one layer over a token range (a latent cache's unit: one layer's latent); its checksum is
//   XXH3-64 over the unit's token rows in token order, so it does not depend on block size, TP
//   split or where the blocks lie: the sender sums what it holds, the receiver what landed, and
//   they must agree. `sample` checks one unit in 16 (at least one), chosen at random per request;
//   `all` checks every unit.
// - The handshake canary. Each rank keeps a small cache-shaped region (kCanaryTokens tokens in
//   its own block size and layout, its blocks in reverse order) filled with a pattern that is a
//   function of (layer, K|V, global head, token, byte) alone. A worker reads its peer's canary
//   through the very plan its requests use (ranks paired by heads, blocks cut at both sides'
//   block ends) into a scratch copy of its own and checks every byte against the pattern, so a
//   mapping bug fails the handshake, naming the first wrong row, before any request moves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "kv/kv_layout.h"

namespace ferry::kv {

enum class KvVerifyMode : uint8_t { kOff, kSample, kAll };
std::string_view KvVerifyModeName(KvVerifyMode m);
Result<KvVerifyMode> ParseKvVerifyMode(std::string_view name);  // "off" | "sample" | "all"

// `sample` checks one unit in this many.
inline constexpr int kVerifySampleEvery = 16;

// With `planes` tensors per layer (2: K and V; 1: a latent cache), unit u is
// (layer u / (planes * heads), global head (u / planes) % heads, V if planes is 2 and u is odd).
struct KvUnit {
    int layer = 0;
    int head = 0;
    bool v = false;
    bool latent = false;
};
inline KvUnit UnitOf(int u, int heads, int planes) {
    return {u / (planes * heads), (u / planes) % heads, planes == 2 && (u & 1) != 0, planes == 1};
}
inline int UnitCount(int layers, int heads, int planes) { return layers * heads * planes; }
std::string UnitName(const KvUnit& u);  // "layer 3 head 1 V", "layer 3 latent"

// The units a request checks among `count`: none (off), every one (all), or a random sorted
// sample.
std::vector<int> ChooseUnits(KvVerifyMode mode, int count, std::mt19937_64& rng);

// One side's ranks as checksums see them: each rank's layout and its allocation.
struct KvRankView {
    KvLayout layout;
    const std::byte* base = nullptr;
};

// Checksums of `units` over tokens [begin, end) of the sequence whose block table is `blocks`,
// from whichever rank holds each unit's head. InvalidArgument (naming what) when a unit is out of
// range, the range is empty or reversed, or the table does not cover it.
Result<std::vector<uint64_t>> KvUnitSums(std::span<const KvRankView> ranks,
                                         std::span<const BlockId> blocks, int begin, int end,
                                         std::span<const int> units, int heads);

// The first unit whose sums differ (index into units), if any.
std::optional<size_t> FirstMismatch(std::span<const uint64_t> ours,
                                    std::span<const uint64_t> theirs);

// --- The handshake canary ---------------------------------------------------------------------

inline constexpr int kCanaryTokens = 72;  // cut by every common block size, never whole

// The canary's spec for a rank whose cache has `spec`: same layout, just enough blocks.
KvCacheSpec CanarySpec(KvCacheSpec spec);
// Its block table: the blocks in reverse order (so that no two adjacent tokens' blocks are
// adjacent in memory where the block size allows it).
std::vector<BlockId> CanaryTable(const KvCacheSpec& canary_spec);
// Fills a rank's canary (`memory`: CanarySpec bytes laid out as `layout`).
void FillCanary(const KvLayout& layout, std::span<std::byte> memory);
// Checks a copy of the peer's canary read into `memory` (laid out as `layout`, a CanarySpec): every
// head the layout holds, every layer, K and V, every token. DataLoss naming the first row that
// differs, and whose row it holds instead when it is another head's, layer's or token's.
Status CheckCanary(const KvLayout& layout, std::span<const std::byte> memory, int model_heads);

}  // namespace ferry::kv
