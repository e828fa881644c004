// The multimem (NVLS) collective policy: the same kernel bodies as `UnicastColl` (coll.cuh),
// with the reduction done by the NVSwitch. Every rank's workspace allocation is bound to one
// driver multicast object (src/symmetric/multicast.rs); its multicast address `mc` mirrors one
// allocation, so the symmetric buffer is at the same offset through `mc` as through
// `rank_alloc`, and a multimem access to `mc + off` touches `off` of every rank's allocation.
//
//  * load_reduce:     one `multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.{bf16x2,f16x2}`
//                     (fp32 accumulation in the switch) or `.add.v4.f32`. Never the 16-bit form
//                     without `.acc::f32` (it accumulates in bf16), never `multimem.red` for data.
//  * broadcast_store: one `multimem.st.relaxed.sys.global.v4`.
//  * barrier:         one `multimem.red.release.sys.global.add.u64` of 1 on a per-(phase, block)
//                     multicast counter (it adds 1 to every rank's copy), then an acquire wait
//                     (.sys) on this rank's own copy through its unicast address until it holds
//                     the per-block arrival total kept by the owner. The counter only grows (no
//                     reset, no wrap in 2^64 arrivals); the target is kept per block, so the grid
//                     may change between calls (every rank launches the same grid per call).
//  * `fence.proxy.alias` around each barrier: the kernel touches the symmetric buffer through
//    both addresses (multimem for the packs, unicast for the scalar tail and the counters'
//    wait), and the caller writes it through the unicast address.
//
// The summation order inside the switch is unspecified: results are identical on every rank
// (each element is reduced once and broadcast) but not guaranteed bit-identical to the
// peer-pointer kernels, which sum in rank order. `Config::reproducible` keeps `Auto` away.
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

// The argument block of the multimem entry points: SymmArgs plus the multicast address. The
// in-place kernels take no input pointer, so the entry points receive `mc` in that argument
// (the common signature and launch stay the same for every kernel of the table).
struct MulticastArgs : SymmArgs {
    uint64_t mc_base;
};

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
    __device__ static __forceinline__ void st(void* p, uint4 v) {
#if SYMM_MULTIMEM
        asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p),
                     "f"(__uint_as_float(v.x)), "f"(__uint_as_float(v.y)), "f"(__uint_as_float(v.z)),
                     "f"(__uint_as_float(v.w))
                     : "memory");
#else
        (void)p;
        (void)v;
        __trap();
#endif
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
    __device__ static __forceinline__ void st(void* p, uint4 v) {
#if SYMM_MULTIMEM
        asm volatile("multimem.st.relaxed.sys.global.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
                     "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
#else
        (void)p;
        (void)v;
        __trap();
#endif
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
    __device__ static __forceinline__ void st(void* p, uint4 v) {
#if SYMM_MULTIMEM
        asm volatile("multimem.st.relaxed.sys.global.v4.f16x2 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
                     "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
#else
        (void)p;
        (void)v;
        __trap();
#endif
    }
};

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

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

struct MultimemColl {
    const SymmArgs& a;
    char* mc;         // multicast address of the bound allocations
    uint64_t offset;  // where the buffer lies in every rank's allocation

    __device__ MultimemColl(const SymmArgs& args, uint64_t buffer_offset)
        : a(args), mc(reinterpret_cast<char*>(static_cast<const MulticastArgs&>(args).mc_base)), offset(buffer_offset) {}

    __device__ __forceinline__ char* mc_symmetric() const { return mc + offset; }

    // Rank q's copy of the buffer, through the unicast mapping.
    __device__ __forceinline__ char* buffer(uint32_t q) const { return rank_alloc(a, q) + offset; }

    template <typename T>
    __device__ __forceinline__ uint4 load_reduce(uint64_t pack) const {
        SYMM_POLICY_MARK("load_reduce");
        return Multimem<T>::ld_reduce(reinterpret_cast<const uint4*>(mc_symmetric()) + pack);
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
        // A store moves 16 bytes whatever they hold: one form (.v4.f32) serves every dtype.
        Multimem<float>::st(reinterpret_cast<uint4*>(mc_symmetric()) + pack, v);
    }

    // Barrier between block blockIdx.x of every rank (false in every thread if the wait timed
    // out). `epoch` is not needed: the target is the owner's running arrival total.
    __device__ __forceinline__ bool barrier(uint32_t phase, uint64_t epoch) const {
        SYMM_POLICY_MARK("barrier");
        (void)epoch;
        __syncthreads();
        int timed_out = 0;
        if (threadIdx.x == 0) {
            const uint64_t slot = (static_cast<uint64_t>(phase) * MAX_BLOCKS + blockIdx.x);
            char* own = rank_alloc(a, a.rank);
            uint64_t* expected = reinterpret_cast<uint64_t*>(own + MC_EXPECTED_OFFSET) + slot;
            const uint64_t target = *expected + a.world;
            *expected = target;
            fence_proxy_alias();
            multimem_arrive_sys(reinterpret_cast<uint64_t*>(mc + MC_SIGNAL_OFFSET + slot * MC_SIGNAL_STRIDE));
            const uint64_t* mine = reinterpret_cast<const uint64_t*>(own + MC_SIGNAL_OFFSET + slot * MC_SIGNAL_STRIDE);
            uint64_t deadline = 0;
            while (ld_acquire_sys_u64(mine) < target) {
                const uint64_t now = global_timer_ns();
                if (deadline == 0) {
                    deadline = now + a.timeout_ns;
                } else if (now > deadline) {
                    // Which peer is late is not known from a sum: report the world size.
                    report_timeout(a, phase, a.world);
                    timed_out = 1;
                    break;
                }
            }
            fence_proxy_alias();
        }
        return __syncthreads_or(timed_out) == 0;
    }
};

}  // namespace symm
