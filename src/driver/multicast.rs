//! NVLink multicast objects (NVLS) behind a trait, [`MulticastDriver`]: the real driver
//! ([`CudaMulticast`], a thin `unsafe fn` tier over cudarc's `driver::sys`) and a fake with
//! shared state ([`FakeMulticast`]) that enforces the driver's rules, for the tests.
//!
//! **The real implementation is compiled, never exercised on this project's machines**: creating
//! a multicast object can take a shared host's GPUs out of service, and the single-H200 machine
//! reports `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0` anyway. The only real call the test
//! suite makes is the attribute query ([`MulticastDriver::supported`]). Nothing in `tests/`,
//! `benches/` or `examples/` may name the create/add/bind entry points (a CI grep checks it).
//!
//! The rules the fake enforces (each broken rule is recorded as a *violation*, which the
//! tests require to be empty, and fails the call):
//! - sizes (create, bind, map) are multiples of the minimum multicast granularity;
//! - every device is added before any device binds memory (the real driver blocks a bind or
//!   a map of a partially populated object until all devices are added: a peer that never
//!   adds its device hangs the others);
//! - a device maps the object only after it bound its own memory;
//! - teardown in order: unmap before unbind, unbind before release; nothing leaked (handles,
//!   mappings, bindings, descriptors).
//!
//! Failure can be injected at any step on any rank ([`FakeMulticast::fail_at`]).

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::check;
use crate::error::{Error, Result};

/// A multicast object handle (`CUmemGenericAllocationHandle`).
pub(crate) type McHandle = u64;

/// Which multicast granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Granularity {
    /// `CU_MULTICAST_GRANULARITY_MINIMUM`: what sizes and offsets must be multiples of.
    Minimum,
    /// `CU_MULTICAST_GRANULARITY_RECOMMENDED`: for performance (can be 512 MiB).
    Recommended,
}

/// The steps of the multicast lifecycle, in order (also the places a failure can be injected).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum Op {
    Supported,
    Granularity,
    Create,
    Export,
    Import,
    AddDevice,
    Bind,
    Map,
    Unmap,
    Unbind,
    Release,
}

impl Op {
    /// Every step, in lifecycle order.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) const ALL: [Op; 11] = [
        Op::Supported,
        Op::Granularity,
        Op::Create,
        Op::Export,
        Op::Import,
        Op::AddDevice,
        Op::Bind,
        Op::Map,
        Op::Unmap,
        Op::Unbind,
        Op::Release,
    ];

    /// The driver function this step calls (the real one's name, for errors and logs).
    pub(crate) const fn call(self) -> &'static str {
        match self {
            Op::Supported => "cuDeviceGetAttribute(MULTICAST_SUPPORTED)",
            Op::Granularity => "cuMulticastGetGranularity",
            Op::Create => "cuMulticastCreate",
            Op::Export => "cuMemExportToShareableHandle(multicast)",
            Op::Import => "cuMemImportFromShareableHandle(multicast)",
            Op::AddDevice => "cuMulticastAddDevice",
            Op::Bind => "cuMulticastBindMem",
            Op::Map => "cuMemMap(multicast)",
            Op::Unmap => "cuMemUnmap(multicast)",
            Op::Unbind => "cuMulticastUnbind",
            Op::Release => "cuMemRelease(multicast)",
        }
    }
}

