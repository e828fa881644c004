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
//! 32 KiB   call state: [block 0..64] × {completed calls (u64), poison word}, 16 bytes each
//! 64 KiB   divergence check: [epoch parity 2][block][source rank] × 32-byte call announcements
//! 128 KiB  data buffer, parity 0 (data_bytes): the kernels' copy of the caller's input
//! ...      data buffer, parity 1 (data_bytes)
//! ...      symmetric buffer (data_bytes): the caller's data for the zero-copy in-place call
//! ...      low-latency slots: [buffer 3][source rank W] × ll_slot_bytes, rings of 16-byte lines
//! ...      symmetric pool (pool_bytes, 4 KiB aligned): alloc_symmetric's buffers (pool.rs)
//! end-256  pool tags: [parity 2] u64, the last POOL_TAG_BYTES of the allocation
//! ```
//!
//! Setup zeroes the whole allocation and then fills the low-latency slots with all-ones
//! words (the "not yet arrived" sentinel), so nothing a new communicator reads holds an old
//! one's bytes. The pool comes last so that changes to the protocol regions in front of it do
//! not move anything the pool allocator or its kernels rely on: the kernels find a pool
//! buffer from its own address and the pool tags from the stride.

pub(crate) mod multicast;
pub(crate) mod pool;
mod workspace;

pub(crate) use workspace::{allocate, Workspace};

use crate::kernels::abi::{
    BLOCK_STATE_BYTES, CHECK_BYTES, CHECK_OFFSET, LL_BUFFERS, MAX_BLOCKS, MAX_RANKS, POOL_TAG_BYTES,
    SIGNAL_PHASES, SLOTS_PER_ROW,
};

pub(crate) const SIGNAL_OFFSET: usize = 0;
pub(crate) const SIGNAL_ROW_BYTES: usize = SLOTS_PER_ROW * 8;
pub(crate) const STATE_OFFSET: usize = 32 << 10;
pub(crate) const DATA_OFFSET: usize = 128 << 10;

const _: () = assert!(SIGNAL_OFFSET + SIGNAL_PHASES * MAX_BLOCKS * SIGNAL_ROW_BYTES <= STATE_OFFSET);
const _: () = assert!(STATE_OFFSET + MAX_BLOCKS * BLOCK_STATE_BYTES <= CHECK_OFFSET);
const _: () = assert!(CHECK_OFFSET + CHECK_BYTES <= DATA_OFFSET);
const _: () = assert!(MAX_RANKS <= SLOTS_PER_ROW);

/// Smallest low-latency slot: 512 cache lines, so that two low-latency calls whose lengths
/// differ by fewer than 256 elements never share their lines (`kernels::abi::ll_rotation`).
pub(crate) const LL_MIN_SLOT_BYTES: usize = 64 << 10;

/// Sizes derived from the configured capacity and the device granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of one data buffer and of the symmetric buffer (capacity rounded up to 4 KiB).
    pub data_bytes: usize,
    /// Largest message, in bytes, a low-latency slot holds: [`crate::Config::low_latency_limit`]
    /// (the larger of `low_latency_max_bytes` and the tuning table's largest low-latency
    /// threshold, at most the capacity) rounded up to whole 16-byte lines (each line carries
    /// 16 payload bytes).
    pub ll_capacity_bytes: usize,
    /// Bytes of one low-latency slot: a power of two, at least eight times
    /// `ll_capacity_bytes` and at least 64 KiB. A call's lines lie in it rotated by whole cache
    /// lines, by an amount that grows with the call's length (see `docs/design.md`, "Calls
    /// that cannot disagree"): a ring at least eight times the largest message.
    pub ll_slot_bytes: usize,
    /// Offset of the symmetric pool inside each rank's allocation (4 KiB aligned).
    pub pool_offset: usize,
    /// Bytes of the symmetric pool (`Config::pool_bytes` rounded up to 256).
    pub pool_bytes: usize,
    /// Bytes of each rank's allocation (and the stride between ranks' mappings).
    pub alloc_bytes: usize,
}

