// Loads and stores of the caller's buffers at any element offset. The kernels move 16-byte
// packs (8-byte lines for the low-latency kernel); a view at an odd element offset is not
// 16-byte aligned, so its packs are assembled from element loads instead. Whether a pointer
// is aligned is uniform over the grid, so the branch costs the aligned fast path nothing
// measurable, and both paths carry the same bits: results are identical.
#pragma once

#include <stdint.h>

#include "elements.cuh"

namespace symm {

__device__ __forceinline__ bool is_aligned(const void* p, uint32_t bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// The raw bits of one element.
template <uint32_t SIZE>
struct ElemBits;
template <>
struct ElemBits<4> {
    using type = uint32_t;
};
template <>
struct ElemBits<2> {
    using type = uint16_t;
};

template <typename T>
union RawPack {
    uint4 bits;
    typename ElemBits<sizeof(T)>::type elems[16 / sizeof(T)];
};

// Pack `pack` (16 bytes) of `in`.
template <typename T>
__device__ __forceinline__ uint4 load_pack(const T* in, uint64_t pack, bool aligned) {
    if (aligned) return reinterpret_cast<const uint4*>(in)[pack];
    using B = typename ElemBits<sizeof(T)>::type;
    const B* src = reinterpret_cast<const B*>(in) + pack * (16 / sizeof(T));
    RawPack<T> p;
#pragma unroll
    for (uint32_t e = 0; e < 16 / sizeof(T); ++e) p.elems[e] = src[e];
    return p.bits;
}

// Stores `v` as pack `pack` of `out`.
template <typename T>
__device__ __forceinline__ void store_pack(T* out, uint64_t pack, uint4 v, bool aligned) {
    if (aligned) {
        reinterpret_cast<uint4*>(out)[pack] = v;
        return;
    }
    using B = typename ElemBits<sizeof(T)>::type;
    B* dst = reinterpret_cast<B*>(out) + pack * (16 / sizeof(T));
    RawPack<T> p;
    p.bits = v;
#pragma unroll
    for (uint32_t e = 0; e < 16 / sizeof(T); ++e) dst[e] = p.elems[e];
}

}  // namespace symm
