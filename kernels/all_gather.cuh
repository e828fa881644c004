// All-gather (and all-gather-v) over peer pointers, byte-typed: every rank copies its chunk
// into its own data buffer, passes one start barrier, then reads every peer's chunk
// (one-shot: each rank reads each peer's bytes exactly once, the bandwidth optimum).
//
// Counts check: before the barrier, block b of every rank publishes the whole per-rank byte
// counts it was called with into its slot b at the end of its data buffer; after the
// barrier, block b compares every peer's slot b with its own counts. Any difference is
// reported on every rank (each rank's counts differ from some peer's, or all agree) as
// ERROR_COUNTS_MISMATCH, and no peer data is read. The slots live in the parity data buffer,
// so they are reused under the same two-calls-later rule as the data (signals.cuh).
#pragma once

#include "signals.cuh"

namespace symm {

// Per-rank byte counts; mirrors `GatherCounts` in src/kernels/coll.rs.
struct GatherCounts {
    uint64_t bytes[MAX_RANKS];
};

static_assert(sizeof(GatherCounts) == 64, "GatherCounts: eight u64, as in src/kernels/coll.rs");

// Error word kind for counts that disagree across ranks (kind | phase << 8 | peer << 16).
constexpr uint32_t ERROR_COUNTS_MISMATCH = 3;
// Bytes at the end of each parity data buffer that hold the counts slots: [block][MAX_RANKS] u64.
constexpr uint64_t COUNT_SLOTS_BYTES = 4096;

static_assert(COUNT_SLOTS_BYTES == MAX_BLOCKS * sizeof(GatherCounts), "one counts slot per block");

__device__ __forceinline__ uint64_t* count_slot(const SymmArgs& a, uint32_t owner, uint32_t parity,
                                                uint32_t block) {
    char* slots = data_buffer(a, owner, parity) + a.data_bytes - COUNT_SLOTS_BYTES;
    return reinterpret_cast<uint64_t*>(slots) + static_cast<uint64_t>(block) * MAX_RANKS;
}

// Largest power of two (at most 16) that divides `offset` (an address): the widest access it
// allows.
__device__ __forceinline__ uint32_t alignment_of(uint64_t offset) {
    const uint64_t low = offset & (~offset + 1);
    return (offset == 0 || low >= 16) ? 16u : static_cast<uint32_t>(low);
}

// The 16 bytes at `src`, which is aligned to `align` bytes (a power of two up to 16): the
// widest loads that alignment allows.
__device__ __forceinline__ uint4 load_pack_at(const char* src, uint32_t align) {
    if (align == 16) return *reinterpret_cast<const uint4*>(src);
    uint32_t w[4];
    if (align >= 4) {
#pragma unroll
        for (uint32_t k = 0; k < 4; ++k) w[k] = reinterpret_cast<const uint32_t*>(src)[k];
    } else {
#pragma unroll
        for (uint32_t k = 0; k < 4; ++k) {
            w[k] = 0;
#pragma unroll
            for (uint32_t b = 0; b < 4; ++b) w[k] |= static_cast<uint32_t>(static_cast<uint8_t>(src[4 * k + b])) << (8 * b);
        }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Stores the 16 bytes of `v` at `dst`, which is aligned to `align` bytes.
__device__ __forceinline__ void store_pack_at(char* dst, uint4 v, uint32_t align) {
    if (align == 16) {
        *reinterpret_cast<uint4*>(dst) = v;
    } else if (align == 8) {
        uint2* d = reinterpret_cast<uint2*>(dst);
        d[0] = make_uint2(v.x, v.y);
        d[1] = make_uint2(v.z, v.w);
    } else if (align == 4) {
        uint32_t* d = reinterpret_cast<uint32_t*>(dst);
        d[0] = v.x;
        d[1] = v.y;
        d[2] = v.z;
        d[3] = v.w;
    } else {
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (uint32_t k = 0; k < 16; ++k) dst[k] = static_cast<char>(words[k / 4] >> (8 * (k % 4)));
    }
}

// Rank q's chunk of c.bytes[q] bytes lands at byte sum(c.bytes[0..q]) of `out`.
__device__ __forceinline__ void all_gather_bytes(const char* in, char* out, const GatherCounts& c,
                                                 const SymmArgs& a) {
    // Counts and output offsets in shared memory: indexed by rank, they would otherwise go to
    // the stack. Only kernel parameters are read, so this precedes `begin_call`, and a thread
    // that returns on a poisoned call leaves no other thread without its counts.
    __shared__ uint64_t count[MAX_RANKS];
    __shared__ uint64_t offset[MAX_RANKS];
    if (threadIdx.x == 0) {
        uint64_t at = 0;
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            count[q] = q < a.world ? c.bytes[q] : 0;
            offset[q] = at;
            at += count[q];
        }
    }
    __syncthreads();
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint32_t parity = static_cast<uint32_t>(epoch & 1);
    const PackLoop loop;
    uint64_t max_packs = 0;
    for (uint32_t q = 0; q < a.world; ++q) {
        if (q != a.rank && count[q] / 16 > max_packs) max_packs = count[q] / 16;
    }
    const uint64_t own = count[a.rank];
    const uint64_t own_packs = own / 16;
    const uint64_t own_at = offset[a.rank];
    // The caller's buffers may be views at any element offset: widths follow the addresses.
    const uint32_t own_align = alignment_of(reinterpret_cast<uint64_t>(out) + own_at);
    const uint32_t in_align = alignment_of(reinterpret_cast<uint64_t>(in));
    char* mine = data_buffer(a, a.rank, parity);

    // Copy in (and straight to this rank's own place in the output).
    for (uint64_t i = loop.first; i < own_packs; i += loop.step) {
        const uint4 v = load_pack_at(in + 16 * i, in_align);
        reinterpret_cast<uint4*>(mine)[i] = v;
        store_pack_at(out + own_at + 16 * i, v, own_align);
    }
    if (blockIdx.x == 0 && threadIdx.x < own % 16) {
        const uint64_t k = own_packs * 16 + threadIdx.x;
        const char b = in[k];
        mine[k] = b;
        out[own_at + k] = b;
    }
    if (threadIdx.x < MAX_RANKS) {
        count_slot(a, a.rank, parity, blockIdx.x)[threadIdx.x] = count[threadIdx.x];
    }

    if (block_barrier(a, PHASE_START, epoch)) {
        pdl_trigger(a);
        // Every peer's counts against ours, before any peer data is touched.
        __shared__ uint32_t disagreeing;
        if (threadIdx.x == 0) disagreeing = MAX_RANKS;
        __syncthreads();
        const uint32_t t = threadIdx.x;
        if (t < a.world * a.world) {
            const uint32_t q = t / a.world;
            const uint32_t j = t % a.world;
            const uint64_t theirs = __ldcg(count_slot(a, q, parity, blockIdx.x) + j);
            if (theirs != count[j]) atomicMin(&disagreeing, q);
        }
        __syncthreads();
        if (disagreeing < MAX_RANKS) {
            // Every block compared the same slots: block 0 alone reports, so the host, which
            // clears the code once it has reported it, never sees a late duplicate.
            if (blockIdx.x == 0 && threadIdx.x == 0)
                note_error(a, ERROR_COUNTS_MISMATCH | (PHASE_START << 8) | (disagreeing << 16));
        } else {
            const char* rank0 = data_buffer(a, 0, parity);
            for (uint64_t i = loop.first; i < max_packs; i += loop.step) {
                uint4 v[MAX_RANKS];
#pragma unroll
                for (uint32_t q = 0; q < MAX_RANKS; ++q) {
                    if (q < a.world && q != a.rank && i < count[q] / 16)
                        v[q] = load_peer_pack(reinterpret_cast<const uint4*>(rank0 + q * a.stride) + i);
                }
#pragma unroll
                for (uint32_t q = 0; q < MAX_RANKS; ++q) {
                    if (q < a.world && q != a.rank && i < count[q] / 16)
                        store_pack_at(out + offset[q] + 16 * i, v[q], alignment_of(reinterpret_cast<uint64_t>(out) + offset[q]));
                }
            }
            // Tails (< 16 bytes per rank): block 0, thread 16 q + k copies byte k of rank q's tail.
            const uint32_t q = threadIdx.x / 16;
            const uint32_t k = threadIdx.x % 16;
            if (blockIdx.x == 0 && q < a.world && q != a.rank && k < count[q] % 16) {
                const uint64_t at = count[q] / 16 * 16 + k;
                out[offset[q] + at] = static_cast<char>(__ldcg(reinterpret_cast<const signed char*>(rank0 + q * a.stride) + at));
            }
        }
    }
    end_call(a, epoch);
}

}  // namespace symm
