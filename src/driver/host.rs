//! Host memory the device writes to: the error word a timed-out kernel leaves for the host,
//! and the divergence record that follows it.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::check;
use crate::error::Result;

/// 64 bytes of pinned, device-mapped, portable host memory: a `u32` error code at 0 and four
/// `u64` at 8 (what a divergence was). The kernels store into it; the host reads it without
/// any CUDA call (so also during graph capture).
#[derive(Debug)]
pub(crate) struct ErrorWord {
    host: *mut u32,
    device: u64,
}

// SAFETY: the pointer is to pinned host memory owned by this value; reads and writes go
// through volatile accesses of a plain u32, valid from any thread.
unsafe impl Send for ErrorWord {}
// SAFETY: as above: every access is a volatile access of a plain u32/u64 in pinned memory;
// concurrent readers see either value, which the callers treat as a snapshot.
unsafe impl Sync for ErrorWord {}

impl ErrorWord {
    /// Allocates a zeroed word. The caller's context must be current.
    pub(crate) fn new() -> Result<Self> {
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: out-pointer is valid; 64 bytes is a valid size.
        let code = unsafe { sys::cuMemHostAlloc(&mut host, 64, flags) };
        check(code, "cuMemHostAlloc")?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was just allocated with DEVICEMAP.
        let mapped = check(
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) },
            "cuMemHostGetDevicePointer",
        );
        if let Err(e) = mapped {
            // SAFETY: freeing what was allocated above, once.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        let word = ErrorWord {
            host: host.cast(),
            device,
        };
        word.clear();
        Ok(word)
    }

    /// The address kernels write to.
    pub(crate) fn device_ptr(&self) -> u64 {
        self.device
    }

    /// The current code (0 = no error).
    pub(crate) fn read(&self) -> u32 {
        // SAFETY: `host` points to a live, aligned u32 owned by self; volatile because the
        // device writes it behind the compiler's back.
        unsafe { std::ptr::read_volatile(self.host) }
    }

    /// The four `u64` after the code.
    pub(crate) fn record(&self) -> [u64; 4] {
        let words = self.host.cast::<u64>();
        // SAFETY: the allocation is 64 bytes, 8-aligned (page-aligned pinned memory); words 1..5
        // lie inside it; volatile as in `read`.
        std::array::from_fn(|i| unsafe { std::ptr::read_volatile(words.add(1 + i)) })
    }

    /// Sets the word to 0 if it still holds `code` (one atomic compare-and-swap: a code a
    /// kernel stores meanwhile is never lost). Returns whether it did.
    pub(crate) fn clear_if(&self, code: u32) -> bool {
        // SAFETY: `host` points to a live, 4-aligned u32 owned by self for its whole life;
        // every host access to it is atomic or volatile, and the device only stores to it.
        let word = unsafe { std::sync::atomic::AtomicU32::from_ptr(self.host) };
        word.compare_exchange(
            code,
            0,
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
        )
        .is_ok()
    }

    pub(crate) fn clear(&self) {
        // SAFETY: as in `read`; the 64 bytes are owned by self.
        unsafe { std::ptr::write_bytes(self.host.cast::<u8>(), 0, 64) }
    }
}

impl Drop for ErrorWord {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed exactly once. A failure here
        // cannot be reported from Drop and leaks nothing further.
        unsafe { sys::cuMemFreeHost(self.host.cast()) };
    }
}
