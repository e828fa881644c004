//! The NCCL data path: `ncclAllReduce` through the caller's cudarc communicator or through
//! one this crate created, and the plain buffer that stands in for the symmetric buffer when
//! every call goes to NCCL.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use cudarc::nccl::{group_end, group_start, Comm, NcclType, ReduceOp};

use crate::dtype::Element;
use crate::error::{CudaResultExt, Error, Result};
use crate::nccl::comm::{OwnedNcclComm, RawComm};
use crate::nccl::library::library;

/// A device range known only by its address, for cudarc's NCCL API (which takes
/// `DevicePtr`s). It does no event tracking: the caller orders the streams.
struct RawRange<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _type: PhantomData<T>,
}

impl<T> DeviceSlice<T> for RawRange<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for RawRange<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for RawRange<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

/// The NCCL communicator a Communicator hands large (or unmappable) calls to.
#[derive(Debug)]
pub(crate) enum Fallback {
    /// The caller's cudarc communicator. NCCL runs on that communicator's stream, ordered
    /// after the caller's stream by `fork` and back by `join` (nothing extra when the caller
    /// passes the communicator's own stream).
    Cudarc {
        comm: OwnedNcclComm,
        fork: CudaEvent,
        join: CudaEvent,
    },
    /// A communicator this crate created: NCCL runs on the caller's stream itself.
    Raw(RawComm),
}

impl Fallback {
    /// What it is, for the path report.
    pub(crate) fn describe(&self) -> String {
        let lib = library().map_or_else(|_| "NCCL".to_string(), |l| format!("NCCL {}", l.version()));
        match self {
            Fallback::Cudarc { comm, .. } if comm.is_shared() => {
                format!("{lib} through the application's shared communicator (on its stream)")
            }
            Fallback::Cudarc { .. } => format!("{lib} through the caller's communicator (on its stream)"),
            Fallback::Raw(c) => format!("{lib} ({}) on the caller's stream", c.library().name()),
        }
    }

    /// An error NCCL recorded asynchronously (only knowable for a communicator this crate
    /// created).
    pub(crate) fn async_error(&self) -> Result<()> {
        match self {
            Fallback::Raw(c) => c.async_error(),
            Fallback::Cudarc { .. } => Ok(()),
        }
    }

    /// Sums `len` elements at `input` into `output` (may be equal) over all ranks, ordered on
    /// `stream`. The caller validated both ranges: `len` elements of `T` of device memory on
    /// the communicator's device.
    pub(crate) fn all_reduce<T: Element>(
        &self,
        input: u64,
        output: u64,
        len: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        match self {
            Fallback::Raw(c) => {
                c.async_error()?;
                // SAFETY: live communicator; the ranges were validated by the caller (device
                // memory of this device, `len` elements of `T`); the stream is live.
                unsafe { c.all_reduce(input, output, len, T::as_nccl_type(), stream) }
            }
            Fallback::Cudarc { comm, fork, join } => {
                cudarc_all_reduce::<T>(comm.get(), fork, join, input, output, len, stream)
            }
        }
    }
    /// Gathers `chunk_bytes` bytes from every rank (rank-major) into `output`, as
    /// `ncclAllGather` of `ncclUint8`. The caller validated both ranges (`chunk_bytes` at
    /// `input`, `world · chunk_bytes` at `output`, device memory of this device).
    pub(crate) fn all_gather_bytes(
        &self,
        input: u64,
        output: u64,
        chunk_bytes: usize,
        world: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        match self {
            Fallback::Raw(c) => {
                c.async_error()?;
                // SAFETY: live communicator; the caller validated the ranges; live stream.
                unsafe { c.all_gather(input, output, chunk_bytes, u8::as_nccl_type(), stream) }
            }
            Fallback::Cudarc { comm, fork, join } => on_nccl_stream(comm.get(), fork, join, stream, |s| {
                let src = RawRange::<u8>::new(input, chunk_bytes, s);
                let mut dst = RawRange::<u8>::new(output, chunk_bytes * world, s);
                comm.get()
                    .all_gather(&src, &mut dst)
                    .map(|_| ())
                    .map_err(Error::from_cudarc_nccl("ncclAllGather"))
            }),
        }
    }

