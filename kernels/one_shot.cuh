// One-shot all-reduce, written over a collective policy (coll.cuh): one barrier, then every
// rank reduces the whole message from every rank's copy. With `UnicastColl` it reads every
// peer's data buffer and sums in rank order; with `MultimemColl` (multimem.cu) one
// `multimem.ld_reduce` per pack returns the switch's sum.
#pragma once

#include "coll.cuh"
#include "unaligned.cuh"

namespace symm {

// Copy in (into this rank's data buffer of the call's parity), start barrier, every rank
// reduces every pack and the scalar tail into its output. The block publishes the call
// (`publish`) inside the start barrier, so the kernel ends with its last store; the data
// buffer is rewritten two calls later, after every peer has entered the call in between,
// which it does only after this call's kernel completed there (signals.cuh).
template <typename Coll, typename T>
__device__ __forceinline__ void one_shot(const T* in, T* out, uint64_t n, const SymmArgs& a) {
    const uint64_t packs = n / Elem<T>::PER_PACK;
    const PackLoop loop;
    // A view at any element offset: packs of unaligned buffers are assembled from elements
    // (uniform over the grid; same bits).
    const bool in_aligned = is_aligned(in, 16), out_aligned = is_aligned(out, 16);
    // This thread's first pack, loaded while `begin_call` reads the call state.
    uint4 first = make_uint4(0, 0, 0, 0);
    const auto prefetch = [&] {
        if (loop.first < packs) first = load_pack(in, loop.first, in_aligned);
    };
    const uint64_t epoch = begin_call(a, prefetch);
    if (epoch == 0) return;
    const uint32_t parity = epoch & 1;
    const Coll coll(a, a.data_offset + parity * a.data_bytes);
    uint4* mine = reinterpret_cast<uint4*>(coll.buffer(a.rank));

    if (loop.first < packs) mine[loop.first] = first;
    for (uint64_t i = loop.first + loop.step; i < packs; i += loop.step) mine[i] = load_pack(in, i, in_aligned);
    copy_tail_in(a, parity, in, n);

    if (coll.barrier_arrive(PHASE_START, epoch)) {
        pdl_trigger(a);
        for (uint64_t i = loop.first; i < packs; i += loop.step)
            store_pack(out, i, coll.template load_reduce<T>(i), out_aligned);
        const uint64_t tail = packs * Elem<T>::PER_PACK + threadIdx.x;
        if (blockIdx.x == 0 && tail < n) out[tail] = Elem<T>::from_float(coll.template load_reduce_element<T>(tail));
    }
}

}  // namespace symm
