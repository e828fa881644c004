// The one instantiation file: every kernel of src/kernels/registry.rs × every dtype of
// SYMM_FOR_EACH_DTYPE, as extern "C" entry points `symm_<kernel>_<dtype>` with the common
// signature (const T* in, T* out, uint64_t n, SymmArgs). build.rs compiles every
// kernels/*.cu into one fatbin; a test checks the PTX entries against the registry.
#include "in_place.cuh"
#include "low_latency.cuh"
#include "one_shot.cuh"
#include "pool_two_shot.cuh"
#include "two_shot.cuh"

using symm::SymmArgs;

#define SYMM_ENTRY(NAME, SUFFIX, T, BODY)                                                        \
    extern "C" __global__ void __launch_bounds__(symm::THREADS)                                  \
        symm_##NAME##_##SUFFIX(const T* in, T* out, uint64_t n, SymmArgs a) {                    \
        (void)in;                                                                                \
        (void)out;                                                                               \
        BODY;                                                                                    \
    }

// Every kernel of the registry for one dtype (SYMM_FOR_EACH_DTYPE calls it per dtype).
#define SYMM_KERNELS(SUFFIX, T)                                                                  \
    SYMM_ENTRY(one_shot, SUFFIX, T, (symm::one_shot<T>(in, out, n, a)))                          \
    SYMM_ENTRY(two_shot, SUFFIX, T, (symm::two_shot<T>(in, out, n, a)))                          \
    SYMM_ENTRY(in_place, SUFFIX, T, (symm::in_place<symm::UnicastColl, T>(in, n, a)))                \
    SYMM_ENTRY(one_shot_ll, SUFFIX, T, (symm::one_shot_ll<T>(in, out, n, a)))                    \
    SYMM_ENTRY(pool_two_shot, SUFFIX, T, (symm::pool_two_shot<T>(in, out, n, a)))

SYMM_FOR_EACH_DTYPE(SYMM_KERNELS)

// Same signature and launch geometry as the all-reduce kernels, no body: the benchmark's
// floor for launch and graph-replay cost.
extern "C" __global__ void __launch_bounds__(symm::THREADS) symm_empty(const void*, void*, uint64_t, SymmArgs) {}
