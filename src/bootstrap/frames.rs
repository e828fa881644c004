//! The bootstrap sockets' wire format and admission rules, as pure functions over byte slices.
//!
//! Everything a peer sends is parsed here, before it is trusted: bounded lengths (checked
//! before anything is allocated), known kinds, one protocol version, exact descriptor counts,
//! the launch secret and the peer's credentials. No function here panics on any input, and
//! none allocates more than the bytes it was given (plus a short error message); the fuzz
//! suite in `tests/bootstrap_fuzz.rs` checks both over random and mutated frames.
//!
//! Public only so that the tests can reach it; not a stable API.

use std::os::fd::AsFd;
use std::sync::OnceLock;

use crate::wire::{Reader, Wire, Writer};

/// The protocol version every frame header carries; a peer with another is refused.
pub const PROTOCOL_VERSION: u16 = 2;
/// `magic: u32 | kind: u16 | version: u16 | seq: u64 | payload length: u64`, little-endian.
pub const HEADER_BYTES: usize = 24;
/// Largest payload accepted in any frame (setup messages are far smaller). Checked against
/// the header before a byte of the payload is allocated.
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// Largest payload accepted from a connection that has not proved the secret yet.
pub const MAX_HELLO_BYTES: usize = 64;
/// Bytes of a launch secret (and of the NCCL path's per-socket token).
pub const SECRET_BYTES: usize = 16;
/// `rank: u32 | world: u32 | secret: 16 bytes`.
pub const HELLO_BYTES: usize = 8 + SECRET_BYTES;
/// The fd exchange's offer: `rank: u32 | token: 16 bytes`.
pub const OFFER_BYTES: usize = 4 + SECRET_BYTES;

const MAGIC: u32 = u32::from_le_bytes(*b"SYMS");

/// A launch secret or token.
pub type Secret = [u8; SECRET_BYTES];

/// Why bytes from a peer were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the structure needs.
    #[error("truncated message: {got} bytes where {needed} are needed")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes present.
        got: usize,
    },
    /// Trailing or inconsistent bytes.
    #[error("malformed {what}")]
    Malformed {
        /// Which structure.
        what: &'static str,
    },
    /// Not one of this crate's frames.
    #[error("not a symm-allreduce frame (bad magic): is another program on this socket?")]
    BadMagic,
    /// Another protocol version.
    #[error(
        "peer speaks bootstrap protocol version {got}, this rank version {expected}: run the same \
         symm-allreduce build on every rank"
    )]
    WrongVersion {
        /// The peer's.
        got: u16,
        /// This build's.
        expected: u16,
    },
    /// A kind this version does not know.
    #[error("unknown frame kind {0}")]
    UnknownKind(u16),
    /// A payload over the bound.
    #[error("a frame of {len} bytes is over the {max}-byte limit")]
    Oversized {
        /// The announced length.
        len: u64,
        /// The bound.
        max: usize,
    },
    /// The launch secret (or token) does not match.
    #[error(
        "wrong launch secret: pass every rank the full store address that the launcher created \
         (StoreAddress::unique), `#secret` included"
    )]
    WrongSecret,
    /// A frame with another number of descriptors than its kind carries.
    #[error("{got} file descriptors attached where {expected} were expected (closed unused)")]
    UnexpectedDescriptors {
        /// Attached.
        got: usize,
        /// Expected.
        expected: usize,
    },
    /// A frame of another kind or step than expected (a rank at another step, or a replay).
    #[error("got {got:?} #{got_seq} where {expected:?} #{expected_seq} was expected")]
    OutOfSequence {
        /// What came.
        got: Kind,
        /// Its sequence number.
        got_seq: u64,
        /// What was expected.
        expected: Kind,
        /// The expected sequence number.
        expected_seq: u64,
    },
    /// A byte of a connection's first frame that no rank of this build sends there: the
    /// connection is dropped at that byte, before anything else is read.
    #[error(
        "byte {at} of the first frame is not what a rank sends there: another program, or another \
         symm-allreduce build (run the same build on every rank)"
    )]
    UnexpectedByte {
        /// Its offset in the frame.
        at: usize,
    },
    /// A rank or world out of range.
    #[error("rank {rank} of a world of {world} is out of range")]
    BadRank {
        /// The rank.
        rank: usize,
        /// The world.
        world: usize,
    },
}

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A leaf's rank, world and the launch secret, once, right after connecting.
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
    /// Rank 0 refused this connection (reason as text); nothing else follows.
    Refused = 7,
}

