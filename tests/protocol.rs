//! The synchronisation protocol over server lifetimes, on virtual ranks: the device call
//! counter set just below 2^31 and 2^32 before calls that use new blocks and phases while one
//! rank starts late; communicators re-created over slots full of an old one's bytes; calls
//! alternating between two streams per rank; a graph replayed after a timeout; and a million
//! mixed calls with a sampled bit-exact check. Every result is compared bit for bit with the
//! fp32 rank-order emulation, and every rank with rank 0.
//!
//! Run by [`common::harness`] (`harness = false`).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{check_against_f64, check_bits, emulate, random_input, rng, TestElem};
use half::{bf16, f16};
use rand::Rng;
use symm_allreduce::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use symm_allreduce::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use symm_allreduce::{Algorithm, BarrierPhase, Communicator, Config, Error};

/// How long the late rank starts after the others: long enough that every other rank
/// reaches its first wait (or, with a broken protocol, passes it) before the late rank has
/// written anything.
const LATE_NS: u64 = 30_000_000;

fn config(capacity_bytes: usize) -> Config {
    Config {
        capacity_bytes,
        timeout: Duration::from_secs(5),
        ..Config::default()
    }
}

/// How a call reaches the kernels.
#[derive(Clone, Copy, Debug)]
enum How {
    Forced(Algorithm),
    /// `all_reduce_symmetric`: the zero-copy in-place kernel (start and end barriers).
    Symmetric,
}

/// One call on every rank with fresh random inputs; rank `late` (if any) starts `LATE_NS`
/// after the others. Checks every rank's output bit for bit.
fn checked_call<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    len: usize,
    how: How,
    late: Option<usize>,
    seed: u64,
    what: &str,
) {
    let world = comms.len();
    let mut g = rng(seed);
    let inputs: Vec<Vec<T>> = (0..world).map(|_| random_input(&mut g, len)).collect();
    let d_in: Vec<CudaSlice<T>> = streams
        .iter()
        .zip(&inputs)
        .map(|(s, x)| s.clone_htod(x).unwrap())
        .collect();
    let mut d_out: Vec<CudaSlice<T>> = streams
        .iter()
        .map(|s| s.clone_htod(&vec![T::from_f32(f32::NAN); len]).unwrap())
        .collect();
    for s in streams {
        s.synchronize().unwrap();
    }
    for r in 0..world {
        if late == Some(r) {
            comms[r].__delay(&streams[r], LATE_NS).unwrap();
        }
        match how {
            How::Forced(algo) => comms[r]
                .all_reduce_with(&d_in[r], &mut d_out[r], &streams[r], algo)
                .unwrap(),
            How::Symmetric => {
                comms[r].copy_to_symmetric(&d_in[r], &streams[r]).unwrap();
                comms[r].all_reduce_symmetric::<T>(len, &streams[r]).unwrap();
                comms[r].copy_from_symmetric(&mut d_out[r], &streams[r]).unwrap();
            }
        }
    }
    let outs: Vec<Vec<T>> = (0..world)
        .map(|r| {
            comms[r]
                .synchronize(&streams[r])
                .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
            streams[r].clone_dtoh(&d_out[r]).unwrap()
        })
        .collect();
    let expected = emulate(&inputs);
    for (r, out) in outs.iter().enumerate() {
        if let Err(e) = check_bits(&format!("{what}: rank {r}"), &expected, out) {
            let wrong = expected
                .iter()
                .zip(out)
                .filter(|(e, g)| e.bits() != g.bits() && !(e.is_nan() && g.is_nan()))
                .count();
            panic!("{e} ({wrong} of {len} elements wrong)");
        }
    }
    check_against_f64(&inputs, &outs[0]).unwrap_or_else(|e| panic!("{what}: {e}"));
}

