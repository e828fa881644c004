//! NCCL: finding the library, the fallback all-reduce, and a bootstrap over an existing
//! NCCL communicator.
//!
//! **Finding the library.** cudarc's loader tries `libnccl.so` and a list of other names but
//! not `libnccl.so.2`, the soname that runtime-only installs ship (the `nvidia-nccl-cu12`
//! wheel, `libnccl2` without `-dev`). Loading `libnccl.so.2` with `RTLD_GLOBAL` first does not
//! help: glibc matches an already-loaded object by the exact name or soname, so a later
//! `dlopen("libnccl.so")` still fails (checked with a two-file C program). Environment changes
//! after start-up do not reach the loader either. So the NCCL calls this crate makes itself go
//! through its own table of function pointers, loaded by [`library`] from cudarc's names first
//! and `libnccl.so.2` last: whenever cudarc found a library, this finds the same file; when
//! only `libnccl.so.2` exists, this still works. A communicator that the *caller* built with
//! cudarc keeps being driven through cudarc's own API (its raw handle is private).
//!
//! **Bootstrap.** [`NcclBootstrap`] all-gathers bytes through device memory in fixed-size,
//! length-prefixed frames, and passes file descriptors over per-rank abstract `AF_UNIX`
//! sockets whose names (with a random token) travel through NCCL.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::marker::PhantomData;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use cudarc::nccl::{sys, Comm, NcclType, ReduceOp};

use super::socket::{random_token, send_frame_with_fds, Kind};
use super::wire::{self, decode_announce, decode_offer, encode_announce, encode_offer, StoreOptions};
use super::{vote, Bootstrap};
use crate::dtype::DType;
use crate::error::{CudaResultExt, Error, Result};

// ---- The library ----------------------------------------------------------------------------

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueIdFn = unsafe extern "C" fn(*mut sys::ncclUniqueId) -> c_int;
type CommInitRankFn = unsafe extern "C" fn(*mut sys::ncclComm_t, c_int, sys::ncclUniqueId, c_int) -> c_int;
type CommAbortFn = unsafe extern "C" fn(sys::ncclComm_t) -> c_int;
type CommGetAsyncErrorFn = unsafe extern "C" fn(sys::ncclComm_t, *mut c_int) -> c_int;
type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    sys::ncclComm_t,
    *mut c_void,
) -> c_int;
type GetErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// NCCL's functions, resolved once per process. Return codes are read as plain integers
/// (never as a Rust enum, which an unknown code would make undefined).
pub(crate) struct NcclLibrary {
    name: String,
    version: i32,
    get_unique_id: GetUniqueIdFn,
    comm_init_rank: CommInitRankFn,
    comm_abort: CommAbortFn,
    comm_get_async_error: CommGetAsyncErrorFn,
    all_reduce: AllReduceFn,
    get_error_string: GetErrorStringFn,
    // Keeps the function pointers above valid; never unloaded (lives in a static).
    _library: libloading::Library,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclLibrary({} {})", self.name, version_string(self.version))
    }
}

/// Which NCCL this process would use for the fallback, and its version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclLibraryInfo {
    /// The name it was loaded by (`libnccl.so`, `libnccl.so.2`, ...).
    pub name: String,
    /// `major.minor.patch`.
    pub version: String,
}

/// Loads NCCL (once per process) and reports which library and version this crate uses.
/// An error says how to install it; nothing else in the crate needs NCCL unless a
/// communicator has, or asks for, the NCCL fallback.
pub fn nccl_library() -> Result<NcclLibraryInfo> {
    let lib = library()?;
    Ok(NcclLibraryInfo {
        name: lib.name.clone(),
        version: version_string(lib.version),
    })
}

fn version_string(code: i32) -> String {
    // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
    format!("{}.{}.{}", code / 10000, (code / 100) % 100, code % 100)
}

/// The names tried, in order: cudarc's list (so that a library cudarc loaded is the one used
/// here), then the soname of runtime-only installs.
pub(crate) fn candidate_names() -> Vec<String> {
    let mut names = cudarc::get_lib_name_candidates("nccl");
    if !names.iter().any(|n| n == "libnccl.so.2") {
        names.push("libnccl.so.2".to_string());
    }
    names
}

