//! One call: validate once, route, run on the chosen backend. Nothing on this path
//! allocates or formats text unless the call is refused (or NVTX is on).

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::{Communicator, Paths, SymmetricTensor};
use crate::config::Algorithm;
use crate::driver::nvtx;
use crate::dtype::{DType, Element};
use crate::error::{CudaResultExt, Error, Result};
use crate::kernels::launch;
use crate::plan::route::{CallKind, Route, Target};
use crate::plan::validate::{validate_call, validate_lengths, validate_placement, CallShape};

impl Communicator {
    /// Sums `input` over all ranks into `output` (out of place), choosing the path by size
    /// (see [`path`](Self::path)). All ranks must make the same sequence of calls with the
    /// same lengths. Inputs and outputs may be views at any element offset. With
    /// `Algorithm::Auto`, an `input` that is (a 16-byte aligned view of) one of this
    /// communicator's pool buffers ([`alloc_symmetric`](Self::alloc_symmetric)) is read in
    /// place by the zero-copy two-shot, up to `capacity_bytes` ([`pool_path`](Self::pool_path)
    /// with `out_of_place`); every rank then passes its buffer of the same allocation.
    pub fn all_reduce<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.all_reduce_with(input, output, stream, Algorithm::Auto)
    }

    /// [`all_reduce`](Self::all_reduce) with a forced algorithm (`Auto` = the configured
    /// choice; `Nccl` needs a fallback).
    pub fn all_reduce_with<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
        algorithm: Algorithm,
    ) -> Result<()> {
        self.check_usable()?;
        let shape = CallShape {
            dtype: T::DTYPE,
            input_len: input.len(),
            output_len: output.len(),
            input_addr: 0,
            output_addr: 0,
            input_device: input.stream().context().ordinal(),
            output_device: output.stream().context().ordinal(),
            stream_device: stream.context().ordinal(),
        };
        validate_lengths(&shape)?;
        let (in_ptr, _read) = input.device_ptr(stream);
        let (out_ptr, _write) = output.device_ptr_mut(stream);
        let shape = CallShape {
            input_addr: in_ptr,
            output_addr: out_ptr,
            ..shape
        };
        // An input in this communicator's pool (16-byte aligned) is read in place.
        let tag = match algorithm {
            Algorithm::Auto => self.zero_copy_tag(in_ptr, shape.input_len * T::DTYPE.size()),
            _ => None,
        };
        let (kind, tag) = match tag {
            Some(tag) => (CallKind::PoolInput, tag),
            None => (CallKind::Buffers, 0),
        };
        let route = self.route(kind, shape.input_len, T::DTYPE, algorithm)?;
        self.run::<T>(&shape, &route, tag, stream)
    }

    /// Sums `buffer` over all ranks in place. With `Algorithm::Auto`, a 16-byte aligned
    /// buffer (or view) that lies inside one of this communicator's pool buffers
    /// ([`alloc_symmetric`](Self::alloc_symmetric)) is reduced zero-copy: the in-place kernel
    /// reads every rank's copy of it directly ([`pool_path`](Self::pool_path) says where it
    /// goes). Anything else, a pool buffer of another communicator included, is an ordinary
    /// buffer: copied in, at any element offset.
    pub fn all_reduce_in_place<T: Element>(
        &self,
        buffer: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
        algorithm: Algorithm,
    ) -> Result<()> {
        self.check_usable()?;
        let len = buffer.len();
        let device = buffer.stream().context().ordinal();
        let stream_device = stream.context().ordinal();
        validate_lengths(&CallShape::in_place(T::DTYPE, len, 0, device, stream_device))?;
        let (ptr, _write) = buffer.device_ptr_mut(stream);
        let shape = CallShape::in_place(T::DTYPE, len, ptr, device, stream_device);
        let tag = match algorithm {
            Algorithm::Auto => self.zero_copy_tag(ptr, len * T::DTYPE.size()),
            _ => None,
        };
        let (kind, tag) = match tag {
            Some(tag) => (CallKind::Pool, tag),
            None => (CallKind::Buffers, 0),
        };
        let route = self.route(kind, len, T::DTYPE, algorithm)?;
        self.run::<T>(&shape, &route, tag, stream)
    }

    /// Sums a buffer of this communicator's symmetric pool over all ranks, in place and
    /// zero-copy ([`pool_path`](Self::pool_path)): every rank passes its buffer of the same
    /// allocation. The agreement is checked on the device before any data is touched; a
    /// divergence is [`Error::PoolMismatch`] on every rank (reported by this call or the next,
    /// as a peer timeout is), nothing reduced. A pool buffer of another communicator is
    /// refused with [`Error::ForeignPoolBuffer`] (pass it to
    /// [`all_reduce_in_place`](Self::all_reduce_in_place) to reduce it as an ordinary buffer).
    pub fn all_reduce_pool<T: Element>(
        &self,
        buffer: &mut SymmetricTensor<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check_usable()?;
        let pool = self.pool()?;
        if buffer.pool_id() != pool.id() {
            return Err(Error::ForeignPoolBuffer {
                expected: pool.id(),
                found: buffer.pool_id(),
            });
        }
        self.all_reduce_in_place(buffer, stream, Algorithm::Auto)
    }

    /// Device address of this rank's symmetric buffer: [`crate::Layout::data_bytes`] bytes
    /// (at least `Config::capacity_bytes`), 16-byte aligned, mapped by every peer. Write the
    /// data to reduce there (from your own kernel's epilogue, or with
    /// [`copy_to_symmetric`](Self::copy_to_symmetric)), then call
    /// [`all_reduce_symmetric`](Self::all_reduce_symmetric), which skips the copy-in. (When
    /// every call goes to NCCL this is a plain buffer of the same size, reduced by NCCL in
    /// place.)
    pub fn symmetric_buffer(&self) -> u64 {
        match &self.paths {
            Paths::Peer { peer, .. } => peer.symmetric_buffer(),
            Paths::NcclOnly { standin, .. } => standin.ptr(),
        }
    }

    /// Sums the first `len` elements of every rank's symmetric buffer, in place, zero-copy:
    /// each rank reduces a 1/W slice from all peers and writes the sum into every rank's
    /// buffer, with a start and an end barrier. The buffer may be rewritten as soon as the
    /// call is complete on the stream. Same bits as [`all_reduce`](Self::all_reduce). Sizes
    /// that [`symmetric_path`](Self::symmetric_path) sends to NCCL are reduced by NCCL in
    /// place.
    pub fn all_reduce_symmetric<T: Element>(&self, len: usize, stream: &Arc<CudaStream>) -> Result<()> {
        self.check_usable()?;
        let ptr = self.symmetric_buffer();
        let shape = CallShape::in_place(T::DTYPE, len, ptr, self.device(), stream.context().ordinal());
        validate_call(&shape, self.device(), self.config.capacity_bytes)?;
        let route = self.route(CallKind::Symmetric, len, T::DTYPE, Algorithm::Auto)?;
        self.run::<T>(&shape, &route, 0, stream)
    }

    /// Copies `src` to the start of this rank's symmetric buffer (asynchronously, capturable).
    pub fn copy_to_symmetric<T: Element>(
        &self,
        src: &impl DevicePtr<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check_symmetric_copy::<T>(src.len(), src.stream().context().ordinal(), stream)?;
        let (ptr, _read) = src.device_ptr(stream);
        self.copy(self.symmetric_buffer(), ptr, src.len() * T::DTYPE.size(), stream)
    }

    /// Copies the first `dst.len()` elements of this rank's symmetric buffer into `dst`.
    pub fn copy_from_symmetric<T: Element>(
        &self,
        dst: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check_symmetric_copy::<T>(dst.len(), dst.stream().context().ordinal(), stream)?;
        let len = dst.len();
        let (ptr, _write) = dst.device_ptr_mut(stream);
        self.copy(ptr, self.symmetric_buffer(), len * T::DTYPE.size(), stream)
    }

    /// Lengths and devices as for a call, against the symmetric buffer's size (copies need
    /// no alignment).
    fn check_symmetric_copy<T: Element>(&self, len: usize, device: usize, stream: &CudaStream) -> Result<()> {
        let shape = CallShape::in_place(T::DTYPE, len, 0, device, stream.context().ordinal());
        validate_call(&shape, self.device(), self.layout.data_bytes)
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize, stream: &Arc<CudaStream>) -> Result<()> {
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        self.order_after_previous_call(stream)?;
        // SAFETY: both ranges are device memory of this rank's device: one is the symmetric
        // buffer (or its stand-in, of the same size), the other a live cudarc buffer of
        // `bytes` bytes; `check_symmetric_copy` validated the devices and that `bytes` fits.
        unsafe { launch::copy(dst, src, bytes, stream) }
    }

    /// Launches the body-less kernel with exactly the grid a call of `len` elements would
    /// use: the benchmark's floor for launch and graph-replay cost.
    #[doc(hidden)]
    pub fn launch_empty(
        &self,
        len: usize,
        dtype: DType,
        stream: &CudaStream,
        algorithm: Algorithm,
    ) -> Result<()> {
        let peer = self.peer()?;
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        peer.launch_empty(self.plan(len, dtype, algorithm), stream)
    }

    /// Waits for `stream` and reports a timeout any earlier call hit (and an error NCCL
    /// recorded, for a fallback this crate created). A peer kernel's wait is bounded by
    /// `Config::timeout`; an NCCL call's is NCCL's own business.
    pub fn synchronize(&self, stream: &CudaStream) -> Result<()> {
        stream.synchronize().during("cuStreamSynchronize")?;
        if let Ok(nccl) = self.nccl() {
            nccl.async_error()?;
        }
        self.check_usable()
    }

    /// Returns the error that made this communicator unusable, if any, without a CUDA call:
    /// the failure itself the first time it is seen, [`Error::Poisoned`] with it as the
    /// cause afterwards.
    pub fn check_usable(&self) -> Result<()> {
        if let Some(cause) = self.poisoned.borrow().as_ref() {
            return Err(Error::Poisoned {
                cause: Box::new(cause.clone()),
            });
        }
        let Paths::Peer { peer, .. } = &self.paths else {
            return Ok(());
        };
        match peer.kernel_error(self.config.timeout) {
            None => Ok(()),
            Some(err) => {
                *self.poisoned.borrow_mut() = Some(err.clone());
                Err(err)
            }
        }
    }

    /// Orders this call after the communicator's previous one when it comes on another
    /// stream: an event recorded on the previous stream, waited for by this one (both
    /// capturable). Two calls of one rank never run at once, whatever streams they come on.
    fn order_after_previous_call(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let mut order = self.order.borrow_mut();
        match &order.last {
            Some(last) if last.cu_stream() == stream.cu_stream() => return Ok(()),
            Some(last) => {
                let ordered = order.event.record(last).and_then(|()| stream.wait(&order.event));
                ordered.map_err(|source| Error::StreamOrder { source })?;
            }
            None => {}
        }
        order.last = Some(stream.clone());
        Ok(())
    }

    /// Validates placement for the route's target and runs it (`pool_tag`: see
    /// kernels/pool.cuh; 0 off the pool).
    fn run<T: Element>(
        &self,
        shape: &CallShape,
        route: &Route,
        pool_tag: u64,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let _range = nvtx::Range::new(|| {
            format!(
                "symm all_reduce {} {} {} B",
                route.algorithm(),
                shape.dtype,
                route.bytes
            )
        });
        match route.target {
            Target::Kernel(kernel, plan) => {
                validate_placement(shape, self.device(), true)?;
                let peer = self.peer()?;
                self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
                self.order_after_previous_call(stream)?;
                peer.launch_tagged(kernel, plan, shape, pool_tag, stream)
            }
            Target::Nccl => {
                validate_placement(shape, self.device(), false)?;
                self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
                self.order_after_previous_call(stream)?;
                self.nccl()?
                    .all_reduce::<T>(shape.input_addr, shape.output_addr, shape.input_len, stream)
            }
        }
    }
}