impl Kind {
    /// The kind with this code.
    pub fn from_code(v: u16) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Bytes,
            3 => Kind::Gathered,
            4 => Kind::Fd,
            5 => Kind::Fds,
            6 => Kind::Abort,
            7 => Kind::Refused,
            _ => return None,
        })
    }

    /// Descriptors a frame of this kind carries in a world of `world`.
    pub fn descriptors(self, world: usize) -> usize {
        match self {
            Kind::Fd => 1,
            Kind::Fds => world,
            _ => 0,
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What follows.
    pub kind: Kind,
    /// The exchange it belongs to.
    pub seq: u64,
    /// Payload bytes.
    pub len: u64,
}

/// The `T` at byte `at` of `b`.
fn at<T: Wire>(b: &[u8], at: usize) -> Option<T> {
    Reader::new(b.get(at..)?).take()
}

/// The header's bytes.
pub fn encode_header(h: Header) -> [u8; HEADER_BYTES] {
    let mut w = Writer::with_capacity(HEADER_BYTES);
    w.put(&MAGIC)
        .put(&(h.kind as u16))
        .put(&PROTOCOL_VERSION)
        .put(&h.seq)
        .put(&h.len);
    w.finish().try_into().unwrap_or([0; HEADER_BYTES])
}

/// Parses a header, refusing payloads over `max` bytes.
pub fn decode_header(b: &[u8], max: usize) -> Result<Header, WireError> {
    if b.len() < HEADER_BYTES {
        return Err(WireError::Truncated {
            needed: HEADER_BYTES,
            got: b.len(),
        });
    }
    let truncated = WireError::Truncated {
        needed: HEADER_BYTES,
        got: b.len(),
    };
    if at::<u32>(b, 0).ok_or(truncated.clone())? != MAGIC {
        return Err(WireError::BadMagic);
    }
    let version = at::<u16>(b, 6).ok_or(truncated.clone())?;
    if version != PROTOCOL_VERSION {
        return Err(WireError::WrongVersion {
            got: version,
            expected: PROTOCOL_VERSION,
        });
    }
    let code = at::<u16>(b, 4).ok_or(truncated.clone())?;
    let kind = Kind::from_code(code).ok_or(WireError::UnknownKind(code))?;
    let len = at::<u64>(b, 16).ok_or(truncated.clone())?;
    if len > max as u64 {
        return Err(WireError::Oversized { len, max });
    }
    Ok(Header {
        kind,
        seq: at::<u64>(b, 8).ok_or(truncated)?,
        len,
    })
}

/// Checks the first bytes of a connection's first frame against the header a rank sends
/// (`expected`); the sequence number (bytes 8..16) is not compared when `any_seq`. `got` may
/// be any prefix of the frame: bytes past the header are not looked at. Lets a reader drop a
/// connection at the first byte that cannot be a rank's.
pub fn check_header_prefix(
    got: &[u8],
    expected: &[u8; HEADER_BYTES],
    any_seq: bool,
) -> Result<(), WireError> {
    for (at, (g, e)) in got.iter().zip(expected.iter()).enumerate() {
        if any_seq && (8..16).contains(&at) {
            continue;
        }
        if g != e {
            return Err(WireError::UnexpectedByte { at });
        }
    }
    Ok(())
}

/// Checks that a frame is the one expected at this step (a frame of an earlier step, replayed,
/// or of another kind is refused).
pub fn check_sequence(h: &Header, expected: Kind, seq: u64) -> Result<(), WireError> {
    if h.kind == expected && h.seq == seq {
        Ok(())
    } else {
        Err(WireError::OutOfSequence {
            got: h.kind,
            got_seq: h.seq,
            expected,
            expected_seq: seq,
        })
    }
}

/// Checks the number of descriptors attached to a frame of `kind`.
pub fn check_descriptors(kind: Kind, world: usize, got: usize) -> Result<(), WireError> {
    let expected = kind.descriptors(world);
    if got == expected {
        Ok(())
    } else {
        Err(WireError::UnexpectedDescriptors { got, expected })
    }
}

/// Compares secrets in time independent of where they differ.
pub fn secrets_match(a: &Secret, b: &[u8]) -> bool {
    b.len() == SECRET_BYTES && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A leaf's hello.
pub fn encode_hello(rank: usize, world: usize, secret: &Secret) -> Vec<u8> {
    let mut w = Writer::with_capacity(HELLO_BYTES);
    w.put(&(rank as u32)).put(&(world as u32)).put(secret);
    w.finish()
}

/// Parses a hello and proves its secret; returns the peer's (rank, world).
pub fn decode_hello(b: &[u8], secret: &Secret) -> Result<(usize, usize), WireError> {
    if b.len() != HELLO_BYTES {
        return Err(if b.len() < HELLO_BYTES {
            WireError::Truncated {
                needed: HELLO_BYTES,
                got: b.len(),
            }
        } else {
            WireError::Malformed { what: "hello" }
        });
    }
    if !secrets_match(secret, &b[8..]) {
        return Err(WireError::WrongSecret);
    }
    let bad = WireError::Malformed { what: "hello" };
    Ok((
        at::<u32>(b, 0).ok_or(bad.clone())? as usize,
        at::<u32>(b, 4).ok_or(bad)? as usize,
    ))
}

/// `count: u32`, then per rank `length: u64 | bytes`.
pub fn encode_gathered(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut w = Writer::with_capacity(4 + parts.iter().map(|p| p.len() + 8).sum::<usize>());
    w.put(&(parts.len() as u32));
    for p in parts {
        w.put(&(p.len() as u64)).raw(p);
    }
    w.finish()
}

/// Parses rank 0's all-gather answer for a world of `world`.
pub fn decode_gathered(b: &[u8], world: usize) -> Result<Vec<Vec<u8>>, WireError> {
    let count = at::<u32>(b, 0).ok_or(WireError::Truncated {
        needed: 4,
        got: b.len(),
    })? as usize;
    if count != world {
        return Err(WireError::BadRank { rank: count, world });
    }
    let bad = WireError::Malformed {
        what: "all-gather answer",
    };
    // First the lengths (no allocation), then the copies: never more than `b.len()` bytes.
    let mut at = 4usize;
    for _ in 0..count {
        let len = self::at::<u64>(b, at).ok_or(bad.clone())?;
        at = at
            .checked_add(8)
            .and_then(|a| a.checked_add(usize::try_from(len).ok()?))
            .filter(|&end| end <= b.len())
            .ok_or(bad.clone())?;
    }
    if at != b.len() {
        return Err(bad);
    }
    let mut parts = Vec::with_capacity(count.min(crate::kernels::abi::MAX_RANKS));
    let mut at = 4usize;
    for _ in 0..count {
        let len = self::at::<u64>(b, at).ok_or(bad.clone())? as usize;
        at += 8;
        parts.push(b.get(at..at + len).ok_or(bad.clone())?.to_vec());
        at += len;
    }
    Ok(parts)
}

/// An abort frame's payload.
pub fn encode_abort(rank: usize, reason: &str) -> Vec<u8> {
    let mut w = Writer::with_capacity(4 + reason.len());
    w.put(&(rank as u32)).raw(reason.as_bytes());
    w.finish()
}

/// Parses an abort frame's payload: the failing rank and why.
pub fn decode_abort(payload: &[u8]) -> Result<(usize, String), WireError> {
    let rank = at::<u32>(payload, 0).ok_or(WireError::Truncated {
        needed: 4,
        got: payload.len(),
    })?;
    Ok((
        rank as usize,
        String::from_utf8_lossy(payload.get(4..).unwrap_or_default()).into_owned(),
    ))
}

/// The fd exchange's offer: who sends, proved by the receiver's token.
pub fn encode_offer(rank: usize, token: &Secret) -> Vec<u8> {
    let mut w = Writer::with_capacity(OFFER_BYTES);
    w.put(&(rank as u32)).put(token);
    w.finish()
}

/// Parses an offer sent to `me` (of `world`) and proves its token; returns the sender.
pub fn decode_offer(b: &[u8], token: &Secret, me: usize, world: usize) -> Result<usize, WireError> {
    if b.len() != OFFER_BYTES {
        return Err(WireError::Truncated {
            needed: OFFER_BYTES,
            got: b.len(),
        });
    }
    if !secrets_match(token, &b[4..]) {
        return Err(WireError::WrongSecret);
    }
    let q = at::<u32>(b, 0).ok_or(WireError::Malformed { what: "offer" })? as usize;
    if q >= world || q == me {
        return Err(WireError::BadRank { rank: q, world });
    }
    Ok(q)
}

/// A rank's announcement in the fd exchange: `1 | token | socket name`, or `0 | why not`.
pub fn encode_announce(token: &Secret, name: &str) -> Vec<u8> {
    let mut w = Writer::with_capacity(1 + SECRET_BYTES + name.len());
    w.put(&1u8).put(token).raw(name.as_bytes());
    w.finish()
}

/// Parses an announcement: the peer's token and socket name, or the peer's failure.
pub fn decode_announce(a: &[u8]) -> Result<(Secret, &str), Result<String, WireError>> {
    match a.first() {
        Some(1) if a.len() > 1 + SECRET_BYTES => {
            let token: Secret = a[1..1 + SECRET_BYTES]
                .try_into()
                .map_err(|_| Err(WireError::Malformed { what: "announcement" }))?;
            let name = std::str::from_utf8(&a[1 + SECRET_BYTES..])
                .map_err(|_| Err(WireError::Malformed { what: "announcement" }))?;
            Ok((token, name))
        }
        Some(0) => Err(Ok(String::from_utf8_lossy(&a[1..]).into_owned())),
        _ => Err(Err(WireError::Malformed { what: "announcement" })),
    }
}

/// Splits `name#hexsecret` into the name and the secret (`None` when there is no `#`).
pub fn split_secret(s: &str) -> (&str, Option<Result<Secret, WireError>>) {
    match s.rsplit_once('#') {
        None => (s, None),
        Some((name, hexed)) => {
            let mut secret = [0u8; SECRET_BYTES];
            let parsed = hex::decode_to_slice(hexed, &mut secret)
                .map(|()| secret)
                .map_err(|_| WireError::Malformed {
                    what: "launch secret (expected 32 hex digits after `#`)",
                });
            (name, Some(parsed))
        }
    }
}

/// Fresh random bytes from the OS.
pub fn random_secret() -> std::io::Result<Secret> {
    let mut s = [0u8; SECRET_BYTES];
    getrandom::fill(&mut s).map_err(|e| std::io::Error::other(format!("getrandom failed: {e}")))?;
    Ok(s)
}

// ---- Peer credentials -------------------------------------------------------------------------

/// Who is at the other end of a Unix socket, as the kernel recorded it (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCredentials {
    /// Process id as this process sees it; **0 when the peer lives in a pid namespace this
    /// process cannot see** (a container with its own pid namespace). Informational only: no
    /// admission decision rests on it, since it is best effort across namespaces.
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

impl PeerCredentials {
    /// `pid N`, or `a process in another pid namespace` when the kernel reported pid 0.
    pub fn describe(&self) -> String {
        if self.pid == 0 {
            "a process in another pid namespace".to_string()
        } else {
            format!("pid {}", self.pid)
        }
    }
}

/// Decides whether a peer may join: `Ok` admits it, `Err` says why not.
pub type PeerCheck = fn(&PeerCredentials, &StoreOptions) -> Result<(), String>;

/// Who may join a bootstrap socket.
#[derive(Debug, Clone, Copy)]
pub struct StoreOptions {
    /// Also admit peers running as root (uid 0). Off by default.
    pub allow_root: bool,
    /// The check every accepted and every connected socket passes before anything is read
    /// from or sent to it. [`same_user`] by default; tests replace it to simulate a foreign
    /// user.
    pub check_peer: PeerCheck,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            allow_root: false,
            check_peer: same_user,
        }
    }
}

