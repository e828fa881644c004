// Entry points of the all-gather and reduce-scatter kernels (rows `all_gather`,
// `all_gather_ll`, `reduce_scatter` and `reduce_scatter_ll` of src/kernels/registry.rs), one
// per dtype column like every kernel of the table. The all-gathers are byte-typed: their
// three columns are the same byte kernel. The one-shot takes the per-rank byte counts as a
// fifth parameter (`GatherCounts`, copied at launch, so a captured graph keeps them); the
// low-latency one takes this rank's chunk in bytes as `n`. This file is compiled in the same
// unit as symm.cu.
#include "all_gather.cuh"
#include "low_latency_bytes.cuh"
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
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(symm::THREADS, 1)                               \
        symm_all_gather_ll_##SUFFIX(const T* in, T* out, uint64_t n, symm::SymmArgs a) {         \
        symm::all_gather_ll(reinterpret_cast<const char*>(in), reinterpret_cast<char*>(out), n, a); \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(symm::THREADS)                                  \
        symm_reduce_scatter_ll_##SUFFIX(const T* in, T* out, uint64_t n, symm::SymmArgs a) {     \
        symm::reduce_scatter_ll<T>(in, out, n, a);                                               \
    }

SYMM_FOR_EACH_DTYPE(SYMM_GATHER_ENTRY)
