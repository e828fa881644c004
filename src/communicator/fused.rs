//! The fused all-reduce + residual add + RMSNorm call, and the unfused residual + RMSNorm
//! epilogue that gives the same bits after [`Communicator::all_reduce`].
//!
//! # Numerics (exact)
//! For every row of `hidden` elements, with `round` = round-to-nearest-even to the dtype and
//! every fp32 operation correctly rounded (explicit `__fadd_rn`, `__fmaf_rn`, `__fdiv_rn`,
//! `__fsqrt_rn`, `__fmul_rn` in kernels/fused_norm.cuh; no fast math):
//! 1. `s = round(x_0 + x_1 + … + x_{W-1})`: fp32, absolute rank order (exactly the bits of
//!    `all_reduce`);
//! 2. `r = round(residual + s)` (one fp32 add): written back to `residual`;
//! 3. `ss = Σ r²` in fp32 by fused multiply-adds in a fixed order: thread `t` of a
//!    512-thread block accumulates the elements of packs `t, t+512, …` in index order, then
//!    the 512 partials are added by a fixed tree (shuffle-down 16, 8, 4, 2, 1 in each warp,
//!    then the same tree over the 16 warp sums);
//! 4. `inv = 1 / sqrt(ss / hidden + eps)` (`__fdiv_rn`, `__fsqrt_rn`: IEEE, not `rsqrtf`);
//! 5. `norm_out = round(round(r · inv) · weight)` (Hugging Face Llama's order).
//!
//! The 512 threads of step 3 are those of one block per row in the one-shot and two-shot
//! kernels and in the epilogue kernel; the low-latency kernel spreads a row over a cluster of
//! C blocks (compute capability 9.0+) and block c runs the threads `c·512/C …` of that tree
//! as "virtual threads", exchanging its warp sums through distributed shared memory. So
//! nothing depends on the grid: the fused low-latency kernel, the fused one-shot, the fused
//! two-shot, every rank, and `all_reduce` followed by [`Communicator::residual_rmsnorm`] give
//! the same bits. The low-latency kernel has no barrier: every rank pushes its rows a 32-bit
//! word per thread into every peer's low-latency slots and sums the words that arrive, as the
//! low-latency all-reduce does. The two-shot splits the *reduction* by rows (rank q sums the
//! rows of its range of `⌈T/W⌉` and keeps the sums in its buffer) and every rank runs the
//! epilogue on every row with its own residual, so a rank's residual and weight never leave it
//! and each rank's result is what the one-shot computes from its own residual (in tensor
//! parallelism the residual is replicated, so all ranks hold the same bits).

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::Communicator;
use crate::config::Algorithm;
use crate::dtype::{DType, Element};
use crate::error::{CudaResultExt, Error, Result};
use crate::kernels::norm_abi::NormArgs;
use crate::kernels::registry::Kernel;
use crate::plan::explain::PathDecision;
use crate::plan::fused::{explain_fused, route_fused, NormShape};
use crate::plan::grid::grid;
use crate::plan::route::Target;
use crate::plan::validate::CallShape;

