// Entry points of the fused all-reduce + residual + RMSNorm kernels and of the unfused
// residual + RMSNorm kernel (kernels/fused_norm.cuh), one per dtype of SYMM_FOR_EACH_DTYPE:
// `symm_fused_one_shot_<dtype>`, `symm_fused_two_shot_<dtype>` and `symm_fused_ll_<dtype>`
// (NormArgs, SymmArgs), and `symm_rmsnorm_<dtype>(NormArgs)` (rows registered in
// src/kernels/registry.rs).
#include "fused_norm.cuh"

#define SYMM_FUSED_KERNELS(SUFFIX, T)                                                                \
    extern "C" __global__ void __launch_bounds__(symm::NORM_THREADS, 1)                                 \
        symm_fused_one_shot_##SUFFIX(symm::NormArgs f, symm::SymmArgs a) {                           \
        symm::fused_one_shot<T>(f, a);                                                               \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(symm::NORM_THREADS, 1)                                 \
        symm_fused_two_shot_##SUFFIX(symm::NormArgs f, symm::SymmArgs a) {                           \
        symm::fused_two_shot<T>(f, a);                                                               \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(symm::NORM_THREADS, 1)                                 \
        symm_fused_ll_##SUFFIX(symm::NormArgs f, symm::SymmArgs a) {                                 \
        symm::fused_low_latency<T>(f, a);                                                            \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(symm::NORM_THREADS, 1) symm_rmsnorm_##SUFFIX(symm::NormArgs f) { \
        symm::residual_rmsnorm<T>(f);                                                                \
    }

SYMM_FOR_EACH_DTYPE(SYMM_FUSED_KERNELS)
