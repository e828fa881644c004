// The multimem (NVLS) collective policy: the same kernel bodies as `UnicastColl` (coll.cuh),
// with the reduction and the broadcast done by the NVSwitch. Every rank's workspace allocation
// is bound to one driver multicast object (src/symmetric/multicast.rs); its multicast address
// (`SymmArgs::mc_base`) mirrors one allocation, so a buffer is at the same offset through it as
// through `rank_alloc`, and a multimem access to `mc + off` touches `off` of every rank's
// allocation.
//
//  * load_reduce:     one `multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.{bf16x2,f16x2}`
//                     (fp32 accumulation in the switch) or `.add.v4.f32`. Never the 16-bit form
//                     without `.acc::f32` (it accumulates in bf16), never `multimem.red` for data.
//  * broadcast_store: one `multimem.st.relaxed.sys.global.v4`.
//  * broadcast_line:  one `multimem.st.relaxed.sys.global.v4` of the 16-byte low-latency line
//                     into this rank's slot of every rank's low-latency buffer, its own included
//                     (see low_latency.cuh for why that own copy is harmless).
//  * broadcast_word:  one `multimem.st.relaxed.sys.global.b32` of a 32-bit low-latency word,
//                     likewise (the low-latency all-reduce's word-per-thread path).
//  * barrier:         one `multimem.red.release.sys.global.add.u64` of 1 on a per-(phase, block)
//                     multicast counter (it adds 1 to every rank's copy), then an acquire wait
//                     (.sys) on this rank's own copy through its unicast address until it holds
//                     the per-block arrival total kept by the owner. The counter only grows (no
//                     reset, no wrap in 2^64 arrivals); the target is kept per block, so the grid
//                     may change between calls (every rank launches the same grid per call).
//  * one `fence.proxy.alias` per barrier, in thread 0 only, after its wait has seen every
//    arrival (why one, and why there: `barrier_impl`).
//
// The summation order inside the switch is unspecified: results of `load_reduce` are identical
// on every rank (each element is reduced once and broadcast) but not guaranteed bit-identical to
// the peer-pointer kernels, which sum in rank order. `Config::reproducible` keeps `Auto` away
// from the kernels that use it (not from the low-latency one, which sums in rank order).
//
// sm_90 or newer only: every multimem instruction is guarded by __CUDA_ARCH__ >= 900, and the
// instantiation file (multimem.cu) is compiled only for those targets (min-arch 90).
#pragma once

#include "coll.cuh"

namespace symm {

// Multicast barrier counters inside every rank's allocation, between the call state and the
// data buffers (src/symmetric/multicast.rs holds the same numbers and checks them against the
// layout): [phase][block] u64 counters 64 bytes apart, reached through `mc`, then the owner's
// per-(phase, block) arrival totals, reached only through the unicast address.
constexpr uint64_t MC_SIGNAL_OFFSET = 49152;
constexpr uint64_t MC_SIGNAL_STRIDE = 64;
constexpr uint64_t MC_EXPECTED_OFFSET = 61440;
constexpr uint32_t MC_PHASES = 3;

static_assert(MC_SIGNAL_OFFSET + MC_PHASES * MAX_BLOCKS * MC_SIGNAL_STRIDE <= MC_EXPECTED_OFFSET,
              "multicast counters overlap the arrival totals");
static_assert(MC_EXPECTED_OFFSET + MC_PHASES * MAX_BLOCKS * 8 <= 65536, "multicast counters reach the data");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SYMM_MULTIMEM 1
#else
#define SYMM_MULTIMEM 0
#endif

template <typename T>
struct Multimem;

template <>
struct Multimem<float> {
    __device__ static __forceinline__ uint4 ld_reduce(const void* p) {
        uint4 v;
#if SYMM_MULTIMEM
        float x, y, z, w;
        asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(x), "=f"(y), "=f"(z), "=f"(w)
                     : "l"(p)
                     : "memory");
        v = make_uint4(__float_as_uint(x), __float_as_uint(y), __float_as_uint(z), __float_as_uint(w));
#else
        (void)p;
        __trap();
        v = make_uint4(0, 0, 0, 0);
#endif
        return v;
    }
};

template <>
struct Multimem<__nv_bfloat16> {
    __device__ static __forceinline__ uint4 ld_reduce(const void* p) {
        uint4 v;
#if SYMM_MULTIMEM
        asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p)
                     : "memory");
#else
        (void)p;
        __trap();
        v = make_uint4(0, 0, 0, 0);
#endif
        return v;
    }
};

template <>
struct Multimem<__half> {
    __device__ static __forceinline__ uint4 ld_reduce(const void* p) {
        uint4 v;
#if SYMM_MULTIMEM
        asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p)
                     : "memory");
