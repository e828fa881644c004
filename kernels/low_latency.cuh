// Low-latency one-shot (Lamport style): no barrier, the data carries the synchronisation.
// Written over a collective policy (coll.cuh) for the push only: `UnicastColl` stores each
// line into every peer's slot (W - 1 stores), `MultimemColl` (multimem.cu) with one multicast
// store. The readers poll their own local slots and sum in rank order either way, so both
// instantiations give the same bits as every peer kernel.
#pragma once

#include "coll.cuh"
#include "elements.cuh"
#include "memory.cuh"
#include "signals.cuh"
#include "unaligned.cuh"

namespace symm {

constexpr uint64_t LL_NOT_ARRIVED = ~0ull;

// Line `l` (16 bytes, one pack) of the input, zero-padded past element n.
template <typename T>
__device__ __forceinline__ uint4 load_line(const T* in, uint64_t n, uint64_t l, bool aligned) {
    constexpr uint32_t PER_LINE = Elem<T>::PER_PACK;
    if ((l + 1) * PER_LINE <= n) return load_pack(in, l, aligned);
    Pack<T> p;
    p.bits = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (uint32_t e = 0; e < PER_LINE; ++e) {
        if (l * PER_LINE + e < n) p.elems[e] = in[l * PER_LINE + e];
    }
    return p.bits;
}

__device__ __forceinline__ ulonglong2 as_words(uint4 v) {
    return make_ulonglong2(static_cast<uint64_t>(v.y) << 32 | v.x, static_cast<uint64_t>(v.w) << 32 | v.z);
}

__device__ __forceinline__ uint4 as_pack(ulonglong2 w) {
    return make_uint4(static_cast<uint32_t>(w.x), static_cast<uint32_t>(w.x >> 32), static_cast<uint32_t>(w.y),
                      static_cast<uint32_t>(w.y >> 32));
}

// Whether a polled line is complete: none of its four 32-bit words still holds the all-ones
// sentinel. Data never has an all-ones 32-bit word (wire_pack), so this is exact; checking
// 32-bit words, not 64-bit ones, also covers a writer whose 16 bytes land as four 32-bit
// pieces (a multicast store, `MultimemColl::broadcast_line`).
__device__ __forceinline__ bool line_arrived(ulonglong2 w) {
    constexpr uint32_t NOT_ARRIVED = 0xffffffffu;
    return static_cast<uint32_t>(w.x) != NOT_ARRIVED && static_cast<uint32_t>(w.x >> 32) != NOT_ARRIVED &&
           static_cast<uint32_t>(w.y) != NOT_ARRIVED && static_cast<uint32_t>(w.y >> 32) != NOT_ARRIVED;
}

// Polls every peer's copy of one line or word of this rank's low-latency buffer until
// `arrived(w[q])` holds for each peer q: `source0` is source 0's copy, source q's is `slot`
// elements further. The arrived values are left in `w` (this rank's own entry is not
// touched). False when the wait timed out or the group is poisoned. Every low-latency reader
// waits through it. Every pending peer's copy is loaded before any is looked at, so a poll
// costs one round trip, not one per peer (checking each load before issuing the next
// serialised them), and the values are loaded straight into `w`: no second copy of 8 lines
// in registers. The addresses are worked out once, not per poll (on the critical path every
// instruction counts, docs/design.md).
template <typename Word, typename Arrived>
__device__ __forceinline__ bool ll_poll_peers(const SymmArgs& a, const Word* source0, uint64_t slot, Arrived arrived,
                                              Word (&w)[MAX_RANKS]) {
    uint32_t pending = ((1u << a.world) - 1) & ~(1u << a.rank);
    Deadline d;
    while (true) {
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (pending & (1u << q)) w[q] = ld_poll_sys(source0 + q * slot);
        }
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if ((pending & (1u << q)) && arrived(w[q])) pending &= ~(1u << q);
        }
        if (pending == 0) return true;
        if (!d.keep_waiting(a, PHASE_ARRIVAL, __ffs(pending) - 1)) return false;
    }
}

