//! Socket store: the bootstrap for processes started without NCCL.
//!
//! Rank 0 listens on a Unix socket (a filesystem path or a Linux abstract name); every other
//! rank connects, retrying until the timeout. Each exchange is relayed through rank 0: the
//! leaves send their contribution, rank 0 answers every leaf with everyone's. File
//! descriptors travel as `SCM_RIGHTS` ancillary data, which needs no ptrace rights (unlike
//! `pidfd_getfd`).
//!
//! Every read and write has a deadline. A rank that exits closes its socket, so its peers see
//! end-of-file at once rather than waiting out the timeout; rank 0 then tells every other rank
//! why the group failed (an abort frame) before it returns its own error.

use std::cell::{Cell, RefCell};
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, IoSlice, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rustix::net::{
    recvmsg, send, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

use super::Bootstrap;
use crate::error::{Error, Result};
use crate::plan::MAX_RANKS;

/// Where rank 0 of a [`SocketStore`] listens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum StoreAddress {
    /// A socket file. A stale file left by a dead run is replaced; a live one is an error.
    /// Rank 0 removes the file as soon as every rank has connected.
    Path(PathBuf),
    /// A Linux abstract socket name: no file, gone with the socket, reachable by every process
    /// in the same network namespace.
    Abstract(String),
}

impl StoreAddress {
    /// `@name` is an abstract name, anything else a path.
    pub fn parse(s: &str) -> StoreAddress {
        match s.strip_prefix('@') {
            Some(name) => StoreAddress::Abstract(name.to_string()),
            None => StoreAddress::Path(PathBuf::from(s)),
        }
    }

    /// A fresh abstract name, `<prefix>.<pid>.<random>`, for a launcher to hand to its ranks.
    pub fn unique(prefix: &str) -> StoreAddress {
        StoreAddress::Abstract(format!(
            "{prefix}.{}.{}",
            std::process::id(),
            hex(&random_token())
        ))
    }

    fn socket_addr(&self) -> io::Result<SocketAddr> {
        match self {
            StoreAddress::Path(p) => SocketAddr::from_pathname(p),
            StoreAddress::Abstract(name) => SocketAddr::from_abstract_name(name.as_bytes()),
        }
    }
}

impl std::fmt::Display for StoreAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreAddress::Path(p) => write!(f, "{}", p.display()),
            StoreAddress::Abstract(name) => write!(f, "@{name}"),
        }
    }
}

/// A bootstrap over Unix sockets for `world` processes on one host.
///
/// Create one per rank, all with the same address, world and (ideally) timeout; the
/// constructor returns once every rank has connected. It can serve any number of
/// [`crate::Communicator::new`] calls, one at a time, as long as every rank makes the same
/// sequence of calls.
///
/// ```no_run
/// use std::time::Duration;
/// use symm_allreduce::{Communicator, Config, SocketStore, StoreAddress};
/// # fn main() -> Result<(), symm_allreduce::Error> {
/// # let (rank, world) = (0, 2);
/// let store = SocketStore::new(&StoreAddress::parse("@my-job-42"), rank, world, Duration::from_secs(30))?;
/// let comm = Communicator::new(&store, symm_allreduce::context(0)?, Config::default())?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct SocketStore {
    rank: usize,
    world: usize,
    timeout: Duration,
    links: Links,
    /// Exchange counter: every frame carries it, so a rank at another step is detected.
    seq: Cell<u64>,
    /// Set after the first failure; every later exchange returns it.
    broken: RefCell<Option<(usize, String)>>,
}

#[derive(Debug)]
enum Links {
    /// World of one: nothing to connect.
    Alone,
    /// Rank 0: a connection to rank q at index q - 1.
    Root(Vec<UnixStream>),
    /// Any other rank: the connection to rank 0.
    Leaf(UnixStream),
}

