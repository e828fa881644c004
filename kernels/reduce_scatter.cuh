// Reduce-scatter over peer pointers, one-shot: every rank copies its whole input (W slices of
// n elements) into its data buffer, passes one start barrier, then reduces its own slice from
// every rank with `sum_ranks` (fp32 in absolute rank order 0..W-1, rounded once): exactly the
// arithmetic of the all-reduce kernels, so rank r's output has the bits of elements
// [r n, (r + 1) n) of an all-reduce of the same inputs.
//
// In the data buffer slice q starts at q * slice_bytes (n elements rounded up to 16 bytes), so
// every slice is pack-aligned even when n is not a multiple of a pack. Copy-in and reduce walk
// the same slice-relative PackLoop: block b writes, in every slice, the packs that block b of
// the slice's owner reduces after the barrier; block 0 does the scalar tails of every slice.
#pragma once

#include "reduce.cuh"
#include "unaligned.cuh"

namespace symm {

// P elements starting at `src` (element-aligned only) as one pack.
template <typename T>
__device__ __forceinline__ uint4 load_pack_unaligned(const T* src) {
    Pack<T> p;
#pragma unroll
    for (uint32_t k = 0; k < Elem<T>::PER_PACK; ++k) p.elems[k] = src[k];
    return p.bits;
}

template <typename T>
__device__ __forceinline__ void reduce_scatter(const T* in, T* out, uint64_t n, const SymmArgs& a) {
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint32_t parity = static_cast<uint32_t>(epoch & 1);
    constexpr uint32_t P = Elem<T>::PER_PACK;
    const uint64_t packs = n / P;
    const uint32_t tail = static_cast<uint32_t>(n % P);
    const uint64_t slice_bytes = (n * sizeof(T) + 15) / 16 * 16;
    const PackLoop loop;
    char* mine = data_buffer(a, a.rank, parity);

    if (tail == 0 && is_aligned(in, 16)) {
        // Every slice of the input is 16-byte aligned: all W packs in flight, then stored.
        for (uint64_t i = loop.first; i < packs; i += loop.step) {
            uint4 v[MAX_RANKS];
#pragma unroll
            for (uint32_t q = 0; q < MAX_RANKS; ++q) {
                if (q < a.world) v[q] = reinterpret_cast<const uint4*>(in + q * n)[i];
            }
#pragma unroll
            for (uint32_t q = 0; q < MAX_RANKS; ++q) {
                if (q < a.world) reinterpret_cast<uint4*>(mine + q * slice_bytes)[i] = v[q];
            }
        }
    } else {
        // Slices start at element (not pack) boundaries, or the input is a view at an element
        // offset: packs assembled from element loads.
        for (uint64_t i = loop.first; i < packs; i += loop.step) {
            for (uint32_t q = 0; q < a.world; ++q) {
                reinterpret_cast<uint4*>(mine + q * slice_bytes)[i] = load_pack_unaligned<T>(in + q * n + i * P);
            }
        }
    }
    if (blockIdx.x == 0) {
        const uint32_t q = threadIdx.x / P;
        const uint32_t k = threadIdx.x % P;
        if (q < a.world && k < tail) reinterpret_cast<T*>(mine + q * slice_bytes)[packs * P + k] = in[q * n + packs * P + k];
    }

    if (block_barrier(a, PHASE_START, epoch)) {
        pdl_trigger(a);
        const char* rank0 = data_buffer(a, 0, parity) + a.rank * slice_bytes;
        const bool out_aligned = is_aligned(out, 16);
        for (uint64_t i = loop.first; i < packs; i += loop.step) store_pack(out, i, sum_ranks<T>(a, rank0, i), out_aligned);
        if (blockIdx.x == 0 && threadIdx.x < tail) {
            const uint64_t i = packs * P + threadIdx.x;
            float acc = 0.0f;
            for (uint32_t q = 0; q < a.world; ++q) {
                const T x = __ldcg(reinterpret_cast<const T*>(rank0 + q * a.stride) + i);
                acc = q == 0 ? Elem<T>::to_float(x) : acc + Elem<T>::to_float(x);
            }
            out[i] = Elem<T>::from_float(acc);
        }
    }
    end_call(a, epoch);
}

}  // namespace symm