// `ll_poll_peers` over line `l` of every peer's slot in this rank's buffer `buffer` (the
// all-gather's reader).
template <typename Arrived>
__device__ __forceinline__ bool ll_wait_peers(const SymmArgs& a, uint32_t buffer, uint64_t l, Arrived arrived,
                                              ulonglong2 (&w)[MAX_RANKS]) {
    return ll_poll_peers(a, ll_line(a, a.rank, buffer, 0, l), a.ll_slot_bytes / sizeof(ulonglong2), arrived, w);
}

// Waits for line `l` of every peer (`ll_poll_peers`), sums in rank order 0..W-1 in fp32 (this
// rank's own contribution `own` from registers), rounds once into `sum`, and re-arms the
// lines it consumed. False (nothing summed) when the wait timed out or the group is
// poisoned. Every low-latency reduction (the all-reduce, the reduce-scatter, the fused call)
// sums through it, so each has the arithmetic of every other algorithm.
template <typename T>
__device__ __forceinline__ bool ll_reduce_line(const SymmArgs& a, uint32_t buffer, uint64_t l, uint4 own,
                                               uint4& sum) {
    constexpr uint32_t PER_LINE = Elem<T>::PER_PACK;
    ulonglong2* source0 = ll_line(a, a.rank, buffer, 0, l);
    const uint64_t slot = a.ll_slot_bytes / sizeof(ulonglong2);
    ulonglong2 w[MAX_RANKS];
    if (!ll_poll_peers(a, source0, slot, line_arrived, w)) return false;
    float acc[PER_LINE];
#pragma unroll
    for (uint32_t q = 0; q < MAX_RANKS; ++q) {
        if (q < a.world) {
            const uint4 x = q == a.rank ? own : as_pack(w[q]);
            if (q == 0) {
                pack_to_float<T>(x, acc);
            } else {
                add_pack<T>(x, acc);
            }
        }
    }
    sum = float_to_pack<T>(acc);
#pragma unroll
    for (uint32_t q = 0; q < MAX_RANKS; ++q) {
        if (q < a.world && q != a.rank) st_line_sys(source0 + q * slot, make_ulonglong2(LL_NOT_ARRIVED, LL_NOT_ARRIVED));
    }
    return true;
}

// `ll_reduce_line`, then the rounded line stored into `out` (n elements; a partial last line
// element by element). False (nothing stored) when the wait failed.
template <typename T>
__device__ __forceinline__ bool ll_sum_line(const SymmArgs& a, uint32_t buffer, uint64_t l, uint4 own, T* out,
                                            uint64_t n, bool out_aligned) {
    constexpr uint32_t PER_LINE = Elem<T>::PER_PACK;
    Pack<T> r;
    if (!ll_reduce_line<T>(a, buffer, l, own, r.bits)) return false;
    if ((l + 1) * PER_LINE <= n) {
        store_pack(out, l, r.bits, out_aligned);
    } else {
#pragma unroll
        for (uint32_t e = 0; e < PER_LINE; ++e) {
            if (l * PER_LINE + e < n) out[l * PER_LINE + e] = r.elems[e];
        }
    }
    return true;
}

// 32-bit word `i` of `in` (elements i * (4 / sizeof(T)) ..), zero-padded past element n.
template <typename T>
__device__ __forceinline__ uint32_t load_word(const T* in, uint64_t n, uint64_t i, bool aligned) {
    constexpr uint32_t PER_WORD = 4 / sizeof(T);
    using B = typename ElemBits<sizeof(T)>::type;
    if (aligned && (i + 1) * PER_WORD <= n) return reinterpret_cast<const uint32_t*>(in)[i];
    union {
        uint32_t bits;
        B elems[PER_WORD];
    } p;
    p.bits = 0;
    const B* src = reinterpret_cast<const B*>(in);
#pragma unroll
    for (uint32_t e = 0; e < PER_WORD; ++e) {
        if (i * PER_WORD + e < n) p.elems[e] = src[i * PER_WORD + e];
    }
    return p.bits;
}

