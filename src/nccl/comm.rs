//! NCCL communicators: the one this crate creates over a bootstrap ([`RawComm`], driven
//! through [`super::library`]) and the caller's cudarc one ([`OwnedNcclComm`]), with the
//! record of teardowns that failed.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{sys, Comm};

use super::library::{library, NcclLibrary};
use crate::bootstrap::{vote_soft, Bootstrap};
use crate::error::{CudaResultExt, Error, Result};

/// An NCCL communicator this crate created through [`library`]. Aborted on drop.
pub(crate) struct RawComm {
    comm: sys::ncclComm_t,
    library: &'static NcclLibrary,
}

// SAFETY: an NCCL communicator may be used from any thread as long as it is not used by two
// at once: every collective on it is enqueued under the owning Communicator's order lock
// (`Communicator::ordered`), and the only other call on a shared reference,
// `ncclCommGetAsyncError`, is a query NCCL allows from any thread at any time.
unsafe impl Send for RawComm {}
// SAFETY: see `Send` above.
unsafe impl Sync for RawComm {}

impl std::fmt::Debug for RawComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RawComm({:?}, {:?})", self.comm, self.library)
    }
}

impl RawComm {
    /// `ncclCommInitRank` on a helper thread, bounded by `timeout`: NCCL's initialisation
    /// blocks until every rank has joined. On expiry the helper thread is left behind (it
    /// aborts its communicator if NCCL ever returns) and this returns an error.
    pub(crate) fn init(
        ctx: &Arc<CudaContext>,
        id: [u8; 128],
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<RawComm> {
        let library = library()?;
        let (tx, rx) = mpsc::channel::<Result<RawComm>>();
        let ctx = ctx.clone();
        std::thread::Builder::new()
            .name("symm-nccl-init".into())
            .spawn(move || {
                let result = (|| {
                    ctx.bind_to_thread().during("cuCtxSetCurrent")?;
                    // SAFETY: the id came from ncclGetUniqueId on rank 0; rank < world was
                    // checked by the caller; the device is current on this thread.
                    let comm = unsafe { library.comm_init_rank(id, world, rank) }?;
                    Ok(RawComm { comm, library })
                })();
                // If the caller gave up waiting, the comm (if any) is dropped here: aborted.
                let _ = tx.send(result);
            })
            .map_err(|e| Error::Nccl {
                call: "ncclCommInitRank",
                detail: format!("cannot start the init thread: {e}"),
            })?;
        match rx.recv_timeout(timeout) {
            Ok(result) => result,
            Err(_) => Err(Error::Nccl {
                call: "ncclCommInitRank",
                detail: format!(
                    "did not complete within {timeout:?}: a rank is missing, or NCCL cannot connect the ranks \
                     (set NCCL_DEBUG=INFO to see why)"
                ),
            }),
        }
    }

    /// An error NCCL recorded asynchronously (a failed or aborted collective).
    pub(crate) fn async_error(&self) -> Result<()> {
        // SAFETY: a live communicator made by comm_init_rank.
        unsafe { self.library.comm_async_error(self.comm) }
    }

    /// `ncclAllReduce(sum)` on `stream`.
    ///
    /// # Safety
    /// As [`NcclLibrary::all_reduce`]: both ranges are `len` elements of `dtype` on this
    /// communicator's device, live until the reduction completes on `stream`.
    pub(crate) unsafe fn all_reduce(
        &self,
        input: u64,
        output: u64,
        len: usize,
        dtype: sys::ncclDataType_t,
        stream: &CudaStream,
    ) -> Result<()> {
        // SAFETY: the communicator is live; the caller guarantees the ranges.
        unsafe {
            self.library
                .all_reduce(self.comm, input, output, len, dtype, stream.cu_stream())
        }
    }

    /// `ncclAllGather` of `send_count` elements per rank (see [`NcclLibrary::all_gather`]).
    ///
    /// # Safety
    /// As [`NcclLibrary::all_gather`].
    pub(crate) unsafe fn all_gather(
        &self,
        input: u64,
        output: u64,
        send_count: usize,
        dtype: sys::ncclDataType_t,
        stream: &CudaStream,
    ) -> Result<()> {
        // SAFETY: the communicator is live; the caller guarantees the ranges.
        unsafe {
            self.library
                .all_gather(self.comm, input, output, send_count, dtype, stream.cu_stream())
        }
    }

    /// `ncclReduceScatter(sum)` into `recv_count` elements (see [`NcclLibrary::reduce_scatter`]).
    ///
    /// # Safety
    /// As [`NcclLibrary::reduce_scatter`].
    pub(crate) unsafe fn reduce_scatter(
        &self,
        input: u64,
        output: u64,
        recv_count: usize,
        dtype: sys::ncclDataType_t,
        stream: &CudaStream,
    ) -> Result<()> {
        // SAFETY: the communicator is live; the caller guarantees the ranges.
        unsafe {
            self.library
                .reduce_scatter(self.comm, input, output, recv_count, dtype, stream.cu_stream())
        }
    }

    /// All-gather-v of bytes as one group of `ncclBroadcast`s, rank q the root of its
    /// `counts[q]` bytes into `output` at `counts[..q].sum()` (NCCL has no all-gather-v;
    /// `ncclAllGather` on padded counts would need a staging buffer and a second copy).
    /// Zero counts are skipped on every rank alike (the counts are the same everywhere).
    ///
    /// # Safety
    /// `input` holds this rank's `counts[rank]` bytes and `output` their sum, device memory
    /// on this communicator's device, live until the group completes on `stream`, a live
    /// stream of that device.
    pub(crate) unsafe fn all_gather_v_bytes(
        &self,
        input: u64,
        output: u64,
        counts: impl Iterator<Item = usize>,
        stream: CUstream,
    ) -> Result<()> {
        self.library.grouped(|| {
            let mut at = 0u64;
            for (root, count) in counts.enumerate() {
                if count > 0 {
                    // SAFETY: the caller's guarantee covers every chunk of `output` and, on
                    // the root (this rank), `input`; NCCL reads `input` only on the root.
                    unsafe {
                        self.library.broadcast(
                            self.comm,
                            input,
                            output + at,
                            count,
                            sys::ncclDataType_t::ncclUint8,
                            root,
                            stream,
                        )
                    }?;
                }
                at += count as u64;
            }
            Ok(())
        })
    }

    /// The library it was made by.
    pub(crate) fn library(&self) -> &'static NcclLibrary {
        self.library
    }