pub(crate) fn library() -> Result<&'static NcclLibrary> {
    static LIBRARY: OnceLock<std::result::Result<NcclLibrary, String>> = OnceLock::new();
    LIBRARY
        .get_or_init(load_library)
        .as_ref()
        .map_err(|detail| Error::Nccl {
            call: "dlopen",
            detail: detail.clone(),
        })
}

fn load_library() -> std::result::Result<NcclLibrary, String> {
    let names = candidate_names();
    let mut last = String::from("no candidates");
    for name in &names {
        // SAFETY: loading NCCL runs its library initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(name.as_str()) } {
            Ok(library) => return bind(library, name),
            Err(e) => last = e.to_string(),
        }
    }
    Err(format!(
        "neither libnccl.so nor libnccl.so.2 could be loaded ({} names tried; last error: {last}). Install \
         NCCL (e.g. `apt install libnccl2`, or `pip install nvidia-nccl-cu12` and put its lib directory on \
         LD_LIBRARY_PATH)",
        names.len()
    ))
}

/// Resolves `name` as a value of type `T`.
///
/// # Safety
/// `T` must be the exact C signature of the symbol.
unsafe fn symbol<T: Copy>(library: &libloading::Library, name: &str) -> std::result::Result<T, String> {
    // SAFETY: the caller guarantees that `T` matches the symbol.
    unsafe { library.get::<T>(name) }
        .map(|s| *s)
        .map_err(|e| format!("{name} is missing from the NCCL library: {e}"))
}

fn bind(library: libloading::Library, name: &str) -> std::result::Result<NcclLibrary, String> {
    // Every `symbol` call below: the types are the prototypes of nccl.h, stable across
    // NCCL 2.x; enums are passed as `int`, handles as pointers, cudaStream_t as `void*`.
    // SAFETY: `int ncclGetVersion(int*)`.
    let get_version: GetVersionFn = unsafe { symbol(&library, "ncclGetVersion")? };
    let mut version = 0;
    // SAFETY: valid out-pointer.
    let code = unsafe { get_version(&mut version) };
    if code != 0 {
        return Err(format!("ncclGetVersion failed with code {code} in {name}"));
    }
    Ok(NcclLibrary {
        name: name.to_string(),
        version,
        // SAFETY: see above.
        get_unique_id: unsafe { symbol(&library, "ncclGetUniqueId")? },
        // SAFETY: see above.
        comm_init_rank: unsafe { symbol(&library, "ncclCommInitRank")? },
        // SAFETY: see above.
        comm_abort: unsafe { symbol(&library, "ncclCommAbort")? },
        // SAFETY: see above.
        comm_get_async_error: unsafe { symbol(&library, "ncclCommGetAsyncError")? },
        // SAFETY: see above.
        all_reduce: unsafe { symbol(&library, "ncclAllReduce")? },
        // SAFETY: see above.
        get_error_string: unsafe { symbol(&library, "ncclGetErrorString")? },
        _library: library,
    })
}

impl NcclLibrary {
    fn check(&self, code: c_int, call: &'static str) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString accepts any code and returns a static string (or null).
        let text = unsafe { (self.get_error_string)(code) };
        let text = if text.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: non-null, NUL-terminated, static storage owned by NCCL.
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(Error::Nccl {
            call,
            detail: format!("code {code}: {text}"),
        })
    }

    /// A new unique id (rank 0 makes it, every rank passes it to `ncclCommInitRank`).
    pub(crate) fn unique_id(&self) -> Result<[u8; 128]> {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: valid out-pointer to a 128-byte id.
        self.check(unsafe { (self.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        Ok(id.internal.map(|c| c as u8))
    }
}

fn dtype_code(dtype: DType) -> c_int {
    (match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
    }) as c_int
}

fn cudarc_nccl_error(call: &'static str) -> impl Fn(cudarc::nccl::result::NcclError) -> Error {
    move |e| Error::Nccl {
        call,
        detail: format!("{:?} (set NCCL_DEBUG=WARN for NCCL's own account)", e.0),
    }
}

// ---- Communicators ------------------------------------------------------------------------

/// An NCCL communicator this crate created through [`library`]. Aborted on drop.
pub(crate) struct RawComm {
    comm: sys::ncclComm_t,
    library: &'static NcclLibrary,
}

// SAFETY: an NCCL communicator may be used from any thread as long as it is not used by two
// at once; RawComm lives inside a Communicator, which is not Sync.
unsafe impl Send for RawComm {}

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
                    let id = sys::ncclUniqueId {
                        internal: id.map(|b| b as c_char),
                    };
                    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
                    // SAFETY: valid out-pointer; the id came from ncclGetUniqueId on rank 0;
                    // rank < world was checked by the caller; the device is current.
                    let code =
                        unsafe { (library.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) };
                    library.check(code, "ncclCommInitRank")?;
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
        let mut code: c_int = 0;
        // SAFETY: live communicator, valid out-pointer.
        let call = unsafe { (self.library.comm_get_async_error)(self.comm, &mut code) };
        self.library.check(call, "ncclCommGetAsyncError")?;
        self.library.check(code, "NCCL (asynchronous error)")
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: a live communicator created by ncclCommInitRank, aborted exactly once. Abort
        // (not destroy) never waits for peers.
        let code = unsafe { (self.library.comm_abort)(self.comm) };
        if let Err(e) = self.library.check(code, "ncclCommAbort") {
            record_teardown_failure(e.to_string());
        }
    }
}