// Waits for word `i` of every peer's slot in this rank's buffer `buffer` (`ll_poll_peers`:
// none reads as the all-ones sentinel any more), sums the words in rank order 0..W-1 in fp32
// (this rank's own word `own` from registers), rounds once into `sum` and re-arms the words it
// consumed: `ll_reduce_line` for one 32-bit word (the word-per-thread readers: the
// all-reduce's and the fused kernel's), element for element the same arithmetic. False
// (nothing summed) when the wait timed out or the group is poisoned.
template <typename T>
__device__ __forceinline__ bool ll_reduce_word(const SymmArgs& a, uint32_t buffer, uint64_t i, uint32_t own,
                                               uint32_t& sum) {
    constexpr uint32_t PER_WORD = 4 / sizeof(T);
    constexpr uint32_t NOT_ARRIVED = 0xffffffffu;
    uint32_t* source0 = ll_word(a, a.rank, buffer, 0, i);
    const uint64_t slot = a.ll_slot_bytes / sizeof(uint32_t);
    uint32_t w[MAX_RANKS];
    if (!ll_poll_peers(a, source0, slot, [](uint32_t x) { return x != NOT_ARRIVED; }, w)) return false;
    float acc[PER_WORD], v[PER_WORD];
#pragma unroll
    for (uint32_t q = 0; q < MAX_RANKS; ++q) {
        if (q < a.world) {
            word_to_float<T>(q == a.rank ? own : w[q], v);
#pragma unroll
            for (uint32_t e = 0; e < PER_WORD; ++e) acc[e] = q == 0 ? v[e] : acc[e] + v[e];
        }
    }
#pragma unroll
    for (uint32_t q = 0; q < MAX_RANKS; ++q) {
        if (q < a.world && q != a.rank) st_relaxed_sys_u32(source0 + q * slot, NOT_ARRIVED);
    }
    sum = float_to_word<T>(acc);
    return true;
}

// The low-latency all-reduce with 32-bit words (every message of at most twice as many words as
// the grid has threads): thread i pushes word i of its input (`own`, loaded by the caller) into
// its slot of every peer's buffer (the policy's `broadcast_word`: W - 1 unicast stores, or one
// multicast store; `ll_all_reduce_word`), then `ll_sum_word` runs `ll_reduce_word`: polls
// word i of every peer's slot in its own buffer until none reads as the all-ones sentinel, sums
// them in rank order 0..W-1 in fp32 (its own word from registers) and re-arms them. 32-bit stores
// are single-copy atomic and the sentinel is a 32-bit word, so a word is either the sentinel or
// the peer's data; word i is where the 16-byte lines keep it, so the region's invariants are those
// stated at `one_shot_ll` (every word a reader reads it re-arms inside the call; a word past the
// message is never written). The sums are element for element those of `ll_reduce_line`, so the
// bits are every other algorithm's. Why words and not lines: each thread's critical path (its sum
// above all) shrinks fourfold, and on the H200 every instruction on it shows (docs/design.md,
// "Words, not lines"). False when the wait failed.
template <typename T>
__device__ __forceinline__ bool ll_sum_word(uint32_t own, T* out, uint64_t n, const SymmArgs& a, uint32_t buffer,
                                            uint64_t i) {
    constexpr uint32_t PER_WORD = 4 / sizeof(T);
    union {
        uint32_t bits;
        T elems[PER_WORD];
    } r;
    if (!ll_reduce_word<T>(a, buffer, i, own, r.bits)) return false;
    if (is_aligned(out, 4) && (i + 1) * PER_WORD <= n) {
        reinterpret_cast<uint32_t*>(out)[i] = r.bits;
    } else {
#pragma unroll
        for (uint32_t e = 0; e < PER_WORD; ++e) {
            if (i * PER_WORD + e < n) out[i * PER_WORD + e] = r.elems[e];
        }
    }
    return true;
}

