//! A fake NCCL table for the CPU tests: the functions of [`super::library::NcclLibrary`] as
//! `extern "C"` functions over host memory, one rank per thread of the test process.
//!
//! A communicator handle points at a [`FakeComm`] (its rank, how its window registration
//! behaves, the group it belongs to). Windows are counted while live, and every register,
//! deregister, abort (and whatever a test adds) is logged in the group's order of events.
//! `ncclBroadcast`s queue in the calling thread's group and run at `ncclGroupEnd`: every rank
//! publishes its roots' source addresses, all wait, every rank copies its destinations from
//! the roots' host memory, all wait again, so the data really crosses ranks.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use cudarc::nccl::sys;

/// A code no real call below returns: the fake refuses functions the tests never reach.
const UNUSED: c_int = 5;

/// How a rank's `ncclCommWindowRegister` behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Registration {
    /// Registers and returns a window.
    Succeeds,
    /// Returns this error code.
    Fails(c_int),
    /// Returns success without a window (NCCL's answer when symmetric memory is off).
    NoWindow,
}

/// What the ranks of one fake communicator share.
#[derive(Debug)]
pub(crate) struct FakeGroup {
    barrier: Barrier,
    published: Mutex<Vec<Vec<u64>>>,
    live_windows: AtomicUsize,
    log: Mutex<Vec<String>>,
}

impl FakeGroup {
    pub(crate) fn new(world: usize) -> Arc<FakeGroup> {
        Arc::new(FakeGroup {
            barrier: Barrier::new(world),
            published: Mutex::new(vec![Vec::new(); world]),
            live_windows: AtomicUsize::new(0),
            log: Mutex::new(Vec::new()),
        })
    }

    /// Windows registered and not yet deregistered.
    pub(crate) fn live_windows(&self) -> usize {
        self.live_windows.load(Ordering::SeqCst)
    }

    /// Every event so far, in order.
    pub(crate) fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Adds an event (a test's own, such as an unmap).
    pub(crate) fn note(&self, event: String) {
        self.log.lock().unwrap().push(event);
    }
}

/// One rank's fake communicator.
#[derive(Debug)]
pub(crate) struct FakeComm {
    rank: usize,
    registration: Registration,
    group: Arc<FakeGroup>,
}

impl FakeComm {
    /// A handle for rank `rank` of `group`, freed by `ncclCommAbort`.
    pub(crate) fn handle(rank: usize, registration: Registration, group: &Arc<FakeGroup>) -> sys::ncclComm_t {
        let comm = Box::new(FakeComm {
            rank,
            registration,
            group: group.clone(),
        });
        Box::into_raw(comm).cast()
    }
}

/// # Safety
/// `comm` came from [`FakeComm::handle`] and was not aborted.
unsafe fn comm<'a>(comm: sys::ncclComm_t) -> &'a FakeComm {
    // SAFETY: the caller's guarantee.
    unsafe { &*comm.cast::<FakeComm>() }
}

/// A fake window: where it was registered.
struct FakeWindow {
    rank: usize,
    ptr: u64,
}

pub(crate) unsafe extern "C" fn window_register(
    c: sys::ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut *mut c_void,
    flags: c_int,
) -> c_int {
    // SAFETY: the library passes the communicator it was given.
    let c = unsafe { comm(c) };
    c.group.note(format!(
        "rank {} register {:#x} {size} flags {flags}",
        c.rank, buff as u64
    ));
    match c.registration {
        Registration::Fails(code) => code,
        Registration::NoWindow => {
            // SAFETY: the library passes a valid out-pointer.
            unsafe { *win = std::ptr::null_mut() };
            0
        }
        Registration::Succeeds => {
            let window = Box::new(FakeWindow {
                rank: c.rank,
                ptr: buff as u64,
            });
            c.group.live_windows.fetch_add(1, Ordering::SeqCst);
            // SAFETY: as above.
            unsafe { *win = Box::into_raw(window).cast() };
            0
        }
    }
}

pub(crate) unsafe extern "C" fn window_deregister(c: sys::ncclComm_t, win: *mut c_void) -> c_int {
    // SAFETY: the library passes the communicator and a window window_register made.
    let (c, window) = unsafe { (comm(c), Box::from_raw(win.cast::<FakeWindow>())) };
    assert_eq!(
        window.rank, c.rank,
        "a window deregistered on another rank's communicator"
    );
    c.group.live_windows.fetch_sub(1, Ordering::SeqCst);
    c.group
        .note(format!("rank {} deregister {:#x}", c.rank, window.ptr));
    0
}

pub(crate) unsafe extern "C" fn comm_abort(c: sys::ncclComm_t) -> c_int {
    // SAFETY: a handle from FakeComm::handle, aborted once (RawComm's drop).
    let c = unsafe { Box::from_raw(c.cast::<FakeComm>()) };
    c.group.note(format!("rank {} abort", c.rank));
    0
}

/// One queued broadcast.
struct Broadcast {
    comm: sys::ncclComm_t,
    send: u64,
    recv: u64,
    count: usize,
    root: usize,
}

thread_local! {
    static GROUP: RefCell<Vec<Broadcast>> = const { RefCell::new(Vec::new()) };
}

pub(crate) unsafe extern "C" fn broadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: sys::ncclComm_t,
    _stream: *mut c_void,
) -> c_int {
    if dtype != sys::ncclDataType_t::ncclUint8 as c_int {
        return UNUSED;
    }
    GROUP.with(|g| {
        g.borrow_mut().push(Broadcast {
            comm,
            send: send as u64,
            recv: recv as u64,
            count,
            root: root as usize,
        })
    });
    0
}

