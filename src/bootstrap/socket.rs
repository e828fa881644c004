//! Socket store: the bootstrap for processes started without NCCL.
//!
//! Rank 0 listens on a Unix socket (a filesystem path or a Linux abstract name) and admits
//! connections through a [`Gate`] (concurrent, bounded per connection); every other rank
//! connects without blocking, retrying until the timeout. Each exchange is relayed through rank 0: the
//! leaves send their contribution, rank 0 answers every leaf with everyone's. File
//! descriptors travel as `SCM_RIGHTS` ancillary data, which needs no ptrace rights (unlike
//! `pidfd_getfd`).
//!
//! Every read and write has a deadline. A rank that exits closes its socket, so its peers see
//! end-of-file at once rather than waiting out the timeout; rank 0 then tells every other rank
//! why the group failed (an abort frame) before it returns its own error.

use std::cell::{Cell, RefCell};
use std::io::{self, IoSlice, IoSliceMut};
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

pub(crate) use super::frames::Kind;
use super::frames::{
    self, check_descriptors, check_sequence, decode_abort, decode_gathered, decode_header, decode_hello,
    encode_abort as abort_payload, encode_gathered, encode_header, encode_hello, split_secret, Header,
    Secret, StoreOptions, HEADER_BYTES, HELLO_BYTES, MAX_FRAME_BYTES,
};
use super::gate::{dial, refuse, unix_addr, Dial, Gate, Greeting, Refusal, DIAL_RETRY};
use super::Bootstrap;
use crate::error::{Error, Result};
use crate::kernels::abi::MAX_RANKS;

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

    /// A fresh abstract name with a fresh launch secret, `<prefix>.<pid>.<random>#<secret>`,
    /// for a launcher to hand to its ranks (its [`Display`](std::fmt::Display) form carries the
    /// secret; pass it whole).
    ///
    /// Fails only if the operating system's random source does: a secret is never made from
    /// anything predictable.
    pub fn unique(prefix: &str) -> Result<StoreAddress> {
        StoreAddress::Abstract(format!(
            "{prefix}.{}.{}",
            std::process::id(),
            hex::encode(random_token())
        ))
        .with_secret()
    }

    /// The address a launcher put in environment variable `var` (its full text, secret
    /// included). The environment is the intended channel: another user cannot read
    /// `/proc/<pid>/environ`, while anyone on the host can read a process's arguments. Never
    /// pass the address on the command line.
    pub fn from_env(var: &str) -> Result<StoreAddress> {
        let text = std::env::var(var).map_err(|e| Error::Bootstrap {
            reason: format!(
                "no socket store address in the environment variable {var} ({e}): the launcher sets it \
                 to StoreAddress::unique(..)'s text"
            ),
        })?;
        Ok(StoreAddress::parse(text.trim()))
    }

    /// The address read from `path`: a file only this user can read (a regular file must have
    /// no permission bits for group or others, e.g. mode 0600), or an inherited descriptor
    /// (`/dev/fd/<n>`, such as a pipe from the launcher). The alternative to
    /// [`StoreAddress::from_env`]; never pass the address on the command line.
    pub fn from_file(path: &std::path::Path) -> Result<StoreAddress> {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let fail = |why: String| Error::Bootstrap {
            reason: format!(
                "cannot take the socket store address from {}: {why}",
                path.display()
            ),
        };
        let meta = std::fs::metadata(path).map_err(|e| fail(e.to_string()))?;
        let mode = meta.permissions().mode();
        if meta.is_file() && mode & 0o077 != 0 {
            return Err(fail(format!(
                "it is readable or writable by other users (mode {:o}); chmod 600 it, it holds the launch secret",
                mode & 0o777
            )));
        }
        if meta.is_file() && Some(meta.uid()) != frames::own_uid() {
            return Err(fail(format!(
                "it belongs to uid {}, not to this user",
                meta.uid()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        Ok(StoreAddress::parse(text.trim()))
    }

    /// This address with a fresh launch secret (replacing any it had): `…#<32 hex digits>`.
    /// Fails only if the operating system's random source does.
    pub fn with_secret(self) -> Result<StoreAddress> {
        let secret = hex::encode(frames::random_secret().map_err(|e| Error::Bootstrap {
            reason: format!("no random launch secret: {e}"),
        })?);
        Ok(match self {
            StoreAddress::Path(p) => {
                let text = p.to_string_lossy().into_owned();
                StoreAddress::Path(PathBuf::from(format!("{}#{secret}", split_secret(&text).0)))
            }
            StoreAddress::Abstract(name) => {
                StoreAddress::Abstract(format!("{}#{secret}", split_secret(&name).0))
            }
        })
    }

    fn text(&self) -> std::borrow::Cow<'_, str> {
        match self {
            StoreAddress::Path(p) => p.to_string_lossy(),
            StoreAddress::Abstract(name) => std::borrow::Cow::Borrowed(name.as_str()),
        }
    }

    /// The launch secret after `#`, or the typed error an address without one gets.
    pub fn secret(&self) -> Result<Secret> {
        let text = self.text();
        let problem = match split_secret(&text).1 {
            Some(Ok(secret)) => return Ok(secret),
            Some(Err(e)) => e.to_string(),
            None => "carries no launch secret".to_string(),
        };
        Err(Error::MissingSecret {
            address: self.redacted(),
            problem,
        })
    }

    /// The address without its secret, for messages and logs.
    pub fn redacted(&self) -> String {
        let text = self.text();
        let (name, secret) = split_secret(&text);
        let tail = if secret.is_some() { "#…" } else { "" };
        match self {
            StoreAddress::Path(_) => format!("{name}{tail}"),
            StoreAddress::Abstract(_) => format!("@{name}{tail}"),
        }
    }

    fn socket_addr(&self) -> io::Result<SocketAddr> {
        let text = self.text();
        let name = split_secret(&text).0;
        match self {
            StoreAddress::Path(_) => SocketAddr::from_pathname(name),
            StoreAddress::Abstract(_) => SocketAddr::from_abstract_name(name.as_bytes()),
        }
    }

    fn file(&self) -> Option<PathBuf> {
        match self {
            StoreAddress::Path(_) => Some(PathBuf::from(split_secret(&self.text()).0)),
            StoreAddress::Abstract(_) => None,
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
/// // The launcher makes the address once (`StoreAddress::unique("my-job")?`) and hands its
/// // text, which carries the launch secret, to every rank in the environment (never on the
/// // command line: docs/security.md); without a secret `new` returns `Error::MissingSecret`.
/// # std::env::set_var("MY_JOB_STORE", StoreAddress::unique("my-job")?.to_string());
/// let store = SocketStore::new(&StoreAddress::from_env("MY_JOB_STORE")?, rank, world, Duration::from_secs(30))?;
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
    /// The current exchange: what it is and when it started (for error messages).
    step: Cell<(&'static str, Instant)>,
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
    ///
    /// The address must carry the launch secret ([`StoreAddress::unique`]); without one this
    /// returns [`Error::MissingSecret`]. Only processes of this user are admitted
    /// ([`StoreOptions`] to change that).
    pub fn new(address: &StoreAddress, rank: usize, world: usize, timeout: Duration) -> Result<SocketStore> {
        SocketStore::with_options(address, rank, world, timeout, StoreOptions::default())
    }

    /// [`SocketStore::new`] with explicit admission rules.
    pub fn with_options(
        address: &StoreAddress,
        rank: usize,
        world: usize,
        timeout: Duration,
        options: StoreOptions,
    ) -> Result<SocketStore> {
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
        let secret = address.secret()?;
        // One deadline for the whole constructor: connecting, the hellos and the first
        // exchange together take at most `timeout`, whatever rank 0 or anyone else does.
        let started = Instant::now();
        let deadline = started + timeout;
        let links = if world == 1 {
            Links::Alone
        } else if rank == 0 {
            Links::Root(accept_all(address, &secret, world, started, timeout, &options)?)
        } else {
            Links::Leaf(connect(
                address, &secret, rank, world, started, timeout, &options,
            )?)
        };
        let store = SocketStore {
            rank,
            world,
            timeout,
            links,
            seq: Cell::new(0),
            broken: RefCell::new(None),
            step: Cell::new(("joining", started)),
        };
        // Rank 0 answers only once all ranks are in, so every rank leaves together (or with
        // the reason it could not).
        store.gather(&[], "joining", started, deadline)?;
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
                rank: Some(*rank),
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
            // One short deadline for all: a peer that does not read costs at most this.
            let deadline = Instant::now() + Duration::from_millis(500);
            for s in peers {
                let _ = write_frame(s, Kind::Abort, self.seq.get(), &payload, deadline);
            }
        }
        *self.broken.borrow_mut() = Some((rank, reason.clone()));
        Error::PeerSetupFailed {
            step: "socket store",
            rank: Some(rank),
            reason,
        }
    }

    fn io_failure(&self, peer: usize, e: io::Error) -> Error {
        let (step, started) = self.step.get();
        self.fail(
            peer,
            format!(
                "{} ({step}, exchange #{})",
                describe_io(peer, &e, started.elapsed(), self.timeout),
                self.seq.get()
            ),
        )
    }

    /// A leaf's send to rank 0 failed. Rank 0 closes a connection right after it refuses or
    /// aborts it, so the send can fail before the leaf reads why: a frame already queued on the
    /// socket is read (without waiting) and reported in place of the bare failure.
    fn leaf_send_failed(&self, root: &UnixStream, e: io::Error) -> Error {
        let queued = read_frame(root, Instant::now() + Duration::from_millis(20));
        match queued {
            Ok((header, payload)) if matches!(header.kind, Kind::Refused | Kind::Abort) => {
                self.unexpected(header, &payload, header.kind, header.seq)
            }
            _ => self.io_failure(0, e),
        }
    }

    /// A frame a leaf received from rank 0 that is not the expected answer.
    fn unexpected(&self, header: Header, payload: &[u8], expected: Kind, seq: u64) -> Error {
        if header.kind == Kind::Refused {
            let reason = String::from_utf8_lossy(payload).into_owned();
            *self.broken.borrow_mut() = Some((0, reason.clone()));
            return Error::PeerRefused { reason };
        }
        if header.kind == Kind::Abort {
            let (rank, reason) =
                decode_abort(payload).unwrap_or((0, "rank 0 aborted without a reason".to_string()));
            *self.broken.borrow_mut() = Some((rank, reason.clone()));
            return Error::PeerSetupFailed {
                step: "socket store",
                rank: Some(rank),
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
        let started = Instant::now();
        self.gather(bytes, "all-gather", started, started + self.timeout)
    }

    fn all_gather_fds(&self, fd: BorrowedFd<'_>) -> Result<Vec<OwnedFd>> {
        let seq = self.next_seq()?;
        let started = Instant::now();
        self.step.set(("descriptor all-gather", started));
        let deadline = started + self.timeout;
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
                    if check_sequence(&header, Kind::Fd, seq)
                        .and_then(|()| check_descriptors(Kind::Fd, self.world, got.len()))
                        .is_err()
                    {
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
                    .map_err(|e| self.leaf_send_failed(root, e))?;
                drop(own);
                let (header, payload, fds) =
                    recv_frame_with_fds(root, deadline, self.world).map_err(|e| self.io_failure(0, e))?;
                if check_sequence(&header, Kind::Fds, seq).is_err() {
                    return Err(self.unexpected(header, &payload, Kind::Fds, seq));
                }
                if check_descriptors(Kind::Fds, self.world, fds.len()).is_err() {
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

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl SocketStore {
    /// One all-gather, every wait bounded by `deadline`.
    fn gather(
        &self,
        bytes: &[u8],
        step: &'static str,
        started: Instant,
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>> {
        let seq = self.next_seq()?;
        self.step.set((step, started));
        match &self.links {
            Links::Alone => Ok(vec![bytes.to_vec()]),
            Links::Root(peers) => {
                let mut parts = vec![bytes.to_vec()];
                for (i, s) in peers.iter().enumerate() {
                    let q = i + 1;
                    let (header, payload) = read_frame(s, deadline).map_err(|e| self.io_failure(q, e))?;
                    if check_sequence(&header, Kind::Bytes, seq).is_err() {
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
                write_frame(root, Kind::Bytes, seq, bytes, deadline)
                    .map_err(|e| self.leaf_send_failed(root, e))?;
                let (header, payload) = read_frame(root, deadline).map_err(|e| self.io_failure(0, e))?;
                if check_sequence(&header, Kind::Gathered, seq).is_err() {
                    return Err(self.unexpected(header, &payload, Kind::Gathered, seq));
                }
                decode_gathered(&payload, self.world).map_err(|e| {
                    self.fail(
                        0,
                        format!("rank 0's all-gather answer was refused: {e} (mismatched crate versions?)"),
                    )
                })
            }
        }
    }
}

/// Rank 0: listen, then admit a hello from every other rank through a [`Gate`] (every
/// unauthenticated connection handled concurrently, none for longer than its greeting).
fn accept_all(
    address: &StoreAddress,
    secret: &Secret,
    world: usize,
    started: Instant,
    timeout: Duration,
    options: &StoreOptions,
) -> Result<Vec<UnixStream>> {
    let deadline = started + timeout;
    let listener = listen(address, deadline)?;
    // Removes the socket file on every way out of this function: peers are connected (or the
    // group failed) by then, so nobody needs it again.
    let _cleanup = RemoveOnDrop(address.file());
    let address = &address.redacted();
    let greeting = Greeting {
        header: encode_header(Header {
            kind: Kind::Hello,
            seq: 0,
            len: HELLO_BYTES as u64,
        }),
        any_seq: false,
        fds: 0,
        tell: true,
    };
    let mut gate = Gate::new(&listener, *options, greeting).map_err(|e| Error::Bootstrap {
        reason: format!("cannot make the listening socket at {address} non-blocking: {e}"),
    })?;
    let mut peers: Vec<Option<UnixStream>> = (1..world).map(|_| None).collect();
    let abort_all = |peers: &[Option<UnixStream>], rank: usize, reason: &str| {
        let payload = abort_payload(rank, reason);
        let until = Instant::now() + Duration::from_millis(500);
        for s in peers.iter().flatten() {
            let _ = write_frame(s, Kind::Abort, 0, &payload, until);
        }
    };
    let mut arrivals = Vec::new();
    while peers.iter().any(Option::is_none) {
        if Instant::now() >= deadline {
            let missing: Vec<usize> = peers
                .iter()
                .enumerate()
                .filter(|(_, p)| p.is_none())
                .map(|(i, _)| i + 1)
                .collect();
            let reason = format!(
                "rank 0 waited {:.1?} (timeout {timeout:?}) at {address} but rank(s) {missing:?} never \
                 connected{}",
                started.elapsed(),
                gate.refusals.summary()
            );
            abort_all(&peers, missing[0], &reason);
            return Err(Error::PeerSetupFailed {
                step: "socket store",
                rank: Some(missing[0]),
                reason,
            });
        }
        gate.step(deadline, &mut arrivals).map_err(|e| Error::Bootstrap {
            reason: format!("accept on {address} failed after {:.1?}: {e}", started.elapsed()),
        })?;
        for arrival in arrivals.drain(..) {
            let (rank, their_world) = match decode_hello(&arrival.payload, secret) {
                Ok(v) => v,
                Err(why) => {
                    // A whole hello with a wrong secret: tell it why (it is this user's
                    // process) and drop it; nothing else is ever sent to it.
                    let why = why.to_string();
                    refuse(&arrival.stream, &why);
                    gate.refusals.note(Refusal::Rejected, || {
                        format!("{}: {why}", arrival.creds.describe())
                    });
                    continue;
                }
            };
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
            let stream = arrival.stream;
            if let Some(reason) = problem {
                let _ = stream.set_nonblocking(false);
                let _ = write_frame(
                    &stream,
                    Kind::Abort,
                    0,
                    &abort_payload(0, &reason),
                    Instant::now() + Duration::from_millis(500),
                );
                abort_all(&peers, rank.min(world - 1), &reason);
                return Err(Error::PeerSetupFailed {
                    step: "socket store",
                    rank: Some(rank.min(world - 1)),
                    reason,
                });
            }
            // From here on every read and write of this rank's connection has a deadline.
            stream.set_nonblocking(false).map_err(|e| Error::Bootstrap {
                reason: format!("the connection of rank {rank} failed: {e}"),
            })?;
            peers[rank - 1] = Some(stream);
        }
    }
    Ok(peers.into_iter().flatten().collect())
}

/// Binds rank 0's socket. A socket file left by a dead run is replaced; the check for one is a
/// non-blocking connect, so a live listener with a full backlog (a squatter) is an error at
/// once rather than a wait.
fn listen(full: &StoreAddress, deadline: Instant) -> Result<UnixListener> {
    let address = &full.redacted();
    let addr = full.socket_addr().map_err(|e| Error::Bootstrap {
        reason: format!("{address} is not a valid Unix socket address: {e}"),
    })?;
    let in_use = |why: &str| Error::Bootstrap {
        reason: format!(
            "{address} is in use by another live socket ({why}; another job, or a squatter?): give each \
             group its own address, in a directory only this user can write to"
        ),
    };
    loop {
        match UnixListener::bind_addr(&addr) {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                let Some(file) = full.file() else {
                    return Err(in_use("the abstract name is bound"));
                };
                let target = unix_addr(&addr).map_err(|e| Error::Bootstrap {
                    reason: format!("{address} is not a valid Unix socket address: {e}"),
                })?;
                match dial(&target) {
                    Dial::Connected(_) => return Err(in_use("it accepts connections")),
                    Dial::Retry(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                        // Nobody listens: left over from a dead run.
                        let _ = std::fs::remove_file(&file);
                    }
                    // Gone meanwhile: bind again.
                    Dial::Retry(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Dial::Retry(e) | Dial::Failed(e) => return Err(in_use(&e.to_string())),
                }
                if Instant::now() >= deadline {
                    return Err(in_use("it kept coming back"));
                }
            }
            Err(e) => {
                return Err(Error::Bootstrap {
                    reason: format!("cannot listen on {address}: {e}"),
                })
            }
        }
    }
}

/// Any rank but 0: connect (non-blocking, retrying until rank 0 listens and has room in its
/// backlog, never past the deadline) and say hello.
fn connect(
    address: &StoreAddress,
    secret: &Secret,
    rank: usize,
    world: usize,
    started: Instant,
    timeout: Duration,
    options: &StoreOptions,
) -> Result<UnixStream> {
    let deadline = started + timeout;
    let shown = address.redacted();
    let addr = address
        .socket_addr()
        .and_then(|a| unix_addr(&a))
        .map_err(|e| Error::Bootstrap {
            reason: format!("{shown} is not a valid Unix socket address: {e}"),
        })?;
    let stream = loop {
        match dial(&addr) {
            Dial::Connected(s) => break s,
            Dial::Retry(e) => {
                if Instant::now() >= deadline {
                    return Err(Error::PeerSetupFailed {
                        step: "socket store",
                        rank: Some(0),
                        reason: format!(
                            "rank {rank} could not connect to rank 0 at {shown}: tried for {:.1?} (timeout \
                             {timeout:?}), last because {e}: is rank 0 running, with the same address?",
                            started.elapsed()
                        ),
                    });
                }
                std::thread::sleep(DIAL_RETRY);
            }
            Dial::Failed(e) => {
                return Err(Error::Bootstrap {
                    reason: format!("rank {rank} cannot connect to {shown}: {e}"),
                })
            }
        }
    };
    // The secret goes only to a listener of an admitted user.
    frames::admit(&stream, options).map_err(|why| Error::PeerRefused {
        reason: format!("the process listening on {shown} is not admitted ({why}); nothing was sent to it"),
    })?;
    let hello = encode_hello(rank, world, secret);
    stream
        .set_nonblocking(false)
        .and_then(|()| write_frame(&stream, Kind::Hello, 0, &hello, deadline))
        .map_err(|e| Error::PeerSetupFailed {
            step: "socket store",
            rank: Some(0),
            reason: format!(
                "{} (rank {rank} sending its hello)",
                describe_io(0, &e, started.elapsed(), timeout)
            ),
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

// ---- Messages -------------------------------------------------------------------------------

fn mismatch(peer: usize, header: Header, expected: Kind, seq: u64) -> String {
    format!(
        "rank {peer} sent {:?} #{} while this rank expected {expected:?} #{seq}: the ranks are at different \
         setup steps (every rank must make the same sequence of calls)",
        header.kind, header.seq
    )
}

fn describe_io(peer: usize, e: &io::Error, elapsed: Duration, timeout: Duration) -> String {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
            "rank {peer} did not answer: waited {elapsed:.1?} (timeout {timeout:?}; stuck, or at a different \
             setup step)"
        ),
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted => {
            format!("rank {peer} closed its connection after {elapsed:.1?} (the process exited or crashed)")
        }
        _ => format!("talking to rank {peer} failed after {elapsed:.1?}: {e}"),
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

/// Fills `buf`, collecting any descriptors that arrive with the bytes into `fds` (so that
/// they are closed, not leaked, when unexpected).
fn read_exact_by(
    stream: &UnixStream,
    buf: &mut [u8],
    deadline: Instant,
    fds: &mut Vec<OwnedFd>,
) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        arm(stream, deadline)?;
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_RANKS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = match recvmsg(
            stream,
            &mut [IoSliceMut::new(&mut buf[done..])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(msg) => msg,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        if got.flags.contains(ReturnFlags::CTRUNC) {
            return Err(io::Error::other(
                "a peer attached more descriptors than one message may carry (they were closed)",
            ));
        }
        if got.bytes == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        done += got.bytes;
    }
    Ok(())
}

/// Reads one frame: a header (payload at most `max_payload` bytes, checked before anything is
/// allocated), then the payload, grown only as bytes arrive. More than `max_fds` descriptors
/// is an error; every descriptor received is closed on any error.
pub(crate) fn read_frame_bounded(
    stream: &UnixStream,
    deadline: Instant,
    max_payload: usize,
    max_fds: usize,
) -> io::Result<(Header, Vec<u8>, Vec<OwnedFd>)> {
    const CHUNK: usize = 64 << 10;
    let mut fds = Vec::new();
    let mut raw = [0u8; HEADER_BYTES];
    read_exact_by(stream, &mut raw, deadline, &mut fds)?;
    let header = decode_header(&raw, max_payload).map_err(io::Error::other)?;
    let len = header.len as usize;
    let mut payload = Vec::new();
    while payload.len() < len {
        let at = payload.len();
        payload.resize(len.min(at + CHUNK), 0);
        read_exact_by(stream, &mut payload[at..], deadline, &mut fds)?;
    }
    if fds.len() > max_fds {
        return Err(io::Error::other(frames::WireError::UnexpectedDescriptors {
            got: fds.len(),
            expected: max_fds,
        }));
    }
    Ok((header, payload, fds))
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

/// A frame that carries no descriptors (any attached are closed, and refused).
pub(crate) fn read_frame(stream: &UnixStream, deadline: Instant) -> io::Result<(Header, Vec<u8>)> {
    let (header, payload, _) = read_frame_bounded(stream, deadline, MAX_FRAME_BYTES, 0)?;
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
    read_frame_bounded(stream, deadline, MAX_FRAME_BYTES, max_fds)
}

/// 16 bytes that make a socket *name* unique: from the OS (`getrandom`), degrading to time
/// and pid if the OS generator fails (it does not on any supported Linux). Names are public
/// (`/proc/net/unix`), so this is never used for a secret or token: those come from
/// [`frames::random_secret`], which fails instead.
pub(crate) fn random_token() -> [u8; 16] {
    frames::random_secret().unwrap_or_else(|_| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut out = [0u8; 16];
        out[..12].copy_from_slice(&t.to_le_bytes()[..12]);
        out[12..].copy_from_slice(&std::process::id().to_le_bytes());
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    fn unique() -> StoreAddress {
        StoreAddress::unique("symm-allreduce-test").unwrap()
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
        assert_eq!(decode_header(&encode_header(h), MAX_FRAME_BYTES).unwrap(), h);
        let mut bad = encode_header(h);
        bad[0] ^= 1;
        assert_eq!(
            decode_header(&bad, MAX_FRAME_BYTES),
            Err(frames::WireError::BadMagic)
        );
        let mut bad = encode_header(h);
        bad[4] = 99;
        assert!(decode_header(&bad, MAX_FRAME_BYTES).is_err());
        let huge = encode_header(Header {
            len: MAX_FRAME_BYTES as u64 + 1,
            ..h
        });
        assert!(decode_header(&huge, MAX_FRAME_BYTES).is_err());

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
    fn addresses_carry_a_secret_and_hide_it_in_messages() {
        let a = unique();
        let text = a.to_string();
        assert_eq!(StoreAddress::parse(&text), a);
        assert!(a.secret().is_ok());
        assert!(!a.redacted().contains(&hex::encode(a.secret().unwrap())));
        let bare = StoreAddress::parse("@no-secret");
        assert!(matches!(bare.secret(), Err(Error::MissingSecret { .. })));
        let e = SocketStore::new(&bare, 0, 1, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, Error::MissingSecret { .. }), "{e}");
        assert!(e.to_string().contains("StoreAddress::unique"), "{e}");
        assert!(matches!(
            StoreAddress::parse("@x#zz").secret(),
            Err(Error::MissingSecret { .. })
        ));
    }

    #[test]
    fn addresses_come_from_the_environment_or_a_private_file() {
        use std::os::unix::fs::PermissionsExt;
        let a = unique();
        let var = format!("SYMM_TEST_ADDR_{}", hex::encode(random_token()));
        std::env::set_var(&var, a.to_string());
        assert_eq!(StoreAddress::from_env(&var).unwrap(), a);
        std::env::remove_var(&var);
        assert!(matches!(
            StoreAddress::from_env(&var),
            Err(Error::Bootstrap { .. })
        ));
        let path = std::env::temp_dir().join(format!("symm-addr-{}", hex::encode(random_token())));
        std::fs::write(&path, format!("{a}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = StoreAddress::from_file(&path).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(StoreAddress::from_file(&path).unwrap(), a);
        std::fs::remove_file(&path).unwrap();
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
        let dir = std::env::temp_dir().join(format!("symm-store-{}", hex::encode(random_token())));
        std::fs::create_dir_all(&dir).unwrap();
        let path = StoreAddress::Path(dir.join("store.sock")).with_secret().unwrap();
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
        assert!(!path.file().unwrap().exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn descriptors_travel_by_scm_rights() {
        let dir = std::env::temp_dir().join(format!("symm-fds-{}", hex::encode(random_token())));
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
    fn a_refusal_is_reported_even_when_the_leaf_sends_after_rank_0_closed() {
        // Rank 0 refuses and closes before the leaf's first exchange: the leaf's send fails
        // (EPIPE), yet the refusal queued on its socket is what it reports.
        let (leaf_end, root_end) = UnixStream::pair().unwrap();
        refuse(&root_end, "the launch secret does not match");
        drop(root_end);
        let store = SocketStore {
            rank: 1,
            world: 2,
            timeout: Duration::from_secs(1),
            links: Links::Leaf(leaf_end),
            seq: Cell::new(0),
            broken: RefCell::new(None),
            step: Cell::new(("joining", Instant::now())),
        };
        let e = store.all_gather(b"x").unwrap_err();
        assert!(matches!(e, Error::PeerRefused { .. }), "{e}");
        assert!(e.to_string().contains("secret"), "{e}");
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
