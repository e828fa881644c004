//! Hostile local processes against a live socket store and against the NCCL path's
//! descriptor exchange: no secret, a wrong secret, a foreign uid (simulated through the
//! `StoreOptions::check_peer` seam, and real when this runs as root and can switch to
//! `nobody`). Each attacker is a child process (this test binary re-run in attacker mode); it
//! reports how many descriptors it received, which must be zero, and the group must still
//! form.

use std::io::{BufRead, IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::FileExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use symm_allreduce::__wire::{self as wire, encode_header, Header, Kind, PeerCredentials};
use symm_allreduce::{Bootstrap, Error, LocalHub, Result, SocketStore, StoreAddress, StoreOptions};

const MODE: &str = "SYMM_ATTACKER";

// ---- The attacker ----------------------------------------------------------------------------

/// Attacker mode (does nothing in a normal run): waits for a line on stdin, connects, sends a
/// frame, collects whatever arrives for a second, prints `ATTACKER fds=<n> bytes=<n>`.
#[test]
fn attacker_entry() {
    let Ok(mode) = std::env::var(MODE) else { return };
    let target = std::env::var("SYMM_ATTACKER_TARGET").unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let names: Vec<String> = if mode == "fds" {
        // The exchange's sockets are listed in /proc/net/unix: find the victim's.
        std::fs::read_to_string("/proc/net/unix")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_whitespace().nth(7))
            .filter_map(|n| n.strip_prefix('@'))
            .filter(|n| n.starts_with(&target))
            .map(str::to_string)
            .collect()
    } else {
        vec![target]
    };
    let (mut fds, mut bytes, mut connected) = (0usize, 0usize, 0usize);
    for name in names {
        let Ok(addr) = SocketAddr::from_abstract_name(name.as_bytes()) else {
            continue;
        };
        let Ok(stream) = UnixStream::connect_addr(&addr) else {
            continue;
        };
        connected += 1;
        let payload = if mode == "fds" {
            wire::encode_offer(1, &[7u8; 16])
        } else {
            let secret = std::env::var("SYMM_ATTACKER_SECRET").unwrap();
            let secret = wire::split_secret(&format!("x#{secret}")).1.and_then(|s| s.ok());
            wire::encode_hello(1, 2, &secret.unwrap_or([0u8; 16]))
        };
        let kind = if mode == "fds" { Kind::Fd } else { Kind::Hello };
        let seq = if mode == "fds" { 1 } else { 0 };
        let header = encode_header(Header {
            kind,
            seq,
            len: payload.len() as u64,
        });
        let _ = (&stream).write_all(&[&header[..], &payload].concat());
        stream.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end {
            let mut buf = [0u8; 4096];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(16))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            match recvmsg(
                &stream,
                &mut [IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::empty(),
            ) {
                Ok(m) if m.bytes > 0 => {
                    bytes += m.bytes;
                    for msg in control.drain() {
                        if let RecvAncillaryMessage::ScmRights(r) = msg {
                            fds += r.count();
                        }
                    }
                }
                _ => break,
            }
        }
    }
    println!("ATTACKER fds={fds} bytes={bytes} connected={connected}");
}

struct Attacker {
    child: std::process::Child,
}

impl Attacker {
    /// Starts an attacker; `as_nobody` switches it to uid/gid 65534 (needs root).
    fn spawn(mode: &str, target: &str, secret: &str, as_nobody: bool) -> std::io::Result<Attacker> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["--exact", "attacker_entry", "--nocapture", "--test-threads=1"])
            .env(MODE, mode)
            .env("SYMM_ATTACKER_TARGET", target)
            .env("SYMM_ATTACKER_SECRET", secret)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if as_nobody {
            cmd.uid(65534).gid(65534);
        }
        Ok(Attacker { child: cmd.spawn()? })
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Lets it attack and returns (descriptors, bytes, connections) it reported.
    fn run(mut self) -> (usize, usize, usize) {
        let _ = self.child.stdin.take().unwrap().write_all(b"go\n");
        let out = self.child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find_map(|l| l.find("ATTACKER fds=").map(|at| &l[at..]))
            .unwrap_or_else(|| panic!("attacker printed no report: {text}"));
        let field = |k: &str| -> usize {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .unwrap()
                .parse()
                .unwrap()
        };
        (field("fds="), field("bytes="), field("connected="))
    }
}

