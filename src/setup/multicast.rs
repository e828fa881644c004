//! The multicast (NVLS) steps of setup: the glue between the setup table and the pipeline of
//! `symmetric/multicast.rs`, run after the peer workspace is mapped (every rank reaches it
//! together: the mapping step's vote passed on every rank).

use std::sync::Arc;

use crate::bootstrap::Bootstrap;
use crate::config::{Config, Multicast};
use crate::driver::multicast::CudaMulticast;
use crate::error::{Error, Result};
use crate::kernels::registry::Kernel;
use crate::kernels::Kernels;
use crate::symmetric::multicast::{self, Outcome, Request};
use crate::symmetric::Workspace;

/// Runs the voted multicast steps with the real driver. `Off` makes no driver call at all; a
/// veto or a device without the sm_90 multimem kernel makes none either (the eligibility
/// vote fails before the attribute query).
pub(super) fn run(
    bootstrap: &dyn Bootstrap,
    config: &Config,
    ordinal: usize,
    workspace: &Workspace,
    kernels: &Kernels,
) -> Result<Outcome> {
    let layout = workspace.layout();
    let blocked = multicast::env_veto().or_else(|| {
        (!kernels.has(Kernel::InPlaceMultimem)).then(|| {
            format!("device {ordinal} has no multimem kernel (it needs compute capability 9.0 or newer)")
        })
    });
    let request = Request {
        mode: config.multicast,
        ordinal,
        memory: workspace.own_handle(),
        memory_size: layout.alloc_bytes,
        // Through the end of the low-latency slots: the multimem low-latency kernel pushes
        // its lines through the multicast address.
        needed: layout.ll_offset() + layout.ll_bytes(bootstrap.world()),
    };
    multicast::establish(bootstrap, Arc::new(CudaMulticast), request, blocked)
}

/// With `Required`, a setup that ended without the peer kernels is an error naming why.
pub(super) fn require_none(config: &Config, why: &Error) -> Result<()> {
    if config.multicast == Multicast::Required {
        return Err(Error::MulticastUnavailable {
            reason: format!("the peer kernels are not set up ({why})"),
        });
    }
    Ok(())
}
