//! The symmetric pool's allocator: pure host bookkeeping over the pool region of the layout
//! (the memory itself is part of the workspace, mapped by every rank).
//!
//! First fit over a free list kept sorted by offset and coalesced on free; every region is
//! [`POOL_ALIGN`]-aligned and a multiple of it. Allocation is a collective call: when every
//! rank makes the same sequence of allocations and frees, every rank's allocator holds the
//! same state, so a buffer lies at the same offset everywhere. Each allocation gets the next
//! sequence number; [`tag`] digests (sequence, offset, bytes, dtype) with the call's view, and
//! the zero-copy kernel compares the digests of all ranks on the device before it touches any
//! data (kernels/pool.cuh), so a diverged sequence is an error on every rank, not a silent
//! mix of different buffers, with no host exchange and no host sync on the call path.

use crate::error::{Error, Result};

/// Alignment (and size granule) of every pool region: 256 bytes, as cudaMalloc gives.
pub(crate) const POOL_ALIGN: usize = 256;

/// One live allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Region {
    /// Offset inside the pool.
    pub(crate) offset: usize,
    /// Bytes reserved (a multiple of [`POOL_ALIGN`]).
    pub(crate) bytes: usize,
    /// The allocation's sequence number (0, 1, 2, ... in allocation order on every rank).
    pub(crate) seq: u64,
    /// The element type's code (its index in `DType::ALL`).
    pub(crate) dtype: u8,
}

/// First-fit allocator over `capacity` bytes.
#[derive(Debug)]
pub(crate) struct Allocator {
    capacity: usize,
    /// Free (offset, bytes), sorted by offset, never two adjacent.
    free: Vec<(usize, usize)>,
    /// Live regions, sorted by offset.
    live: Vec<Region>,
    next_seq: u64,
}

impl Allocator {
    pub(crate) fn new(capacity: usize) -> Allocator {
        let capacity = capacity - capacity % POOL_ALIGN;
        Allocator {
            capacity,
            free: if capacity > 0 {
                vec![(0, capacity)]
            } else {
                Vec::new()
            },
            live: Vec::new(),
            next_seq: 0,
        }
    }

    /// Reserves `bytes` (rounded up to [`POOL_ALIGN`], at least one granule) at the lowest
    /// offset that fits.
    pub(crate) fn alloc(&mut self, bytes: usize, dtype: u8) -> Result<Region> {
        let want = bytes
            .max(1)
            .checked_next_multiple_of(POOL_ALIGN)
            .unwrap_or(usize::MAX);
        let Some(i) = self.free.iter().position(|&(_, b)| b >= want) else {
            return Err(Error::PoolExhausted {
                requested: want,
                largest: self.largest_free(),
                free: self.free_bytes(),
                capacity: self.capacity,
            });
        };
        let (offset, b) = self.free[i];
        if b == want {
            self.free.remove(i);
        } else {
            self.free[i] = (offset + want, b - want);
        }
        let region = Region {
            offset,
            bytes: want,
            seq: self.next_seq,
            dtype,
        };
        self.next_seq += 1;
        let at = self.live.partition_point(|r| r.offset < offset);
        self.live.insert(at, region);
        Ok(region)
    }

    /// The live region that starts at `offset`, if any (no allocation).
    pub(crate) fn region_at(&self, offset: usize) -> Option<Region> {
        let at = self.live.binary_search_by_key(&offset, |r| r.offset).ok()?;
        Some(self.live[at])
    }

    /// Returns the region at `offset` (a no-op if none is live there).
    pub(crate) fn free(&mut self, offset: usize) {
        let Ok(at) = self.live.binary_search_by_key(&offset, |r| r.offset) else {
            return;
        };
        let r = self.live.remove(at);
        let i = self.free.partition_point(|&(o, _)| o < r.offset);
        self.free.insert(i, (r.offset, r.bytes));
        // Coalesce with the next, then with the previous.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn free_bytes(&self) -> usize {
        self.free.iter().map(|&(_, b)| b).sum()
    }

    pub(crate) fn largest_free(&self) -> usize {
        self.free.iter().map(|&(_, b)| b).max().unwrap_or(0)
    }

    /// Live allocations.
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.live.len()
    }
}

/// The digest of a zero-copy call on `region`: `len` elements from byte `view` of the region.
/// Never 0 (the legacy symmetric buffer's tag), equal on every rank exactly when the
/// allocation (sequence number, offset, size, dtype) and the view agree.
pub(crate) fn tag(region: &Region, view: usize, len: usize) -> u64 {
    let mut h = 0x243f_6a88_85a3_08d3u64;
    for x in [
        region.seq,
        region.offset as u64,
        region.bytes as u64,
        region.dtype as u64,
        view as u64,
        len as u64,
    ] {
        h = mix(h ^ x);
    }
    h.max(1)
}

