//! A whole group in one process: one thread per rank over a [`LocalHub`].

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::Communicator;
use crate::bootstrap::LocalHub;
use crate::config::{validate_world, Config};
use crate::error::{Error, Result};
use crate::setup::setup_timeout;

impl Communicator {
    /// Creates a group of `contexts.len()` ranks in this process, rank r on `contexts[r]`.
    /// Ranks may share a device ("virtual ranks": each has its own mapping of every peer's
    /// memory and its own stream, and the kernels really synchronise across grids).
    ///
    /// Each rank is set up by [`Communicator::new`] on its own thread over an in-process
    /// [`LocalHub`]: every allocation is exported as a POSIX file descriptor and imported by
    /// every other rank, the same path separate processes take. There is no NCCL fallback:
    /// `Config::nccl_above_bytes` is ignored and a call above `capacity_bytes` is an error.
    pub fn local_group(contexts: &[Arc<CudaContext>], config: Config) -> Result<Vec<Communicator>> {
        config.validate()?;
        validate_world(contexts.len())?;
        let hub = LocalHub::new(contexts.len(), setup_timeout(&config));
        let results: Vec<Result<Communicator>> = std::thread::scope(|s| {
            let handles: Vec<_> = contexts
                .iter()
                .enumerate()
                .map(|(rank, ctx)| {
                    let hub = hub.rank(rank);
                    let config = config.clone();
                    s.spawn(move || Communicator::new(&hub, ctx.clone(), config))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::PeerSetupFailed {
                            step: "thread",
                            rank: None,
                            reason: "a setup thread panicked".into(),
                        })
                    })
                })
                .collect()
        });
        // Report a rank's own error in preference to the echoes of it on other ranks.
        let mut comms = Vec::with_capacity(results.len());
        let mut errors = Vec::new();
        for r in results {
            match r {
                Ok(c) => comms.push(c),
                Err(e) => errors.push(e),
            }
        }
        if !errors.is_empty() {
            let own = errors
                .iter()
                .position(|e| !matches!(e, Error::PeerSetupFailed { .. }));
            return Err(errors.swap_remove(own.unwrap_or(0)));
        }
        Ok(comms)
    }
}
