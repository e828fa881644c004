//! The symmetric workspace: one VMM allocation per rank, every rank's allocation mapped into
//! every rank's address space at `base + q·stride`. [`Layout`] says where everything lies;
//! [`Workspace`] establishes the mappings over a bootstrap (export, exchange, import, map).
//! A multicast object over the same allocations would be a sibling room.
//!
//! Layout of each rank's allocation (offsets shared with the kernels through `SymmArgs`):
//!
//! ```text
//! 0        signal pad: [phase 0..3][block 0..64][32 u32 slots], one 128-byte row per block;
//!          peers write slot [phase][block][their rank]
//! 32 KiB   call state: completed-call counter and finished-block counter (owner only)
//! 64 KiB   data buffer, parity 0 (data_bytes): the kernels' copy of the caller's input
//! ...      data buffer, parity 1 (data_bytes)
//! ...      symmetric buffer (data_bytes): the caller's data for the zero-copy in-place call
//! ...      low-latency slots: [parity 2][source rank W] × ll_slot_bytes of 16-byte lines
//! ```

pub(crate) mod multicast;
mod workspace;

pub(crate) use workspace::{allocate, Workspace};

use crate::kernels::abi::MAX_BLOCKS;

pub(crate) const SIGNAL_OFFSET: usize = 0;
pub(crate) const SIGNAL_PHASES: usize = 3;
pub(crate) const SIGNAL_ROW_BYTES: usize = 128;
pub(crate) const STATE_OFFSET: usize = 32 << 10;
pub(crate) const DATA_OFFSET: usize = 64 << 10;

const _: () = assert!(SIGNAL_OFFSET + SIGNAL_PHASES * MAX_BLOCKS * SIGNAL_ROW_BYTES <= STATE_OFFSET);
const _: () = assert!(STATE_OFFSET + 128 <= DATA_OFFSET);

/// Sizes derived from the configured capacity and the device granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of one data buffer and of the symmetric buffer (capacity rounded up to 4 KiB).
    pub data_bytes: usize,
    /// Bytes of one low-latency slot: 16-byte lines carrying 8 payload bytes each, for up
    /// to `min(low_latency_max_bytes, capacity)` bytes.
    pub ll_slot_bytes: usize,
    /// Bytes of each rank's allocation (and the stride between ranks' mappings).
    pub alloc_bytes: usize,
}

impl Layout {
    /// The layout for `capacity` bytes per call, low-latency calls of up to
    /// `low_latency_max` bytes, and `world` ranks.
    pub fn new(capacity: usize, low_latency_max: usize, world: usize, granularity: usize) -> Self {
        let data_bytes = capacity.next_multiple_of(4096);
        let ll_slot_bytes = (low_latency_max.min(capacity).div_ceil(8) * 16).max(16);
        let end = DATA_OFFSET + 3 * data_bytes + 2 * world * ll_slot_bytes;
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

    /// Largest message, in bytes, the low-latency slots hold.
    pub fn ll_capacity(&self) -> usize {
        self.ll_slot_bytes / 2
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
        assert_eq!(l.ll_capacity(), 8); // one line: never more than the capacity
        let l = Layout::new(64 << 20, 32 << 10, 8, 2 << 20);
        assert_eq!(l.data_bytes, 64 << 20);
        assert_eq!(l.ll_slot_bytes, 64 << 10);
        assert_eq!(l.ll_capacity(), 32 << 10);
        assert_eq!(l.alloc_bytes, 194 << 20);
        assert!(l.ll_offset() + 2 * 8 * l.ll_slot_bytes <= l.alloc_bytes);
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
