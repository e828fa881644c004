//! The candle custom ops: each checks the tensor (`check`), takes the contiguous range of its
//! storage, and makes one communicator call on the storage's own stream. Outputs come from
//! the device's stream-ordered allocator, so a call is capturable in a CUDA graph as the
//! communicator's call is.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp1, DType, InplaceOp1, InplaceOp3, Layout, Shape, Storage, Tensor};
use symm_allreduce::cudarc::driver::{CudaSlice, CudaStream, CudaView, DeviceRepr};
use symm_allreduce::half::{bf16, f16};
use symm_allreduce::{Element, Gatherable};

use crate::check::{self, Error, Kind};
use crate::{AllReduce, SymmComm};

const ALL_REDUCE: &str = "symm all_reduce";
const ALL_GATHER: &str = "symm all_gather";
const REDUCE_SCATTER: &str = "symm reduce_scatter";
const FUSED: &str = "symm all_reduce_add_rmsnorm";

/// The error a CPU tensor gets from an op's `cpu_fwd` (a Metal tensor gets candle's own
/// "no metal implementation" error, naming the op).
fn not_cuda(op: &'static str) -> candle_core::Error {
    Error::NotCuda { op, device: "cpu" }.into()
}

/// Dispatches a reduction on the storage's dtype to a generic body over the element type.
macro_rules! by_dtype {
    ($op:expr, $dtype:expr, $body:ident ( $($arg:expr),* )) => {{
        check::dtype($op, Kind::Reduce, $dtype)?;
        match $dtype {
            DType::F32 => $body::<f32>($($arg),*),
            DType::F16 => $body::<f16>($($arg),*),
            DType::BF16 => $body::<bf16>($($arg),*),
            dtype => Err(Error::UnsupportedDType { op: $op, dtype, supported: check::REDUCE_DTYPES }.into()),
        }
    }};
}

/// A new buffer of `len` elements on the storage's device, ordered on its stream.
fn alloc<T: DeviceRepr>(s: &CudaStorage, len: usize) -> candle_core::Result<CudaSlice<T>> {
    // SAFETY: every element is written by the collective before the tensor is read (the
    // output of each call below is fully covered: `len` is the call's output length).
    unsafe { s.device().alloc::<T>(len) }
}

/// The out-of-place step every collective op shares: the tensor's elements
/// `start..end` of `s` as the input, a new buffer of `out_len` elements as the output, and
/// `call(communicator, input, output, stream)` on the tensor's own stream.
fn collective_into<T: CudaDType + DeviceRepr>(
    op: &'static str,
    comm: &SymmComm,
    s: &CudaStorage,
    (start, end): (usize, usize),
    out_len: usize,
    call: impl FnOnce(
        &symm_allreduce::Communicator,
        &CudaView<'_, T>,
        &mut CudaSlice<T>,
        &Arc<CudaStream>,
    ) -> symm_allreduce::Result<()>,
) -> candle_core::Result<CudaStorage> {
    let input = s.as_cuda_slice::<T>()?;
    let input = input.try_slice(start..end).ok_or_else(|| out_of_range(op))?;
    let mut out = alloc::<T>(s, out_len)?;
    let stream = s.device().cuda_stream();
    call(comm.communicator(), &input, &mut out, &stream).map_err(Error::from)?;
    Ok(CudaStorage::wrap_cuda_slice(out, s.device().clone()))
}

fn all_reduce_into<T: Element + CudaDType>(
    comm: &SymmComm,
    s: &CudaStorage,
    range: (usize, usize),
) -> candle_core::Result<CudaStorage> {
    collective_into::<T>(ALL_REDUCE, comm, s, range, range.1 - range.0, |c, i, o, st| {
        c.all_reduce(i, o, st)
    })
}

