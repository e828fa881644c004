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
    uint32_t cluster;   // the fused low-latency kernel: blocks per row (a thread-block cluster); else 1
};

static_assert(sizeof(NormArgs) == 48, "NormArgs: four u64, two u32, f32, u32");

constexpr uint32_t NORM_THREADS = 512;
static_assert(NORM_THREADS == THREADS, "the fused kernels use the common block size (plan/grid.rs)");

// The fixed tree, stage 1: one warp's 32 floats summed by shuffle-down 16, 8, 4, 2, 1; lane 0
// holds the warp's sum.
__device__ __forceinline__ float warp_sum_fixed(float v) {
#pragma unroll
    for (uint32_t off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, off));
    return v;
}

// The fixed tree, stage 2: the 16 warp sums `red[0..16)` summed by the same shuffle-down tree
// over one warp (lanes 16..31 add zeros); every lane of the calling warp gets lane 0's total.
__device__ __forceinline__ float warp_sums_total_fixed(const float* red) {
    const uint32_t lane = threadIdx.x % 32;
    float w = lane < NORM_THREADS / 32 ? red[lane] : 0.0f;
#pragma unroll
    for (uint32_t off = 16; off > 0; off >>= 1) w = __fadd_rn(w, __shfl_down_sync(0xffffffffu, w, off));
    return __shfl_sync(0xffffffffu, w, 0);
}

// Sum of one float per thread of a 512-thread block by the fixed tree; every thread gets
// the total. `red` is 17 floats of shared memory.
__device__ __forceinline__ float block_sum_fixed(float v, float* red) {
    v = warp_sum_fixed(v);
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const float w = warp_sums_total_fixed(red);
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
        pdl_trigger(a);
        for (uint64_t row = blockIdx.x; row < f.tokens; row += gridDim.x) {
            const uint64_t base = row * packs;
            add_rmsnorm_row<T>(f, row, [&](uint32_t k) { return sum_ranks<T>(a, rank0, base + k); }, red);
        }
    }
    end_call(a, epoch);
}

// The most 16-byte packs of a row one block of the fused low-latency kernel keeps in shared
// memory (8 KiB); a larger share is parked in `norm_out`.
constexpr uint32_t FUSED_LL_STASH_PACKS = 512;

// A refused call's block in a cluster of the fused low-latency kernel: the barriers of the
// cluster's first row with its failure flag set (so every block of the cluster stops after
// that row), touching no global memory.
__device__ __forceinline__ void fused_ll_stand_down(float (&red)[2][24], uint32_t cluster) {
    cluster_wait();
    if (threadIdx.x == 0) {
        for (uint32_t k = 0; k < cluster; ++k) st_cluster_f32(&red[0][16 + blockIdx.x % cluster], k, 1.0f);
    }
    cluster_sync();
}

