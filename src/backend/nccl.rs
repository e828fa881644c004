//! The NCCL data path: `ncclAllReduce` through the caller's cudarc communicator or through
//! one this crate created, and the plain buffer that stands in for the symmetric buffer when
//! every call goes to NCCL.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use cudarc::nccl::{Comm, ReduceOp};

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
