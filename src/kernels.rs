//! The embedded fatbin and the functions loaded from it.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, DeviceRepr};
use cudarc::nvrtc::Ptx;

use crate::dtype::DType;
use crate::error::{CudaResultExt, Error, Result};
use crate::plan::Algorithm;

static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin"));
static PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));
static PTXAS_REPORT: &str = include_str!(concat!(env!("OUT_DIR"), "/ptxas.txt"));

/// Whether this build carries compiled kernels.
pub fn kernels_available() -> bool {
    cfg!(symm_kernels) && !FATBIN.is_empty()
}

/// The compute_90 PTX of every kernel (empty without nvcc). For the scope checks in tests.
#[doc(hidden)]
pub fn embedded_ptx() -> &'static str {
    PTX
}

/// `ptxas -v` output of the build (empty without nvcc). For the spill checks in tests.
#[doc(hidden)]
pub fn ptxas_report() -> &'static str {
    PTXAS_REPORT
}

/// Kernel parameter block; mirrors `symm::SymmArgs` in kernels/primitives.cuh.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SymmArgs {
    pub base: u64,
    pub stride: u64,
    pub signal_offset: u64,
    pub state_offset: u64,
    pub data_offset: u64,
    pub data_bytes: u64,
    pub ll_offset: u64,
    pub ll_slot_bytes: u64,
    pub error: u64,
    pub timeout_ns: u64,
    pub rank: u32,
    pub world: u32,
}

// SAFETY: SymmArgs is a #[repr(C)] struct of plain integers with the same layout as the
// device-side struct (checked by `symm_args_layout_matches_device_struct`).
unsafe impl DeviceRepr for SymmArgs {}

/// Every kernel of the fatbin, loaded into one context.
#[derive(Debug)]
pub(crate) struct Kernels {
    one_shot: [CudaFunction; 3],
    two_shot: [CudaFunction; 3],
    in_place: [CudaFunction; 3],
    low_latency: [CudaFunction; 3],
    empty: CudaFunction,
}

impl Kernels {
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        if !kernels_available() {
            return Err(Error::KernelsUnavailable);
        }
        let module = ctx
            .load_module(Ptx::from_binary(FATBIN.to_vec()))
            .map_err(|e| match e.0 {
                cudarc::driver::sys::CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
                | cudarc::driver::sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => Error::Unsupported {
                    ordinal: ctx.ordinal(),
                    reason: format!(
                        "the embedded kernels (sm_80, sm_90 and compute_90 PTX from {}) do not load: {e}",
                        env!("SYMM_ALLREDUCE_NVCC")
                    ),
                },
                _ => Error::Cuda {
                    call: "cuModuleLoadData",
                    source: e,
                },
            })?;
        let load = |name: String| module.load_function(&name).during("cuModuleGetFunction");
        let per_dtype = |algo: &str| -> Result<[CudaFunction; 3]> {
            Ok([
                load(format!("symm_{algo}_{}", DType::ALL[0].name()))?,
                load(format!("symm_{algo}_{}", DType::ALL[1].name()))?,
                load(format!("symm_{algo}_{}", DType::ALL[2].name()))?,
            ])
        };
        Ok(Kernels {
            one_shot: per_dtype("one_shot")?,
            two_shot: per_dtype("two_shot")?,
            in_place: per_dtype("in_place")?,
            low_latency: per_dtype("one_shot_ll")?,
            empty: load("symm_empty".to_string())?,
        })
    }

    /// The kernel for a planned algorithm (`Auto` never reaches here).
    pub(crate) fn get(&self, algorithm: Algorithm, dtype: DType) -> &CudaFunction {
        match algorithm {
            Algorithm::TwoShot => &self.two_shot[dtype.index()],
            Algorithm::LowLatency => &self.low_latency[dtype.index()],
            _ => &self.one_shot[dtype.index()],
        }
    }

    /// The zero-copy in-place kernel over the symmetric buffers.
    pub(crate) fn in_place(&self, dtype: DType) -> &CudaFunction {
        &self.in_place[dtype.index()]
    }

    pub(crate) fn empty(&self) -> &CudaFunction {
        &self.empty
    }

    /// Fewest resident blocks per SM over the dtypes, for the one-shot family (one-shot and
    /// low-latency) and for the two-shot family (two-shot and in-place).
    pub(crate) fn blocks_per_sm(&self, threads: u32) -> Result<(usize, usize)> {
        let occ = |fs: &[CudaFunction; 3]| -> Result<usize> {
            let mut least = usize::MAX;
            for f in fs {
                let n = f
                    .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
                    .during("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
                least = least.min(n as usize);
            }
            Ok(least)
        };
        Ok((
            occ(&self.one_shot)?.min(occ(&self.low_latency)?),
            occ(&self.two_shot)?.min(occ(&self.in_place)?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symm_args_layout_matches_device_struct() {
        // Device struct: ten u64 then two u32, no padding: 88 bytes, 8-aligned.
        assert_eq!(std::mem::size_of::<SymmArgs>(), 88);
        assert_eq!(std::mem::align_of::<SymmArgs>(), 8);
        assert_eq!(std::mem::offset_of!(SymmArgs, ll_offset), 48);
        assert_eq!(std::mem::offset_of!(SymmArgs, timeout_ns), 72);
        assert_eq!(std::mem::offset_of!(SymmArgs, rank), 80);
        assert_eq!(std::mem::offset_of!(SymmArgs, world), 84);
    }
}
