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

// The most 16-byte packs of its rows one block of the fused low-latency kernel keeps in shared
// memory (8 KiB); a block whose share of one row is larger parks it in `norm_out`.
constexpr uint32_t FUSED_LL_STASH_PACKS = 512;
// The most rows a cluster takes through one cluster barrier (a group).
constexpr uint32_t FUSED_LL_GROUP = 8;
// The largest cluster (plan/fused.rs `MAX_CLUSTER`).
constexpr uint32_t FUSED_LL_MAX_CLUSTER = 8;

// A refused call's block in a cluster of the fused low-latency kernel: the barriers of the
// cluster's first group with its failure flag set (so every block of the cluster stops after
// that group), touching no global memory.
__device__ __forceinline__ void fused_ll_stand_down(float (&failures)[2][FUSED_LL_MAX_CLUSTER], uint32_t cluster) {
    cluster_wait();
    if (threadIdx.x == 0) {
        for (uint32_t k = 0; k < cluster; ++k) st_cluster_f32(&failures[0][blockIdx.x % cluster], k, 1.0f);
    }
    cluster_sync();
}

// Fused low-latency: no barrier between ranks, the words carry the synchronisation (the
// protocol of `one_shot_ll`), and a row is spread over the `f.cluster` blocks of a
// thread-block cluster (one block where the device has no clusters).
//
// Ownership keeps the bits of the one-block tree: the row's sum of squares is the fixed tree over
// 512 *virtual* threads (virtual thread v accumulates packs v, v + 512, ... in index order, the
// warp sums of the 16 virtual warps are summed by the same tree). Block c of a cluster of C owns
// virtual threads [c·512/C, (c+1)·512/C) — 16/C whole virtual warps — and with them their packs:
// its local pack q is pack c·512/C + q % (512/C) + 512·(q / (512/C)) of the row.
//
// Rows: cluster k of K takes rows k, k + K, ... (every block of a cluster the same rows), in
// groups of up to `FUSED_LL_GROUP` rows that fit the block's 8 KiB of shared memory (one row
// where a block's share of a row does not: it is parked in `norm_out`). The block's threads
// first push this rank's input of every row into every peer's slot: a 32-bit word of a local
// pack each (`broadcast_word`; neighbouring threads, neighbouring words) where that gives a
// thread at most one word, else a whole 16-byte line each (`broadcast_line`: a quarter of the
// stores). Then per group, the same way: poll every peer's word or line, sum in rank order and
// re-arm (`ll_reduce_word` / `ll_reduce_line`, the all-reduce's arithmetic), add the residual
// (rounded) and keep the result in shared memory; the virtual threads' chains run in index order
// over it, each warp sums its 32 chains (`warp_sum_fixed`) and stores the virtual warp's sum
// into every block of the cluster (distributed shared memory); one cluster barrier for the
// group; every warp sums the 16 of the row it writes (`warp_sums_total_fixed`) and the block
// writes its share of the residual and of the normalised rows. The sums, the residual and the tree are those of
// every other fused kernel and of the unfused pair, so the bits are too.
//
// The sums of the two groups in flight sit in two halves of `red` (a block can be one group ahead
// of another, never two). A failed wait in any block sets its flag for the group, every block
// reads all C flags after the barrier, and the whole cluster stops at that group (the residual
// of its rows and of every later row left as it was). The entry barrier (arrive at the top,
// wait before the first remote store) makes sure every block of the cluster runs before
// anything is stored into its shared memory. A refused call (`begin_call`: poison, exhausted
// epochs, a failed divergence check; decided per block) still takes part in the cluster's
// barriers, touching no global memory, so blocks of one cluster that decided differently
// neither wait for an exited block nor store into one.
//
// The low-latency region: the words are those of the lines (word 4l + k of line l = row ·
// packs + pack), each block reads exactly the words of its own packs, which every peer's
// same-shaped call writes (by word or by line: the same words), and re-arms each, so
// `one_shot_ll`'s three-buffer argument holds unchanged, whatever the cluster size on each rank.
template <typename T>
__device__ __forceinline__ void fused_low_latency(const NormArgs& f, const SymmArgs& a) {
    constexpr uint32_t PER_WORD = 4 / sizeof(T);
    constexpr uint32_t PER_PACK = Elem<T>::PER_PACK;
    // [group parity][row of the group][virtual warp]: the virtual warps' sums of squares.
    __shared__ float red[2][FUSED_LL_GROUP][NORM_THREADS / 32];
    // [group parity][block of the cluster]: that block's failure flag for the group.
    __shared__ float failures[2][FUSED_LL_MAX_CLUSTER];
    __shared__ uint4 stash[FUSED_LL_STASH_PACKS];
    const uint32_t cluster = f.cluster;
    const uint32_t c = blockIdx.x % cluster;
    cluster_arrive_relaxed();
    const uint32_t packs = f.hidden / PER_PACK;
    // The cluster is a power of two (plan/fused.rs), so is this block's count of virtual threads.
    const uint32_t nv = NORM_THREADS / cluster;
    const uint32_t nv_shift = __ffs(nv) - 1;
    const uint32_t stripes = (packs + NORM_THREADS - 1) / NORM_THREADS;
    const uint32_t local_packs = nv * stripes;
    const uint32_t first_row = blockIdx.x / cluster, row_step = gridDim.x / cluster;
    const uint32_t rows = first_row < f.tokens ? (f.tokens - first_row + row_step - 1) / row_step : 0;
    const bool stashed = local_packs <= FUSED_LL_STASH_PACKS;
    const uint32_t group = stashed ? min(FUSED_LL_GROUP, FUSED_LL_STASH_PACKS / local_packs) : 1;
    // Lines where words would give a thread more than one (measured: 8192 × 1 bf16 on a
    // cluster of 4 blocks, 2 words a thread, 6.7 µs by lines and 7.9 by words): items are
    // local packs (lines), else words (4 per local pack).
    const bool by_line = static_cast<uint64_t>(rows) * local_packs * 4 > static_cast<uint64_t>(blockDim.x);
    const uint32_t per_row = by_line ? local_packs : local_packs * 4;
    const uint32_t* in = reinterpret_cast<const uint32_t*>(f.input);
    uint32_t* res = reinterpret_cast<uint32_t*>(f.residual);
    uint32_t* out = reinterpret_cast<uint32_t*>(f.norm_out);
    const uint32_t* weight = reinterpret_cast<const uint32_t*>(f.weight);
    const uint4* in4 = reinterpret_cast<const uint4*>(f.input);
    uint4* res4 = reinterpret_cast<uint4*>(f.residual);
    uint4* out4 = reinterpret_cast<uint4*>(f.norm_out);
    const uint4* weight4 = reinterpret_cast<const uint4*>(f.weight);
    uint32_t* stash_words = reinterpret_cast<uint32_t*>(stash);
    const UnicastColl coll(a, 0);
    // Item x of a row (a local pack, or word x % 4 of local pack x / 4) -> its pack in the row
    // (`packs` or more past the row).
    const auto pack_of = [&](uint32_t x) {
        const uint32_t q = by_line ? x : x >> 2;
        return c * nv + (q & (nv - 1)) + NORM_THREADS * (q >> nv_shift);
    };
    // Row j of this cluster's rows -> the row.
    const auto row_of = [&](uint32_t j) { return first_row + static_cast<uint64_t>(j) * row_step; };
    // A thread walks items i = threadIdx.x, + blockDim.x, ... of a run of rows as (row j of the
    // run, item x of the row), without dividing: `walk` carries x past the row's end into the
    // next rows (the block has at most 512 threads, a row at least 64 items).
    const auto walk = [&](uint32_t& j, uint32_t& x) {
        while (x >= per_row) {
            x -= per_row;
            ++j;
        }
    };
    // This thread's first item of the input (the first it pushes) and the weight of its first
    // item (the same in every row), loaded while `begin_call` reads the call state.
    uint4 own0 = make_uint4(0, 0, 0, 0), weight_first = make_uint4(0, 0, 0, 0);
    uint32_t j0_first = 0, x_first = threadIdx.x;
    walk(j0_first, x_first);
    const uint32_t p_first = j0_first < rows ? pack_of(x_first) : packs;
    const auto prefetch = [&] {
        if (p_first < packs) {
            const uint64_t l = row_of(j0_first) * packs + p_first;
            if (by_line) {
                own0 = in4[l];
                weight_first = __ldg(weight4 + p_first);
            } else {
                own0.x = in[l * 4 + x_first % 4];
                weight_first.x = __ldg(weight + p_first * 4 + x_first % 4);
            }
        }
    };
    const uint64_t epoch = begin_call(a, prefetch);
    if (epoch == 0) return fused_ll_stand_down(failures, cluster);
    const uint32_t buffer = static_cast<uint32_t>(epoch % LL_BUFFERS);

    for (uint32_t i = threadIdx.x, j = 0, x = threadIdx.x; i < rows * per_row; i += blockDim.x, x += blockDim.x) {
        walk(j, x);
        const uint32_t p = pack_of(x);
        if (p >= packs) continue;
        const uint64_t l = row_of(j) * packs + p;
        if (by_line) {
            coll.broadcast_line(buffer, l, as_words(wire_pack(i == threadIdx.x ? own0 : in4[l])));
        } else {
            const uint64_t w = l * 4 + x % 4;
            coll.broadcast_word(buffer, w, wire_word(i == threadIdx.x ? own0.x : in[w]));
        }
    }
    uint32_t parity = 0;
    for (uint32_t j0 = 0; j0 < rows; j0 += group, parity ^= 1) {
        const uint32_t in_group = min(group, rows - j0);
        const uint32_t items = in_group * per_row;
        int failed = 0;
        for (uint32_t i = threadIdx.x, j = 0, x = threadIdx.x; i < items && !failed; i += blockDim.x, x += blockDim.x) {
            walk(j, x);
            const uint32_t p = pack_of(x);
            if (p >= packs) continue;
            const uint64_t l = row_of(j0 + j) * packs + p;
            // residual + the rounded sum (the all-reduce's output), rounded, kept until the
            // cluster knows every wait of the group passed: only then is the residual written.
            if (by_line) {
                const uint4 residual = res4[l];
                uint4 reduced;
                if (!ll_reduce_line<T>(a, buffer, l, in4[l], reduced)) {
                    failed = 1;
                    continue;
                }
                float v[PER_PACK], r[PER_PACK];
                pack_to_float<T>(reduced, v);
                pack_to_float<T>(residual, r);
#pragma unroll
                for (uint32_t e = 0; e < PER_PACK; ++e) r[e] = __fadd_rn(r[e], v[e]);
                const uint4 sum = float_to_pack<T>(r);
                if (stashed) {
                    stash[j * local_packs + x] = sum;
                } else {
                    out4[l] = sum;
                }
            } else {
                const uint64_t w = l * 4 + x % 4;
                const uint32_t residual = res[w];
                uint32_t reduced;
                if (!ll_reduce_word<T>(a, buffer, w, in[w], reduced)) {
                    failed = 1;
                    continue;
                }
                float v[PER_WORD], r[PER_WORD];
                word_to_float<T>(reduced, v);
                word_to_float<T>(residual, r);
#pragma unroll
                for (uint32_t e = 0; e < PER_WORD; ++e) r[e] = __fadd_rn(r[e], v[e]);
                const uint32_t sum = float_to_word<T>(r);
                if (stashed) {
                    stash_words[j * per_row + x] = sum;
                } else {
                    out[w] = sum;
                }
            }
        }
        failed = __syncthreads_or(failed);
        // Every peer's data for this block's last group has arrived: the next kernel may start
        // launching (what remains waits only for blocks of this cluster, all running).
        if (!failed && j0 + group >= rows) pdl_trigger(a);
        if (j0 == 0) cluster_wait();  // the entry barrier: every block of the cluster runs

        // The virtual threads' chains (virtual thread v of row j: item j·nv + v; nv is a
        // multiple of 32 and so is the block, so every warp takes whole virtual warps of one
        // row, all its lanes together), in index order over shared memory.
        for (uint32_t i = threadIdx.x; i < in_group * nv; i += blockDim.x) {
            const uint32_t j = i >> nv_shift, v = i & (nv - 1);
            float ss = 0.0f;
            for (uint32_t s = 0; s < stripes; ++s) {
                const uint32_t p = c * nv + v + NORM_THREADS * s;
                if (p >= packs) break;
                float x[PER_PACK];
                pack_to_float<T>(stashed ? stash[j * local_packs + v + nv * s] : out4[row_of(j0 + j) * packs + p], x);
#pragma unroll
                for (uint32_t e = 0; e < PER_PACK; ++e) ss = __fmaf_rn(x[e], x[e], ss);
            }
            ss = warp_sum_fixed(ss);
            if (threadIdx.x % 32 == 0) {
                const uint32_t vw = c * (nv / 32) + v / 32;
                for (uint32_t k = 0; k < cluster; ++k) st_cluster_f32(&red[parity][j][vw], k, ss);
            }
        }
        if (threadIdx.x == 0) {
            for (uint32_t k = 0; k < cluster; ++k) st_cluster_f32(&failures[parity][c], k, failed ? 1.0f : 0.0f);
        }
        cluster_sync();
        bool any_failed = false;
        for (uint32_t k = 0; k < cluster; ++k) any_failed |= failures[parity][k] != 0.0f;
        if (any_failed) break;
        // Items i of a warp are 32 consecutive ones of one row (rows of items are a multiple of
        // 32, and so is the block), so each warp sums the 16 of its row, all its lanes together.
        for (uint32_t i = threadIdx.x, j = 0, x = threadIdx.x; i < items; i += blockDim.x, x += blockDim.x) {
            walk(j, x);
            const float total = warp_sums_total_fixed(red[parity][j]);
            const float inv =
                __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(f.hidden)), f.eps)));
            const uint32_t p = pack_of(x);
            if (p >= packs) continue;
            const uint64_t l = row_of(j0 + j) * packs + p;
            if (by_line) {
                const uint4 sum = stashed ? stash[j * local_packs + x] : out4[l];
                res4[l] = sum;
                float r[PER_PACK], g[PER_PACK];
                pack_to_float<T>(sum, r);
                pack_to_float<T>(j0 == 0 && i == threadIdx.x ? weight_first : __ldg(weight4 + p), g);
#pragma unroll
                for (uint32_t e = 0; e < PER_PACK; ++e) r[e] = __fmul_rn(round_to<T>(__fmul_rn(r[e], inv)), g[e]);
                out4[l] = float_to_pack<T>(r);
            } else {
                const uint64_t w = l * 4 + x % 4;
                const uint32_t sum = stashed ? stash_words[j * per_row + x] : out[w];
                res[w] = sum;
                float r[PER_WORD], g[PER_WORD];
                word_to_float<T>(sum, r);
                word_to_float<T>(j0 == 0 && i == threadIdx.x ? weight_first.x : __ldg(weight + p * 4 + x % 4), g);
#pragma unroll
                for (uint32_t e = 0; e < PER_WORD; ++e) r[e] = __fmul_rn(round_to<T>(__fmul_rn(r[e], inv)), g[e]);
                out[w] = float_to_word<T>(r);
            }
        }
        __syncthreads();  // `stash` is refilled by the next group
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
