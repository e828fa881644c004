//! Fuzzing of the bootstrap's frame parsers (`symm_allreduce::__wire`): random, truncated,
//! oversized, mutated and replayed frames, and wrong descriptor counts. Every case must end in
//! `Ok` or a typed `WireError`, never a panic, and no single allocation may exceed the bytes
//! the parser was given (three times, for lossy UTF-8 reasons) plus a short error message (a counting global allocator checks it),
//! let alone the frame bound.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use symm_allreduce::__wire::*;

struct Counting;

static ARMED: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        }
        // SAFETY: the caller's layout is passed through.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) {
            LARGEST.fetch_max(new_size, Ordering::Relaxed);
        }
        // SAFETY: passed through from the caller.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Slack for an error message or a small fixed structure. (A reason text decoded lossily may
/// grow to three bytes per invalid input byte: U+FFFD; hence `3 * input + SLACK`.)
const SLACK: usize = 512;

/// Runs one parse of `input`, checking the allocation bound.
fn case(input: &[u8], parse: impl FnOnce(&[u8])) {
    LARGEST.store(0, Ordering::Relaxed);
    ARMED.store(true, Ordering::Relaxed);
    parse(input);
    ARMED.store(false, Ordering::Relaxed);
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        largest <= 3 * input.len() + SLACK && largest <= MAX_FRAME_BYTES,
        "a {largest}-byte allocation while parsing {} bytes",
        input.len()
    );
}

fn all_parsers(b: &[u8], secret: &Secret, world: usize, count: &mut u64) {
    case(b, |b| {
        let _ = decode_header(b, MAX_FRAME_BYTES);
    });
    case(b, |b| {
        let _ = decode_header(b, MAX_HELLO_BYTES);
    });
    case(b, |b| {
        let _ = decode_hello(b, secret);
    });
    case(b, |b| {
        let _ = decode_gathered(b, world);
    });
    case(b, |b| {
        let _ = decode_abort(b);
    });
    case(b, |b| {
        let _ = decode_offer(b, secret, 0, world);
    });
    case(b, |b| {
        let _ = decode_announce(b);
    });
    let hello = encode_header(Header {
        kind: Kind::Hello,
        seq: 0,
        len: HELLO_BYTES as u64,
    });
    case(b, |b| {
        // The gate's byte-at-a-time check agrees with the whole-header parser: a prefix it
        // passes is a prefix of a hello header (any seq when `any_seq`).
        let strict = check_header_prefix(b, &hello, false);
        let n = b.len().min(HEADER_BYTES);
        assert_eq!(strict.is_ok(), b[..n] == hello[..n]);
        if let Err(WireError::UnexpectedByte { at }) = strict {
            assert!(at < n && b[at] != hello[at] && b[..at] == hello[..at]);
        }
        let loose = check_header_prefix(b, &hello, true);
        assert!(loose.is_ok() || strict.is_err());
    });
    *count += 8;
}

fn valid_frames(rng: &mut StdRng, secret: &Secret, world: usize) -> Vec<Vec<u8>> {
    let parts: Vec<Vec<u8>> = (0..world)
        .map(|_| {
            let n = rng.random_range(0..64);
            (0..n).map(|_| rng.random()).collect()
        })
        .collect();
    let header = encode_header(Header {
        kind: Kind::Bytes,
        seq: rng.random(),
        len: rng.random_range(0..1 << 20),
    });
    vec![
        header.to_vec(),
        encode_hello(rng.random_range(0..world), world, secret),
        encode_gathered(&parts),
        encode_abort(rng.random_range(0..world), "some reason"),
        encode_offer(rng.random_range(1..world.max(2)), secret),
        encode_announce(secret, "symm-allreduce.1.abc"),
    ]
}

