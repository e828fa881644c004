//! Virtual memory management: physical allocations that can be exported as POSIX file
//! descriptors, imported by peers, and mapped side by side into one address reservation.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::check;
use crate::error::Result;

const FD_HANDLE: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// A device location. Written through a helper because the binding's layout of
/// `CUmemLocation` differs between CUDA versions (a plain `id` up to 13.1, an anonymous
/// union from 13.2); in every version the id is the `int` right after `type_`.
pub(super) fn device_location(ordinal: usize) -> sys::CUmemLocation {
    // SAFETY: CUmemLocation is a plain C struct for which all-zero bytes are valid.
    let mut location: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    let id_offset = std::mem::size_of::<sys::CUmemLocationType>();
    // SAFETY: `id` (or the union holding it) starts at `id_offset` and is a 4-byte int
    // inside the struct, which is at least 8 bytes long.
    unsafe {
        (&mut location as *mut sys::CUmemLocation)
            .cast::<u8>()
            .add(id_offset)
            .cast::<i32>()
            .write_unaligned(ordinal as i32)
    };
    location
}

fn allocation_properties(ordinal: usize) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct; zero is the documented default for
    // every field not set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = FD_HANDLE;
    prop.location = device_location(ordinal);
    prop
}

/// The recommended allocation granularity of exportable device memory on `ordinal`.
pub(crate) fn granularity(ordinal: usize) -> Result<usize> {
    let prop = allocation_properties(ordinal);
    let mut g = 0usize;
    check(
        // SAFETY: valid out-pointer and property struct.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        },
        "cuMemGetAllocationGranularity",
    )?;
    Ok(g.max(1))
}

/// A physical allocation handle (created here or imported from a peer). Released on drop;
/// the memory itself lives until every mapping of it is gone too.
#[derive(Debug)]
pub(crate) struct Allocation {
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
}

impl Allocation {
    /// `size` bytes on device `ordinal` (a multiple of [`granularity`]), exportable as a
    /// POSIX file descriptor.
    pub(crate) fn create(ordinal: usize, size: usize) -> Result<Self> {
        let prop = allocation_properties(ordinal);
        let mut handle = 0;
        // SAFETY: valid out-pointer and properties; size is granularity-aligned by the caller.
        let code = unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) };
        check(code, "cuMemCreate")?;
        Ok(Allocation { handle, size })
    }

    /// The driver handle (for binding to a multicast object).
    pub(crate) fn handle(&self) -> u64 {
        self.handle
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// A file descriptor for this allocation, to send to peers (SCM_RIGHTS) or import in
    /// this process.
    pub(crate) fn export_fd(&self) -> Result<OwnedFd> {
        let mut fd: i32 = -1;
        check(
            // SAFETY: for POSIX_FILE_DESCRIPTOR the shareable handle is an `int` written to the
            // out-pointer.
            unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut i32).cast::<c_void>(),
                    self.handle,
                    FD_HANDLE,
                    0,
                )
            },
            "cuMemExportToShareableHandle",
        )?;
        // SAFETY: the driver returned a new descriptor that nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Imports a peer's allocation of `size` bytes from its file descriptor. The descriptor
    /// stays owned by the caller (the driver duplicates what it needs).
    pub(crate) fn import_fd(fd: BorrowedFd<'_>, size: usize) -> Result<Self> {
        let mut handle = 0;
        check(
            // SAFETY: for POSIX fds the "OS handle" argument is the descriptor value itself,
            // cast to a pointer, and the descriptor is open for the duration of the call.
            unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut handle,
                    fd.as_raw_fd() as usize as *mut c_void,
                    FD_HANDLE,
                )
            },
            "cuMemImportFromShareableHandle",
        )?;
        Ok(Allocation { handle, size })
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: the handle came from cuMemCreate/cuMemImportFromShareableHandle and is
        // released exactly once. Drop cannot report a failure.
        unsafe { sys::cuMemRelease(self.handle) };
    }
}

/// One address reservation of `allocations.len() × stride` bytes with allocation q mapped at
/// `base + q·stride`, readable and writable by one device. Unmapped and freed on drop.
#[derive(Debug)]
pub(crate) struct PeerMapping {
    base: u64,
    stride: usize,
    mapped: usize,
    reserved: usize,
}

impl PeerMapping {
    pub(crate) fn new(allocations: &[&Allocation], stride: usize, device: usize) -> Result<Self> {
        let reserved = stride * allocations.len();
        let mut base: sys::CUdeviceptr = 0;
        check(
            // SAFETY: valid out-pointer; alignment 0 means the allocation granularity.
            unsafe { sys::cuMemAddressReserve(&mut base, reserved, 0, 0, 0) },
            "cuMemAddressReserve",
        )?;
        let mut mapping = PeerMapping {
            base,
            stride,
            mapped: 0,
            reserved,
        };
        for (q, a) in allocations.iter().enumerate() {
            debug_assert!(a.size() <= stride);
            check(
                // SAFETY: the range lies inside our reservation and is not mapped yet; the
                // handle is live for the call (the mapping keeps the memory alive after).
                unsafe { sys::cuMemMap(base + (q * stride) as u64, a.size(), 0, a.handle, 0) },
                "cuMemMap",
            )?;
            // Drop unmaps exactly the first `mapped` slots.
            mapping.mapped = q + 1;
            let desc = sys::CUmemAccessDesc {
                location: device_location(device),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            check(
                // SAFETY: the range was just mapped; one valid descriptor.
                unsafe { sys::cuMemSetAccess(base + (q * stride) as u64, a.size(), &desc, 1) },
                "cuMemSetAccess",
            )?;
        }
        Ok(mapping)
    }

    /// Address of allocation 0; allocation q is at `base() + q·stride`.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }
}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        for q in 0..self.mapped {
            // SAFETY: slot q was mapped with this exact range by `new` and is unmapped once.
            unsafe { sys::cuMemUnmap(self.base + (q * self.stride) as u64, self.stride) };
        }
        // SAFETY: the reservation made in `new`, freed once after its mappings are gone.
        unsafe { sys::cuMemAddressFree(self.base, self.reserved) };
    }
}

/// The base and size of the mapping that holds `ptr` (`cuMemGetAddressRange`).
pub(crate) fn address_range(ptr: u64) -> Result<(u64, usize)> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    check(
        // SAFETY: valid out-pointers; any address is accepted (an unmapped one is an error).
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) },
        "cuMemGetAddressRange",
    )?;
    Ok((base, size))
}

/// Copies `bytes` at `ptr` to the host (synchronous; test hooks only).
pub(crate) fn read(ptr: u64, bytes: usize) -> Result<Vec<u8>> {
    let mut host = vec![0u8; bytes];
    // SAFETY: the caller passes a mapped device range of `bytes`; `host` holds as many.
    let code = unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr, bytes) };
    check(code, "cuMemcpyDtoH")?;
    Ok(host)
}

/// Sets `bytes` at `ptr` to `byte` (synchronous; setup only).
pub(crate) fn fill(ptr: u64, byte: u8, bytes: usize) -> Result<()> {
    // SAFETY: the caller passes a mapped, writable device range.
    let code = unsafe { sys::cuMemsetD8_v2(ptr, byte, bytes) };
    check(code, "cuMemsetD8")
}
