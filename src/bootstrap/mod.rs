//! How ranks exchange bytes and file descriptors during setup.
//!
//! Setup is collective: every rank runs the same steps in the same order, and each risky
//! step ends in an all-gathered vote, so a failure on one rank makes every rank return an
//! error (or fall back) together instead of leaving the others waiting.
//!
//! Three implementations: [`LocalHub`] (threads of one process), [`SocketStore`] (processes
//! on one host, over a Unix socket) and [`NcclBootstrap`] (over an existing NCCL
//! communicator). A transport that can only move bytes implements [`Bootstrap::all_gather`]
//! and gets the descriptor exchange for free ([`fds`]); [`frames`] holds the socket store's
//! wire format and admission rules as pure functions.

pub(crate) mod fds;
#[doc(hidden)]
pub mod frames;
mod gate;
mod local;
pub(crate) mod nccl;
pub(crate) mod socket;

use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

pub use frames::{PeerCheck, PeerCredentials, StoreOptions};
pub use local::LocalHub;
pub use nccl::NcclBootstrap;
pub use socket::{SocketStore, StoreAddress};

use crate::error::{Error, Result};
use crate::wire::Wire;

/// A channel between the ranks of one group, used only at setup.
pub trait Bootstrap {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Every rank contributes `bytes`; returns every rank's contribution, indexed by rank.
    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Every rank contributes one descriptor; returns a descriptor for every rank's
    /// (this rank's own included), indexed by rank. The default passes them over per-rank
    /// abstract Unix sockets whose names travel through [`Bootstrap::all_gather`] (every rank
    /// on one host, same user, within [`Bootstrap::timeout`]).
    fn all_gather_fds(&self, fd: BorrowedFd<'_>) -> Result<Vec<OwnedFd>> {
        fds::gather_fds_over_abstract_sockets(self, fd, self.timeout(), &StoreOptions::default())
    }
    /// The bound on each exchange of the default descriptor all-gather (30 s unless the
    /// transport says otherwise).
    fn timeout(&self) -> Duration {
        Duration::from_secs(30)
    }
}

/// Every rank reports whether `step` succeeded here. Returns this rank's value if every rank
/// succeeded, this rank's error if it failed, or [`Error::PeerSetupFailed`] naming the first
/// rank that failed.
pub(crate) fn vote<T, B: Bootstrap + ?Sized>(
    bootstrap: &B,
    step: &'static str,
    outcome: Result<T>,
) -> Result<T> {
    vote_soft(bootstrap, step, outcome)?
}

/// [`vote`] that tells a failed step (inner `Err`, the same verdict on every rank: a reason
/// to fall back) from a failed exchange (outer `Err`: the group itself is broken).
pub(crate) fn vote_soft<T, B: Bootstrap + ?Sized>(
    bootstrap: &B,
    step: &'static str,
    outcome: Result<T>,
) -> Result<Result<T>> {
    // `None`: succeeded here; `Some(why)`: failed.
    let ballot: Option<String> = outcome.as_ref().err().map(|e| e.to_string());
    let ballots = bootstrap.all_gather(&ballot.to_wire())?;
    let value = match outcome {
        Ok(v) => v,
        Err(e) => return Ok(Err(e)),
    };
    Ok(
        match ballots
            .iter()
            .map(|b| Option::<String>::from_wire(b).unwrap_or_else(|| Some("a malformed ballot".into())))
            .enumerate()
            .find_map(|(rank, b)| b.map(|why| (rank, why)))
        {
            None => Ok(value),
            Some((rank, reason)) => Err(Error::PeerSetupFailed {
                step,
                rank: Some(rank),
                reason,
            }),
        },
    )
}
