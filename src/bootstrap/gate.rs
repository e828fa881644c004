//! The two socket mechanisms every bootstrap listener and dialer shares, so that no local
//! process can make a rank wait longer than the caller's timeout:
//!
//! * [`dial`]: a non-blocking `connect`. A full listen backlog (`EAGAIN`), a socket that does
//!   not exist yet or refuses are answered at once, never waited for in the kernel; the
//!   caller retries until its own deadline.
//! * [`Gate`]: the listening side. One `poll` loop over the listener and every connection that
//!   has not sent its first frame yet (at most [`MAX_PENDING`], the oldest dropped first). An
//!   accepted connection passes the uid check before a byte is read; then at most one frame
//!   header and a fixed-size greeting are read from it, within [`GREETING_WAIT`], and it is
//!   dropped at the first byte that no rank sends there. Refusals are counted, not stored: a
//!   flood of connections costs neither memory nor another connection's time.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{
    connect, recvmsg, send, socket_with, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags,
    ReturnFlags, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

use super::frames::{
    self, check_header_prefix, encode_header, Header, Kind, PeerCredentials, StoreOptions, HEADER_BYTES,
};

/// Connections that have not sent their first frame yet, at most. A newcomer beyond this
/// evicts the one that has waited longest (a rank's greeting follows its connect at once, so
/// the longest-silent connection is the least likely to be one).
pub(crate) const MAX_PENDING: usize = 64;
/// How long an admitted connection may take to send its whole first frame.
pub(crate) const GREETING_WAIT: Duration = Duration::from_secs(2);
/// Bytes of the largest first frame (a hello: header and 24 bytes).
pub(crate) const MAX_GREETING: usize = 64;
/// Connections accepted per wake-up before pending greetings are read again.
const ACCEPT_BURST: usize = 256;
/// Refusal reasons kept word for word for the error message; the rest are only counted.
const KEPT_REASONS: usize = 3;
/// Pause between two connect attempts to a listener that is not there yet or is full.
pub(crate) const DIAL_RETRY: Duration = Duration::from_millis(2);

/// The outcome of one non-blocking connect.
pub(crate) enum Dial {
    /// Connected (the stream is non-blocking).
    Connected(UnixStream),
    /// Not now: no listener yet, or its backlog is full. Retry before the deadline.
    Retry(io::Error),
    /// Will not work.
    Failed(io::Error),
}

/// One non-blocking connect to `addr`: never waits in the kernel.
pub(crate) fn dial(addr: &SocketAddrUnix) -> Dial {
    let fd = match socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    ) {
        Ok(fd) => fd,
        Err(e) => return Dial::Failed(e.into()),
    };
    match connect(&fd, addr) {
        Ok(()) => Dial::Connected(UnixStream::from(fd)),
        Err(Errno::AGAIN) => Dial::Retry(io::Error::other("its listen backlog is full")),
        Err(e @ (Errno::NOENT | Errno::CONNREFUSED | Errno::INTR)) => Dial::Retry(e.into()),
        Err(e) => Dial::Failed(e.into()),
    }
}

/// The rustix form of a std socket address.
pub(crate) fn unix_addr(addr: &std::os::unix::net::SocketAddr) -> io::Result<SocketAddrUnix> {
    use std::os::linux::net::SocketAddrExt;
    if let Some(name) = addr.as_abstract_name() {
        return Ok(SocketAddrUnix::new_abstract_name(name)?);
    }
    match addr.as_pathname() {
        Some(p) => Ok(SocketAddrUnix::new(p)?),
        None => Err(io::Error::other("an unnamed socket address")),
    }
}

/// Sends a short refusal (a `Refused` frame with `reason`) without waiting: best effort, for a
/// connection of this user that is about to be dropped.
pub(crate) fn refuse(stream: &UnixStream, reason: &str) {
    let reason = &reason.as_bytes()[..reason.len().min(512)];
    let mut frame = encode_header(Header {
        kind: Kind::Refused,
        seq: 0,
        len: reason.len() as u64,
    })
    .to_vec();
    frame.extend_from_slice(reason);
    let _ = send(stream, &frame, SendFlags::NOSIGNAL | SendFlags::DONTWAIT);
}

