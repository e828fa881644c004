//! What a collective takes from a candle tensor, checked before anything runs: the dtype, a
//! contiguous layout (any start offset), the shape rules of each collective, and a CUDA
//! device. Pure: no CUDA call, so every refusal is tested on CPU tensors. The order is
//! dtype, layout, shape, device, so that a CPU tensor still reports its dtype and layout
//! errors.

use candle_core::{DType, Layout, Tensor};

/// Why a tensor cannot go to a collective.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tensor is not in CUDA memory.
    #[error(
        "{op}: the tensor is on the {device} device; the collectives run on CUDA tensors \
         (create it on a Device::Cuda, or move it there with .to_device())"
    )]
    NotCuda {
        /// The collective.
        op: &'static str,
        /// `cpu` or `metal`.
        device: &'static str,
    },
    /// The tensor's elements are not one contiguous run of its storage.
    #[error(
        "{op}: {what} is not contiguous (shape {dims:?}, stride {stride:?}); call .contiguous() first \
         (an offset into the storage is fine, gaps and transposes are not)"
    )]
    NotContiguous {
        /// The collective.
        op: &'static str,
        /// Which tensor of the call.
        what: &'static str,
        /// Its dimensions.
        dims: Vec<usize>,
        /// Its strides.
        stride: Vec<usize>,
    },
    /// A dtype the collective has no kernel for.
    #[error("{op}: dtype {dtype:?} is not supported (supported: {supported})")]
    UnsupportedDType {
        /// The collective.
        op: &'static str,
        /// The tensor's dtype.
        dtype: DType,
        /// The dtypes it takes.
        supported: &'static str,
    },
    /// Tensors of one call with different dtypes.
    #[error("{op}: {what} has dtype {found:?}, but the input has {expected:?}; every tensor of the call has one dtype")]
    DTypeMismatch {
        /// The collective.
        op: &'static str,
        /// Which tensor.
        what: &'static str,
        /// The input's dtype.
        expected: DType,
        /// This tensor's dtype.
        found: DType,
    },
    /// A shape the collective does not take.
    #[error("{op}: {reason}")]
    Shape {
        /// The collective.
        op: &'static str,
        /// What is wrong and what to do.
        reason: String,
    },
    /// Two ranks of one in-process group on the same GPU without a stream each.
    #[error(
        "local_group: ranks {first} and {second} are both on GPU {ordinal} and {how}; ranks that \
         share a GPU need a stream each (a collective waits for the other ranks' collectives, which \
         would be queued behind it on a shared stream): create each rank's device with \
         Device::new_cuda_with_stream({ordinal})"
    )]
    SharedStream {
        /// The lower rank.
        first: usize,
        /// The higher rank.
        second: usize,
        /// Their GPU.
        ordinal: usize,
        /// How their streams collide.
        how: String,
    },
    /// The collective itself failed (see [`symm_allreduce::Error`]).
    #[error(transparent)]
    Collective(#[from] symm_allreduce::Error),
}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> candle_core::Error {
        candle_core::Error::wrap(e)
    }
}

/// The reductions' dtypes.
pub(crate) const REDUCE_DTYPES: &str = "f32, f16, bf16";
/// The all-gather's dtypes (it copies bytes).
pub(crate) const GATHER_DTYPES: &str = "f32, f16, bf16, u8";

/// What a collective does with a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Sums: `all_reduce`, `reduce_scatter`, the fused call.
    Reduce,
    /// Copies: `all_gather`.
    Gather,
}

/// Refuses a dtype the collective has no kernel for.
pub(crate) fn dtype(op: &'static str, kind: Kind, dtype: DType) -> Result<(), Error> {
    let ok = match kind {
        Kind::Reduce => matches!(dtype, DType::F32 | DType::F16 | DType::BF16),
        Kind::Gather => matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::U8),
    };
    if ok {
        Ok(())
    } else {
        let supported = match kind {
            Kind::Reduce => REDUCE_DTYPES,
            Kind::Gather => GATHER_DTYPES,
        };
        Err(Error::UnsupportedDType { op, dtype, supported })
    }
}