/// A caller's cudarc communicator, owned by a Communicator.
pub(crate) struct OwnedNcclComm(Option<Comm>);

// SAFETY: cudarc's Comm is !Send only because it holds a raw pointer. NCCL allows a
// communicator to move between threads as long as two threads never use it at once, and the
// Communicator that owns this is not Sync, so every use is from one thread at a time.
unsafe impl Send for OwnedNcclComm {}

impl std::fmt::Debug for OwnedNcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(c) => write!(f, "cudarc Comm(rank {} of {})", c.rank(), c.world_size()),
            None => f.write_str("cudarc Comm(dropped)"),
        }
    }
}

impl OwnedNcclComm {
    pub(crate) fn new(comm: Comm) -> Self {
        OwnedNcclComm(Some(comm))
    }

    pub(crate) fn get(&self) -> &Comm {
        self.0.as_ref().expect("present until drop")
    }
}

impl Drop for OwnedNcclComm {
    fn drop(&mut self) {
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
fn record_teardown_failure(what: impl Into<String>) {
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

/// A device range known only by its address, for cudarc's NCCL API (which takes
/// `DevicePtr`s). It does no event tracking: the caller orders the streams.
struct RawRange<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _type: PhantomData<T>,
}

impl<T> DeviceSlice<T> for RawRange<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for RawRange<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for RawRange<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

/// The NCCL communicator a Communicator hands large (or unmappable) calls to.
#[derive(Debug)]
pub(crate) enum Fallback {
    /// The caller's cudarc communicator. NCCL runs on that communicator's stream, ordered
    /// after the caller's stream by `fork` and back by `join` (nothing extra when the caller
    /// passes the communicator's own stream).
    Cudarc {
        comm: OwnedNcclComm,
        fork: CudaEvent,
        join: CudaEvent,
    },
    /// A communicator this crate created: NCCL runs on the caller's stream itself.
    Raw(RawComm),
}

impl Fallback {
    /// What it is, for the path report.
    pub(crate) fn describe(&self) -> String {
        let lib = library().map_or_else(
            |_| "NCCL".to_string(),
            |l| format!("NCCL {}", version_string(l.version)),
        );
        match self {
            Fallback::Cudarc { .. } => format!("{lib} through the caller's communicator (on its stream)"),
            Fallback::Raw(c) => format!("{lib} ({}) on the caller's stream", c.library.name),
        }
    }

    /// Sums `len` elements at `input` into `output` (may be equal) over all ranks, ordered on
    /// `stream`.
    pub(crate) fn all_reduce(
        &self,
        input: u64,
        output: u64,
        len: usize,
        dtype: DType,
        stream: &CudaStream,
    ) -> Result<()> {
        match self {
            Fallback::Raw(c) => {
                c.async_error()?;
                // SAFETY: live communicator; the ranges are `len` elements of `dtype` of device
                // memory on the communicator's device (validated by the caller); the stream is
                // a live stream of that device.
                let code = unsafe {
                    (c.library.all_reduce)(
                        input as *const c_void,
                        output as *mut c_void,
                        len,
                        dtype_code(dtype),
                        sys::ncclRedOp_t::ncclSum as c_int,
                        c.comm,
                        stream.cu_stream() as *mut c_void,
                    )
                };
                c.library.check(code, "ncclAllReduce")
            }
            Fallback::Cudarc { comm, fork, join } => match dtype {
                DType::F32 => cudarc_all_reduce::<f32>(comm.get(), fork, join, input, output, len, stream),
                DType::F16 => {
                    cudarc_all_reduce::<half::f16>(comm.get(), fork, join, input, output, len, stream)
                }
                DType::BF16 => {
                    cudarc_all_reduce::<half::bf16>(comm.get(), fork, join, input, output, len, stream)
                }
            },
        }
    }
}

fn cudarc_all_reduce<T: NcclType>(
    comm: &Comm,
    fork: &CudaEvent,
    join: &CudaEvent,
    input: u64,
    output: u64,
    len: usize,
    stream: &CudaStream,
) -> Result<()> {
    let nccl_stream = comm.stream();
    let same = nccl_stream.cu_stream() == stream.cu_stream();
    if !same {
        fork.record(stream).during("cuEventRecord")?;
        nccl_stream.wait(fork).during("cuStreamWaitEvent")?;
    }
    let src = RawRange::<T> {
        ptr: input,
        len,
        stream: nccl_stream.clone(),
        _type: PhantomData,
    };
    let mut dst = RawRange::<T> {
        ptr: output,
        len,
        stream: nccl_stream.clone(),
        _type: PhantomData,
    };
    comm.all_reduce(&src, &mut dst, &ReduceOp::Sum)
        .map_err(cudarc_nccl_error("ncclAllReduce"))?;
    if !same {
        join.record(&nccl_stream).during("cuEventRecord")?;
        stream.wait(join).during("cuStreamWaitEvent")?;
    }
    Ok(())
}

// ---- Bootstrap over NCCL ------------------------------------------------------------------

/// Bytes per all-gather frame.
pub(crate) const FRAME: usize = 1024;
/// Payload bytes in the first frame (after the 4-byte length).
const FIRST_PAYLOAD: usize = FRAME - 4;
/// Largest message one rank may contribute.
const MAX_MESSAGE: usize = 16 << 20;

/// Frames a message of `len` bytes takes.
pub(crate) fn frames_needed(len: usize) -> usize {
    1 + len.saturating_sub(FIRST_PAYLOAD).div_ceil(FRAME)
}

/// The first frame: `length: u32` then the first bytes, zero-padded.
pub(crate) fn first_frame(bytes: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; FRAME];
    f[..4].copy_from_slice(&(bytes.len() as u32).to_le_bytes());
    let n = bytes.len().min(FIRST_PAYLOAD);
    f[4..4 + n].copy_from_slice(&bytes[..n]);
    f
}

/// `extra` continuation frames: the bytes after the first frame's, zero-padded.
pub(crate) fn continuation_frames(bytes: &[u8], extra: usize) -> Vec<u8> {
    let mut f = vec![0u8; extra * FRAME];
    let rest = bytes.get(FIRST_PAYLOAD..).unwrap_or_default();
    f[..rest.len()].copy_from_slice(rest);
    f
}

/// Every rank's length from the gathered first frames.
pub(crate) fn frame_lengths(first: &[u8], world: usize) -> std::result::Result<Vec<usize>, String> {
    if first.len() != world * FRAME {
        return Err(format!(
            "gathered {} bytes, expected {}",
            first.len(),
            world * FRAME
        ));
    }
    (0..world)
        .map(|q| {
            let at = q * FRAME;
            let len = u32::from_le_bytes(first[at..at + 4].try_into().expect("4 bytes")) as usize;
            if len > MAX_MESSAGE {
                Err(format!(
                    "rank {q} announced a {len}-byte message (over {MAX_MESSAGE}): malformed"
                ))
            } else {
                Ok(len)
            }
        })
        .collect()
}

/// Rebuilds every rank's message from the first frames and `extra` continuation frames per
/// rank.
pub(crate) fn assemble(first: &[u8], rest: &[u8], lengths: &[usize], extra: usize) -> Vec<Vec<u8>> {
    lengths
        .iter()
        .enumerate()
        .map(|(q, &len)| {
            let head = len.min(FIRST_PAYLOAD);
            let mut m = first[q * FRAME + 4..q * FRAME + 4 + head].to_vec();
            if len > head {
                let at = q * extra * FRAME;
                m.extend_from_slice(&rest[at..at + (len - head)]);
            }
            m
        })
        .collect()
}

/// A [`Bootstrap`] over an existing cudarc NCCL communicator: bytes are all-gathered through
/// device memory on the communicator's stream (every wait bounded by `timeout`), descriptors
/// over per-rank abstract Unix sockets whose names travel through NCCL. Needs every rank on
/// one host for the descriptors; [`crate::Communicator::from_nccl`] checks that first and
/// otherwise never asks for descriptors.
pub struct NcclBootstrap<'a> {
    comm: &'a Comm,
    timeout: Duration,
}

