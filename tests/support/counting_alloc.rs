//! A global allocator that counts the current thread's heap allocations, for the tests that
//! show a path allocates nothing. Shared by `tests/no_alloc.rs` and the crate's own unit
//! tests (through `#[path]`); install it with `#[global_allocator]`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

/// Forwards to the system allocator, counting `alloc` and `realloc` calls per thread (other
/// threads never disturb a test's count).
pub struct Counting;

// SAFETY: forwards to the system allocator; the counter is a const-initialised thread-local
// Cell that never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        COUNT.with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's layout contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        COUNT.with(|c| c.set(c.get() + 1));
        // SAFETY: as for alloc and dealloc.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Allocations this thread has made so far.
pub fn allocations() -> usize {
    COUNT.with(|c| c.get())
}
