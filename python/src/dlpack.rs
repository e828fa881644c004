//! A pool buffer as a DLPack capsule (`dltensor`), so that `torch.from_dlpack` wraps the
//! symmetric memory zero-copy. The structs are DLPack's stable C ABI (v0.x, the form every
//! `from_dlpack` accepts as a capsule); written here because the crates that provide them
//! follow other PyO3 versions, and the ABI is four plain structs.

use std::ffi::{c_void, CStr};

use pyo3::prelude::*;
use symm_allreduce::SymmetricTensor;

use crate::errors::invalid_call;
use crate::tensor::Kind;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `kDLCUDA`.
const DL_CUDA: i32 = 2;

/// What a capsule keeps alive: the pool buffer (its drop returns the region to the pool) and
/// the shape array the tensor points at.
struct Holder {
    _buffer: Box<dyn Send>,
    _shape: Vec<i64>,
}

const NAME: &CStr = c"dltensor";

/// Elements of a shape (non-negative dimensions, no overflow).
pub(crate) fn element_count(shape: &[i64]) -> PyResult<usize> {
    shape.iter().try_fold(1usize, |n, &d| {
        usize::try_from(d)
            .ok()
            .and_then(|d| n.checked_mul(d))
            .ok_or_else(|| invalid_call(format!("shape {shape:?} is not a valid tensor shape")))
    })
}

fn dl_dtype(kind: Kind) -> DLDataType {
    let code = match kind {
        Kind::F32 | Kind::F16 => 2, // kDLFloat
        Kind::BF16 => 4,            // kDLBfloat
        Kind::U8 => 1,              // kDLUInt
        Kind::I8 => 0,              // kDLInt
    };
    DLDataType {
        code,
        bits: (kind.size() * 8) as u8,
        lanes: 1,
    }
}

unsafe extern "C" fn delete_managed(p: *mut DLManagedTensor) {
    if p.is_null() {
        return;
    }
    // SAFETY: `p` is the `Box<DLManagedTensor>` made in `capsule`, whose `manager_ctx` is a
    // `Box<Holder>`; DLPack calls the deleter exactly once (by the consumer, or by the
    // capsule's destructor when nobody consumed it), so both are freed once.
    unsafe {
        drop(Box::from_raw((*p).manager_ctx.cast::<Holder>()));
        drop(Box::from_raw(p));
    }
}

unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the capsule; a capsule still named `dltensor` was never
    // consumed (consumers rename it `used_dltensor` and own the tensor), so its pointer is
    // ours to delete. `PyCapsule_IsValid` sets no exception.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) == 1 {
            let p = pyo3::ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()).cast::<DLManagedTensor>();
            delete_managed(p);
        }
    }
}

/// Wraps `buffer` (a 1-D pool buffer of the product of `shape` elements) in a DLPack capsule
/// of that shape on CUDA device `device`.
pub(crate) fn capsule<'py, T: 'static>(
    py: Python<'py>,
    buffer: SymmetricTensor<T>,
    mut shape: Vec<i64>,
    kind: Kind,
    device: usize,
) -> PyResult<Bound<'py, PyAny>>
where
    SymmetricTensor<T>: Send,
{
    let data = buffer.device_address() as *mut c_void;
    let ndim = i32::try_from(shape.len()).map_err(|_| invalid_call("too many dimensions"))?;
    let shape_ptr = shape.as_mut_ptr();
    let holder = Box::new(Holder {
        _buffer: Box::new(buffer),
        _shape: shape,
    });
    let managed = Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data,
            device: DLDevice {
                device_type: DL_CUDA,
                device_id: device as i32,
            },
            ndim,
            dtype: dl_dtype(kind),
            shape: shape_ptr,
            // NULL strides: compact row-major.
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: Box::into_raw(holder).cast(),
        deleter: Some(delete_managed),
    });
    let raw = Box::into_raw(managed);
    // SAFETY: `raw` is a valid DLManagedTensor that the capsule owns from here on (its
    // destructor deletes it unless a consumer took it); the name is a static C string.
    unsafe {
        let cap = pyo3::ffi::PyCapsule_New(raw.cast(), NAME.as_ptr(), Some(capsule_destructor));
        if cap.is_null() {
            delete_managed(raw);
        }
        Bound::from_owned_ptr_or_err(py, cap)
    }
}
