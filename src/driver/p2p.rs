//! Peer access between devices: `cuDeviceCanAccessPeer` and `cuDeviceGetP2PAttribute`.

use std::ffi::c_int;

use cudarc::driver::{result, sys};

/// (UUID, handle) of every device this process sees.
pub(crate) fn visible_devices() -> Vec<([u8; 16], sys::CUdevice)> {
    let count = result::device::get_count().unwrap_or(0);
    (0..count)
        .filter_map(|i| {
            let dev = result::device::get(i).ok()?;
            let uuid = result::device::get_uuid(dev).ok()?;
            Some((uuid.bytes.map(|b| b as u8), dev))
        })
        .collect()
}

pub(crate) fn p2p_attribute(
    src: sys::CUdevice,
    dst: sys::CUdevice,
    attribute: sys::CUdevice_P2PAttribute,
) -> Option<i32> {
    let mut value: c_int = 0;
    // SAFETY: valid out-pointer; both handles come from cuDeviceGet.
    let code = unsafe { sys::cuDeviceGetP2PAttribute(&mut value, attribute, src, dst) };
    (code == sys::CUresult::CUDA_SUCCESS).then_some(value)
}

pub(crate) fn can_access_peer(src: sys::CUdevice, dst: sys::CUdevice) -> bool {
    let mut can: c_int = 0;
    // SAFETY: valid out-pointer; both handles come from cuDeviceGet.
    let code = unsafe { sys::cuDeviceCanAccessPeer(&mut can, src, dst) };
    code == sys::CUresult::CUDA_SUCCESS && can != 0
}
