// The reduction every algorithm shares: all W loads in flight, then fp32 sums in absolute
// rank order 0..W-1, rounded once. The same arithmetic everywhere is why every algorithm
// gives the same bits.
#pragma once

#include "elements.cuh"
#include "memory.cuh"
#include "signals.cuh"

namespace symm {

// Packs `v[0..world)` (one per rank, world <= R) summed in fp32 in rank order, rounded once.
template <typename T, uint32_t R>
__device__ __forceinline__ uint4 sum_in_rank_order(const SymmArgs& a, const uint4 (&v)[R]) {
    float acc[Elem<T>::PER_PACK];
    pack_to_float<T>(v[0], acc);
#pragma unroll
    for (uint32_t q = 1; q < R; ++q) {
        if (q < a.world) add_pack<T>(v[q], acc);
    }
    return float_to_pack<T>(acc);
}

// `pack` of rank 0's data buffer is at `rank0 + 16 * pack`; rank q's is `q * stride` further.
// Every peer's load is issued before the first add.
template <typename T>
__device__ __forceinline__ uint4 sum_ranks(const SymmArgs& a, const char* rank0, uint64_t pack) {
    const char* p = rank0 + pack * sizeof(uint4);
    uint4 v[MAX_RANKS];
#pragma unroll
    for (uint32_t q = 0; q < MAX_RANKS; ++q) {
        if (q < a.world) v[q] = load_peer_pack(reinterpret_cast<const uint4*>(p + q * a.stride));
    }
    return sum_in_rank_order<T, MAX_RANKS>(a, v);
}

// The n % PER_PACK trailing elements: block 0 copies them in before the start barrier and
// sums them (scalar, same order) after it.
template <typename T>
__device__ __forceinline__ void copy_tail_in(const SymmArgs& a, uint32_t parity, const T* in, uint64_t n) {
    const uint64_t start = n - n % Elem<T>::PER_PACK;
    if (blockIdx.x == 0 && start + threadIdx.x < n) {
        reinterpret_cast<T*>(data_buffer(a, a.rank, parity))[start + threadIdx.x] = in[start + threadIdx.x];
    }
}

template <typename T>
__device__ __forceinline__ void sum_tail(const SymmArgs& a, uint32_t parity, T* out, uint64_t n) {
    const uint64_t i = n - n % Elem<T>::PER_PACK + threadIdx.x;
    if (blockIdx.x == 0 && i < n) {
        float acc = 0.0f;
        for (uint32_t q = 0; q < a.world; ++q) {
            const T x = __ldcg(reinterpret_cast<const T*>(data_buffer(a, q, parity)) + i);
            acc = q == 0 ? Elem<T>::to_float(x) : acc + Elem<T>::to_float(x);
        }
        out[i] = Elem<T>::from_float(acc);
    }
}

}  // namespace symm
