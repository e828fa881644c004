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

template <>
struct Elem<__half> {
    static constexpr uint32_t PER_PACK = 8;
    __device__ static float to_float(__half x) { return __half2float(x); }
    __device__ static __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Elem<__nv_bfloat16> {
    static constexpr uint32_t PER_PACK = 8;
    __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// The low-latency protocol's "not yet arrived" sentinel is an all-ones word. An element whose
// bits are all ones (a NaN in every dtype here) is sent as the NaN one below it, so no word
// of real data is ever all ones; ±0, every number and every other NaN keep their bits. The
// sum is a NaN either way (fp32 addition returns the canonical NaN), so every algorithm still
// gives the same bits; a rank's own contribution is never rewritten.
template <typename T>
__device__ __forceinline__ uint32_t wire_word(uint32_t w) {
    if (sizeof(T) == 4) return w == 0xffffffffu ? 0xfffffffeu : w;
    if ((w & 0xffffu) == 0xffffu) w ^= 0x1u;
    if ((w >> 16) == 0xffffu) w ^= 0x10000u;
    return w;
}

template <typename T>
__device__ __forceinline__ uint4 wire_pack(uint4 v) {
    return make_uint4(wire_word<T>(v.x), wire_word<T>(v.y), wire_word<T>(v.z), wire_word<T>(v.w));
}

template <typename T>
union Pack {
    uint4 bits;
    T elems[Elem<T>::PER_PACK];
};

template <typename T>
__device__ __forceinline__ void pack_to_float(uint4 bits, float (&acc)[Elem<T>::PER_PACK]) {
    Pack<T> p;
    p.bits = bits;
#pragma unroll
    for (uint32_t i = 0; i < Elem<T>::PER_PACK; ++i) acc[i] = Elem<T>::to_float(p.elems[i]);
}

template <typename T>
__device__ __forceinline__ void add_pack(uint4 bits, float (&acc)[Elem<T>::PER_PACK]) {
    Pack<T> p;
    p.bits = bits;
#pragma unroll
    for (uint32_t i = 0; i < Elem<T>::PER_PACK; ++i) acc[i] += Elem<T>::to_float(p.elems[i]);
}

template <typename T>
__device__ __forceinline__ uint4 float_to_pack(const float (&acc)[Elem<T>::PER_PACK]) {
    Pack<T> p;
#pragma unroll
    for (uint32_t i = 0; i < Elem<T>::PER_PACK; ++i) p.elems[i] = Elem<T>::from_float(acc[i]);
    return p.bits;
}

}  // namespace symm
