//! The descriptor all-gather every bootstrap gets for free: over per-rank abstract Unix
//! sockets whose names travel through the bootstrap's own byte all-gather.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::time::{Duration, Instant};

use rustix::net::SocketAddrUnix;

use super::frames::{
    self, decode_announce, decode_offer, encode_announce, encode_header, encode_offer, Header, Secret,
    StoreOptions,
};
use super::gate::{dial, Dial, Gate, Greeting, Refusal, DIAL_RETRY, GREETING_WAIT};
use super::socket::{random_token, send_frame_with_fds, Kind};
use super::{vote, Bootstrap};
use crate::error::{Error, Result};

/// Descriptor exchange for a bootstrap that can only move bytes: every rank listens on an
/// abstract Unix socket with a random name, the names (and a token each) travel through
/// `bootstrap.all_gather`, then every rank sends its descriptor with `SCM_RIGHTS` to every
/// peer while it collects the peers' from its own socket (one loop: no phase only connects).
/// It ends in a vote, so every rank returns the same verdict. The sockets are closed when this
/// returns. Every step is bounded by `timeout` from the call.
///
/// Every accepted connection and every connected listener passes `options.check_peer` (same
/// user by default) before anything is read from or sent to it; a descriptor is only sent to
/// a listener that passed, and is only taken from a sender that proved the receiver's token.
#[doc(hidden)] // public only for the security tests
pub fn gather_fds_over_abstract_sockets<B: Bootstrap + ?Sized>(
    bootstrap: &B,
    fd: BorrowedFd<'_>,
    timeout: Duration,
    options: &StoreOptions,
) -> Result<Vec<OwnedFd>> {
    let (rank, world) = (bootstrap.rank(), bootstrap.world());
    let own = fd.try_clone_to_owned().map_err(|e| Error::Bootstrap {
        reason: format!("dup of a file descriptor failed: {e}"),
    })?;
    if world == 1 {
        return Ok(vec![own]);
    }
    let started = Instant::now();
    let token = frames::random_secret().map_err(|e| Error::Bootstrap {
        reason: format!("no random token for the descriptor exchange: {e}"),
    })?;
    let name = format!(
        "symm-allreduce.{}.{}",
        std::process::id(),
        hex::encode(random_token())
    );
    let listener = SocketAddr::from_abstract_name(name.as_bytes())
        .and_then(|a| UnixListener::bind_addr(&a))
        .and_then(|l| l.set_nonblocking(true).map(|()| l));
    let announce = match &listener {
        Ok(_) => encode_announce(&token, &name),
        Err(e) => [
            &[0u8][..],
            format!("cannot listen on abstract socket @{name}: {e}").as_bytes(),
        ]
        .concat(),
    };
    let announced = bootstrap.all_gather(&announce)?;
    let mut peers: Vec<([u8; 16], String)> = Vec::with_capacity(world);
    for (q, a) in announced.iter().enumerate() {
        match decode_announce(a) {
            Ok((token, name)) => peers.push((token, name.to_string())),
            Err(why) => {
                // Every rank sees the same announcements: all fail here together.
                return Err(Error::PeerSetupFailed {
                    step: "descriptor exchange",
                    rank: Some(q),
                    reason: why.unwrap_or_else(|e| e.to_string()),
                });
            }
        }
    }
    // This rank's own announcement was a success if we got here.
    let listener = listener.map_err(|e| Error::Bootstrap {
        reason: format!("cannot listen on abstract socket @{name}: {e}"),
    })?;

    let received = exchange(
        rank, world, &own, &token, &peers, &listener, options, started, timeout,
    );
    let mut fds = vote(bootstrap, "descriptor exchange", received)?;
    fds[rank] = Some(own);
    fds.into_iter()
        .enumerate()
        .map(|(q, f)| {
            f.ok_or_else(|| Error::Bootstrap {
                reason: format!("no descriptor from rank {q}"),
            })
        })
        .collect()
}