impl Communicator {
    /// Fused all-reduce + residual add + RMSNorm over `[tokens, hidden]` rows:
    /// `residual ← residual + Σ_ranks input` and `norm_out ← RMSNorm(residual) · weight`,
    /// in one kernel where that is faster (see the module documentation of the exact
    /// numerics; `hidden` is `weight.len()`, a multiple of the dtype's elements per 16-byte
    /// pack, at most [`MAX_HIDDEN`](crate::MAX_HIDDEN)). Every rank passes its own partial
    /// sums, its own residual (the same on every rank in tensor parallelism) and the weight.
    /// Bit-identical to [`all_reduce`](Self::all_reduce) followed by
    /// [`residual_rmsnorm`](Self::residual_rmsnorm). Capturable like `all_reduce`.
    pub fn all_reduce_add_rmsnorm<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        residual: &mut impl DevicePtrMut<T>,
        weight: &impl DevicePtr<T>,
        eps: f32,
        norm_out: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.all_reduce_add_rmsnorm_with(input, residual, weight, eps, norm_out, stream, Algorithm::Auto)
    }

    /// [`all_reduce_add_rmsnorm`](Self::all_reduce_add_rmsnorm) with a forced algorithm:
    /// `LowLatency` (up to [`Config::low_latency_limit`](crate::Config::low_latency_limit)
    /// bytes, else [`Error::ExceedsCapacity`]), `OneShot` or `TwoShot` (the multimem
    /// algorithms have no fused kernel: [`Error::InvalidConfig`]; `Nccl` runs NCCL's
    /// all-reduce into `norm_out`, then the unfused epilogue). `Auto`, between ranks: the
    /// low-latency kernel up to the all-reduce's low-latency limit on devices with
    /// thread-block clusters (compute capability 9.0+: a row spread over a cluster), the
    /// one-shot up to the fused one-shot limit, the two-shot above; and where the chosen
    /// one-shot or two-shot kernel would have fewer blocks than there are rows, the
    /// all-reduce into `norm_out` followed by the epilogue kernel (same bits; docs/fused.md).
    /// [`add_rmsnorm_path`](Self::add_rmsnorm_path) says which and why.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_add_rmsnorm_with<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        residual: &mut impl DevicePtrMut<T>,
        weight: &impl DevicePtr<T>,
        eps: f32,
        norm_out: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
        algorithm: Algorithm,
    ) -> Result<()> {
        self.check_usable()?;
        let (tokens, hidden) = self.norm_shape(
            T::DTYPE,
            eps,
            [
                ("input", input.len(), input.stream()),
                ("residual", residual.len(), residual.stream()),
                ("weight", weight.len(), weight.stream()),
                ("norm_out", norm_out.len(), norm_out.stream()),
            ],
            stream,
        )?;
        let route = route_fused(tokens, hidden, T::DTYPE, &self.config, algorithm, self.facts())?;
        // The epilogue kernel is needed on every route: refuse before anything is launched.
        let peer = self.peer()?;
        let book = self.bookkeeping(stream)?;
        let (in_ptr, g_in) = input.device_ptr(book);
        let (res_ptr, g_res) = residual.device_ptr_mut(book);
        let (w_ptr, g_w) = weight.device_ptr(book);
        let (out_ptr, g_out) = norm_out.device_ptr_mut(book);
        let _records = self.settle(book, stream, (g_in, g_res, g_w, g_out))?;
        let norm = norm_args([in_ptr, res_ptr, w_ptr, out_ptr], tokens, hidden, eps)?;
        let _range = crate::driver::nvtx::Range::new(|| {
            format!(
                "symm all_reduce_add_rmsnorm {} {} {tokens}x{hidden}",
                route.algorithm(),
                T::DTYPE
            )
        });
        let elements = tokens * hidden;
        match route.target {
            Target::Kernel(kernel, plan) if kernel.is_fused() => {
                return self.ordered(stream, || peer.launch_norm(kernel, plan, T::DTYPE, &norm, stream));
            }
            // `Auto` where the fused kernel would have more rows than blocks: the all-reduce
            // into norm_out, then the epilogue below.
            Target::Kernel(kernel, plan) => {
                let device = self.device();
                let shape = CallShape {
                    dtype: T::DTYPE,
                    input_len: elements,
                    output_len: elements,
                    input_addr: in_ptr,
                    output_addr: out_ptr,
                    input_device: device,
                    output_device: device,
                    stream_device: device,
                };
                self.ordered(stream, || peer.launch_tagged(kernel, plan, &shape, 0, stream))?;
            }
            Target::Nccl => {
                let nccl = self.nccl()?;
                self.ordered(stream, || nccl.all_reduce::<T>(in_ptr, out_ptr, elements, stream))?;
            }
        }
        // The unfused epilogue over the sums in norm_out (it reads a row before it writes it).
        let sums = NormArgs {
            input: out_ptr,
            ..norm
        };
        let plan = grid(Kernel::RmsNorm, tokens, T::DTYPE, self.world, self.limits);
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        peer.launch_norm(Kernel::RmsNorm, plan, T::DTYPE, &sums, stream)
    }

    /// The unfused epilogue: `residual ← residual + sum` and `norm_out ← RMSNorm(residual) ·
    /// weight` for an already all-reduced `sum` of `[tokens, hidden]` rows, with exactly the
    /// arithmetic of [`all_reduce_add_rmsnorm`](Self::all_reduce_add_rmsnorm) after its
    /// reduction: `all_reduce` then this gives the fused call's bits. A local kernel (no
    /// peer is involved); needs the peer kernels to be loaded.
    pub fn residual_rmsnorm<T: Element>(
        &self,
        sum: &impl DevicePtr<T>,
        residual: &mut impl DevicePtrMut<T>,
        weight: &impl DevicePtr<T>,
        eps: f32,
        norm_out: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check_usable()?;
        let (tokens, hidden) = self.norm_shape(
            T::DTYPE,
            eps,
            [
                ("input", sum.len(), sum.stream()),
                ("residual", residual.len(), residual.stream()),
                ("weight", weight.len(), weight.stream()),
                ("norm_out", norm_out.len(), norm_out.stream()),
            ],
            stream,
        )?;
        let peer = self.peer()?;
        let book = self.bookkeeping(stream)?;
        let (in_ptr, g_in) = sum.device_ptr(book);
        let (res_ptr, g_res) = residual.device_ptr_mut(book);
        let (w_ptr, g_w) = weight.device_ptr(book);
        let (out_ptr, g_out) = norm_out.device_ptr_mut(book);
        let _records = self.settle(book, stream, (g_in, g_res, g_w, g_out))?;
        let norm = norm_args([in_ptr, res_ptr, w_ptr, out_ptr], tokens, hidden, eps)?;
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        let plan = grid(Kernel::RmsNorm, tokens, T::DTYPE, self.world, self.limits);
        peer.launch_norm(Kernel::RmsNorm, plan, T::DTYPE, &norm, stream)
    }

    /// Where [`all_reduce_add_rmsnorm_with`](Self::all_reduce_add_rmsnorm_with) of
    /// `tokens × hidden` elements of `dtype` goes (fused low-latency, one-shot or two-shot,
    /// or NCCL then the epilogue) and why; an error where that call would be refused.
    pub fn add_rmsnorm_path(
        &self,
        tokens: usize,
        hidden: usize,
        dtype: DType,
        algorithm: Algorithm,
    ) -> Result<PathDecision> {
        NormShape {
            dtype,
            input: tokens * hidden,
            residual: tokens * hidden,
            norm_out: tokens * hidden,
            weight: hidden,
            eps: 0.0,
        }
        .validate()?;
        let r = route_fused(tokens, hidden, dtype, &self.config, algorithm, self.facts())?;
        Ok(explain_fused(
            &r,
            (tokens, hidden),
            algorithm,
            &self.config,
            self.facts(),
        ))
    }

    /// `(tokens, hidden)` of a call over (input, residual, weight, norm_out), each given as
    /// (name, length, stream), once the lengths agree and every buffer and `stream` are on
    /// this rank's device.
    fn norm_shape(
        &self,
        dtype: DType,
        eps: f32,
        buffers: [(&'static str, usize, &Arc<CudaStream>); 4],
        stream: &CudaStream,
    ) -> Result<(usize, usize)> {
        let [input, residual, weight, norm_out] = buffers.map(|(_, len, _)| len);
        let shape = NormShape {
            dtype,
            input,
            residual,
            norm_out,
            weight,
            eps,
        }
        .validate()?;
        self.check_norm_devices(buffers.map(|(which, _, s)| (which, s)), stream)?;
        Ok(shape)
    }

    fn check_norm_devices(
        &self,
        buffers: [(&'static str, &Arc<CudaStream>); 4],
        stream: &CudaStream,
    ) -> Result<()> {
        let expected = self.device();
        let found = stream.context().ordinal();
        if found != expected {
            return Err(Error::WrongDevice {
                which: "stream",
                expected,
                found,
            });
        }
        for (which, s) in buffers {
            let found = s.context().ordinal();
            if found != expected {
                return Err(Error::WrongDevice {
                    which,
                    expected,
                    found,
                });
            }
        }
        Ok(())
    }
}

/// The kernels' parameter block over the (input, residual, weight, norm_out) addresses, each
/// of which must be 16-byte aligned.
fn norm_args(
    [input, residual, weight, norm_out]: [u64; 4],
    tokens: usize,
    hidden: usize,
    eps: f32,
) -> Result<NormArgs> {
    for (which, address) in [
        ("input", input),
        ("residual", residual),
        ("weight", weight),
        ("norm_out", norm_out),
    ] {
        if address % 16 != 0 {
            return Err(Error::Misaligned { which, address });
        }
    }
    Ok(NormArgs {
        input,
        residual,
        weight,
        norm_out,
        tokens: tokens as u32,
        hidden: hidden as u32,
        eps,
        cluster: 1,
    })
}