impl std::fmt::Debug for NcclBootstrap<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclBootstrap(rank {} of {}, timeout {:?})",
            self.comm.rank(),
            self.comm.world_size(),
            self.timeout
        )
    }
}

impl<'a> NcclBootstrap<'a> {
    /// Uses `comm` (which must stay unused by anyone else meanwhile). Every exchange gives up
    /// after `timeout`.
    pub fn new(comm: &'a Comm, timeout: Duration) -> Self {
        NcclBootstrap { comm, timeout }
    }

    /// One `ncclAllGather` of `local` (the same length on every rank), bounded by the timeout.
    fn gather_device(&self, local: &[u8]) -> Result<Vec<u8>> {
        let world = self.comm.world_size();
        let stream = self.comm.stream();
        stream.context().bind_to_thread().during("cuCtxSetCurrent")?;
        let send = stream.clone_htod(local).during("cuMemcpyHtoDAsync")?;
        let mut recv = stream
            .alloc_zeros::<u8>(local.len() * world)
            .during("cuMemAllocAsync")?;
        self.comm
            .all_gather(&send, &mut recv)
            .map_err(cudarc_nccl_error("ncclAllGather"))?;
        wait_bounded(&stream, self.timeout, self.comm.rank())?;
        stream.clone_dtoh(&recv).during("cuMemcpyDtoH")
    }
}

