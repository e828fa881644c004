//! NVTX ranges, so Nsight Systems shows every collective by name ("symm all_reduce one_shot
//! bf16 8192 B") above its kernel. They cost nothing unless a tool has injected itself
//! (nsys and ncu set NVTX_INJECTION64_PATH) and the crate was built with the NVTX headers.

use std::ffi::{c_char, CString};
use std::sync::OnceLock;

#[cfg(symm_nvtx)]
extern "C" {
    fn symm_nvtx_push(message: *const c_char);
    fn symm_nvtx_pop();
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| cfg!(symm_nvtx) && std::env::var_os("NVTX_INJECTION64_PATH").is_some())
}

/// An open range, closed on drop.
pub(crate) struct Range {
    active: bool,
}

impl Range {
    /// Opens a range named by `name()` (only called when a profiler listens).
    pub(crate) fn new(name: impl FnOnce() -> String) -> Range {
        if !enabled() {
            return Range { active: false };
        }
        let Ok(message) = CString::new(name()) else {
            return Range { active: false };
        };
        push(message.as_ptr());
        Range { active: true }
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        if self.active {
            pop();
        }
    }
}

#[cfg(symm_nvtx)]
fn push(message: *const c_char) {
    // SAFETY: `message` is a live NUL-terminated string; NVTX copies what it keeps.
    unsafe { symm_nvtx_push(message) }
}

#[cfg(symm_nvtx)]
fn pop() {
    // SAFETY: only called to close a range this module pushed on this thread.
    unsafe { symm_nvtx_pop() }
}

#[cfg(not(symm_nvtx))]
fn push(_: *const c_char) {}

#[cfg(not(symm_nvtx))]
fn pop() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_inert_without_a_profiler() {
        // No tool injected in unit tests: the name closure must not even run.
        let r = Range::new(|| panic!("formatted without a profiler"));
        assert!(!r.active);
    }
}