impl SocketStore {
    /// Joins the store at `address` as `rank` of `world`. Rank 0 listens, the others connect
    /// (retrying while the socket does not exist yet). Every wait, here and in later
    /// exchanges, gives up after `timeout`.
    pub fn new(address: &StoreAddress, rank: usize, world: usize, timeout: Duration) -> Result<SocketStore> {
        if world == 0 || world > MAX_RANKS || rank >= world {
            return Err(Error::InvalidWorldSize {
                world,
                reason: format!("rank {rank} of a world of {world}; worlds are 1..={MAX_RANKS}"),
            });
        }
        if timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "the socket store timeout must be positive".into(),
            ));
        }
        let links = if world == 1 {
            Links::Alone
        } else if rank == 0 {
            Links::Root(accept_all(address, world, timeout)?)
        } else {
            Links::Leaf(connect(address, rank, world, timeout)?)
        };
        let store = SocketStore {
            rank,
            world,
            timeout,
            links,
            seq: Cell::new(0),
            broken: RefCell::new(None),
        };
        // Rank 0 answers only once all ranks are in, so every rank leaves together (or with
        // the reason it could not).
        store.all_gather(&[])?;
        Ok(store)
    }

    /// The bound on every wait.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn next_seq(&self) -> Result<u64> {
        if let Some((rank, reason)) = self.broken.borrow().as_ref() {
            return Err(Error::PeerSetupFailed {
                step: "socket store",
                rank: *rank,
                reason: format!("the store failed earlier: {reason}"),
            });
        }
        let seq = self.seq.get() + 1;
        self.seq.set(seq);
        Ok(seq)
    }

    /// Records a failure that `rank` caused; rank 0 also tells every leaf.
    fn fail(&self, rank: usize, reason: String) -> Error {
        if let Links::Root(peers) = &self.links {
            let payload = abort_payload(rank, &reason);
            let deadline = Instant::now() + Duration::from_millis(500);
            for s in peers {
                let _ = write_frame(s, Kind::Abort, self.seq.get(), &payload, deadline);
            }
        }
        *self.broken.borrow_mut() = Some((rank, reason.clone()));
        Error::PeerSetupFailed {
            step: "socket store",
            rank,
            reason,
        }
    }

    fn io_failure(&self, peer: usize, e: io::Error) -> Error {
        self.fail(peer, describe_io(peer, &e, self.timeout))
    }

    /// A frame a leaf received from rank 0 that is not the expected answer.
    fn unexpected(&self, header: Header, payload: &[u8], expected: Kind, seq: u64) -> Error {
        if header.kind == Kind::Abort {
            let (rank, reason) = decode_abort(payload);
            *self.broken.borrow_mut() = Some((rank, reason.clone()));
            return Error::PeerSetupFailed {
                step: "socket store",
                rank,
                reason,
            };
        }
        self.fail(0, mismatch(0, header, expected, seq))
    }
}

impl Bootstrap for SocketStore {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let seq = self.next_seq()?;
        let deadline = Instant::now() + self.timeout;
        match &self.links {
            Links::Alone => Ok(vec![bytes.to_vec()]),
            Links::Root(peers) => {
                let mut parts = vec![bytes.to_vec()];
                for (i, s) in peers.iter().enumerate() {
                    let q = i + 1;
                    let (header, payload) = read_frame(s, deadline).map_err(|e| self.io_failure(q, e))?;
                    if header.kind != Kind::Bytes || header.seq != seq {
                        return Err(self.fail(q, mismatch(q, header, Kind::Bytes, seq)));
                    }
                    parts.push(payload);
                }
                let gathered = encode_gathered(&parts);
                for (i, s) in peers.iter().enumerate() {
                    write_frame(s, Kind::Gathered, seq, &gathered, deadline)
                        .map_err(|e| self.io_failure(i + 1, e))?;
                }
                Ok(parts)
            }
            Links::Leaf(root) => {
                write_frame(root, Kind::Bytes, seq, bytes, deadline).map_err(|e| self.io_failure(0, e))?;
                let (header, payload) = read_frame(root, deadline).map_err(|e| self.io_failure(0, e))?;
                if header.kind != Kind::Gathered || header.seq != seq {
                    return Err(self.unexpected(header, &payload, Kind::Gathered, seq));
                }
                decode_gathered(&payload, self.world).map_err(|e| self.fail(0, e))
            }
        }
    }

    fn all_gather_fds(&self, fd: BorrowedFd<'_>) -> Result<Vec<OwnedFd>> {
        let seq = self.next_seq()?;
        let deadline = Instant::now() + self.timeout;
        let own = fd.try_clone_to_owned().map_err(|e| Error::Bootstrap {
            reason: format!("dup of a file descriptor failed: {e}"),
        })?;
        match &self.links {
            Links::Alone => Ok(vec![own]),
            Links::Root(peers) => {
                let mut fds = vec![own];
                for (i, s) in peers.iter().enumerate() {
                    let q = i + 1;
                    let (header, _, mut got) =
                        recv_frame_with_fds(s, deadline, 1).map_err(|e| self.io_failure(q, e))?;
                    if header.kind != Kind::Fd || header.seq != seq || got.len() != 1 {
                        return Err(self.fail(
                            q,
                            format!(
                                "{} (with {} descriptors, expected 1)",
                                mismatch(q, header, Kind::Fd, seq),
                                got.len()
                            ),
                        ));
                    }
                    fds.push(got.remove(0));
                }
                let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
                for (i, s) in peers.iter().enumerate() {
                    send_frame_with_fds(s, Kind::Fds, seq, &[], &borrowed, deadline)
                        .map_err(|e| self.io_failure(i + 1, e))?;
                }
                drop(borrowed);
                Ok(fds)
            }
            Links::Leaf(root) => {
                send_frame_with_fds(root, Kind::Fd, seq, &[], &[own.as_fd()], deadline)
                    .map_err(|e| self.io_failure(0, e))?;
                drop(own);
                let (header, payload, fds) =
                    recv_frame_with_fds(root, deadline, self.world).map_err(|e| self.io_failure(0, e))?;
                if header.kind != Kind::Fds || header.seq != seq {
                    return Err(self.unexpected(header, &payload, Kind::Fds, seq));
                }
                if fds.len() != self.world {
                    return Err(self.fail(
                        0,
                        format!(
                            "rank 0 sent {} descriptors for a world of {}",
                            fds.len(),
                            self.world
                        ),
                    ));
                }
                Ok(fds)
            }
        }
    }
}

