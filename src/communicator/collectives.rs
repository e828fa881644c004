//! The collectives beside the all-reduce: `all_gather`, `all_gather_v` and `reduce_scatter`.
//! Same call path as the all-reduce: validate once (`plan::collective`), route (a `Copy`
//! value), check placement for the target, launch the peer kernel or NCCL. Nothing on the
//! path allocates or formats text unless the call is refused.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::{Communicator, Paths};
use crate::config::Algorithm;
use crate::driver::nvtx;
use crate::dtype::{DType, Element, Gatherable};
use crate::error::{Error, Result};
use crate::kernels::registry::Kernel;
use crate::plan::collective::{
    explain_collective, route_collective, validate_all_gather, validate_all_gather_v,
    validate_reduce_scatter, CollShape, Collective,
};
use crate::plan::route::{Route, Target};
use crate::plan::PathDecision;

/// Validated addresses of one collective call.
struct Buffers {
    input: u64,
    output: u64,
    /// Bytes per element: the alignment the kernels need (views at any element offset work).
    element: usize,
    input_device: usize,
    output_device: usize,
    stream_device: usize,
}

impl Communicator {
    /// Gathers every rank's `input` into `output` on every rank, rank-major: rank q's
    /// elements land at `output[q·len .. (q+1)·len]`, where `len = input.len()` and
    /// `output.len() == world · len`. Copies bytes, so `u8`/`i8` (packed fp8, fp4, int8) work
    /// like the float types; any length. All ranks must make the same sequence of calls with
    /// the same lengths (a length that differs across ranks is reported by
    /// [`synchronize`](Self::synchronize) as [`Error::CountsMismatch`] when the kernels take
    /// the call). Routed like the all-reduce: the low-latency kernel while the lines one rank
    /// pushes to one peer (twice its chunk: 8 payload bytes per 16-byte line, so that any
    /// byte pattern is data) fit `Config::low_latency_max_bytes`, the one-shot kernel up to
    /// the workspace, NCCL (`ncclAllGather`) above `Config::nccl_above_bytes` (compared with
    /// the gathered size) or the workspace; see [`all_gather_path`](Self::all_gather_path).
    /// In the low-latency range a length that differs across ranks is not reported as
    /// `CountsMismatch`: the ranks wait for lines that never come, time out, and the
    /// communicator is poisoned (`Config::check_divergence` reports it as `Diverged` first).
    pub fn all_gather<T: Gatherable>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.all_gather_with(input, output, stream, Algorithm::Auto)
    }

    /// [`all_gather`](Self::all_gather) with a forced algorithm: `Auto`, `LowLatency`
    /// (refused above the low-latency slots), `OneShot` (refused above the workspace) or
    /// `Nccl`.
    pub fn all_gather_with<T: Gatherable>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
        algorithm: Algorithm,
    ) -> Result<()> {
        self.check_usable()?;
        let size = std::mem::size_of::<T>();
        let shape = validate_all_gather(size, input.len(), output.len(), self.world)?;
        let route = route_collective(&shape, &self.config, algorithm, self.facts())?;
        let chunk = input.len() * size;
        let counts = std::iter::repeat_n(chunk, self.world);
        self.with_addresses(input, output, stream, |b| {
            self.run_gather(&shape, &route, b, counts, stream)
        })
    }

    /// Gathers `counts[q]` elements from every rank q into `output`, rank-major (rank q's
    /// elements start at `counts[..q].sum()`). `counts` has one entry per rank and is the
    /// same on every rank; this rank's entry is `input.len()`; `output.len()` is the sum.
    /// Counts that differ across ranks are detected on the device before any peer data is
    /// read (every rank publishes its counts next to its data and compares every peer's):
    /// [`synchronize`](Self::synchronize) then returns [`Error::CountsMismatch`] on every
    /// rank, the output's peer chunks are left as they were, and the communicator stays
    /// usable. The one-shot kernel (always its whole grid, so that ranks that disagree still
    /// meet) up to the workspace; NCCL, as one group of `ncclBroadcast`s rooted at each rank
    /// (NCCL has no all-gather-v), above `Config::nccl_above_bytes` (the gathered size) or
    /// when the largest chunk exceeds the workspace, or when the peer kernels are not set up.
    /// NCCL does not check the counts: on that path counts that disagree are undefined
    /// behaviour (a hang or wrong bytes). Without a fallback a chunk above the workspace is
    /// refused with [`Error::ExceedsCapacity`]. See
    /// [`all_gather_v_path`](Self::all_gather_v_path).
    pub fn all_gather_v<T: Gatherable>(
        &self,
        input: &impl DevicePtr<T>,
        counts: &[usize],
        output: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check_usable()?;
        let size = std::mem::size_of::<T>();
        let shape = validate_all_gather_v(size, counts, self.rank, input.len(), output.len(), self.world)?;
        let route = route_collective(&shape, &self.config, Algorithm::Auto, self.facts())?;
        let bytes = counts.iter().map(|&c| c * size);
        self.with_addresses(input, output, stream, |b| {
            self.run_gather(&shape, &route, b, bytes, stream)
        })
    }

    /// Sums `input` (`world · len` elements) over all ranks and leaves this rank's slice,
    /// elements `[rank·len, (rank+1)·len)` of the sum, in `output` (`len` elements). fp32
    /// accumulation in absolute rank order, rounded once: the kernel's output has the bits of
    /// the same slice of an [`all_reduce`](Self::all_reduce) of the same inputs. Routed like
    /// [`all_gather`](Self::all_gather) (`ncclReduceScatter` where NCCL takes it, whose sums
    /// are NCCL's own); the low-latency kernel (the all-reduce's lines, the same bits) while
    /// the padded slice fits the low-latency threshold of the dtype and world; see
    /// [`reduce_scatter_path`](Self::reduce_scatter_path).
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.reduce_scatter_with(input, output, stream, Algorithm::Auto)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) with a forced algorithm: `Auto`,
    /// `LowLatency`, `OneShot` or `Nccl`.
    pub fn reduce_scatter_with<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
        algorithm: Algorithm,
    ) -> Result<()> {
        self.check_usable()?;
        let shape = validate_reduce_scatter(T::DTYPE, input.len(), output.len(), self.world)?;
        let route = route_collective(&shape, &self.config, algorithm, self.facts())?;
        let len = output.len();
        let _range = nvtx::Range::new(|| {
            format!(
                "symm reduce_scatter {} {} {} B",
                route.algorithm(),
                T::DTYPE,
                route.bytes
            )
        });
        self.with_addresses(input, output, stream, |b| match route.target {
            Target::Kernel(kernel, plan) => {
                self.placement(b, true)?;
                let peer = self.peer()?;
                self.ordered(stream, || {
                    peer.launch_reduce_scatter(kernel, plan, T::DTYPE, (b.input, b.output, len), stream)
                })
            }
            Target::Nccl => {
                self.placement(b, false)?;
                let nccl = self.nccl()?;
                self.ordered(stream, || {
                    nccl.reduce_scatter::<T>(b.input, b.output, len, self.world, stream)
                })
            }
        })
    }

    /// Where an [`all_gather`](Self::all_gather) of `bytes_per_rank` bytes from every rank
    /// goes, and why (every rank decides the same).
    pub fn all_gather_path(&self, bytes_per_rank: usize, algorithm: Algorithm) -> Result<PathDecision> {
        let shape = validate_all_gather(
            1,
            bytes_per_rank,
            bytes_per_rank.saturating_mul(self.world),
            self.world,
        )?;
        self.explain_collective(&shape, algorithm)
    }

    /// Where an [`all_gather_v`](Self::all_gather_v) with these per-rank byte counts goes.
    pub fn all_gather_v_path(&self, counts_bytes: &[usize]) -> Result<PathDecision> {
        let own = counts_bytes.get(self.rank).copied().unwrap_or(0);
        let total = counts_bytes.iter().fold(0usize, |s, &c| s.saturating_add(c));
        let shape = validate_all_gather_v(1, counts_bytes, self.rank, own, total, self.world)?;
        self.explain_collective(&shape, Algorithm::Auto)
    }

    /// Where a [`reduce_scatter`](Self::reduce_scatter) into `len` elements of `dtype` per
    /// rank goes.
    pub fn reduce_scatter_path(
        &self,
        len: usize,
        dtype: DType,
        algorithm: Algorithm,
    ) -> Result<PathDecision> {
        let shape = validate_reduce_scatter(dtype, len.saturating_mul(self.world), len, self.world)?;
        self.explain_collective(&shape, algorithm)
    }

    fn explain_collective(&self, shape: &CollShape, algorithm: Algorithm) -> Result<PathDecision> {
        let route = route_collective(shape, &self.config, algorithm, self.facts())?;
        Ok(explain_collective(shape, &route, &self.config, self.facts()))
    }

    /// Reports (once) and clears a counts mismatch an all-gather found on the device. The
    /// caller synchronised the stream, so no kernel of this rank still writes the word.
    pub(super) fn take_counts_mismatch(&self) -> Result<()> {
        let Paths::Peer { peer, .. } = &self.paths else {
            return Ok(());
        };
        let code = peer.error_code();
        match peer.kernel_error(self.config.timeout) {
            Some(err @ Error::CountsMismatch { .. }) => {
                peer.clear_error(code);
                Err(err)
            }
            _ => Ok(()),
        }
    }

    /// Runs `call` with the buffers' addresses, taken through the same bookkeeping as every
    /// call's ([`bookkeeping`](Self::bookkeeping) and [`settle`](Self::settle): capturable
    /// with cudarc's event tracking on), holding cudarc's access guards until it has launched
    /// (so that cudarc orders later uses of the buffers after this call).
    fn with_addresses<T>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
        call: impl FnOnce(&Buffers) -> Result<()>,
    ) -> Result<()> {
        let input_device = input.stream().context().ordinal();
        let output_device = output.stream().context().ordinal();
        let book = self.bookkeeping(stream)?;
        let (in_ptr, read) = input.device_ptr(book);
        let (out_ptr, write) = output.device_ptr_mut(book);
        let _records = self.settle(book, stream, (read, write))?;
        call(&Buffers {
            input: in_ptr,
            output: out_ptr,
            element: std::mem::size_of::<T>(),
            input_device,
            output_device,
            stream_device: stream.context().ordinal(),
        })
    }

    /// Devices, and alignment to the element size where the kernels run (NCCL needs none):
    /// views at any element offset work (the kernels load and store unaligned views with
    /// narrower accesses); only a raw address inside an element is refused.
    fn placement(&self, b: &Buffers, aligned: bool) -> Result<()> {
        let expected = self.device();
        for (which, found) in [
            ("stream", b.stream_device),
            ("input", b.input_device),
            ("output", b.output_device),
        ] {
            if found != expected {
                return Err(Error::WrongDevice {
                    which,
                    expected,
                    found,
                });
            }
        }
        for (which, address) in [("input", b.input), ("output", b.output)] {
            if aligned && address % b.element as u64 != 0 {
                return Err(Error::Misaligned { which, address });
            }
        }
        Ok(())
    }

    fn run_gather(
        &self,
        shape: &CollShape,
        route: &Route,
        b: &Buffers,
        counts: impl Iterator<Item = usize> + Clone,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let _range = nvtx::Range::new(|| {
            format!(
                "symm {} {} {} B",
                shape.collective.name(),
                route.algorithm(),
                route.bytes
            )
        });
        match route.target {
            Target::Kernel(kernel, plan) => {
                self.placement(b, true)?;
                let peer = self.peer()?;
                self.ordered(stream, || {
                    if kernel == Kernel::AllGatherLowLatency {
                        let chunk = counts.clone().nth(self.rank).unwrap_or(0);
                        peer.launch_gather_low_latency(plan, b.input, b.output, chunk, stream)
                    } else {
                        peer.launch_gather(plan, b.input, b.output, counts, stream)
                    }
                })
            }
            Target::Nccl => {
                self.placement(b, false)?;
                let nccl = self.nccl()?;
                self.ordered(stream, || {
                    if shape.collective == Collective::AllGatherV {
                        nccl.all_gather_v_bytes(b.input, b.output, counts, self.rank, stream)
                    } else {
                        let chunk = counts.clone().nth(self.rank).unwrap_or(0);
                        nccl.all_gather_bytes(b.input, b.output, chunk, self.world, stream)
                    }
                })
            }
        }
    }
}