impl Layout {
    /// The layout for `capacity` bytes per call, low-latency calls of up to
    /// `low_latency_max` bytes, `world` ranks and a symmetric pool of `pool_bytes`.
    pub fn new(
        capacity: usize,
        low_latency_max: usize,
        world: usize,
        pool_bytes: usize,
        granularity: usize,
    ) -> Self {
        let data_bytes = capacity.next_multiple_of(4096);
        let ll_capacity_bytes = low_latency_max.min(capacity).next_multiple_of(16).max(16);
        // Eight times the largest message: the rotation (in whole cache lines) keeps calls
        // that differ apart only while a window is at most 1/8 of the slot.
        let ll_slot_bytes = (8 * ll_capacity_bytes).next_power_of_two().max(LL_MIN_SLOT_BYTES);
        let end = DATA_OFFSET + 3 * data_bytes + LL_BUFFERS * world * ll_slot_bytes;
        // The pool after everything else; its tags in the allocation's last bytes.
        let pool_offset = end.next_multiple_of(4096);
        let pool_bytes = pool_bytes.next_multiple_of(256);
        Layout {
            data_bytes,
            ll_capacity_bytes,
            ll_slot_bytes,
            pool_offset,
            pool_bytes,
            alloc_bytes: (pool_offset + pool_bytes + POOL_TAG_BYTES).next_multiple_of(granularity),
        }
    }

    /// Offset of the pool tags (the last `POOL_TAG_BYTES` of each rank's allocation; the
    /// kernels find them from the stride).
    #[cfg(test)]
    pub(crate) fn pool_tag_offset(&self) -> usize {
        self.alloc_bytes - POOL_TAG_BYTES
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
        self.ll_capacity_bytes
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
        let l = Layout::new(1, 32 << 10, 8, 0, 2 << 20);
        assert_eq!(l.data_bytes, 4096);
        assert_eq!(l.alloc_bytes, 2 << 20);
        assert_eq!(l.ll_capacity(), 16); // one line
        assert_eq!(l.ll_slot_bytes, LL_MIN_SLOT_BYTES);
        let l = Layout::new(64 << 20, 32 << 10, 8, 0, 2 << 20);
        assert_eq!(l.data_bytes, 64 << 20);
        assert_eq!(l.ll_slot_bytes, 256 << 10);
        assert_eq!(l.ll_capacity(), 32 << 10);
        assert_eq!(l.alloc_bytes, 200 << 20);
        assert_eq!(l.ll_bytes(8), 3 * 8 * (256 << 10));
        let l = Layout::new(64 << 20, (32 << 10) + 1, 8, 0, 2 << 20);
        assert_eq!((l.ll_capacity(), l.ll_slot_bytes), ((32 << 10) + 16, 512 << 10));
        assert!(l.ll_offset() + l.ll_bytes(8) <= l.alloc_bytes);
        assert_eq!(
            l.symmetric_offset() + l.data_bytes,
            DATA_OFFSET + 3 * l.data_bytes
        );
        assert!(l.symmetric_offset() + l.data_bytes <= l.alloc_bytes);
        let l = Layout::new(5000, 0, 3, 0, 4096);
        assert_eq!((l.ll_capacity(), l.ll_slot_bytes), (16, LL_MIN_SLOT_BYTES));
        assert_eq!(l.data_bytes, 8192);
        assert_eq!(l.alloc_bytes % 4096, 0);
        assert!(l.symmetric_offset() + l.data_bytes <= l.alloc_bytes);
    }

    #[test]
    fn the_pool_comes_last_and_its_tags_end_the_allocation() {
        for (pool, gran) in [
            (0usize, 4096usize),
            (1, 4096),
            (64 << 20, 2 << 20),
            (1000, 2 << 20),
        ] {
            let l = Layout::new(1 << 20, 32 << 10, 8, pool, gran);
            assert_eq!(l.pool_bytes, pool.next_multiple_of(256));
            assert_eq!(l.pool_offset % 4096, 0);
            assert!(l.pool_offset >= l.ll_offset() + 2 * 8 * l.ll_slot_bytes);
            assert!(l.pool_offset + l.pool_bytes <= l.pool_tag_offset());
            assert_eq!(l.pool_tag_offset() + POOL_TAG_BYTES, l.alloc_bytes);
            assert_eq!(l.alloc_bytes % gran, 0);
            // The pool does not move what comes before it.
            let without = Layout::new(1 << 20, 32 << 10, 8, 0, gran);
            assert_eq!(l.ll_offset(), without.ll_offset());
            assert_eq!(l.symmetric_offset(), without.symmetric_offset());
        }
    }
}
