//! [symm-allreduce](symm_allreduce) collectives on [`candle_core::Tensor`]s: all-reduce (out
//! of place, or in place on the tensor's own storage), all-gather and reduce-scatter along
//! dimension 0, and the fused all-reduce + residual add + RMSNorm; and [`AllReduce`], a
//! `CustomOp1` that takes the place of the NCCL one in candle's `llama_multiprocess` example
//! and in mistral.rs.
//!
//! Every call runs on the tensor's own CUDA stream (its device's `cuda_stream()`), takes any
//! contiguous layout (a start offset into the storage is fine: `narrow` on dimension 0, `i`),
//! and is CUDA-graph capturable where the communicator's call is (outputs are allocated with
//! candle's stream-ordered allocator). CPU and Metal tensors, non-contiguous layouts, dtypes
//! without a kernel and mixed dtypes are refused before anything runs, with an [`Error`] that
//! says what to do (wrapped into `candle_core::Error`).
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use symm_allreduce_candle::{AllReduce, SymmComm};
//!
//! # fn main() -> candle_core::Result<()> {
//! // Two ranks on one GPU (virtual ranks), one candle device (own stream) each.
//! let devices = [Device::new_cuda_with_stream(0)?, Device::new_cuda_with_stream(0)?];
//! let comms = SymmComm::local_group(&devices, symm_allreduce::Config::default())?;
//! std::thread::scope(|s| {
//!     for (comm, dev) in comms.iter().zip(&devices) {
//!         s.spawn(move || -> candle_core::Result<()> {
//!             let x = Tensor::ones((8, 4096), DType::BF16, dev)?;
//!             let sum = x.apply_op1_no_bwd(&AllReduce::new(comm))?; // every element = 2
//!             comm.all_reduce_(&x)?; // in place
//!             // Wait for this rank's collectives before reading anything on the host.
//!             comm.synchronize(dev)?;
//!             assert_eq!(sum.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?[0], 2.0);
//!             Ok(())
//!         });
//!     }
//! });
//! # Ok(()) }
//! ```
//!
//! # Several ranks in one process
//!
//! With [`SymmComm::local_group`] (virtual ranks on one GPU, or one thread per GPU), every
//! rank's thread shares the process's CUDA driver with the other ranks' threads. Two rules
//! keep a rank's thread from blocking the others before they have enqueued their part of a
//! collective (which would hang the group until `Config::timeout`, and leave the outputs
//! unwritten):
//!
//! - **Read results on the host only after [`SymmComm::synchronize`].** candle's `to_vec*`,
//!   `to_scalar` and `to_device(&Device::Cpu)` copy into pageable host memory: the driver
//!   holds the calling thread inside that copy until the stream has reached it, that is until
//!   the collective before it has finished, which needs every peer's collective; meanwhile the
//!   peers' own pageable copies (candle's `Tensor::new`, `from_vec`, `from_slice`) can wait
//!   behind it in the driver, so a peer that still has to upload its input never enqueues its
//!   collective. `synchronize` waits for the stream without holding anything (and reports a
//!   peer timeout as an error, where `to_vec*` would return the unwritten output).
//! - **Ranks sharing a GPU need a stream each**: `Device::new_cuda_with_stream` for every rank
//!   (`local_group` refuses two ranks on one stream, and the implicit streams of
//!   `Device::new_cuda`); and on a shared GPU see [`prepare_shared_gpu`].
//!
//! With one process per GPU (`llama_multiprocess`, mistral.rs) the ranks share no driver
//! state, and `synchronize` is only the way to see a peer timeout.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod check;
mod ops;

use std::sync::Arc;

use candle_core::{Device, Tensor};
use symm_allreduce::{Communicator, Config};

pub use check::Error;