/// The multicast driver entry points the setup pipeline (`symmetric/multicast.rs`) uses.
///
/// Contract the pipeline keeps (and the fake checks): every rank adds its device before any
/// rank binds; a rank maps only after binding; it unmaps, unbinds and releases in that order,
/// and only after every rank stopped using the multicast address (a collective close).
pub(crate) trait MulticastDriver: Send + Sync {
    /// `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` of device `ordinal` is non-zero.
    fn supported(&self, ordinal: usize) -> Result<bool>;
    /// The multicast granularity for an object over `devices` devices with POSIX-fd handles.
    fn granularity(&self, ordinal: usize, devices: usize, which: Granularity) -> Result<usize>;
    /// A new multicast object of `size` bytes for `devices` devices, exportable as a POSIX fd.
    fn create(&self, devices: usize, size: usize) -> Result<McHandle>;
    /// A file descriptor for the object, to pass to the peers.
    fn export_fd(&self, mc: McHandle) -> Result<OwnedFd>;
    /// Imports an object exported by a peer (the descriptor stays the caller's).
    fn import_fd(&self, fd: BorrowedFd<'_>) -> Result<McHandle>;
    /// Adds device `ordinal` to the object.
    fn add_device(&self, mc: McHandle, ordinal: usize) -> Result<()>;
    /// Binds `size` bytes at offset 0 of the physical allocation `memory` (of `memory_size`
    /// bytes, on `ordinal`) at offset 0 of the object.
    fn bind_mem(
        &self,
        mc: McHandle,
        ordinal: usize,
        memory: u64,
        memory_size: usize,
        size: usize,
    ) -> Result<()>;
    /// Reserves an address range of `size` bytes aligned to `alignment` (the multicast
    /// granularity), maps the object there and gives `ordinal` read-write access; returns the
    /// multicast address. On failure nothing stays mapped.
    fn map(&self, mc: McHandle, ordinal: usize, size: usize, alignment: usize) -> Result<u64>;
    /// Unmaps what [`MulticastDriver::map`] mapped and frees the address range.
    fn unmap(&self, va: u64, size: usize) -> Result<()>;
    /// Unbinds device `ordinal`'s memory (`size` bytes at offset 0).
    fn unbind(&self, mc: McHandle, ordinal: usize, size: usize) -> Result<()>;
    /// Releases this process's handle of the object.
    fn release(&self, mc: McHandle) -> Result<()>;
}

// ---------------------------------------------------------------------------------------
// The real driver: a thin unsafe tier, one function per driver call.

const FD_HANDLE: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

fn object_properties(devices: usize, size: usize) -> sys::CUmulticastObjectProp {
    // SAFETY: a plain C struct for which all-zero bytes are valid (flags 0 is the default).
    let mut prop: sys::CUmulticastObjectProp = unsafe { std::mem::zeroed() };
    prop.numDevices = devices as _;
    prop.size = size;
    prop.handleTypes = FD_HANDLE.0 as _;
    prop
}

fn device(ordinal: usize) -> Result<sys::CUdevice> {
    let mut dev: sys::CUdevice = 0;
    check(
        // SAFETY: valid out-pointer; an invalid ordinal is an error code, not UB.
        unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) },
        "cuDeviceGet",
    )?;
    Ok(dev)
}

/// `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` of `ordinal` (the one real multicast-related call
/// this project's machines ever make).
///
/// # Safety
/// The driver is initialised (a context exists in this process).
pub(crate) unsafe fn attribute_supported(ordinal: usize) -> Result<bool> {
    let dev = device(ordinal)?;
    let mut v = 0i32;
    check(
        // SAFETY: valid out-pointer and device; the caller initialised the driver.
        unsafe {
            sys::cuDeviceGetAttribute(
                &mut v,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED,
                dev,
            )
        },
        "cuDeviceGetAttribute(MULTICAST_SUPPORTED)",
    )?;
    Ok(v != 0)
}

/// # Safety
/// The driver is initialised and the device supports multicast.
pub(crate) unsafe fn get_granularity(devices: usize, which: Granularity) -> Result<usize> {
    let prop = object_properties(devices, 0);
    let flag = match which {
        Granularity::Minimum => sys::CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_MINIMUM,
        Granularity::Recommended => sys::CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_RECOMMENDED,
    };
    let mut g = 0usize;
    check(
        // SAFETY: valid out-pointer and property struct.
        unsafe { sys::cuMulticastGetGranularity(&mut g, &prop, flag) },
        Op::Granularity.call(),
    )?;
    Ok(g.max(1))
}

/// # Safety
/// Every device of the group supports multicast (the attribute was voted on); `size` is a
/// multiple of the minimum granularity.
pub(crate) unsafe fn create(devices: usize, size: usize) -> Result<McHandle> {
    let prop = object_properties(devices, size);
    let mut h: McHandle = 0;
    check(
        // SAFETY: valid out-pointer and properties.
        unsafe { sys::cuMulticastCreate(&mut h, &prop) },
        Op::Create.call(),
    )?;
    Ok(h)
}