// Fused low-latency: no barrier between ranks, the words carry the synchronisation (the
// protocol of `ll_all_reduce_word`), and a row is spread over the `f.cluster` blocks of a
// thread-block cluster (one block where the device has no clusters).
//
// Ownership keeps the bits of the one-block tree: the row's sum of squares is the fixed tree over
// 512 *virtual* threads (virtual thread v accumulates packs v, v + 512, ... in index order, the
// warp sums of the 16 virtual warps are summed by the same tree). Block c of a cluster of C owns
// virtual threads [c·512/C, (c+1)·512/C) — 16/C whole virtual warps — and with them their packs.
// Its threads first handle those packs a 32-bit word each (local word m is word m % 4 of local
// pack m / 4; local pack q is pack c·512/C + q % (512/C) + 512·(q / (512/C)), so neighbouring
// threads touch neighbouring words): push the word of this rank's input into every peer's slot,
// then per row poll every peer's word, sum in rank order and re-arm (`ll_reduce_word`, the
// all-reduce's arithmetic), add the residual (rounded) and park the result in shared memory (past
// 512 packs per block: in `norm_out`). Then the block's first 512/C threads run their virtual
// threads' chains over it, each warp of them sums its 32 chains (`warp_sum_fixed`) and stores the
// virtual warp's sum into every block of the cluster (distributed shared memory); after one
// cluster barrier every warp sums the 16 (`warp_sums_total_fixed`) and the block writes its words
// of the residual and of the normalised row. The sums, the residual and the tree are those of
// every other fused kernel and of the unfused pair, so the bits are too.
//
// Rows: cluster k of K takes rows k, k + K, ... (every block of a cluster the same rows). Each
// row costs one cluster barrier; the sums of the two rows in flight sit in two halves of `red`
// (a block can be one row ahead of another, never two). A failed wait in any block sets its
// flag for the row, every block reads all C flags after the barrier, and the whole cluster
// stops at that row (the residual of that row and of every later row left as it was). The
// entry barrier (arrive at the top, wait before the first remote store) makes sure every
// block of the cluster runs before anything is stored into its shared memory. A refused
// call (`begin_call`: poison, exhausted epochs, a failed divergence check; decided per block)
// still takes part in the cluster's barriers, touching no global memory, so blocks of one
// cluster that decided differently neither wait for an exited block nor store into one.
//
// The low-latency region: the words are those of the lines (word 4l + k of line l = row ·
// packs + pack), each block reads exactly the words of its own packs, which every peer's
// same-shaped call writes, and re-arms each, so `one_shot_ll`'s three-buffer argument holds
// unchanged, whatever the cluster size on each rank.
template <typename T>
__device__ __forceinline__ void fused_low_latency(const NormArgs& f, const SymmArgs& a) {
    constexpr uint32_t PER_WORD = 4 / sizeof(T);
    // [row parity][0..16): the virtual warps' sums; [16 + c]: block c's failure flag.
    __shared__ float red[2][24];
    __shared__ uint4 stash[FUSED_LL_STASH_PACKS];
    const uint32_t cluster = f.cluster;
    const uint32_t c = blockIdx.x % cluster;
    cluster_arrive_relaxed();
    const uint32_t packs = f.hidden / Elem<T>::PER_PACK;
    const uint32_t nv = NORM_THREADS / cluster;  // this block's virtual threads
    const uint32_t stripes = (packs + NORM_THREADS - 1) / NORM_THREADS;
    const uint32_t local_words = nv * stripes * 4;
    const uint32_t first_row = blockIdx.x / cluster, row_step = gridDim.x / cluster;
    const uint32_t* in = reinterpret_cast<const uint32_t*>(f.input);
    uint32_t* res = reinterpret_cast<uint32_t*>(f.residual);
    uint32_t* out = reinterpret_cast<uint32_t*>(f.norm_out);
    const uint32_t* weight = reinterpret_cast<const uint32_t*>(f.weight);
    uint32_t* words = reinterpret_cast<uint32_t*>(stash);
    // Where this block's share of a row does not fit `stash` (a row of more than 512 packs
    // per block: no clusters, or a small block limit), it is parked in `norm_out` instead
    // (this block's own global stores, visible to it after `__syncthreads`; each word is
    // overwritten by the normalised one by the thread that parked it).
    const bool stashed = local_words <= FUSED_LL_STASH_PACKS * 4;
    const uint4* parked = reinterpret_cast<const uint4*>(f.norm_out);
    const UnicastColl coll(a, 0);
    // Local word m -> the word's index in the row (pack * 4 + k), or ~0u past the row.
    const auto row_word = [&](uint32_t m) {
        const uint32_t q = m / 4;
        const uint32_t pack = c * nv + q % nv + NORM_THREADS * (q / nv);
        return pack < packs ? pack * 4 + m % 4 : ~0u;
    };
    // This thread's first input word (of its first row) and the weight word of its first local
    // word (the same in every row), loaded while `begin_call` reads the call state: the input's
    // latency overlaps the state load's, the weight's is not paid after the cluster barrier.
    const uint32_t w0 = threadIdx.x < local_words ? row_word(threadIdx.x) : ~0u;
    uint32_t in0 = 0, weight0 = 0;
    const auto prefetch = [&] {
        if (w0 != ~0u) {
            if (first_row < f.tokens) in0 = in[first_row * packs * 4 + w0];
            weight0 = __ldg(weight + w0);
        }
    };
    const uint64_t epoch = begin_call(a, prefetch);
    if (epoch == 0) return fused_ll_stand_down(red, cluster);
    const uint32_t buffer = static_cast<uint32_t>(epoch % LL_BUFFERS);

    for (uint64_t row = first_row; row < f.tokens; row += row_step) {
        for (uint32_t m = threadIdx.x; m < local_words; m += blockDim.x) {
            const uint32_t w = row_word(m);
            const uint64_t i = row * packs * 4 + w;
            if (w != ~0u) coll.broadcast_word(buffer, i, wire_word(row == first_row && m == threadIdx.x ? in0 : in[i]));
        }
    }
    uint32_t parity = 0;
    for (uint64_t row = first_row; row < f.tokens; row += row_step, parity ^= 1) {
        const uint64_t base = row * packs * 4;
        int failed = 0;
        for (uint32_t m = threadIdx.x; m < local_words; m += blockDim.x) {
            const uint32_t w = row_word(m);
            if (w == ~0u || failed) continue;
            const uint32_t residual = res[base + w];
            uint32_t reduced;
            if (!ll_reduce_word<T>(a, buffer, base + w, in[base + w], reduced)) {
                failed = 1;
                continue;
            }
            // residual + the rounded sum (the all-reduce's output), rounded.
            float v[PER_WORD], r[PER_WORD];
            word_to_float<T>(reduced, v);
            word_to_float<T>(residual, r);
#pragma unroll
            for (uint32_t e = 0; e < PER_WORD; ++e) r[e] = __fadd_rn(r[e], v[e]);
            // Parked until the cluster knows every wait of the row passed: only then is the
            // residual written.
            const uint32_t sum = float_to_word<T>(r);
            if (stashed) {
                words[m] = sum;
            } else {
                out[base + w] = sum;
            }
        }
        failed = __syncthreads_or(failed);
        // Every peer's words for this block's last row have arrived: the next kernel may start
        // launching (what remains waits only for blocks of this cluster, all running).
        if (!failed && row + row_step >= f.tokens) pdl_trigger(a);

        // This block's virtual threads: their chains, in index order, over shared memory.
        float ss = 0.0f;
        if (threadIdx.x < nv) {
            // Local pack q = threadIdx.x + nv·j is `row_word`'s pack with q % nv and q / nv
            // written out (through the lambda the compiler divides by nv: ~140 more SASS).
            for (uint32_t j = 0; j < stripes; ++j) {
                if (c * nv + threadIdx.x + NORM_THREADS * j >= packs) break;
                float x[Elem<T>::PER_PACK];
                const uint32_t q = threadIdx.x + nv * j;
                pack_to_float<T>(stashed ? stash[q] : parked[row * packs + c * nv + threadIdx.x + NORM_THREADS * j], x);
#pragma unroll
                for (uint32_t e = 0; e < Elem<T>::PER_PACK; ++e) ss = __fmaf_rn(x[e], x[e], ss);
            }
        }
        ss = warp_sum_fixed(ss);
        if (row == first_row) cluster_wait();  // the entry barrier: every block of the cluster runs
        if (threadIdx.x < nv && threadIdx.x % 32 == 0) {
            const uint32_t vw = c * (nv / 32) + threadIdx.x / 32;
            for (uint32_t k = 0; k < cluster; ++k) st_cluster_f32(&red[parity][vw], k, ss);
        }
        if (threadIdx.x == 0) {
            for (uint32_t k = 0; k < cluster; ++k) st_cluster_f32(&red[parity][16 + c], k, failed ? 1.0f : 0.0f);
        }
        cluster_sync();
        bool any_failed = false;
        for (uint32_t k = 0; k < cluster; ++k) any_failed |= red[parity][16 + k] != 0.0f;
        if (any_failed) break;
        const float total = warp_sums_total_fixed(red[parity]);
        const float inv =
            __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(f.hidden)), f.eps)));
        for (uint32_t m = threadIdx.x; m < local_words; m += blockDim.x) {
            const uint32_t w = row_word(m);
            if (w == ~0u) continue;
            float r[PER_WORD], g[PER_WORD];
            const uint32_t sum = stashed ? words[m] : out[base + w];
            res[base + w] = sum;
            word_to_float<T>(sum, r);
            word_to_float<T>(m == threadIdx.x ? weight0 : __ldg(weight + w), g);
#pragma unroll
            for (uint32_t e = 0; e < PER_WORD; ++e) r[e] = __fmul_rn(round_to<T>(__fmul_rn(r[e], inv)), g[e]);
            out[base + w] = float_to_word<T>(r);
        }
        __syncthreads();  // `stash` is refilled by the next row
    }
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
    pdl_trigger(a);
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
