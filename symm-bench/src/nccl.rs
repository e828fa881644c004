//! The NCCL baseline: finding libnccl and creating the communicators.

use std::sync::Arc;

use symm_allreduce::cudarc::driver::CudaStream;
use symm_allreduce::cudarc::nccl::{self, Comm};

/// NCCL communicators for the baseline, or why there are none.
pub enum Baseline {
    /// Ready; `comms.len()` is NCCL's world (1 when all ranks share one GPU).
    Ready { comms: Vec<Comm> },
    /// Skipped, with the one-line reason.
    Skipped(String),
}

impl Baseline {
    /// NCCL over `streams` (one per distinct GPU), if libnccl loads and init succeeds.
    pub fn new(streams: Vec<Arc<CudaStream>>) -> Baseline {
        if let Err(why) = library() {
            return Baseline::Skipped(why);
        }
        match Comm::from_devices(streams) {
            Ok(comms) => Baseline::Ready { comms },
            Err(e) => Baseline::Skipped(format!("ncclCommInitAll failed: {:?}", e.0)),
        }
    }

    /// A one-line description for the header and results.json.
    pub fn describe(&self) -> String {
        match self {
            Baseline::Ready { comms } if comms.len() == 1 => {
                "NCCL with world 1 (one GPU: NCCL refuses two ranks on one device)".into()
            }
            Baseline::Ready { comms } => format!("NCCL with world {}, one rank per GPU", comms.len()),
            Baseline::Skipped(why) => format!("NCCL skipped: {why}"),
        }
    }
}

/// Whether cudarc can load libnccl; if not, why (and the fix when only libnccl.so.2 exists).
pub(crate) fn library() -> Result<(), String> {
    // SAFETY: loading libnccl runs its initialisers, which have no preconditions; cudarc
    // drops the handle again.
    if unsafe { nccl::sys::is_culib_present() } {
        return Ok(());
    }
    let versioned = "libnccl.so.2";
    // SAFETY: as above; the handle is dropped at once.
    let hint = if unsafe { libloading::Library::new(versioned) }.is_ok() {
        format!(
            "; {versioned} is loadable but cudarc looks for libnccl.so: put a libnccl.so symlink to it \
             in a directory on LD_LIBRARY_PATH"
        )
    } else {
        String::new()
    };
    let tried = symm_allreduce::cudarc::get_lib_name_candidates("nccl");
    Err(format!(
        "libnccl could not be loaded (cudarc tried {} and {} other names){hint}",
        tried.first().map_or("libnccl.so", String::as_str),
        tried.len().saturating_sub(1)
    ))
}
