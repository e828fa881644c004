//! The crate's only kernel launch and device-to-device copy: the raw driver calls of the hot
//! path, each behind a function whose callers state why its contract holds.

use std::ffi::c_void;

use cudarc::driver::{result, sys, CudaFunction, CudaStream};

use super::abi::SymmArgs;
use crate::error::{CudaResultExt, Result};

/// Launches `func(input, output, len, args)` with `blocks × threads` on `stream`. The context
/// of `stream` must be current.
///
/// # Safety
/// `func` takes exactly `(const T*, T*, u64, SymmArgs)`; `input` and `output` are 16-byte
/// aligned device ranges of `len` elements of that `T` on the stream's device (or ignored by
/// `func`); every address in `args` is mapped on that device until the launch completes.
pub(crate) unsafe fn launch(
    func: &CudaFunction,
    (blocks, threads): (u32, u32),
    input: u64,
    output: u64,
    len: usize,
    args: &SymmArgs,
    stream: &CudaStream,
) -> Result<()> {
    let mut input = input;
    let mut output = output;
    let mut n = len as u64;
    let mut args = *args;
    let mut params: [*mut c_void; 4] = [
        (&mut input as *mut u64).cast(),
        (&mut output as *mut u64).cast(),
        (&mut n as *mut u64).cast(),
        (&mut args as *mut SymmArgs).cast(),
    ];
    // SAFETY: the caller guarantees the signature and the ranges; `params` points at locals
    // that outlive the call (the driver copies them at launch).
    unsafe {
        result::launch_kernel(
            func.cu_function(),
            (blocks, 1, 1),
            (threads, 1, 1),
            0,
            stream.cu_stream(),
            &mut params,
        )
    }
    .during("cuLaunchKernel")
}

/// Copies `bytes` from `src` to `dst` on `stream` (asynchronous, capturable). The context of
/// `stream` must be current.
///
/// # Safety
/// Both ranges are `bytes` long, device memory of the stream's device, live until the copy
/// completes.
pub(crate) unsafe fn copy(dst: u64, src: u64, bytes: usize, stream: &CudaStream) -> Result<()> {
    // SAFETY: the caller guarantees both ranges.
    let code = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream()) };
    code.result().during("cuMemcpyDtoDAsync")
}

/// Launches a residual + RMSNorm kernel: `func(norm)` (unfused) or `func(norm, args)` (the
/// fused all-reduce kernels) with `blocks × threads` on `stream`. The context of `stream`
/// must be current.
///
/// # Safety
/// `func` takes exactly `(NormArgs)` when `args` is `None` and `(NormArgs, SymmArgs)`
/// otherwise; the four buffers in `norm` are 16-byte aligned device ranges on the stream's
/// device of the sizes its `tokens` and `hidden` give, live until the launch completes; every
/// address in `args` is mapped on that device until the launch completes.
pub(crate) unsafe fn launch_norm(
    func: &CudaFunction,
    (blocks, threads): (u32, u32),
    norm: &super::norm_abi::NormArgs,
    args: Option<&SymmArgs>,
    stream: &CudaStream,
) -> Result<()> {
    let mut norm = *norm;
    let mut symm = args.copied().unwrap_or_default();
    let mut params: [*mut c_void; 2] = [
        (&mut norm as *mut super::norm_abi::NormArgs).cast(),
        (&mut symm as *mut SymmArgs).cast(),
    ];
    let params = &mut params[..if args.is_some() { 2 } else { 1 }];
    // SAFETY: the caller guarantees the signature and the ranges; `params` points at locals
    // that outlive the call (the driver copies them at launch).
    unsafe {
        result::launch_kernel(
            func.cu_function(),
            (blocks, 1, 1),
            (threads, 1, 1),
            0,
            stream.cu_stream(),
            params,
        )
    }
    .during("cuLaunchKernel")
}
