// One-shot all-reduce over peer pointers: one barrier, every rank reads every rank.
#pragma once

#include "reduce.cuh"
#include "unaligned.cuh"

namespace symm {

// One-shot: copy in, start barrier, every rank reads every rank's whole buffer.
template <typename T>
__device__ __forceinline__ void one_shot(const T* in, T* out, uint64_t n, const SymmArgs& a) {
    const uint64_t packs = n / Elem<T>::PER_PACK;
    const PackLoop loop;
    const bool in_aligned = is_aligned(in, 16), out_aligned = is_aligned(out, 16);
    // Start this thread's first input load before reading the epoch: the two latencies overlap.
    const uint4 first = loop.first < packs ? load_pack(in, loop.first, in_aligned) : make_uint4(0, 0, 0, 0);
    const uint32_t epoch = begin_call(a);
    const uint32_t parity = epoch & 1;
    uint4* mine = reinterpret_cast<uint4*>(data_buffer(a, a.rank, parity));
    const char* rank0 = data_buffer(a, 0, parity);

    if (loop.first < packs) mine[loop.first] = first;
    for (uint64_t i = loop.first + loop.step; i < packs; i += loop.step) mine[i] = load_pack(in, i, in_aligned);
    copy_tail_in(a, parity, in, n);

    if (block_barrier(a, PHASE_START, epoch)) {
        for (uint64_t i = loop.first; i < packs; i += loop.step) store_pack(out, i, sum_ranks<T>(a, rank0, i), out_aligned);
        sum_tail(a, parity, out, n);
    }
    end_call(a, epoch);
}

}  // namespace symm
