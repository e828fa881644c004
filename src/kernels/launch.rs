//! The crate's only kernel launch and device-to-device copy: the raw driver calls of the hot
//! path, each behind a function whose callers state why its contract holds.

use std::ffi::c_void;

use cudarc::driver::{result, sys, CudaFunction, CudaStream};

use super::abi::SymmArgs;
use super::coll::GatherCounts;
use crate::error::{CudaResultExt, Result};

/// The launch attributes of one launch. Every launch of the crate goes through [`launch_raw`]
/// with the attributes the backend chose for it (`backend/peer.rs`, `PeerBackend::attributes`),
/// so the three parameter shapes (the collectives', the all-gather's, the norm kernels') get
/// the same attributes the same way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LaunchAttrs {
    /// Programmatic stream serialization (Programmatic Dependent Launch): the launch may begin
    /// while the previous kernel on the stream finishes; every kernel launched so waits for it
    /// (`griddepcontrol.wait`) before it reads or writes memory that kernel may touch. Only
    /// for devices of compute capability 9.0 and newer.
    pub(crate) pdl: bool,
    /// The remote memory-synchronisation domain (`Config::remote_sync_domain`): the kernel's
    /// system-scope fences wait only for the memory traffic of its own domain, not for a
    /// concurrent kernel's of the default domain. Compute capability 9.0 and newer.
    pub(crate) remote_domain: bool,
    /// Blocks per thread-block cluster (0 or 1: no cluster attribute). Only the fused
    /// low-latency kernel is launched in clusters (its grid a multiple of it), only on
    /// compute capability 9.0 and newer, and never more than 8 (the portable size: no
    /// function attribute needed).
    pub(crate) cluster: u32,
}

/// The most attributes one launch carries.
const MAX_ATTRS: usize = 3;

impl LaunchAttrs {
    /// These attributes with a thread-block cluster of `blocks` (0 or 1: none).
    pub(crate) fn with_cluster(self, blocks: u32) -> Self {
        LaunchAttrs {
            cluster: blocks,
            ..self
        }
    }

    /// The driver's attribute list for these settings: the first `n` entries of the array.
    pub(crate) fn driver(self) -> ([sys::CUlaunchAttribute; MAX_ATTRS], usize) {
        // SAFETY: a zeroed launch attribute is a valid C value (id 0, the "ignore" entry);
        // only the first `n` are passed, each with its id and value set below.
        let mut attrs: [sys::CUlaunchAttribute; MAX_ATTRS] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if self.pdl {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if self.remote_domain {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN;
            attrs[n].value.memSyncDomain = sys::CUlaunchMemSyncDomain::CU_LAUNCH_MEM_SYNC_DOMAIN_REMOTE;
            n += 1;
        }
        if self.cluster > 1 {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = self.cluster;
            attrs[n].value.clusterDim.y = 1;
            attrs[n].value.clusterDim.z = 1;
            n += 1;
        }
        (attrs, n)
    }
}

/// The crate's one kernel launch: `func(params)` with `blocks × threads` and `attrs` on
/// `stream` (`cuLaunchKernelEx` with the attribute list; `cuLaunchKernel` when the list is
/// empty, which every driver has). The context of `stream` must be current.
///
/// # Safety
/// `params` points at one value of each of `func`'s parameters, in order, with their types;
/// every address those values hold is valid for `func` until the launch completes.
unsafe fn launch_raw(
    func: &CudaFunction,
    (blocks, threads, attrs): (u32, u32, LaunchAttrs),
    params: &mut [*mut c_void],
    stream: &CudaStream,
) -> Result<()> {
    let (mut list, n) = attrs.driver();
    if n == 0 {
        // SAFETY: the caller guarantees the parameters; `params` points at its locals, which
        // outlive the call (the driver copies them at launch).
        return unsafe {
            result::launch_kernel(
                func.cu_function(),
                (blocks, 1, 1),
                (threads, 1, 1),
                0,
                stream.cu_stream(),
                params,
            )
        }
        .during("cuLaunchKernel");
    }
    let config = sys::CUlaunchConfig {
        gridDimX: blocks,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream.cu_stream(),
        attrs: list.as_mut_ptr(),
        numAttrs: n as u32,
    };
    // SAFETY: as above; `config` and `list` are locals that outlive the call.
    let code = unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    code.result().during("cuLaunchKernelEx")
}

/// Launches `func(input, output, len, args)` with `blocks × threads` and `attrs` on `stream`
/// ([`launch_raw`]).
///
/// # Safety
/// `func` takes exactly `(const T*, T*, u64, SymmArgs)`; `input` and `output` are 16-byte
/// aligned device ranges of `len` elements of that `T` on the stream's device (or ignored by
/// `func`); every address in `args` is mapped on that device until the launch completes;
/// `attrs.pdl` and `attrs.remote_domain` only on devices of compute capability 9.0 and newer.
pub(crate) unsafe fn launch(
    func: &CudaFunction,
    grid: (u32, u32, LaunchAttrs),
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
    // SAFETY: the caller guarantees the signature, the ranges and the attributes; `params`
    // points at the locals above.
    unsafe { launch_raw(func, grid, &mut params, stream) }
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
/// `blocks × threads` and `attrs` on `stream` ([`launch_raw`]).
///
/// # Safety
/// `func` takes exactly `(const T*, T*, u64, SymmArgs, GatherCounts)`; `input` is a 16-byte
/// aligned device range of `counts.bytes[args.rank]` bytes and `output` one of the sum of the
/// counts, on the stream's device; every address in `args` is mapped on that device until
/// the launch completes; the attributes as for [`launch`].
pub(crate) unsafe fn launch_gather(
    func: &CudaFunction,
    grid: (u32, u32, LaunchAttrs),
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
    // SAFETY: the caller guarantees the signature, the ranges and the attributes; `params`
    // points at the locals above.
    unsafe { launch_raw(func, grid, &mut params, stream) }
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
/// fused all-reduce kernels) with `blocks × threads` and `attrs` on `stream` ([`launch_raw`]).
///
/// # Safety
/// `func` takes exactly `(NormArgs)` when `args` is `None` and `(NormArgs, SymmArgs)`
/// otherwise; the four buffers in `norm` are 16-byte aligned device ranges on the stream's
/// device of the sizes its `tokens` and `hidden` give, live until the launch completes; every
/// address in `args` is mapped on that device until the launch completes; the attributes as
/// for [`launch`].
pub(crate) unsafe fn launch_norm(
    func: &CudaFunction,
    grid: (u32, u32, LaunchAttrs),
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
    // SAFETY: the caller guarantees the signature, the ranges and the attributes; `params`
    // points at the locals above.
    unsafe { launch_raw(func, grid, params, stream) }
}

#[cfg(test)]
mod tests {
    /// One driver launch call of each kind, both in the one helper, which the three parameter
    /// shapes call: no launch path with a mechanism or attributes of its own.
    #[test]
    fn every_launch_goes_through_the_one_helper() {
        let code = include_str!("launch.rs");
        let code = code.split("#[cfg(test)]").next().unwrap_or_default();
        assert_eq!(code.matches("sys::cuLaunchKernelEx(").count(), 1);
        assert_eq!(code.matches("result::launch_kernel(").count(), 1);
        assert_eq!(
            code.matches("launch_raw(").count(),
            4,
            "the helper and its three callers"
        );
        let helper = &code[code.find("unsafe fn launch_raw(").unwrap()..];
        let helper = &helper[..helper.find("\n}\n").unwrap()];
        assert!(helper.contains("sys::cuLaunchKernelEx(") && helper.contains("result::launch_kernel("));
    }
}
