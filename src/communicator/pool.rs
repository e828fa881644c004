//! The symmetric pool: [`Communicator::alloc_symmetric`] carves typed buffers out of the pool
//! region of every rank's workspace ([`crate::Layout::pool_offset`]); a buffer lies at the same
//! offset of every rank's allocation, so the zero-copy kernel reads the peers' copies in place.
//! [`SymmetricTensor`] implements cudarc's `DevicePtr`/`DevicePtrMut`: cudarc kernels, cuBLAS
//! and the caller's own kernels write into it directly.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use super::{Communicator, Paths};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::symmetric::pool::{tag, Allocator, Region};
use crate::symmetric::Workspace;

/// Distinguishes the pools of the communicators of one process.
static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// One rank's pool: the allocator and the mapping its buffers live in.
#[derive(Debug)]
pub(crate) struct Pool {
    id: u64,
    /// This rank's address of the pool's first byte.
    base: u64,
    allocator: Mutex<Allocator>,
    /// Keeps the workspace mapped while any buffer lives, even past the communicator.
    _workspace: Arc<Workspace>,
}

impl Pool {
    /// The pool of a peer-kernel communicator (`None` when `Config::pool_bytes` is 0).
    pub(crate) fn new(workspace: &Arc<Workspace>, rank: usize) -> Option<Arc<Pool>> {
        let layout = workspace.layout();
        if layout.pool_bytes == 0 {
            return None;
        }
        Some(Arc::new(Pool {
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            base: workspace.base() + (rank * layout.alloc_bytes + layout.pool_offset) as u64,
            allocator: Mutex::new(Allocator::new(layout.pool_bytes)),
            _workspace: workspace.clone(),
        }))
    }

    /// The live allocation that starts at this rank's address `addr`, if any.
    fn region_at(&self, addr: u64) -> Option<Region> {
        let offset = usize::try_from(addr.checked_sub(self.base)?).ok()?;
        self.lock().region_at(offset)
    }

    fn lock(&self) -> MutexGuard<'_, Allocator> {
        // A panic while holding the lock cannot leave the allocator half-updated in a way
        // that matters more than losing the pool: keep going with its state.
        self.allocator.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A typed buffer in a communicator's symmetric pool (see
/// [`Communicator::alloc_symmetric`]). It is ordinary device memory of this rank's device to
/// every kernel; the communicator's `all_reduce_in_place` / `all_reduce_pool` reduce it
/// zero-copy. Dropping it returns its region to the pool (drop it on every rank, in the same
/// order as the other pool calls). It keeps the workspace mapped while it lives, even past
/// its communicator.
///
/// Stream ordering: `device_ptr` records no event (like a raw pointer): order writers and
/// readers on other streams than the one it was allocated with yourself, as the
/// communicator's calls do for its own stream switches.
pub struct SymmetricTensor<T> {
    ptr: u64,
    len: usize,
    region: Region,
    stream: Arc<CudaStream>,
    pool: Arc<Pool>,
    _type: PhantomData<T>,
}

impl<T> std::fmt::Debug for SymmetricTensor<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmetricTensor")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("pool", &self.pool.id)
            .field("offset", &self.region.offset)
            .field("seq", &self.region.seq)
            .finish()
    }
}

impl<T> SymmetricTensor<T> {
    /// Offset of the buffer inside the pool (the same on every rank).
    pub fn pool_offset(&self) -> usize {
        self.region.offset
    }

    /// The allocation's sequence number in its pool (0, 1, 2, ... in allocation order).
    pub fn sequence(&self) -> u64 {
        self.region.seq
    }

    /// Which communicator's pool it belongs to (unique within the process).
    pub fn pool_id(&self) -> u64 {
        self.pool.id
    }

    /// This rank's device address of the buffer (256-byte aligned).
    pub fn device_address(&self) -> u64 {
        self.ptr
    }
}

impl<T> Drop for SymmetricTensor<T> {
    fn drop(&mut self) {
        self.pool.lock().free(self.region.offset);
    }
}

impl<T> DeviceSlice<T> for SymmetricTensor<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for SymmetricTensor<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for SymmetricTensor<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

fn dtype_code(dtype: DType) -> u8 {
    DType::ALL.iter().position(|&d| d == dtype).unwrap_or(0xff) as u8
}

