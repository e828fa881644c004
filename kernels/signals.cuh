// The signal protocol (v2.1): per-call 64-bit epochs kept in device memory, one call state
// entry per block index (no grid-wide counter), per-block barriers over the signal pads, every
// wait bounded by %globaltimer, and a poison word that stops the whole group once any rank's
// wait timed out. docs/design.md states the invariants.
//
// Why it is safe to reuse buffers with only these barriers:
//  * Each call writes the data buffer of parity (epoch & 1). A rank rewrites a buffer two
//    calls later; by then every peer has passed the start barrier of the call in between,
//    and a peer only signals that barrier after its previous kernel (which read the buffer)
//    has completed. So no end barrier is needed, even when the grid size changes.
//    With Programmatic Dependent Launch nothing changes: a kernel's `pdl_wait` (in
//    `begin_call`) returns only once the previous kernel on the stream has completed and
//    flushed its memory, and nothing before it touches memory.
//  * Blocks synchronise only with the same-index block of every peer, so block b must read
//    exactly the elements that block b of each peer wrote before the barrier. Every kernel
//    therefore uses one index pattern (`PackLoop`) for its copy-in, reduce and gather.
//  * Slots hold 64-bit flags, epoch << 16 | the call's identity, that only grow and are
//    compared with `>=` on the epoch: a slot last written any number of calls ago holds a
//    smaller epoch and never passes a wait; a fast peer that is already one barrier ahead
//    never breaks a waiter. Epochs start at 1 and stay below 2^48; every slot is zeroed at
//    setup, so nothing a previous communicator left can pass. A flag of the same epoch with
//    another identity (another kernel, dtype or length) fails the wait as ERROR_DIVERGED.
#pragma once

#include "check.cuh"

