// Collective policies: how a kernel body reduces from, stores to and synchronises with every
// rank. A kernel written over `Coll` runs unchanged on any policy. `UnicastColl` reaches the
// peers through their mapped copies of the buffer (peer pointers; a data buffer, a pool buffer
// or the legacy symmetric buffer lies at the same offset of every rank's allocation).
// `MultimemColl` (multimem.cuh, sm_90 only) is the NVLS policy beside it: `load_reduce` as one
// `multimem.ld_reduce...add.acc::f32` on the multicast address, `broadcast_store` and
// `broadcast_line` and `broadcast_word` as one `multimem.st`, the barriers by `multimem.red.release.sys` on a
// multicast counter (docs/multicast.md).
//
// The policy methods:
//  * load_reduce<T>(pack), load_reduce_element<T>(i): pack / element of every rank's buffer, summed;
//  * broadcast_store(pack, v): v into every rank's buffer;
//  * broadcast_line(buffer, line, words): a low-latency line into this rank's slot of every
//    peer's low-latency buffer (the buffer's offset is not used);
//  * broadcast_word(buffer, i, wire): word i of the low-latency lines, likewise (the
//    low-latency all-reduce's word-per-thread path, `WORDS`);
//  * barrier(phase, epoch), barrier_arrive(phase, epoch): the per-block barrier between ranks,
//    the second also counting the block's arrival for the call (a kernel without end_call).
#pragma once

#include "reduce.cuh"

// A marker in the PTX (an inline-asm comment survives into it) at the top of each policy
// method, so a CPU test can check that the unicast and the multimem instantiations of one
// kernel body call the policy in the same order (tests/multimem_code.rs).
#define SYMM_POLICY_MARK(WHAT) asm volatile("// symm-policy: " WHAT)

namespace symm {

struct UnicastColl {
    // The low-latency all-reduce moves one 32-bit word per thread (`ll_all_reduce_word`).
    static constexpr bool WORDS = true;
    const SymmArgs& a;
    char* rank0;  // rank 0's copy of the buffer; rank q's is q * stride further

    // `offset`: where the buffer lies in every rank's allocation (a pool buffer, or the
    // legacy symmetric buffer).
    __device__ UnicastColl(const SymmArgs& args, uint64_t offset) : a(args), rank0(rank_alloc(args, 0) + offset) {}

    // Rank q's copy of the buffer.
    __device__ __forceinline__ char* buffer(uint32_t q) const { return rank0 + q * a.stride; }

    // Pack `pack` of every rank's symmetric buffer, summed in rank order.
    template <typename T>
    __device__ __forceinline__ uint4 load_reduce(uint64_t pack) const {
        SYMM_POLICY_MARK("load_reduce");
        return sum_ranks<T>(a, rank0, pack);
    }

    // Element `i` of every rank's symmetric buffer, summed in rank order (the scalar tail).
    template <typename T>
    __device__ __forceinline__ float load_reduce_element(uint64_t i) const {
        SYMM_POLICY_MARK("load_reduce_element");
        float acc = 0.0f;
        for (uint32_t q = 0; q < a.world; ++q) {
            const float x = Elem<T>::to_float(__ldcg(reinterpret_cast<const T*>(buffer(q)) + i));
            acc = q == 0 ? x : acc + x;
        }
        return acc;
    }

    // Stores `v` as pack `pack` of every rank's symmetric buffer.
    __device__ __forceinline__ void broadcast_store(uint64_t pack, uint4 v) const {
        SYMM_POLICY_MARK("broadcast_store");
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (q < a.world) reinterpret_cast<uint4*>(buffer(q))[pack] = v;
        }
    }

    // Line `line` (two 64-bit words) into this rank's slot of low-latency buffer `buffer` of
    // every peer: W - 1 stores. This rank's own slot is not written (its contribution comes
    // from its input).
    __device__ __forceinline__ void broadcast_line(uint32_t buffer, uint64_t line, ulonglong2 words) const {
        SYMM_POLICY_MARK("broadcast_line");
        char* rank0_slot = reinterpret_cast<char*>(ll_line(a, 0, buffer, a.rank, line));
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (q < a.world && q != a.rank) st_line_sys(reinterpret_cast<ulonglong2*>(rank0_slot + q * a.stride), words);
        }
    }

    // Word `i` of the low-latency lines (`ll_all_reduce_word`) into this rank's slot of
    // low-latency buffer `buffer` of every peer: W - 1 single-copy-atomic 32-bit stores. This
    // rank's own slot is not written.
    __device__ __forceinline__ void broadcast_word(uint32_t buffer, uint64_t i, uint32_t wire) const {
        SYMM_POLICY_MARK("broadcast_word");
        char* rank0_slot = reinterpret_cast<char*>(ll_word(a, 0, buffer, a.rank, i));
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (q < a.world && q != a.rank) st_relaxed_sys_u32(reinterpret_cast<uint32_t*>(rank0_slot + q * a.stride), wire);
        }
    }

    // Barrier between block blockIdx.x of every rank (false if a wait timed out).
    __device__ __forceinline__ bool barrier(uint32_t phase, uint64_t epoch) const {
        SYMM_POLICY_MARK("barrier");
        return block_barrier(a, phase, epoch);
    }

    // The same, counting the block's arrival for the call off the critical path.
    __device__ __forceinline__ bool barrier_arrive(uint32_t phase, uint64_t epoch) const {
        SYMM_POLICY_MARK("barrier_arrive");
        return block_barrier_arrive(a, phase, epoch);
    }
};

}  // namespace symm
