//! How ranks exchange bytes and file descriptors during setup.
//!
//! Setup is collective: every rank runs the same steps in the same order, and each risky
//! step ends in an all-gathered vote, so a failure on one rank makes every rank return an
//! error (or fall back) together instead of leaving the others waiting.
//!
//! Three implementations: [`LocalHub`] (threads of one process), [`SocketStore`] (processes
//! on one host, over a Unix socket) and [`NcclBootstrap`] (over an existing NCCL
//! communicator).

mod local;
pub(crate) mod nccl;
pub(crate) mod socket;
#[doc(hidden)]
pub mod wire;

use std::os::fd::{BorrowedFd, OwnedFd};

pub use local::LocalHub;
pub use nccl::{nccl_library, nccl_teardown_failures, NcclBootstrap, NcclLibraryInfo};
pub use socket::{SocketStore, StoreAddress};
pub use wire::{PeerCheck, PeerCredentials, StoreOptions};

use crate::error::{Error, Result};

/// A channel between the ranks of one group, used only at setup.
pub trait Bootstrap {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Every rank contributes `bytes`; returns every rank's contribution, indexed by rank.
    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Every rank contributes one descriptor; returns a descriptor for every rank's
    /// (this rank's own included), indexed by rank.
    fn all_gather_fds(&self, fd: BorrowedFd<'_>) -> Result<Vec<OwnedFd>>;
}

/// Every rank reports whether `step` succeeded here. Returns this rank's value if every rank
/// succeeded, this rank's error if it failed, or [`Error::PeerSetupFailed`] naming the first
/// rank that failed.
pub(crate) fn vote<T>(bootstrap: &dyn Bootstrap, step: &'static str, outcome: Result<T>) -> Result<T> {
    vote_soft(bootstrap, step, outcome)?
}

/// [`vote`] that tells a failed step (inner `Err`, the same verdict on every rank: a reason
/// to fall back) from a failed exchange (outer `Err`: the group itself is broken).
pub(crate) fn vote_soft<T>(
    bootstrap: &dyn Bootstrap,
    step: &'static str,
    outcome: Result<T>,
) -> Result<Result<T>> {
    let ballot = match &outcome {
        Ok(_) => vec![1u8],
        Err(e) => [&[0u8][..], e.to_string().as_bytes()].concat(),
    };
    let ballots = bootstrap.all_gather(&ballot)?;
    let value = match outcome {
        Ok(v) => v,
        Err(e) => return Ok(Err(e)),
    };
    Ok(
        match ballots.iter().enumerate().find(|(_, b)| b.first() != Some(&1)) {
            None => Ok(value),
            Some((rank, b)) => Err(Error::PeerSetupFailed {
                step,
                rank,
                reason: String::from_utf8_lossy(b.get(1..).unwrap_or_default()).into_owned(),
            }),
        },
    )
}
