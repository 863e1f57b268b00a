#include "kv/kv_cache.h"

#include <fmt/core.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "core/half.h"

namespace ferry::kv {

size_t KvDtypeSize(KvDtype d) { return d == KvDtype::kF32 ? 4 : 2; }

std::string_view KvDtypeName(KvDtype d) {
    switch (d) {
        case KvDtype::kF32:
            return "f32";
        case KvDtype::kF16:
            return "f16";
        case KvDtype::kBF16:
            return "bf16";
    }
    return "?";
}

Result<KvDtype> ParseKvDtype(std::string_view name) {
    if (name == "f32" || name == "float32") return KvDtype::kF32;
    if (name == "f16" || name == "float16" || name == "half") return KvDtype::kF16;
    if (name == "bf16" || name == "bfloat16") return KvDtype::kBF16;
    return InvalidArgumentError(fmt::format("kv dtype '{}' is not one of f32, f16, bf16", name));
}

Status KvCacheSpec::Validate() const {
    if (num_layers <= 0 || kv_heads <= 0 || head_dim <= 0 || block_tokens <= 0 || num_blocks <= 0) {
        return InvalidArgumentError(fmt::format(
            "kv cache spec: layers {}, kv heads {}, head dim {}, block tokens {} and blocks {} "
            "must all be positive",
            num_layers, kv_heads, head_dim, block_tokens, num_blocks));
    }
    if (block_tokens > 4096 || head_dim > 4096 || kv_heads > 4096 || num_layers > 4096) {
        return InvalidArgumentError("kv cache spec: a dimension is above 4096");
    }
    if (latent && kv_heads != 1) {
        return InvalidArgumentError(
            fmt::format("kv cache spec: a latent cache holds 1 head, not {}", kv_heads));
    }
    if (TotalBytes() / Planes() / num_layers / num_blocks != BlockBytes()) {
        return InvalidArgumentError("kv cache spec: size overflows");
    }
    return Status::Ok();
}

Result<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheSpec& spec, KvAllocator allocator) {
    FERRY_RETURN_IF_ERROR(spec.Validate());
    size_t bytes = spec.TotalBytes();
    std::span<std::byte> memory;
    if (allocator.allocate) {
        FERRY_ASSIGN_OR_RETURN(memory, allocator.allocate(bytes));
        if (memory.size() < bytes) {
            return InternalError(fmt::format("kv cache: allocator returned {} bytes of {} asked",
                                             memory.size(), bytes));
        }
    } else {
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (p == MAP_FAILED) {
            return ResourceExhaustedError(
                fmt::format("kv cache: cannot map {} MiB: {}", bytes >> 20, std::strerror(errno)));
        }
        memory = {static_cast<std::byte*>(p), bytes};
    }
    return std::unique_ptr<KvCache>(new KvCache(spec, std::move(allocator), memory));
}

KvCache::~KvCache() {
    if (allocator_.release) {
        allocator_.release(memory_);
    } else if (!allocator_.allocate) {
        munmap(memory_.data(), memory_.size());
    }
}

void KvCache::Store(int layer, bool v, int block, int head, int slot, int count, const float* rows,
                    size_t row_stride) {
    const int hd = spec_.head_dim;
    std::byte* base = memory_.data() + Offset(layer, v, block, head) +
                      size_t(slot) * hd * KvDtypeSize(spec_.dtype);
    for (int t = 0; t < count; ++t) {
        const float* src = rows + t * row_stride;
        switch (spec_.dtype) {
            case KvDtype::kF32:
                std::memcpy(base + size_t(t) * hd * 4, src, size_t(hd) * 4);
                break;
            case KvDtype::kF16: {
                auto* dst = reinterpret_cast<uint16_t*>(base) + size_t(t) * hd;
                for (int i = 0; i < hd; ++i) dst[i] = FloatToF16(src[i]);
                break;
            }
            case KvDtype::kBF16: {
                auto* dst = reinterpret_cast<uint16_t*>(base) + size_t(t) * hd;
                for (int i = 0; i < hd; ++i) dst[i] = FloatToBf16(src[i]);
                break;
            }
        }
    }
}

void KvCache::Load(int layer, bool v, int block, int head, int count, float* out) const {
    const size_t n = size_t(count) * spec_.head_dim;
    const std::byte* base = memory_.data() + Offset(layer, v, block, head);
    switch (spec_.dtype) {
        case KvDtype::kF32:
            std::memcpy(out, base, n * 4);
            break;
        case KvDtype::kF16: {
            F16ToFloat(reinterpret_cast<const uint16_t*>(base), n, out);
            break;
        }
        case KvDtype::kBF16: {
            Bf16ToFloat(reinterpret_cast<const uint16_t*>(base), n, out);
            break;
        }
    }
}

}  // namespace ferry::kv