    /// Gathers `counts[q]` bytes from every rank q (rank-major, no gaps) into `output`, as one
    /// group of `ncclBroadcast`s rooted at each rank in turn (NCCL 2.x has no all-gather-v).
    /// The caller validated both ranges (this rank's count at `input`, the sum at `output`,
    /// device memory of this device) and that the counts are the same on every rank.
    pub(crate) fn all_gather_v_bytes(
        &self,
        input: u64,
        output: u64,
        counts: impl Iterator<Item = usize> + Clone,
        rank: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        match self {
            Fallback::Raw(c) => {
                c.async_error()?;
                // SAFETY: live communicator; the caller validated the ranges; live stream.
                unsafe { c.all_gather_v_bytes(input, output, counts, stream.cu_stream()) }
            }
            Fallback::Cudarc { comm, fork, join } => on_nccl_stream(comm.get(), fork, join, stream, |s| {
                let broadcasts = || {
                    let mut at = 0u64;
                    for (root, count) in counts.clone().enumerate() {
                        if count > 0 {
                            let src = RawRange::<u8>::new(input, count, s);
                            let mut dst = RawRange::<u8>::new(output + at, count, s);
                            comm.get()
                                .broadcast((root == rank).then_some(&src), &mut dst, root as i32)
                                .map_err(Error::from_cudarc_nccl("ncclBroadcast"))?;
                        }
                        at += count as u64;
                    }
                    Ok(())
                };
                // cudarc's group calls reach the library its communicator was made by.
                group_start().map_err(Error::from_cudarc_nccl("ncclGroupStart"))?;
                let result = broadcasts();
                let end = group_end()
                    .map(|_| ())
                    .map_err(Error::from_cudarc_nccl("ncclGroupEnd"));
                result.and(end)
            }),
        }
    }

    /// Sums `world · len` elements at `input` over all ranks and leaves this rank's `len` at
    /// `output`, as `ncclReduceScatter`. The caller validated both ranges.
    pub(crate) fn reduce_scatter<T: Element>(
        &self,
        input: u64,
        output: u64,
        len: usize,
        world: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        match self {
            Fallback::Raw(c) => {
                c.async_error()?;
                // SAFETY: live communicator; the caller validated the ranges; live stream.
                unsafe { c.reduce_scatter(input, output, len, T::as_nccl_type(), stream) }
            }
            Fallback::Cudarc { comm, fork, join } => on_nccl_stream(comm.get(), fork, join, stream, |s| {
                let src = RawRange::<T>::new(input, len * world, s);
                let mut dst = RawRange::<T>::new(output, len, s);
                comm.get()
                    .reduce_scatter(&src, &mut dst, &ReduceOp::Sum)
                    .map(|_| ())
                    .map_err(Error::from_cudarc_nccl("ncclReduceScatter"))
            }),
        }
    }
}

impl<T> RawRange<T> {
    fn new(ptr: u64, len: usize, stream: &Arc<CudaStream>) -> Self {
        RawRange {
            ptr,
            len,
            stream: stream.clone(),
            _type: PhantomData,
        }
    }
}

/// Runs `call` on the cudarc communicator's stream, ordered after `stream` and back (nothing
/// extra when they are the same stream).
fn on_nccl_stream(
    comm: &Comm,
    fork: &CudaEvent,
    join: &CudaEvent,
    stream: &CudaStream,
    call: impl FnOnce(&Arc<CudaStream>) -> Result<()>,
) -> Result<()> {
    let nccl_stream = comm.stream();
    let same = nccl_stream.cu_stream() == stream.cu_stream();
    if !same {
        fork.record(stream).during("cuEventRecord")?;
        nccl_stream.wait(fork).during("cuStreamWaitEvent")?;
    }
    call(&nccl_stream)?;
    if !same {
        join.record(&nccl_stream).during("cuEventRecord")?;
        stream.wait(join).during("cuStreamWaitEvent")?;
    }
    Ok(())
}

fn cudarc_all_reduce<T: Element>(
    comm: &Comm,
    fork: &CudaEvent,
    join: &CudaEvent,
    input: u64,
    output: u64,
    len: usize,
    stream: &CudaStream,
) -> Result<()> {
    let nccl_stream = comm.stream();
    let same = nccl_stream.cu_stream() == stream.cu_stream();
    if !same {
        fork.record(stream).during("cuEventRecord")?;
        nccl_stream.wait(fork).during("cuStreamWaitEvent")?;
    }
    let src = RawRange::<T> {
        ptr: input,
        len,
        stream: nccl_stream.clone(),
        _type: PhantomData,
    };
    let mut dst = RawRange::<T> {
        ptr: output,
        len,
        stream: nccl_stream.clone(),
        _type: PhantomData,
    };
    comm.all_reduce(&src, &mut dst, &ReduceOp::Sum)
        .map_err(Error::from_cudarc_nccl("ncclAllReduce"))?;
    if !same {
        join.record(&nccl_stream).during("cuEventRecord")?;
        stream.wait(join).during("cuStreamWaitEvent")?;
    }
    Ok(())
}

/// A plain device buffer standing in for the symmetric buffer when every call goes to NCCL,
/// so that the zero-copy API keeps working.
pub(crate) struct StandIn {
    _buffer: CudaSlice<u8>,
    ptr: u64,
    bytes: usize,
}

impl std::fmt::Debug for StandIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StandIn({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

impl StandIn {
    pub(crate) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<StandIn> {
        let stream = ctx.default_stream();
        let buffer = stream.alloc_zeros::<u8>(bytes).during("cuMemAlloc")?;
        let ptr = {
            let (ptr, _sync) = buffer.device_ptr(&stream);
            ptr
        };
        stream.synchronize().during("cuStreamSynchronize")?;
        Ok(StandIn {
            _buffer: buffer,
            ptr,
            bytes,
        })
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}