/// The default [`PeerCheck`]: the peer runs as this process's user (or as root, with
/// [`StoreOptions::allow_root`]).
pub fn same_user(peer: &PeerCredentials, options: &StoreOptions) -> Result<(), String> {
    let me = own_uid();
    if Some(peer.uid) == me || (options.allow_root && peer.uid == 0) {
        return Ok(());
    }
    Err(match me {
        Some(me) => format!(
            "{} runs as uid {}, this job as uid {me}{}: only the job's own user may join",
            peer.describe(),
            peer.uid,
            if peer.uid == 0 {
                " (set StoreOptions::allow_root to admit root)"
            } else {
                ""
            }
        ),
        None => "this process's own uid could not be read, so no peer can be admitted".to_string(),
    })
}

/// This process's effective uid, read the same way as a peer's (over a socket pair), so
/// that no extra dependency feature is needed.
pub(crate) fn own_uid() -> Option<u32> {
    static UID: OnceLock<Option<u32>> = OnceLock::new();
    *UID.get_or_init(|| {
        let (a, _b) = std::os::unix::net::UnixStream::pair().ok()?;
        peer_credentials(&a).ok().map(|c| c.uid)
    })
}

/// The kernel's record of the peer of a connected Unix socket (`SO_PEERCRED`).
///
/// Read with `getsockopt` directly rather than through a typed wrapper: the kernel reports
/// pid 0 for a peer in a pid namespace this process cannot see, and that value must not land
/// in a type that may never be zero.
pub fn peer_credentials(socket: impl AsFd) -> std::io::Result<PeerCredentials> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a valid, writable `ucred` of `len` bytes that outlives the call, and
    // the descriptor is borrowed for the call's duration; the kernel writes at most `len`
    // bytes and reports how many in `len`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(std::io::Error::other(format!(
            "SO_PEERCRED returned {len} bytes, not a ucred"
        )));
    }
    Ok(PeerCredentials {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// Reads the peer's credentials and applies `options.check_peer`.
pub fn admit(socket: impl AsFd, options: &StoreOptions) -> Result<PeerCredentials, String> {
    let creds =
        peer_credentials(socket).map_err(|e| format!("the peer's credentials could not be read ({e})"))?;
    (options.check_peer)(&creds, options)?;
    Ok(creds)
}