static FOREIGN_PID: AtomicI32 = AtomicI32::new(-1);
/// Held by the tests that use the seam, so that two never share `FOREIGN_PID`.
static SEAM: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The test seam: the attacker's pid is treated as another user.
fn fake_foreign(peer: &PeerCredentials, options: &StoreOptions) -> std::result::Result<(), String> {
    if peer.pid == FOREIGN_PID.load(Ordering::SeqCst) {
        return Err(format!("pid {} is (simulated as) another user", peer.pid));
    }
    wire::same_user(peer, options)
}

fn is_root() -> bool {
    wire::peer_credentials(UnixStream::pair().unwrap().0)
        .map(|c| c.uid == 0)
        .unwrap_or(false)
}

/// A file whose descriptor the ranks exchange; reading it back proves the descriptor's origin.
fn payload_file(tag: &str) -> std::fs::File {
    let path = std::env::temp_dir().join(format!("symm-sec-{}-{tag}", std::process::id()));
    std::fs::write(&path, tag).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    f
}

fn read_all(fd: OwnedFd) -> String {
    let mut buf = [0u8; 64];
    let n = std::fs::File::from(fd).read_at(&mut buf, 0).unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

// ---- Against the socket store ----------------------------------------------------------------

/// Rank 0 listens; the attacker connects first and is refused; then rank 1 joins, the group
/// forms and exchanges descriptors. Returns what the attacker got.
fn store_attack(
    secret_for_attacker: &str,
    options: StoreOptions,
    nobody: bool,
    seam: bool,
) -> (usize, usize, usize) {
    let address = StoreAddress::unique("symm-sec").unwrap();
    let text = address.to_string();
    let name = text
        .trim_start_matches('@')
        .split('#')
        .next()
        .unwrap()
        .to_string();
    let secret = match secret_for_attacker {
        "right" => text.rsplit('#').next().unwrap().to_string(),
        other => other.to_string(),
    };
    std::thread::scope(|s| {
        let root = s.spawn(|| -> Result<Vec<String>> {
            let store = SocketStore::with_options(&address, 0, 2, Duration::from_secs(20), options)?;
            let f = payload_file("rank0");
            Ok(store
                .all_gather_fds(f.as_fd())?
                .into_iter()
                .map(read_all)
                .collect())
        });
        // Rank 0 listens once the abstract name shows in /proc/net/unix.
        let end = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string("/proc/net/unix").unwrap().contains(&name) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        let attacker = Attacker::spawn("store", &name, &secret, nobody).unwrap();
        if seam {
            FOREIGN_PID.store(attacker.pid(), Ordering::SeqCst);
        }
        let got = attacker.run();
        let leaf = s.spawn(|| -> Result<Vec<String>> {
            let store = SocketStore::new(&address, 1, 2, Duration::from_secs(20))?;
            let f = payload_file("rank1");
            Ok(store
                .all_gather_fds(f.as_fd())?
                .into_iter()
                .map(read_all)
                .collect())
        });
        for r in [root.join().unwrap(), leaf.join().unwrap()] {
            assert_eq!(r.unwrap(), vec!["rank0", "rank1"], "the group must still form");
        }
        got
    })
}

#[test]
fn store_refuses_a_process_without_the_secret() {
    let (fds, _, connected) = store_attack("", StoreOptions::default(), false, false);
    assert_eq!(connected, 1);
    assert_eq!(fds, 0, "no descriptor may leave the process");
}

#[test]
fn store_refuses_a_wrong_secret() {
    let (fds, bytes, connected) = store_attack(&"ab".repeat(16), StoreOptions::default(), false, false);
    assert_eq!(connected, 1);
    assert_eq!(fds, 0, "no descriptor may leave the process");
    assert!(bytes > 0, "a refused rank is told why");
}

#[test]
fn store_refuses_a_foreign_uid_even_with_the_secret_simulated() {
    let _seam = SEAM.lock().unwrap_or_else(|p| p.into_inner());
    let options = StoreOptions {
        check_peer: fake_foreign,
        ..StoreOptions::default()
    };
    let (fds, bytes, _) = store_attack("right", options, false, true);
    assert_eq!(fds, 0, "no descriptor may leave the process");
    assert_eq!(bytes, 0, "nothing at all is sent to another user's process");
}

#[test]
fn store_refuses_a_real_foreign_uid_even_with_the_secret() {
    if !is_root() {
        eprintln!(
            "skipped: not root, so no child can run as another uid (the simulated test covers the check)"
        );
        return;
    }
    let (fds, bytes, connected) = store_attack("right", StoreOptions::default(), true, false);
    if connected == 0 {
        eprintln!("skipped: the child running as nobody could not connect (no such user, or no access)");
        return;
    }
    assert_eq!(fds, 0, "no descriptor may leave the process");
    assert_eq!(bytes, 0, "nothing at all is sent to another user's process");
}

#[test]
fn a_rank_with_a_wrong_secret_gets_a_typed_error() {
    let address = StoreAddress::unique("symm-sec-wrong").unwrap();
    let wrong = StoreAddress::parse(&address.to_string()).with_secret().unwrap();
    let (root, leaf) = std::thread::scope(|s| {
        let root = s.spawn(|| SocketStore::new(&address, 0, 2, Duration::from_millis(1500)).map(|_| ()));
        let leaf = s.spawn(|| SocketStore::new(&wrong, 1, 2, Duration::from_millis(1500)).map(|_| ()));
        (root.join().unwrap(), leaf.join().unwrap())
    });
    let leaf = leaf.unwrap_err();
    assert!(matches!(leaf, Error::PeerRefused { .. }), "{leaf}");
    assert!(leaf.to_string().contains("secret"), "{leaf}");
    let root = root.unwrap_err();
    assert!(root.to_string().contains("refused"), "{root}");
}

// ---- Against the NCCL path's descriptor exchange --------------------------------------------

/// A bootstrap that runs `hook` once on rank 0 right after the first all-gather (the sockets'
/// announcement), while every rank's listener is up.
struct Hooked<'a> {
    inner: LocalHub,
    hook: std::cell::RefCell<Option<Box<dyn FnOnce() + 'a>>>,
}