/// Rank 0: listen, then accept and check a hello from every other rank.
fn accept_all(address: &StoreAddress, world: usize, timeout: Duration) -> Result<Vec<UnixStream>> {
    let deadline = Instant::now() + timeout;
    let listener = listen(address)?;
    // Removes the socket file on every way out of this function: peers are connected (or the
    // group failed) by then, so nobody needs it again.
    let _cleanup = RemoveOnDrop(match address {
        StoreAddress::Path(p) => Some(p.clone()),
        StoreAddress::Abstract(_) => None,
    });
    listener.set_nonblocking(true).map_err(|e| Error::Bootstrap {
        reason: format!("cannot make the listening socket non-blocking: {e}"),
    })?;
    let mut peers: Vec<Option<UnixStream>> = (1..world).map(|_| None).collect();
    let abort_all = |peers: &[Option<UnixStream>], rank: usize, reason: &str| {
        let payload = abort_payload(rank, reason);
        for s in peers.iter().flatten() {
            let _ = write_frame(
                s,
                Kind::Abort,
                0,
                &payload,
                Instant::now() + Duration::from_millis(500),
            );
        }
    };
    while peers.iter().any(Option::is_none) {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = peers
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| p.is_none())
                        .map(|(i, _)| i + 1)
                        .collect();
                    let reason = format!(
                        "rank 0 waited {timeout:?} at {address} but rank(s) {missing:?} never connected"
                    );
                    abort_all(&peers, missing[0], &reason);
                    return Err(Error::PeerSetupFailed {
                        step: "socket store",
                        rank: missing[0],
                        reason,
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => {
                return Err(Error::Bootstrap {
                    reason: format!("accept on {address} failed: {e}"),
                })
            }
        };
        // A connection that does not say hello in time is not one of ours: drop it.
        let hello = stream
            .set_nonblocking(false)
            .and_then(|()| read_frame(&stream, deadline.min(Instant::now() + Duration::from_secs(5))));
        let Ok((header, payload)) = hello else { continue };
        if header.kind != Kind::Hello || payload.len() != 8 {
            continue;
        }
        let rank = u32::from_le_bytes(payload[0..4].try_into().expect("4 bytes")) as usize;
        let their_world = u32::from_le_bytes(payload[4..8].try_into().expect("4 bytes")) as usize;
        let problem = if their_world != world {
            Some(format!(
                "rank {rank} joined {address} for a world of {their_world}, rank 0 for a world of {world}"
            ))
        } else if rank == 0 || rank >= world {
            Some(format!(
                "a process joined {address} as rank {rank} of a world of {world}"
            ))
        } else if peers[rank - 1].is_some() {
            Some(format!("two processes joined {address} as rank {rank}"))
        } else {
            None
        };
        if let Some(reason) = problem {
            let _ = write_frame(&stream, Kind::Abort, 0, &abort_payload(0, &reason), deadline);
            abort_all(&peers, rank.min(world - 1), &reason);
            return Err(Error::PeerSetupFailed {
                step: "socket store",
                rank: rank.min(world - 1),
                reason,
            });
        }
        peers[rank - 1] = Some(stream);
    }
    Ok(peers.into_iter().map(|p| p.expect("all connected")).collect())
}

