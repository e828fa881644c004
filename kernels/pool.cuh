// The symmetric pool on the device: where a pool buffer lies in every rank's allocation, and
// the check that every rank's zero-copy call names the same buffer (the pool tag).
//
// A pool buffer lies at the same offset of every rank's allocation, so a kernel finds peer q's
// copy from this rank's pointer alone: offset = ptr - (base + rank * stride). No argument
// carries the offset.
//
// The tag (SymmArgs::pool_tag) is a digest of the buffer's allocation (sequence number,
// offset, bytes, dtype) and of the call (view offset, length), computed on the host without
// any exchange. Every block stores it into this rank's tag slot of the call's epoch parity
// before the start barrier and compares every rank's slot with its own after it; the barrier's
// release/acquire makes the peers' stores visible. If any rank's tag differs, every rank sees
// a difference (the comparison covers all W tags), so every rank skips all reads and writes of
// the data and reports ERROR_POOL_MISMATCH: the ranks' allocation sequences diverged, and
// nothing is corrupted. A slot is rewritten two calls later, after the call in between has
// passed its start barrier on every rank (as the data buffers).
#pragma once

#include "signals.cuh"

namespace symm {

// This rank's offset of the buffer at `ptr` (one of this rank's pool buffers).
__device__ __forceinline__ uint64_t pool_offset(const SymmArgs& a, const void* ptr) {
    return reinterpret_cast<uint64_t>(ptr) - (a.base + a.rank * a.stride);
}

__device__ __forceinline__ volatile uint64_t* pool_tag_slot(const SymmArgs& a, uint32_t owner, uint32_t parity) {
    return reinterpret_cast<volatile uint64_t*>(rank_alloc(a, owner) + a.stride - POOL_TAG_BYTES) + parity;
}

// Before the start barrier (every block: the barrier orders only its own block's writes).
__device__ __forceinline__ void pool_publish(const SymmArgs& a, uint32_t parity) {
    if (threadIdx.x == 0) *pool_tag_slot(a, a.rank, parity) = a.pool_tag;
}

// After the start barrier: true in every thread when every rank's tag equals this rank's.
// Otherwise block 0 reports the lowest rank whose tag differs and every block returns false.
__device__ __forceinline__ bool pool_agree(const SymmArgs& a, uint32_t parity) {
    const uint32_t t = threadIdx.x;
    const int differs = t < a.world && *pool_tag_slot(a, t, parity) != a.pool_tag;
    if (__syncthreads_or(differs) == 0) return true;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        uint32_t peer = 0;
        while (peer < a.world && *pool_tag_slot(a, peer, parity) == a.pool_tag) ++peer;
        note_error(a, ERROR_POOL_MISMATCH | (peer << 16) | (a.rank << 24));
    }
    return false;
}

}  // namespace symm