/// Why a connection was dropped, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Another user (the uid check).
    Foreign,
    /// A byte no rank sends there.
    Malformed,
    /// Silent or too slow past [`GREETING_WAIT`].
    Slow,
    /// Closed before a whole greeting.
    Closed,
    /// Evicted by a newer connection while [`MAX_PENDING`] were waiting.
    Crowded,
    /// A whole greeting the caller refused (a wrong secret or token).
    Rejected,
}

/// Counts of refused connections and the first few reasons: constant memory whatever the
/// number of connections.
#[derive(Debug, Default, Clone)]
pub(crate) struct Refusals {
    counts: [u64; 6],
    first: Vec<String>,
}

impl Refusals {
    /// Counts one refusal; `reason` is only formatted while fewer than a few are kept.
    pub(crate) fn note(&mut self, why: Refusal, reason: impl FnOnce() -> String) {
        self.counts[why as usize] += 1;
        if self.first.len() < KEPT_REASONS {
            self.first.push(reason());
        }
    }

    /// Connections refused.
    pub(crate) fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// ` (refused N connection(s): …; first reasons: …)`, or nothing when none was refused.
    pub(crate) fn summary(&self) -> String {
        if self.total() == 0 {
            return String::new();
        }
        let labels = [
            "of another user",
            "with a malformed first frame",
            "silent or too slow",
            "closed early",
            "evicted while too many waited",
            "with a wrong secret or token",
        ];
        let parts: Vec<String> = self
            .counts
            .iter()
            .zip(labels)
            .filter(|(n, _)| **n > 0)
            .map(|(n, l)| format!("{n} {l}"))
            .collect();
        format!(
            " (refused {} connection(s): {}; first reasons: {})",
            self.total(),
            parts.join(", "),
            self.first.join("; ")
        )
    }
}

/// What an admitted connection's first frame must look like.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Greeting {
    /// The header a rank sends.
    pub header: [u8; HEADER_BYTES],
    /// Whether the header's sequence number varies (it carries the sender's rank).
    pub any_seq: bool,
    /// Descriptors the frame carries.
    pub fds: usize,
    /// Send a `Refused` frame with the reason before dropping a malformed connection (never
    /// to another user).
    pub tell: bool,
}

impl Greeting {
    fn len(&self) -> usize {
        HEADER_BYTES + u64::from_le_bytes(self.header[16..24].try_into().unwrap_or_default()) as usize
    }
}

/// A whole first frame from an admitted connection.
pub(crate) struct Arrival {
    /// The connection (non-blocking).
    pub stream: UnixStream,
    /// Its credentials (as the uid check saw them).
    pub creds: PeerCredentials,
    /// The frame's payload (the bytes after the header).
    pub payload: Vec<u8>,
    /// The descriptors that came with it (exactly [`Greeting::fds`]).
    pub fds: Vec<OwnedFd>,
}

struct Pending {
    stream: UnixStream,
    creds: PeerCredentials,
    buf: [u8; MAX_GREETING],
    got: usize,
    fds: Vec<OwnedFd>,
    since: Instant,
}

enum Progress {
    Waiting,
    Done,
    Dropped(Refusal, String),
}

/// The listening side: see the module documentation.
pub(crate) struct Gate<'l> {
    listener: &'l UnixListener,
    options: StoreOptions,
    greeting: Greeting,
    pending: Vec<Pending>,
    /// What was refused so far.
    pub refusals: Refusals,
}

impl<'l> Gate<'l> {
    /// A gate on `listener`, which it makes non-blocking.
    pub(crate) fn new(
        listener: &'l UnixListener,
        options: StoreOptions,
        greeting: Greeting,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        debug_assert!(greeting.len() <= MAX_GREETING);
        Ok(Gate {
            listener,
            options,
            greeting,
            pending: Vec::with_capacity(MAX_PENDING + 1),
            refusals: Refusals::default(),
        })
    }