fn all_reduce_in_place<T: Element + CudaDType>(
    comm: &SymmComm,
    s: &mut CudaStorage,
    (start, end): (usize, usize),
) -> candle_core::Result<()> {
    let stream = s.device().cuda_stream();
    let slice = s.as_cuda_slice_mut::<T>()?;
    let mut view = slice
        .try_slice_mut(start..end)
        .ok_or_else(|| out_of_range(ALL_REDUCE))?;
    comm.communicator()
        .all_reduce_in_place(&mut view, &stream, symm_allreduce::Algorithm::Auto)
        .map_err(Error::from)?;
    Ok(())
}

/// A layout that reaches past its storage: candle never makes one.
fn out_of_range(op: &'static str) -> candle_core::Error {
    Error::Shape {
        op,
        reason: "the layout reaches past the end of the tensor's storage".into(),
    }
    .into()
}

impl CustomOp1 for AllReduce {
    fn name(&self) -> &'static str {
        ALL_REDUCE
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(not_cuda(ALL_REDUCE))
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let range = check::range(ALL_REDUCE, "the tensor", l)?;
        let out = by_dtype!(ALL_REDUCE, s.dtype(), all_reduce_into(&self.comm, s, range))?;
        Ok((out, l.shape().clone()))
    }
}

impl InplaceOp1 for AllReduce {
    fn name(&self) -> &'static str {
        ALL_REDUCE
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(not_cuda(ALL_REDUCE))
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let range = check::range(ALL_REDUCE, "the tensor", l)?;
        let dtype = s.dtype();
        by_dtype!(ALL_REDUCE, dtype, all_reduce_in_place(&self.comm, s, range))
    }
}

/// `SymmComm::all_gather`'s op.
pub(crate) struct AllGather<'a> {
    pub(crate) comm: &'a SymmComm,
}

fn all_gather_into<T: Gatherable + CudaDType>(
    comm: &SymmComm,
    s: &CudaStorage,
    range: (usize, usize),
) -> candle_core::Result<CudaStorage> {
    let out_len = (range.1 - range.0) * comm.world_size();
    collective_into::<T>(ALL_GATHER, comm, s, range, out_len, |c, i, o, st| {
        c.all_gather(i, o, st)
    })
}

impl CustomOp1 for AllGather<'_> {
    fn name(&self) -> &'static str {
        ALL_GATHER
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(not_cuda(ALL_GATHER))
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let range = check::range(ALL_GATHER, "the tensor", l)?;
        let dims = check::gathered_dims(ALL_GATHER, l.dims(), self.comm.world_size())?;
        check::dtype(ALL_GATHER, Kind::Gather, s.dtype())?;
        let out = match s.dtype() {
            DType::U8 => all_gather_into::<u8>(self.comm, s, range),
            DType::F32 => all_gather_into::<f32>(self.comm, s, range),
            DType::F16 => all_gather_into::<f16>(self.comm, s, range),
            DType::BF16 => all_gather_into::<bf16>(self.comm, s, range),
            dtype => Err(Error::UnsupportedDType {
                op: ALL_GATHER,
                dtype,
                supported: check::GATHER_DTYPES,
            }
            .into()),
        }?;
        Ok((out, Shape::from(dims)))
    }
}

/// `SymmComm::reduce_scatter`'s op.
pub(crate) struct ReduceScatter<'a> {
    pub(crate) comm: &'a SymmComm,
}

fn reduce_scatter_into<T: Element + CudaDType>(
    comm: &SymmComm,
    s: &CudaStorage,
    range: (usize, usize),
) -> candle_core::Result<CudaStorage> {
    let out_len = (range.1 - range.0) / comm.world_size();
    collective_into::<T>(REDUCE_SCATTER, comm, s, range, out_len, |c, i, o, st| {
        c.reduce_scatter(i, o, st)
    })
}

impl CustomOp1 for ReduceScatter<'_> {
    fn name(&self) -> &'static str {
        REDUCE_SCATTER
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(not_cuda(REDUCE_SCATTER))
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let range = check::range(REDUCE_SCATTER, "the tensor", l)?;
        let dims = check::scattered_dims(REDUCE_SCATTER, l.dims(), self.comm.world_size())?;
        let out = by_dtype!(
            REDUCE_SCATTER,
            s.dtype(),
            reduce_scatter_into(self.comm, s, range)
        )?;
        Ok((out, Shape::from(dims)))
    }
}

