//! NCCL, used only for bootstrap and as the fallback data path: the `dlopen` table
//! ([`library`], the only NCCL FFI) and the communicators ([`comm`]).

pub(crate) mod comm;
pub(crate) mod library;

pub use comm::nccl_teardown_failures;
pub use library::{nccl_library, NcclLibraryInfo};

use crate::error::Error;

/// Maps an error of cudarc's NCCL API (for the caller's communicator), naming the call.
pub(crate) fn cudarc_error(call: &'static str) -> impl Fn(cudarc::nccl::result::NcclError) -> Error {
    move |e| Error::Nccl {
        call,
        detail: format!("{:?} (set NCCL_DEBUG=WARN for NCCL's own account)", e.0),
    }
}
