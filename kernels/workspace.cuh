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

// Line `line` of the slot that rank `source` fills in `owner`'s buffer for epoch parity `parity`.
__device__ __forceinline__ uint4* ll_line(const SymmArgs& a, uint32_t owner, uint32_t parity, uint32_t source,
                                          uint64_t line) {
    char* slot = rank_alloc(a, owner) + a.ll_offset + (parity * a.world + source) * a.ll_slot_bytes;
    return reinterpret_cast<uint4*>(slot) + line;
}

__device__ __forceinline__ CallState* call_state(const SymmArgs& a) {
    return reinterpret_cast<CallState*>(rank_alloc(a, a.rank) + a.state_offset);
}

}  // namespace symm