/// # Safety
/// `mc` is a live multicast handle created with POSIX-fd handle types.
pub(crate) unsafe fn export_fd(mc: McHandle) -> Result<OwnedFd> {
    let mut fd: i32 = -1;
    check(
        // SAFETY: for POSIX fds the shareable handle is an int written to the out-pointer.
        unsafe { sys::cuMemExportToShareableHandle((&mut fd as *mut i32).cast(), mc, FD_HANDLE, 0) },
        Op::Export.call(),
    )?;
    // SAFETY: the driver returned a new descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// # Safety
/// `fd` is a descriptor exported from a multicast object.
pub(crate) unsafe fn import_fd(fd: BorrowedFd<'_>) -> Result<McHandle> {
    let mut h: McHandle = 0;
    check(
        // SAFETY: for POSIX fds the OS handle argument is the descriptor value; it is open for
        // the call.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                FD_HANDLE,
            )
        },
        Op::Import.call(),
    )?;
    Ok(h)
}

/// # Safety
/// `mc` is live; every rank adds its device before any rank binds (or the binds block).
pub(crate) unsafe fn add_device(mc: McHandle, ordinal: usize) -> Result<()> {
    let dev = device(ordinal)?;
    check(
        // SAFETY: live handle, valid device.
        unsafe { sys::cuMulticastAddDevice(mc, dev) },
        Op::AddDevice.call(),
    )
}

/// # Safety
/// Every device was added to `mc` (by every rank); `memory` is a live physical allocation of
/// at least `size` bytes on `ordinal`; `size` is a multiple of the minimum granularity.
pub(crate) unsafe fn bind_mem(mc: McHandle, memory: u64, size: usize) -> Result<()> {
    check(
        // SAFETY: per the caller's contract.
        unsafe { sys::cuMulticastBindMem(mc, 0, memory, 0, size, 0) },
        Op::Bind.call(),
    )
}

