// Entry points of the all-gather and reduce-scatter kernels (rows `all_gather` and
// `reduce_scatter` of src/kernels/registry.rs), one per dtype column like every kernel of the
// table. The all-gather is byte-typed: its three columns are the same byte kernel, and it
// takes the per-rank byte counts as a fifth parameter (`GatherCounts`, copied at launch, so a
// captured graph keeps them). This file is compiled in the same unit as symm.cu.
#include "all_gather.cuh"
#include "reduce_scatter.cuh"

#define SYMM_GATHER_ENTRY(SUFFIX, T)                                                             \
    extern "C" __global__ void __launch_bounds__(symm::THREADS)                                  \
        symm_all_gather_##SUFFIX(const T* in, T* out, uint64_t n, symm::SymmArgs a,              \
                                 symm::GatherCounts c) {                                         \
        (void)n;                                                                                 \
        symm::all_gather_bytes(reinterpret_cast<const char*>(in), reinterpret_cast<char*>(out), c, a); \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(symm::THREADS, 1)                                  \
        symm_reduce_scatter_##SUFFIX(const T* in, T* out, uint64_t n, symm::SymmArgs a) {        \
        symm::reduce_scatter<T>(in, out, n, a);                                                  \
    }

SYMM_FOR_EACH_DTYPE(SYMM_GATHER_ENTRY)