// The low-latency all-reduce of one 32-bit word (`ll_sum_word` after the push).
template <typename Coll, typename T>
__device__ __forceinline__ bool ll_all_reduce_word(const Coll& coll, uint32_t own, T* out, uint64_t n,
                                                   const SymmArgs& a, uint32_t buffer, uint64_t i) {
    coll.broadcast_word(buffer, i, wire_word(own));
    return ll_sum_word<T>(own, out, n, a, buffer, i);
}

// Low-latency one-shot for small messages: no barrier at all. Every rank pushes its input as
// 16-byte lines into its slot of every peer's buffer `epoch % 3`; each rank polls its slots
// until no word of a line reads as the all-ones sentinel, sums in rank order (its own
// contribution straight from its input), and re-arms the lines it consumed to the sentinel.
//
// Why three buffers suffice, with no clearing pass and no epoch in the lines: a rank is at
// most one call ahead of any peer (a call cannot complete without every peer's data for it),
// so while rank r runs call k its peers write only buffers k % 3 and (k + 1) % 3 of r; buffer
// k % 3 is written next in call k + 3, which no peer can start before r has finished call
// k + 2 — and r re-armed its lines of buffer k % 3 before its call k ended. Setup fills the
// whole region with the sentinel. A thread handles one 32-bit word of the lines
// (`ll_all_reduce_word`, whenever the grid covers the message), two (both pushed, then both
// summed: up to twice the grid's threads) or one 16-byte line per step (a larger message).
//
// The region is shared by every low-latency kernel (this one, `reduce_scatter_ll`,
// `all_gather_ll`, `fused_low_latency`, `two_shot_ll`): line l of slot (buffer, source) is at
// the same place whichever kernel writes it, and every kernel re-arms every line it reads
// before its call ends, while its writers write only lines its readers read (every rank makes
// the same call). So after any sequence of calls every line not in flight holds the sentinel,
// whatever the collectives.
//
// The multicast push (`MultimemColl::broadcast_word`, `broadcast_line`) changes two things,
// and the argument holds for both:
//  * The word or line lands in every rank's slot for this rank, its own slot (owner r, source r)
//    included. That slot is write-only: no rank reads it (the owner takes its contribution
//    from its input, the peers read only their own allocations) and nobody re-arms it, so
//    what it holds never matters. The peers' slots for r are re-armed by their owners as
//    before, and r overwrites them only in call k + 3, two kernel boundaries after the owner's
//    re-arm in call k (the owner's call k completed before it pushed its call k + 2 data,
//    which r needed to finish call k + 2): the same order as the unicast push.
//  * The 16 bytes may land as four 32-bit pieces: `line_arrived` checks 32-bit words.
template <typename Coll, typename T>
__device__ __forceinline__ void one_shot_ll(const T* in, T* out, uint64_t n, const SymmArgs& a) {
    constexpr uint32_t PER_LINE = Elem<T>::PER_PACK;
    const uint64_t lines = (n + PER_LINE - 1) / PER_LINE;
    const PackLoop loop;  // one thread per word or line
    const bool in_aligned = is_aligned(in, 16), out_aligned = is_aligned(out, 16);
    const uint64_t words = (n * sizeof(T) + 3) / 4;
    const bool by_word = Coll::WORDS && words <= loop.step;
    // Two words per thread where the grid covers the message that way: a line per thread would
    // leave three threads of four idle and put four words' sums on one critical path.
    const bool by_two_words = Coll::WORDS && !by_word && words <= 2 * loop.step;
    const uint64_t second = loop.first + loop.step;
    // This thread's first word (in `.x`; its second in `.y`) or line of the input, loaded while
    // `begin_call` reads the call state; it stays in registers as this rank's own contribution.
    uint4 own_first = make_uint4(0, 0, 0, 0);
    const auto prefetch = [&] {
        if (by_word && loop.first < words) {
            own_first.x = load_word(in, n, loop.first, is_aligned(in, 4));
        } else if (by_two_words) {
            // Every thread has a first word (words > the grid's threads).
            own_first.x = load_word(in, n, loop.first, is_aligned(in, 4));
            if (second < words) own_first.y = load_word(in, n, second, is_aligned(in, 4));
        } else if (!by_word && loop.first < lines) {
            own_first = load_line(in, n, loop.first, in_aligned);
        }
    };
    const uint64_t epoch = begin_call(a, prefetch);
    if (epoch == 0) return;
    const uint32_t buffer = static_cast<uint32_t>(epoch % LL_BUFFERS);
    const Coll coll(a, 0);

    if (by_word) {
        // One 32-bit word per thread (`ll_all_reduce_word`); a thread past the message has
        // nothing to wait for and so does not let the next kernel launch.
        if (loop.first < words && ll_all_reduce_word(coll, own_first.x, out, n, a, buffer, loop.first)) pdl_trigger(a);
    } else if (by_two_words) {
        // Two 32-bit words per thread (one where the second lies past the message): both pushed
        // before either is waited for, so the second word's round trip overlaps the first's.
        coll.broadcast_word(buffer, loop.first, wire_word(own_first.x));
        if (second < words) coll.broadcast_word(buffer, second, wire_word(own_first.y));
        if (ll_sum_word(own_first.x, out, n, a, buffer, loop.first) &&
            (second >= words || ll_sum_word(own_first.y, out, n, a, buffer, second))) {
            pdl_trigger(a);
        }
    } else {
        // One 16-byte line per thread and step.
        for (uint64_t l = loop.first; l < lines; l += loop.step) {
            coll.broadcast_line(buffer, l,
                                as_words(wire_pack(l == loop.first ? own_first : load_line(in, n, l, in_aligned))));
        }
        for (uint64_t l = loop.first; l < lines; l += loop.step) {
            const uint4 own = l == loop.first ? own_first : load_line(in, n, l, in_aligned);
            if (!ll_sum_line(a, buffer, l, own, out, n, out_aligned)) break;
        }
        // Every peer's data for this thread's lines has arrived: the next kernel may start
        // launching (not a thread without a line: it has waited for nothing).
        if (loop.first < lines) pdl_trigger(a);
    }
    end_call(a, epoch);
}