/// The counter just below 2^31, 2^32 and the 2^48 calls epochs count: a few small low-latency calls
/// (one block, no barrier), then calls that use blocks, phases and buffers the small calls
/// never touched, each with rank 1 starting 30 ms late. A 32-bit epoch compared with
/// wrap-around passes a slot not written for 2^31 calls at once, and the early ranks then read
/// rank 1's buffers before rank 1 has written them; at 2^32 - 1 a 32-bit epoch becomes 0.
fn counter_near_2_pow_31_and_2_pow_32_with_a_late_rank(ctx: Arc<CudaContext>) {
    for world in [2usize, 4] {
        let (comms, streams) = common::group(&ctx, world, config(8 << 20));
        for start in [(1u64 << 31) - 3, (1u64 << 32) - 3, (1u64 << 48) - 12] {
            for r in 0..world {
                comms[r].__set_call_counter(start, &streams[r]).unwrap();
            }
            let what = |c: &str| format!("W={world} counter {start:#x}: {c}");
            for k in 0..3 {
                checked_call::<bf16>(
                    &comms,
                    &streams,
                    512,
                    How::Forced(Algorithm::LowLatency),
                    None,
                    k,
                    &what("1 KiB low-latency"),
                );
            }
            let calls: [(usize, How, &str); 5] = [
                (1 << 20, How::Forced(Algorithm::OneShot), "4 MiB one-shot"),
                (1 << 20, How::Forced(Algorithm::TwoShot), "4 MiB two-shot"),
                (262_147, How::Symmetric, "1 MiB zero-copy in place"),
                (4096, How::Forced(Algorithm::LowLatency), "16 KiB low-latency"),
                (1 << 20, How::Forced(Algorithm::OneShot), "4 MiB one-shot again"),
            ];
            for (k, (len, how, name)) in calls.into_iter().enumerate() {
                checked_call::<f32>(&comms, &streams, len, how, Some(1), 100 + k as u64, &what(name));
            }
            // Grids of one block and of many ran; every block's entry of the call state (each block
            // reads and publishes its own) counts all eight calls.
            for (r, c) in comms.iter().enumerate() {
                let counts = c.__call_counts().unwrap();
                assert_eq!(counts.len(), 64);
                assert!(
                    counts.iter().all(|&n| n == start + 8),
                    "{}: rank {r}: call counts {counts:?}",
                    what("after the calls")
                );
            }
        }
    }
}

/// At the last epoch the flags can hold (2^48 - 1) a call still runs; the next is refused on
/// every rank with `CallsExhausted`, never run with a wrapped flag.
fn calls_past_the_last_epoch_are_refused_on_every_rank(ctx: Arc<CudaContext>) {
    let (comms, streams) = common::group(&ctx, 3, config(1 << 20));
    for r in 0..3 {
        comms[r]
            .__set_call_counter((1u64 << 48) - 2, &streams[r])
            .unwrap();
    }
    checked_call::<f32>(
        &comms,
        &streams,
        5000,
        How::Forced(Algorithm::OneShot),
        None,
        1,
        "last epoch",
    );
    for r in 0..3 {
        let x = streams[r].clone_htod(&[1.0f32; 64]).unwrap();
        let mut y = streams[r].alloc_zeros::<f32>(64).unwrap();
        let _ = comms[r].all_reduce(&x, &mut y, &streams[r]);
    }
    for (r, c) in comms.iter().enumerate() {
        match c.synchronize(&streams[r]) {
            Err(Error::CallsExhausted { .. }) => {}
            other => panic!("rank {r}: expected CallsExhausted, got {other:?}"),
        }
    }
}

/// A communicator re-created over pages an earlier one filled with bytes that look like data:
/// setup arms every low-latency slot, the first calls (with a late rank) are right, and the
/// reader re-arms every line it consumed.
fn recreated_communicator_never_reads_an_old_ones_slots(ctx: Arc<CudaContext>) {
    const W: usize = 4;
    for round in 0..3u64 {
        let (comms, streams) = common::group(&ctx, W, config(1 << 20));
        for c in &comms {
            assert!(
                c.__low_latency_slots_armed().unwrap(),
                "slots armed at setup (round {round})"
            );
        }
        for (k, len) in [8usize, 4099, 8192, 1].into_iter().enumerate() {
            checked_call::<f16>(
                &comms,
                &streams,
                len,
                How::Forced(Algorithm::LowLatency),
                Some(k % W),
                round * 10 + k as u64,
                &format!("round {round}, low-latency len {len}"),
            );
        }
        for c in &comms {
            assert!(
                c.__low_latency_slots_armed().unwrap(),
                "slots re-armed after the calls"
            );
        }
        // Leave bytes that look like complete lines for the next communicator's pages.
        for c in &comms {
            c.__scribble_low_latency_slots(0x3c).unwrap();
            assert!(!c.__low_latency_slots_armed().unwrap());
        }
    }
}

