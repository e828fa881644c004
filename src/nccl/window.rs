//! NCCL windows over the symmetric memory: each rank's allocation registered once, at setup,
//! with `ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC)` on the communicator's own NCCL
//! fallback, so that NCCL (2.27 and later) runs its symmetric kernels on pool buffers.
//!
//! Nothing on the call path knows about windows: NCCL finds the window of a collective's
//! buffers by their addresses and picks a symmetric kernel where it has one for the call
//! (docs/nccl-windows.md). Registration is collective inside NCCL (every rank must make the
//! call, with a range of the same size), so it is preceded by a voted check that every rank
//! can make it: a rank never enters NCCL's registration alone.
//!
//! Order: a [`Window`] is deregistered before the memory it covers is unmapped ([`Windowed`]:
//! field order is drop order) and before its communicator is aborted (the communicator's
//! `Paths` hold the windowed memory in front of the fallback).

use std::ffi::c_void;
use std::ptr::NonNull;

use cudarc::nccl::sys;

use super::comm::{record_teardown_failure, RawComm};
use super::library::NcclLibrary;
use crate::bootstrap::{vote_soft, Bootstrap};
use crate::error::{Error, Result};
use crate::wire::Wire;

/// The voted check that every rank can register (library version, memory properties).
pub(crate) const CHECK_STEP: &str = "NCCL window check";
/// The voted registration itself.
pub(crate) const REGISTER_STEP: &str = "NCCL window registration";

/// NCCL 2.27's registration requirement on the allocation that holds the buffer
/// (`NCCL_REC_PAGE_SIZE`): its base and its size are multiples of 2 MiB.
pub(crate) const NCCL_PAGE: u64 = 2 << 20;

/// One registered window. Deregistered on drop (locally: NCCL's deregistration waits for no
/// peer); a failure is recorded with the NCCL teardown failures.
pub(crate) struct Window {
    comm: sys::ncclComm_t,
    handle: NonNull<c_void>,
    library: &'static NcclLibrary,
    ptr: u64,
    bytes: usize,
}

// SAFETY: the window is used only to deregister it, once, on drop; NCCL allows that from any
// thread as long as no other call on the communicator runs at the same time, which the owning
// Communicator guarantees (its drop runs alone, after its last call completed).
unsafe impl Send for Window {}
// SAFETY: a shared reference gives access to nothing but the address and the size.
unsafe impl Sync for Window {}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Window({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: the window came from window_register on this live communicator (a Window
        // never outlives its RawComm, see the module docs) and is deregistered exactly once;
        // the owning Communicator waited for its last call before dropping it.
        if let Err(e) = unsafe { self.library.window_deregister(self.comm, self.handle) } {
            record_teardown_failure(e.to_string());
        }
    }
}

/// The memory to register: one rank's whole symmetric allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Region {
    /// Where this rank's allocation is mapped in its own address space.
    pub(crate) ptr: u64,
    /// Its size (the same on every rank).
    pub(crate) bytes: usize,
}

/// Checks that NCCL will register exactly `ptr..ptr + bytes`: NCCL 2.27 registers the whole
/// allocation that holds the pointer (`cuMemGetAddressRange`, given here as `range`), whose
/// base and size must be multiples of 2 MiB; later versions require a window start 4 KiB
/// aligned inside its allocation. A failed check here keeps every rank out of NCCL's
/// collective registration (where one rank's failure would leave the others waiting).
pub(crate) fn check_region(ptr: u64, bytes: usize, range: (u64, usize)) -> Result<Region> {
    let fail = |detail: String| {
        Err(Error::Nccl {
            call: "ncclCommWindowRegister",
            detail: format!("not called: {detail}"),
        })
    };
    if range != (ptr, bytes) {
        return fail(format!(
            "the symmetric allocation at {ptr:#x} ({bytes} bytes) is not one mapping to the driver (it reports \
             {:#x}, {} bytes), so NCCL would register another range",
            range.0, range.1
        ));
    }
    if ptr % NCCL_PAGE != 0 || bytes as u64 % NCCL_PAGE != 0 {
        return fail(format!(
            "the symmetric allocation at {ptr:#x} ({bytes} bytes) is not 2 MiB aligned in address and size, \
             which NCCL requires of a window's allocation (the device's allocation granularity is smaller)"
        ));
    }
    Ok(Region { ptr, bytes })
}

/// The NCCL windows over a communicator's symmetric memory, or why there are none.
#[derive(Debug)]
pub(crate) struct Windows(std::result::Result<Window, String>);