namespace symm {

__device__ __forceinline__ uint64_t* signal_slot(const SymmArgs& a, uint32_t owner, uint32_t phase,
                                                 uint32_t block, uint32_t from) {
    uint64_t* pad = reinterpret_cast<uint64_t*>(rank_alloc(a, owner) + a.signal_offset);
    return pad + (phase * MAX_BLOCKS + block) * SLOTS_PER_ROW + from;
}

// `begin_call`'s default prefetch: nothing.
struct NoPrefetch {
    __device__ __forceinline__ void operator()() const {}
};

// Epoch of the call this grid runs (one more than the calls completed so far), or 0 if the
// group is poisoned, the divergence check failed or the epochs are exhausted: then the kernel
// returns at once, without touching its output or the workspace (epoch 0 would mean parity 0,
// which may be the buffer a slow peer still reads for the previous call; tests/kernel_code.rs
// checks every kernel, and nothing after `begin_call` checks the epoch again). Every thread
// reads its block's entry of the call state itself (no grid-wide state); a peer may poison the
// entry while the block reads it, so the block decides together (`__syncthreads_or`): either
// every thread of the block returns or none does. `pdl_wait` first, so the previous kernel on
// the stream has completed; with the divergence check on, every peer's call is compared
// first. Call it before touching any input, output or workspace.
//
// `prefetch` (loads only, never a store) runs right after the call-state load is issued: a
// kernel loads its first input words there, so that their latency overlaps the state load's
// instead of following the block's vote. The input is complete once `pdl_wait` has returned,
// and reading it is harmless when the call is then refused (nothing is written).
template <typename Prefetch = NoPrefetch>
__device__ __forceinline__ uint64_t begin_call(const SymmArgs& a, const Prefetch& prefetch = Prefetch()) {
    pdl_wait();
    if (a.flags & FLAG_PDL_EARLY) pdl_launch_dependents();
    const ulonglong2 s = ld_state_sys(block_state(a));
    prefetch();
    const uint32_t poison = static_cast<uint32_t>(s.y);
    const uint64_t epoch = s.x + 1;
    const bool exhausted = (epoch >> EPOCH_BITS) != 0;
    // One vote for both refusals (the epoch is the same in every thread: the previous kernel
    // wrote it and has completed).
    if (__builtin_expect(__syncthreads_or(poison != 0 || exhausted), 0)) {
        if (poison != 0) {
            note_error(a, poison);
        } else if (exhausted && blockIdx.x == 0 && threadIdx.x == 0) {
            note_error(a, ERROR_EPOCHS_EXHAUSTED | (a.rank << 24));
        }
        return 0;
    }
    if (a.check_shape != 0 && !check_call(a, epoch)) return 0;
    return epoch;
}

// Lets the next kernel on the stream launch (Programmatic Dependent Launch); called once this
// thread's first cross-rank wait has passed (a barrier kernel right after its start barrier, a
// low-latency thread once every peer's data has arrived). The next kernel launches when every
// block has triggered, so every peer's blocks of this call have signalled this rank and are
// resident: the next kernel's blocks, parked in their own `griddepcontrol.wait`, take only SMs
// that no block of the call still needs, even where ranks share a device; the rest of the
// call (reduce, middle or end barrier, gather) then runs beside the next launch. With
// FLAG_PDL_AT_EXIT the kernel leaves it to its exit, when its output is complete (for
// consumers that do not call `griddepcontrol.wait`); with FLAG_PDL_EARLY `begin_call` has
// triggered already.
__device__ __forceinline__ void pdl_trigger(const SymmArgs& a) {
    if ((a.flags & (FLAG_PDL_AT_EXIT | FLAG_PDL_EARLY)) == 0) pdl_launch_dependents();
}

// A barrier flag of `peer` carried another call's identity for the same epoch: the two ranks run
// different kernels, dtypes or lengths. Reported as ERROR_DIVERGED with both identities (the
// record follows the error word), and the group is poisoned. Never paired: the wait fails on both
// ranks.
__device__ __forceinline__ void report_ident_divergence(const SymmArgs& a, uint32_t phase, uint32_t peer,
                                                        uint32_t peer_ident) {
    volatile uint64_t* record = reinterpret_cast<volatile uint64_t*>(a.error + 8);
    const uint32_t code = ERROR_DIVERGED | (phase << 8) | (peer << 16) | (a.rank << 24);
    if (*reinterpret_cast<volatile uint32_t*>(a.error) == 0) {
        record[0] = RECORD_IDENT | a.ident;
        record[1] = a.check_len;
        record[2] = RECORD_IDENT | peer_ident;
        record[3] = 0;
        __threadfence_system();
    }
    note_error(a, code);
    poison_all(a, code);
}

// Publishes `epoch` as completed for the next launch, once every thread of this block has
// read it (the caller synchronised the block since): block b of G writes entries b, b + G,
// b + 2G, ... of the call state, so every entry holds the epoch after the grid, whatever G,
// and no block reads another's entry. Threads `first ..` of the block share the stores (one
// each for any G when 64 threads take part; the block needs more than `first` threads).
// Plain stores, nothing waits for them: the next kernel reads the entries only after this
// one has completed (stream order; `pdl_wait`).
__device__ __forceinline__ void publish(const SymmArgs& a, uint64_t epoch, uint32_t first) {
    const uint32_t step = (blockDim.x - first) * gridDim.x;
    for (uint32_t j = blockIdx.x + (threadIdx.x - first) * gridDim.x; j < MAX_BLOCKS; j += step) {
        *reinterpret_cast<volatile uint64_t*>(&block_state_of(a, a.rank, j)->calls) = epoch;
    }
}

// The end of a kernel that has not published in a barrier (`block_barrier_arrive`); `epoch`
// is the accepted call's (never 0).
__device__ __forceinline__ void end_call(const SymmArgs& a, uint64_t epoch) {
    __syncthreads();
    publish(a, epoch, 0);
}

// Barrier between block blockIdx.x of every rank. Thread t < world signals rank t and waits
// for rank t. The __syncthreads before the release orders the whole block's writes before
// it; the acquire polls and the __syncthreads after them extend the peers'
// writes to the whole block. Returns false (in every thread of the block) if a wait timed out
// or the group is poisoned. `epoch` is never 0: a kernel returns as soon as `begin_call` refuses
// its call. With `arrives`, the warps that do not signal (threads 32 and up) also publish the
// call as completed (`publish`), off the critical path.
// `releases` = false only for the sync floor, which publishes no data: its flags are relaxed
// stores (a release store is a `MEMBAR.ALL.SYS` first).
__device__ __forceinline__ bool block_barrier_impl(const SymmArgs& a, uint32_t phase, uint64_t epoch,
                                                   bool arrives, bool releases = true) {
    __syncthreads();
    int failed = 0;
    const uint32_t t = threadIdx.x;
    if (t < a.world) {
        // The flag: the epoch beside the call's identity. A peer's flag of an earlier epoch
        // is smaller, of a later one larger (it has passed this barrier, so it accepted this
        // rank's flag: same identity); only the same epoch with another identity differs.
        const uint64_t flag = epoch << IDENT_BITS | a.ident;
        uint64_t* theirs = signal_slot(a, t, phase, blockIdx.x, a.rank);
        if (releases) {
            st_release_sys(theirs, flag);
        } else {
            st_relaxed_sys(theirs, flag);
        }
        const uint64_t* mine = signal_slot(a, a.rank, phase, blockIdx.x, t);
        const uint64_t floor = epoch << IDENT_BITS;
        Deadline d;
        uint64_t seen;
        while ((seen = ld_acquire_sys(mine)) < floor) {
            if (!d.keep_waiting(a, phase, t)) {
                failed = 1;
                break;
            }
        }
        if (__builtin_expect(!failed && seen >> IDENT_BITS == epoch && static_cast<uint32_t>(seen & 0xffff) != a.ident,
                             0)) {
            report_ident_divergence(a, phase, t, static_cast<uint32_t>(seen & 0xffff));
            failed = 1;
        }
    } else if (arrives && t >= 32) {
        publish(a, epoch, 32);
    }
    return __syncthreads_or(failed) == 0;
}

__device__ __forceinline__ bool block_barrier(const SymmArgs& a, uint32_t phase, uint64_t epoch) {
    return block_barrier_impl(a, phase, epoch, false);
}

// The first barrier of a kernel that then ends without `end_call`.
__device__ __forceinline__ bool block_barrier_arrive(const SymmArgs& a, uint32_t phase, uint64_t epoch) {
    return block_barrier_impl(a, phase, epoch, true);
}

// The sync floor's exchange: `block_barrier_arrive` with relaxed flag stores.
__device__ __forceinline__ bool flag_exchange(const SymmArgs& a, uint64_t epoch) {
    return block_barrier_impl(a, PHASE_START, epoch, true, false);
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
