//! Tensor descriptors from Python, their validation, and the device-buffer type the crate's
//! calls take for them.

use std::marker::PhantomData;
use std::sync::Arc;

use pyo3::PyResult;
use symm_allreduce::cudarc::driver::{
    sys, CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use symm_allreduce::{DType, Error};

use crate::errors::{invalid_call, raise};

/// `(data_ptr, numel, dtype name, device type, device index, is_contiguous)`, as
/// `symm_allreduce._tensor.describe` builds it from a tensor (or any object with the same
/// methods).
pub(crate) type TensorArg = (u64, usize, String, String, i64, bool);

/// The dtypes a call may name: the three the reductions sum, and the two byte types the
/// gathers also move. The discriminant is the dtype's code on the hot path ([`Kind::code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    F32 = 0,
    F16 = 1,
    BF16 = 2,
    U8 = 3,
    I8 = 4,
}

/// [`Kind::ALL`] lists the dtypes in the order of their codes ([`Kind::from_code`] indexes it).
const _: () = {
    let mut i = 0;
    while i < Kind::ALL.len() {
        assert!(Kind::ALL[i] as usize == i);
        i += 1;
    }
};

impl Kind {
    pub(crate) const ALL: [Kind; 5] = [Kind::F32, Kind::F16, Kind::BF16, Kind::U8, Kind::I8];

    /// torch's name (`float32`, ...).
    pub(crate) const fn torch_name(self) -> &'static str {
        match self {
            Kind::F32 => "float32",
            Kind::F16 => "float16",
            Kind::BF16 => "bfloat16",
            Kind::U8 => "uint8",
            Kind::I8 => "int8",
        }
    }

    /// The code of this dtype on the hot path (`symm_allreduce._native.dtype_code`): its
    /// index in [`Kind::ALL`].
    pub(crate) const fn code(self) -> u8 {
        self as u8
    }

    /// The dtype of a hot-path code ([`Kind::code`]).
    pub(crate) fn from_code(code: u8) -> PyResult<Kind> {
        Kind::ALL.get(usize::from(code)).copied().ok_or_else(|| {
            invalid_call(format!(
                "unknown dtype code {code}: expected 0 to {} (symm_allreduce._native.dtype_code)",
                Kind::ALL.len() - 1
            ))
        })
    }

    pub(crate) const fn size(self) -> usize {
        match self {
            Kind::F32 => 4,
            Kind::F16 | Kind::BF16 => 2,
            Kind::U8 | Kind::I8 => 1,
        }
    }

    /// From a torch dtype's name, with or without `torch.`, or the crate's name (`bf16`).
    pub(crate) fn parse(name: &str) -> PyResult<Kind> {
        let bare = name.strip_prefix("torch.").unwrap_or(name);
        let alias = match bare {
            "float" | "f32" => "float32",
            "half" | "f16" => "float16",
            "bf16" => "bfloat16",
            "u8" => "uint8",
            "i8" => "int8",
            other => other,
        };
        Kind::ALL
            .into_iter()
            .find(|k| k.torch_name() == alias)
            .ok_or_else(|| {
                let names: Vec<&str> = Kind::ALL.iter().map(|k| k.torch_name()).collect();
                invalid_call(format!(
                "unsupported dtype {name}: the reductions take float32, float16 and bfloat16, the gathers \
                 also {}; convert the tensor (tensor.to(torch.bfloat16)) or reduce it with torch.distributed",
                names[3..].join(" and ")
            ))
            })
    }

    pub(crate) fn from_dtype(d: DType) -> Kind {
        match d {
            DType::F32 => Kind::F32,
            DType::F16 => Kind::F16,
            DType::BF16 => Kind::BF16,
        }
    }

    /// The crate's reduction dtype, or why this one cannot be summed.
    pub(crate) fn element(self) -> PyResult<DType> {
        DType::ALL
            .into_iter()
            .find(|d| Kind::from_dtype(*d) == self)
            .ok_or_else(|| self.not_summable())
    }

    /// The error of a reduction called on a dtype only the gathers move.
    pub(crate) fn not_summable(self) -> pyo3::PyErr {
        invalid_call(format!(
            "dtype {} cannot be summed: the reductions take float32, float16 and bfloat16 \
             (uint8 and int8 only move through all_gather and all_gather_v)",
            self.torch_name()
        ))
    }
}