/// Waits for `stream` by polling an event until `timeout`.
fn wait_bounded(stream: &Arc<CudaStream>, timeout: Duration, rank: usize) -> Result<()> {
    let event = stream.context().new_event(None).during("cuEventCreate")?;
    event.record(stream).during("cuEventRecord")?;
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(20);
    loop {
        if event.try_is_complete().during("cuEventQuery")? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::PeerSetupFailed {
                step: "NCCL bootstrap",
                rank,
                reason: format!(
                    "an ncclAllGather did not complete within {timeout:?}: a rank died or is at another setup step"
                ),
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

impl Bootstrap for NcclBootstrap<'_> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world_size()
    }

    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let world = self.world();
        if bytes.len() > MAX_MESSAGE {
            return Err(Error::Bootstrap {
                reason: format!(
                    "a {}-byte setup message is over the {MAX_MESSAGE}-byte limit",
                    bytes.len()
                ),
            });
        }
        let malformed = |reason: String| Error::PeerSetupFailed {
            step: "NCCL bootstrap",
            rank: usize::MAX,
            reason,
        };
        let first = self.gather_device(&first_frame(bytes))?;
        let lengths = frame_lengths(&first, world).map_err(malformed)?;
        // Every rank sees the same lengths, so every rank makes the same second call (or none).
        let extra = lengths.iter().map(|&l| frames_needed(l)).max().unwrap_or(1) - 1;
        let rest = if extra > 0 {
            self.gather_device(&continuation_frames(bytes, extra))?
        } else {
            Vec::new()
        };
        Ok(assemble(&first, &rest, &lengths, extra))
    }

    fn all_gather_fds(&self, fd: BorrowedFd<'_>) -> Result<Vec<OwnedFd>> {
        gather_fds_over_abstract_sockets(self, fd, self.timeout, &StoreOptions::default())
    }
}

