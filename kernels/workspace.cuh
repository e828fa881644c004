// Addressing inside the symmetric workspace (layout: src/symmetric/mod.rs).
#pragma once

#include "abi.cuh"

namespace symm {

__device__ __forceinline__ char* rank_alloc(const SymmArgs& a, uint32_t owner) {
    return reinterpret_cast<char*>(a.base + owner * a.stride);
}

__device__ __forceinline__ char* data_buffer(const SymmArgs& a, uint32_t owner, uint32_t parity) {
    return rank_alloc(a, owner) + a.data_offset + parity * a.data_bytes;
}

// The buffer users write into for the zero-copy in-place all-reduce.
__device__ __forceinline__ char* symmetric_buffer(const SymmArgs& a, uint32_t owner) {
    return rank_alloc(a, owner) + a.data_offset + 2 * a.data_bytes;
}

// Line `line` of the slot that rank `source` fills in `owner`'s low-latency buffer `buffer`.
__device__ __forceinline__ ulonglong2* ll_line(const SymmArgs& a, uint32_t owner, uint32_t buffer, uint32_t source,
                                               uint64_t line) {
    char* slot = rank_alloc(a, owner) + a.ll_offset + (buffer * a.world + source) * a.ll_slot_bytes;
    return reinterpret_cast<ulonglong2*>(slot) + line;
}

// Rank `owner`'s call state entry for block index `block` (peers only ever write its poison
// word).
__device__ __forceinline__ BlockState* block_state_of(const SymmArgs& a, uint32_t owner, uint32_t block) {
    return reinterpret_cast<BlockState*>(rank_alloc(a, owner) + a.state_offset) + block;
}

// This block's entry of this rank's call state.
__device__ __forceinline__ BlockState* block_state(const SymmArgs& a) {
    return block_state_of(a, a.rank, blockIdx.x);
}

}  // namespace symm