impl Windows {
    /// No windows, for `why`.
    pub(crate) fn off(why: impl Into<String>) -> Windows {
        Windows(Err(why.into()))
    }

    /// Why there are no windows, if there are none.
    pub(crate) fn unavailable(&self) -> Option<&str> {
        self.0.as_ref().err().map(String::as_str)
    }

    /// The report line's text.
    pub(crate) fn describe(&self) -> String {
        match &self.0 {
            Ok(w) => format!(
                "on ({} bytes per rank registered with NCCL_WIN_COLL_SYMMETRIC: the symmetric buffer and the \
                 pool; NCCL picks its symmetric kernels for calls routed to it on those buffers)",
                w.bytes
            ),
            Err(why) => format!("off ({why})"),
        }
    }
}

/// Memory with an NCCL window over it. Field order is drop order: the window is deregistered
/// before the memory is unmapped.
#[derive(Debug)]
pub(crate) struct Windowed<M> {
    windows: Windows,
    memory: M,
}

impl<M> Windowed<M> {
    pub(crate) fn new(memory: M, windows: Windows) -> Self {
        Windowed { windows, memory }
    }

    pub(crate) fn windows(&self) -> &Windows {
        &self.windows
    }
}

impl<M> std::ops::Deref for Windowed<M> {
    type Target = M;
    fn deref(&self) -> &M {
        &self.memory
    }
}

impl<M> std::ops::DerefMut for Windowed<M> {
    fn deref_mut(&mut self) -> &mut M {
        &mut self.memory
    }
}

/// The voted registration, on every rank of `bootstrap` together (outside any capture):
/// [`CHECK_STEP`] votes on `region` (this rank's memory check) and on the library having the
/// window functions, then every rank compares the sizes, then [`REGISTER_STEP`] registers and
/// votes. A failure anywhere turns the windows off on every rank with the step and the
/// reason; a rank whose registration succeeded while a peer's failed deregisters its window
/// again. Outer error: the group itself is broken.
pub(crate) fn register_over(
    bootstrap: &dyn Bootstrap,
    comm: &RawComm,
    region: Result<Region>,
) -> Result<Windows> {
    let library = comm.library();
    let local = library
        .windows()
        .map_err(|why| Error::Nccl {
            call: "ncclCommWindowRegister",
            detail: format!("not called: {why}"),
        })
        .and(region);
    let region = match vote_soft(bootstrap, CHECK_STEP, local)? {
        Ok(region) => region,
        Err(e) => return Ok(Windows::off(off_reason(CHECK_STEP, &e))),
    };
    let sizes = bootstrap.all_gather(&region.bytes.to_wire())?;
    for (rank, size) in sizes.iter().enumerate() {
        let size = usize::from_wire(size).ok_or_else(|| Error::malformed("window size"))?;
        if size != region.bytes {
            return Ok(Windows::off(format!(
                "setup step '{CHECK_STEP}': rank {rank} would register {size} bytes, rank {} {}: NCCL needs the \
                 same size on every rank",
                bootstrap.rank(),
                region.bytes
            )));
        }
    }
    // SAFETY: the communicator is live; the region is this rank's mapped symmetric allocation
    // (cuMemCreate, exportable as a file descriptor: driver/vmm.rs), which stays mapped until
    // the window is dropped (Windowed's field order).
    let registered = unsafe { comm.window_register(region.ptr, region.bytes) }.and_then(|handle| {
        let handle = handle.ok_or_else(|| Error::Nccl {
            call: "ncclCommWindowRegister",
            detail:
                "NCCL returned no window: its symmetric memory support is off for this communicator (not \
                     every pair of ranks has direct peer access, several nodes, or NCCL_WIN_ENABLE=0, \
                     NCCL_CUMEM_ENABLE=0 or NCCL_LOCAL_REGISTER=0; NCCL_DEBUG=WARN says why)"
                    .into(),
        })?;
        Ok(Window {
            comm: comm.raw(),
            handle,
            library,
            ptr: region.ptr,
            bytes: region.bytes,
        })
    });
    // A rank that registered while a peer failed drops (deregisters) its window in the vote.
    Ok(match vote_soft(bootstrap, REGISTER_STEP, registered)? {
        Ok(window) => Windows(Ok(window)),
        Err(e) => Windows::off(off_reason(REGISTER_STEP, &e)),
    })
}