pub(crate) unsafe extern "C" fn group_start() -> c_int {
    0
}

pub(crate) unsafe extern "C" fn group_end() -> c_int {
    let ops = GROUP.with(|g| std::mem::take(&mut *g.borrow_mut()));
    let Some(first) = ops.first() else { return 0 };
    // SAFETY: the communicator the broadcasts were queued on.
    let c = unsafe { comm(first.comm) };
    let sources = ops
        .iter()
        .map(|op| if op.root == c.rank { op.send } else { 0 })
        .collect();
    c.group.published.lock().unwrap()[c.rank] = sources;
    c.group.barrier.wait();
    {
        let published = c.group.published.lock().unwrap();
        for (k, op) in ops.iter().enumerate() {
            let src = published[op.root][k];
            // SAFETY: the root's host bytes stay alive until the second barrier; every rank
            // writes only its own destination ranges (which the caller sized).
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, op.recv as *mut u8, op.count) };
        }
    }
    c.group.barrier.wait();
    0
}

pub(crate) unsafe extern "C" fn get_error_string(_code: c_int) -> *const c_char {
    c"fake NCCL error".as_ptr()
}

pub(crate) unsafe extern "C" fn get_unique_id(_id: *mut sys::ncclUniqueId) -> c_int {
    UNUSED
}

pub(crate) unsafe extern "C" fn comm_init_rank(
    _comm: *mut sys::ncclComm_t,
    _world: c_int,
    _id: sys::ncclUniqueId,
    _rank: c_int,
) -> c_int {
    UNUSED
}

pub(crate) unsafe extern "C" fn comm_get_async_error(_comm: sys::ncclComm_t, code: *mut c_int) -> c_int {
    // SAFETY: the library passes a valid out-pointer.
    unsafe { *code = 0 };
    0
}

pub(crate) unsafe extern "C" fn reduce(
    _send: *const c_void,
    _recv: *mut c_void,
    _count: usize,
    _dtype: c_int,
    _op: c_int,
    _comm: sys::ncclComm_t,
    _stream: *mut c_void,
) -> c_int {
    UNUSED
}

pub(crate) unsafe extern "C" fn all_gather(
    _send: *const c_void,
    _recv: *mut c_void,
    _count: usize,
    _dtype: c_int,
    _comm: sys::ncclComm_t,
    _stream: *mut c_void,
) -> c_int {
    UNUSED
}
