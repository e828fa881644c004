//! NCCL, used only for bootstrap and as the fallback data path: the `dlopen` table
//! ([`library`], the only NCCL FFI) and the communicators ([`comm`]).

pub(crate) mod comm;
#[cfg(test)]
pub(crate) mod fake;
pub(crate) mod library;
pub(crate) mod window;

pub use comm::{nccl_teardown_failures, SharedNcclComm};
pub use library::{nccl_library, NcclLibraryInfo};
