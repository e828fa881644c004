//! The device code as the Rust side sees it: the embedded fatbin, the kernel table loaded
//! from it ([`Kernels`], sized by the [`registry`]), the ABI ([`abi`]) and the launch
//! ([`launch`]).

pub(crate) mod abi;
pub(crate) mod coll;
pub(crate) mod launch;
pub(crate) mod norm_abi;
pub(crate) mod registry;

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;

use crate::dtype::DType;
use crate::error::{CudaResultExt, Error, Result};
use registry::{
    Family, Kernel, CONSUME_KERNEL, EMPTY_KERNEL, KERNELS, PRODUCE_KERNEL, SPIN_KERNEL, SYNC_FLOOR_KERNEL,
};

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

/// The embedded fatbin (sm_80 and sm_90 SASS, compute_90 PTX; empty without nvcc). For the
/// SASS checks in tests.
#[doc(hidden)]
pub fn embedded_fatbin() -> &'static [u8] {
    FATBIN
}

/// `ptxas -v` output of the build (empty without nvcc). For the spill checks in tests.
#[doc(hidden)]
pub fn ptxas_report() -> &'static str {
    PTXAS_REPORT
}

/// Every kernel of the registry × every dtype, loaded into one context (`None` where the
/// device is older than the kernel's minimum architecture). Loaded once per context and
/// shared by every communicator on it ([`Kernels::load`]).
#[derive(Debug)]
pub(crate) struct Kernels {
    table: [[Option<CudaFunction>; DType::COUNT]; KERNELS.len()],
    empty: CudaFunction,
    sync_floor: CudaFunction,
    spin: CudaFunction,
    produce: CudaFunction,
    consume: CudaFunction,
    arch: u32,
    ordinal: usize,
}

/// The kernel tables loaded so far, one per CUDA context (keyed by its handle). Each entry's
/// functions hold their module and so the context: the context stays alive, and its handle
/// cannot name another context, for as long as the process runs.
static LOADED: Mutex<Vec<(usize, Arc<Kernels>)>> = Mutex::new(Vec::new());

impl Kernels {
    /// The kernels of `ctx`: loaded on the first call for a context, the same table after.
    /// Unloading the module does not give back all of the device memory the driver took for
    /// it (about 1.6 MiB per load and unload of this fatbin on an H100), so a server that
    /// creates and drops communicators would lose memory with each one if every communicator
    /// loaded its own; the module stays loaded, once per context, until the process exits.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Arc<Self>> {
        if !kernels_available() {
            return Err(Error::KernelsUnavailable);
        }
        let key = ctx.cu_ctx() as usize;
        // A poisoned lock only means another thread panicked while loading: the list itself
        // is always whole (entries are pushed complete).
        let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, kernels)) = loaded.iter().find(|(k, _)| *k == key) {
            return Ok(kernels.clone());
        }
        let kernels = Arc::new(Self::load_module(ctx)?);
        loaded.push((key, kernels.clone()));
        Ok(kernels)
    }

    fn load_module(ctx: &Arc<CudaContext>) -> Result<Self> {
        let module = ctx
            .load_module(Ptx::from_binary(FATBIN.to_vec()))
            .map_err(|e| match e.0 {
                sys::CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
                | sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => Error::Unsupported {
                    ordinal: ctx.ordinal(),
                    reason: format!(
                        "the embedded kernels (from {}) do not load: {e}; the compute_90 PTX needs a \
                             CUDA 13.0 driver to JIT",
                        env!("SYMM_ALLREDUCE_NVCC")
                    ),
                },
                _ => Error::Cuda {
                    call: "cuModuleLoadData",
                    source: e,
                },
            })?;
        let (major, minor) = ctx.compute_capability().during("cuDeviceGetAttribute")?;
        let arch = (major * 10 + minor) as u32;
        let load = |name: &str| module.load_function(name).during("cuModuleGetFunction");
        let mut table: [[Option<CudaFunction>; DType::COUNT]; KERNELS.len()] = Default::default();
        for (spec, row) in KERNELS.iter().zip(table.iter_mut()) {
            if arch < spec.min_arch {
                continue;
            }
            for (d, slot) in DType::ALL.iter().zip(row.iter_mut()) {
                *slot = Some(load(&format!("symm_{}_{}", spec.prefix, d.name()))?);
            }
        }
        Ok(Kernels {
            table,
            empty: load(EMPTY_KERNEL)?,
            sync_floor: load(SYNC_FLOOR_KERNEL)?,
            spin: load(SPIN_KERNEL)?,
            produce: load(PRODUCE_KERNEL)?,
            consume: load(CONSUME_KERNEL)?,
            arch,
            ordinal: ctx.ordinal(),
        })
    }

    /// The entry point of `kernel` for `dtype`, or why this device has none.
    pub(crate) fn get(&self, kernel: Kernel, dtype: DType) -> Result<&CudaFunction> {
        self.table[kernel.index()][dtype.index()]
            .as_ref()
            .ok_or_else(|| Error::Unsupported {
                ordinal: self.ordinal,
                reason: format!(
                    "the {} kernel needs compute capability {}.{}; this device has {}.{}",
                    kernel.spec().prefix,
                    kernel.spec().min_arch / 10,
                    kernel.spec().min_arch % 10,
                    self.arch / 10,
                    self.arch % 10
                ),
            })
    }

    /// Whether the device launches thread-block clusters (compute capability 9.0 and newer).
    pub(crate) fn clusters(&self) -> bool {
        self.arch >= 90
    }

    /// Whether this device has `kernel` (its minimum architecture is met).
    pub(crate) fn has(&self, kernel: Kernel) -> bool {
        self.table[kernel.index()].iter().all(Option::is_some)
    }

    pub(crate) fn empty(&self) -> &CudaFunction {
        &self.empty
    }

    pub(crate) fn sync_floor(&self) -> &CudaFunction {
        &self.sync_floor
    }

    pub(crate) fn spin(&self) -> &CudaFunction {
        &self.spin
    }

    pub(crate) fn produce(&self) -> &CudaFunction {
        &self.produce
    }

    /// The PDL consumer of the tests (`symm_consume`).
    pub(crate) fn consume(&self) -> &CudaFunction {
        &self.consume
    }

    /// Whether launches may use Programmatic Dependent Launch (compute capability 9.0+).
    pub(crate) fn supports_pdl(&self) -> bool {
        self.arch >= 90
    }

    /// Fewest resident blocks per SM over the kernels of each family and every dtype:
    /// `(one-shot family, two-shot family)`.
    pub(crate) fn blocks_per_sm(&self, threads: u32) -> Result<(usize, usize)> {
        let mut least = [usize::MAX; 2];
        for spec in KERNELS.iter().filter(|s| s.family != Family::Local) {
            for f in self.table[spec.kernel.index()].iter().flatten() {
                let n = f
                    .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
                    .during("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
                let slot = &mut least[(spec.family == Family::TwoShot) as usize];
                *slot = (*slot).min(n as usize);
            }
        }
        Ok((least[0], least[1]))
    }
}
