// Zero-copy in-place all-reduce of a buffer that lies at the same offset of every rank's
// allocation (a pool buffer, or the legacy symmetric buffer), written over a collective policy
// (coll.cuh): the same body runs with peer pointers today and with multimem next to it. The
// buffer is found from this rank's pointer `buf`; the pool tags (pool.cuh) are compared after
// the start barrier, before any data is read.
#pragma once

#include "coll.cuh"
#include "pool.cuh"

namespace symm {

// Every rank reduces its slice from every rank's buffer and writes the sum into that slice of
// every rank's buffer (its own included). Nobody else reads slice r, so the pushes race with
// nothing; the end barrier (release/acquire) makes every peer's pushes into this rank's buffer
// visible before the kernel ends, and tells the peers this rank has stopped reading theirs, so
// the caller may overwrite the buffer after the call. The tail is summed into registers before
// the end barrier and written after it.
template <typename Coll, typename T>
__device__ __forceinline__ void in_place(const T* buf, uint64_t n, const SymmArgs& a) {
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint32_t parity = static_cast<uint32_t>(epoch & 1);
    const uint64_t packs = n / Elem<T>::PER_PACK;
    const uint64_t slice = (packs + a.world - 1) / a.world;
    const PackLoop loop;
    const Coll coll(a, pool_offset(a, buf));

    pool_publish(a, parity);
    bool ok = coll.barrier(PHASE_START, epoch) && pool_agree(a, parity);
    float tail = 0.0f;
    const uint64_t tail_index = packs * Elem<T>::PER_PACK + threadIdx.x;
    const bool has_tail = blockIdx.x == 0 && tail_index < n;
    if (ok) {
        pdl_trigger(a);
        for (uint64_t i = loop.first; i < slice; i += loop.step) {
            const uint64_t p = a.rank * slice + i;
            if (p < packs) coll.broadcast_store(p, coll.template load_reduce<T>(p));
        }
        if (has_tail) tail = coll.template load_reduce_element<T>(tail_index);
        ok = coll.barrier(PHASE_END, epoch);
    }
    if (ok && has_tail) reinterpret_cast<T*>(coll.buffer(a.rank))[tail_index] = Elem<T>::from_float(tail);
    end_call(a, epoch);
}

}  // namespace symm