/// Each rank alternates its calls between two streams (and the late rank changes): the
/// communicator orders a call after the previous one whatever stream it comes on.
fn calls_alternating_between_two_streams_stay_ordered(ctx: Arc<CudaContext>) {
    const W: usize = 3;
    const CALLS: usize = 120;
    const SLOT: usize = 70_000;
    let comms = Communicator::local_group(&vec![ctx.clone(); W], config(SLOT * 4)).unwrap();
    let streams: Vec<[Arc<CudaStream>; 2]> = (0..W)
        .map(|_| [ctx.new_stream().unwrap(), ctx.new_stream().unwrap()])
        .collect();
    let mut g = rng(42);
    let inputs: Vec<Vec<f32>> = (0..W).map(|_| random_input(&mut g, SLOT * CALLS)).collect();
    let d_in: Vec<CudaSlice<f32>> = (0..W)
        .map(|r| streams[r][0].clone_htod(&inputs[r]).unwrap())
        .collect();
    let mut d_out: Vec<CudaSlice<f32>> = (0..W)
        .map(|r| streams[r][0].alloc_zeros::<f32>(SLOT * CALLS).unwrap())
        .collect();
    for s in streams.iter().flatten() {
        s.synchronize().unwrap();
    }
    let algos = [
        Algorithm::LowLatency,
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::Auto,
    ];
    let mut lens = Vec::with_capacity(CALLS);
    for c in 0..CALLS {
        let algo = algos[g.random_range(0..algos.len())];
        let len = if algo == Algorithm::LowLatency {
            g.random_range(1..=8192)
        } else {
            g.random_range(1..=SLOT)
        };
        lens.push(len);
        let range = c * SLOT..c * SLOT + len;
        for r in 0..W {
            let s = &streams[r][(c + r) % 2];
            if c % 10 == 0 && r == c / 10 % W {
                comms[r].__delay(s, 2_000_000).unwrap();
            }
            comms[r]
                .all_reduce_with(
                    &d_in[r].slice(range.clone()),
                    &mut d_out[r].slice_mut(range.clone()),
                    s,
                    algo,
                )
                .unwrap();
        }
    }
    let outs: Vec<Vec<f32>> = (0..W)
        .map(|r| {
            for s in &streams[r] {
                comms[r].synchronize(s).unwrap();
            }
            streams[r][0].clone_dtoh(&d_out[r]).unwrap()
        })
        .collect();
    for (c, &len) in lens.iter().enumerate() {
        let range = c * SLOT..c * SLOT + len;
        let ins: Vec<Vec<f32>> = inputs.iter().map(|x| x[range.clone()].to_vec()).collect();
        let expected = emulate(&ins);
        for (r, out) in outs.iter().enumerate() {
            check_bits(
                &format!("call {c} len {len} rank {r}"),
                &expected,
                &out[range.clone()],
            )
            .unwrap();
        }
    }
}

