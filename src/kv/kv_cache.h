// The paged KV cache of one TP rank: per layer one K and one V tensor, each
// [num_blocks][kv_heads][block_tokens][head_dim] (head-major inside a block, DESIGN "Layouts"), so
// one block of one layer is one contiguous run and one head of one block is one contiguous run.
// A latent cache (MLA) has one tensor per layer, [num_blocks][1][block_tokens][head_dim] with
// head_dim the compressed latent plus the shared RoPE key: it is read both as K and as V (the
// values are the latent's first dims), so V names the same tensor as K there.
// All tensors live in one allocation, which a connector registers with its transfer Agent as a
// region (or allocates through the Agent: see KvCache::Create's allocator).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "ferry/status.h"

namespace ferry::kv {

enum class KvDtype : uint8_t { kF32, kF16, kBF16 };
size_t KvDtypeSize(KvDtype d);
std::string_view KvDtypeName(KvDtype d);
Result<KvDtype> ParseKvDtype(std::string_view name);  // "f32" | "f16" | "bf16"

struct KvCacheSpec {
    int num_layers = 0;
    int kv_heads = 0;  // heads held by this rank
    int head_dim = 0;
    int block_tokens = 16;
    int num_blocks = 0;
    KvDtype dtype = KvDtype::kF32;
    bool latent = false;  // MLA: one tensor per layer, K and V alike (kv_heads 1)

    Status Validate() const;
    // Tensors per layer: 2 (K, V), or 1 for a latent cache.
    int Planes() const { return latent ? 1 : 2; }
    // The tensor index of (layer, K|V) in the allocation.
    size_t Plane(int layer, bool v) const {
        return size_t(layer) * Planes() + (v && !latent ? 1 : 0);
    }
    // Bytes of one head of one block of one layer's K (or V).
    size_t HeadBytes() const { return size_t(block_tokens) * head_dim * KvDtypeSize(dtype); }
    // Bytes of one block of one layer's K (or V).
    size_t BlockBytes() const { return HeadBytes() * kv_heads; }
    // Bytes of one layer's K (or V) tensor.
    size_t TensorBytes() const { return BlockBytes() * num_blocks; }
    size_t TotalBytes() const { return TensorBytes() * Planes() * num_layers; }
};

// Returns `bytes` of zeroed, page-aligned memory that stays valid until the matching release.
struct KvAllocator {
    std::function<Result<std::span<std::byte>>(size_t bytes)> allocate;
    std::function<void(std::span<std::byte>)> release;
};

class KvCache {
  public:
    // Allocates the tensors (pre-faulted anonymous memory unless `allocator` is given).
    // InvalidArgument for a bad spec, ResourceExhausted if the memory cannot be had.
    static Result<std::unique_ptr<KvCache>> Create(const KvCacheSpec& spec,
                                                   KvAllocator allocator = {});
    ~KvCache();
    KvCache(const KvCache&) = delete;
    KvCache& operator=(const KvCache&) = delete;

    const KvCacheSpec& spec() const { return spec_; }
    // The one allocation holding every tensor: layer l's K at l * 2 * TensorBytes(), its V right
    // after (a latent cache: layer l's one tensor at l * TensorBytes()).
    std::span<std::byte> memory() const { return memory_; }
    std::byte* K(int layer) const { return memory_.data() + TensorOffset(layer, false); }
    std::byte* V(int layer) const { return memory_.data() + TensorOffset(layer, true); }
    size_t TensorOffset(int layer, bool v) const {
        return spec_.Plane(layer, v) * spec_.TensorBytes();
    }
    // Offset inside memory() of (layer, K|V, block, head).
    size_t Offset(int layer, bool v, int block, int head) const {
        return TensorOffset(layer, v) + size_t(block) * spec_.BlockBytes() +
               size_t(head) * spec_.HeadBytes();
    }

    // Stores `count` rows of head_dim floats for `head` at token slots [slot, slot + count) of
    // `block` (converted to the cache dtype).
    void Store(int layer, bool v, int block, int head, int slot, int count, const float* rows,
               size_t row_stride);
    // Loads `count` token rows of `head` from `block`, starting at slot 0, as f32 into `out`
    // (row stride head_dim).
    void Load(int layer, bool v, int block, int head, int count, float* out) const;

  private:
    KvCache(const KvCacheSpec& spec, KvAllocator allocator, std::span<std::byte> memory)
        : spec_(spec), allocator_(std::move(allocator)), memory_(memory) {}
    KvCacheSpec spec_;
    KvAllocator allocator_;
    std::span<std::byte> memory_;
};

}  // namespace ferry::kv