/// Prepares `device`'s stream-ordered memory pool (the pool candle's CUDA allocations come
/// from) for several ranks sharing one GPU (virtual ranks, tests): an allocation on one
/// rank's stream must never wait for another rank's stream. By default CUDA may hand a buffer
/// freed on rank A's stream to an allocation on rank B's stream by making B's stream wait for
/// A's (`CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES`): if A's stream holds a collective
/// that waits for B, B's collective is then queued behind it, and both time out. This turns
/// that reuse off (reuse after the free has completed stays) and keeps the pool's memory once
/// it has grown. Call it on every rank's device before the first collective; with one rank per
/// GPU it is not needed. A device that is not CUDA is candle's error.
pub fn prepare_shared_gpu(device: &candle_core::Device) -> candle_core::Result<()> {
    use symm_allreduce::cudarc::driver::sys;
    let cuda = device.as_cuda_device()?;
    let ctx = cuda.cuda_stream().context().clone();
    ctx.bind_to_thread().map_err(candle_core::Error::wrap)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the device's context is current; `pool` is a valid out-pointer.
    let got = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
    got.result().map_err(candle_core::Error::wrap)?;
    let mut no: std::ffi::c_int = 0;
    let mut keep: u64 = u64::MAX;
    for (attr, value) in [
        (
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            (&mut no as *mut std::ffi::c_int).cast::<std::ffi::c_void>(),
        ),
        (
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast::<std::ffi::c_void>(),
        ),
    ] {
        // SAFETY: `pool` is the device's live default pool; the reuse attribute takes an int,
        // the release threshold a u64, each pointed to by `value`, which outlives the call.
        let code = unsafe { sys::cuMemPoolSetAttribute(pool, attr, value) };
        code.result().map_err(candle_core::Error::wrap)?;
    }
    Ok(())
}
pub use symm_allreduce;

/// docs/candle.md, whose examples are compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../docs/candle.md")]
pub struct CandleGuide;

/// One rank's communicator, shared by the ops and layers of that rank (`Clone` is a
/// reference count). `Send + Sync`, as candle's `apply_op1` and engines' layer types need.
#[derive(Clone)]
pub struct SymmComm {
    comm: Arc<Communicator>,
}

impl std::fmt::Debug for SymmComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SymmComm(rank {} of {})", self.rank(), self.world_size())
    }
}

impl From<Communicator> for SymmComm {
    fn from(comm: Communicator) -> SymmComm {
        SymmComm::new(comm)
    }
}

impl SymmComm {
    /// Wraps a communicator made by any of its constructors (`Communicator::new` over a
    /// bootstrap, `from_nccl`, `from_nccl_shared`, `with_nccl_fallback`).
    pub fn new(comm: Communicator) -> SymmComm {
        SymmComm { comm: Arc::new(comm) }
    }