fn listen(address: &StoreAddress) -> Result<UnixListener> {
    let addr = address.socket_addr().map_err(|e| Error::Bootstrap {
        reason: format!("{address} is not a valid Unix socket address: {e}"),
    })?;
    match UnixListener::bind_addr(&addr) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            // A socket file nobody listens on is left over from a dead run: replace it.
            let stale = matches!(address, StoreAddress::Path(_))
                && UnixStream::connect_addr(&addr)
                    .is_err_and(|e| e.kind() == io::ErrorKind::ConnectionRefused);
            if let (true, StoreAddress::Path(p)) = (stale, address) {
                let _ = std::fs::remove_file(p);
                return UnixListener::bind_addr(&addr).map_err(|e| Error::Bootstrap {
                    reason: format!("cannot listen on {address}: {e}"),
                });
            }
            Err(Error::Bootstrap {
                reason: format!(
                    "{address} is in use by another live socket (another job?): give each group its own address"
                ),
            })
        }
        Err(e) => Err(Error::Bootstrap {
            reason: format!("cannot listen on {address}: {e}"),
        }),
    }
}

/// Any rank but 0: connect (retrying until rank 0 listens) and say hello.
fn connect(address: &StoreAddress, rank: usize, world: usize, timeout: Duration) -> Result<UnixStream> {
    let deadline = Instant::now() + timeout;
    let addr = address.socket_addr().map_err(|e| Error::Bootstrap {
        reason: format!("{address} is not a valid Unix socket address: {e}"),
    })?;
    let stream = loop {
        match UnixStream::connect_addr(&addr) {
            Ok(s) => break s,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                ) =>
            {
                if Instant::now() >= deadline {
                    return Err(Error::PeerSetupFailed {
                        step: "socket store",
                        rank: 0,
                        reason: format!(
                            "rank {rank} could not reach rank 0 at {address} within {timeout:?} ({e}): is rank 0 \
                             running, with the same address?"
                        ),
                    });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                return Err(Error::Bootstrap {
                    reason: format!("cannot connect to {address}: {e}"),
                })
            }
        }
    };
    let mut hello = (rank as u32).to_le_bytes().to_vec();
    hello.extend_from_slice(&(world as u32).to_le_bytes());
    write_frame(&stream, Kind::Hello, 0, &hello, deadline).map_err(|e| Error::PeerSetupFailed {
        step: "socket store",
        rank: 0,
        reason: describe_io(0, &e, timeout),
    })?;
    Ok(stream)
}

struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

// ---- Frames -------------------------------------------------------------------------------

const MAGIC: u32 = u32::from_le_bytes(*b"SYMS");
pub(crate) const HEADER_BYTES: usize = 24;
/// Largest payload accepted from a peer (setup messages are far smaller).
const MAX_PAYLOAD: u64 = 64 << 20;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A leaf's rank and world, once, right after connecting.
    Hello = 1,
    /// One rank's contribution to an all-gather.
    Bytes = 2,
    /// Every rank's contribution, from rank 0.
    Gathered = 3,
    /// One descriptor (as `SCM_RIGHTS`).
    Fd = 4,
    /// Every rank's descriptor, from rank 0.
    Fds = 5,
    /// The group failed: failing rank (u32) and the reason.
    Abort = 6,
}

impl Kind {
    fn from_u32(v: u32) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Bytes,
            3 => Kind::Gathered,
            4 => Kind::Fd,
            5 => Kind::Fds,
            6 => Kind::Abort,
            _ => return None,
        })
    }
}

/// `magic: u32 | kind: u32 | seq: u64 | payload length: u64`, little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) seq: u64,
    pub(crate) len: u64,
}

pub(crate) fn encode_header(h: Header) -> [u8; HEADER_BYTES] {
    let mut b = [0u8; HEADER_BYTES];
    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&(h.kind as u32).to_le_bytes());
    b[8..16].copy_from_slice(&h.seq.to_le_bytes());
    b[16..24].copy_from_slice(&h.len.to_le_bytes());
    b
}

