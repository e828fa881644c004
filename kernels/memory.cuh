// Memory-order primitives: every access that crosses ranks, with its scope spelled out, and
// the global timer that bounds every wait.
#pragma once

#include <stdint.h>

namespace symm {

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Cross-rank flags: release/acquire at system scope. Peers are other GPUs (or, for
// virtual ranks, other grids through another mapping); .gpu scope would not order
// the data a peer reads over NVLink.
__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Low-latency lines {d0, epoch, d1, epoch}: written with one 16-byte relaxed store at system
// scope, polled with one 16-byte relaxed load. Each 8-byte half carries its own copy of the
// epoch, so even a store split into halves is never mistaken for a complete line.
__device__ __forceinline__ void st_line_sys(uint4* p, uint32_t d0, uint32_t d1, uint32_t epoch) {
    asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d0), "r"(epoch), "r"(d1),
                 "r"(epoch)
                 : "memory");
}

__device__ __forceinline__ uint4 ld_line_sys(const uint4* p) {
    uint4 v;
    asm volatile("ld.relaxed.sys.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

// Local (same grid) counter: device scope is enough, nothing crosses GPUs.
__device__ __forceinline__ uint32_t atom_add_acq_rel_gpu(uint32_t* p, uint32_t v) {
    uint32_t old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Peer data is read at L2 (.cg): never from an L1 line filled before the peer wrote it.
__device__ __forceinline__ uint4 load_peer_pack(const uint4* p) { return __ldcg(p); }

}  // namespace symm