/// # Safety
/// This device bound its memory to `mc`; `size` is the bound size.
pub(crate) unsafe fn map(mc: McHandle, ordinal: usize, size: usize, alignment: usize) -> Result<u64> {
    let mut va: sys::CUdeviceptr = 0;
    check(
        // SAFETY: valid out-pointer; the alignment is a granularity (a power of two).
        unsafe { sys::cuMemAddressReserve(&mut va, size, alignment, 0, 0) },
        "cuMemAddressReserve(multicast)",
    )?;
    // SAFETY: the range is ours and unmapped; the handle is live.
    if let Err(e) = check(unsafe { sys::cuMemMap(va, size, 0, mc, 0) }, Op::Map.call()) {
        // SAFETY: the reservation made above, freed once.
        unsafe { sys::cuMemAddressFree(va, size) };
        return Err(e);
    }
    let desc = sys::CUmemAccessDesc {
        location: super::vmm::device_location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    if let Err(e) = check(
        // SAFETY: the range was just mapped; one valid descriptor.
        unsafe { sys::cuMemSetAccess(va, size, &desc, 1) },
        "cuMemSetAccess(multicast)",
    ) {
        // SAFETY: undo the mapping and the reservation above, once each.
        unsafe {
            sys::cuMemUnmap(va, size);
            sys::cuMemAddressFree(va, size);
        }
        return Err(e);
    }
    Ok(va)
}

/// # Safety
/// `va`/`size` is exactly a range [`map`] returned, and no kernel on any rank still uses it.
pub(crate) unsafe fn unmap(va: u64, size: usize) -> Result<()> {
    // SAFETY: per the caller's contract.
    let unmapped = check(unsafe { sys::cuMemUnmap(va, size) }, Op::Unmap.call());
    // SAFETY: the reservation of that range, freed once.
    let freed = check(
        unsafe { sys::cuMemAddressFree(va, size) },
        "cuMemAddressFree(multicast)",
    );
    unmapped.and(freed)
}

/// # Safety
/// This device bound `size` bytes at offset 0 and unmapped the object.
pub(crate) unsafe fn unbind(mc: McHandle, ordinal: usize, size: usize) -> Result<()> {
    let dev = device(ordinal)?;
    check(
        // SAFETY: per the caller's contract.
        unsafe { sys::cuMulticastUnbind(mc, dev, 0, size) },
        Op::Unbind.call(),
    )
}

/// # Safety
/// `mc` is live, released once, after unbind.
pub(crate) unsafe fn release(mc: McHandle) -> Result<()> {
    // SAFETY: per the caller's contract.
    check(unsafe { sys::cuMemRelease(mc) }, Op::Release.call())
}

/// The real driver. Only the attribute query ever runs on this project's machines.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct CudaMulticast;

impl MulticastDriver for CudaMulticast {
    fn supported(&self, ordinal: usize) -> Result<bool> {
        // SAFETY: setup calls this after creating the rank's context.
        unsafe { attribute_supported(ordinal) }
    }
    fn granularity(&self, _ordinal: usize, devices: usize, which: Granularity) -> Result<usize> {
        // SAFETY: the pipeline calls this only after every rank's attribute vote passed.
        unsafe { get_granularity(devices, which) }
    }
    fn create(&self, devices: usize, size: usize) -> Result<McHandle> {
        // SAFETY: attribute voted on; the pipeline rounds `size` to the agreed granularity.
        unsafe { create(devices, size) }
    }
    fn export_fd(&self, mc: McHandle) -> Result<OwnedFd> {
        // SAFETY: `mc` came from `create` with POSIX-fd handles.
        unsafe { export_fd(mc) }
    }
    fn import_fd(&self, fd: BorrowedFd<'_>) -> Result<McHandle> {
        // SAFETY: the descriptor came from rank 0's export.
        unsafe { import_fd(fd) }
    }
    fn add_device(&self, mc: McHandle, ordinal: usize) -> Result<()> {
        // SAFETY: live handle; the pipeline votes after every rank's add, before any bind.
        unsafe { add_device(mc, ordinal) }
    }
    fn bind_mem(
        &self,
        mc: McHandle,
        _ordinal: usize,
        memory: u64,
        memory_size: usize,
        size: usize,
    ) -> Result<()> {
        if size > memory_size {
            return Err(Error::InvalidConfig(format!(
                "multicast bind of {size} bytes over an allocation of {memory_size}"
            )));
        }
        // SAFETY: the add-device vote passed; `memory` is the rank's live workspace allocation.
        unsafe { bind_mem(mc, memory, size) }
    }
    fn map(&self, mc: McHandle, ordinal: usize, size: usize, alignment: usize) -> Result<u64> {
        // SAFETY: the bind vote passed.
        unsafe { map(mc, ordinal, size, alignment) }
    }
    fn unmap(&self, va: u64, size: usize) -> Result<()> {
        // SAFETY: called by the pipeline's teardown after the collective close.
        unsafe { unmap(va, size) }
    }
    fn unbind(&self, mc: McHandle, ordinal: usize, size: usize) -> Result<()> {
        // SAFETY: after unmap, as the pipeline's teardown orders it.
        unsafe { unbind(mc, ordinal, size) }
    }
    fn release(&self, mc: McHandle) -> Result<()> {
        // SAFETY: once, after unbind.
        unsafe { release(mc) }
    }
}

/// The real attribute query and nothing else: every other entry point refuses without calling
/// the driver. For checks on machines that must never create a multicast object (the GPU
/// test of `tests/multicast.rs`): even where the attribute is 1, this cannot go further.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct AttributeOnly;

fn refused(op: Op) -> Error {
    Error::MulticastUnavailable {
        reason: format!("{} refused: this is the attribute-only probe", op.call()),
    }
}

impl MulticastDriver for AttributeOnly {
    fn supported(&self, ordinal: usize) -> Result<bool> {
        CudaMulticast.supported(ordinal)
    }
    fn granularity(&self, _: usize, _: usize, _: Granularity) -> Result<usize> {
        Err(refused(Op::Granularity))
    }
    fn create(&self, _: usize, _: usize) -> Result<McHandle> {
        Err(refused(Op::Create))
    }
    fn export_fd(&self, _: McHandle) -> Result<OwnedFd> {
        Err(refused(Op::Export))
    }
    fn import_fd(&self, _: BorrowedFd<'_>) -> Result<McHandle> {
        Err(refused(Op::Import))
    }
    fn add_device(&self, _: McHandle, _: usize) -> Result<()> {
        Err(refused(Op::AddDevice))
    }
    fn bind_mem(&self, _: McHandle, _: usize, _: u64, _: usize, _: usize) -> Result<()> {
        Err(refused(Op::Bind))
    }
    fn map(&self, _: McHandle, _: usize, _: usize, _: usize) -> Result<u64> {
        Err(refused(Op::Map))
    }
    fn unmap(&self, _: u64, _: usize) -> Result<()> {
        Err(refused(Op::Unmap))
    }
    fn unbind(&self, _: McHandle, _: usize, _: usize) -> Result<()> {
        Err(refused(Op::Unbind))
    }
    fn release(&self, _: McHandle) -> Result<()> {
        Err(refused(Op::Release))
    }
}

#[cfg(test)]
pub(crate) use fake::FakeMulticast;

/// The fake (tests only): every object is a memfd holding its record, so export/import pass a
/// real descriptor (SCM_RIGHTS works on it) and processes share the object's state.
#[cfg(test)]
mod fake {
    use super::*;
    use std::collections::HashMap;
    use std::fs::File;
    use std::os::fd::AsFd;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    use std::sync::{Arc, Mutex};

    /// The record of a fake object, stored at offset 0 of its memfd (little-endian u64s).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    struct Record {
        magic: u64,
        size: u64,
        devices: u64,
        /// Bitmask of added device ordinals (fake ordinal = rank-chosen, < 64).
        added: u64,
        /// Bitmask of ordinals with bound memory.
        bound: u64,
        /// Live mappings over all processes.
        mapped: u64,
        /// Live handles (create + imports − releases) over all processes.
        handles: u64,
    }

    const MAGIC: u64 = 0x4d43_4641_4b45_0001; // "MCFAKE" v1
    const RECORD_WORDS: usize = 7;

    impl Record {
        fn read(f: &File) -> Result<Record> {
            let mut buf = [0u8; RECORD_WORDS * 8];
            // Positional: every process holding the memfd shares one file offset.
            f.read_exact_at(&mut buf, 0).map_err(io_error)?;
            let w = |i: usize| u64::from_le_bytes(buf[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            let r = Record {
                magic: w(0),
                size: w(1),
                devices: w(2),
                added: w(3),
                bound: w(4),
                mapped: w(5),
                handles: w(6),
            };
            if r.magic != MAGIC {
                return Err(Error::InvalidConfig(
                    "fake multicast: descriptor is not a fake multicast object".into(),
                ));
            }
            Ok(r)
        }
        fn write(&self, f: &File) -> Result<()> {
            let mut buf = Vec::with_capacity(RECORD_WORDS * 8);
            for v in [
                self.magic,
                self.size,
                self.devices,
                self.added,
                self.bound,
                self.mapped,
                self.handles,
            ] {
                buf.extend_from_slice(&v.to_le_bytes());
            }
            f.write_all_at(&buf, 0).map_err(io_error)
        }
    }

    fn io_error(e: std::io::Error) -> Error {
        Error::InvalidConfig(format!("fake multicast: {e}"))
    }

    /// The fake's failure: worded like a driver error, without cudarc's `DriverError` (whose
    /// message asks the driver library for the error string).
    fn fake_error(rank: usize, op: Op, what: &str) -> Error {
        Error::Unsupported {
            ordinal: rank,
            reason: format!("{} failed (fake driver: {what})", op.call()),
        }
    }

    /// This process's side of the fake (shared by the ranks of one process).
    #[derive(Debug, Default)]
    struct Local {
        /// Live handles of this process: handle → the object's memfd.
        handles: HashMap<McHandle, File>,
        /// Live mappings: address → (handle, size, ordinal).
        mappings: HashMap<u64, (McHandle, usize, usize)>,
        /// Every call: (rank, step).
        calls: Vec<(usize, Op)>,
        /// Broken rules (a correct pipeline leaves this empty).
        violations: Vec<String>,
        /// Injected failures: (step, rank).
        fail: Vec<(Op, usize)>,
        next_handle: u64,
        next_va: u64,
    }

    #[derive(Debug)]
    struct Shared {
        local: Mutex<Local>,
        supported: bool,
        min_granularity: usize,
        recommended_granularity: usize,
    }

    /// A fake multicast driver. Clone one view per rank with [`FakeMulticast::for_rank`]; all
    /// views (and, through the memfds, other processes' fakes) share the objects' state.
    #[derive(Debug, Clone)]
    pub(crate) struct FakeMulticast {
        shared: Arc<Shared>,
        rank: usize,
    }

    impl FakeMulticast {
        /// A fake whose devices report the attribute `supported`, with these granularities.
        pub(crate) fn new(supported: bool, min_granularity: usize, recommended_granularity: usize) -> Self {
            FakeMulticast {
                shared: Arc::new(Shared {
                    local: Mutex::new(Local {
                        next_handle: 0x1000,
                        next_va: 0x7f00_0000_0000,
                        ..Local::default()
                    }),
                    supported,
                    min_granularity,
                    recommended_granularity,
                }),
                rank: 0,
            }
        }

        /// The view rank `rank` calls through.
        pub(crate) fn for_rank(&self, rank: usize) -> Self {
            FakeMulticast {
                shared: Arc::clone(&self.shared),
                rank,
            }
        }

        /// Makes step `op` fail on rank `rank` (every time it is called there).
        pub(crate) fn fail_at(&self, op: Op, rank: usize) {
            self.local().fail.push((op, rank));
        }

        /// Every call made so far, as (rank, step).
        pub(crate) fn calls(&self) -> Vec<(usize, Op)> {
            self.local().calls.clone()
        }

        /// Rules broken so far.
        pub(crate) fn violations(&self) -> Vec<String> {
            self.local().violations.clone()
        }

        /// What this process still holds: (handles, mappings).
        pub(crate) fn held(&self) -> (usize, usize) {
            let l = self.local();
            (l.handles.len(), l.mappings.len())
        }

        /// The shared record of an object this process holds a handle to: (added mask, bound
        /// mask, live mappings, live handles) over every process.
        pub(crate) fn object_state(&self, mc: McHandle) -> Option<(u64, u64, u64, u64)> {
            let l = self.local();
            let f = l.handles.get(&mc)?;
            Record::read(f)
                .ok()
                .map(|r| (r.added, r.bound, r.mapped, r.handles))
        }

        fn local(&self) -> std::sync::MutexGuard<'_, Local> {
            // A panicking test thread poisons the lock; the state is still meaningful.
            self.shared.local.lock().unwrap_or_else(|p| p.into_inner())
        }

        /// Logs the call and applies an injected failure.
        fn enter(&self, l: &mut Local, op: Op) -> Result<()> {
            l.calls.push((self.rank, op));
            if op != Op::Supported && !self.shared.supported {
                l.violations.push(format!(
                    "rank {}: {} called although the attribute is 0",
                    self.rank,
                    op.call()
                ));
            }
            if l.fail.contains(&(op, self.rank)) {
                return Err(fake_error(self.rank, op, "injected failure"));
            }
            Ok(())
        }

        fn violation(&self, l: &mut Local, op: Op, what: String) -> Error {
            l.violations
                .push(format!("rank {}: {}: {what}", self.rank, op.call()));
            fake_error(self.rank, op, &what)
        }

        fn check_multiple(&self, l: &mut Local, op: Op, size: usize) -> Result<()> {
            if size == 0 || size % self.shared.min_granularity != 0 {
                return Err(self.violation(
                    l,
                    op,
                    format!(
                        "size {size} is not a multiple of the granularity {}",
                        self.shared.min_granularity
                    ),
                ));
            }
            Ok(())
        }

        /// Runs `f` on the object's record under an exclusive lock of its memfd.
        fn with_record<T>(
            &self,
            l: &mut Local,
            op: Op,
            mc: McHandle,
            f: impl FnOnce(&mut Record) -> std::result::Result<T, String>,
        ) -> Result<T> {
            let Some(file) = l.handles.get(&mc) else {
                return Err(self.violation(l, op, format!("unknown or released handle {mc:#x}")));
            };
            // A lock of its own: flock locks belong to the open file description, which a
            // dup'd or SCM_RIGHTS-passed descriptor shares with every other process holding
            // the object, so the lock must be taken through a fresh one.
            let path = format!("/proc/self/fd/{}", file.as_raw_fd());
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .map_err(io_error)?;
            file.lock().map_err(io_error)?;
            let outcome = Record::read(&file).and_then(|mut r| match f(&mut r) {
                Ok(v) => r.write(&file).map(|()| Ok(v)),
                Err(why) => Ok(Err(why)),
            });
            let _ = file.unlock();
            match outcome? {
                Ok(v) => Ok(v),
                Err(why) => Err(self.violation(l, op, why)),
            }
        }

        fn new_handle(l: &mut Local, file: File) -> McHandle {
            l.next_handle += 1;
            let h = l.next_handle;
            l.handles.insert(h, file);
            h
        }
    }

    fn bit(ordinal: usize) -> u64 {
        1u64 << (ordinal % 64)
    }

    impl MulticastDriver for FakeMulticast {
        fn supported(&self, _ordinal: usize) -> Result<bool> {
            let mut l = self.local();
            self.enter(&mut l, Op::Supported)?;
            Ok(self.shared.supported)
        }

        fn granularity(&self, _ordinal: usize, _devices: usize, which: Granularity) -> Result<usize> {
            let mut l = self.local();
            self.enter(&mut l, Op::Granularity)?;
            Ok(match which {
                Granularity::Minimum => self.shared.min_granularity,
                Granularity::Recommended => self.shared.recommended_granularity,
            })
        }

        fn create(&self, devices: usize, size: usize) -> Result<McHandle> {
            let mut l = self.local();
            self.enter(&mut l, Op::Create)?;
            self.check_multiple(&mut l, Op::Create, size)?;
            let fd = rustix::fs::memfd_create("symm-fake-multicast", rustix::fs::MemfdFlags::CLOEXEC)
                .map_err(|e| io_error(e.into()))?;
            let file = File::from(fd);
            Record {
                magic: MAGIC,
                size: size as u64,
                devices: devices as u64,
                handles: 1,
                ..Record::default()
            }
            .write(&file)?;
            Ok(Self::new_handle(&mut l, file))
        }

        fn export_fd(&self, mc: McHandle) -> Result<OwnedFd> {
            let mut l = self.local();
            self.enter(&mut l, Op::Export)?;
            match l.handles.get(&mc) {
                Some(f) => f.as_fd().try_clone_to_owned().map_err(io_error),
                None => Err(self.violation(&mut l, Op::Export, format!("unknown handle {mc:#x}"))),
            }
        }

        fn import_fd(&self, fd: BorrowedFd<'_>) -> Result<McHandle> {
            let mut l = self.local();
            self.enter(&mut l, Op::Import)?;
            let file = File::from(fd.try_clone_to_owned().map_err(io_error)?);
            Record::read(&file)?;
            let h = Self::new_handle(&mut l, file);
            self.with_record(&mut l, Op::Import, h, |r| {
                r.handles += 1;
                Ok(())
            })?;
            Ok(h)
        }

        fn add_device(&self, mc: McHandle, ordinal: usize) -> Result<()> {
            let mut l = self.local();
            self.enter(&mut l, Op::AddDevice)?;
            self.with_record(&mut l, Op::AddDevice, mc, |r| {
                if r.bound != 0 {
                    return Err("a device was added after memory was bound".into());
                }
                if r.added & bit(ordinal) != 0 {
                    return Err(format!("device {ordinal} added twice"));
                }
                if u64::from(r.added.count_ones()) >= r.devices {
                    return Err(format!(
                        "more than the {} devices the object was created for",
                        r.devices
                    ));
                }
                r.added |= bit(ordinal);
                Ok(())
            })
        }

        fn bind_mem(
            &self,
            mc: McHandle,
            ordinal: usize,
            memory: u64,
            memory_size: usize,
            size: usize,
        ) -> Result<()> {
            let mut l = self.local();
            self.enter(&mut l, Op::Bind)?;
            self.check_multiple(&mut l, Op::Bind, size)?;
            if memory == 0 || size > memory_size {
                return Err(self.violation(
                    &mut l,
                    Op::Bind,
                    format!("bind of {size} bytes over allocation {memory:#x} of {memory_size}"),
                ));
            }
            self.with_record(&mut l, Op::Bind, mc, |r| {
                if u64::from(r.added.count_ones()) != r.devices {
                    return Err(format!(
                        "bind before every device was added ({} of {}): the real driver would block",
                        r.added.count_ones(),
                        r.devices
                    ));
                }
                if r.added & bit(ordinal) == 0 || r.bound & bit(ordinal) != 0 {
                    return Err(format!("device {ordinal} not added, or bound twice"));
                }
                if size as u64 > r.size {
                    return Err(format!("bind of {size} bytes into an object of {}", r.size));
                }
                r.bound |= bit(ordinal);
                Ok(())
            })
        }

        fn map(&self, mc: McHandle, ordinal: usize, size: usize, alignment: usize) -> Result<u64> {
            let mut l = self.local();
            self.enter(&mut l, Op::Map)?;
            self.check_multiple(&mut l, Op::Map, size)?;
            if alignment == 0 || alignment % self.shared.min_granularity != 0 {
                let why = format!("alignment {alignment} is not a granularity multiple");
                return Err(self.violation(&mut l, Op::Map, why));
            }
            self.with_record(&mut l, Op::Map, mc, |r| {
                if r.bound & bit(ordinal) == 0 {
                    return Err(format!("device {ordinal} maps before binding its memory"));
                }
                r.mapped += 1;
                Ok(())
            })?;
            l.next_va += 1 << 32;
            let va = l.next_va;
            l.mappings.insert(va, (mc, size, ordinal));
            Ok(va)
        }

        fn unmap(&self, va: u64, size: usize) -> Result<()> {
            let mut l = self.local();
            self.enter(&mut l, Op::Unmap)?;
            match l.mappings.remove(&va) {
                Some((mc, mapped, _)) if mapped == size => self.with_record(&mut l, Op::Unmap, mc, |r| {
                    r.mapped -= 1;
                    Ok(())
                }),
                other => Err(self.violation(
                    &mut l,
                    Op::Unmap,
                    format!("unmap of {va:#x}+{size}, which is not a mapping ({other:?})"),
                )),
            }
        }

        fn unbind(&self, mc: McHandle, ordinal: usize, _size: usize) -> Result<()> {
            let mut l = self.local();
            self.enter(&mut l, Op::Unbind)?;
            if l.mappings.values().any(|(h, _, o)| *h == mc && *o == ordinal) {
                return Err(self.violation(
                    &mut l,
                    Op::Unbind,
                    "unbind while the object is still mapped".into(),
                ));
            }
            self.with_record(&mut l, Op::Unbind, mc, |r| {
                if r.bound & bit(ordinal) == 0 {
                    return Err(format!("device {ordinal} unbinds memory it never bound"));
                }
                r.bound &= !bit(ordinal);
                Ok(())
            })
        }

        fn release(&self, mc: McHandle) -> Result<()> {
            let mut l = self.local();
            self.enter(&mut l, Op::Release)?;
            if l.mappings.values().any(|(h, _, _)| *h == mc) {
                return Err(self.violation(&mut l, Op::Release, "release while still mapped".into()));
            }
            self.with_record(&mut l, Op::Release, mc, |r| {
                r.handles -= 1;
                Ok(())
            })?;
            l.handles.remove(&mc);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn the_fake_enforces_the_order() {
        let fake = FakeMulticast::new(true, 4096, 8192);
        let (r0, r1) = (fake.for_rank(0), fake.for_rank(1));
        assert!(r0.create(2, 1000).is_err(), "not a granularity multiple");
        assert_eq!(fake.violations().len(), 1);
        let mc = r0.create(2, 8192).unwrap();
        let fd = r0.export_fd(mc).unwrap();
        let mc1 = r1.import_fd(fd.as_fd()).unwrap();
        drop(fd);
        r0.add_device(mc, 0).unwrap();
        assert!(
            r0.bind_mem(mc, 0, 1, 8192, 8192).is_err(),
            "bind before every add"
        );
        assert!(r0.map(mc, 0, 8192, 4096).is_err(), "map before bind");
        r1.add_device(mc1, 1).unwrap();
        r0.bind_mem(mc, 0, 1, 8192, 8192).unwrap();
        r1.bind_mem(mc1, 1, 2, 8192, 8192).unwrap();
        let va = r0.map(mc, 0, 8192, 4096).unwrap();
        assert!(r0.unbind(mc, 0, 8192).is_err(), "unbind while mapped");
        assert!(r0.release(mc).is_err(), "release while mapped");
        assert_eq!(fake.object_state(mc), Some((0b11, 0b11, 1, 2)));
        r0.unmap(va, 8192).unwrap();
        r0.unbind(mc, 0, 8192).unwrap();
        r1.unbind(mc1, 1, 8192).unwrap();
        r0.release(mc).unwrap();
        assert_eq!(fake.object_state(mc1), Some((0b11, 0, 0, 1)));
        r1.release(mc1).unwrap();
        assert_eq!(fake.held(), (0, 0));
        assert_eq!(fake.violations().len(), 5, "{:?}", fake.violations());
    }

    #[test]
    fn an_injected_failure_fails_only_that_rank_and_step() {
        let fake = FakeMulticast::new(true, 4096, 4096);
        fake.fail_at(Op::Create, 1);
        assert!(fake.for_rank(1).create(2, 4096).is_err());
        let mc = fake.for_rank(0).create(2, 4096).unwrap();
        fake.for_rank(0).release(mc).unwrap();
        assert!(fake.violations().is_empty());
        assert_eq!(fake.held(), (0, 0));
    }
}