/// Rank 1 never calls; rank 0 replays a captured graph of 20 all-reduces (four of them fused
/// all-reduce + RMSNorm calls). The first wait times out and poisons the group, so every
/// later call of the replay — and every later replay — returns at once: the replay takes
/// about one timeout, not twenty.
fn a_graph_replayed_after_a_timeout_returns_within_twice_the_timeout(ctx: Arc<CudaContext>) {
    let timeout = Duration::from_millis(300);
    let comms = Communicator::local_group(
        &[ctx.clone(), ctx.clone()],
        Config {
            capacity_bytes: 1 << 20,
            timeout,
            ..Config::default()
        },
    )
    .unwrap();
    let stream = ctx.new_stream().unwrap();
    let input = stream.clone_htod(&vec![1.0f32; 100_000]).unwrap();
    let mut output = stream.alloc_zeros::<f32>(100_000).unwrap();
    let algos = [
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::LowLatency,
        Algorithm::Auto,
    ];
    // Every fifth call the fused low-latency kernel over one row of 8192 f32 (32 KiB): a
    // row over a thread-block cluster of 8 blocks where the device has clusters, so a refused
    // call's blocks stand down together (kernels/fused_norm.cuh). Its buffers are made before
    // the capture (made during it, they would be the graph's own allocations).
    const HIDDEN: usize = 8192;
    let weight = stream.clone_htod(&vec![1.0f32; HIDDEN]).unwrap();
    let mut residual = stream.clone_htod(&vec![2.0f32; HIDDEN]).unwrap();
    let mut norm_out = stream.alloc_zeros::<f32>(HIDDEN).unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    for i in 0..20 {
        if i % 5 == 4 {
            comms[0]
                .all_reduce_add_rmsnorm_with(
                    &input.slice(..HIDDEN),
                    &mut residual,
                    &weight,
                    1e-5,
                    &mut norm_out,
                    &stream,
                    Algorithm::LowLatency,
                )
                .unwrap();
            continue;
        }
        let algo = algos[i % algos.len()];
        let len = if algo == Algorithm::LowLatency {
            4000
        } else {
            100_000 - i
        };
        comms[0]
            .all_reduce_with(&input.slice(..len), &mut output.slice_mut(..len), &stream, algo)
            .unwrap();
    }
    let graph = stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .unwrap()
        .expect("a graph");
    let started = Instant::now();
    graph.launch().unwrap();
    stream.synchronize().unwrap();
    let first = started.elapsed();
    assert!(first >= timeout, "returned after {first:?}, before the timeout");
    assert!(
        first < 2 * timeout,
        "20 all-reduces after a timeout took {first:?} (timeout {timeout:?})"
    );
    match comms[0].check_usable() {
        Err(Error::PeerTimeout {
            rank: 0,
            peer: 1,
            phase: BarrierPhase::Start,
            ..
        }) => {}
        other => panic!("unexpected {other:?}"),
    }
    let started = Instant::now();
    for _ in 0..5 {
        graph.launch().unwrap();
    }
    stream.synchronize().unwrap();
    let later = started.elapsed();
    assert!(
        later < timeout / 2,
        "5 replays of a poisoned graph took {later:?}"
    );
    // No fused call ran: the residual and the output are as they were.
    assert!(stream.clone_dtoh(&residual).unwrap().iter().all(|&x| x == 2.0));
    assert!(stream.clone_dtoh(&norm_out).unwrap().iter().all(|&x| x == 0.0));
}

/// Rank 2 never calls; ranks 0 and 1 both call. Whichever times out first pushes its timeout
/// to every rank, so the other stops waiting too: both report the timeout within about one
/// timeout, and rank 2, once it does call, returns at once with the same error.
fn a_timeout_is_pushed_to_every_rank(ctx: Arc<CudaContext>) {
    let timeout = Duration::from_millis(300);
    let comms = Communicator::local_group(
        &[ctx.clone(), ctx.clone(), ctx.clone()],
        Config {
            capacity_bytes: 1 << 20,
            timeout,
            ..Config::default()
        },
    )
    .unwrap();
    let streams: Vec<_> = (0..3).map(|_| ctx.new_stream().unwrap()).collect();
    let inputs: Vec<_> = streams
        .iter()
        .map(|s| s.clone_htod(&[1.0f32; 5000]).unwrap())
        .collect();
    let mut outputs: Vec<_> = streams
        .iter()
        .map(|s| s.alloc_zeros::<f32>(5000).unwrap())
        .collect();
    let started = Instant::now();
    for r in 0..2 {
        comms[r]
            .all_reduce_with(&inputs[r], &mut outputs[r], &streams[r], Algorithm::TwoShot)
            .unwrap();
    }
    for r in 0..2 {
        let err = comms[r].synchronize(&streams[r]).unwrap_err();
        assert!(
            matches!(err, Error::PeerTimeout { peer: 2, .. }),
            "rank {r}: {err:?}"
        );
    }
    let waited = started.elapsed();
    assert!(waited < 2 * timeout, "both ranks stopped after {waited:?}");
    let started = Instant::now();
    comms[2]
        .all_reduce_with(&inputs[2], &mut outputs[2], &streams[2], Algorithm::TwoShot)
        .unwrap();
    let err = comms[2].synchronize(&streams[2]).unwrap_err();
    assert!(
        matches!(err, Error::PeerTimeout { peer: 2, .. }),
        "rank 2: {err:?}"
    );
    assert!(
        started.elapsed() < timeout / 2,
        "the poisoned rank waited {:?}",
        started.elapsed()
    );
}

