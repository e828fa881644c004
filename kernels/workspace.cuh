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

// Byte `offset` of the slot that rank `source` fills in `owner`'s low-latency buffer
// `buffer`, where this call keeps it: rotated by the call's `ll_rot` inside the slot (a power
// of two bytes). Every low-latency access goes through here, so a reader and its writers of
// the same call agree on every position, and whatever a kernel re-arms is where it read.
__device__ __forceinline__ char* ll_slot_byte(const SymmArgs& a, uint32_t owner, uint32_t buffer, uint32_t source,
                                              uint64_t offset) {
    char* slot = rank_alloc(a, owner) + a.ll_offset + (buffer * a.world + source) * a.ll_slot_bytes;
    return slot + ((offset + a.ll_rot) & (a.ll_slot_bytes - 1));
}

// Line `line` (16 bytes) of that slot.
__device__ __forceinline__ ulonglong2* ll_line(const SymmArgs& a, uint32_t owner, uint32_t buffer, uint32_t source,
                                               uint64_t line) {
    return reinterpret_cast<ulonglong2*>(ll_slot_byte(a, owner, buffer, source, line * sizeof(ulonglong2)));
}

// 32-bit word `i` of that slot (word 4l + k is word k of line l).
__device__ __forceinline__ uint32_t* ll_word(const SymmArgs& a, uint32_t owner, uint32_t buffer, uint32_t source,
                                             uint64_t i) {
    return reinterpret_cast<uint32_t*>(ll_slot_byte(a, owner, buffer, source, i * sizeof(uint32_t)));
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