/// The reason every rank gives: the step, and the failing rank's error (a peer's error
/// already names the step).
fn off_reason(step: &'static str, e: &Error) -> String {
    match e {
        Error::PeerSetupFailed { .. } => e.to_string(),
        _ => format!("setup step '{step}' failed on this rank: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::bootstrap::LocalHub;
    use crate::nccl::fake::{FakeComm, FakeGroup, Registration};
    use crate::nccl::library::{window_functions, WindowFns, WINDOWS_SINCE};

    /// A fake table reporting `version` (leaked: the communicators hold `&'static`).
    fn fake_library(version: i32) -> &'static NcclLibrary {
        Box::leak(Box::new(NcclLibrary::fake(version)))
    }

    /// Runs `body` on `world` rank threads, each with its bootstrap and a fake communicator
    /// whose registration behaves as `registration(rank)` says; the communicator is aborted
    /// after `body` returns (so whatever `body` registered must be dropped inside it).
    fn on_ranks<T: Send>(
        world: usize,
        version: i32,
        registration: impl Fn(usize) -> Registration + Sync,
        body: impl Fn(&LocalHub, &RawComm, &FakeGroup) -> T + Sync,
    ) -> (Vec<T>, Arc<FakeGroup>) {
        let library = fake_library(version);
        let hub = LocalHub::new(world, Duration::from_secs(20));
        let group = FakeGroup::new(world);
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (hub, group, body, registration) = (hub.rank(rank), &group, &body, &registration);
                    s.spawn(move || {
                        let comm = RawComm::fake(FakeComm::handle(rank, registration(rank), group), library);
                        let out = body(&hub, &comm, group);
                        drop(comm);
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        (results, group)
    }

    /// Rank `rank`'s region in a fake address space (2 MiB aligned, the same size everywhere).
    fn region(rank: usize) -> Result<Region> {
        let ptr = (1u64 << 40) + rank as u64 * (64 << 20);
        check_region(ptr, 6 << 20, (ptr, 6 << 20))
    }

    /// The rank of a hub handle (`LocalHub::rank(r)` makes handles).
    fn me(hub: &LocalHub) -> usize {
        Bootstrap::rank(hub)
    }

    fn count(log: &[String], what: &str) -> usize {
        log.iter().filter(|e| e.contains(what)).count()
    }

    #[test]
    fn window_functions_are_resolved_by_version_only() {
        let resolved = std::cell::Cell::new(false);
        let fns = || {
            resolved.set(true);
            Ok(WindowFns {
                register: crate::nccl::fake::window_register,
                deregister: crate::nccl::fake::window_deregister,
            })
        };
        let old = window_functions(22605, "libnccl.so.2", fns).err().unwrap();
        assert!(
            !resolved.get(),
            "a 2.26 library must not be probed for the symbols"
        );
        assert!(
            old.contains("NCCL 2.26.5") && old.contains("2.27.0 or newer"),
            "{old}"
        );
        assert!(window_functions(WINDOWS_SINCE - 1, "x", fns).is_err());
        assert!(!resolved.get());
        assert!(window_functions(WINDOWS_SINCE, "x", fns).is_ok());
        assert!(resolved.get());
        // A 2.27+ library that lacks the symbols says so (resolution errors pass through).
        let missing = window_functions(22703, "x", || Err("ncclCommWindowRegister is missing".into()));
        assert_eq!(
            missing.err().as_deref(),
            Some("ncclCommWindowRegister is missing")
        );
        assert!(NcclLibrary::fake(22605).windows().is_err());
        assert!(NcclLibrary::fake(22703).windows().is_ok());
        assert!(NcclLibrary::fake(23007).windows().is_ok());
    }

    #[test]
    fn an_old_nccl_turns_windows_off_on_every_rank_without_registering() {
        let (reasons, group) = on_ranks(
            3,
            22605,
            |_| Registration::Succeeds,
            |hub, comm, _| {
                let w = register_over(hub, comm, region(me(hub))).unwrap();
                w.unavailable().map(str::to_string)
            },
        );
        for why in reasons {
            let why = why.expect("windows must be off");
            assert!(why.contains(CHECK_STEP) && why.contains("NCCL 2.26.5"), "{why}");
        }
        assert_eq!(count(&group.log(), " register"), 0);
        assert_eq!(group.live_windows(), 0);
    }

    #[test]
    fn every_rank_registers_once_with_the_symmetric_flag_and_deregisters_before_abort() {
        let (on, group) = on_ranks(
            4,
            22703,
            |_| Registration::Succeeds,
            |hub, comm, group| {
                let w = register_over(hub, comm, region(me(hub))).unwrap();
                let on = w.unavailable().is_none() && w.describe().starts_with("on (6291456 bytes");
                // Every rank registered before any rank looks.
                hub.all_gather(&[]).unwrap();
                assert_eq!(group.live_windows(), 4);
                hub.all_gather(&[]).unwrap();
                drop(w);
                on
            },
        );
        assert!(on.iter().all(|&on| on));
        let log = group.log();
        assert_eq!(count(&log, " register 0x"), 4, "{log:?}");
        assert_eq!(count(&log, "flags 1"), 4, "{log:?}");
        assert_eq!(count(&log, "deregister"), 4, "{log:?}");
        for rank in 0..4 {
            let at = |what: &str| log.iter().position(|e| *e == format!("rank {rank} {what}"));
            let ptr = region(rank).unwrap().ptr;
            let dereg = at(&format!("deregister {ptr:#x}")).expect("deregistered");
            assert!(dereg < at("abort").expect("aborted"), "{log:?}");
        }
        assert_eq!(group.live_windows(), 0, "nothing leaked");
    }

    #[test]
    fn a_failed_registration_on_any_rank_turns_windows_off_everywhere() {
        for failing in 0..3 {
            for how in [Registration::Fails(2), Registration::NoWindow] {
                let (reasons, group) = on_ranks(
                    3,
                    22905,
                    |rank| {
                        if rank == failing {
                            how
                        } else {
                            Registration::Succeeds
                        }
                    },
                    |hub, comm, group| {
                        let w = register_over(hub, comm, region(me(hub))).unwrap();
                        // After the vote, the ranks that had registered have deregistered.
                        hub.all_gather(&[]).unwrap();
                        assert_eq!(group.live_windows(), 0);
                        w.unavailable().map(str::to_string)
                    },
                );
                for (rank, why) in reasons.into_iter().enumerate() {
                    let why = why.expect("windows must be off on every rank");
                    assert!(why.contains(REGISTER_STEP), "rank {rank}: {why}");
                    let detail = match how {
                        Registration::NoWindow => "NCCL returned no window",
                        _ => "fake NCCL error",
                    };
                    assert!(why.contains(detail), "rank {rank}: {why}");
                    if rank != failing {
                        assert!(why.contains(&format!("rank {failing}")), "rank {rank}: {why}");
                    }
                }
                let log = group.log();
                assert_eq!(
                    count(&log, " register 0x"),
                    3,
                    "every rank made the collective call: {log:?}"
                );
                // The two ranks that registered deregistered in the vote.
                assert_eq!(count(&log, "deregister"), 2, "{log:?}");
                assert_eq!(group.live_windows(), 0);
            }
        }
    }

    #[test]
    fn a_failed_check_on_any_rank_keeps_every_rank_out_of_the_registration() {
        for failing in 0..3 {
            let (reasons, group) = on_ranks(
                3,
                22703,
                |_| Registration::Succeeds,
                |hub, comm, _| {
                    let rank = me(hub);
                    let region = if rank == failing {
                        // A 64 KiB granularity device.
                        check_region(1 << 40, 3 << 16, (1 << 40, 3 << 16))
                    } else {
                        region(rank)
                    };
                    register_over(hub, comm, region)
                        .unwrap()
                        .unavailable()
                        .map(str::to_string)
                },
            );
            for why in reasons {
                let why = why.expect("off");
                assert!(why.contains(CHECK_STEP) && why.contains("2 MiB"), "{why}");
            }
            assert_eq!(count(&group.log(), " register 0x"), 0);
        }
    }

    #[test]
    fn different_sizes_turn_windows_off_before_registering() {
        let (reasons, group) = on_ranks(
            2,
            22703,
            |_| Registration::Succeeds,
            |hub, comm, _| {
                let ptr = (1u64 << 40) + me(hub) as u64 * (64 << 20);
                let bytes = (2 + 2 * me(hub)) << 20;
                let w = register_over(hub, comm, check_region(ptr, bytes, (ptr, bytes))).unwrap();
                w.unavailable().map(str::to_string)
            },
        );
        for why in reasons {
            let why = why.expect("off");
            assert!(why.contains("same size on every rank"), "{why}");
        }
        assert_eq!(count(&group.log(), " register 0x"), 0);
    }

    /// Memory whose release is logged, standing in for the workspace.
    struct Mapping<'a>(&'a FakeGroup, usize);
    impl Drop for Mapping<'_> {
        fn drop(&mut self) {
            self.0.note(format!("rank {} unmap", self.1));
        }
    }

    #[test]
    fn the_window_is_deregistered_before_the_memory_is_unmapped() {
        let (_, group) = on_ranks(
            2,
            22703,
            |_| Registration::Succeeds,
            |hub, comm, group| {
                let windows = register_over(hub, comm, region(me(hub))).unwrap();
                let memory = Windowed::new(Mapping(group, me(hub)), windows);
                assert!(memory.windows().unavailable().is_none());
                drop(memory);
            },
        );
        let log = group.log();
        for rank in 0..2 {
            let at = |what: &str| {
                log.iter()
                    .position(|e| e.starts_with(&format!("rank {rank} {what}")))
            };
            assert!(at("deregister").unwrap() < at("unmap").unwrap(), "{log:?}");
            assert!(at("unmap").unwrap() < at("abort").unwrap(), "{log:?}");
        }
        assert_eq!(group.live_windows(), 0);
    }

    /// The all-gather-v the fallback runs for fp4 payloads (bytes, uneven, odd, one rank
    /// empty), through the one NCCL call path on buffers inside the registered windows: every
    /// rank's output is the ranks' inputs back to back, byte for byte.
    #[test]
    fn all_gather_v_of_odd_uneven_bytes_through_the_window_path_is_byte_exact() {
        // fp4 e2m1: two values a byte; 7168-wide rows of 3, 1, 0 and 5 tokens plus an odd tail.
        let counts = [3 * 3584 + 1, 3584 - 1, 0, 5 * 3584 + 7];
        let total: usize = counts.iter().sum();
        let pattern = |rank: usize, i: usize| ((rank * 131 + i * 7 + i / 251) % 256) as u8;
        let (outputs, group) = on_ranks(
            4,
            22703,
            |_| Registration::Succeeds,
            |hub, comm, _| {
                let rank = me(hub);
                // One host allocation per rank stands in for the pool (the same size on every
                // rank, as NCCL requires): input and output in it.
                let mut pool = vec![0u8; total + total + 64];
                for (i, byte) in pool[..counts[rank]].iter_mut().enumerate() {
                    *byte = pattern(rank, i);
                }
                let base = pool.as_mut_ptr() as u64;
                let bytes = pool.len();
                let windows = register_over(hub, comm, Ok(Region { ptr: base, bytes })).unwrap();
                assert!(windows.unavailable().is_none());
                let output = base + counts[rank] as u64;
                // SAFETY: the fake reads `counts[rank]` bytes at `base` and writes `total` at
                // `output`, inside `pool`, before the group ends; the stream is never used.
                unsafe {
                    comm.all_gather_v_bytes(base, output, counts.iter().copied(), std::ptr::null_mut())
                }
                .unwrap();
                drop(windows);
                pool[counts[rank]..counts[rank] + total].to_vec()
            },
        );
        let expected: Vec<u8> = (0..4)
            .flat_map(|q| (0..counts[q]).map(move |i| pattern(q, i)))
            .collect();
        for (rank, out) in outputs.iter().enumerate() {
            assert!(out == &expected, "rank {rank}: the gathered bytes differ");
        }
        assert_eq!(group.live_windows(), 0);
    }

    #[test]
    fn the_region_must_be_the_whole_two_mib_allocation() {
        let base = 64u64 << 20;
        assert_eq!(
            check_region(base, 4 << 20, (base, 4 << 20)).unwrap(),
            Region {
                ptr: base,
                bytes: 4 << 20
            }
        );
        // A range the driver sees differently (part of a larger mapping).
        let e = check_region(base, 4 << 20, (base - (2 << 20), 6 << 20)).unwrap_err();
        assert!(e.to_string().contains("not one mapping"), "{e}");
        // A 64 KiB granularity allocation.
        let e = check_region(base, 3 << 16, (base, 3 << 16)).unwrap_err();
        assert!(e.to_string().contains("2 MiB"), "{e}");
        let e = check_region(base + 4096, 2 << 20, (base + 4096, 2 << 20)).unwrap_err();
        assert!(e.to_string().contains("2 MiB"), "{e}");
    }

    #[test]
    fn windows_off_say_why() {
        let w = Windows::off("Config::nccl_windows is false");
        assert_eq!(w.unavailable(), Some("Config::nccl_windows is false"));
        assert_eq!(w.describe(), "off (Config::nccl_windows is false)");
    }
}