/// The element range `[start, end)` of a contiguous layout in its storage.
pub(crate) fn range(op: &'static str, what: &'static str, layout: &Layout) -> Result<(usize, usize), Error> {
    layout.contiguous_offsets().ok_or_else(|| Error::NotContiguous {
        op,
        what,
        dims: layout.dims().to_vec(),
        stride: layout.stride().to_vec(),
    })
}

/// Refuses a tensor that is not in CUDA memory.
pub(crate) fn on_cuda(op: &'static str, t: &Tensor) -> Result<(), Error> {
    match t.device() {
        candle_core::Device::Cuda(_) => Ok(()),
        candle_core::Device::Cpu => Err(Error::NotCuda { op, device: "cpu" }),
        candle_core::Device::Metal(_) => Err(Error::NotCuda { op, device: "metal" }),
    }
}

/// Whether a stream handle is one of the driver's implicit streams: the NULL stream (0), the
/// legacy default stream (1) or the per-thread default stream (2, what `Device::new_cuda`
/// uses). Such a handle names another stream on each host thread.
pub(crate) fn is_implicit_stream(handle: usize) -> bool {
    handle <= 2
}

/// Refuses an in-process group in which two ranks on one GPU would not have a stream each:
/// the same stream (one device given twice, or a clone of it), or an implicit stream on
/// either (whose work goes to whichever thread's stream uses it, with no ordering between
/// them). `ranks[r]` is rank r's (GPU ordinal, stream handle). Ranks alone on their GPU may
/// use any stream.
pub(crate) fn stream_per_rank(ranks: &[(usize, usize)]) -> Result<(), Error> {
    for (first, &(ordinal, a)) in ranks.iter().enumerate() {
        for (second, &(other, b)) in ranks.iter().enumerate().skip(first + 1) {
            if ordinal != other {
                continue;
            }
            let implicit = [(first, a), (second, b)]
                .into_iter()
                .find_map(|(r, h)| is_implicit_stream(h).then_some(r));
            let how = if let Some(r) = implicit {
                format!(
                    "rank {r} uses an implicit stream (the per-thread or legacy default stream of \
                     Device::new_cuda), which is a different stream on every thread that touches it"
                )
            } else if a == b {
                format!("share one stream ({a:#x}: the same device, or a clone of it)")
            } else {
                continue;
            };
            return Err(Error::SharedStream {
                first,
                second,
                ordinal,
                how,
            });
        }
    }
    Ok(())
}

/// The output dimensions of an all-gather along dimension 0 over `world` ranks.
pub(crate) fn gathered_dims(op: &'static str, dims: &[usize], world: usize) -> Result<Vec<usize>, Error> {
    let Some((&first, rest)) = dims.split_first() else {
        return Err(Error::Shape {
            op,
            reason: "a scalar has no dimension 0 to gather along; reshape it to (1,)".into(),
        });
    };
    let mut out = vec![first * world];
    out.extend_from_slice(rest);
    Ok(out)
}

/// The output dimensions of a reduce-scatter along dimension 0 over `world` ranks.
pub(crate) fn scattered_dims(op: &'static str, dims: &[usize], world: usize) -> Result<Vec<usize>, Error> {
    match dims.split_first() {
        Some((&first, rest)) if first % world == 0 && first > 0 => {
            let mut out = vec![first / world];
            out.extend_from_slice(rest);
            Ok(out)
        }
        Some((&first, _)) => Err(Error::Shape {
            op,
            reason: format!(
                "dimension 0 ({first}) is not a positive multiple of the world size ({world}): every rank \
                 keeps dimension 0 / world rows"
            ),
        }),
        None => Err(Error::Shape {
            op,
            reason: "a scalar has no dimension 0 to scatter along".into(),
        }),
    }
}