    /// One communicator per device, all in this process (`Communicator::local_group`, each
    /// rank on its device's context): one rank per GPU, or several ranks on one GPU (virtual
    /// ranks: give each its own stream with `Device::new_cuda_with_stream`; two ranks on one
    /// GPU that share a stream, or use `Device::new_cuda`'s implicit per-thread stream, are
    /// refused with [`Error::SharedStream`]). Read the crate's "Several ranks in one process".
    pub fn local_group(devices: &[Device], config: Config) -> candle_core::Result<Vec<SymmComm>> {
        let streams = devices
            .iter()
            .map(|d| Ok(d.as_cuda_device()?.cuda_stream()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let placement: Vec<(usize, usize)> = streams
            .iter()
            .map(|s| (s.context().ordinal(), s.cu_stream() as usize))
            .collect();
        check::stream_per_rank(&placement)?;
        let contexts: Vec<_> = streams.iter().map(|s| s.context().clone()).collect();
        let comms = Communicator::local_group(&contexts, config).map_err(Error::from)?;
        Ok(comms.into_iter().map(SymmComm::new).collect())
    }

    /// Waits until everything enqueued so far on `device`'s stream (this rank's collectives
    /// among it) has completed, and reports what made a collective fail: a peer that did not
    /// make the same call in time (`symm_allreduce::Error::PeerTimeout`; the outputs of that
    /// call are not written), or an earlier failure of this communicator
    /// (`Communicator::synchronize`). Call it before reading a tensor back to the host
    /// (`to_vec*`, `to_scalar`, `to_device(&Device::Cpu)`) whenever other ranks of the group run
    /// in this process: see the crate's "Several ranks in one process". A device that is not
    /// CUDA is candle's error.
    pub fn synchronize(&self, device: &Device) -> candle_core::Result<()> {
        let stream = device.as_cuda_device()?.cuda_stream();
        self.comm.synchronize(&stream).map_err(Error::from)?;
        Ok(())
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The communicator, for its other calls (`path`, `describe`, `synchronize`, …).
    pub fn communicator(&self) -> &Communicator {
        &self.comm
    }

    /// The sum over all ranks of `x`, as a new tensor of `x`'s shape (f32, f16, bf16).
    pub fn all_reduce(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.apply_op1_no_bwd(&AllReduce::new(self))
    }

    /// Sums `x` over all ranks in place: `x`'s own storage (and every tensor sharing those
    /// elements) holds the sum afterwards.
    pub fn all_reduce_(&self, x: &Tensor) -> candle_core::Result<()> {
        x.inplace_op1(&AllReduce::new(self))
    }

    /// Every rank's `x` stacked along dimension 0, rank-major: `(world·d0, …)` from
    /// `(d0, …)` (f32, f16, bf16, u8). To gather along the last dimension (a column-parallel
    /// output), gather a `(d0, …)` view and `reshape((world, …))` + `permute`.
    pub fn all_gather(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.apply_op1_no_bwd(&ops::AllGather { comm: self })
    }

    /// The sum over all ranks of `x` (`(world·n, …)`), of which this rank keeps rows
    /// `[rank·n, (rank+1)·n)`: `(n, …)` (f32, f16, bf16).
    pub fn reduce_scatter(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.apply_op1_no_bwd(&ops::ReduceScatter { comm: self })
    }

    /// The fused all-reduce + residual add + RMSNorm of tensor-parallel decoders: with this
    /// rank's partial sums `partial` (`[…, hidden]`), `residual ← residual + Σ_ranks partial`
    /// in place and the return value `RMSNorm(residual) · weight` (`weight`: `(hidden,)`),
    /// in one kernel, bit-identical to [`all_reduce`](Self::all_reduce) followed by the
    /// crate's unfused epilogue (`Communicator::residual_rmsnorm`). Every tensor has one
    /// dtype (f32, f16, bf16); `hidden` is a multiple of 16 bytes' worth of elements (see
    /// `symm_allreduce::MAX_HIDDEN`). Needs the peer kernels (the epilogue is theirs).
    pub fn all_reduce_add_rmsnorm(
        &self,
        partial: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> candle_core::Result<Tensor> {
        ops::fused(self, partial, residual, weight, eps)
    }
}

/// The sum over all ranks, as a candle custom op: the drop-in for the NCCL `AllReduce` op of
/// candle's `llama_multiprocess` example and of mistral.rs (`xs.apply_op1_no_bwd(&op)`, or
/// [`apply`](Self::apply)); also an `InplaceOp1` (`xs.inplace_op1(&op)`), which sums in the
/// tensor's own storage.
#[derive(Clone, Debug)]
pub struct AllReduce {
    comm: SymmComm,
}

impl AllReduce {
    /// The op over `comm` (a reference-counted clone is kept).
    pub fn new(comm: &SymmComm) -> AllReduce {
        AllReduce { comm: comm.clone() }
    }

    /// `xs.apply_op1_no_bwd(self)`: the sum as a new tensor.
    pub fn apply(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        xs.apply_op1_no_bwd(self)
    }

    /// The communicator it runs on.
    pub fn comm(&self) -> &SymmComm {
        &self.comm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handles_are_send_and_sync() {
        fn send_sync<T: Send + Sync + 'static>() {}
        send_sync::<SymmComm>();
        send_sync::<AllReduce>();
    }
}
