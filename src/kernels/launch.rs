//! The crate's only kernel launch and device-to-device copy: the raw driver calls of the hot
//! path, each behind a function whose callers state why its contract holds.

use std::ffi::c_void;

use cudarc::driver::{result, sys, CudaFunction, CudaStream};

use super::abi::SymmArgs;
use super::coll::GatherCounts;
use crate::error::{CudaResultExt, Result};

/// Launches `func(input, output, len, args)` with `blocks × threads` on `stream`. The context
/// of `stream` must be current. With `pdl` set, the launch carries programmatic stream
/// serialization (`cuLaunchKernelEx`): it may begin while the previous kernel on the stream
/// finishes; every kernel of the fatbin waits for it (`griddepcontrol.wait`) before it
/// touches memory. Only for devices of compute capability 9.0 and newer.
///
/// # Safety
/// `func` takes exactly `(const T*, T*, u64, SymmArgs)`; `input` and `output` are 16-byte
/// aligned device ranges of `len` elements of that `T` on the stream's device (or ignored by
/// `func`); every address in `args` is mapped on that device until the launch completes.
pub(crate) unsafe fn launch(
    func: &CudaFunction,
    (blocks, threads, pdl): (u32, u32, bool),
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
    if pdl {
        // SAFETY: a zeroed launch attribute is a valid C value; the id and value are set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: blocks,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as below; `config` and `attr` are locals that outlive the call.
        let code = unsafe {
            sys::cuLaunchKernelEx(
                &config,
                func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        return code.result().during("cuLaunchKernelEx");
    }
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

/// Writes the 64-bit `value` at `count` places `pitch` bytes apart from `dst` on `stream` (two
/// strided 32-bit memsets: asynchronous, capturable, no host buffer). The context of `stream`
/// must be current.
///
/// # Safety
/// `dst + k * pitch` is 8 bytes of device memory of the stream's device for every k < count,
/// 4-byte aligned; `pitch` is a multiple of 4 and at least 8.
pub(crate) unsafe fn write_u64_strided(
    dst: u64,
    (pitch, count): (usize, usize),
    value: u64,
    stream: &CudaStream,
) -> Result<()> {
    for (offset, half) in [(0, value as u32), (4, (value >> 32) as u32)] {
        // SAFETY: the caller guarantees the 8 bytes at every `dst + k * pitch`; one 32-bit
        // element per row of `count` rows.
        let code =
            unsafe { sys::cuMemsetD2D32Async(dst + offset, pitch, half, 1, count, stream.cu_stream()) };
        code.result().during("cuMemsetD2D32Async")?;
    }
    Ok(())
}

/// Launches the all-gather kernel `func(input, output, 0, args, counts)` with
/// `blocks × threads` on `stream`. The context of `stream` must be current.
///
/// # Safety
/// `func` takes exactly `(const T*, T*, u64, SymmArgs, GatherCounts)`; `input` is a 16-byte
/// aligned device range of `counts.bytes[args.rank]` bytes and `output` one of the sum of the
/// counts, on the stream's device; every address in `args` is mapped on that device until
/// the launch completes.
pub(crate) unsafe fn launch_gather(
    func: &CudaFunction,
    (blocks, threads): (u32, u32),
    input: u64,
    output: u64,
    args: &SymmArgs,
    counts: &GatherCounts,
    stream: &CudaStream,
) -> Result<()> {
    let mut input = input;
    let mut output = output;
    let mut n = 0u64;
    let mut args = *args;
    let mut counts = *counts;
    let mut params: [*mut c_void; 5] = [
        (&mut input as *mut u64).cast(),
        (&mut output as *mut u64).cast(),
        (&mut n as *mut u64).cast(),
        (&mut args as *mut SymmArgs).cast(),
        (&mut counts as *mut GatherCounts).cast(),
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
