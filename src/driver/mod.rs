//! Raw driver calls (VMM, host-mapped memory, the driver probe), each owned by an RAII type.
//! All of the crate's `unsafe` FFI lives here, behind safe types.

pub(crate) mod host;
pub(crate) mod probe;
pub(crate) mod vmm;

use cudarc::driver::sys;

use crate::error::{CudaResultExt, Result};

/// `cuResult` → `Result`, naming the call.
pub(crate) fn check(code: sys::CUresult, call: &'static str) -> Result<()> {
    code.result().during(call)
}
