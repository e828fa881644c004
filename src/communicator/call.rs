//! One call: validate once, route, run on the chosen backend. Nothing on this path
//! allocates or formats text unless the call is refused (or NVTX is on).

use std::sync::Arc;

use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice};

use super::{Communicator, Paths, SymmetricTensor};
use crate::config::Algorithm;
use crate::driver::nvtx;
use crate::dtype::{DType, Element};
use crate::error::{CudaResultExt, Error, Result};
use crate::kernels::abi::BLOCK_STATE_BYTES;
use crate::kernels::launch;
use crate::plan::route::{CallKind, Route, Target};
use crate::plan::validate::{validate_call, validate_lengths, validate_placement, CallShape};

impl Communicator {
    /// Sums `input` over all ranks into `output` (out of place), choosing the path by size
    /// (see [`path`](Self::path)). All ranks must make the same sequence of calls with the
    /// same lengths. Inputs and outputs may be views at any element offset. Every buffer is
    /// an ordinary buffer here, a pool buffer too: the path depends only on what every rank
    /// agrees on (the call, the length, the dtype, the configuration), never on where one
    /// rank's pointer lies. To read a pool buffer in place, call
    /// [`all_reduce_from_pool`](Self::all_reduce_from_pool) on every rank.
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
        let book = self.bookkeeping(stream)?;
        let (in_ptr, read) = input.device_ptr(book);
        let (out_ptr, write) = output.device_ptr_mut(book);
        let _records = self.settle(book, stream, (read, write))?;
        let shape = CallShape {
            input_addr: in_ptr,
            output_addr: out_ptr,
            ..shape
        };
        let route = self.route(CallKind::Buffers, shape.input_len, T::DTYPE, algorithm)?;
        self.run::<T>(&shape, &route, 0, stream)
    }

    /// Sums the pool buffer `input` over all ranks into `output`, reading every rank's copy
    /// of `input` in place (zero-copy) where that is the fastest path: what an ordinary buffer
    /// gets where `Auto` takes the low-latency kernel (it copies nothing in anyway) or the
    /// one-shot (its copy-in costs less than a second barrier), above that the zero-copy
    /// two-shot up to `capacity_bytes`, then what an ordinary buffer gets
    /// ([`pool_path`](Self::pool_path) with `out_of_place`). Every rank calls it with its buffer of the same allocation
    /// (checked on the device before the peers' copies are read: [`Error::PoolMismatch`]).
    /// `input` may be rewritten as soon as the call is complete on the stream. A pool buffer
    /// of another communicator is refused with [`Error::ForeignPoolBuffer`].
    pub fn all_reduce_from_pool<T: Element>(
        &self,
        input: &SymmetricTensor<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check_usable()?;
        let tag = self.pool_tag(input)?;
        let shape = CallShape {
            dtype: T::DTYPE,
            input_len: input.len(),
            output_len: output.len(),
            input_addr: input.device_address(),
            output_addr: 0,
            input_device: self.device(),
            output_device: output.stream().context().ordinal(),
            stream_device: stream.context().ordinal(),
        };
        validate_lengths(&shape)?;
        let book = self.bookkeeping(stream)?;
        let (out_ptr, write) = output.device_ptr_mut(book);
        let _records = self.settle(book, stream, write)?;
        let shape = CallShape {
            output_addr: out_ptr,
            ..shape
        };
        let route = self.route(CallKind::PoolInput, shape.input_len, T::DTYPE, Algorithm::Auto)?;
        self.run::<T>(&shape, &route, tag, stream)
    }

    /// Sums `buffer` over all ranks in place, at any element offset. Every buffer is an
    /// ordinary buffer here (copied in), a pool buffer too: the path depends only on what
    /// every rank agrees on, never on where one rank's pointer lies. To reduce a pool buffer
    /// zero-copy, call [`all_reduce_pool`](Self::all_reduce_pool) on every rank.
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
        let book = self.bookkeeping(stream)?;
        let (ptr, write) = buffer.device_ptr_mut(book);
        let _records = self.settle(book, stream, write)?;
        let shape = CallShape::in_place(T::DTYPE, len, ptr, device, stream_device);
        let route = self.route(CallKind::Buffers, len, T::DTYPE, algorithm)?;
        self.run::<T>(&shape, &route, 0, stream)
    }

    /// Sums a buffer of this communicator's symmetric pool over all ranks, in place
    /// ([`pool_path`](Self::pool_path)): the kernel an ordinary buffer gets where `Auto` takes
    /// the low-latency kernel or the one-shot (the one-shot copies in, in place), above them
    /// the zero-copy in-place kernel, which reads every rank's copy directly. Every rank passes its
    /// buffer of the same allocation. The agreement is checked on the device before any data
    /// is touched; a divergence is [`Error::PoolMismatch`] on every rank (reported by this call
    /// or the next, as a peer timeout is), nothing reduced. A pool buffer of another
    /// communicator is refused with [`Error::ForeignPoolBuffer`] (pass it to
    /// [`all_reduce_in_place`](Self::all_reduce_in_place) to reduce it as an ordinary buffer).
    pub fn all_reduce_pool<T: Element>(
        &self,
        buffer: &mut SymmetricTensor<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check_usable()?;
        let tag = self.pool_tag(buffer)?;
        let (len, ptr) = (buffer.len(), buffer.device_address());
        self.pool_in_place::<T>((len, ptr, self.device()), tag, stream)
    }

    /// [`all_reduce_pool`](Self::all_reduce_pool) on a pool buffer seen through another
    /// handle than its [`SymmetricTensor`] (a DLPack tensor of the Python package, say):
    /// `buffer` must start where one of this communicator's live pool allocations starts, with
    /// that allocation's dtype, and fit in it; anything else is [`Error::ForeignPoolBuffer`],
    /// before anything is launched. The call is what makes it zero-copy (every rank makes
    /// it), never where the pointer lies.
    pub fn all_reduce_pool_buffer<T: Element>(
        &self,
        buffer: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check_usable()?;
        let (len, device) = (buffer.len(), buffer.stream().context().ordinal());
        let book = self.bookkeeping(stream)?;
        let (ptr, write) = buffer.device_ptr_mut(book);
        let _records = self.settle(book, stream, write)?;
        let tag = self.pool_tag_at(ptr, len, T::DTYPE)?;
        self.pool_in_place::<T>((len, ptr, device), tag, stream)
    }

    /// The zero-copy in-place call on `len` elements of a pool buffer at `ptr` (on `device`)
    /// with its tag.
    fn pool_in_place<T: Element>(
        &self,
        (len, ptr, device): (usize, u64, usize),
        tag: u64,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let shape = CallShape::in_place(T::DTYPE, len, ptr, device, stream.context().ordinal());
        validate_lengths(&shape)?;
        let route = self.route(CallKind::Pool, len, T::DTYPE, Algorithm::Auto)?;
        self.run::<T>(&shape, &route, tag, stream)
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
        self.all_reduce_symmetric_with::<T>(len, stream, Algorithm::Auto)
    }

    /// [`all_reduce_symmetric`](Self::all_reduce_symmetric) with an algorithm: `Auto` (the
    /// configured choice), `TwoShot` (the peer in-place kernel), `Multimem` (the NVLS kernel:
    /// [`Error::MulticastUnavailable`] without a multicast object) or `Nccl`; the buffer
    /// algorithms (one-shot, low-latency) take the in-place kernel.
    pub fn all_reduce_symmetric_with<T: Element>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
        algorithm: Algorithm,
    ) -> Result<()> {
        self.check_usable()?;
        let ptr = self.symmetric_buffer();
        let shape = CallShape::in_place(T::DTYPE, len, ptr, self.device(), stream.context().ordinal());
        validate_call(&shape, self.device(), self.config.capacity_bytes)?;
        let route = self.route(CallKind::Symmetric, len, T::DTYPE, algorithm)?;
        self.run::<T>(&shape, &route, 0, stream)
    }

    /// Copies `src` to the start of this rank's symmetric buffer (asynchronously, capturable).
    pub fn copy_to_symmetric<T: Element>(
        &self,
        src: &impl DevicePtr<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check_symmetric_copy::<T>(src.len(), src.stream().context().ordinal(), stream)?;
        let book = self.bookkeeping(stream)?;
        let (ptr, read) = src.device_ptr(book);
        let _records = self.settle(book, stream, read)?;
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
        let book = self.bookkeeping(stream)?;
        let (ptr, write) = dst.device_ptr_mut(book);
        let _records = self.settle(book, stream, write)?;
        self.copy(ptr, self.symmetric_buffer(), len * T::DTYPE.size(), stream)
    }

    /// Lengths and devices as for a call, against the symmetric buffer's size (copies need
    /// no alignment).
    fn check_symmetric_copy<T: Element>(&self, len: usize, device: usize, stream: &CudaStream) -> Result<()> {
        let shape = CallShape::in_place(T::DTYPE, len, 0, device, stream.context().ordinal());
        validate_call(&shape, self.device(), self.layout.data_bytes)
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize, stream: &Arc<CudaStream>) -> Result<()> {
        // SAFETY: both ranges are device memory of this rank's device: one is the symmetric
        // buffer (or its stand-in, of the same size), the other a live cudarc buffer of
        // `bytes` bytes; `check_symmetric_copy` validated the devices and that `bytes` fits.
        self.ordered(stream, || unsafe { launch::copy(dst, src, bytes, stream) })
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

    /// Launches the protocol alone — the epoch read, one all-to-all flag exchange per block and
    /// the call count — with exactly the grid a call of `len` elements would use: the
    /// benchmark's sync floor. It is a call of the group: every rank must make it.
    #[doc(hidden)]
    pub fn launch_sync_floor(
        &self,
        len: usize,
        dtype: DType,
        stream: &Arc<CudaStream>,
        algorithm: Algorithm,
    ) -> Result<()> {
        let peer = self.peer()?;
        let plan = self.plan(len, dtype, algorithm);
        self.ordered(stream, || peer.launch_sync_floor(plan, dtype, len, stream))
    }

    /// Test hook: holds `stream` for `ns` nanoseconds (one spinning thread), so that this
    /// rank's next call starts late.
    #[doc(hidden)]
    pub fn __delay(&self, stream: &CudaStream, ns: u64) -> Result<()> {
        let peer = self.peer()?;
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        peer.launch_spin(ns, stream)
    }

    /// Benchmark hook: copies `src` into `dst` with a small copy kernel launched as an
    /// ordinary kernel (never with Programmatic Dependent Launch, whatever `Config::pdl` says),
    /// standing for the GEMM that writes an all-reduce's input. Not a call of the group: no
    /// other rank takes part. Any element offset works (16-byte accesses where both addresses
    /// allow them). [`Error::Empty`], [`Error::LengthMismatch`] or [`Error::WrongDevice`] before
    /// anything is launched.
    #[doc(hidden)]
    pub fn __launch_producer<T: Element>(
        &self,
        src: &impl DevicePtr<T>,
        dst: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.local_copy(src, dst, stream, |peer, (s, d, bytes)| {
            peer.launch_producer(s, d, bytes, stream)
        })
    }

    /// Test hook: copies `src` into `dst` with a consumer kernel launched with programmatic
    /// stream serialization right after whatever this rank enqueued last on `stream` (the
    /// situation of a PDL-aware kernel after a collective). With `waits` it calls
    /// `griddepcontrol.wait` before reading, as the PDL contract asks; without, it reads at
    /// once, which sees the collective's complete output only with `Config::pdl_at_exit`.
    /// Not a call of the group. [`Error::Empty`], [`Error::LengthMismatch`] or
    /// [`Error::WrongDevice`] before anything is launched.
    #[doc(hidden)]
    pub fn __launch_consumer<T: Element>(
        &self,
        src: &impl DevicePtr<T>,
        dst: &mut impl DevicePtrMut<T>,
        waits: bool,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.local_copy(src, dst, stream, |peer, (s, d, bytes)| {
            peer.launch_consumer(s, d, bytes, waits, stream)
        })
    }

    /// The two copy hooks' common part: lengths and devices checked, the buffers' addresses
    /// taken through the bookkeeping, then `launch(peer, (src, dst, bytes))` (a local kernel,
    /// not a call of the group).
    fn local_copy<T: Element>(
        &self,
        src: &impl DevicePtr<T>,
        dst: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
        launch: impl FnOnce(&crate::backend::peer::PeerBackend, (u64, u64, usize)) -> Result<()>,
    ) -> Result<()> {
        let shape = CallShape {
            dtype: T::DTYPE,
            input_len: src.len(),
            output_len: dst.len(),
            input_addr: 0,
            output_addr: 0,
            input_device: src.stream().context().ordinal(),
            output_device: dst.stream().context().ordinal(),
            stream_device: stream.context().ordinal(),
        };
        validate_lengths(&shape)?;
        validate_placement(&shape, self.device(), false)?;
        let peer = self.peer()?;
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        let book = self.bookkeeping(stream)?;
        let (src_ptr, read) = src.device_ptr(book);
        let (dst_ptr, write) = dst.device_ptr_mut(book);
        let _records = self.settle(book, stream, (read, write))?;
        launch(peer, (src_ptr, dst_ptr, shape.input_len * T::DTYPE.size()))
    }

    /// Test hook: sets this rank's device call counter (every rank must be given the same
    /// value, between calls): the protocol near 2^31 and 2^32 calls without waiting days.
    #[doc(hidden)]
    pub fn __set_call_counter(&self, calls: u64, stream: &Arc<CudaStream>) -> Result<()> {
        let peer = self.peer()?;
        self.ordered(stream, || peer.set_call_counter(calls, stream))
    }

    /// Test hook: the completed-call count in each block's entry of this rank's call state
    /// (synchronises the context; call between calls). Every entry holds the same count
    /// after any sequence of calls, whatever their grids.
    #[doc(hidden)]
    pub fn __call_counts(&self) -> Result<Vec<u64>> {
        let (ptr, bytes) = self.peer()?.call_state_region();
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        self.ctx.synchronize().during("cuCtxSynchronize")?;
        let state = crate::driver::vmm::read(ptr, bytes)?;
        Ok(state
            .chunks_exact(BLOCK_STATE_BYTES)
            .map(|entry| u64::from_le_bytes(std::array::from_fn(|i| entry[i])))
            .collect())
    }

    /// Test hook: whether every byte of this rank's low-latency slots holds the "not yet
    /// arrived" sentinel (synchronises the context; call between calls).
    #[doc(hidden)]
    pub fn __low_latency_slots_armed(&self) -> Result<bool> {
        let (ptr, bytes) = self.peer()?.low_latency_region();
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        self.ctx.synchronize().during("cuCtxSynchronize")?;
        Ok(crate::driver::vmm::read(ptr, bytes)?.iter().all(|&b| b == 0xff))
    }

    /// Test hook: overwrites every byte of this rank's low-latency slots with `byte`, as an
    /// earlier communicator's lines would look (synchronous; call between calls).
    #[doc(hidden)]
    pub fn __scribble_low_latency_slots(&self, byte: u8) -> Result<()> {
        let (ptr, bytes) = self.peer()?.low_latency_region();
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        self.ctx.synchronize().during("cuCtxSynchronize")?;
        crate::driver::vmm::fill(ptr, byte, bytes)
    }

    /// Waits for `stream` and reports a timeout any earlier call hit (and an error NCCL
    /// recorded, for a fallback this crate created). A peer kernel's wait is bounded by
    /// `Config::timeout`; an NCCL call's is NCCL's own business.
    pub fn synchronize(&self, stream: &CudaStream) -> Result<()> {
        stream.synchronize().during("cuStreamSynchronize")?;
        if let Ok(nccl) = self.nccl() {
            nccl.async_error()?;
        }
        self.check_usable()?;
        self.take_counts_mismatch()
    }

    /// Returns the error that made this communicator unusable, if any, without a CUDA call:
    /// the failure itself the first time it is seen, [`Error::Poisoned`] with it as the
    /// cause afterwards.
    pub fn check_usable(&self) -> Result<()> {
        let mut poisoned = super::lock(&self.poisoned);
        if let Some(cause) = poisoned.as_ref() {
            return Err(Error::Poisoned {
                cause: Box::new(cause.clone()),
            });
        }
        let Paths::Peer { peer, .. } = &self.paths else {
            return Ok(());
        };
        match peer.kernel_error(self.config.timeout) {
            // Not a failure of the communicator: reported (once) by `synchronize`.
            None | Some(Error::CountsMismatch { .. }) => Ok(()),
            Some(err) => {
                *poisoned = Some(err.clone());
                Err(err)
            }
        }
    }

    /// The stream on which cudarc does its event bookkeeping for this call's buffers
    /// (`device_ptr(book)` waits on the buffers' last writes or reads there, and the guard it
    /// returns records their read / write event there when dropped).
    ///
    /// With event tracking on (cudarc's default), `device_ptr(stream)` on a stream that is
    /// being captured makes that stream wait on events recorded *outside* the capture (the
    /// upload that filled the input, say), which CUDA refuses
    /// (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`, and the capture is invalidated); it would also
    /// record the buffers' events *inside* the capture, and every later eager use of those
    /// buffers would then wait on a captured event (`CUDA_ERROR_CAPTURED_EVENT`). So:
    /// - eager calls (or tracking off): the caller's stream, exactly cudarc's contract: the
    ///   call waits for earlier writers and later users wait for the call;
    /// - while the caller's stream is capturing: this rank's shadow stream, which the crate
    ///   never captures. The waits become legal eager waits that order nothing in the graph
    ///   (a graph node has no eager predecessor: ordering a replay after the writes that fill
    ///   its inputs is the stream the graph is launched on, as for every captured kernel), and
    ///   the events are recorded eagerly, so cudarc's later eager bookkeeping stays valid.
    ///   Inside the graph, the call is ordered after the work captured before it on the same
    ///   stream, as any captured kernel is.
    ///
    /// No allocation; one `cuStreamIsCapturing` per call when cudarc manages synchronisation.
    pub(super) fn bookkeeping<'s>(&'s self, stream: &'s Arc<CudaStream>) -> Result<&'s CudaStream> {
        let Some(shadow) = &self.shadow.stream else {
            return Ok(stream);
        };
        if !stream.context().is_managing_stream_synchronization() {
            return Ok(stream);
        }
        match stream.capture_status().during("cuStreamIsCapturing")? {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(stream),
            _ => Ok(shadow.stream()),
        }
    }

    /// Ends the bookkeeping of [`bookkeeping`](Self::bookkeeping): on the caller's stream the
    /// guards are kept until the call is enqueued (returned, dropped by the caller after the
    /// launch); on the shadow stream they are dropped now, and if a wait drew the shadow
    /// stream into the capture (a buffer last written by work captured in this same capture
    /// makes the eager shadow wait on a captured event, which forks it into the capture), it
    /// is joined back into the caller's stream so the capture stays well formed.
    pub(super) fn settle<G>(&self, book: &CudaStream, stream: &CudaStream, guards: G) -> Result<Option<G>> {
        if book.cu_stream() == stream.cu_stream() {
            return Ok(Some(guards));
        }
        drop(guards);
        let status = book.capture_status().during("cuStreamIsCapturing")?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            let joined = self
                .shadow
                .join
                .record(book)
                .and_then(|()| stream.wait(&self.shadow.join));
            joined.map_err(|source| Error::StreamOrder { source })?;
        }
        Ok(None)
    }

    /// Enqueues one call of the group on `stream` (`launch` launches it) in this rank's order
    /// of calls: after the previous call, whatever streams, captures and graph replays they
    /// come in, and before the next (`order.rs`). Every launch of a group call goes through
    /// here; the context is bound first.
    pub(super) fn ordered(
        &self,
        stream: &Arc<CudaStream>,
        launch: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        super::lock(&self.order).run(stream, launch)
    }

    /// Validates placement for the route's target and runs it (`pool_tag`: see
    /// kernels/pool.cuh; 0 off the pool).
    pub(super) fn run<T: Element>(
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
                self.ordered(stream, || {
                    peer.launch_tagged(kernel, plan, shape, pool_tag, stream)
                })
            }
            Target::Nccl => {
                validate_placement(shape, self.device(), false)?;
                let nccl = self.nccl()?;
                self.ordered(stream, || {
                    nccl.all_reduce::<T>(shape.input_addr, shape.output_addr, shape.input_len, stream)
                })
            }
        }
    }
}
