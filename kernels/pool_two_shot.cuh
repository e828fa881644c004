// Zero-copy out-of-place two-shot: the input is a pool buffer (the same offset of every
// rank's allocation), so nothing is copied in. Start barrier (and the pool-tag check of
// pool.cuh), reduce-scatter straight from every rank's copy of the input (rank r reduces
// slice r into its output and its data buffer of the call's parity), middle barrier, gather
// of every peer's reduced slice from its data buffer. A peer reads this rank's input only
// between its start and middle barriers, so when this kernel ends (its blocks passed the
// middle barrier of every peer's same-index block) nobody reads the input any more and the
// caller may overwrite it. The data buffers alternate by parity as in two_shot.cuh.
#pragma once

#include "pool.cuh"
#include "reduce.cuh"
#include "unaligned.cuh"

namespace symm {

template <typename T>
__device__ __forceinline__ void pool_two_shot(const T* in, T* out, uint64_t n, const SymmArgs& a) {
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint32_t parity = static_cast<uint32_t>(epoch & 1);
    const uint64_t packs = n / Elem<T>::PER_PACK;
    const uint64_t slice = (packs + a.world - 1) / a.world;
    const PackLoop loop;
    const bool out_aligned = is_aligned(out, 16);
    const char* src0 = rank_alloc(a, 0) + pool_offset(a, in);  // rank 0's copy of the input
    uint4* mine = reinterpret_cast<uint4*>(data_buffer(a, a.rank, parity));
    const char* rank0 = data_buffer(a, 0, parity);

    pool_publish(a, parity);
    if (!block_barrier(a, PHASE_START, epoch) || !pool_agree(a, parity)) {
        end_call(a, epoch);
        return;
    }
    pdl_trigger(a);
    for (uint64_t i = loop.first; i < slice; i += loop.step) {
        const uint64_t p = a.rank * slice + i;
        if (p < packs) {
            const uint4 r = sum_ranks<T>(a, src0, p);
            mine[p] = r;
            store_pack(out, p, r, out_aligned);
        }
    }
    // The n % PER_PACK trailing elements: block 0 of every rank sums them from every input.
    const uint64_t t = packs * Elem<T>::PER_PACK + threadIdx.x;
    if (blockIdx.x == 0 && t < n) {
        float acc = 0.0f;
        for (uint32_t q = 0; q < a.world; ++q) {
            const float x = Elem<T>::to_float(__ldcg(reinterpret_cast<const T*>(src0 + q * a.stride) + t));
            acc = q == 0 ? x : acc + x;
        }
        out[t] = Elem<T>::from_float(acc);
    }

    if (block_barrier(a, PHASE_MIDDLE, epoch)) {
        for (uint64_t i = loop.first; i < slice; i += loop.step) {
            uint4 v[MAX_RANKS];
#pragma unroll
            for (uint32_t q = 0; q < MAX_RANKS; ++q) {
                const uint64_t p = q * slice + i;
                if (q < a.world && q != a.rank && p < packs)
                    v[q] = load_peer_pack(reinterpret_cast<const uint4*>(rank0 + q * a.stride) + p);
            }
#pragma unroll
            for (uint32_t q = 0; q < MAX_RANKS; ++q) {
                const uint64_t p = q * slice + i;
                if (q < a.world && q != a.rank && p < packs) store_pack(out, p, v[q], out_aligned);
            }
        }
    }
    end_call(a, epoch);
}

}  // namespace symm
