// One-shot all-reduce over peer pointers: one barrier, every rank reads every rank.
#pragma once

#include "reduce.cuh"
#include "unaligned.cuh"

namespace symm {

// One-shot: copy in, start barrier, every rank reads every rank's whole buffer. The block's
// arrival (the grid-wide call count) rides in the start barrier, so the kernel ends with its
// last store.
template <typename T>
__device__ __forceinline__ void one_shot(const T* in, T* out, uint64_t n, const SymmArgs& a) {
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint32_t parity = epoch & 1;
    const uint64_t packs = n / Elem<T>::PER_PACK;
    const PackLoop loop;
    // A view at any element offset: packs of unaligned buffers are assembled from elements
    // (uniform over the grid; same bits).
    const bool in_aligned = is_aligned(in, 16), out_aligned = is_aligned(out, 16);
    uint4* mine = reinterpret_cast<uint4*>(data_buffer(a, a.rank, parity));
    const char* rank0 = data_buffer(a, 0, parity);

    for (uint64_t i = loop.first; i < packs; i += loop.step) mine[i] = load_pack(in, i, in_aligned);
    copy_tail_in(a, parity, in, n);

    if (block_barrier_arrive(a, PHASE_START, epoch)) {
        pdl_launch_dependents();
        for (uint64_t i = loop.first; i < packs; i += loop.step)
            store_pack(out, i, sum_ranks<T>(a, rank0, i), out_aligned);
        sum_tail(a, parity, out, n);
    }
}

}  // namespace symm
