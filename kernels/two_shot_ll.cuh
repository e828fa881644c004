// The low-latency two-shot: the reduce-scatter and the all-gather of the two-shot with the data
// carrying the synchronisation (the low-latency region's sentinel protocol, low_latency.cuh)
// instead of two barriers. Taken where both halves of a shard fit the low-latency limit and the
// world's published threshold (plan::route::two_shot_variant); the barrier two-shot
// (two_shot.cuh) above it.
//
// Why the region's invariants hold: every line a rank reads it re-arms inside the call, and a
// writer writes only lines its reader reads in the same call (every rank makes the same call).
// A rank is at most one call ahead of any peer: it finishes call k only with every owner's sums
// of call k, which each owner sent after every rank's reduce-scatter lines of call k had
// arrived; so `one_shot_ll`'s three-buffer argument holds unchanged. In place (`out == in`) is
// safe: a rank stores line l of another shard only once l's owner has summed it, which needed
// this rank's push of line l, read from the input before.
//
// Numerics: the owner sums a line in rank order in fp32 and rounds once (`ll_reduce_line`, the
// arithmetic of every other algorithm); the other ranks store those bits as they arrive, so
// every rank and every algorithm gives the same bits.
#pragma once

#include "low_latency.cuh"

namespace symm {

// Lines [q·L, (q+1)·L) of the message (L = ceil(lines / W)) are rank q's shard. In rank p's
// buffer, the slot of source s holds: lines 0..L (the reduce-scatter: s's input lines of
// shard p) and lines L..2L (the all-gather: shard s's rounded sums, pushed by s). p ≠ s, so
// the two never overlap; every reader re-arms what it read (the region's invariant).
template <typename T, uint32_t U>
__device__ __forceinline__ void two_shot_ll_body(const T* in, T* out, uint64_t n, const SymmArgs& a,
                                                 uint32_t buffer, uint64_t lines, uint64_t shard) {
    constexpr uint32_t PER_LINE = Elem<T>::PER_PACK;
    const PackLoop loop;
    const bool in_aligned = is_aligned(in, 16), out_aligned = is_aligned(out, 16);
    const auto store_out = [&](uint64_t l, uint4 v) {
        if ((l + 1) * PER_LINE <= n) {
            store_pack(out, l, v, out_aligned);
        } else {
            Pack<T> r;
            r.bits = v;
#pragma unroll
            for (uint32_t e = 0; e < PER_LINE; ++e) {
                if (l * PER_LINE + e < n) out[l * PER_LINE + e] = r.elems[e];
            }
        }
    };
    // 1. Push every line of another rank's shard into this rank's slot of its owner, U loads in
    //    flight before the stores.
    for (uint64_t l0 = loop.first; l0 < lines; l0 += U * loop.step) {
        uint4 v[U];
#pragma unroll
        for (uint32_t u = 0; u < U; ++u) {
            const uint64_t l = l0 + u * loop.step;
            if (l < lines && l / shard != a.rank) v[u] = load_line(in, n, l, in_aligned);
        }
#pragma unroll
        for (uint32_t u = 0; u < U; ++u) {
            const uint64_t l = l0 + u * loop.step;
            const uint32_t q = static_cast<uint32_t>(l / shard);
            if (l < lines && q != a.rank) {
                st_line_sys(ll_line(a, q, buffer, a.rank, l - q * shard), as_words(wire_pack(v[u])));
            }
        }
    }
    // 2. Reduce this rank's shard: wait for every peer's line, sum in rank order, push the
    //    rounded line into this rank's slot of every peer (lines L..2L), store it.
    const uint64_t mine = a.rank * shard;
    const uint64_t own_lines = mine < lines ? min(shard, lines - mine) : 0;
    bool waited = false;
    for (uint64_t j = loop.first; j < own_lines; j += loop.step) {
        uint4 sum;
        if (!ll_reduce_line<T>(a, buffer, j, load_line(in, n, mine + j, in_aligned), sum)) return;
        const ulonglong2 w = as_words(wire_pack(sum));
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (q < a.world && q != a.rank) st_line_sys(ll_line(a, q, buffer, a.rank, shard + j), w);
        }
        store_out(mine + j, sum);
        waited = true;
    }
    // This thread's first wait on the peers has passed: the next kernel may start launching
    // (a thread without a line of this rank's shard triggers after its first gather wait, one
    // with no line at all waits for nothing and does not trigger).
    if (waited) pdl_trigger(a);
    // 3. Gather every other shard: poll U lines at a time, each from its owner's slot.
    const uint64_t others = lines - own_lines;
    for (uint64_t k0 = loop.first; k0 < others; k0 += U * loop.step) {
        ulonglong2 w[U];
        uint32_t pending = 0;
#pragma unroll
        for (uint32_t u = 0; u < U; ++u) {
            if (k0 + u * loop.step < others) pending |= 1u << u;
        }
        // The owner sends a line only once its own waits on every rank have passed: a rank
        // that never came is reported by those direct waits (this rank's sum above, or a
        // peer's) after one timeout; this wait names the owner only after one and a half.
        Deadline d;
        d.behind_direct_waits = true;
        uint32_t owner = a.rank;
        while (true) {
#pragma unroll
            for (uint32_t u = 0; u < U; ++u) {
                if (pending & (1u << u)) {
                    const uint64_t k = k0 + u * loop.step;
                    const uint64_t l = k < mine ? k : k + own_lines;
                    const uint32_t q = static_cast<uint32_t>(l / shard);
                    w[u] = ld_poll_sys(ll_line(a, a.rank, buffer, q, shard + l - q * shard));
                    owner = q;
                }
            }
#pragma unroll
            for (uint32_t u = 0; u < U; ++u) {
                if ((pending & (1u << u)) && line_arrived(w[u])) pending &= ~(1u << u);
            }
            if (pending == 0) break;
            if (!d.keep_waiting(a, PHASE_ARRIVAL, owner)) return;
        }
#pragma unroll
        for (uint32_t u = 0; u < U; ++u) {
            const uint64_t k = k0 + u * loop.step;
            if (k < others) {
                const uint64_t l = k < mine ? k : k + own_lines;
                const uint32_t q = static_cast<uint32_t>(l / shard);
                st_line_sys(ll_line(a, a.rank, buffer, q, shard + l - q * shard),
                            make_ulonglong2(LL_NOT_ARRIVED, LL_NOT_ARRIVED));
                store_out(l, as_pack(w[u]));
            }
        }
        if (!waited) {
            pdl_trigger(a);
            waited = true;
        }
    }
}

// The low-latency two-shot kernel. The host routes a call here only when both halves of a
// shard fit the low-latency capacity (plan::route), so its window stays within the rotation's
// eighth of the slot, like every low-latency call's.
template <typename T>
__device__ __forceinline__ void two_shot_ll(const T* in, T* out, uint64_t n, const SymmArgs& a) {
    constexpr uint32_t PER_LINE = Elem<T>::PER_PACK;
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint64_t lines = (n + PER_LINE - 1) / PER_LINE;
    const uint64_t shard = (lines + a.world - 1) / a.world;
    two_shot_ll_body<T, 4>(in, out, n, a, static_cast<uint32_t>(epoch % LL_BUFFERS), lines, shard);
    end_call(a, epoch);
}

}  // namespace symm
