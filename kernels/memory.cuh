// Memory-order primitives: every access that crosses ranks, with its scope spelled out, the
// global timer that bounds every wait, and Programmatic Dependent Launch.
#pragma once

#include <stdint.h>

namespace symm {

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Cross-rank flags: 64-bit epochs (they never wrap), released and observed at system scope.
// Peers are other GPUs (or, for virtual ranks, other grids through another mapping); .gpu
// scope would not order the data a peer reads over NVLink.
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// A flag that publishes nothing (the sync floor's exchange): no fence before it.
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Polled with acquire loads: the load that sees the peer's release store synchronises with
// it, so the peer's writes before its signal are visible to this thread. Measured on the H200
// (8 virtual ranks, chain of 10 in a graph): relaxed polls followed by one `fence.acq_rel.sys`
// (MEMBAR.ALL.SYS) cost 2.6 µs more per barrier than acquire polls (LDG.STRONG.SYS plus an
// L1 invalidate), docs/design.md.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// A relaxed system-scope load (fields read after an acquire has ordered them).
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// The poison word (written by a rank whose wait timed out into its own and every peer's call
// state, polled by every wait) and the low-latency all-reduce's 32-bit words (a 32-bit access
// is single-copy atomic).
__device__ __forceinline__ void st_relaxed_sys_u32(uint32_t* p, uint32_t v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_relaxed_sys_u32(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// A block's call state {calls, poison} in one 16-byte load.
__device__ __forceinline__ ulonglong2 ld_state_sys(const void* p) {
    ulonglong2 v;
    asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
    return v;
}

// Low-latency lines: 16 payload bytes written as two 64-bit words with one relaxed
// system-scope store, polled with one relaxed load. Each 64-bit access is single-copy atomic;
// a word reads as all ones (the "not yet arrived" sentinel) until the peer's store of that
// word lands, so a line split into its two words is never mistaken for a complete one.
__device__ __forceinline__ void st_line_sys(ulonglong2* p, ulonglong2 v) {
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(v.x), "l"(v.y) : "memory");
}

__device__ __forceinline__ ulonglong2 ld_line_sys(const ulonglong2* p) {
    ulonglong2 v;
    asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
    return v;
}

// The poll load of a low-latency reader, by what it polls: a 16-byte line or a 32-bit word.
__device__ __forceinline__ ulonglong2 ld_poll_sys(const ulonglong2* p) { return ld_line_sys(p); }
__device__ __forceinline__ uint32_t ld_poll_sys(const uint32_t* p) { return ld_relaxed_sys_u32(p); }

// Peer data is read at L2 (.cg): never from an L1 line filled before the peer wrote it.
__device__ __forceinline__ uint4 load_peer_pack(const uint4* p) { return __ldcg(p); }

// Programmatic Dependent Launch (sm_90+; no-ops on older parts and when the kernel was not
// launched with programmatic stream serialization). `wait`: block until the previous kernel
// on the stream has completed and its memory is visible — every kernel calls it before it
// touches its input, its output or the workspace. `launch_dependents`: let the next kernel
// start its launch (it still waits in its own `wait` for this one to finish).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Thread-block clusters (sm_90+): the fused low-latency kernel spreads a row over the blocks
// of a cluster and sums its squares through distributed shared memory. On older parts (and
// in any launch without a cluster attribute) a cluster is one block: the barrier is the
// block's `__syncthreads` and a store to "rank 0" is a store to the block's own shared memory.
// The barriers are the `.aligned` forms: every thread of the block executes each of them.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

// Every thread's shared-memory stores before it (its own and, through the earlier barriers,
// those it has seen) are visible to every thread of the cluster after it.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
    cluster_wait();
}

// Stores `v` at the address of `local` (this block's shared memory) in the shared memory of
// block `rank` of the cluster.
__device__ __forceinline__ void st_cluster_f32(float* local, uint32_t rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t mine = static_cast<uint32_t>(__cvta_generic_to_shared(local));
    uint32_t theirs;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(theirs) : "r"(mine), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(theirs), "f"(v) : "memory");
#else
    (void)rank;
    *local = v;
#endif
}

}  // namespace symm
