// Element traits: how each dtype is loaded from 16-byte packs and 8-byte lines, widened to
// fp32 and rounded back once. A new dtype is one `Elem` specialisation here plus one line in
// SYMM_FOR_EACH_DTYPE.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// X(suffix, type): every dtype, in the order of src/dtype.rs (the kernel table's columns).
#define SYMM_FOR_EACH_DTYPE(X) \
    X(f32, float)              \
    X(f16, __half)             \
    X(bf16, __nv_bfloat16)

namespace symm {

template <typename T>
struct Elem;

template <>
struct Elem<float> {
    static constexpr uint32_t PER_PACK = 4;
    __device__ static float to_float(float x) { return x; }
    __device__ static float from_float(float x) { return x; }
};

// The 16-bit types also widen a 32-bit word (two elements, the first in the low half) at once:
// one instruction per element for bf16 (a shift or a mask), one conversion of the pair for f16.
// The values are exactly `to_float` of each element.
template <>
struct Elem<__half> {
    static constexpr uint32_t PER_PACK = 8;
    __device__ static float to_float(__half x) { return __half2float(x); }
    __device__ static __half from_float(float x) { return __float2half_rn(x); }
    __device__ static float2 widen(uint32_t w) {
        __half2 h;
        memcpy(&h, &w, 4);
        return __half22float2(h);
    }
};

template <>
struct Elem<__nv_bfloat16> {
    static constexpr uint32_t PER_PACK = 8;
    __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
    __device__ static float2 widen(uint32_t w) {
        return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    }
};

// The low-latency protocol's "not yet arrived" sentinel is an all-ones 32-bit word (the
// readers check 32-bit words). A data word whose bits are all ones — an all-ones f32 NaN, or
// two all-ones 16-bit NaNs side by side — is sent with its lowest bit cleared: the f32 NaN one
// below it, or the first of the two 16-bit NaNs as the NaN one below it. No data word is then
// all ones; ±0, every number, every other NaN and every other word keep their bits. The sum
// is a NaN either way (fp32 addition returns the canonical NaN), so every algorithm still
// gives the same bits; a rank's own contribution is never rewritten. One test per word: the
// push's critical path feels every instruction (docs/design.md).
__device__ __forceinline__ uint32_t wire_word(uint32_t w) {
    return w == 0xffffffffu ? 0xfffffffeu : w;
}

__device__ __forceinline__ uint4 wire_pack(uint4 v) {
    return make_uint4(wire_word(v.x), wire_word(v.y), wire_word(v.z), wire_word(v.w));
}

template <typename T>
union Pack {
    uint4 bits;
    T elems[Elem<T>::PER_PACK];
};

// The elements of a 32-bit word in fp32 (`to_float` of each, in order), and back (each
// rounded once with `from_float`).
template <typename T>
__device__ __forceinline__ void word_to_float(uint32_t w, float (&x)[4 / sizeof(T)]) {
    if constexpr (sizeof(T) == 4) {
        x[0] = __uint_as_float(w);
    } else {
        const float2 v = Elem<T>::widen(w);
        x[0] = v.x;
        x[1] = v.y;
    }
}

template <typename T>
__device__ __forceinline__ uint32_t float_to_word(const float (&x)[4 / sizeof(T)]) {
    union {
        uint32_t bits;
        T elems[4 / sizeof(T)];
    } r;
#pragma unroll
    for (uint32_t e = 0; e < 4 / sizeof(T); ++e) r.elems[e] = Elem<T>::from_float(x[e]);
    return r.bits;
}

// The elements of a pack in fp32 (`to_float` of each, in order).
template <typename T>
__device__ __forceinline__ void pack_to_float(uint4 bits, float (&x)[Elem<T>::PER_PACK]) {
    constexpr uint32_t PER_WORD = 4 / sizeof(T);
    const uint32_t w[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) {
        float v[PER_WORD];
        word_to_float<T>(w[i], v);
#pragma unroll
        for (uint32_t e = 0; e < PER_WORD; ++e) x[PER_WORD * i + e] = v[e];
    }
}

template <typename T>
__device__ __forceinline__ void add_pack(uint4 bits, float (&acc)[Elem<T>::PER_PACK]) {
    float x[Elem<T>::PER_PACK];
    pack_to_float<T>(bits, x);
#pragma unroll
    for (uint32_t i = 0; i < Elem<T>::PER_PACK; ++i) acc[i] += x[i];
}

template <typename T>
__device__ __forceinline__ uint4 float_to_pack(const float (&acc)[Elem<T>::PER_PACK]) {
    Pack<T> p;
#pragma unroll
    for (uint32_t i = 0; i < Elem<T>::PER_PACK; ++i) p.elems[i] = Elem<T>::from_float(acc[i]);
    return p.bits;
}

}  // namespace symm
