// Fused all-reduce + residual add + RMSNorm, and the unfused residual + RMSNorm kernel that
// gives the same bits after a plain all-reduce.
//
// Numerics (the contract src/communicator/fused.rs documents; every step is an IEEE
// round-to-nearest-even operation named explicitly, so no flag or contraction changes it):
//   s    = round_T( x_0 + x_1 + ... + x_{W-1} )        fp32 adds in rank order (= all_reduce)
//   r    = round_T( __fadd_rn(float(residual), float(s)) )          -> written to residual
//   ss   = sum over the row of __fmaf_rn(float(r), float(r), acc)  in a FIXED order: thread t
//          of a 512-thread block owns packs t, t+512, ... of the row and accumulates its
//          elements in index order; the 512 partials are summed by a fixed tree (shuffle-down
//          16,8,4,2,1 inside each warp, then the same tree over the 16 warp sums)
//   inv  = __fdiv_rn(1, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, hidden), eps)))
//   out  = round_T( __fmul_rn(float(round_T(__fmul_rn(float(r), inv))), float(weight)) )
//          (Hugging Face Llama's order: normalise, round to the dtype, then scale by weight)
// One block per row (rows b, b + grid, ...): nothing depends on the grid size, so every
// algorithm, every rank and the unfused pair give the same bits.
#pragma once

#include "low_latency.cuh"
#include "reduce.cuh"

namespace symm {

// Mirrors `NormArgs` in src/kernels/fused.rs field for field.
struct NormArgs {
    uint64_t input;     // [tokens, hidden]: this rank's partial sums (unfused: the reduced sums)
    uint64_t residual;  // [tokens, hidden], read and overwritten with residual + sum
    uint64_t weight;    // [hidden]
    uint64_t norm_out;  // [tokens, hidden]
    uint32_t tokens;
    uint32_t hidden;    // a multiple of the dtype's elements per 16-byte pack
    float eps;
    uint32_t reserved;
};

static_assert(sizeof(NormArgs) == 48, "NormArgs: four u64, two u32, f32, u32");

constexpr uint32_t NORM_THREADS = 512;
static_assert(NORM_THREADS == THREADS, "the fused kernels use the common block size (plan/grid.rs)");

// Sum of one float per thread of a 512-thread block by the fixed tree; every thread gets
// the total. `red` is 17 floats of shared memory.
__device__ __forceinline__ float block_sum_fixed(float v, float* red) {
#pragma unroll
    for (uint32_t off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, off));
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < NORM_THREADS / 32 ? red[lane] : 0.0f;
#pragma unroll
        for (uint32_t off = 16; off > 0; off >>= 1) w = __fadd_rn(w, __shfl_down_sync(0xffffffffu, w, off));
        if (lane == 0) red[16] = w;
    }
    __syncthreads();
    const float total = red[16];
    __syncthreads();  // `red` may be reused by the next row
    return total;
}

template <typename T>
__device__ __forceinline__ float round_to(float x) {
    return Elem<T>::to_float(Elem<T>::from_float(x));
}

// The epilogue of one row: `sum_pack(k)` returns pack k of the row's reduced (rounded) sum.
// Pass 1 writes residual + sum (rounded) back to `residual` and accumulates the squares;
// pass 2 re-reads what this same thread wrote and writes the normalised row.
template <typename T, typename SumPack>
__device__ __forceinline__ void add_rmsnorm_row(const NormArgs& f, uint64_t row, SumPack sum_pack, float* red) {
    constexpr uint32_t PER = Elem<T>::PER_PACK;
    const uint32_t packs = f.hidden / PER;
    uint4* res = reinterpret_cast<uint4*>(f.residual) + row * packs;
    uint4* out = reinterpret_cast<uint4*>(f.norm_out) + row * packs;
    const uint4* w = reinterpret_cast<const uint4*>(f.weight);
    float ss = 0.0f;
    for (uint32_t k = threadIdx.x; k < packs; k += NORM_THREADS) {
        const uint4 s = sum_pack(k);
        float sv[PER], rv[PER];
        pack_to_float<T>(s, sv);
        pack_to_float<T>(res[k], rv);
#pragma unroll
        for (uint32_t i = 0; i < PER; ++i) {
            rv[i] = round_to<T>(__fadd_rn(rv[i], sv[i]));
            ss = __fmaf_rn(rv[i], rv[i], ss);
        }
        res[k] = float_to_pack<T>(rv);
    }
    const float total = block_sum_fixed(ss, red);
    const float inv =
        __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(f.hidden)), f.eps)));
    for (uint32_t k = threadIdx.x; k < packs; k += NORM_THREADS) {
        float rv[PER], wv[PER];
        pack_to_float<T>(res[k], rv);
        pack_to_float<T>(__ldg(w + k), wv);
#pragma unroll
        for (uint32_t i = 0; i < PER; ++i) rv[i] = __fmul_rn(round_to<T>(__fmul_rn(rv[i], inv)), wv[i]);
        out[k] = float_to_pack<T>(rv);
    }
}

