// symm: min-arch 90
// The multimem (NVLS) instantiations: the in-place two-shot body of in_place.cuh over
// `MultimemColl` (multimem.cuh), one entry point per dtype, `symm_in_place_mm_<dtype>`, with the
// common signature. The first argument carries the multicast address of the bound allocations
// (the in-place kernels take no input pointer); src/backend passes it. Compiled only for sm_90
// and newer (the line above; build.rs), and the registry row has min_arch 90, so the kernel
// table has no entry on older devices.
#include "in_place.cuh"
#include "multimem.cuh"

#define SYMM_MM_ENTRY(SUFFIX, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(symm::THREADS)                                  \
        symm_in_place_mm_##SUFFIX(const T* mc, T* out, uint64_t n, symm::SymmArgs a) {           \
        (void)out;                                                                               \
        symm::MulticastArgs m;                                                                   \
        static_cast<symm::SymmArgs&>(m) = a;                                                     \
        m.mc_base = reinterpret_cast<uint64_t>(mc);                                              \
        symm::in_place<symm::MultimemColl, T>(reinterpret_cast<const T*>(symm::symmetric_buffer(a, a.rank)), n, m); \
    }

SYMM_FOR_EACH_DTYPE(SYMM_MM_ENTRY)