/// The low-latency sentinel is an all-ones word; inputs that hold exactly that NaN (and its
/// neighbours, ±0, ±inf) give the same bits on every algorithm — NaN payloads included.
fn sentinel_bit_patterns_give_the_same_bits_on_every_algorithm(ctx: Arc<CudaContext>) {
    fn patterns<T: TestElem>(ctx: &Arc<CudaContext>, specials: &[T]) {
        for world in [1usize, 2, 3] {
            let (comms, streams) = common::group(ctx, world, config(1 << 20));
            let mut g = rng(world as u64);
            let len = 1000;
            let inputs: Vec<Vec<T>> = (0..world)
                .map(|_| {
                    let mut x = random_input::<T>(&mut g, len);
                    for v in x.iter_mut() {
                        if g.random_range(0..4) == 0 {
                            *v = specials[g.random_range(0..specials.len())];
                        }
                    }
                    // Whole all-ones 32-bit words for sure (two all-ones 16-bit elements
                    // side by side: the sentinel itself), at both parities.
                    for at in [0, 2, 101, 500, len - 2] {
                        x[at] = specials[0];
                        x[at + 1] = specials[0];
                    }
                    x
                })
                .collect();
            let mut by_algo: Vec<(Algorithm, Vec<Vec<u32>>)> = Vec::new();
            for algo in [Algorithm::LowLatency, Algorithm::OneShot, Algorithm::TwoShot] {
                let d_in: Vec<CudaSlice<T>> = streams
                    .iter()
                    .zip(&inputs)
                    .map(|(s, x)| s.clone_htod(x).unwrap())
                    .collect();
                let mut d_out: Vec<CudaSlice<T>> =
                    streams.iter().map(|s| s.alloc_zeros(len).unwrap()).collect();
                for r in 0..world {
                    comms[r]
                        .all_reduce_with(&d_in[r], &mut d_out[r], &streams[r], algo)
                        .unwrap();
                }
                let outs: Vec<Vec<u32>> = (0..world)
                    .map(|r| {
                        comms[r].synchronize(&streams[r]).unwrap();
                        streams[r]
                            .clone_dtoh(&d_out[r])
                            .unwrap()
                            .iter()
                            .map(|v| v.bits())
                            .collect()
                    })
                    .collect();
                by_algo.push((algo, outs));
            }
            let (_, reference) = &by_algo[1];
            for (algo, outs) in &by_algo {
                for (r, out) in outs.iter().enumerate() {
                    assert_eq!(
                        out,
                        &reference[0],
                        "{} W={world} {algo} rank {r}: bits differ from one-shot rank 0",
                        T::DTYPE
                    );
                }
            }
        }
    }
    let f32s: Vec<f32> = [
        0xffff_ffffu32,
        0xffff_fffe,
        0x7fff_ffff,
        0x8000_0000,
        0,
        0x7f80_0000,
        0xff80_0000,
    ]
    .map(f32::from_bits)
    .to_vec();
    patterns(&ctx, &f32s);
    let halves: [u16; 7] = [0xffff, 0xfffe, 0x7fff, 0x8000, 0, 0x7c00, 0xfc00];
    patterns(&ctx, &halves.map(f16::from_bits));
    let bhalves: [u16; 7] = [0xffff, 0xfffe, 0x7fff, 0x8000, 0, 0x7f80, 0xff80];
    patterns(&ctx, &bhalves.map(bf16::from_bits));
}