/// Descriptor exchange for a bootstrap that can only move bytes: every rank listens on an
/// abstract Unix socket with a random name, the names (and a token each) travel through
/// `bootstrap.all_gather`, every rank connects to every peer and sends its descriptor with
/// `SCM_RIGHTS`, then collects the peers' from its own socket. Both halves end in a vote, so
/// every rank returns the same verdict. The sockets are closed when this returns.
///
/// Every accepted connection and every connected listener passes `options.check_peer` (same
/// user by default) before anything is read from or sent to it; a descriptor is only sent to
/// a listener that passed, and is only taken from a sender that proved the receiver's token.
#[doc(hidden)] // public only for the security tests
pub fn gather_fds_over_abstract_sockets(
    bootstrap: &dyn Bootstrap,
    fd: BorrowedFd<'_>,
    timeout: Duration,
    options: &StoreOptions,
) -> Result<Vec<OwnedFd>> {
    let (rank, world) = (bootstrap.rank(), bootstrap.world());
    let own = fd.try_clone_to_owned().map_err(|e| Error::Bootstrap {
        reason: format!("dup of a file descriptor failed: {e}"),
    })?;
    if world == 1 {
        return Ok(vec![own]);
    }
    let deadline = Instant::now() + timeout;
    let token = wire::random_secret().map_err(|e| Error::Bootstrap {
        reason: format!("no random token for the descriptor exchange: {e}"),
    })?;
    let name = format!(
        "symm-allreduce.{}.{}",
        std::process::id(),
        hex::encode(random_token())
    );
    let listener = SocketAddr::from_abstract_name(name.as_bytes())
        .and_then(|a| UnixListener::bind_addr(&a))
        .and_then(|l| l.set_nonblocking(true).map(|()| l));
    let announce = match &listener {
        Ok(_) => encode_announce(&token, &name),
        Err(e) => [
            &[0u8][..],
            format!("cannot listen on abstract socket @{name}: {e}").as_bytes(),
        ]
        .concat(),
    };
    let announced = bootstrap.all_gather(&announce)?;
    let mut peers: Vec<([u8; 16], String)> = Vec::with_capacity(world);
    for (q, a) in announced.iter().enumerate() {
        match decode_announce(a) {
            Ok((token, name)) => peers.push((token, name.to_string())),
            Err(why) => {
                // Every rank sees the same announcements: all fail here together.
                return Err(Error::PeerSetupFailed {
                    step: "descriptor exchange",
                    rank: q,
                    reason: why.unwrap_or_else(|e| e.to_string()),
                });
            }
        }
    }
    // This rank's own announcement was a success if we got here.
    let listener = listener.map_err(|e| Error::Bootstrap {
        reason: format!("cannot listen on abstract socket @{name}: {e}"),
    })?;

    // Phase 1: send this rank's descriptor to every peer. Connecting to a listening socket
    // and writing a small message complete without the peer's help (the kernel queues the
    // connection and the data), so no rank waits on another here.
    let sent = (|| -> std::io::Result<()> {
        for (q, (their_token, their_name)) in peers.iter().enumerate() {
            if q == rank {
                continue;
            }
            let stream = UnixStream::connect_addr(&SocketAddr::from_abstract_name(their_name.as_bytes())?)?;
            // The descriptor goes only to a listener of an admitted user.
            wire::admit(&stream, options).map_err(|why| {
                std::io::Error::other(format!("the listener of rank {q} is not admitted: {why}"))
            })?;
            let payload = encode_offer(rank, their_token);
            send_frame_with_fds(&stream, Kind::Fd, rank as u64, &payload, &[own.as_fd()], deadline)?;
        }
        Ok(())
    })()
    .map_err(|e| Error::Bootstrap {
        reason: format!(
            "sending a descriptor to a peer over an abstract socket failed ({e}); are all ranks in one \
             network namespace?"
        ),
    });
    vote(bootstrap, "descriptor exchange (send)", sent)?;

    // Phase 2: every peer's descriptor is queued on the listener by now.
    let received = (|| -> Result<Vec<Option<OwnedFd>>> {
        let mut fds: Vec<Option<OwnedFd>> = (0..world).map(|_| None).collect();
        let mut missing = world - 1;
        while missing > 0 {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(Error::Bootstrap {
                            reason: format!("{missing} peer descriptor(s) did not arrive within {timeout:?}"),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                Err(e) => {
                    return Err(Error::Bootstrap {
                        reason: format!("accept on @{name} failed: {e}"),
                    })
                }
            };
            // Another user's connection is dropped before a byte is read. Anything that is
            // not a peer's well-formed message with our token is not ours: ignore it (any
            // descriptor it carried is closed with it).
            if wire::admit(&stream, options).is_err() {
                continue;
            }
            let Ok((header, payload, mut got)) = stream
                .set_nonblocking(false)
                .and_then(|()| super::socket::read_frame_bounded(&stream, deadline, wire::OFFER_BYTES, 1))
            else {
                continue;
            };
            if header.kind != Kind::Fd || wire::check_descriptors(Kind::Fd, world, got.len()).is_err() {
                continue;
            }
            let Ok(q) = decode_offer(&payload, &token, rank, world) else {
                continue;
            };
            if fds[q].is_some() {
                continue;
            }
            fds[q] = Some(got.remove(0));
            missing -= 1;
        }
        Ok(fds)
    })();
    let mut fds = vote(bootstrap, "descriptor exchange (receive)", received)?;
    fds[rank] = Some(own);
    fds.into_iter()
        .enumerate()
        .map(|(q, f)| {
            f.ok_or_else(|| Error::Bootstrap {
                reason: format!("no descriptor from rank {q}"),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_any_lengths() {
        let lengths = [
            0usize,
            1,
            FIRST_PAYLOAD - 1,
            FIRST_PAYLOAD,
            FIRST_PAYLOAD + 1,
            5000,
            3 * FRAME,
        ];
        let messages: Vec<Vec<u8>> = lengths
            .iter()
            .enumerate()
            .map(|(q, &n)| (0..n).map(|i| (i * 7 + q) as u8).collect())
            .collect();
        let world = messages.len();
        // What the all-gathers would return: concatenation in rank order.
        let first: Vec<u8> = messages.iter().flat_map(|m| first_frame(m)).collect();
        let got = frame_lengths(&first, world).unwrap();
        assert_eq!(got, lengths);
        let extra = got.iter().map(|&l| frames_needed(l)).max().unwrap() - 1;
        assert_eq!(extra, frames_needed(5000) - 1); // the longest message decides
        let rest: Vec<u8> = messages
            .iter()
            .flat_map(|m| continuation_frames(m, extra))
            .collect();
        assert_eq!(rest.len(), world * extra * FRAME);
        assert_eq!(assemble(&first, &rest, &got, extra), messages);
    }

    #[test]
    fn frame_counts_and_bad_lengths() {
        assert_eq!(frames_needed(0), 1);
        assert_eq!(frames_needed(FIRST_PAYLOAD), 1);
        assert_eq!(frames_needed(FIRST_PAYLOAD + 1), 2);
        assert_eq!(frames_needed(FIRST_PAYLOAD + FRAME), 2);
        assert_eq!(frames_needed(FIRST_PAYLOAD + FRAME + 1), 3);
        let mut f = first_frame(b"abc");
        f[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(frame_lengths(&f, 1).is_err());
        assert!(frame_lengths(&f, 2).is_err());
    }

    #[test]
    fn descriptors_travel_over_abstract_sockets_named_through_the_bootstrap() {
        use std::os::unix::fs::FileExt;
        let dir = std::env::temp_dir().join(format!("symm-abstract-{}", hex::encode(random_token())));
        std::fs::create_dir_all(&dir).unwrap();
        let world = 4;
        let hub = crate::LocalHub::new(world, Duration::from_secs(10));
        std::thread::scope(|s| {
            for r in 0..world {
                let hub = hub.rank(r);
                let dir = &dir;
                s.spawn(move || {
                    let path = dir.join(format!("rank{r}"));
                    std::fs::write(&path, format!("from rank {r}")).unwrap();
                    let file = std::fs::File::open(&path).unwrap();
                    for _ in 0..3 {
                        let fds = gather_fds_over_abstract_sockets(
                            &hub,
                            file.as_fd(),
                            Duration::from_secs(10),
                            &StoreOptions::default(),
                        )
                        .unwrap();
                        assert_eq!(fds.len(), world);
                        for (q, fd) in fds.into_iter().enumerate() {
                            let mut buf = [0u8; 32];
                            let n = std::fs::File::from(fd).read_at(&mut buf, 0).unwrap();
                            assert_eq!(&buf[..n], format!("from rank {q}").as_bytes());
                        }
                    }
                });
            }
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn library_names_end_with_the_runtime_soname() {
        let names = candidate_names();
        assert_eq!(names.first().map(String::as_str), Some("libnccl.so"));
        assert_eq!(names.last().map(String::as_str), Some("libnccl.so.2"));
    }

    #[test]
    fn missing_nccl_is_an_error_that_says_how_to_install_it() {
        // On machines with NCCL this checks the version string instead.
        match nccl_library() {
            Ok(info) => assert!(info.version.starts_with("2."), "{info:?}"),
            Err(e) => {
                let text = e.to_string();
                assert!(
                    text.contains("libnccl.so.2") && text.contains("Install"),
                    "{text}"
                );
            }
        }
    }
}
