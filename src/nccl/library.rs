//! NCCL's functions, loaded with `dlopen` once per process: the crate's only NCCL FFI.
//!
//! cudarc's loader tries `libnccl.so` and a list of other names but not `libnccl.so.2`, the
//! soname that runtime-only installs ship (the `nvidia-nccl-cu12` wheel, `libnccl2` without
//! `-dev`). Loading `libnccl.so.2` with `RTLD_GLOBAL` first does not help: glibc matches an
//! already-loaded object by the exact name or soname, so a later `dlopen("libnccl.so")` still
//! fails (checked with a two-file C program). Environment changes after start-up do not reach
//! the loader either. So the NCCL calls this crate makes itself go through its own table of
//! function pointers, loaded by [`library`] from cudarc's names first and `libnccl.so.2`
//! last: whenever cudarc found a library, this finds the same file; when only
//! `libnccl.so.2` exists, this still works. A communicator that the *caller* built with
//! cudarc keeps being driven through cudarc's own API (its raw handle is private).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys;

use crate::error::{Error, Result};

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
type AllGatherFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, sys::ncclComm_t, *mut c_void) -> c_int;
type ReduceScatterFn = AllReduceFn;
type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    sys::ncclComm_t,
    *mut c_void,
) -> c_int;
type GroupFn = unsafe extern "C" fn() -> c_int;
type GetErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
/// `ncclCommWindowRegister(comm, buff, size, ncclWindow_t* win, int winFlags)`; `ncclWindow_t`
/// is an opaque pointer (`struct ncclWindow*` in 2.27, `struct ncclWindow_vidmem*` from 2.28).
type WindowRegisterFn =
    unsafe extern "C" fn(sys::ncclComm_t, *mut c_void, usize, *mut *mut c_void, c_int) -> c_int;
/// `ncclCommWindowDeregister(comm, ncclWindow_t win)`.
type WindowDeregisterFn = unsafe extern "C" fn(sys::ncclComm_t, *mut c_void) -> c_int;

/// The first NCCL with window registration, as `ncclGetVersion` encodes it (2.27.0).
pub(crate) const WINDOWS_SINCE: i32 = 22700;

/// `NCCL_WIN_COLL_SYMMETRIC` (nccl.h, 2.27 and later): every rank registers a buffer of the
/// same size, so NCCL may run its symmetric kernels on buffers inside the window.
pub(crate) const WIN_COLL_SYMMETRIC: c_int = 0x01;

/// NCCL's window functions: present only in a library of version [`WINDOWS_SINCE`] or later.
#[derive(Clone, Copy)]
pub(crate) struct WindowFns {
    pub(crate) register: WindowRegisterFn,
    pub(crate) deregister: WindowDeregisterFn,
}

/// The window functions of a library of version `version` (named `name`): resolved by
/// `resolve` only when the version has them (never by probing for the symbols), else why not.
pub(crate) fn window_functions(
    version: i32,
    name: &str,
    resolve: impl FnOnce() -> std::result::Result<WindowFns, String>,
) -> std::result::Result<WindowFns, String> {
    if version < WINDOWS_SINCE {
        return Err(format!(
            "{name} is NCCL {}; window registration (ncclCommWindowRegister) needs NCCL {} or newer",
            version_string(version),
            version_string(WINDOWS_SINCE)
        ));
    }
    resolve()
}

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
    all_gather: AllGatherFn,
    reduce_scatter: ReduceScatterFn,
    broadcast: BroadcastFn,
    group_start: GroupFn,
    group_end: GroupFn,
    get_error_string: GetErrorStringFn,
    /// The window functions, or why this library has none.
    windows: std::result::Result<WindowFns, String>,
    // Keeps the function pointers above valid; never unloaded (lives in a static). `None`
    // only for the tests' fake tables.
    _library: Option<libloading::Library>,
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

/// The names tried, in order: `libnccl.so`, the name cudarc's loader finds NCCL by (so that a
/// library cudarc loaded is the one used here), then `libnccl.so.2`, the soname of
/// runtime-only installs. Written out rather than taken from `cudarc::get_lib_name_candidates`,
/// which exists only with cudarc's `dynamic-loading`, not beside an application that selects
/// `dynamic-linking` (candle, mistral.rs).
pub(crate) fn candidate_names() -> Vec<String> {
    vec!["libnccl.so".to_string(), "libnccl.so.2".to_string()]
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
    let windows = window_functions(version, name, || {
        Ok(WindowFns {
            // SAFETY: the prototypes of nccl.h 2.27 and later (`ncclWindow_t` is a pointer).
            register: unsafe { symbol(&library, "ncclCommWindowRegister")? },
            // SAFETY: as above.
            deregister: unsafe { symbol(&library, "ncclCommWindowDeregister")? },
        })
    });
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
        all_gather: unsafe { symbol(&library, "ncclAllGather")? },
        // SAFETY: see above (same prototype as ncclAllReduce, with recvcount).
        reduce_scatter: unsafe { symbol(&library, "ncclReduceScatter")? },
        // SAFETY: see above (ncclBroadcast: send, recv, count, type, root, comm, stream).
        broadcast: unsafe { symbol(&library, "ncclBroadcast")? },
        // SAFETY: see above (`ncclResult_t ncclGroupStart(void)`).
        group_start: unsafe { symbol(&library, "ncclGroupStart")? },
        // SAFETY: see above (`ncclResult_t ncclGroupEnd(void)`).
        group_end: unsafe { symbol(&library, "ncclGroupEnd")? },
        // SAFETY: see above.
        get_error_string: unsafe { symbol(&library, "ncclGetErrorString")? },
        windows,
        _library: Some(library),
    })
}