impl Communicator {
    /// Allocates `len` elements of `T` in the symmetric pool: a collective call (every rank
    /// makes the same sequence of `alloc_symmetric` calls and drops, with the same lengths and
    /// types), so the buffer lies at the same offset of every rank's workspace, 256-byte
    /// aligned. The contents are unspecified (as cudarc's `alloc`). `stream` becomes the
    /// buffer's stream (what `DeviceSlice::stream` returns).
    ///
    /// Host-only bookkeeping (no CUDA call, no exchange): the agreement of the ranks'
    /// sequences is checked on the device by every zero-copy call ([`Error::PoolMismatch`]).
    /// Errors: [`Error::PoolExhausted`] when no free region fits (the pool does not grow:
    /// raise `Config::pool_bytes`); [`Error::Unsupported`] when the peer kernels are not set
    /// up or the pool is configured off (`pool_bytes: 0`).
    pub fn alloc_symmetric<T: Element>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<SymmetricTensor<T>> {
        self.check_usable()?;
        let pool = self.pool()?;
        let bytes = len.checked_mul(T::DTYPE.size()).ok_or(Error::PoolExhausted {
            requested: usize::MAX,
            largest: 0,
            free: 0,
            capacity: self.layout().pool_bytes,
        })?;
        let region = pool.lock().alloc(bytes, dtype_code(T::DTYPE))?;
        Ok(SymmetricTensor {
            ptr: pool.base + region.offset as u64,
            len,
            region,
            stream: stream.clone(),
            pool: pool.clone(),
            _type: PhantomData,
        })
    }

    /// Bytes of the pool still free (all regions together) and the largest free region.
    pub fn pool_free(&self) -> (usize, usize) {
        match &self.pool {
            Some(p) => {
                let a = p.lock();
                (a.free_bytes(), a.largest_free())
            }
            None => (0, 0),
        }
    }

    pub(crate) fn pool(&self) -> Result<&Arc<Pool>> {
        match (&self.pool, &self.paths) {
            (Some(p), _) => Ok(p),
            (None, Paths::NcclOnly { why, .. }) => Err(Error::Unsupported {
                ordinal: self.device(),
                reason: format!(
                    "the symmetric pool needs the peer kernels, which are not set up ({why}): allocate ordinary \
                     buffers instead (all_reduce takes them through NCCL)"
                ),
            }),
            (None, Paths::Peer { .. }) => Err(Error::Unsupported {
                ordinal: self.device(),
                reason: "the symmetric pool is off (Config::pool_bytes is 0)".into(),
            }),
        }
    }

    /// The pool tag of a zero-copy call on `len` elements of `dtype` at this rank's address
    /// `addr`, which must be the start of a live allocation of this communicator's pool of
    /// that dtype and at least that size (what [`alloc_symmetric`](Self::alloc_symmetric)
    /// returned, seen through another handle: a DLPack tensor, say); otherwise
    /// [`Error::ForeignPoolBuffer`].
    pub(crate) fn pool_tag_at(&self, addr: u64, len: usize, dtype: DType) -> Result<u64> {
        let pool = self.pool()?;
        let bytes = len.saturating_mul(dtype.size());
        match pool.region_at(addr) {
            Some(region) if region.dtype == dtype_code(dtype) && bytes <= region.bytes => {
                Ok(tag(&region, 0, bytes))
            }
            _ => Err(Error::ForeignPoolBuffer {
                expected: pool.id,
                found: 0,
            }),
        }
    }

    /// The pool tag of a zero-copy call on the whole of `tensor` (kernels/pool.cuh: the same
    /// on every rank when every rank made the same sequence of pool allocations), or
    /// [`Error::ForeignPoolBuffer`] for another communicator's buffer.
    pub(crate) fn pool_tag<T>(&self, tensor: &SymmetricTensor<T>) -> Result<u64> {
        let pool = self.pool()?;
        if tensor.pool.id != pool.id {
            return Err(Error::ForeignPoolBuffer {
                expected: pool.id,
                found: tensor.pool.id,
            });
        }
        let bytes = std::mem::size_of::<T>() * tensor.len;
        Ok(tag(&tensor.region, 0, bytes))
    }
}
