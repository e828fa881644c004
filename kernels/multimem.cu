// symm: min-arch 90
// The multimem (NVLS) instantiations: the kernel bodies of in_place.cuh, one_shot.cuh and
// low_latency.cuh over `MultimemColl` (multimem.cuh), with the common signature, one entry
// point per kernel and dtype: `symm_in_place_mm_<dtype>` (the in-place two-shot),
// `symm_one_shot_mm_<dtype>` (the one-shot, `multimem.ld_reduce` over the data buffers) and
// `symm_one_shot_ll_mm_<dtype>` (the low-latency one-shot, one multicast store per line). The
// multicast address travels in `SymmArgs::mc_base`. Compiled only for sm_90 and newer (the
// line above; build.rs), and the registry rows have min_arch 90, so the kernel table has no
// entry on older devices.
#include "in_place.cuh"
#include "low_latency.cuh"
#include "multimem.cuh"
#include "one_shot.cuh"

#define SYMM_MM_ENTRY(NAME, SUFFIX, T, BODY)                                                     \
    extern "C" __global__ void __launch_bounds__(symm::THREADS)                                  \
        symm_##NAME##_mm_##SUFFIX(const T* in, T* out, uint64_t n, symm::SymmArgs a) {           \
        (void)in;                                                                                \
        (void)out;                                                                               \
        BODY;                                                                                    \
    }

#define SYMM_MM_KERNELS(SUFFIX, T)                                                               \
    SYMM_MM_ENTRY(in_place, SUFFIX, T, (symm::in_place<symm::MultimemColl, T>(in, n, a)))        \
    SYMM_MM_ENTRY(one_shot, SUFFIX, T, (symm::one_shot<symm::MultimemColl, T>(in, out, n, a)))   \
    SYMM_MM_ENTRY(one_shot_ll, SUFFIX, T, (symm::one_shot_ll<symm::MultimemColl, T>(in, out, n, a)))

SYMM_FOR_EACH_DTYPE(SYMM_MM_KERNELS)