pub(crate) fn decode_header(b: &[u8; HEADER_BYTES]) -> std::result::Result<Header, String> {
    let word = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let long = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    if word(0) != MAGIC {
        return Err("not a symm-allreduce frame (bad magic): is another program on this socket?".into());
    }
    let kind = Kind::from_u32(word(4)).ok_or_else(|| format!("unknown frame kind {}", word(4)))?;
    let len = long(16);
    if len > MAX_PAYLOAD {
        return Err(format!(
            "frame of {len} bytes is over the {MAX_PAYLOAD}-byte limit"
        ));
    }
    Ok(Header {
        kind,
        seq: long(8),
        len,
    })
}

/// `count: u32`, then per rank `length: u64 | bytes`.
pub(crate) fn encode_gathered(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + parts.iter().map(|p| p.len() + 8).sum::<usize>());
    b.extend_from_slice(&(parts.len() as u32).to_le_bytes());
    for p in parts {
        b.extend_from_slice(&(p.len() as u64).to_le_bytes());
        b.extend_from_slice(p);
    }
    b
}

pub(crate) fn decode_gathered(b: &[u8], world: usize) -> std::result::Result<Vec<Vec<u8>>, String> {
    let bad = || "malformed all-gather answer from rank 0 (mismatched crate versions?)".to_string();
    let count = u32::from_le_bytes(b.get(0..4).ok_or_else(bad)?.try_into().expect("4 bytes")) as usize;
    if count != world {
        return Err(format!(
            "rank 0 answered for {count} ranks, this rank expects {world}"
        ));
    }
    let mut parts = Vec::with_capacity(count);
    let mut at = 4usize;
    for _ in 0..count {
        let len =
            u64::from_le_bytes(b.get(at..at + 8).ok_or_else(bad)?.try_into().expect("8 bytes")) as usize;
        at += 8;
        let end = at.checked_add(len).ok_or_else(bad)?;
        parts.push(b.get(at..end).ok_or_else(bad)?.to_vec());
        at = end;
    }
    if at != b.len() {
        return Err(bad());
    }
    Ok(parts)
}

fn abort_payload(rank: usize, reason: &str) -> Vec<u8> {
    let mut payload = (rank as u32).to_le_bytes().to_vec();
    payload.extend_from_slice(reason.as_bytes());
    payload
}

fn decode_abort(payload: &[u8]) -> (usize, String) {
    match payload.get(0..4) {
        Some(r) => (
            u32::from_le_bytes(r.try_into().expect("4 bytes")) as usize,
            String::from_utf8_lossy(&payload[4..]).into_owned(),
        ),
        None => (0, "rank 0 aborted without a reason".into()),
    }
}

fn mismatch(peer: usize, header: Header, expected: Kind, seq: u64) -> String {
    format!(
        "rank {peer} sent {:?} #{} while this rank expected {expected:?} #{seq}: the ranks are at different \
         setup steps (every rank must make the same sequence of calls)",
        header.kind, header.seq
    )
}

fn describe_io(peer: usize, e: &io::Error, timeout: Duration) -> String {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            format!("rank {peer} did not answer within {timeout:?} (stuck, or at a different setup step)")
        }
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted => {
            format!("rank {peer} closed its connection (the process exited or crashed)")
        }
        _ => format!("talking to rank {peer} failed: {e}"),
    }
}

// ---- Socket I/O with deadlines --------------------------------------------------------------

/// Sets the socket's read and write timeouts to what is left until `deadline`.
fn arm(stream: &UnixStream, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    // Never zero: a zero timeout means "block forever".
    let left = left.max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))
}

