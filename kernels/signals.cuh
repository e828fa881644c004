// The signal protocol: per-call epochs kept in device memory and per-block barriers over
// the signal pads, every wait bounded by %globaltimer.
//
// Why it is safe to reuse buffers with only these barriers:
//  * Each call writes the data buffer of parity (epoch & 1). A rank rewrites a buffer two
//    calls later; by then every peer has passed the start barrier of the call in between,
//    and a peer only signals that barrier after its previous kernel (which read the buffer)
//    has completed. So no end barrier is needed, even when the grid size changes.
//  * Blocks synchronise only with the same-index block of every peer, so block b must read
//    exactly the elements that block b of each peer wrote before the barrier. Every kernel
//    therefore uses one index pattern (`PackLoop`) for its copy-in, reduce and gather.
//  * Slots are written with monotonically increasing epochs and compared wrap-safely, so
//    a fast peer that is already one barrier ahead never breaks a waiter.
#pragma once

#include "memory.cuh"
#include "workspace.cuh"

namespace symm {

__device__ __forceinline__ uint32_t* signal_slot(const SymmArgs& a, uint32_t owner, uint32_t phase,
                                                 uint32_t block, uint32_t from) {
    uint32_t* pad = reinterpret_cast<uint32_t*>(rank_alloc(a, owner) + a.signal_offset);
    return pad + (phase * MAX_BLOCKS + block) * SLOTS_PER_ROW + from;
}

__device__ __forceinline__ void report_timeout(const SymmArgs& a, uint32_t phase, uint32_t peer) {
    volatile uint32_t* err = reinterpret_cast<volatile uint32_t*>(a.error);
    *err = ERROR_PEER_TIMEOUT | (phase << 8) | (peer << 16);
    __threadfence_system();
}

// Epoch of the call this grid runs: one more than the calls completed so far.
__device__ __forceinline__ uint32_t begin_call(const SymmArgs& a) {
    __shared__ uint32_t epoch;
    if (threadIdx.x == 0) epoch = *reinterpret_cast<volatile uint32_t*>(&call_state(a)->calls) + 1;
    __syncthreads();
    return epoch;
}

// The last block to finish publishes the epoch as completed for the next launch (a lone
// block is last by definition and skips the atomic).
__device__ __forceinline__ void end_call(const SymmArgs& a, uint32_t epoch) {
    __syncthreads();
    if (threadIdx.x == 0) {
        CallState* s = call_state(a);
        if (gridDim.x == 1) {
            *reinterpret_cast<volatile uint32_t*>(&s->calls) = epoch;
        } else if (atom_add_acq_rel_gpu(&s->finished, 1) == gridDim.x - 1) {
            *reinterpret_cast<volatile uint32_t*>(&s->finished) = 0;
            *reinterpret_cast<volatile uint32_t*>(&s->calls) = epoch;
        }
    }
}

// Barrier between block blockIdx.x of every rank. Thread t < world signals rank t and waits
// for rank t. The __syncthreads before the release orders the whole block's writes before
// it; the one after the acquire extends the peers' writes to the whole block.
// Returns false (in every thread of the block) if a wait timed out.
__device__ __forceinline__ bool block_barrier(const SymmArgs& a, uint32_t phase, uint32_t epoch) {
    __syncthreads();
    int timed_out = 0;
    const uint32_t t = threadIdx.x;
    if (t < a.world) {
        st_release_sys(signal_slot(a, t, phase, blockIdx.x, a.rank), epoch);
        const uint32_t* mine = signal_slot(a, a.rank, phase, blockIdx.x, t);
        uint64_t deadline = 0;
        while (static_cast<int32_t>(ld_acquire_sys(mine) - epoch) < 0) {
            const uint64_t now = global_timer_ns();
            if (deadline == 0) {
                deadline = now + a.timeout_ns;
            } else if (now > deadline) {
                report_timeout(a, phase, t);
                timed_out = 1;
                break;
            }
        }
    }
    return __syncthreads_or(timed_out) == 0;
}

// The one index pattern every phase of a kernel walks: block-cyclic over 16-byte packs.
struct PackLoop {
    uint64_t first;
    uint64_t step;
    __device__ PackLoop()
        : first(static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x),
          step(static_cast<uint64_t>(gridDim.x) * blockDim.x) {}
};

}  // namespace symm