#else
        (void)p;
        __trap();
        v = make_uint4(0, 0, 0, 0);
#endif
        return v;
    }
};

// Stores the 16 bytes `v` at multicast address `p` (every rank's copy). A store moves the
// bytes whatever they hold, so one form (.v4.f32) serves every dtype and the low-latency lines.
__device__ __forceinline__ void multimem_st_v4(void* p, uint4 v) {
#if SYMM_MULTIMEM
    asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(__uint_as_float(v.x)),
                 "f"(__uint_as_float(v.y)), "f"(__uint_as_float(v.z)), "f"(__uint_as_float(v.w))
                 : "memory");
#else
    (void)p;
    (void)v;
    __trap();
#endif
}

// Stores the 32-bit `v` at multicast address `p` (every rank's copy).
__device__ __forceinline__ void multimem_st_b32(void* p, uint32_t v) {
#if SYMM_MULTIMEM
    asm volatile("multimem.st.relaxed.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
    (void)p;
    (void)v;
    __trap();
#endif
}

// Adds 1 to every rank's copy of the counter at multicast address `p`, after this thread's
// (and, behind the caller's __syncthreads, its block's) earlier writes.
__device__ __forceinline__ void multimem_arrive_sys(uint64_t* p) {
#if SYMM_MULTIMEM
    asm volatile("multimem.red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(1ull) : "memory");
#else
    (void)p;
    __trap();
#endif
}

// Orders this thread's accesses through the unicast and the multicast address of the same bytes.
__device__ __forceinline__ void fence_proxy_alias() {
#if SYMM_MULTIMEM
    asm volatile("fence.proxy.alias;" ::: "memory");
#endif
}

struct MultimemColl {
    // The low-latency all-reduce moves one 32-bit word per thread, as with `UnicastColl`: one
    // multicast store of the word instead of W - 1 unicast ones.
    static constexpr bool WORDS = true;
    const SymmArgs& a;
    char* mc;         // multicast address of the bound allocations
    uint64_t offset;  // where the buffer lies in every rank's allocation

    __device__ MultimemColl(const SymmArgs& args, uint64_t buffer_offset)
        : a(args), mc(reinterpret_cast<char*>(args.mc_base)), offset(buffer_offset) {}

    __device__ __forceinline__ char* mc_buffer() const { return mc + offset; }

    // Rank q's copy of the buffer, through the unicast mapping.
    __device__ __forceinline__ char* buffer(uint32_t q) const { return rank_alloc(a, q) + offset; }

    template <typename T>
    __device__ __forceinline__ uint4 load_reduce(uint64_t pack) const {
        SYMM_POLICY_MARK("load_reduce");
        return Multimem<T>::ld_reduce(reinterpret_cast<const uint4*>(mc_buffer()) + pack);
    }

    // The odd elements after the last 16-byte pack: summed in rank order through the peer
    // pointers (multimem has no 16-bit scalar form; these bytes are never touched through `mc`).
    template <typename T>
    __device__ __forceinline__ float load_reduce_element(uint64_t i) const {
        SYMM_POLICY_MARK("load_reduce_element");
        float acc = 0.0f;
        for (uint32_t q = 0; q < a.world; ++q) {
            const float x = Elem<T>::to_float(__ldcg(reinterpret_cast<const T*>(buffer(q)) + i));
            acc = q == 0 ? x : acc + x;
        }
        return acc;
    }

    __device__ __forceinline__ void broadcast_store(uint64_t pack, uint4 v) const {
        SYMM_POLICY_MARK("broadcast_store");
        multimem_st_v4(reinterpret_cast<uint4*>(mc_buffer()) + pack, v);
    }

    // Line `line` into this rank's slot of low-latency buffer `buffer` of every rank, with one
    // multicast store. Its four 32-bit words may land one by one (a vector multimem access is a
    // set of 32-bit accesses; the PTX has no 64-bit vector form): the readers check every 32-bit
    // word for the sentinel (low_latency.cuh).
    __device__ __forceinline__ void broadcast_line(uint32_t buffer, uint64_t line, ulonglong2 words) const {
        SYMM_POLICY_MARK("broadcast_line");
        const uint64_t own = reinterpret_cast<uint64_t>(ll_line(a, a.rank, buffer, a.rank, line)) -
                             reinterpret_cast<uint64_t>(rank_alloc(a, a.rank));
        const uint4 v = make_uint4(static_cast<uint32_t>(words.x), static_cast<uint32_t>(words.x >> 32),
                                   static_cast<uint32_t>(words.y), static_cast<uint32_t>(words.y >> 32));
        multimem_st_v4(mc + own, v);
    }

    // Word `i` of the low-latency lines into this rank's slot of low-latency buffer `buffer` of
    // every rank, its own included (write-only: see `broadcast_line`), with one 32-bit
    // multicast store: single-copy atomic in every copy, so a reader's 32-bit poll sees the
    // sentinel or the word.
    __device__ __forceinline__ void broadcast_word(uint32_t buffer, uint64_t i, uint32_t wire) const {
        SYMM_POLICY_MARK("broadcast_word");
        const uint64_t own = reinterpret_cast<uint64_t>(ll_word(a, a.rank, buffer, a.rank, i)) -
                             reinterpret_cast<uint64_t>(rank_alloc(a, a.rank));
        multimem_st_b32(mc + own, wire);
    }

    // Barrier between block blockIdx.x of every rank (false in every thread if the wait timed
    // out or the group is poisoned). `epoch` is not needed: the target is the owner's running
    // arrival total.
    __device__ __forceinline__ bool barrier(uint32_t phase, uint64_t epoch) const {
        SYMM_POLICY_MARK("barrier");
        return barrier_impl(phase, epoch, false);
    }

    // The same, publishing the call as completed (threads 32 and up, off the critical path).
    __device__ __forceinline__ bool barrier_arrive(uint32_t phase, uint64_t epoch) const {
        SYMM_POLICY_MARK("barrier_arrive");
        return barrier_impl(phase, epoch, true);
    }

    // Why exactly one alias fence, in thread 0, after the wait. The kernels reach the same bytes
    // through two virtual addresses: the one-shot copies its input in through the unicast
    // address and every rank reads it through `mc`; the in-place kernel reads and writes
    // through `mc` what the caller wrote, and reads afterwards, through the unicast address.
    // Addresses that alias behave as different proxies: the PTX memory model (PTX ISA,
    // "Causality order", proxy-preserved base causality order) orders a write X through one
    // alias before a read or write Y through the other only if an alias proxy fence lies
    // somewhere on the base causality path from X to Y, in any thread of it. Every such path
    // through this barrier runs X -> (__syncthreads) -> thread 0 of the writing rank -> its
    // release `multimem.red` -> thread 0 of the reading rank, whose acquire poll reads the
    // total -> (__syncthreads) -> Y, the writing and the reading rank being the same rank
    // included. One fence in the reading rank's thread 0 between its successful acquire and the
    // closing __syncthreads lies on every one of them. A fence in the other threads, or a
    // second one before the release, adds nothing to any path (a proxy fence orders only the
    // accesses of the thread that issues it, and no thread touches one address through both
    // aliases without a barrier in between); each compiles to a `MEMBAR.SC.SYS` (or `.GPU`) and a
    // `CCTL.IVALL` on sm_90. Paths that cross a kernel boundary instead (the caller's writes
    // before the call, its reads after it, buffer reuse two calls later) need no fence: kernel
    // completion and start take part in proxy-preserved base causality order. The counter is
    // written through `mc` and polled through the unicast address; this thread needs no order
    // between its own `red` and its poll (the total it waits for includes its own arrival,
    // which only has to land), and the release/acquire pair is the one NVLS barriers use.
    __device__ __forceinline__ bool barrier_impl(uint32_t phase, uint64_t epoch, bool arrives) const {
        __syncthreads();
        int failed = 0;
        if (threadIdx.x == 0) {
            const uint64_t slot = (static_cast<uint64_t>(phase) * MAX_BLOCKS + blockIdx.x);
            char* own = rank_alloc(a, a.rank);
            uint64_t* expected = reinterpret_cast<uint64_t*>(own + MC_EXPECTED_OFFSET) + slot;
            const uint64_t target = *expected + a.world;
            *expected = target;
            multimem_arrive_sys(reinterpret_cast<uint64_t*>(mc + MC_SIGNAL_OFFSET + slot * MC_SIGNAL_STRIDE));
            const uint64_t* mine = reinterpret_cast<const uint64_t*>(own + MC_SIGNAL_OFFSET + slot * MC_SIGNAL_STRIDE);
            Deadline d;
            while (ld_acquire_sys(mine) < target) {
                // Which peer is late is not known from a sum: a timeout names the world size.
                if (!d.keep_waiting(a, phase, a.world)) {
                    failed = 1;
                    break;
                }
            }
            // The one alias fence (above): every peer's writes, through either address, before
            // the block's accesses through the other. (After a failed wait nothing is read.)
            if (!failed) fence_proxy_alias();
        } else if (arrives && threadIdx.x >= 32) {
            publish(a, epoch, 32);
        }
        return __syncthreads_or(failed) == 0;
    }
};

}  // namespace symm
