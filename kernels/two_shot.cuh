// Two-shot all-reduce over peer pointers: reduce-scatter, then all-gather.
#pragma once

#include "reduce.cuh"
#include "unaligned.cuh"

namespace symm {

// Two-shot: copy in the peers' slices, start barrier, reduce-scatter (rank r reduces slice r,
// its own part straight from its input, and keeps the result in its own data buffer), middle
// barrier (release/acquire publishes the reduced slices), all-gather of every peer's reduced
// slice.
//
// Loads in flight: every phase issues all its loads for U iterations of the loop before the
// first store or add (R = a bound on the world size, known at compile time). A thread then
// has R·U = 8 16-byte loads in flight, a lone rank (one pass from input to output) too: 12 or
// 16 spill at 128 registers (tests/kernel_code.rs refuses any spill); with one iteration at a
// time a lone rank had one, and moved 64 MiB at 0.13× copy speed. Unrolling keeps the index pattern: a thread handles
// the same packs as the plain PackLoop, only U of them at once.
template <typename T, uint32_t R, uint32_t U>
__device__ __forceinline__ void two_shot_body(const T* in, T* out, uint64_t n, const SymmArgs& a, uint64_t epoch) {
    const uint32_t parity = epoch & 1;
    const uint64_t packs = n / Elem<T>::PER_PACK;
    const uint64_t slice = (packs + a.world - 1) / a.world;
    const PackLoop loop;
    const bool in_aligned = is_aligned(in, 16), out_aligned = is_aligned(out, 16);
    uint4* mine = reinterpret_cast<uint4*>(data_buffer(a, a.rank, parity));
    const char* rank0 = data_buffer(a, 0, parity);
    // Pack i of rank q's slice, when rank q exists and the pack is inside the message.
    const auto in_slice = [&](uint32_t q, uint64_t i) { return q < a.world && i < slice && q * slice + i < packs; };

    // Copy in with the slice-relative pattern: block b writes, in every peer's slice, the packs
    // that block b of the slice's owner reduces after the start barrier. This rank's own slice
    // is not copied: only this rank reads it, from its input.
    for (uint64_t i0 = loop.first; i0 < slice; i0 += U * loop.step) {
        uint4 v[U][R];
#pragma unroll
        for (uint32_t u = 0; u < U; ++u) {
            const uint64_t i = i0 + u * loop.step;
#pragma unroll
            for (uint32_t q = 0; q < R; ++q) {
                if (q != a.rank && in_slice(q, i)) v[u][q] = load_pack(in, q * slice + i, in_aligned);
            }
        }
#pragma unroll
        for (uint32_t u = 0; u < U; ++u) {
            const uint64_t i = i0 + u * loop.step;
#pragma unroll
            for (uint32_t q = 0; q < R; ++q) {
                if (q != a.rank && in_slice(q, i)) mine[q * slice + i] = v[u][q];
            }
        }
    }
    copy_tail_in(a, parity, in, n);

    if (!block_barrier_arrive(a, PHASE_START, epoch)) return;
    pdl_trigger(a);
    for (uint64_t i0 = loop.first; i0 < slice; i0 += U * loop.step) {
        uint4 v[U][R];
#pragma unroll
        for (uint32_t u = 0; u < U; ++u) {
            const uint64_t p = a.rank * slice + i0 + u * loop.step;
#pragma unroll
            for (uint32_t q = 0; q < R; ++q) {
                if (in_slice(a.rank, i0 + u * loop.step) && q < a.world)
                    v[u][q] = q == a.rank ? load_pack(in, p, in_aligned)
                                          : load_peer_pack(reinterpret_cast<const uint4*>(rank0 + q * a.stride) + p);
            }
        }
#pragma unroll
        for (uint32_t u = 0; u < U; ++u) {
            const uint64_t p = a.rank * slice + i0 + u * loop.step;
            if (in_slice(a.rank, i0 + u * loop.step)) {
                const uint4 r = sum_in_rank_order<T, R>(a, v[u]);
                if (a.world > 1) mine[p] = r;
                store_pack(out, p, r, out_aligned);
            }
        }
    }
    sum_tail(a, parity, out, n);
    if (a.world == 1) return;

    if (block_barrier(a, PHASE_MIDDLE, epoch)) {
        for (uint64_t i0 = loop.first; i0 < slice; i0 += U * loop.step) {
            uint4 v[U][R];
#pragma unroll
            for (uint32_t u = 0; u < U; ++u) {
                const uint64_t i = i0 + u * loop.step;
#pragma unroll
                for (uint32_t q = 0; q < R; ++q) {
                    if (q != a.rank && in_slice(q, i))
                        v[u][q] = load_peer_pack(reinterpret_cast<const uint4*>(rank0 + q * a.stride) + q * slice + i);
                }
            }
#pragma unroll
            for (uint32_t u = 0; u < U; ++u) {
                const uint64_t i = i0 + u * loop.step;
#pragma unroll
                for (uint32_t q = 0; q < R; ++q) {
                    if (q != a.rank && in_slice(q, i)) store_pack(out, q * slice + i, v[u][q], out_aligned);
                }
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void two_shot(const T* in, T* out, uint64_t n, const SymmArgs& a) {
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    if (a.world == 1) {
        two_shot_body<T, 1, 8>(in, out, n, a, epoch);
    } else if (a.world == 2) {
        two_shot_body<T, 2, 4>(in, out, n, a, epoch);
    } else if (a.world <= 4) {
        two_shot_body<T, 4, 2>(in, out, n, a, epoch);
    } else {
        two_shot_body<T, MAX_RANKS, 1>(in, out, n, a, epoch);
    }
}

}  // namespace symm
