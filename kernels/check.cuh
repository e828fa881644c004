// The divergence check (Config::check_divergence, SYMM_ALLREDUCE_CHECK=1): before a kernel
// touches any data, block b of every rank announces (epoch, shape, length) of the call it runs
// to block b of every peer and compares what each peer announced with its own. A mismatch —
// another length, dtype, algorithm or collective, or another epoch (a rank that made more or
// fewer calls) — is reported as ERROR_DIVERGED with both calls, and poisons the group.
//
// Slots alternate by epoch parity: a peer one call ahead writes the other row, so the row
// read for epoch e holds the peer's announcement for e once its epoch is >= e.
#pragma once

#include "wait.cuh"

namespace symm {

__device__ __forceinline__ CheckSlot* check_slot(const SymmArgs& a, uint32_t owner, uint64_t epoch, uint32_t block,
                                                 uint32_t from) {
    CheckSlot* slots = reinterpret_cast<CheckSlot*>(rank_alloc(a, owner) + CHECK_OFFSET);
    return slots + ((epoch & 1) * MAX_BLOCKS + block) * MAX_RANKS + from;
}

__device__ __forceinline__ void report_divergence(const SymmArgs& a, uint32_t peer, uint64_t shape, uint64_t len) {
    volatile uint64_t* record = reinterpret_cast<volatile uint64_t*>(a.error + 8);
    record[0] = a.check_shape;
    record[1] = a.check_len;
    record[2] = shape;
    record[3] = len;
    __threadfence_system();
    const uint32_t code = ERROR_DIVERGED | (PHASE_CHECK << 8) | (peer << 16) | (a.rank << 24);
    note_error(a, code);
    poison_all(a, code);
}

// True (in every thread of the block) when every peer runs the same call as this rank.
__device__ __forceinline__ bool check_call(const SymmArgs& a, uint64_t epoch) {
    int failed = 0;
    const uint32_t t = threadIdx.x;
    if (t < a.world) {
        CheckSlot* to = check_slot(a, t, epoch, blockIdx.x, a.rank);
        asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(&to->shape), "l"(a.check_shape),
                     "l"(a.check_len)
                     : "memory");
        st_release_sys(&to->epoch, epoch);
        const CheckSlot* from = check_slot(a, a.rank, epoch, blockIdx.x, t);
        Deadline d;
        uint64_t seen;
        while ((seen = ld_acquire_sys(&from->epoch)) < epoch) {
            if (!d.keep_waiting(a, PHASE_CHECK, t)) {
                failed = 1;
                break;
            }
        }
        if (!failed) {
            const uint64_t shape = ld_relaxed_sys(&from->shape);
            const uint64_t len = ld_relaxed_sys(&from->len);
            if (seen != epoch || shape != a.check_shape || len != a.check_len) {
                report_divergence(a, t, seen != epoch ? 0 : shape, seen != epoch ? seen : len);
                failed = 1;
            }
        }
    }
    return __syncthreads_or(failed) == 0;
}

}  // namespace symm