#[test]
fn frame_parsers_survive_hostile_input() {
    let started = std::time::Instant::now();
    let mut rng = StdRng::seed_from_u64(0x005e_ed15);
    let secret: Secret = rng.random();
    let mut count = 0u64;

    // 1. Random bytes of random lengths.
    for _ in 0..4_000 {
        let n = rng.random_range(0..200);
        let b: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        all_parsers(&b, &secret, rng.random_range(1..=8), &mut count);
    }
    // 2. Every truncation and random bit flips of valid frames.
    for _ in 0..300 {
        let world = rng.random_range(1..=8);
        for frame in valid_frames(&mut rng, &secret, world) {
            for cut in 0..frame.len() {
                all_parsers(&frame[..cut], &secret, world, &mut count);
            }
            for _ in 0..4 {
                let mut m = frame.clone();
                if !m.is_empty() {
                    let i = rng.random_range(0..m.len());
                    m[i] ^= 1 << rng.random_range(0..8);
                }
                all_parsers(&m, &secret, world, &mut count);
            }
        }
    }
    // 3. Oversized length claims in otherwise valid headers, and headers of every kind code
    //    and version: refused before any allocation.
    for _ in 0..5_000 {
        let mut h = encode_header(Header {
            kind: Kind::Gathered,
            seq: rng.random(),
            len: 0,
        });
        h[16..24].copy_from_slice(
            &rng.random_range(MAX_FRAME_BYTES as u64 + 1..=u64::MAX)
                .to_le_bytes(),
        );
        case(&h, |b| {
            assert!(matches!(
                decode_header(b, MAX_FRAME_BYTES),
                Err(WireError::Oversized { .. })
            ));
        });
        h[4..6].copy_from_slice(&rng.random::<u16>().to_le_bytes());
        h[6..8].copy_from_slice(&rng.random::<u16>().to_le_bytes());
        case(&h, |b| {
            let _ = decode_header(b, MAX_FRAME_BYTES);
        });
        count += 2;
    }
    // A gathered answer whose per-rank lengths claim far more than it holds.
    for _ in 0..5_000 {
        let world = rng.random_range(1..=8);
        let mut b = (world as u32).to_le_bytes().to_vec();
        for _ in 0..world {
            b.extend_from_slice(&rng.random::<u64>().to_le_bytes());
            b.extend((0..rng.random_range(0..16)).map(|_| rng.random::<u8>()));
        }
        case(&b, |b| assert!(decode_gathered(b, world).is_err()));
        count += 1;
    }
    // 4. Replayed frames: a frame of an earlier step, or of another kind, is refused.
    for _ in 0..10_000 {
        let seq: u64 = rng.random_range(1..u64::MAX);
        let replay = Header {
            kind: Kind::Bytes,
            seq: seq - rng.random_range(1..=seq.min(1000)),
            len: 0,
        };
        let parsed = decode_header(&encode_header(replay), MAX_FRAME_BYTES).unwrap();
        assert!(matches!(
            check_sequence(&parsed, Kind::Bytes, seq),
            Err(WireError::OutOfSequence { .. })
        ));
        assert!(check_sequence(&parsed, Kind::Gathered, parsed.seq).is_err());
        assert!(check_sequence(&parsed, Kind::Bytes, parsed.seq).is_ok());
        // A replayed hello with another secret.
        let other: Secret = rng.random();
        if other != secret {
            assert_eq!(
                decode_hello(&encode_hello(1, 2, &other), &secret),
                Err(WireError::WrongSecret)
            );
        }
        count += 4;
    }
    // 5. Wrong descriptor counts for every kind.
    for _ in 0..10_000 {
        let world = rng.random_range(1..=8);
        let kind = Kind::from_code(rng.random_range(1..=7)).unwrap();
        let got = rng.random_range(0..=2 * world + 1);
        let r = check_descriptors(kind, world, got);
        assert_eq!(r.is_ok(), got == kind.descriptors(world));
        if let Err(e) = r {
            assert!(matches!(e, WireError::UnexpectedDescriptors { .. }));
        }
        count += 1;
    }
    // Addresses with random secrets.
    for _ in 0..5_000 {
        let n = rng.random_range(0..48);
        let s: String = (0..n)
            .map(|_| *b"0123456789abcdefXYZ#@./".get(rng.random_range(0..23)).unwrap() as char)
            .collect();
        case(s.as_bytes(), |_| {
            let _ = split_secret(&s);
        });
        count += 1;
    }

    eprintln!(
        "bootstrap fuzz: {count} parser cases in {:?}, no panic, every allocation within 3x the input's size + {SLACK} bytes",
        started.elapsed()
    );
    assert!(count >= 100_000, "only {count} cases");
}