    /// Connections admitted by uid and still sending their first frame.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Waits at most until `until` for activity on the listener or a pending connection, then
    /// accepts what is queued and reads what has arrived. Whole first frames are appended to
    /// `done`. Errors only when the listener itself fails.
    pub(crate) fn step(&mut self, until: Instant, done: &mut Vec<Arrival>) -> io::Result<()> {
        let now = Instant::now();
        let wake = self
            .pending
            .iter()
            .map(|p| p.since + GREETING_WAIT)
            .fold(until, Instant::min);
        let wait = wake.saturating_duration_since(now);
        {
            let mut fds = Vec::with_capacity(1 + self.pending.len());
            fds.push(PollFd::new(self.listener, PollFlags::IN));
            for p in &self.pending {
                fds.push(PollFd::new(&p.stream, PollFlags::IN));
            }
            let ts = Timespec::try_from(wait).unwrap_or(Timespec {
                tv_sec: 1,
                tv_nsec: 0,
            });
            match poll(&mut fds, Some(&ts)) {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        for _ in 0..ACCEPT_BURST {
            match self.listener.accept() {
                Ok((stream, _)) => self.admit(stream, done),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => match e.raw_os_error().map(Errno::from_raw_os_error) {
                    Some(Errno::INTR | Errno::CONNABORTED | Errno::PROTO) => {}
                    // Out of descriptors or memory: leave the rest queued, retry next time.
                    Some(Errno::MFILE | Errno::NFILE | Errno::NOBUFS | Errno::NOMEM) => break,
                    _ => return Err(e),
                },
            }
        }
        let now = Instant::now();
        let mut i = 0;
        while i < self.pending.len() {
            if !self.settle(i, now, done) {
                i += 1;
            }
        }
        Ok(())
    }

    /// Reads what has arrived on pending connection `i` and hands it on when whole, or drops
    /// it when malformed, closed or out of time. Returns whether it left the table.
    fn settle(&mut self, i: usize, now: Instant, done: &mut Vec<Arrival>) -> bool {
        let progress = match self.read_some(i) {
            Progress::Waiting if now >= self.pending[i].since + GREETING_WAIT => Progress::Dropped(
                Refusal::Slow,
                format!(
                    "{} sent {} of {} bytes within {GREETING_WAIT:?}",
                    self.pending[i].creds.describe(),
                    self.pending[i].got,
                    self.greeting.len()
                ),
            ),
            p => p,
        };
        match progress {
            Progress::Waiting => false,
            Progress::Done => {
                let p = self.pending.swap_remove(i);
                done.push(Arrival {
                    payload: p.buf[HEADER_BYTES..p.got].to_vec(),
                    stream: p.stream,
                    creds: p.creds,
                    fds: p.fds,
                });
                true
            }
            Progress::Dropped(why, reason) => {
                let p = self.pending.swap_remove(i);
                if self.greeting.tell && why == Refusal::Malformed {
                    refuse(&p.stream, &reason);
                }
                self.refusals.note(why, || reason);
                true
            }
        }
    }

    /// The uid check, before a byte is read; then a slot in the pending table.
    /// A greeting that is already there is read at once, so it never waits for (or is evicted
    /// from) a slot.
    fn admit(&mut self, stream: UnixStream, done: &mut Vec<Arrival>) {
        let creds = match frames::admit(&stream, &self.options) {
            Ok(c) => c,
            Err(why) => return self.refusals.note(Refusal::Foreign, || why),
        };
        if let Err(e) = stream.set_nonblocking(true) {
            return self
                .refusals
                .note(Refusal::Closed, || format!("an accepted connection failed: {e}"));
        }
        let since = Instant::now();
        self.pending.push(Pending {
            stream,
            creds,
            buf: [0; MAX_GREETING],
            got: 0,
            fds: Vec::new(),
            since,
        });
        if self.settle(self.pending.len() - 1, since, done) || self.pending.len() <= MAX_PENDING {
            return;
        }
        if let Some(oldest) = (0..self.pending.len()).min_by_key(|&i| self.pending[i].since) {
            let p = self.pending.swap_remove(oldest);
            self.refusals.note(Refusal::Crowded, || {
                format!(
                    "{} had sent {} bytes when {MAX_PENDING} newer connections were waiting",
                    p.creds.describe(),
                    p.got
                )
            });
        }
    }

    /// Reads what has arrived on pending connection `i`, never past its greeting.
    fn read_some(&mut self, i: usize) -> Progress {
        let need = self.greeting.len();
        let greeting = self.greeting;
        let p = &mut self.pending[i];
        while p.got < need {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = match recvmsg(
                &p.stream,
                &mut [io::IoSliceMut::new(&mut p.buf[p.got..need])],
                &mut control,
                RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
            ) {
                Ok(m) => m,
                Err(Errno::AGAIN) => return Progress::Waiting,
                Err(Errno::INTR) => continue,
                Err(e) => return Progress::Dropped(Refusal::Closed, format!("{}: {e}", p.creds.describe())),
            };
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = message {
                    p.fds.extend(received);
                }
            }
            if got.flags.contains(ReturnFlags::CTRUNC) || p.fds.len() > greeting.fds {
                return Progress::Dropped(
                    Refusal::Malformed,
                    format!(
                        "{} attached more descriptors than a rank does (closed)",
                        p.creds.describe()
                    ),
                );
            }
            if got.bytes == 0 {
                return Progress::Dropped(
                    Refusal::Closed,
                    format!("{} closed after {} of {need} bytes", p.creds.describe(), p.got),
                );
            }
            p.got += got.bytes;
            if let Err(e) = check_header_prefix(&p.buf[..p.got], &greeting.header, greeting.any_seq) {
                return Progress::Dropped(Refusal::Malformed, format!("{}: {e}", p.creds.describe()));
            }
        }
        if p.fds.len() != greeting.fds {
            return Progress::Dropped(
                Refusal::Malformed,
                format!(
                    "{}: {}",
                    p.creds.describe(),
                    frames::WireError::UnexpectedDescriptors {
                        got: p.fds.len(),
                        expected: greeting.fds
                    }
                ),
            );
        }
        Progress::Done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::linux::net::SocketAddrExt;

    fn hello_greeting() -> Greeting {
        Greeting {
            header: encode_header(Header {
                kind: Kind::Hello,
                seq: 0,
                len: frames::HELLO_BYTES as u64,
            }),
            any_seq: false,
            fds: 0,
            tell: false,
        }
    }

    #[test]
    fn many_silent_connections_take_bounded_slots_and_a_real_greeting_still_arrives() {
        let name = format!(
            "symm-gate-test.{}",
            hex::encode(super::super::socket::random_token())
        );
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixListener::bind_addr(&addr).unwrap();
        let mut gate = Gate::new(&listener, StoreOptions::default(), hello_greeting()).unwrap();
        let target = unix_addr(&addr).unwrap();
        let mut idle = Vec::new();
        let mut done = Vec::new();
        for _ in 0..300 {
            match dial(&target) {
                Dial::Connected(s) => idle.push(s),
                _ => panic!("the test listener refused a connection"),
            }
            if idle.len() % 50 == 0 {
                gate.step(Instant::now(), &mut done).unwrap();
                assert!(gate.pending() <= MAX_PENDING);
            }
        }
        // A garbage byte drops its connection at once; a real hello arrives whole.
        let Dial::Connected(bad) = dial(&target) else {
            panic!()
        };
        (&bad).write_all(b"X").unwrap();
        let Dial::Connected(real) = dial(&target) else {
            panic!()
        };
        let hello = frames::encode_hello(1, 2, &[9; 16]);
        let mut frame = hello_greeting().header.to_vec();
        frame.extend_from_slice(&hello);
        (&real).write_all(&frame).unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while done.is_empty() && Instant::now() < end {
            gate.step(Instant::now() + Duration::from_millis(10), &mut done)
                .unwrap();
        }
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].payload, hello);
        assert!(gate.pending() <= MAX_PENDING);
        assert!(gate.refusals.counts[Refusal::Crowded as usize] >= 300 - MAX_PENDING as u64);
        assert_eq!(gate.refusals.counts[Refusal::Malformed as usize], 1);
        assert!(gate.refusals.first.len() <= KEPT_REASONS);
        assert!(gate.refusals.summary().contains("evicted"));
    }
}