impl NcclLibrary {
    /// A table of the fake NCCL (tests only) reporting `version`: the window functions are
    /// resolved exactly as for a loaded library, by version.
    #[cfg(test)]
    pub(crate) fn fake(version: i32) -> NcclLibrary {
        use super::fake;
        NcclLibrary {
            name: "fake NCCL".to_string(),
            version,
            get_unique_id: fake::get_unique_id,
            comm_init_rank: fake::comm_init_rank,
            comm_abort: fake::comm_abort,
            comm_get_async_error: fake::comm_get_async_error,
            all_reduce: fake::reduce,
            all_gather: fake::all_gather,
            reduce_scatter: fake::reduce,
            broadcast: fake::broadcast,
            group_start: fake::group_start,
            group_end: fake::group_end,
            get_error_string: fake::get_error_string,
            windows: window_functions(version, "fake NCCL", || {
                Ok(WindowFns {
                    register: fake::window_register,
                    deregister: fake::window_deregister,
                })
            }),
            _library: None,
        }
    }

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
impl NcclLibrary {
    /// The name it was loaded by.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// `major.minor.patch`.
    pub(crate) fn version(&self) -> String {
        version_string(self.version)
    }

    /// Whether this library can register windows (`Err`: why not).
    pub(crate) fn windows(&self) -> std::result::Result<(), &str> {
        self.windows.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// `ncclCommWindowRegister(comm, ptr, bytes, &win, NCCL_WIN_COLL_SYMMETRIC)`: a
    /// collective call, every rank of `comm` makes it with a range of the same size. `None`:
    /// NCCL returned success without a window (its symmetric memory support is off for this
    /// communicator, or the memory failed its checks; NCCL logs why with `NCCL_DEBUG=WARN`).
    ///
    /// # Safety
    /// `comm` is live and `ptr..ptr + bytes` is device memory of its device, allocated with
    /// `cuMemCreate` (exportable as a POSIX file descriptor) and mapped, that stays mapped
    /// until the window is deregistered.
    pub(crate) unsafe fn window_register(
        &self,
        comm: sys::ncclComm_t,
        ptr: u64,
        bytes: usize,
    ) -> Result<Option<std::ptr::NonNull<c_void>>> {
        let fns = self.windows.as_ref().map_err(|why| Error::Nccl {
            call: "ncclCommWindowRegister",
            detail: why.clone(),
        })?;
        let mut window: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the caller guarantees the communicator and the memory.
        let code =
            unsafe { (fns.register)(comm, ptr as *mut c_void, bytes, &mut window, WIN_COLL_SYMMETRIC) };
        self.check(code, "ncclCommWindowRegister")?;
        Ok(std::ptr::NonNull::new(window))
    }

    /// `ncclCommWindowDeregister` (local: it waits for no peer).
    ///
    /// # Safety
    /// `comm` is live and `window` came from [`NcclLibrary::window_register`] on it, is
    /// deregistered once, and no collective on memory of the window is still pending.
    pub(crate) unsafe fn window_deregister(
        &self,
        comm: sys::ncclComm_t,
        window: std::ptr::NonNull<c_void>,
    ) -> Result<()> {
        let fns = self.windows.as_ref().map_err(|why| Error::Nccl {
            call: "ncclCommWindowDeregister",
            detail: why.clone(),
        })?;
        // SAFETY: the caller's guarantee.
        let code = unsafe { (fns.deregister)(comm, window.as_ptr()) };
        self.check(code, "ncclCommWindowDeregister")
    }

    /// `ncclCommInitRank`: blocks until every rank has joined.
    ///
    /// # Safety
    /// `id` came from [`NcclLibrary::unique_id`] on one rank of this group, `rank < world`,
    /// and the rank's device context is current on this thread.
    pub(crate) unsafe fn comm_init_rank(
        &self,
        id: [u8; 128],
        world: usize,
        rank: usize,
    ) -> Result<sys::ncclComm_t> {
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the caller guarantees the id, the rank and the context.
        let code = unsafe { (self.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) };
        self.check(code, "ncclCommInitRank")?;
        Ok(comm)
    }

    /// An error NCCL recorded asynchronously on `comm` (a failed or aborted collective).
    ///
    /// # Safety
    /// `comm` is a live communicator made by [`NcclLibrary::comm_init_rank`].
    pub(crate) unsafe fn comm_async_error(&self, comm: sys::ncclComm_t) -> Result<()> {
        let mut code: c_int = 0;
        // SAFETY: live communicator (the caller's guarantee), valid out-pointer.
        let call = unsafe { (self.comm_get_async_error)(comm, &mut code) };
        self.check(call, "ncclCommGetAsyncError")?;
        self.check(code, "NCCL (asynchronous error)")
    }

    /// `ncclCommAbort` (never waits for peers).
    ///
    /// # Safety
    /// `comm` is a live communicator made by [`NcclLibrary::comm_init_rank`], never used
    /// again after this call.
    pub(crate) unsafe fn comm_abort(&self, comm: sys::ncclComm_t) -> Result<()> {
        // SAFETY: the caller's guarantee.
        let code = unsafe { (self.comm_abort)(comm) };
        self.check(code, "ncclCommAbort")
    }

    /// `ncclAllReduce(sum)` of `len` elements of `dtype` from `input` into `output` on
    /// `stream`.
    ///
    /// # Safety
    /// `comm` is live; both ranges are `len` elements of `dtype` of device memory on the
    /// communicator's device, live until the reduction completes on `stream`, a live stream of
    /// that device.
    pub(crate) unsafe fn all_reduce(
        &self,
        comm: sys::ncclComm_t,
        input: u64,
        output: u64,
        len: usize,
        dtype: sys::ncclDataType_t,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's guarantee.
        let code = unsafe {
            (self.all_reduce)(
                input as *const c_void,
                output as *mut c_void,
                len,
                dtype as c_int,
                sys::ncclRedOp_t::ncclSum as c_int,
                comm,
                stream as *mut c_void,
            )
        };
        self.check(code, "ncclAllReduce")
    }

    /// `ncclAllGather` of `send_count` elements of `dtype` per rank from `input` into
    /// `output` (rank-major, `world · send_count` elements) on `stream`.
    ///
    /// # Safety
    /// `comm` is live; `input` holds `send_count` and `output` `world · send_count` elements
    /// of `dtype` of device memory on the communicator's device, live until the call completes
    /// on `stream`, a live stream of that device.
    pub(crate) unsafe fn all_gather(
        &self,
        comm: sys::ncclComm_t,
        input: u64,
        output: u64,
        send_count: usize,
        dtype: sys::ncclDataType_t,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's guarantee.
        let code = unsafe {
            (self.all_gather)(
                input as *const c_void,
                output as *mut c_void,
                send_count,
                dtype as c_int,
                comm,
                stream as *mut c_void,
            )
        };
        self.check(code, "ncclAllGather")
    }

    /// `ncclReduceScatter(sum)`: `world · recv_count` elements of `dtype` from `input`, this
    /// rank's `recv_count` into `output`, on `stream`.
    ///
    /// # Safety
    /// As [`NcclLibrary::all_gather`], with `input` holding `world · recv_count` elements and
    /// `output` `recv_count`.
    pub(crate) unsafe fn reduce_scatter(
        &self,
        comm: sys::ncclComm_t,
        input: u64,
        output: u64,
        recv_count: usize,
        dtype: sys::ncclDataType_t,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's guarantee.
        let code = unsafe {
            (self.reduce_scatter)(
                input as *const c_void,
                output as *mut c_void,
                recv_count,
                dtype as c_int,
                sys::ncclRedOp_t::ncclSum as c_int,
                comm,
                stream as *mut c_void,
            )
        };
        self.check(code, "ncclReduceScatter")
    }

    /// `ncclBroadcast` of `count` elements of `dtype` from rank `root`'s `input` into every
    /// rank's `output`, on `stream` (`input` is read on the root only).
    ///
    /// # Safety
    /// As [`NcclLibrary::all_gather`], with `output` holding `count` elements and, on the
    /// root, `input` holding `count` elements.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn broadcast(
        &self,
        comm: sys::ncclComm_t,
        input: u64,
        output: u64,
        count: usize,
        dtype: sys::ncclDataType_t,
        root: usize,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's guarantee.
        let code = unsafe {
            (self.broadcast)(
                input as *const c_void,
                output as *mut c_void,
                count,
                dtype as c_int,
                root as c_int,
                comm,
                stream as *mut c_void,
            )
        };
        self.check(code, "ncclBroadcast")
    }

    /// Runs `calls` between `ncclGroupStart` and `ncclGroupEnd` (which this thread's group
    /// state makes one fused launch), ending the group whatever `calls` returns; the first
    /// error wins.
    pub(crate) fn grouped(&self, calls: impl FnOnce() -> Result<()>) -> Result<()> {
        // SAFETY: ncclGroupStart has no preconditions; it opens this thread's group.
        self.check(unsafe { (self.group_start)() }, "ncclGroupStart")?;
        let result = calls();
        // SAFETY: closes the group opened above (whatever the calls in it returned).
        let end = self.check(unsafe { (self.group_end)() }, "ncclGroupEnd");
        result.and(end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