// Unfused: `input` holds the all-reduced sums. No workspace, no protocol. Launched with
// Programmatic Dependent Launch like every kernel of the table, so it waits for its
// predecessor (the all-reduce that wrote `input`, which lets it launch early) before it reads
// anything.
template <typename T>
__device__ __forceinline__ void residual_rmsnorm(const NormArgs& f) {
    __shared__ float red[17];
    pdl_wait();
    const uint32_t packs = f.hidden / Elem<T>::PER_PACK;
    for (uint64_t row = blockIdx.x; row < f.tokens; row += gridDim.x) {
        const uint4* s = reinterpret_cast<const uint4*>(f.input) + row * packs;
        add_rmsnorm_row<T>(f, row, [&](uint32_t k) { return s[k]; }, red);
    }
}

// Fused one-shot: copy this block's rows in, start barrier, then every row: the rank-order
// sum over every peer's copy (the same `sum_ranks` as all_reduce) and the epilogue.
template <typename T>
__device__ __forceinline__ void fused_one_shot(const NormArgs& f, const SymmArgs& a) {
    __shared__ float red[17];
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint32_t parity = epoch & 1;
    const uint32_t packs = f.hidden / Elem<T>::PER_PACK;
    const uint4* src = reinterpret_cast<const uint4*>(f.input);
    uint4* mine = reinterpret_cast<uint4*>(data_buffer(a, a.rank, parity));
    const char* rank0 = data_buffer(a, 0, parity);

    for (uint64_t row = blockIdx.x; row < f.tokens; row += gridDim.x) {
        for (uint32_t k = threadIdx.x; k < packs; k += NORM_THREADS) mine[row * packs + k] = src[row * packs + k];
    }
    if (block_barrier(a, PHASE_START, epoch)) {
        for (uint64_t row = blockIdx.x; row < f.tokens; row += gridDim.x) {
            const uint64_t base = row * packs;
            add_rmsnorm_row<T>(f, row, [&](uint32_t k) { return sum_ranks<T>(a, rank0, base + k); }, red);
        }
    }
    end_call(a, epoch);
}