    /// The raw handle (for a [`super::window::Window`], which never outlives this).
    pub(crate) fn raw(&self) -> sys::ncclComm_t {
        self.comm
    }

    /// Registers `ptr..ptr + bytes` as a symmetric window (a collective call: see
    /// [`NcclLibrary::window_register`]).
    ///
    /// # Safety
    /// As [`NcclLibrary::window_register`].
    pub(crate) unsafe fn window_register(&self, ptr: u64, bytes: usize) -> Result<Option<NonNull<c_void>>> {
        // SAFETY: the communicator is live; the caller guarantees the memory.
        unsafe { self.library.window_register(self.comm, ptr, bytes) }
    }

    /// A communicator over a fake NCCL table (tests only): `comm` is the fake's handle.
    #[cfg(test)]
    pub(crate) fn fake(comm: sys::ncclComm_t, library: &'static NcclLibrary) -> RawComm {
        RawComm { comm, library }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: a live communicator created by ncclCommInitRank, aborted exactly once. Abort
        // (not destroy) never waits for peers.
        if let Err(e) = unsafe { self.library.comm_abort(self.comm) } {
            record_teardown_failure(e.to_string());
        }
    }
}

/// An NCCL communicator the application keeps using beside a Communicator (mistral.rs keeps
/// its own for its other collectives): shared, never aborted by this crate. The application's
/// handle type asserts, by being `Send + Sync`, that it serialises the uses of the
/// communicator (as one rank's thread does).
pub type SharedNcclComm = Arc<dyn std::ops::Deref<Target = Comm> + Send + Sync>;

/// A caller's cudarc communicator, owned by a Communicator (`from_nccl`) or shared with the
/// application (`from_nccl_shared`).
pub(crate) struct OwnedNcclComm(Option<Comm>, Option<SharedNcclComm>);

