// The one instantiation file: every kernel of src/kernels/registry.rs × every dtype of
// SYMM_FOR_EACH_DTYPE, as extern "C" entry points `symm_<kernel>_<dtype>` with the common
// signature (const T* in, T* out, uint64_t n, SymmArgs). build.rs compiles every
// kernels/*.cu into one fatbin; a test checks the PTX entries against the registry.
#include "in_place.cuh"
#include "low_latency.cuh"
#include "one_shot.cuh"
#include "pool_two_shot.cuh"
#include "two_shot.cuh"
#include "two_shot_ll.cuh"

using symm::SymmArgs;

#define SYMM_ENTRY(NAME, SUFFIX, T, BODY)                                                        \
    extern "C" __global__ void __launch_bounds__(symm::THREADS)                                  \
        symm_##NAME##_##SUFFIX(const T* in, T* out, uint64_t n, SymmArgs a) {                    \
        (void)in;                                                                                \
        (void)out;                                                                               \
        BODY;                                                                                    \
    }

// The same with up to 128 registers a thread (one 512-thread block per SM at that size): the
// zero-copy in-place kernel needs more than 64 and would spill. Its family's residency limit
// comes from the occupancy API, so the grid follows.
#define SYMM_ENTRY_ONE_BLOCK_PER_SM(NAME, SUFFIX, T, BODY)                                       \
    extern "C" __global__ void __launch_bounds__(symm::THREADS, 1)                               \
        symm_##NAME##_##SUFFIX(const T* in, T* out, uint64_t n, SymmArgs a) {                    \
        (void)in;                                                                                \
        (void)out;                                                                               \
        BODY;                                                                                    \
    }

// Every kernel of the registry for one dtype (SYMM_FOR_EACH_DTYPE calls it per dtype).
#define SYMM_KERNELS(SUFFIX, T)                                                                  \
    SYMM_ENTRY(one_shot, SUFFIX, T, (symm::one_shot<symm::UnicastColl, T>(in, out, n, a)))       \
    SYMM_ENTRY(two_shot, SUFFIX, T, (symm::two_shot<T>(in, out, n, a)))                          \
    SYMM_ENTRY_ONE_BLOCK_PER_SM(in_place, SUFFIX, T, (symm::in_place<symm::UnicastColl, T>(in, n, a))) \
    SYMM_ENTRY(one_shot_ll, SUFFIX, T, (symm::one_shot_ll<symm::UnicastColl, T>(in, out, n, a))) \
    SYMM_ENTRY(pool_two_shot, SUFFIX, T, (symm::pool_two_shot<T>(in, out, n, a)))             \
    SYMM_ENTRY(two_shot_ll, SUFFIX, T, (symm::two_shot_ll<T>(in, out, n, a)))

SYMM_FOR_EACH_DTYPE(SYMM_KERNELS)

// Same signature and launch geometry as the all-reduce kernels, no body: the benchmark's
// floor for launch and graph-replay cost. Like every kernel launched with Programmatic
// Dependent Launch it waits for its predecessor, so a chain of launches stays ordered.
extern "C" __global__ void __launch_bounds__(symm::THREADS) symm_empty(const void*, void*, uint64_t, SymmArgs) {
    symm::pdl_wait();
}

// The benchmark's sync floor: the same grid doing nothing but the protocol's minimum — the
// epoch read, one all-to-all flag exchange per block (each rank stores its epoch to every peer
// and waits for every peer's) and the call's publication. It publishes no data, so its flags
// are relaxed stores: no kernel that synchronises ranks this way can be faster, and an
// all-reduce's own cost (its data, and the release that orders the data before a barrier's
// flag) is what it spends above this. Like the one-shot, it lets the next kernel launch once
// its exchange has passed.
extern "C" __global__ void __launch_bounds__(symm::THREADS) symm_sync_floor(const void*, void*, uint64_t, SymmArgs a) {
    const uint64_t epoch = symm::begin_call(a);
    if (epoch == 0) return;
    if (symm::flag_exchange(a, epoch)) symm::pdl_trigger(a);
}

// Test and benchmark helper: one thread spins for `ns` nanoseconds (a rank that is late).
extern "C" __global__ void symm_spin(const void*, void*, uint64_t ns, SymmArgs) {
    symm::pdl_wait();
    if (threadIdx.x != 0) return;
    const uint64_t until = symm::global_timer_ns() + ns;
    while (symm::global_timer_ns() < until) {
    }
}

// Benchmark helper: a stand-in for the GEMM that writes an all-reduce's input — copies `bytes`
// from `src` to `dst`, 16 bytes an access (grid-stride) when both are 16-byte aligned, the tail
// (or a misaligned pair, all of it) byte by byte. Launched as an ordinary kernel, as a user's
// cuBLAS call would be: no programmatic serialization on its launch and no griddepcontrol here,
// so it starts after the kernel before it completes, and a PDL launch after it may begin as it
// finishes (that launch's griddepcontrol.wait then waits for all of it).
extern "C" __global__ void __launch_bounds__(symm::THREADS) symm_produce(const void* src, void* dst, uint64_t bytes, SymmArgs) {
    const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
    const bool aligned = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
    const uint64_t vectors = aligned ? bytes / 16 : 0;
    const uint4* s4 = static_cast<const uint4*>(src);
    uint4* d4 = static_cast<uint4*>(dst);
    for (uint64_t i = tid; i < vectors; i += stride) d4[i] = s4[i];
    const uint8_t* s1 = static_cast<const uint8_t*>(src);
    uint8_t* d1 = static_cast<uint8_t*>(dst);
    for (uint64_t i = vectors * 16 + tid; i < bytes; i += stride) d1[i] = s1[i];
}

// Test helper: a consumer of an all-reduce's output launched with programmatic stream
// serialization (as a PDL-aware kernel after ours would be). It copies `bytes` from `src` to
// `dst` one byte a thread (grid-stride) after `griddepcontrol.wait` when FLAG_CONSUMER_WAITS is
// set, or straight away without it: the second is the consumer the PDL contract warns about,
// which sees the complete output only when the collective triggers at its exit
// (Config::pdl_at_exit).
extern "C" __global__ void __launch_bounds__(symm::THREADS) symm_consume(const void* src, void* dst, uint64_t bytes, SymmArgs a) {
    if (a.flags & symm::FLAG_CONSUMER_WAITS) symm::pdl_wait();
    const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
    const uint8_t* s1 = static_cast<const uint8_t*>(src);
    uint8_t* d1 = static_cast<uint8_t*>(dst);
    for (uint64_t i = tid; i < bytes; i += stride) d1[i] = s1[i];
}