/// The one dtype every argument of a call has (the first one's, checked against the rest).
pub(crate) fn same_dtype(args: &[(&TensorArg, &'static str)]) -> PyResult<Kind> {
    let Some(((first, first_name), rest)) = args.split_first() else {
        return Err(invalid_call("a call without tensors".to_string()));
    };
    let kind = Kind::parse(&first.2)?;
    for (arg, name) in rest {
        let k = Kind::parse(&arg.2)?;
        if k != kind {
            return Err(invalid_call(format!(
                "{name} is {} but {first_name} is {}: every tensor of one call has the same dtype",
                k.torch_name(),
                kind.torch_name()
            )));
        }
    }
    Ok(kind)
}

/// What the descriptor alone says is wrong: not a CUDA tensor, another device, not
/// contiguous, an unsupported dtype. No driver call.
pub(crate) fn check_descriptor(arg: &TensorArg, what: &'static str, device: usize) -> PyResult<()> {
    let (_, _, dtype, device_type, index, contiguous) = arg;
    if device_type != "cuda" {
        return Err(invalid_call(format!(
            "{what} is a {device_type} tensor, but this rank runs on cuda:{device}: move it there first \
             (tensor.to(\"cuda:{device}\"))"
        )));
    }
    if usize::try_from(*index).ok() != Some(device) {
        return Err(raise(Error::WrongDevice {
            which: what,
            expected: device,
            found: usize::try_from(*index).unwrap_or(usize::MAX),
        }));
    }
    if !contiguous {
        return Err(invalid_call(format!(
            "{what} is not contiguous: pass tensor.contiguous() (a view at any element offset of contiguous \
             memory is fine)"
        )));
    }
    Kind::parse(dtype)?;
    Ok(())
}

/// [`check_descriptor`], then asks the driver where the memory really is.
pub(crate) fn check(arg: &TensorArg, what: &'static str, device: usize) -> PyResult<()> {
    check_descriptor(arg, what, device)?;
    let (ptr, numel, ..) = *arg;
    if numel == 0 {
        // The crate refuses empty calls with its own error; there is no memory to ask about.
        return Ok(());
    }
    let mut ordinal: i32 = -1;
    // SAFETY: the attribute DEVICE_ORDINAL writes one i32 to `data`, which points at
    // `ordinal`; the driver only inspects the address `ptr`, whatever it is.
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(invalid_call(format!(
            "{what} at {ptr:#x} is not CUDA device memory ({rc:?}): pass a CUDA tensor of cuda:{device}"
        )));
    }
    if usize::try_from(ordinal).ok() != Some(device) {
        return Err(raise(Error::WrongDevice {
            which: what,
            expected: device,
            found: usize::try_from(ordinal).unwrap_or(usize::MAX),
        }));
    }
    Ok(())
}

/// The stream handle belongs to `ctx` (the device's primary context, which torch uses), or
/// [`Error::WrongDevice`] naming the stream's device.
pub(crate) fn check_stream(ctx: &Arc<CudaContext>, handle: usize) -> symm_allreduce::Result<()> {
    let cuda = |call: &'static str, rc: sys::CUresult| Error::Cuda {
        call,
        source: symm_allreduce::cudarc::driver::DriverError(rc),
    };
    // The legacy and per-thread default streams (0, 1, 2) belong to the current context.
    ctx.bind_to_thread().map_err(|e| cuda("cuCtxSetCurrent", e.0))?;
    let mut owner: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `owner` receives one context handle; a handle that is not a stream makes the
    // driver return an error code, which is reported.
    let rc = unsafe { sys::cuStreamGetCtx(handle as sys::CUstream, &mut owner) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(cuda("cuStreamGetCtx", rc));
    }
    if owner == ctx.cu_ctx() {
        return Ok(());
    }
    let mut device: sys::CUdevice = -1;
    // SAFETY: `owner` is a live context (the stream's); it is pushed, asked for its device
    // (one i32 written to `device`) and popped again, leaving this thread's context as it was.
    let rc = unsafe {
        let pushed = sys::cuCtxPushCurrent_v2(owner);
        let asked = sys::cuCtxGetDevice(&mut device);
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        if pushed == sys::CUresult::CUDA_SUCCESS {
            sys::cuCtxPopCurrent_v2(&mut popped);
        }
        if pushed != sys::CUresult::CUDA_SUCCESS {
            pushed
        } else {
            asked
        }
    };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(cuda("cuCtxGetDevice", rc));
    }
    Err(Error::WrongDevice {
        which: "stream",
        expected: ctx.ordinal(),
        found: usize::try_from(device).unwrap_or(usize::MAX),
    })
}

/// A caller's device memory, seen as a typed buffer: the crate's calls take it like any
/// cudarc buffer. It records no event (torch orders its own streams; the call is launched
/// on the caller's current stream). It borrows the call's stream wrapper (no reference count
/// is touched per buffer).
pub(crate) struct Raw<'s, T> {
    ptr: u64,
    len: usize,
    stream: &'s Arc<CudaStream>,
    _type: PhantomData<T>,
}

impl<'s, T> Raw<'s, T> {
    pub(crate) fn new(ptr: u64, len: usize, stream: &'s Arc<CudaStream>) -> Raw<'s, T> {
        Raw {
            ptr,
            len,
            stream,
            _type: PhantomData,
        }
    }
}

impl<T> DeviceSlice<T> for Raw<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for Raw<'_, T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for Raw<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}