// SAFETY: cudarc's Comm is !Send only because it holds a raw pointer. NCCL allows a
// communicator to move between threads as long as two threads never use it at once: every
// collective on it is enqueued under the owning Communicator's order lock
// (`Communicator::ordered`); the other uses through a shared reference are queries (rank,
// world size, the async error) that NCCL allows from any thread. The shared variant is
// Send + Sync by its own type's bound (the application serialises its own uses).
unsafe impl Send for OwnedNcclComm {}
// SAFETY: see `Send` above.
unsafe impl Sync for OwnedNcclComm {}

impl std::fmt::Debug for OwnedNcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.0, &self.1) {
            (Some(c), _) => write!(f, "cudarc Comm(rank {} of {})", c.rank(), c.world_size()),
            (None, Some(c)) => write!(f, "shared cudarc Comm(rank {} of {})", c.rank(), c.world_size()),
            (None, None) => f.write_str("cudarc Comm(dropped)"),
        }
    }
}

impl OwnedNcclComm {
    pub(crate) fn new(comm: Comm) -> Self {
        OwnedNcclComm(Some(comm), None)
    }

    pub(crate) fn shared(comm: SharedNcclComm) -> Self {
        OwnedNcclComm(None, Some(comm))
    }

    /// Whether the application shares it (and keeps it alive after the Communicator).
    pub(crate) fn is_shared(&self) -> bool {
        self.1.is_some()
    }

    pub(crate) fn get(&self) -> &Comm {
        match (&self.0, &self.1) {
            (Some(c), _) => c,
            (None, Some(c)) => c,
            (None, None) => unreachable!("an owned communicator is present until drop"),
        }
    }
}

impl Drop for OwnedNcclComm {
    fn drop(&mut self) {
        // A shared communicator is the application's to abort: dropping the Arc only.
        let Some(comm) = self.0.take() else { return };
        // cudarc's Drop calls ncclCommAbort and panics (`expect`) if it fails, and its raw
        // handle is private, so this crate cannot call abort itself. With unwinding, the drop
        // runs inside catch_unwind and a failure is recorded instead of propagating. Under
        // panic=abort a panic would abort the process, so the communicator is leaked instead
        // (its resources go with the process) and the leak is recorded.
        #[cfg(panic = "unwind")]
        {
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(comm)));
            if caught.is_err() {
                record_teardown_failure("ncclCommAbort failed while dropping the caller's communicator");
            }
        }
        #[cfg(not(panic = "unwind"))]
        {
            std::mem::forget(comm);
            record_teardown_failure("the caller's communicator was leaked, not aborted (panic=abort build)");
        }
    }
}

static TEARDOWN_FAILURES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Records a failed NCCL teardown (never panics; a poisoned lock still records).
pub(crate) fn record_teardown_failure(what: impl Into<String>) {
    let mut log = TEARDOWN_FAILURES.lock().unwrap_or_else(|p| p.into_inner());
    if log.len() < 64 {
        log.push(what.into());
    }
}

/// NCCL teardown failures this process recorded (communicator aborts that failed or were
/// skipped), oldest first, at most 64.
pub fn nccl_teardown_failures() -> Vec<String> {
    TEARDOWN_FAILURES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
}

/// Creates this crate's own NCCL communicator through `bootstrap` (rank 0 makes the unique
/// id): outer error = the group is broken; inner error = NCCL is not usable here (the same
/// verdict on every rank).
pub(crate) fn create_over(
    bootstrap: &dyn Bootstrap,
    ctx: &Arc<CudaContext>,
    timeout: Duration,
) -> Result<Result<RawComm>> {
    let rank = bootstrap.rank();
    let local = library().and_then(|lib| {
        if rank == 0 {
            lib.unique_id().map(Some)
        } else {
            Ok(None)
        }
    });
    let id = match vote_soft(bootstrap, "NCCL library", local)? {
        Ok(id) => id,
        Err(e) => return Ok(Err(e)),
    };
    let ids = bootstrap.all_gather(id.as_ref().map_or(&[][..], |i| &i[..]))?;
    let id: [u8; 128] = ids
        .first()
        .and_then(|b| b.as_slice().try_into().ok())
        .ok_or_else(|| Error::malformed("NCCL unique id"))?;
    let comm = RawComm::init(ctx, id, rank, bootstrap.world(), timeout);
    vote_soft(bootstrap, "NCCL init", comm)
}
