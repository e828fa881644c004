//! NCCL, used only for bootstrap and as the fallback data path: the `dlopen` table
//! ([`library`], the only NCCL FFI) and the communicators ([`comm`]).

pub(crate) mod comm;
#[cfg(test)]
pub(crate) mod fake;
pub(crate) mod library;
pub(crate) mod window;

pub use comm::{nccl_teardown_failures, SharedNcclComm};
pub use library::{nccl_library, NcclLibraryInfo};

/// Runs `calls` between `ncclGroupStart` and `ncclGroupEnd` of the NCCL this crate loaded
/// ([`nccl_library`]), ending the group whatever `calls` returns: for one thread that drives
/// the communicators of several ranks made by
/// [`Communicator::with_nccl_fallback`](crate::Communicator::with_nccl_fallback) and routes
/// calls to NCCL on all of them (NCCL requires a group there; symm-bench does it). The first
/// error wins.
pub fn nccl_group(calls: impl FnOnce() -> crate::Result<()>) -> crate::Result<()> {
    library::library()?.grouped(calls)
}
