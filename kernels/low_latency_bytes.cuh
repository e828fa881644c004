// Low-latency all-gather (Lamport style, no barrier) over the low-latency region the
// all-reduce uses, for byte data.
//
// Why the lines carry a flag here: the all-reduce's lines carry 16 payload bytes and rely on
// no 32-bit word of real data being all ones (`wire_pack` turns an all-ones word, NaNs, into
// another NaN pattern, and the sum is a NaN either way). Bytes of fp8, fp4 or int8 may be
// all ones legitimately and must arrive unchanged, so no payload pattern can be reserved.
// Nor can a 16-byte line be {8 payload bytes, 8-byte flag}: a line is stored as two 64-bit
// words, each single-copy atomic but not the pair, so a reader could see the flag word land
// before the payload word. So every 64-bit word carries its own flag: 4 payload bytes in the
// low half, a 32-bit flag in the high half (NCCL's LL layout). The sentinel word (all ones)
// has the flag 0xffffffff; a word of this protocol has the flag `ll_byte_flag(chunk)`, which
// never is. A line thus moves 8 payload bytes, and a word is complete exactly when its flag
// is: no canonicalisation, every byte pattern arrives as sent.
//
// The flag is the sender's chunk length: ranks that disagree on the length (a misuse) never
// accept each other's words and time out (the group is poisoned) rather than read a wrong
// number of lines, which would leave lines armed for a later call of another collective.
#pragma once

#include "low_latency.cuh"

namespace symm {

// Payload bytes per 16-byte line.
constexpr uint32_t LL_BYTES_PER_LINE = 8;

__device__ __forceinline__ uint32_t ll_byte_flag(uint64_t chunk) {
    // The low-latency region bounds a chunk far below 2^31.
    return static_cast<uint32_t>(chunk & 0x7fffffffu);
}

// Bytes [8 l, 8 l + 8) of `in` (n bytes, at any address), zero-padded past n.
__device__ __forceinline__ uint2 load_byte_line(const char* in, uint64_t n, uint64_t l) {
    if ((l + 1) * LL_BYTES_PER_LINE <= n && (reinterpret_cast<uintptr_t>(in) & 7) == 0) {
        return reinterpret_cast<const uint2*>(in)[l];
    }
    uint64_t bytes = 0;
    for (uint32_t k = 0; l * LL_BYTES_PER_LINE + k < n; ++k) {
        bytes |= static_cast<uint64_t>(static_cast<uint8_t>(in[l * LL_BYTES_PER_LINE + k])) << (8 * k);
    }
    return make_uint2(static_cast<uint32_t>(bytes), static_cast<uint32_t>(bytes >> 32));
}

// Bytes of the line at byte `at` of a chunk of `chunk` bytes (8 except for the last line).
__device__ __forceinline__ uint32_t line_bytes(uint64_t chunk, uint64_t at) {
    return chunk - at < LL_BYTES_PER_LINE ? static_cast<uint32_t>(chunk - at) : LL_BYTES_PER_LINE;
}

// Stores the first `count` (<= 8) bytes of `v` at byte `at` of `out` (at any address): one
// 8-byte store where the address allows it, bytes otherwise.
__device__ __forceinline__ void store_byte_line(char* out, uint64_t at, uint2 v, uint32_t count) {
    const uintptr_t to = reinterpret_cast<uintptr_t>(out + at);
    if (count == LL_BYTES_PER_LINE && to % 8 == 0) {
        *reinterpret_cast<uint2*>(out + at) = v;
    } else if (count == LL_BYTES_PER_LINE && to % 4 == 0) {
        reinterpret_cast<uint32_t*>(out + at)[0] = v.x;
        reinterpret_cast<uint32_t*>(out + at)[1] = v.y;
    } else {
        for (uint32_t k = 0; k < count; ++k) out[at + k] = static_cast<char>((k < 4 ? v.x : v.y) >> (8 * (k % 4)));
    }
}

// Every rank's `chunk` bytes into `out` (rank q's at byte q * chunk). Each rank pushes its
// chunk as flagged lines into its slot of every peer's buffer `epoch % 3` and copies it to
// its own place in the output; then it polls its slots until both words of a line carry the
// flag, stores the 8 bytes, and re-arms the line to the sentinel. The three-buffer argument
// and the sharing of the region with the other low-latency kernels are those of
// `one_shot_ll`: the lines are at the same places and every line read is re-armed by its
// reader inside the call.
__device__ __forceinline__ void all_gather_ll(const char* in, char* out, uint64_t chunk, const SymmArgs& a) {
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint64_t lines = (chunk + LL_BYTES_PER_LINE - 1) / LL_BYTES_PER_LINE;
    const PackLoop loop;  // one thread per line
    const uint32_t buffer = static_cast<uint32_t>(epoch % LL_BUFFERS);
    const uint64_t flag = static_cast<uint64_t>(ll_byte_flag(chunk)) << 32;

    for (uint64_t l = loop.first; l < lines; l += loop.step) {
        const uint2 v = load_byte_line(in, chunk, l);
        const ulonglong2 w = make_ulonglong2(flag | v.x, flag | v.y);
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (q < a.world && q != a.rank) st_line_sys(ll_line(a, q, buffer, a.rank, l), w);
        }
        const uint64_t at = l * LL_BYTES_PER_LINE;
        store_byte_line(out, a.rank * chunk + at, v, line_bytes(chunk, at));
    }

    for (uint64_t l = loop.first; l < lines; l += loop.step) {
        const uint64_t at = l * LL_BYTES_PER_LINE;
        const uint32_t count = line_bytes(chunk, at);
        ulonglong2 w[MAX_RANKS];
        const auto arrived = [&](ulonglong2 x) {
            return (x.x & ~0xffffffffull) == flag && (x.y & ~0xffffffffull) == flag;
        };
        if (!ll_wait_peers(a, buffer, l, arrived, w)) break;
#pragma unroll
        for (uint32_t q = 0; q < MAX_RANKS; ++q) {
            if (q < a.world && q != a.rank) {
                const uint2 v = make_uint2(static_cast<uint32_t>(w[q].x), static_cast<uint32_t>(w[q].y));
                store_byte_line(out, q * chunk + at, v, count);
                st_line_sys(ll_line(a, a.rank, buffer, q, l), make_ulonglong2(LL_NOT_ARRIVED, LL_NOT_ARRIVED));
            }
        }
    }
    if (loop.first < lines) pdl_trigger(a);  // not a thread that waited for nothing
    end_call(a, epoch);
}

}  // namespace symm