/// One loop that sends this rank's descriptor to every peer and collects every peer's, at the
/// same time: a connect that finds a full backlog is retried later (never waited for in the
/// kernel) while this rank keeps accepting, so no two ranks can wait on each other and no
/// other process can hold a rank past `timeout`.
#[allow(clippy::too_many_arguments)]
fn exchange(
    rank: usize,
    world: usize,
    own: &OwnedFd,
    token: &Secret,
    peers: &[(Secret, String)],
    listener: &UnixListener,
    options: &StoreOptions,
    started: Instant,
    timeout: Duration,
) -> Result<Vec<Option<OwnedFd>>> {
    let deadline = started + timeout;
    let failed = |step: String| Error::Bootstrap {
        reason: format!(
            "rank {rank}, descriptor exchange: {step} after {:.1?} (timeout {timeout:?})",
            started.elapsed()
        ),
    };
    // Where to send, and when to try again (`None`: sent, or this rank).
    let mut outgoing: Vec<Option<(SocketAddrUnix, Instant, String)>> = Vec::with_capacity(world);
    for (q, (_, name)) in peers.iter().enumerate() {
        outgoing.push(if q == rank {
            None
        } else {
            let addr = SocketAddrUnix::new_abstract_name(name.as_bytes())
                .map_err(|e| failed(format!("rank {q} announced an unusable socket name ({e})")))?;
            Some((addr, started, "not tried yet".to_string()))
        });
    }
    let greeting = Greeting {
        header: encode_header(Header {
            kind: Kind::Fd,
            seq: 0,
            len: frames::OFFER_BYTES as u64,
        }),
        any_seq: true,
        fds: 1,
        // The receiver never writes to an accepted connection.
        tell: false,
    };
    let mut gate = Gate::new(listener, *options, greeting)
        .map_err(|e| failed(format!("its socket could not be made non-blocking ({e})")))?;
    let mut fds: Vec<Option<OwnedFd>> = (0..world).map(|_| None).collect();
    let mut arrivals = Vec::new();
    loop {
        let now = Instant::now();
        for (q, out) in outgoing.iter_mut().enumerate() {
            let Some((addr, next, last)) = out else { continue };
            if *next > now {
                continue;
            }
            match dial(addr) {
                Dial::Connected(stream) => {
                    // The descriptor goes only to a listener of an admitted user.
                    frames::admit(&stream, options)
                        .map_err(|why| failed(format!("the listener of rank {q} is not admitted ({why})")))?;
                    let payload = encode_offer(rank, &peers[q].0);
                    stream
                        .set_nonblocking(false)
                        .and_then(|()| {
                            send_frame_with_fds(
                                &stream,
                                Kind::Fd,
                                rank as u64,
                                &payload,
                                &[own.as_fd()],
                                deadline.min(Instant::now() + GREETING_WAIT),
                            )
                        })
                        .map_err(|e| failed(format!("sending the descriptor to rank {q} failed ({e})")))?;
                    *out = None;
                }
                Dial::Retry(e) => {
                    *next = now + DIAL_RETRY;
                    *last = e.to_string();
                }
                Dial::Failed(e) => {
                    return Err(failed(format!(
                    "connecting to rank {q}'s socket failed ({e}); are all ranks in one network namespace?"
                )))
                }
            }
        }
        let missing: Vec<usize> = (0..world).filter(|&q| q != rank && fds[q].is_none()).collect();
        let unsent: Vec<usize> = (0..world).filter(|&q| outgoing[q].is_some()).collect();
        if missing.is_empty() && unsent.is_empty() {
            return Ok(fds);
        }
        if Instant::now() >= deadline {
            let last: Vec<String> = unsent
                .iter()
                .filter_map(|&q| outgoing[q].as_ref().map(|(_, _, why)| format!("rank {q}: {why}")))
                .collect();
            let mut what = Vec::new();
            if !unsent.is_empty() {
                what.push(format!(
                    "could not deliver to rank(s) {unsent:?} ({})",
                    last.join("; ")
                ));
            }
            if !missing.is_empty() {
                what.push(format!("got no descriptor from rank(s) {missing:?}"));
            }
            return Err(failed(format!(
                "{}{}",
                what.join(" and "),
                gate.refusals.summary()
            )));
        }
        let wake = outgoing
            .iter()
            .flatten()
            .map(|(_, next, _)| *next)
            .fold(deadline, Instant::min);
        gate.step(wake, &mut arrivals)
            .map_err(|e| failed(format!("accept on its socket failed ({e})")))?;
        for mut arrival in arrivals.drain(..) {
            // Anything that is not a peer's offer with this rank's token is not ours: count
            // it and drop it (any descriptor it carried is closed with it).
            match decode_offer(&arrival.payload, token, rank, world) {
                Ok(q) if fds[q].is_none() => fds[q] = arrival.fds.pop(),
                Ok(q) => gate.refusals.note(Refusal::Rejected, || {
                    format!("{}: a second offer as rank {q}", arrival.creds.describe())
                }),
                Err(e) => gate
                    .refusals
                    .note(Refusal::Rejected, || format!("{}: {e}", arrival.creds.describe())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_travel_over_abstract_sockets_named_through_the_bootstrap() {
        use std::os::unix::fs::FileExt;
        let dir = std::env::temp_dir().join(format!("symm-abstract-{}", hex::encode(random_token())));
        std::fs::create_dir_all(&dir).unwrap();
        let world = 4;
        let hub = crate::bootstrap::LocalHub::new(world, Duration::from_secs(10));
        std::thread::scope(|s| {
            for r in 0..world {
                let hub = hub.rank(r);
                let dir = &dir;
                s.spawn(move || {
                    let path = dir.join(format!("rank{r}"));
                    std::fs::write(&path, format!("from rank {r}")).unwrap();
                    let file = std::fs::File::open(&path).unwrap();
                    for _ in 0..3 {
                        let fds = gather_fds_over_abstract_sockets(
                            &hub,
                            file.as_fd(),
                            Duration::from_secs(10),
                            &StoreOptions::default(),
                        )
                        .unwrap();
                        assert_eq!(fds.len(), world);
                        for (q, fd) in fds.into_iter().enumerate() {
                            let mut buf = [0u8; 32];
                            let n = std::fs::File::from(fd).read_at(&mut buf, 0).unwrap();
                            assert_eq!(&buf[..n], format!("from rank {q}").as_bytes());
                        }
                    }
                });
            }
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
