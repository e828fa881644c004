//! In-process bootstrap: ranks are threads of one process sharing a hub.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::Bootstrap;
use crate::error::{Error, Result};

#[derive(Debug, Default)]
struct Round {
    generation: u64,
    arrived: usize,
    bytes: Vec<Option<Vec<u8>>>,
    fds: Vec<Option<OwnedFd>>,
    /// The completed previous round, read by ranks that have not left it yet.
    done_bytes: Vec<Vec<u8>>,
    done_fds: Vec<Option<OwnedFd>>,
}

/// Every rank's bytes and descriptor from one round.
type Gathered = (Vec<Vec<u8>>, Vec<Option<OwnedFd>>);

/// Shared state of an in-process group. Clone one handle per rank with [`LocalHub::rank`].
#[derive(Debug, Clone)]
pub struct LocalHub {
    shared: Arc<(Mutex<Round>, Condvar)>,
    world: usize,
    rank: usize,
    timeout: Duration,
}

impl LocalHub {
    /// A hub for `world` ranks; every wait gives up after `timeout` (a rank that died or
    /// skipped a step surfaces as [`Error::PeerSetupFailed`] instead of a hang).
    pub fn new(world: usize, timeout: Duration) -> Self {
        let round = Round {
            bytes: vec![None; world],
            fds: (0..world).map(|_| None).collect(),
            ..Round::default()
        };
        LocalHub {
            shared: Arc::new((Mutex::new(round), Condvar::new())),
            world,
            rank: 0,
            timeout,
        }
    }

    /// The handle rank `rank` uses.
    pub fn rank(&self, rank: usize) -> Self {
        LocalHub { rank, ..self.clone() }
    }

    fn exchange(&self, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<Gathered> {
        let fd = fd
            .map(|f| f.try_clone_to_owned())
            .transpose()
            .map_err(|e| Error::PeerSetupFailed {
                step: "bootstrap",
                rank: Some(self.rank),
                reason: format!("dup of a file descriptor failed: {e}"),
            })?;
        let (lock, cv) = &*self.shared;
        let poisoned = || Error::PeerSetupFailed {
            step: "bootstrap",
            rank: Some(self.rank),
            reason: "another rank's thread panicked during setup".into(),
        };
        let mut round = lock.lock().map_err(|_| poisoned())?;
        let generation = round.generation;
        round.bytes[self.rank] = Some(bytes.to_vec());
        round.fds[self.rank] = fd;
        round.arrived += 1;
        if round.arrived == self.world {
            round.done_bytes = round
                .bytes
                .iter_mut()
                .map(|b| b.take().unwrap_or_default())
                .collect();
            round.done_fds = round.fds.iter_mut().map(Option::take).collect();
            round.arrived = 0;
            round.generation += 1;
            cv.notify_all();
        } else {
            let deadline = Instant::now() + self.timeout;
            while round.generation == generation {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::PeerSetupFailed {
                        step: "bootstrap",
                        rank: Some(self.rank),
                        reason: format!(
                            "waited {:?} for the other ranks to reach the same setup step",
                            self.timeout
                        ),
                    });
                }
                round = cv.wait_timeout(round, left).map_err(|_| poisoned())?.0;
            }
            if round.generation != generation + 1 {
                return Err(Error::PeerSetupFailed {
                    step: "bootstrap",
                    rank: Some(self.rank),
                    reason: "fell a whole round behind the other ranks".into(),
                });
            }
        }
        let mut fds = Vec::with_capacity(self.world);
        for f in &round.done_fds {
            fds.push(match f {
                Some(f) => Some(f.try_clone().map_err(|e| Error::PeerSetupFailed {
                    step: "bootstrap",
                    rank: Some(self.rank),
                    reason: format!("dup of a file descriptor failed: {e}"),
                })?),
                None => None,
            });
        }
        Ok((round.done_bytes.clone(), fds))
    }
}

impl Bootstrap for LocalHub {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(self.exchange(bytes, None)?.0)
    }

    fn all_gather_fds(&self, fd: BorrowedFd<'_>) -> Result<Vec<OwnedFd>> {
        let (_, fds) = self.exchange(&[], Some(fd))?;
        fds.into_iter()
            .enumerate()
            .map(|(rank, f)| {
                f.ok_or(Error::PeerSetupFailed {
                    step: "bootstrap",
                    rank: Some(rank),
                    reason: "contributed no file descriptor".into(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn all_gather_returns_every_rank_in_order_over_many_rounds() {
        let hub = LocalHub::new(4, Duration::from_secs(5));
        let results: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|r| {
                    let h = hub.rank(r);
                    s.spawn(move || {
                        let mut last = Vec::new();
                        for round in 0..50u8 {
                            last = h.all_gather(&[r as u8, round]).unwrap();
                            for (q, b) in last.iter().enumerate() {
                                assert_eq!(b, &vec![q as u8, round]);
                            }
                        }
                        last
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(results.len(), 4);
    }

    #[test]
    fn file_descriptors_are_shared() {
        let hub = LocalHub::new(2, Duration::from_secs(5));
        std::thread::scope(|s| {
            for r in 0..2 {
                let h = hub.rank(r);
                s.spawn(move || {
                    let file = std::fs::File::open("/dev/null").unwrap();
                    let fds = h.all_gather_fds(file.as_fd()).unwrap();
                    assert_eq!(fds.len(), 2);
                });
            }
        });
    }

    #[test]
    fn a_missing_rank_times_out_instead_of_hanging() {
        let hub = LocalHub::new(2, Duration::from_millis(50));
        let err = hub.rank(0).all_gather(b"x").unwrap_err();
        assert!(matches!(err, Error::PeerSetupFailed { .. }), "{err}");
    }
}
