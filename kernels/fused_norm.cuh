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

// Unfused: `input` holds the all-reduced sums. No workspace, no protocol.
template <typename T>
__device__ __forceinline__ void residual_rmsnorm(const NormArgs& f) {
    __shared__ float red[17];
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
    const auto epoch = begin_call(a);
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

// Fused two-shot: rows are split into W contiguous ranges of ceil(tokens / W); rank q
// reduces range q. Copy-in: block b writes, in every range, the rows block b of the range's
// owner reduces. Start barrier; the owner sums its rows over every peer and keeps the
// rounded sum in its own data buffer (over its own copy of those rows, which no one else
// reads). Middle barrier; every rank reads every range's sums from its owner and runs the
// epilogue on its own residual: the reduction is split, the epilogue is the one-shot's
// arithmetic on the same sums, so the bits are the same.
template <typename T>
__device__ __forceinline__ void fused_two_shot(const NormArgs& f, const SymmArgs& a) {
    __shared__ float red[17];
    const auto epoch = begin_call(a);
    const uint32_t parity = epoch & 1;
    const uint32_t packs = f.hidden / Elem<T>::PER_PACK;
    const uint32_t per_rank = (f.tokens + a.world - 1) / a.world;
    const uint4* src = reinterpret_cast<const uint4*>(f.input);
    uint4* mine = reinterpret_cast<uint4*>(data_buffer(a, a.rank, parity));
    const char* rank0 = data_buffer(a, 0, parity);

#pragma unroll 1
    for (uint32_t q = 0; q < a.world; ++q) {
        for (uint64_t i = blockIdx.x; i < per_rank; i += gridDim.x) {
            const uint64_t row = static_cast<uint64_t>(q) * per_rank + i;
            if (row >= f.tokens) break;
            for (uint32_t k = threadIdx.x; k < packs; k += NORM_THREADS)
                mine[row * packs + k] = src[row * packs + k];
        }
    }
    if (!block_barrier(a, PHASE_START, epoch)) {
        end_call(a, epoch);
        return;
    }
    for (uint64_t i = blockIdx.x; i < per_rank; i += gridDim.x) {
        const uint64_t row = static_cast<uint64_t>(a.rank) * per_rank + i;
        if (row >= f.tokens) break;
        const uint64_t first = row * packs;
        for (uint32_t k = threadIdx.x; k < packs; k += NORM_THREADS) mine[first + k] = sum_ranks<T>(a, rank0, first + k);
    }
    if (block_barrier(a, PHASE_MIDDLE, epoch)) {
#pragma unroll 1
        for (uint32_t q = 0; q < a.world; ++q) {
            const uint4* owner = reinterpret_cast<const uint4*>(rank0 + q * a.stride);
            for (uint64_t i = blockIdx.x; i < per_rank; i += gridDim.x) {
                const uint64_t row = static_cast<uint64_t>(q) * per_rank + i;
                if (row >= f.tokens) break;
                const uint4* sums = owner + row * packs;
                add_rmsnorm_row<T>(f, row, [&](uint32_t k) { return load_peer_pack(sums + k); }, red);
            }
        }
    }
    end_call(a, epoch);
}

}  // namespace symm