/// The fused call's op: in place on the residual (candle's destination), the partial sums
/// and the weight as sources; the normalised output is a new buffer, handed back through
/// `out`.
struct Fused<'a> {
    comm: &'a SymmComm,
    eps: f32,
    out: Mutex<Option<CudaStorage>>,
}

fn fused_into<T: Element + CudaDType>(
    op: &Fused<'_>,
    residual: &mut CudaStorage,
    residual_range: (usize, usize),
    partial: (&CudaStorage, (usize, usize)),
    weight: (&CudaStorage, (usize, usize)),
) -> candle_core::Result<CudaStorage> {
    let len = residual_range.1 - residual_range.0;
    let stream = residual.device().cuda_stream();
    let device = residual.device().clone();
    let mut out = alloc::<T>(residual, len)?;
    let p = partial.0.as_cuda_slice::<T>()?;
    let p = p
        .try_slice(partial.1 .0..partial.1 .1)
        .ok_or_else(|| out_of_range(FUSED))?;
    let w = weight.0.as_cuda_slice::<T>()?;
    let w = w
        .try_slice(weight.1 .0..weight.1 .1)
        .ok_or_else(|| out_of_range(FUSED))?;
    let r = residual.as_cuda_slice_mut::<T>()?;
    let mut r = r
        .try_slice_mut(residual_range.0..residual_range.1)
        .ok_or_else(|| out_of_range(FUSED))?;
    op.comm
        .communicator()
        .all_reduce_add_rmsnorm(&p, &mut r, &w, op.eps, &mut out, &stream)
        .map_err(Error::from)?;
    Ok(CudaStorage::wrap_cuda_slice(out, device))
}

impl InplaceOp3 for Fused<'_> {
    fn name(&self) -> &'static str {
        FUSED
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        Err(not_cuda(FUSED))
    }

    fn cuda_fwd(
        &self,
        residual: &mut CudaStorage,
        residual_l: &Layout,
        partial: &CudaStorage,
        partial_l: &Layout,
        weight: &CudaStorage,
        weight_l: &Layout,
    ) -> candle_core::Result<()> {
        let rr = check::range(FUSED, "the residual", residual_l)?;
        let pr = check::range(FUSED, "the input", partial_l)?;
        let wr = check::range(FUSED, "the weight", weight_l)?;
        let dtype = residual.dtype();
        let out = by_dtype!(
            FUSED,
            dtype,
            fused_into(self, residual, rr, (partial, pr), (weight, wr))
        )?;
        *self.out.lock().unwrap_or_else(|p| p.into_inner()) = Some(out);
        Ok(())
    }
}

/// `SymmComm::all_reduce_add_rmsnorm`.
pub(crate) fn fused(
    comm: &SymmComm,
    partial: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f32,
) -> candle_core::Result<Tensor> {
    check::fused(FUSED, partial, residual, weight)?;
    let op = Fused {
        comm,
        eps,
        out: Mutex::new(None),
    };
    residual.inplace_op3(partial, weight, &op)?;
    let out = op
        .out
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .ok_or_else(|| candle_core::Error::msg(format!("{FUSED}: the op ran without an output")))?;
    Ok(Tensor::from_storage(
        Storage::Cuda(out),
        partial.shape().clone(),
        BackpropOp::none(),
        false,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_cpu_forward_of_every_op_refuses_with_the_way_to_cuda() {
        // What `cpu_fwd` returns when a CPU tensor reaches an op directly.
        for op in [ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, FUSED] {
            let text = not_cuda(op).to_string();
            assert!(text.starts_with(op) && text.contains("Device::Cuda"), "{text}");
        }
        // And the tensor API checks the device before any op runs: see check.rs.
        let t = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        assert!(check::on_cuda(ALL_REDUCE, &t).is_err());
    }
}