/// The fused call's tensors: `partial` `[.., hidden]`, `residual` of the same shape, `weight`
/// `(hidden,)`, all of one supported dtype and contiguous. Returns `hidden`.
pub(crate) fn fused(
    op: &'static str,
    partial: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
) -> Result<usize, Error> {
    dtype(op, Kind::Reduce, partial.dtype())?;
    for (what, t) in [("the residual", residual), ("the weight", weight)] {
        if t.dtype() != partial.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                what,
                expected: partial.dtype(),
                found: t.dtype(),
            });
        }
    }
    for (what, t) in [
        ("the input", partial),
        ("the residual", residual),
        ("the weight", weight),
    ] {
        range(op, what, t.layout())?;
    }
    let Some(&hidden) = partial.dims().last() else {
        return Err(Error::Shape {
            op,
            reason: "the input is a scalar; it needs a last (hidden) dimension".into(),
        });
    };
    if residual.dims() != partial.dims() {
        return Err(Error::Shape {
            op,
            reason: format!(
                "the residual has shape {:?}, the input {:?}; they must be equal",
                residual.dims(),
                partial.dims()
            ),
        });
    }
    if weight.dims() != [hidden] {
        return Err(Error::Shape {
            op,
            reason: format!(
                "the weight has shape {:?}; it must be ({hidden},), the input's last dimension",
                weight.dims()
            ),
        });
    }
    for t in [partial, residual, weight] {
        on_cuda(op, t)?;
    }
    Ok(hidden)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, IndexOp};

    fn cpu(dims: &[usize], dtype: DType) -> Tensor {
        Tensor::zeros(dims, dtype, &Device::Cpu).unwrap()
    }

    #[test]
    fn reductions_take_f32_f16_bf16_and_refuse_the_rest_by_name() {
        for d in [DType::F32, DType::F16, DType::BF16] {
            dtype("all_reduce", Kind::Reduce, d).unwrap();
            dtype("all_gather", Kind::Gather, d).unwrap();
        }
        dtype("all_gather", Kind::Gather, DType::U8).unwrap();
        for d in [DType::U8, DType::U32, DType::I64, DType::F64] {
            let e = dtype("all_reduce", Kind::Reduce, d).unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains(&format!("{d:?}")) && text.contains(REDUCE_DTYPES),
                "{text}"
            );
        }
        let e = dtype("all_gather", Kind::Gather, DType::F64).unwrap_err();
        assert!(e.to_string().contains(GATHER_DTYPES));
    }

    #[test]
    fn an_offset_into_the_storage_is_taken_and_a_transpose_is_refused() {
        let t = cpu(&[4, 6], DType::F32);
        assert_eq!(range("all_reduce", "the tensor", t.layout()).unwrap(), (0, 24));
        // Rows 2..4: contiguous, starting 12 elements into the storage.
        let rows = t.narrow(0, 2, 2).unwrap();
        assert_eq!(
            range("all_reduce", "the tensor", rows.layout()).unwrap(),
            (12, 24)
        );
        let row = t.i(3).unwrap();
        assert_eq!(range("all_reduce", "the tensor", row.layout()).unwrap(), (18, 24));
        let e = range("all_reduce", "the tensor", t.t().unwrap().layout()).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("not contiguous") && text.contains(".contiguous()"),
            "{text}"
        );
        // Columns 1..3 of every row: gaps between the rows.
        let cols = t.narrow(1, 1, 2).unwrap();
        assert!(matches!(
            range("all_reduce", "the tensor", cols.layout()),
            Err(Error::NotContiguous { .. })
        ));
        // A broadcast (stride 0) is not contiguous either.
        let b = cpu(&[1, 6], DType::F32).broadcast_as((4, 6)).unwrap();
        assert!(range("all_reduce", "the tensor", b.layout()).is_err());
    }

    #[test]
    fn cpu_tensors_are_refused_with_the_way_to_cuda() {
        let e = on_cuda("all_reduce", &cpu(&[8], DType::BF16)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("cpu device") && text.contains("Device::Cuda"),
            "{text}"
        );
        // And into candle's error type, with the message kept.
        let c: candle_core::Error = e.into();
        assert!(c.to_string().contains("cpu device"), "{c}");
    }

    #[test]
    fn ranks_sharing_a_gpu_need_a_stream_each() {
        // One rank per GPU: any stream, the per-thread default stream too.
        stream_per_rank(&[(0, 2), (1, 2)]).unwrap();
        stream_per_rank(&[(0, 0x5000), (1, 0x5000)]).unwrap();
        // Virtual ranks, a stream each (Device::new_cuda_with_stream).
        stream_per_rank(&[(0, 0x5000), (0, 0x6000), (1, 2)]).unwrap();
        // One device given twice.
        let e = stream_per_rank(&[(0, 0x5000), (1, 0x7000), (0, 0x5000)]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::SharedStream {
                    first: 0,
                    second: 2,
                    ordinal: 0,
                    ..
                }
            ),
            "{e}"
        );
        let text = e.to_string();
        assert!(
            text.contains("share one stream") && text.contains("Device::new_cuda_with_stream(0)"),
            "{text}"
        );
        // Device::new_cuda on a GPU another rank shares: the per-thread default stream.
        for implicit in [0, 1, 2] {
            let e = stream_per_rank(&[(3, 0x5000), (3, implicit)]).unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains("rank 1 uses an implicit stream") && text.contains("GPU 3"),
                "{text}"
            );
            // Two Device::new_cuda on one GPU: the same handle, named as the implicit stream.
            let e = stream_per_rank(&[(3, implicit), (3, implicit)]).unwrap_err();
            let text = e.to_string();
            assert!(text.contains("rank 0 uses an implicit stream"), "{text}");
        }
    }

    #[test]
    fn gather_and_scatter_shapes() {
        assert_eq!(gathered_dims("all_gather", &[3, 5], 4).unwrap(), vec![12, 5]);
        assert_eq!(gathered_dims("all_gather", &[7], 2).unwrap(), vec![14]);
        assert!(gathered_dims("all_gather", &[], 2).is_err());
        assert_eq!(scattered_dims("reduce_scatter", &[8, 5], 4).unwrap(), vec![2, 5]);
        let e = scattered_dims("reduce_scatter", &[6, 5], 4).unwrap_err();
        assert!(e.to_string().contains("multiple of the world size (4)"), "{e}");
        assert!(scattered_dims("reduce_scatter", &[0, 5], 4).is_err());
        assert!(scattered_dims("reduce_scatter", &[], 4).is_err());
    }

    #[test]
    fn the_fused_call_names_the_tensor_that_is_wrong() {
        let x = cpu(&[2, 64], DType::BF16);
        let w = cpu(&[64], DType::BF16);
        // Everything right but the device: the input's device is reported.
        let e = fused("all_reduce_add_rmsnorm", &x, &x.clone(), &w).unwrap_err();
        assert!(matches!(e, Error::NotCuda { device: "cpu", .. }), "{e}");
        let e = fused("all_reduce_add_rmsnorm", &x, &cpu(&[2, 64], DType::F16), &w).unwrap_err();
        assert!(
            matches!(
                e,
                Error::DTypeMismatch {
                    what: "the residual",
                    expected: DType::BF16,
                    found: DType::F16,
                    ..
                }
            ),
            "{e}"
        );
        let e = fused("all_reduce_add_rmsnorm", &x, &x, &cpu(&[64], DType::F32)).unwrap_err();
        assert!(e.to_string().contains("the weight has dtype F32"), "{e}");
        let e = fused("all_reduce_add_rmsnorm", &x, &cpu(&[4, 32], DType::BF16), &w).unwrap_err();
        assert!(e.to_string().contains("[4, 32]"), "{e}");
        let e = fused("all_reduce_add_rmsnorm", &x, &x, &cpu(&[32], DType::BF16)).unwrap_err();
        assert!(e.to_string().contains("(64,)"), "{e}");
        let xt = cpu(&[64, 2], DType::BF16).t().unwrap();
        let e = fused("all_reduce_add_rmsnorm", &xt, &x, &w).unwrap_err();
        assert!(
            matches!(
                e,
                Error::NotContiguous {
                    what: "the input",
                    ..
                }
            ),
            "{e}"
        );
        let e = fused("all_reduce_add_rmsnorm", &cpu(&[2, 64], DType::F64), &x, &w).unwrap_err();
        assert!(
            matches!(
                e,
                Error::UnsupportedDType {
                    dtype: DType::F64,
                    ..
                }
            ),
            "{e}"
        );
    }
}