/// splitmix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_at_finds_live_regions_by_their_start_only() {
        let mut a = Allocator::new(4096);
        let r0 = a.alloc(512, 0).unwrap();
        let r1 = a.alloc(1024, 2).unwrap();
        assert_eq!(a.region_at(r0.offset), Some(r0));
        assert_eq!(a.region_at(r1.offset), Some(r1));
        assert_eq!(
            a.region_at(r1.offset + 16),
            None,
            "inside a region is not its start"
        );
        a.free(r0.offset);
        assert_eq!(a.region_at(r0.offset), None, "freed");
    }

    #[test]
    fn first_fit_aligns_and_numbers_allocations() {
        let mut a = Allocator::new(4096);
        let r0 = a.alloc(1, 0).unwrap();
        let r1 = a.alloc(300, 1).unwrap();
        let r2 = a.alloc(256, 2).unwrap();
        assert_eq!((r0.offset, r0.bytes, r0.seq), (0, 256, 0));
        assert_eq!((r1.offset, r1.bytes, r1.seq), (256, 512, 1));
        assert_eq!((r2.offset, r2.bytes, r2.seq), (768, 256, 2));
        for r in [r0, r1, r2] {
            assert_eq!(r.offset % POOL_ALIGN, 0);
            assert_eq!(r.bytes % POOL_ALIGN, 0);
        }
        assert_eq!(a.free_bytes(), 4096 - 1024);
        assert_eq!(a.live(), 3);
        // A zero-byte request still takes one granule (distinct buffers, distinct addresses).
        assert_eq!(a.alloc(0, 0).unwrap().bytes, 256);
    }

    #[test]
    fn freed_regions_are_reused_first_fit_and_coalesce() {
        let mut a = Allocator::new(4096);
        let r: Vec<Region> = (0..4).map(|_| a.alloc(512, 0).unwrap()).collect();
        a.free(r[1].offset);
        // First fit: the hole at 512 takes a request that fits it...
        let x = a.alloc(256, 0).unwrap();
        assert_eq!(x.offset, 512);
        assert_eq!(x.seq, 4, "sequence numbers keep counting across frees");
        // ...and one that does not goes past the live regions.
        let y = a.alloc(512, 0).unwrap();
        assert_eq!(y.offset, 2048);
        // Freeing neighbours coalesces them into one region that a large request fits.
        a.free(r[0].offset);
        a.free(x.offset);
        a.free(r[2].offset);
        assert_eq!(a.largest_free(), 1536);
        let z = a.alloc(1536, 0).unwrap();
        assert_eq!(z.offset, 0);
        // Double free and unknown offsets are no-ops.
        a.free(12345);
        a.free(r[2].offset);
        assert_eq!(a.live(), 3);
        for o in [z.offset, r[3].offset, y.offset] {
            a.free(o);
        }
        assert_eq!(a.free_bytes(), 4096);
        assert_eq!(a.largest_free(), 4096);
        assert_eq!(a.alloc(4096, 0).unwrap().offset, 0);
    }

    #[test]
    fn exhaustion_is_a_typed_error_that_leaves_the_pool_intact() {
        let mut a = Allocator::new(1000); // rounds down to 768
        assert_eq!(a.capacity(), 768);
        let r = a.alloc(512, 0).unwrap();
        match a.alloc(512, 0) {
            Err(Error::PoolExhausted {
                requested: 512,
                largest: 256,
                free: 256,
                capacity: 768,
            }) => {}
            other => panic!("{other:?}"),
        }
        assert!(matches!(a.alloc(usize::MAX, 0), Err(Error::PoolExhausted { .. })));
        // Fragmentation: free bytes suffice but no single region does.
        let mut f = Allocator::new(1024);
        let parts: Vec<Region> = (0..4).map(|_| f.alloc(256, 0).unwrap()).collect();
        f.free(parts[0].offset);
        f.free(parts[2].offset);
        let e = f.alloc(512, 0).unwrap_err();
        assert!(
            matches!(
                e,
                Error::PoolExhausted {
                    free: 512,
                    largest: 256,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("Config::pool_bytes"), "{e}");
        // Nothing changed by the failures.
        assert_eq!(a.live(), 1);
        a.free(r.offset);
        assert_eq!(a.alloc(768, 0).unwrap().offset, 0);
        let mut empty = Allocator::new(0);
        assert!(matches!(
            empty.alloc(1, 0),
            Err(Error::PoolExhausted { capacity: 0, .. })
        ));
    }

    #[test]
    fn tags_differ_when_any_part_differs() {
        let r = Region {
            offset: 256,
            bytes: 512,
            seq: 3,
            dtype: 1,
        };
        let t = tag(&r, 0, 100);
        assert_ne!(t, 0);
        assert_eq!(t, tag(&r, 0, 100));
        for other in [
            tag(&Region { seq: 4, ..r }, 0, 100),
            tag(&Region { offset: 512, ..r }, 0, 100),
            tag(&Region { bytes: 768, ..r }, 0, 100),
            tag(&Region { dtype: 2, ..r }, 0, 100),
            tag(&r, 2, 100),
            tag(&r, 0, 99),
        ] {
            assert_ne!(t, other);
        }
    }
}
