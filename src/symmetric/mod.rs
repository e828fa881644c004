//! The symmetric workspace: one VMM allocation per rank, every rank's allocation mapped into
//! every rank's address space at `base + q·stride`. [`Layout`] says where everything lies;
//! [`Workspace`] establishes the mappings over a bootstrap (export, exchange, import, map).
//! A multicast object over the same allocations would be a sibling room.
//!
//! Layout of each rank's allocation (offsets shared with the kernels through `SymmArgs`):
//!
//! ```text
//! 0        signal pad: [phase 0..3][block 0..64][16 u64 slots], one 128-byte row per block;
//!          peers write slot [phase][block][their rank] with 64-bit epochs
//! 32 KiB   call state: completed-call counter (u64), arrived-block counter, poison word
//! 64 KiB   divergence check: [epoch parity 2][block][source rank] × 32-byte call announcements
//! 128 KiB  data buffer, parity 0 (data_bytes): the kernels' copy of the caller's input
//! ...      data buffer, parity 1 (data_bytes)
//! ...      symmetric buffer (data_bytes): the caller's data for the zero-copy in-place call
//! ...      low-latency slots: [buffer 3][source rank W] × ll_slot_bytes of 16-byte lines
//! ```
//!
//! Setup zeroes the whole allocation and then fills the low-latency slots with all-ones
//! words (the "not yet arrived" sentinel), so nothing a new communicator reads holds an old
//! one's bytes.

pub(crate) mod multicast;
mod workspace;

pub(crate) use workspace::{allocate, Workspace};

use crate::kernels::abi::{
    CHECK_BYTES, CHECK_OFFSET, LL_BUFFERS, MAX_BLOCKS, MAX_RANKS, SIGNAL_PHASES, SLOTS_PER_ROW,
};

pub(crate) const SIGNAL_OFFSET: usize = 0;
pub(crate) const SIGNAL_ROW_BYTES: usize = SLOTS_PER_ROW * 8;
pub(crate) const STATE_OFFSET: usize = 32 << 10;
pub(crate) const DATA_OFFSET: usize = 128 << 10;

const _: () = assert!(SIGNAL_OFFSET + SIGNAL_PHASES * MAX_BLOCKS * SIGNAL_ROW_BYTES <= STATE_OFFSET);
const _: () = assert!(STATE_OFFSET + 128 <= CHECK_OFFSET);
const _: () = assert!(CHECK_OFFSET + CHECK_BYTES <= DATA_OFFSET);
const _: () = assert!(MAX_RANKS <= SLOTS_PER_ROW);

/// Sizes derived from the configured capacity and the device granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of one data buffer and of the symmetric buffer (capacity rounded up to 4 KiB).
    pub data_bytes: usize,
    /// Bytes of one low-latency slot: `min(low_latency_max_bytes, capacity)` rounded up to
    /// whole 16-byte lines (each line carries 16 payload bytes).
    pub ll_slot_bytes: usize,
    /// Bytes of each rank's allocation (and the stride between ranks' mappings).
    pub alloc_bytes: usize,
}

impl Layout {
    /// The layout for `capacity` bytes per call, low-latency calls of up to
    /// `low_latency_max` bytes, and `world` ranks.
    pub fn new(capacity: usize, low_latency_max: usize, world: usize, granularity: usize) -> Self {
        let data_bytes = capacity.next_multiple_of(4096);
        let ll_slot_bytes = low_latency_max.min(capacity).next_multiple_of(16).max(16);
        let end = DATA_OFFSET + 3 * data_bytes + LL_BUFFERS * world * ll_slot_bytes;
        Layout {
            data_bytes,
            ll_slot_bytes,
            alloc_bytes: end.next_multiple_of(granularity),
        }
    }

    /// Offset of the low-latency slots inside each rank's allocation.
    pub fn ll_offset(&self) -> usize {
        DATA_OFFSET + 3 * self.data_bytes
    }

    /// Bytes of the low-latency slots of one rank's allocation (all buffers, all sources).
    pub fn ll_bytes(&self, world: usize) -> usize {
        LL_BUFFERS * world * self.ll_slot_bytes
    }

    /// Largest message, in bytes, the low-latency slots hold.
    pub fn ll_capacity(&self) -> usize {
        self.ll_slot_bytes
    }

    /// Offset of the symmetric buffer inside each rank's allocation.
    pub fn symmetric_offset(&self) -> usize {
        DATA_OFFSET + 2 * self.data_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_rounds_to_granularity_and_keeps_both_parities() {
        let l = Layout::new(1, 32 << 10, 8, 2 << 20);
        assert_eq!(l.data_bytes, 4096);
        assert_eq!(l.alloc_bytes, 2 << 20);
        assert_eq!(l.ll_capacity(), 16); // one line
        let l = Layout::new(64 << 20, 32 << 10, 8, 2 << 20);
        assert_eq!(l.data_bytes, 64 << 20);
        assert_eq!(l.ll_slot_bytes, 32 << 10);
        assert_eq!(l.ll_capacity(), 32 << 10);
        assert_eq!(l.alloc_bytes, 194 << 20);
        assert_eq!(l.ll_bytes(8), 3 * 8 * (32 << 10));
        assert!(l.ll_offset() + l.ll_bytes(8) <= l.alloc_bytes);
        assert_eq!(
            l.symmetric_offset() + l.data_bytes,
            DATA_OFFSET + 3 * l.data_bytes
        );
        assert!(l.symmetric_offset() + l.data_bytes <= l.alloc_bytes);
        let l = Layout::new(5000, 0, 3, 4096);
        assert_eq!(l.ll_slot_bytes, 16);
        assert_eq!(l.data_bytes, 8192);
        assert_eq!(l.alloc_bytes % 4096, 0);
        assert!(l.symmetric_offset() + l.data_bytes <= l.alloc_bytes);
    }
}
