//! The descriptor all-gather every bootstrap gets for free: over per-rank abstract Unix
//! sockets whose names travel through the bootstrap's own byte all-gather.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use super::frames::{self, decode_announce, decode_offer, encode_announce, encode_offer, StoreOptions};
use super::socket::{random_token, send_frame_with_fds, Kind};
use super::{vote, Bootstrap};
use crate::error::{Error, Result};

/// Descriptor exchange for a bootstrap that can only move bytes: every rank listens on an
/// abstract Unix socket with a random name, the names (and a token each) travel through
/// `bootstrap.all_gather`, every rank connects to every peer and sends its descriptor with
/// `SCM_RIGHTS`, then collects the peers' from its own socket. Both halves end in a vote, so
/// every rank returns the same verdict. The sockets are closed when this returns.
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
    let deadline = Instant::now() + timeout;
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

    // Phase 1: send this rank's descriptor to every peer. Connecting to a listening socket
    // and writing a small message complete without the peer's help (the kernel queues the
    // connection and the data), so no rank waits on another here.
    let sent = (|| -> std::io::Result<()> {
        for (q, (their_token, their_name)) in peers.iter().enumerate() {
            if q == rank {
                continue;
            }
            let stream = UnixStream::connect_addr(&SocketAddr::from_abstract_name(their_name.as_bytes())?)?;
            // The descriptor goes only to a listener of an admitted user.
            frames::admit(&stream, options).map_err(|why| {
                std::io::Error::other(format!("the listener of rank {q} is not admitted: {why}"))
            })?;
            let payload = encode_offer(rank, their_token);
            send_frame_with_fds(&stream, Kind::Fd, rank as u64, &payload, &[own.as_fd()], deadline)?;
        }
        Ok(())
    })()
    .map_err(|e| Error::Bootstrap {
        reason: format!(
            "sending a descriptor to a peer over an abstract socket failed ({e}); are all ranks in one \
             network namespace?"
        ),
    });
    vote(bootstrap, "descriptor exchange (send)", sent)?;

    // Phase 2: every peer's descriptor is queued on the listener by now.
    let received = (|| -> Result<Vec<Option<OwnedFd>>> {
        let mut fds: Vec<Option<OwnedFd>> = (0..world).map(|_| None).collect();
        let mut missing = world - 1;
        while missing > 0 {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(Error::Bootstrap {
                            reason: format!("{missing} peer descriptor(s) did not arrive within {timeout:?}"),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                Err(e) => {
                    return Err(Error::Bootstrap {
                        reason: format!("accept on @{name} failed: {e}"),
                    })
                }
            };
            // Another user's connection is dropped before a byte is read. Anything that is
            // not a peer's well-formed message with our token is not ours: ignore it (any
            // descriptor it carried is closed with it).
            if frames::admit(&stream, options).is_err() {
                continue;
            }
            let Ok((header, payload, mut got)) = stream
                .set_nonblocking(false)
                .and_then(|()| super::socket::read_frame_bounded(&stream, deadline, frames::OFFER_BYTES, 1))
            else {
                continue;
            };
            if header.kind != Kind::Fd || frames::check_descriptors(Kind::Fd, world, got.len()).is_err() {
                continue;
            }
            let Ok(q) = decode_offer(&payload, &token, rank, world) else {
                continue;
            };
            if fds[q].is_some() {
                continue;
            }
            fds[q] = Some(got.remove(0));
            missing -= 1;
        }
        Ok(fds)
    })();
    let mut fds = vote(bootstrap, "descriptor exchange (receive)", received)?;
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
