// Bounded waits: the deadline every polling thread keeps (%globaltimer), the error word the
// host reads, and the poison word that stops every rank once any rank's wait timed out.
#pragma once

#include "memory.cuh"
#include "workspace.cuh"

namespace symm {

// Polls between two reads of %globaltimer and of the poison word.
constexpr uint32_t POLLS_PER_CHECK = 128;

// Leaves `code` for the host in the error word; the first code stays. Every writer of the
// error word goes through here. (The word is host memory, where a compare-and-swap is not
// available on every system: two codes written in the same instant may leave either; both
// are failures of the same call.) Returns whether this code was written.
__device__ __forceinline__ bool note_error(const SymmArgs& a, uint32_t code) {
    volatile uint32_t* err = reinterpret_cast<volatile uint32_t*>(a.error);
    const bool first = *err == 0;
    if (first) *err = code;
    __threadfence_system();
    return first;
}

// Writes `code` into the poison word of every block entry of every rank's call state (the
// rare path: W * MAX_BLOCKS stores by one thread).
__device__ __forceinline__ void poison_all(const SymmArgs& a, uint32_t code) {
    for (uint32_t i = 0; i < a.world * MAX_BLOCKS; ++i) {
        st_relaxed_sys_u32(&block_state_of(a, i / MAX_BLOCKS, i % MAX_BLOCKS)->poison, code);
    }
}

// A wait of this rank timed out: tell the host, and poison this rank and every peer so that
// every later call (eager or a graph replay) on every rank returns at once instead of
// waiting out its own timeout.
__device__ __forceinline__ void report_timeout(const SymmArgs& a, uint32_t phase, uint32_t peer) {
    const uint32_t code = ERROR_PEER_TIMEOUT | (phase << 8) | (peer << 16) | (a.rank << 24);
    note_error(a, code);
    poison_all(a, code);
}

// Another rank's poison seen while waiting: copy its code for the host (once per block is
// plenty) and give up.
__device__ __forceinline__ bool poisoned(const SymmArgs& a) {
    const uint32_t code = ld_relaxed_sys_u32(&block_state(a)->poison);
    if (code != 0) note_error(a, code);
    return code != 0;
}

// The bounded-wait bookkeeping of one polling thread.
struct Deadline {
    uint64_t at = 0;
    uint32_t polls = 0;
    // A wait on data that a peer sends only after its own waits on every rank have passed
    // (the low-latency two-shot's gather) lasts one and a half timeouts, so that a direct
    // wait on the rank that is really missing reports it first, and the call still fails
    // within two timeouts where there is none (a rank without lines of its own).
    bool behind_direct_waits = false;
    // False once the wait must stop: this rank's timeout expired (reported and pushed to
    // every peer) or another rank's poison arrived.
    __device__ __forceinline__ bool keep_waiting(const SymmArgs& a, uint32_t phase, uint32_t peer) {
        if (++polls % POLLS_PER_CHECK != 0) return true;
        if (poisoned(a)) return false;
        const uint64_t now = global_timer_ns();
        if (at == 0) {
            at = now + a.timeout_ns + (behind_direct_waits ? a.timeout_ns / 2 : 0);
        } else if (now > at) {
            report_timeout(a, phase, peer);
            return false;
        }
        return true;
    }
};

}  // namespace symm
