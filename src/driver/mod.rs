//! Raw driver calls, each owned by an RAII type or behind a small function: VMM
//! allocations and mappings, host-mapped memory, the driver probe, peer access, NVML and the
//! NVTX shim. With `nccl/library.rs` and `kernels/launch.rs`, the only places of the crate
//! that call C (a CPU test, `tests/house.rs`, checks it).

pub(crate) mod graph;
pub(crate) mod host;
pub(crate) mod multicast;
pub(crate) mod nvml;
pub(crate) mod nvtx;
pub(crate) mod p2p;
pub(crate) mod probe;
pub(crate) mod vmm;

use cudarc::driver::sys;

use crate::error::{CudaResultExt, Result};

/// `cuResult` → `Result`, naming the call.
pub(crate) fn check(code: sys::CUresult, call: &'static str) -> Result<()> {
    code.result().during(call)
}
