// An allocator for large, long-lived, streamed buffers (model weights): allocations of 2 MiB or
// more are anonymous mappings aligned to 2 MiB and marked MADV_HUGEPAGE, so that with
// transparent huge pages in `madvise` mode (Debian's default) they are backed by 2 MiB pages.
// A decode step streams every weight once; on 4 KiB pages that is a TLB miss and a restart of
// the hardware prefetchers every 4 KiB. Smaller allocations, and systems without THP, get
// ordinary memory aligned to a cache line: only speed differs.
//
// CacheLineAllocator: heap memory aligned to 64 bytes (activations, scratch rows), so that a
// vector load of 64 bytes never straddles two lines (the default new aligns to 16).
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>

namespace ferry {

inline constexpr size_t kHugePageBytes = size_t(2) << 20;
inline constexpr size_t kCacheLineBytes = 64;

template <class T>
struct CacheLineAllocator {
    using value_type = T;
    CacheLineAllocator() = default;
    template <class U>
    CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT: allocators convert implicitly

    T* allocate(size_t n) {
        return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{kCacheLineBytes}));
    }
    void deallocate(T* p, size_t) { ::operator delete (p, std::align_val_t{kCacheLineBytes}); }

    template <class U>
    bool operator==(const CacheLineAllocator<U>&) const {
        return true;
    }
};

template <class T>
struct HugePageAllocator {
    using value_type = T;
    HugePageAllocator() = default;
    template <class U>
    HugePageAllocator(const HugePageAllocator<U>&) {}  // NOLINT: allocators convert implicitly

    T* allocate(size_t n) {
        const size_t bytes = n * sizeof(T);
        if (bytes < kHugePageBytes) return CacheLineAllocator<T>().allocate(n);
        // Map one huge page more than needed, keep the 2 MiB-aligned part, unmap the rest.
        const size_t len = RoundUp(bytes, 4096);
        void* p = mmap(nullptr, len + kHugePageBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        auto base = reinterpret_cast<uintptr_t>(p);
        const uintptr_t start = RoundUp(base, kHugePageBytes);
        if (start > base) munmap(p, start - base);
        const uintptr_t end = base + len + kHugePageBytes;
        if (end > start + len) munmap(reinterpret_cast<void*>(start + len), end - (start + len));
        madvise(reinterpret_cast<void*>(start), len, MADV_HUGEPAGE);  // advice: may fail
        return reinterpret_cast<T*>(start);
    }
    void deallocate(T* p, size_t n) {
        const size_t bytes = n * sizeof(T);
        if (bytes < kHugePageBytes) return CacheLineAllocator<T>().deallocate(p, n);
        munmap(p, RoundUp(bytes, 4096));
    }

    template <class U>
    bool operator==(const HugePageAllocator<U>&) const {
        return true;
    }

  private:
    static constexpr size_t RoundUp(size_t v, size_t a) { return (v + a - 1) / a * a; }
};

}  // namespace ferry
