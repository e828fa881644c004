// Device primitives shared by every all-reduce kernel: the argument block, 16-byte packs
// with fp32 accumulation, system-scope flag operations and the global timer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace symm {

// Mirrors `SymmArgs` in src/kernels.rs field for field (both are plain C layouts).
struct SymmArgs {
    // This rank's virtual address of rank 0's allocation; rank q's allocation is mapped at
    // base + q * stride in every rank's address space (one contiguous reservation per rank).
    uint64_t base;
    uint64_t stride;
    uint64_t signal_offset;  // signal pad: [phase][block][32 slots] of u32, one 128-byte row per block
    uint64_t state_offset;   // this rank's CallState (only the owner touches it)
    uint64_t data_offset;    // two data buffers (parity 0 and 1) of data_bytes each, then the
    uint64_t data_bytes;     // user-visible symmetric buffer (data_bytes) at data_offset + 2*data_bytes
    uint64_t ll_offset;      // low-latency slots: [parity 2][source rank world] of ll_slot_bytes
    uint64_t ll_slot_bytes;  // 16-byte lines, each carrying 8 payload bytes and the epoch twice
    uint64_t error;          // host-mapped u32: 0, or an error code written by a timed-out wait
    uint64_t timeout_ns;     // bound on every wait
    uint32_t rank;
    uint32_t world;
};

constexpr uint32_t MAX_RANKS = 8;
constexpr uint32_t MAX_BLOCKS = 64;
constexpr uint32_t SLOTS_PER_ROW = 32;  // 128 bytes: blocks never share a line
constexpr uint32_t THREADS = 512;

// Error word layout (decoded by src/communicator.rs): kind | phase << 8 | peer << 16.
constexpr uint32_t ERROR_PEER_TIMEOUT = 1;

// Call bookkeeping in device memory, advanced by the kernels themselves: no host state per
// call, so a captured graph replays correctly any number of times.
struct CallState {
    uint32_t calls;     // completed calls; the running call's epoch is calls + 1
    uint32_t finished;  // blocks of the running call that have finished
};

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

// ---- element types: 16-byte packs, fp32 accumulation ----

template <typename T>
struct Elem;

template <>
struct Elem<float> {
    static constexpr uint32_t PER_PACK = 4;
    __device__ static float to_float(float x) { return x; }
    __device__ static float from_float(float x) { return x; }
};

template <>
struct Elem<__half> {
    static constexpr uint32_t PER_PACK = 8;
    __device__ static float to_float(__half x) { return __half2float(x); }
    __device__ static __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Elem<__nv_bfloat16> {
    static constexpr uint32_t PER_PACK = 8;
    __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// 8-byte payload of a low-latency line.
template <typename T>
union Half {
    uint2 bits;
    T elems[8 / sizeof(T)];
};

template <typename T>
union Pack {
    uint4 bits;
    T elems[Elem<T>::PER_PACK];
};

template <typename T>
__device__ __forceinline__ void pack_to_float(uint4 bits, float (&acc)[Elem<T>::PER_PACK]) {
    Pack<T> p;
    p.bits = bits;
#pragma unroll
    for (uint32_t i = 0; i < Elem<T>::PER_PACK; ++i) acc[i] = Elem<T>::to_float(p.elems[i]);
}

template <typename T>
__device__ __forceinline__ void add_pack(uint4 bits, float (&acc)[Elem<T>::PER_PACK]) {
    Pack<T> p;
    p.bits = bits;
#pragma unroll
    for (uint32_t i = 0; i < Elem<T>::PER_PACK; ++i) acc[i] += Elem<T>::to_float(p.elems[i]);
}

template <typename T>
__device__ __forceinline__ uint4 float_to_pack(const float (&acc)[Elem<T>::PER_PACK]) {
    Pack<T> p;
#pragma unroll
    for (uint32_t i = 0; i < Elem<T>::PER_PACK; ++i) p.elems[i] = Elem<T>::from_float(acc[i]);
    return p.bits;
}

// ---- addressing inside the symmetric workspace ----

__device__ __forceinline__ char* rank_alloc(const SymmArgs& a, uint32_t owner) {
    return reinterpret_cast<char*>(a.base + owner * a.stride);
}

__device__ __forceinline__ char* data_buffer(const SymmArgs& a, uint32_t owner, uint32_t parity) {
    return rank_alloc(a, owner) + a.data_offset + parity * a.data_bytes;
}

// The buffer users write into for the zero-copy in-place all-reduce.
__device__ __forceinline__ char* symmetric_buffer(const SymmArgs& a, uint32_t owner) {
    return rank_alloc(a, owner) + a.data_offset + 2 * a.data_bytes;
}

// Line `line` of the slot that rank `source` fills in `owner`'s buffer for epoch parity `parity`.
__device__ __forceinline__ uint4* ll_line(const SymmArgs& a, uint32_t owner, uint32_t parity, uint32_t source,
                                          uint64_t line) {
    char* slot = rank_alloc(a, owner) + a.ll_offset + (parity * a.world + source) * a.ll_slot_bytes;
    return reinterpret_cast<uint4*>(slot) + line;
}

__device__ __forceinline__ CallState* call_state(const SymmArgs& a) {
    return reinterpret_cast<CallState*>(rank_alloc(a, a.rank) + a.state_offset);
}

}  // namespace symm
