//! Finding the driver and devices without ever panicking.
//!
//! cudarc panics on its first call when `libcuda` cannot be loaded, so the library is
//! looked for here first, under the names cudarc's loader finds it by.

use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;

use crate::error::{CudaResultExt, Error, Result};

/// `libcuda.so`, then the driver's soname. Written out here rather than taken from
/// `cudarc::get_lib_name_candidates`, which exists only when cudarc loads the libraries itself
/// (`dynamic-loading`), not when the application links them (`dynamic-linking`, as candle and
/// mistral.rs select; the library is then loaded before `main` and the check passes).
const DRIVER_NAMES: [&str; 2] = ["libcuda.so", "libcuda.so.1"];

/// Whether `libcuda` can be loaded (checked once per process).
fn driver_library() -> Result<()> {
    static PRESENT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PRESENT
        .get_or_init(|| {
            for name in DRIVER_NAMES {
                // SAFETY: loading libcuda runs its initialisers, which have no preconditions;
                // the handle is dropped at once (cudarc opens its own).
                if unsafe { libloading::Library::new(name) }.is_ok() {
                    return Ok(());
                }
            }
            Err("no library named libcuda.so or libcuda.so.1 on the loader path".to_string())
        })
        .clone()
        .map_err(|detail| Error::DriverUnavailable { detail })
}

/// Number of CUDA devices, or why there are none.
pub fn device_count() -> Result<usize> {
    driver_library()?;
    cudarc::driver::result::init().during("cuInit")?;
    let n = cudarc::driver::result::device::get_count().during("cuDeviceGetCount")?;
    if n <= 0 {
        return Err(Error::NoDevice);
    }
    Ok(n as usize)
}

/// The primary context of device `ordinal`, or a typed error (never a panic) when there is
/// no driver, no device, or no such ordinal.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::DeviceNotFound { ordinal, count });
    }
    CudaContext::new(ordinal).during("cuDevicePrimaryCtxRetain")
}