/// 10^6 calls on 2 ranks, each alternating between two streams: every algorithm, sizes from 1
/// element to 4 MiB (mostly decode-sized), inputs drawn from a resident random pool, every
/// 1,000th call checked bit for bit against the emulation (the rest run back to back).
fn a_million_mixed_calls_on_two_streams_sampled_bit_exact(ctx: Arc<CudaContext>) {
    const W: usize = 2;
    const CALLS: usize = 1_000_000;
    const POOL: usize = 4 << 20; // elements of bf16 per rank
    const MAX_LEN: usize = 2 << 20; // 4 MiB of bf16
    let comms = Communicator::local_group(&vec![ctx.clone(); W], config(4 << 20)).unwrap();
    let streams: Vec<[Arc<CudaStream>; 2]> = (0..W)
        .map(|_| [ctx.new_stream().unwrap(), ctx.new_stream().unwrap()])
        .collect();
    let mut g = rng(2026);
    let pools: Vec<Vec<bf16>> = (0..W).map(|_| random_input(&mut g, POOL)).collect();
    let d_pool: Vec<CudaSlice<bf16>> = (0..W)
        .map(|r| streams[r][0].clone_htod(&pools[r]).unwrap())
        .collect();
    let mut d_out: Vec<CudaSlice<bf16>> = (0..W)
        .map(|r| streams[r][0].alloc_zeros(MAX_LEN).unwrap())
        .collect();
    for s in streams.iter().flatten() {
        s.synchronize().unwrap();
    }
    let algos = [
        Algorithm::Auto,
        Algorithm::LowLatency,
        Algorithm::OneShot,
        Algorithm::TwoShot,
    ];
    let started = Instant::now();
    let mut checked = 0;
    for c in 0..CALLS {
        let algo = algos[g.random_range(0..algos.len())];
        let len = match (algo, g.random_range(0..100)) {
            (Algorithm::LowLatency, _) => g.random_range(1..=16_384),
            (_, 0) => g.random_range(1..=MAX_LEN),
            (_, 1..=9) => g.random_range(1..=65_536),
            _ => g.random_range(1..=8192),
        };
        let offset = g.random_range(0..=(POOL - len) / 8) * 8;
        let sample = c % 1000 == 999;
        for r in 0..W {
            let s = &streams[r][c % 2];
            comms[r]
                .all_reduce_with(
                    &d_pool[r].slice(offset..offset + len),
                    &mut d_out[r].slice_mut(..len),
                    s,
                    algo,
                )
                .unwrap();
        }
        if sample {
            let ins: Vec<Vec<bf16>> = pools.iter().map(|p| p[offset..offset + len].to_vec()).collect();
            let expected = emulate(&ins);
            for r in 0..W {
                let s = &streams[r][c % 2];
                comms[r].synchronize(s).unwrap();
                let out = s.clone_dtoh(&d_out[r].slice(..len)).unwrap();
                check_bits(&format!("call {c} ({algo}, len {len}) rank {r}"), &expected, &out).unwrap();
            }
            checked += 1;
        }
    }
    for (r, pair) in streams.iter().enumerate() {
        for s in pair {
            comms[r].synchronize(s).unwrap();
        }
    }
    eprintln!(
        "{CALLS} calls ({checked} checked bit for bit) in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// One rank's part of a divergence scenario: (length, dtype is f32 (else bf16), algorithm).
type Calls = Vec<(usize, bool, Algorithm)>;

/// Runs `calls[r]` on rank r with the divergence check on; every rank must report
/// `Error::Diverged`, within the timeout.
fn expect_divergence(ctx: &Arc<CudaContext>, what: &str, calls: &[Calls]) {
    let timeout = Duration::from_secs(2);
    let world = calls.len();
    let config = Config {
        capacity_bytes: 1 << 20,
        timeout,
        check_divergence: true,
        ..Config::default()
    };
    let (comms, streams) = common::group(ctx, world, config);
    let f: Vec<CudaSlice<f32>> = streams
        .iter()
        .map(|s| s.clone_htod(&vec![1.0f32; 4096]).unwrap())
        .collect();
    let mut fo: Vec<CudaSlice<f32>> = streams.iter().map(|s| s.alloc_zeros(4096).unwrap()).collect();
    let b: Vec<CudaSlice<bf16>> = streams
        .iter()
        .map(|s| s.clone_htod(&vec![bf16::ONE; 4096]).unwrap())
        .collect();
    let mut bo: Vec<CudaSlice<bf16>> = streams.iter().map(|s| s.alloc_zeros(4096).unwrap()).collect();
    for s in &streams {
        s.synchronize().unwrap();
    }
    let started = Instant::now();
    for (r, mine) in calls.iter().enumerate() {
        for &(len, is_f32, algo) in mine {
            // A poisoned rank refuses further calls on the host: that is part of the outcome.
            let _ = if is_f32 {
                comms[r].all_reduce_with(&f[r].slice(..len), &mut fo[r].slice_mut(..len), &streams[r], algo)
            } else {
                comms[r].all_reduce_with(&b[r].slice(..len), &mut bo[r].slice_mut(..len), &streams[r], algo)
            };
        }
    }
    assert_diverged_everywhere(what, &comms, &streams, started, timeout);
}

/// Every rank of the group reports `Error::Diverged` (itself or as the cause of `Poisoned`),
/// within `timeout` of `started`.
fn assert_diverged_everywhere(
    what: &str,
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    started: Instant,
    timeout: Duration,
) {
    for (r, (c, s)) in comms.iter().zip(streams).enumerate() {
        match c.synchronize(s) {
            Err(Error::Diverged { .. }) => {}
            Err(Error::Poisoned { cause }) if matches!(*cause, Error::Diverged { .. }) => {}
            other => panic!("{what}: rank {r}: expected Diverged, got {other:?}"),
        }
    }
    let took = started.elapsed();
    assert!(took < timeout, "{what}: reported after {took:?}");
    eprintln!("{what}: {}", comms[0].check_usable().unwrap_err());
}

/// With `Config::check_divergence`, ranks that call with another length, dtype or algorithm,
/// or that skipped a call, get `Error::Diverged` on every rank before any data moves; calls
/// that agree are unaffected (checked bit for bit with a late rank).
fn diverged_calls_are_reported_on_every_rank(ctx: Arc<CudaContext>) {
    use Algorithm::{LowLatency, OneShot, TwoShot};
    let same = |n: usize| vec![(n, true, OneShot)];
    expect_divergence(&ctx, "length", &[same(1000), same(1000), same(1001)]);
    expect_divergence(
        &ctx,
        "dtype",
        &[same(1000), vec![(1000, false, OneShot)], same(1000)],
    );
    expect_divergence(
        &ctx,
        "algorithm",
        &[same(1000), vec![(1000, true, TwoShot)], same(1000)],
    );
    expect_divergence(
        &ctx,
        "low-latency vs one-shot",
        &[vec![(64, true, LowLatency)], same(64)],
    );
    let all = vec![
        (1000, true, OneShot),
        (2000, true, TwoShot),
        (3000, true, OneShot),
    ];
    let skipped = vec![(1000, true, OneShot), (3000, true, OneShot)];
    expect_divergence(&ctx, "skipped call", &[all.clone(), skipped, all]);

    let config = Config {
        check_divergence: true,
        ..config(4 << 20)
    };
    let (comms, streams) = common::group(&ctx, 4, config);
    let calls: [(usize, How); 4] = [
        (4099, How::Forced(Algorithm::LowLatency)),
        (100_003, How::Forced(Algorithm::OneShot)),
        (300_001, How::Forced(Algorithm::TwoShot)),
        (70_001, How::Symmetric),
    ];
    for (k, (len, how)) in calls.into_iter().enumerate() {
        checked_call::<f16>(
            &comms,
            &streams,
            len,
            how,
            Some(k % 4),
            k as u64,
            &format!("checked {how:?}"),
        );
    }
}

/// The fused call and the one-shot all-gather-v are checked too: two ranks whose fused calls
/// have the same number of elements but another tokens × hidden shape (one-shot, two-shot
/// and low-latency kernels), and two ranks whose all-gather-v counts have the same total but
/// split it differently, get `Error::Diverged` on every rank (not a timeout, and not the
/// all-gather's own `CountsMismatch`), before any data moves.
fn diverged_fused_and_gather_calls_are_reported_on_every_rank(ctx: Arc<CudaContext>) {
    let timeout = Duration::from_secs(2);
    let config = Config {
        capacity_bytes: 1 << 20,
        timeout,
        check_divergence: true,
        ..Config::default()
    };
    // (tokens, hidden) per rank: 8192 elements each.
    let shapes = [(2usize, 4096usize), (1, 8192)];
    for algo in [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::LowLatency] {
        let (comms, streams) = common::group(&ctx, 2, config.clone());
        let mut rng = rng(algo as u64);
        let mut bufs: Vec<_> = shapes
            .iter()
            .zip(&streams)
            .map(|(&(t, h), s)| {
                let input = s.clone_htod(&random_input::<bf16>(&mut rng, t * h)).unwrap();
                let residual = s.clone_htod(&random_input::<bf16>(&mut rng, t * h)).unwrap();
                let weight = s.clone_htod(&random_input::<bf16>(&mut rng, h)).unwrap();
                let out: CudaSlice<bf16> = s.alloc_zeros(t * h).unwrap();
                (input, residual, weight, out)
            })
            .collect();
        for s in &streams {
            s.synchronize().unwrap();
        }
        let started = Instant::now();
        for (r, (input, residual, weight, out)) in bufs.iter_mut().enumerate() {
            let _ = comms[r].all_reduce_add_rmsnorm_with(
                &*input,
                residual,
                &*weight,
                1e-6,
                out,
                &streams[r],
                algo,
            );
        }
        let what = format!("fused {algo:?}, 2x4096 vs 1x8192");
        assert_diverged_everywhere(&what, &comms, &streams, started, timeout);
    }

    let (comms, streams) = common::group(&ctx, 2, config);
    let counts = [[16usize, 32], [32, 16]];
    let inputs: Vec<CudaSlice<f32>> = streams
        .iter()
        .map(|s| s.clone_htod(&[1.0f32; 16]).unwrap())
        .collect();
    let mut outputs: Vec<CudaSlice<f32>> = streams.iter().map(|s| s.alloc_zeros(48).unwrap()).collect();
    for s in &streams {
        s.synchronize().unwrap();
    }
    let started = Instant::now();
    for r in 0..2 {
        let _ = comms[r].all_gather_v(&inputs[r], &counts[r], &mut outputs[r], &streams[r]);
    }
    let what = "all_gather_v, counts [16, 32] vs [32, 16]";
    assert_diverged_everywhere(what, &comms, &streams, started, timeout);
    for (r, (o, s)) in outputs.iter().zip(&streams).enumerate() {
        let got = s.clone_dtoh(o).unwrap();
        assert!(
            got.iter().all(|&x| x == 0.0),
            "rank {r}: data moved before the check: {got:?}"
        );
    }
}

fn main() -> std::process::ExitCode {
    common::harness::run(
        "protocol",
        vec![
            gpu_test!(counter_near_2_pow_31_and_2_pow_32_with_a_late_rank),
            gpu_test!(calls_past_the_last_epoch_are_refused_on_every_rank),
            gpu_test!(recreated_communicator_never_reads_an_old_ones_slots),
            gpu_test!(calls_alternating_between_two_streams_stay_ordered),
            gpu_test!(a_graph_replayed_after_a_timeout_returns_within_twice_the_timeout),
            gpu_test!(a_timeout_is_pushed_to_every_rank),
            gpu_test!(sentinel_bit_patterns_give_the_same_bits_on_every_algorithm),
            gpu_test!(diverged_calls_are_reported_on_every_rank),
            gpu_test!(diverged_fused_and_gather_calls_are_reported_on_every_rank),
            gpu_test!(a_million_mixed_calls_on_two_streams_sampled_bit_exact),
        ],
    )
}
