#include "kv/kv_verify.h"

#include <fmt/core.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <memory>

namespace ferry::kv {

std::string_view KvVerifyModeName(KvVerifyMode m) {
    switch (m) {
        case KvVerifyMode::kOff:
            return "off";
        case KvVerifyMode::kSample:
            return "sample";
        case KvVerifyMode::kAll:
            return "all";
    }
    return "?";
}

Result<KvVerifyMode> ParseKvVerifyMode(std::string_view name) {
    if (name == "off") return KvVerifyMode::kOff;
    if (name == "sample") return KvVerifyMode::kSample;
    if (name == "all") return KvVerifyMode::kAll;
    return InvalidArgumentError(
        fmt::format("kv verify mode '{}' is not one of off, sample, all", name));
}

std::string UnitName(const KvUnit& u) {
    if (u.latent) return fmt::format("layer {} latent", u.layer);
    return fmt::format("layer {} head {} {}", u.layer, u.head, u.v ? "V" : "K");
}

std::vector<int> ChooseUnits(KvVerifyMode mode, int n, std::mt19937_64& rng) {
    std::vector<int> out;
    if (mode == KvVerifyMode::kOff || n <= 0) return out;
    if (mode == KvVerifyMode::kAll) {
        for (int u = 0; u < n; ++u) out.push_back(u);
        return out;
    }
    const int k = std::max(1, (n + kVerifySampleEvery - 1) / kVerifySampleEvery);
    std::vector<int> all(n);
    for (int u = 0; u < n; ++u) all[u] = u;
    // A partial Fisher-Yates: the first k of a random permutation.
    for (int i = 0; i < k; ++i) {
        std::uniform_int_distribution<int> pick(i, n - 1);
        std::swap(all[i], all[pick(rng)]);
    }
    out.assign(all.begin(), all.begin() + k);
    std::sort(out.begin(), out.end());
    return out;
}

namespace {

struct StateFree {
    void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

}  // namespace

Result<std::vector<uint64_t>> KvUnitSums(std::span<const KvRankView> ranks,
                                         std::span<const BlockId> blocks, int begin, int end,
                                         std::span<const int> units, int heads) {
    if (ranks.empty() || heads <= 0) return InvalidArgumentError("kv verify: no ranks");
    const KvCacheSpec& s0 = ranks[0].layout.spec;
    const int bt = s0.block_tokens;
    if (begin < 0 || end <= begin) {
        return InvalidArgumentError(
            fmt::format("kv verify: token range [{}, {}) is empty", begin, end));
    }
    if (static_cast<int64_t>(blocks.size()) * bt < end) {
        return InvalidArgumentError(fmt::format(
            "kv verify: {} blocks of {} tokens do not cover token {}", blocks.size(), bt, end - 1));
    }
    for (int b = begin / bt; b <= (end - 1) / bt; ++b) {
        if (blocks[b] < 0 || blocks[b] >= s0.num_blocks) {
            return InvalidArgumentError(fmt::format("kv verify: block {} is outside the cache's {}",
                                                    blocks[b], s0.num_blocks));
        }
    }
    std::unique_ptr<XXH3_state_t, StateFree> st(XXH3_createState());
    if (!st) return ResourceExhaustedError("kv verify: no memory for a hash state");
    const int planes = s0.Planes();
    const int total = UnitCount(s0.num_layers, heads, planes);
    std::vector<uint64_t> out;
    out.reserve(units.size());
    for (int u : units) {
        if (u < 0 || u >= total) {
            return InvalidArgumentError(
                fmt::format("kv verify: unit {} is outside the model's {}", u, total));
        }
        const KvUnit k = UnitOf(u, heads, planes);
        const KvRankView* rank = nullptr;
        for (const KvRankView& r : ranks) {
            if (k.head >= r.layout.head_begin &&
                k.head < r.layout.head_begin + r.layout.spec.kv_heads) {
                rank = &r;
                break;
            }
        }
        if (!rank) {
            return InvalidArgumentError(fmt::format("kv verify: no rank holds head {}", k.head));
        }
        const KvLayout& l = rank->layout;
        const size_t row = l.RowBytes();
        XXH3_64bits_reset(st.get());
        for (int t = begin; t < end;) {
            const int b = t / bt, slot = t % bt;
            const int n = std::min(end - t, bt - slot);
            const std::byte* p =
                rank->base + l.Offset(k.layer, k.v, blocks[b], k.head - l.head_begin, slot);
            XXH3_64bits_update(st.get(), p, size_t(n) * row);
            t += n;
        }
        out.push_back(XXH3_64bits_digest(st.get()));
    }
    return out;
}

std::optional<size_t> FirstMismatch(std::span<const uint64_t> ours,
                                    std::span<const uint64_t> theirs) {
    for (size_t i = 0; i < ours.size(); ++i) {
        if (i >= theirs.size() || ours[i] != theirs[i]) return i;
    }
    return std::nullopt;
}

// --- The canary -------------------------------------------------------------------------------

namespace {

uint64_t Mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

// The canary row of (layer, K|V, global head, token), `bytes` long.
void PatternRow(int layer, bool v, int head, int token, std::byte* out, size_t bytes) {
    const uint64_t key =
        ((((uint64_t(layer) << 1) | (v ? 1 : 0)) << 20 | uint64_t(head)) << 24) | uint64_t(token);
    for (size_t i = 0; i < bytes; i += 8) {
        const uint64_t w = Mix(key * 0x100000001b3ULL + i);
        std::memcpy(out + i, &w, std::min<size_t>(8, bytes - i));
    }
}

}  // namespace

KvCacheSpec CanarySpec(KvCacheSpec spec) {
    spec.num_blocks = (kCanaryTokens + spec.block_tokens - 1) / spec.block_tokens;
    return spec;
}

std::vector<BlockId> CanaryTable(const KvCacheSpec& canary_spec) {
    std::vector<BlockId> t;
    for (int b = canary_spec.num_blocks - 1; b >= 0; --b) t.push_back(b);
    return t;
}

void FillCanary(const KvLayout& layout, std::span<std::byte> memory) {
    const KvCacheSpec& s = layout.spec;
    const std::vector<BlockId> table = CanaryTable(s);
    const size_t row = layout.RowBytes();
    std::fill(memory.begin(), memory.end(), std::byte{0});
    for (int l = 0; l < s.num_layers; ++l) {
        for (int v = 0; v < s.Planes(); ++v) {
            for (int h = 0; h < s.kv_heads; ++h) {
                for (int t = 0; t < kCanaryTokens; ++t) {
                    const size_t off =
                        layout.Offset(l, v != 0, table[t / s.block_tokens], h, t % s.block_tokens);
                    PatternRow(l, v != 0, layout.head_begin + h, t, memory.data() + off, row);
                }
            }
        }
    }
}

Status CheckCanary(const KvLayout& layout, std::span<const std::byte> memory, int model_heads) {
    const KvCacheSpec& s = layout.spec;
    const std::vector<BlockId> table = CanaryTable(s);
    const size_t row = layout.RowBytes();
    if (memory.size() < s.TotalBytes()) {
        return InvalidArgumentError("kv canary: the copy is smaller than the canary");
    }
    std::vector<std::byte> want(row);
    for (int l = 0; l < s.num_layers; ++l) {
        for (int v = 0; v < s.Planes(); ++v) {
            for (int h = 0; h < s.kv_heads; ++h) {
                const int g = layout.head_begin + h;
                for (int t = 0; t < kCanaryTokens; ++t) {
                    const std::byte* got =
                        memory.data() +
                        layout.Offset(l, v != 0, table[t / s.block_tokens], h, t % s.block_tokens);
                    PatternRow(l, v != 0, g, t, want.data(), row);
                    if (std::memcmp(got, want.data(), row) == 0) continue;
                    // Whose row is it? (A head, layer or token offset is the usual mapping bug.)
                    std::string instead = "bytes that are no canary row (not written, or mixed)";
                    for (int l2 = 0; l2 < s.num_layers; ++l2) {
                        for (int v2 = 0; v2 < s.Planes(); ++v2) {
                            for (int h2 = 0; h2 < model_heads; ++h2) {
                                for (int t2 = 0; t2 < kCanaryTokens; ++t2) {
                                    PatternRow(l2, v2 != 0, h2, t2, want.data(), row);
                                    if (std::memcmp(got, want.data(), row) == 0) {
                                        instead =
                                            fmt::format("the row of {} token {}",
                                                        UnitName({l2, h2, v2 != 0, s.latent}), t2);
                                    }
                                }
                            }
                        }
                    }
                    return DataLossError(fmt::format(
                        "kv canary: {} token {} arrived wrong: it holds {}; the transfer mapping "
                        "between the two layouts is wrong",
                        UnitName({l, g, v != 0, s.latent}), t, instead));
                }
            }
        }
    }
    return Status::Ok();
}

}  // namespace ferry::kv