// Fused low-latency: no barrier, the lines carry the synchronisation (one_shot_ll's protocol).
// Every rank pushes its partial sums as 16-byte lines (line row * packs + k, canonicalised by
// `wire_pack`) into its slot of every peer's low-latency buffer `epoch % 3`. Then each block
// takes its rows: every thread waits for the lines of its packs, sums them in rank order with
// `ll_reduce_line` (its own contribution from its input; the lines re-armed) and parks the
// rounded sum in this rank's `norm_out`, where the epilogue's first pass reads it back (the
// same thread, the same pack) before its second pass overwrites it. The sums are those of
// every other algorithm and the epilogue is the same, so the bits are too. A wait that failed
// stops the block before the row's epilogue: the residual of that row and of every later row
// of the block is left as it was. The three-buffer argument of `one_shot_ll` holds unchanged:
// every rank writes and reads the same lines, and every line read is re-armed before the call
// ends.
template <typename T>
__device__ __forceinline__ void fused_low_latency(const NormArgs& f, const SymmArgs& a) {
    __shared__ float red[17];
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint32_t buffer = static_cast<uint32_t>(epoch % LL_BUFFERS);
    const uint32_t packs = f.hidden / Elem<T>::PER_PACK;
    const uint4* src = reinterpret_cast<const uint4*>(f.input);
    uint4* sums = reinterpret_cast<uint4*>(f.norm_out);
    const UnicastColl coll(a, 0);

    for (uint64_t row = blockIdx.x; row < f.tokens; row += gridDim.x) {
        for (uint32_t k = threadIdx.x; k < packs; k += NORM_THREADS) {
            const uint64_t l = row * packs + k;
            coll.broadcast_line(buffer, l, as_words(wire_pack(src[l])));
        }
    }
    for (uint64_t row = blockIdx.x; row < f.tokens; row += gridDim.x) {
        int failed = 0;
        for (uint32_t k = threadIdx.x; k < packs; k += NORM_THREADS) {
            const uint64_t l = row * packs + k;
            uint4 s;
            if (ll_reduce_line<T>(a, buffer, l, src[l], s)) {
                sums[l] = s;
            } else {
                failed = 1;
            }
        }
        if (__syncthreads_or(failed)) break;
        add_rmsnorm_row<T>(f, row, [&](uint32_t k) { return sums[row * packs + k]; }, red);
    }
    // Every peer's lines for this call have arrived: the next kernel may start launching.
    pdl_trigger(a);
    end_call(a, epoch);
}

// Fused two-shot: rows are owned in W contiguous ranges of ceil(tokens / W) (rank q owns
// range q), but every phase maps row j to block j % grid, exactly as the one-shot does, so
// block b only ever reads what block b of a peer wrote before a barrier:
//  * copy-in of every row (block j % grid), start barrier;
//  * the owner of row j sums it over every peer and keeps the rounded sum in its own data
//    buffer (over its own copy of the row, which no one else reads);
//  * middle barrier; every rank reads every row's sum from its owner and runs the epilogue
//    with its own residual. The reduction (W-fold NVLink reads) is split across ranks, the
//    epilogue keeps one block per row, and its arithmetic on the same sums is the one-shot's,
//    so the bits are the same.
template <typename T>
__device__ __forceinline__ void fused_two_shot(const NormArgs& f, const SymmArgs& a) {
    __shared__ float red[17];
    const uint64_t epoch = begin_call(a);
    if (epoch == 0) return;
    const uint32_t parity = epoch & 1;
    const uint32_t packs = f.hidden / Elem<T>::PER_PACK;
    const uint32_t per_rank = (f.tokens + a.world - 1) / a.world;
    const uint64_t lo = static_cast<uint64_t>(a.rank) * per_rank;
    const uint64_t hi = lo + per_rank;
    const uint4* src = reinterpret_cast<const uint4*>(f.input);
    uint4* mine = reinterpret_cast<uint4*>(data_buffer(a, a.rank, parity));
    const char* rank0 = data_buffer(a, 0, parity);

    for (uint64_t row = blockIdx.x; row < f.tokens; row += gridDim.x) {
        for (uint32_t k = threadIdx.x; k < packs; k += NORM_THREADS) mine[row * packs + k] = src[row * packs + k];
    }
    if (!block_barrier(a, PHASE_START, epoch)) {
        end_call(a, epoch);
        return;
    }
    for (uint64_t row = blockIdx.x; row < f.tokens; row += gridDim.x) {
        if (row < lo || row >= hi) continue;
        const uint64_t first = row * packs;
        for (uint32_t k = threadIdx.x; k < packs; k += NORM_THREADS) mine[first + k] = sum_ranks<T>(a, rank0, first + k);
    }
    if (block_barrier(a, PHASE_MIDDLE, epoch)) {
        for (uint64_t row = blockIdx.x; row < f.tokens; row += gridDim.x) {
            const uint32_t owner = static_cast<uint32_t>(row / per_rank);
            const uint4* sums = reinterpret_cast<const uint4*>(rank0 + owner * a.stride) + row * packs;
            add_rmsnorm_row<T>(f, row, [&](uint32_t k) { return load_peer_pack(sums + k); }, red);
        }
    }
    end_call(a, epoch);
}

}  // namespace symm
