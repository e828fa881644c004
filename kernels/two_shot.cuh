// Two-shot all-reduce over peer pointers: reduce-scatter, then all-gather.
#pragma once

#include "reduce.cuh"
#include "unaligned.cuh"

namespace symm {

// Two-shot: copy in the peers' slices, start barrier, reduce-scatter (rank r reduces slice r,
// its own part straight from its input, and keeps the result in its own data buffer), middle
// barrier (release/acquire publishes the reduced slices), all-gather of every peer's reduced
// slice.
template <typename T>
__device__ __forceinline__ void two_shot(const T* in, T* out, uint64_t n, const SymmArgs& a) {
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint32_t parity = epoch & 1;
    const uint64_t packs = n / Elem<T>::PER_PACK;
    const uint64_t slice = (packs + a.world - 1) / a.world;
    const PackLoop loop;
    const bool in_aligned = is_aligned(in, 16), out_aligned = is_aligned(out, 16);
    uint4* mine = reinterpret_cast<uint4*>(data_buffer(a, a.rank, parity));
    const char* rank0 = data_buffer(a, 0, parity);

    // Copy in with the slice-relative pattern: block b writes, in every peer's slice, the packs
    // that block b of the slice's owner reduces after the start barrier — all W - 1 loads in
    // flight before the first store. This rank's own slice is not copied: only this rank reads
    // it, from its input.
    for (uint64_t i = loop.first; i < slice; i += loop.step) {
        uint4 v[MAX_RANKS];
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (q < a.world && q != a.rank && q * slice + i < packs) v[q] = load_pack(in, q * slice + i, in_aligned);
        }
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (q < a.world && q != a.rank && q * slice + i < packs) mine[q * slice + i] = v[q];
        }
    }
    copy_tail_in(a, parity, in, n);

    if (!block_barrier_arrive(a, PHASE_START, epoch)) return;
    for (uint64_t i = loop.first; i < slice; i += loop.step) {
        const uint64_t p = a.rank * slice + i;
        if (p < packs) {
            const uint4 r = sum_ranks_own<T>(a, rank0, p, load_pack(in, p, in_aligned));
            if (a.world > 1) mine[p] = r;
            store_pack(out, p, r, out_aligned);
        }
    }
    sum_tail(a, parity, out, n);
    if (a.world == 1) return;

    if (block_barrier(a, PHASE_MIDDLE, epoch)) {
        pdl_launch_dependents();
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
}

}  // namespace symm