impl Bootstrap for Hooked<'_> {
    fn rank(&self) -> usize {
        Bootstrap::rank(&self.inner)
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let r = self.inner.all_gather(bytes);
        if let Some(hook) = self.hook.borrow_mut().take() {
            hook();
        }
        r
    }
    fn all_gather_fds(&self, fd: std::os::fd::BorrowedFd<'_>) -> Result<Vec<OwnedFd>> {
        self.inner.all_gather_fds(fd)
    }
}

fn fd_exchange_attack(options: StoreOptions, nobody: bool, seam: bool) -> (usize, usize, usize) {
    let hub = LocalHub::new(2, Duration::from_secs(20));
    let target = format!("symm-allreduce.{}.", std::process::id());
    let got = std::sync::Mutex::new(None);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|r| {
                let (hub, target, got) = (hub.rank(r), &target, &got);
                s.spawn(move || {
                    let hook: Option<Box<dyn FnOnce()>> = (r == 0).then(|| {
                        Box::new(move || {
                            let a = Attacker::spawn("fds", target, "", nobody).unwrap();
                            if seam {
                                FOREIGN_PID.store(a.pid(), Ordering::SeqCst);
                            }
                            *got.lock().unwrap() = Some(a.run());
                        }) as Box<dyn FnOnce()>
                    });
                    let b = Hooked {
                        inner: hub,
                        hook: std::cell::RefCell::new(hook),
                    };
                    let f = payload_file(&format!("x{r}"));
                    symm_allreduce::__exchange_fds(&b, f.as_fd(), Duration::from_secs(20), &options)
                        .map(|v| v.into_iter().map(read_all).collect::<Vec<_>>())
                })
            })
            .collect();
        for h in handles {
            assert_eq!(
                h.join().unwrap().unwrap(),
                vec!["x0", "x1"],
                "the exchange must still complete"
            );
        }
    });
    got.into_inner().unwrap().unwrap()
}

#[test]
fn fd_exchange_ignores_a_process_without_the_token() {
    let (fds, bytes, connected) = fd_exchange_attack(StoreOptions::default(), false, false);
    assert!(connected >= 1, "the attacker found no socket to attack");
    assert_eq!((fds, bytes), (0, 0), "nothing may leave the process");
}

#[test]
fn fd_exchange_refuses_a_foreign_uid_simulated() {
    let _seam = SEAM.lock().unwrap_or_else(|p| p.into_inner());
    let options = StoreOptions {
        check_peer: fake_foreign,
        ..StoreOptions::default()
    };
    let (fds, bytes, connected) = fd_exchange_attack(options, false, true);
    assert!(connected >= 1, "the attacker found no socket to attack");
    assert_eq!((fds, bytes), (0, 0), "nothing may leave the process");
}

#[test]
fn fd_exchange_refuses_a_real_foreign_uid() {
    if !is_root() {
        eprintln!("skipped: not root, so no child can run as another uid");
        return;
    }
    let (fds, bytes, connected) = fd_exchange_attack(StoreOptions::default(), true, false);
    if connected == 0 {
        eprintln!("skipped: the child running as nobody could not connect");
        return;
    }
    assert_eq!((fds, bytes), (0, 0), "nothing may leave the process");
}
