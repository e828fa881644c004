//! One rank's mapping of every rank's allocation, established over the bootstrap's
//! descriptor exchange.

use std::os::fd::{AsFd, OwnedFd};

use super::Layout;
use crate::driver::vmm::{self, Allocation, PeerMapping};
use crate::error::{Error, Result};

/// One rank's view of the workspace. Field order is drop order: the mapping goes first,
/// then the imported peer handles, then this rank's own allocation.
#[derive(Debug)]
pub(crate) struct Workspace {
    mapping: PeerMapping,
    _peers: Vec<Allocation>,
    _own: Allocation,
    layout: Layout,
}

/// This rank's allocation and the descriptor that exports it to the peers.
pub(crate) fn allocate(ordinal: usize, layout: &Layout) -> Result<(Allocation, OwnedFd)> {
    let a = Allocation::create(ordinal, layout.alloc_bytes)?;
    let fd = a.export_fd()?;
    Ok((a, fd))
}

impl Workspace {
    /// Imports every peer's allocation from `fds` (indexed by rank; this rank's own is
    /// skipped), maps them all beside `own` for `device`, and zeroes this rank's allocation.
    pub(crate) fn import_and_map(
        rank: usize,
        own: Allocation,
        fds: Vec<OwnedFd>,
        layout: Layout,
        device: usize,
    ) -> Result<Self> {
        let mut peers = Vec::with_capacity(fds.len().saturating_sub(1));
        for (q, fd) in fds.iter().enumerate() {
            if q != rank {
                peers.push((q, Allocation::import_fd(fd.as_fd(), layout.alloc_bytes)?));
            }
        }
        drop(fds);
        Workspace::map(rank, own, peers, layout, device)
    }

    /// Maps `own` and the peers' allocations (indexed by rank, `None` at `rank`) for
    /// `device`, and zeroes all of this rank's allocation (signals, call state, data buffers,
    /// the symmetric buffer), then arms the low-latency slots with the all-ones sentinel. The driver may hand back pages an
    /// earlier communicator wrote (low-latency lines with live-looking epochs among them);
    /// nothing a new communicator reads may hold an old one's bytes. (A memset of the whole
    /// allocation costs well under a millisecond at setup.)
    fn map(
        rank: usize,
        own: Allocation,
        peers: Vec<(usize, Allocation)>,
        layout: Layout,
        device: usize,
    ) -> Result<Self> {
        let world = peers.len() + 1;
        let mut order: Vec<&Allocation> = Vec::with_capacity(world);
        for q in 0..world {
            if q == rank {
                order.push(&own);
            } else {
                let (_, a) = peers.iter().find(|(r, _)| *r == q).ok_or_else(|| {
                    Error::malformed("descriptor exchange (a peer's allocation is missing)")
                })?;
                order.push(a);
            }
        }
        let mapping = PeerMapping::new(&order, layout.alloc_bytes, device)?;
        drop(order);
        let own_base = mapping.base() + (rank * layout.alloc_bytes) as u64;
        vmm::fill(own_base, 0, layout.alloc_bytes)?;
        vmm::fill(own_base + layout.ll_offset() as u64, 0xff, layout.ll_bytes(world))?;
        Ok(Workspace {
            mapping,
            _peers: peers.into_iter().map(|(_, a)| a).collect(),
            _own: own,
            layout,
        })
    }

    pub(crate) fn base(&self) -> u64 {
        self.mapping.base()
    }

    /// This rank's physical allocation handle (bound to the multicast object, if any).
    pub(crate) fn own_handle(&self) -> u64 {
        self._own.handle()
    }

    pub(crate) fn layout(&self) -> Layout {
        self.layout
    }

    /// Rank `rank`'s whole allocation as mapped here (address, bytes), with the range the
    /// driver reports for that address (`cuMemGetAddressRange`: what NCCL registers).
    pub(crate) fn own_mapping(&self, rank: usize) -> Result<((u64, usize), (u64, usize))> {
        let ptr = self.base() + (rank * self.layout.alloc_bytes) as u64;
        Ok(((ptr, self.layout.alloc_bytes), vmm::address_range(ptr)?))
    }

    /// This rank's symmetric buffer, in this rank's address space.
    pub(crate) fn symmetric_buffer(&self, rank: usize) -> u64 {
        self.base() + (rank * self.layout.alloc_bytes + self.layout.symmetric_offset()) as u64
    }
}
