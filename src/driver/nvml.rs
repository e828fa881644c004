//! NVML, loaded with `dlopen` where it is installed: whether two devices have P2P read access
//! and whether NVLink connects them (CUDA cannot tell NVLink from PCIe).

use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::OnceLock;

/// NVML's view of a pair of devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NvmlPair {
    /// P2P read access (`None`: NVML could not say).
    pub(crate) access: Option<bool>,
    /// `Some(true)`: NVLink; `Some(false)`: PCIe; `None`: unknown.
    pub(crate) nvlink: Option<bool>,
}

/// NVML's spelling of a device UUID: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub(crate) fn nvml_uuid_string(uuid: &[u8; 16]) -> String {
    let h = |r: std::ops::Range<usize>| uuid[r].iter().map(|b| format!("{b:02x}")).collect::<String>();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h(0..4),
        h(4..6),
        h(6..8),
        h(8..10),
        h(10..16)
    )
}

type NvmlHandleByUuidFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_int;
type NvmlP2pStatusFn = unsafe extern "C" fn(*mut c_void, *mut c_void, c_int, *mut c_int) -> c_int;

/// nvml.h: `NVML_P2P_CAPS_INDEX_READ`, `NVML_P2P_CAPS_INDEX_NVLINK`, `NVML_P2P_STATUS_OK`.
const NVML_P2P_READ: c_int = 0;
const NVML_P2P_NVLINK: c_int = 2;
const NVML_P2P_OK: c_int = 0;

struct Nvml {
    handle_by_uuid: NvmlHandleByUuidFn,
    p2p_status: NvmlP2pStatusFn,
    _library: libloading::Library,
}

/// NVML, initialised once per process, or `None` where it is not installed.
fn nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    NVML.get_or_init(|| {
        for name in ["libnvidia-ml.so.1", "libnvidia-ml.so"] {
            // SAFETY: loading NVML runs its initialisers, which have no preconditions.
            let Ok(library) = (unsafe { libloading::Library::new(name) }) else {
                continue;
            };
            // The three lookups use the signatures of nvml.h (enums as int, handles as
            // pointers).
            // SAFETY: `nvmlReturn_t nvmlInit_v2(void)`.
            let init = unsafe { library.get::<unsafe extern "C" fn() -> c_int>("nvmlInit_v2") }.ok()?;
            // SAFETY: as above.
            let handle_by_uuid =
                *unsafe { library.get::<NvmlHandleByUuidFn>("nvmlDeviceGetHandleByUUID") }.ok()?;
            // SAFETY: as above.
            let p2p_status = *unsafe { library.get::<NvmlP2pStatusFn>("nvmlDeviceGetP2PStatus") }.ok()?;
            // SAFETY: nvmlInit_v2 takes no arguments; it is reference-counted, and this
            // process keeps NVML initialised for its lifetime.
            if unsafe { init() } != 0 {
                return None;
            }
            return Some(Nvml {
                handle_by_uuid,
                p2p_status,
                _library: library,
            });
        }
        None
    })
    .as_ref()
}

/// NVML's view of the pair of devices with these UUIDs.
pub(crate) fn pair(a: &[u8; 16], b: &[u8; 16]) -> NvmlPair {
    let unknown = NvmlPair {
        access: None,
        nvlink: None,
    };
    let Some(nvml) = nvml() else {
        return unknown;
    };
    let handle = |uuid: &[u8; 16]| -> Option<*mut c_void> {
        let name = CString::new(nvml_uuid_string(uuid)).ok()?;
        let mut h: *mut c_void = std::ptr::null_mut();
        // SAFETY: NUL-terminated UUID string and a valid out-pointer.
        let code = unsafe { (nvml.handle_by_uuid)(name.as_ptr(), &mut h) };
        (code == 0).then_some(h)
    };
    let (Some(ha), Some(hb)) = (handle(a), handle(b)) else {
        return unknown;
    };
    let status = |index: c_int| -> Option<bool> {
        let mut s: c_int = -1;
        // SAFETY: handles from nvmlDeviceGetHandleByUUID, valid out-pointer.
        let code = unsafe { (nvml.p2p_status)(ha, hb, index, &mut s) };
        (code == 0).then_some(s == NVML_P2P_OK)
    };
    NvmlPair {
        access: status(NVML_P2P_READ),
        nvlink: status(NVML_P2P_NVLINK),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_strings_use_nvml_spelling() {
        let mut uuid = [0u8; 16];
        for (i, b) in uuid.iter_mut().enumerate() {
            *b = i as u8 * 17;
        }
        assert_eq!(
            nvml_uuid_string(&uuid),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
    }
}