/// Writes all of `bytes` with `MSG_NOSIGNAL` (a closed peer is an error, not a SIGPIPE).
fn send_all(stream: &UnixStream, mut bytes: &[u8], deadline: Instant) -> io::Result<()> {
    while !bytes.is_empty() {
        arm(stream, deadline)?;
        match send(stream, bytes, SendFlags::NOSIGNAL) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn read_exact_by(stream: &UnixStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        arm(stream, deadline)?;
        match (&mut &*stream).read(&mut buf[done..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(crate) fn write_frame(
    stream: &UnixStream,
    kind: Kind,
    seq: u64,
    payload: &[u8],
    deadline: Instant,
) -> io::Result<()> {
    let header = encode_header(Header {
        kind,
        seq,
        len: payload.len() as u64,
    });
    send_all(stream, &header, deadline)?;
    send_all(stream, payload, deadline)
}

pub(crate) fn read_frame(stream: &UnixStream, deadline: Instant) -> io::Result<(Header, Vec<u8>)> {
    let mut raw = [0u8; HEADER_BYTES];
    read_exact_by(stream, &mut raw, deadline)?;
    let header = decode_header(&raw).map_err(io::Error::other)?;
    let mut payload = vec![0u8; header.len as usize];
    read_exact_by(stream, &mut payload, deadline)?;
    Ok((header, payload))
}

/// Sends a frame with `fds` attached (as `SCM_RIGHTS`) to its first byte.
pub(crate) fn send_frame_with_fds(
    stream: &UnixStream,
    kind: Kind,
    seq: u64,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Instant,
) -> io::Result<()> {
    let header = encode_header(Header {
        kind,
        seq,
        len: payload.len() as u64,
    });
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_RANKS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other(format!(
            "{} descriptors do not fit one message",
            fds.len()
        )));
    }
    let sent = loop {
        arm(stream, deadline)?;
        match sendmsg(
            stream,
            &[IoSlice::new(&header)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    };
    if sent == 0 {
        return Err(io::ErrorKind::WriteZero.into());
    }
    send_all(stream, &header[sent..], deadline)?;
    send_all(stream, payload, deadline)
}

/// Receives a frame and the descriptors attached to it (at most `max_fds`; more is an error,
/// and every descriptor received is closed on any error).
pub(crate) fn recv_frame_with_fds(
    stream: &UnixStream,
    deadline: Instant,
    max_fds: usize,
) -> io::Result<(Header, Vec<u8>, Vec<OwnedFd>)> {
    let mut raw = [0u8; HEADER_BYTES];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_RANKS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        arm(stream, deadline)?;
        match recvmsg(
            stream,
            &mut [IoSliceMut::new(&mut raw)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(msg) => break msg,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    if got.bytes == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    if got.flags.contains(ReturnFlags::CTRUNC) || fds.len() > max_fds {
        return Err(io::Error::other(format!(
            "a peer sent more descriptors than the {max_fds} expected"
        )));
    }
    read_exact_by(stream, &mut raw[got.bytes..], deadline)?;
    let header = decode_header(&raw).map_err(io::Error::other)?;
    let mut payload = vec![0u8; header.len as usize];
    read_exact_by(stream, &mut payload, deadline)?;
    Ok((header, payload, fds))
}

/// 16 random bytes (seeded by the OS through std's hasher keys, mixed with time and pid).
pub(crate) fn random_token() -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_usize(i);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    out
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    fn unique() -> StoreAddress {
        StoreAddress::unique("symm-allreduce-test")
    }

    /// Runs `f(rank, store)` on `world` threads joined to one store.
    fn group<T: Send>(
        address: &StoreAddress,
        world: usize,
        timeout: Duration,
        f: impl Fn(usize, Result<SocketStore>) -> T + Sync,
    ) -> Vec<T> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|r| {
                    let f = &f;
                    s.spawn(move || f(r, SocketStore::new(address, r, world, timeout)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn header_and_gathered_round_trip() {
        let h = Header {
            kind: Kind::Fds,
            seq: 0x0102_0304_0506_0708,
            len: 77,
        };
        assert_eq!(decode_header(&encode_header(h)).unwrap(), h);
        let mut bad = encode_header(h);
        bad[0] ^= 1;
        assert!(decode_header(&bad).unwrap_err().contains("magic"));
        let mut bad = encode_header(h);
        bad[4] = 99;
        assert!(decode_header(&bad).is_err());
        let huge = encode_header(Header {
            len: MAX_PAYLOAD + 1,
            ..h
        });
        assert!(decode_header(&huge).is_err());

        let parts = vec![vec![], vec![1, 2, 3], vec![0; 1000], b"x".to_vec()];
        let enc = encode_gathered(&parts);
        assert_eq!(decode_gathered(&enc, 4).unwrap(), parts);
        assert!(decode_gathered(&enc, 3).is_err());
        assert!(decode_gathered(&enc[..enc.len() - 1], 4).is_err());
        let mut longer = enc.clone();
        longer.push(0);
        assert!(decode_gathered(&longer, 4).is_err());
    }

    #[test]
    fn addresses_parse() {
        assert_eq!(StoreAddress::parse("@abc"), StoreAddress::Abstract("abc".into()));
        assert_eq!(
            StoreAddress::parse("/tmp/x.sock"),
            StoreAddress::Path("/tmp/x.sock".into())
        );
        assert_eq!(StoreAddress::parse("@abc").to_string(), "@abc");
        assert_ne!(unique(), unique());
    }

    #[test]
    fn all_gather_over_abstract_and_path_sockets_many_rounds() {
        let dir = std::env::temp_dir().join(format!("symm-store-{}", hex(&random_token())));
        std::fs::create_dir_all(&dir).unwrap();
        let path = StoreAddress::Path(dir.join("store.sock"));
        for (address, world) in [(unique(), 4), (path.clone(), 3), (unique(), 1), (unique(), 8)] {
            let results = group(&address, world, Duration::from_secs(10), |r, store| {
                let store = store.unwrap();
                for round in 0..20u8 {
                    let mine = vec![r as u8; r * 3 + round as usize];
                    let all = store.all_gather(&mine).unwrap();
                    assert_eq!(all.len(), world);
                    for (q, b) in all.iter().enumerate() {
                        assert_eq!(b, &vec![q as u8; q * 3 + round as usize]);
                    }
                }
                store.rank()
            });
            assert_eq!(results, (0..world).collect::<Vec<_>>());
        }
        // Rank 0 removed the socket file once everyone had connected.
        if let StoreAddress::Path(p) = &path {
            assert!(!p.exists());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn descriptors_travel_by_scm_rights() {
        let dir = std::env::temp_dir().join(format!("symm-fds-{}", hex(&random_token())));
        std::fs::create_dir_all(&dir).unwrap();
        let address = unique();
        group(&address, 3, Duration::from_secs(10), |r, store| {
            let store = store.unwrap();
            let path = dir.join(format!("rank{r}"));
            std::fs::write(&path, format!("payload of rank {r}")).unwrap();
            let file = std::fs::File::open(&path).unwrap();
            for _ in 0..3 {
                let fds = store.all_gather_fds(file.as_fd()).unwrap();
                assert_eq!(fds.len(), 3);
                for (q, fd) in fds.into_iter().enumerate() {
                    let f = std::fs::File::from(fd);
                    let mut buf = vec![0u8; 64];
                    let n = f.read_at(&mut buf, 0).unwrap();
                    assert_eq!(&buf[..n], format!("payload of rank {q}").as_bytes());
                }
            }
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_rank_is_an_error_within_the_timeout() {
        let address = unique();
        let started = Instant::now();
        // World of 3 but rank 2 never starts.
        let errors = std::thread::scope(|s| {
            let a = s.spawn(|| SocketStore::new(&address, 0, 3, Duration::from_millis(400)).unwrap_err());
            let b = s.spawn(|| SocketStore::new(&address, 1, 3, Duration::from_millis(400)).unwrap_err());
            [a.join().unwrap(), b.join().unwrap()]
        });
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(errors[0].to_string().contains("never connected"), "{}", errors[0]);
        assert!(
            matches!(errors[1], Error::PeerSetupFailed { .. }),
            "{}",
            errors[1]
        );
    }

    #[test]
    fn a_rank_that_exits_is_seen_at_once_not_after_the_timeout() {
        let address = unique();
        let started = Instant::now();
        let results = group(&address, 3, Duration::from_secs(30), |r, store| {
            let store = store.unwrap();
            store.all_gather(b"first").unwrap();
            if r == 2 {
                drop(store); // the process "dies" here
                return None;
            }
            Some(store.all_gather(b"second").unwrap_err())
        });
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "took {:?}",
            started.elapsed()
        );
        for e in results.into_iter().flatten() {
            let text = e.to_string();
            assert!(text.contains("rank 2"), "{text}");
            assert!(text.contains("closed its connection"), "{text}");
        }
    }

    #[test]
    fn mismatched_world_sizes_are_refused() {
        let address = unique();
        let errors = std::thread::scope(|s| {
            let a = s.spawn(|| SocketStore::new(&address, 0, 2, Duration::from_secs(5)).unwrap_err());
            let b = s.spawn(|| SocketStore::new(&address, 1, 3, Duration::from_secs(5)).unwrap_err());
            [a.join().unwrap(), b.join().unwrap()]
        });
        for e in errors {
            assert!(e.to_string().contains("world of"), "{e}");
        }
        assert!(SocketStore::new(&unique(), 2, 2, Duration::from_secs(1)).is_err());
    }
}
