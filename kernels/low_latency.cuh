// Low-latency one-shot: no barrier, the data carries the synchronisation.
#pragma once

#include "elements.cuh"
#include "memory.cuh"
#include "signals.cuh"
#include "unaligned.cuh"

namespace symm {

// Line `l` (8 bytes) of the input, zero-padded past element n.
template <typename T>
__device__ __forceinline__ Half<T> load_line(const T* in, uint64_t n, uint64_t l, bool aligned) {
    constexpr uint32_t PER_LINE = 8 / sizeof(T);
    Half<T> h;
    if (aligned && (l + 1) * PER_LINE <= n) {
        h.bits = reinterpret_cast<const uint2*>(in)[l];
        return h;
    }
    // Tail or unaligned view: assemble the words from raw element bits (constant indices keep it in registers).
    uint32_t w0 = 0, w1 = 0;
#pragma unroll
    for (uint32_t e = 0; e < PER_LINE; ++e) {
        const uint64_t i = l * PER_LINE + e;
        if (i < n) {
            const uint32_t bits = sizeof(T) == 4 ? reinterpret_cast<const uint32_t*>(in)[i]
                                                 : reinterpret_cast<const uint16_t*>(in)[i];
            const uint32_t shift = (e * sizeof(T) % 4) * 8;
            if (e * sizeof(T) < 4) w0 |= bits << shift; else w1 |= bits << shift;
        }
    }
    h.bits = make_uint2(w0, w1);
    return h;
}

// Low-latency one-shot for small messages: no barrier at all. Every rank pushes its input as
// 16-byte lines {d0, epoch, d1, epoch} into a slot of every rank's buffer (its own included),
// then polls its own slots until every line of every source carries this call's epoch, and
// sums in rank order. The arrival of the data is the synchronisation. Slots alternate by epoch
// parity: a rank refills slot p two calls later, and it cannot start that call before every
// peer sent it data for the call in between, which each peer does only after it finished
// reading slot p. One thread handles one 8-byte line.
template <typename T>
__device__ __forceinline__ void one_shot_ll(const T* in, T* out, uint64_t n, const SymmArgs& a) {
    constexpr uint32_t PER_LINE = 8 / sizeof(T);
    const uint64_t lines = (n + PER_LINE - 1) / PER_LINE;
    const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    const bool in_aligned = is_aligned(in, 8), out_aligned = is_aligned(out, 8);
    // Input load of the first line before reading the epoch: the two latencies overlap.
    const Half<T> first_line = load_line(in, n, first, in_aligned);
    const uint32_t epoch = begin_call(a);
    const uint32_t parity = epoch & 1;

    for (uint64_t l = first; l < lines; l += step) {
        const Half<T> h = l == first ? first_line : load_line(in, n, l, in_aligned);
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (q < a.world) st_line_sys(ll_line(a, q, parity, a.rank, l), h.bits.x, h.bits.y, epoch);
        }
    }

    bool ok = true;
    for (uint64_t l = first; ok && l < lines; l += step) {
        uint4 v[MAX_RANKS];
        uint32_t pending = (1u << a.world) - 1;
        uint64_t deadline = 0;
        while (pending != 0) {
#pragma unroll
            for (uint32_t q = 0; q < MAX_RANKS; ++q) {
                if (pending & (1u << q)) {
                    v[q] = ld_line_sys(ll_line(a, a.rank, parity, q, l));
                    if (v[q].y == epoch && v[q].w == epoch) pending &= ~(1u << q);
                }
            }
            if (pending != 0) {
                const uint64_t now = global_timer_ns();
                if (deadline == 0) {
                    deadline = now + a.timeout_ns;
                } else if (now > deadline) {
                    report_timeout(a, PHASE_ARRIVAL, __ffs(pending) - 1);
                    ok = false;
                    break;
                }
            }
        }
        if (!ok) break;
        float acc[PER_LINE];
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (q < a.world) {
                Half<T> h;
                h.bits = make_uint2(v[q].x, v[q].z);
#pragma unroll
                for (uint32_t e = 0; e < PER_LINE; ++e) {
                    const float x = Elem<T>::to_float(h.elems[e]);
                    acc[e] = q == 0 ? x : acc[e] + x;
                }
            }
        }
        Half<T> r;
#pragma unroll
        for (uint32_t e = 0; e < PER_LINE; ++e) r.elems[e] = Elem<T>::from_float(acc[e]);
        if (out_aligned && (l + 1) * PER_LINE <= n) {
            reinterpret_cast<uint2*>(out)[l] = r.bits;
        } else {
#pragma unroll
            for (uint32_t e = 0; e < PER_LINE; ++e) {
                if (l * PER_LINE + e < n) out[l * PER_LINE + e] = r.elems[e];
            }
        }
    }
    end_call(a, epoch);
}

}  // namespace symm