// Low-latency reduce-scatter: `in` holds W slices of n elements; rank q's output is the sum
// of slice q over all ranks. Each rank pushes only slice q into its slot of rank q's buffer
// `epoch % 3` (W - 1 slices out, one line of 16 payload bytes per 16 bytes, canonicalised by
// `wire_pack` like the all-reduce's), then polls its own buffer and sums with `ll_sum_line`:
// the arithmetic of `one_shot_ll` and `reduce_scatter`, so the output has the bits of the
// same slice of an all-reduce. Same three-buffer argument as `one_shot_ll`.
template <typename T>
__device__ __forceinline__ void reduce_scatter_ll(const T* in, T* out, uint64_t n, const SymmArgs& a) {
    constexpr uint32_t PER_LINE = Elem<T>::PER_PACK;
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint64_t lines = (n + PER_LINE - 1) / PER_LINE;
    const PackLoop loop;  // one thread per line
    const uint32_t buffer = static_cast<uint32_t>(epoch % LL_BUFFERS);
    // Slice q starts at element q * n: 16-byte aligned only when n is a multiple of a line.
    const bool slices_aligned = is_aligned(in, 16) && n % PER_LINE == 0;
    const bool out_aligned = is_aligned(out, 16);
    const T* own_slice = in + a.rank * n;

    for (uint64_t l = loop.first; l < lines; l += loop.step) {
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (q < a.world && q != a.rank) {
                const ulonglong2 w = as_words(wire_pack(load_line(in + q * n, n, l, slices_aligned)));
                st_line_sys(ll_line(a, q, buffer, a.rank, l), w);
            }
        }
    }
    for (uint64_t l = loop.first; l < lines; l += loop.step) {
        if (!ll_sum_line(a, buffer, l, load_line(own_slice, n, l, slices_aligned), out, n, out_aligned)) break;
    }
    if (loop.first < lines) pdl_trigger(a);  // not a thread that waited for nothing
    end_call(a, epoch);
}

}  // namespace symm
