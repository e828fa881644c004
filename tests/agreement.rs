//! Every rank runs the same kernel for a call, or every rank fails: on virtual ranks, through
//! the public API only.
//!
//! - Every pair of rank-local choices the API allows for one all-reduce (ordinary buffer out
//!   of place, in place, at an element offset, a pool buffer passed as an ordinary buffer, a
//!   pool buffer zero-copy in place or out of place), at sizes in each algorithm's range and
//!   at the low-latency boundary, W = 2, 3, 8, divergence check off and on: either every rank
//!   returns the fp32 rank-order bits, or every rank returns an error within twice the
//!   timeout. Never `Ok` with wrong data, never wrong data in the next call (the next call of
//!   an agreeing group is checked too), and nothing is written outside the buffers a rank
//!   passed (every rank's pool buffer is compared with what it held whenever that rank did
//!   not pass it).
//! - Ranks whose lengths differ by one element, or whose dtypes differ: an error on every rank,
//!   with the divergence check off (the barrier kernels' flags carry the call's identity; the
//!   low-latency kernels place their lines by a rotation that differs: docs/design.md) and on.
//! - Eager calls, captured calls and graph replays mixed on two and three streams per rank,
//!   with the first eager call still queued behind a slow kernel: every call's result bit for
//!   bit, event tracking off and on.
//!
//! Run by [`common::harness`] (`harness = false`).
#![allow(clippy::needless_range_loop)] // ranks index several parallel vectors

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{check_bits, emulate, random_input, rng};
use half::{bf16, f16};
use symm_allreduce::cudarc::driver::sys::{self, CUgraphInstantiate_flags, CUstreamCaptureMode};
use symm_allreduce::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use symm_allreduce::{Algorithm, Communicator, Config, SymmetricTensor};

const TIMEOUT: Duration = Duration::from_millis(1500);

fn config(check_divergence: bool) -> Config {
    Config {
        capacity_bytes: 4 << 20,
        pool_bytes: 8 << 20,
        timeout: TIMEOUT,
        check_divergence,
        ..Config::default()
    }
}

/// One rank's way of making the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Choice {
    /// `all_reduce` of an ordinary buffer into another.
    Plain,
    /// `all_reduce_in_place` of an ordinary buffer.
    PlainInPlace,
    /// `all_reduce` of views at element offset 1 (input) and 3 (output).
    PlainOffset,
    /// `all_reduce` with the pool buffer as an ordinary input.
    PoolAsPlain,
    /// `all_reduce_pool`: the pool buffer, in place.
    PoolInPlace,
    /// `all_reduce_from_pool`: the pool buffer into an ordinary output.
    PoolOut,
}

const CHOICES: [Choice; 6] = [
    Choice::Plain,
    Choice::PlainInPlace,
    Choice::PlainOffset,
    Choice::PoolAsPlain,
    Choice::PoolInPlace,
    Choice::PoolOut,
];

/// One rank's buffers: an ordinary input/output pair with room for offsets, and a pool buffer.
struct RankBuffers {
    input: CudaSlice<bf16>,
    output: CudaSlice<bf16>,
    pool: SymmetricTensor<bf16>,
}

/// What a scenario ended with on one rank.
#[derive(Debug)]
enum Outcome {
    Ok(Vec<bf16>),
    Failed(String),
}

struct Group {
    comms: Vec<Communicator>,
    streams: Vec<Arc<CudaStream>>,
    bufs: Vec<RankBuffers>,
}

fn make_group(ctx: &Arc<CudaContext>, world: usize, len: usize, check: bool) -> Group {
    let (comms, streams) = common::group(ctx, world, config(check));
    let bufs = (0..world)
        .map(|r| RankBuffers {
            input: streams[r].alloc_zeros(len + 8).unwrap(),
            output: streams[r].alloc_zeros(len + 8).unwrap(),
            pool: comms[r].alloc_symmetric::<bf16>(len, &streams[r]).unwrap(),
        })
        .collect();
    Group { comms, streams, bufs }
}

/// Runs one all-reduce of `len` bf16 elements with `choices[r]` on rank r. Returns each
/// rank's outcome (the result read back from where that rank's call put it) and checks that
/// every rank's pool buffer still holds what it held when that rank did not pass it.
fn run_scenario(g: &mut Group, len: usize, choices: &[Choice], seed: u64) -> (Vec<Outcome>, Vec<Vec<bf16>>) {
    let world = g.comms.len();
    let mut gen = rng(seed);
    let inputs: Vec<Vec<bf16>> = (0..world).map(|_| random_input(&mut gen, len)).collect();
    let canary: Vec<Vec<bf16>> = (0..world).map(|_| random_input(&mut gen, len)).collect();
    for r in 0..world {
        let s = &g.streams[r];
        let b = &mut g.bufs[r];
        let pool_gets = matches!(
            choices[r],
            Choice::PoolAsPlain | Choice::PoolInPlace | Choice::PoolOut
        );
        let (into_input, into_pool) = if pool_gets {
            (&canary[r], &inputs[r])
        } else {
            (&inputs[r], &canary[r])
        };
        let offset = usize::from(choices[r] == Choice::PlainOffset);
        s.memcpy_htod(into_input, &mut b.input.slice_mut(offset..offset + len))
            .unwrap();
        s.memcpy_htod(into_pool, &mut b.pool).unwrap();
        s.memcpy_htod(&vec![bf16::from_f32(-7.0); len + 8], &mut b.output)
            .unwrap();
        s.synchronize().unwrap();
    }
    let mut launch_errors: Vec<Option<String>> = vec![None; world];
    for r in 0..world {
        let (c, s, b) = (&g.comms[r], &g.streams[r], &mut g.bufs[r]);
        let result = match choices[r] {
            Choice::Plain => c.all_reduce(&b.input.slice(..len), &mut b.output.slice_mut(..len), s),
            Choice::PlainInPlace => c.all_reduce_in_place(&mut b.input.slice_mut(..len), s, Algorithm::Auto),
            Choice::PlainOffset => {
                c.all_reduce(&b.input.slice(1..len + 1), &mut b.output.slice_mut(3..len + 3), s)
            }
            Choice::PoolAsPlain => c.all_reduce(&b.pool, &mut b.output.slice_mut(..len), s),
            Choice::PoolInPlace => c.all_reduce_pool(&mut b.pool, s),
            Choice::PoolOut => c.all_reduce_from_pool(&b.pool, &mut b.output.slice_mut(..len), s),
        };
        launch_errors[r] = result.err().map(|e| e.to_string());
    }
    let mut outcomes = Vec::with_capacity(world);
    for r in 0..world {
        let (c, s, b) = (&g.comms[r], &g.streams[r], &g.bufs[r]);
        let synced = c.synchronize(s);
        let result = match choices[r] {
            Choice::Plain | Choice::PoolAsPlain | Choice::PoolOut => s.clone_dtoh(&b.output.slice(..len)),
            Choice::PlainInPlace => s.clone_dtoh(&b.input.slice(..len)),
            Choice::PlainOffset => s.clone_dtoh(&b.output.slice(3..len + 3)),
            Choice::PoolInPlace => s.clone_dtoh(&b.pool),
        }
        .unwrap();
        let pool_now = s.clone_dtoh(&b.pool).unwrap();
        let pool_passed = matches!(
            choices[r],
            Choice::PoolAsPlain | Choice::PoolInPlace | Choice::PoolOut
        );
        if !pool_passed {
            assert!(
                pool_now
                    .iter()
                    .zip(&canary[r])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{choices:?} len {len}: rank {r}'s pool buffer changed although rank {r} did not pass it"
            );
        }
        outcomes.push(match (launch_errors[r].take(), synced) {
            (Some(e), _) => Outcome::Failed(e),
            (None, Err(e)) => Outcome::Failed(e.to_string()),
            (None, Ok(())) => Outcome::Ok(result),
        });
    }
    (outcomes, inputs)
}

/// Every rank right, or every rank failed within twice the timeout.
fn judge(what: &str, outcomes: &[Outcome], inputs: &[Vec<bf16>], took: Duration) -> bool {
    let failed = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Failed(_)))
        .count();
    if failed == 0 {
        let expected = emulate(inputs);
        for (r, o) in outcomes.iter().enumerate() {
            if let Outcome::Ok(got) = o {
                check_bits(&format!("{what}: rank {r}"), &expected, got).unwrap();
            }
        }
        return true;
    }
    assert_eq!(
        failed,
        outcomes.len(),
        "{what}: some ranks returned Ok, others failed: {outcomes:?}"
    );
    assert!(took < 2 * TIMEOUT, "{what}: the failure took {took:?}");
    if let Some(Outcome::Failed(e)) = outcomes.first() {
        eprintln!("{what}: rank 0: {e}");
    }
    false
}

fn rank_local_choices(ctx: Arc<CudaContext>) {
    let mut pairs = 0;
    let mut failures = 0;
    for world in [2usize, 3, 8] {
        // bf16 elements: the low-latency range, its last size and the first above it (the
        // one-shot; pool calls copy in there too), the one-shot range, and above it (the
        // zero-copy pool kernels; the two-shot, or at two ranks the one-shot up to 2 MiB).
        let ll = config(false).low_latency_limit(world) / 2;
        let sizes = [1000usize, ll, ll + 1, ll + 60_000, 1_100_000];
        for check in [false, true] {
            for &len in &sizes {
                let mut g = make_group(&ctx, world, len, check);
                for (i, &a) in CHOICES.iter().enumerate() {
                    for (j, &b) in CHOICES.iter().enumerate() {
                        let choices: Vec<Choice> = (0..world).map(|r| if r == 0 { a } else { b }).collect();
                        let what = format!("W={world} check={check} len {len}: rank 0 {a:?}, others {b:?}");
                        let started = Instant::now();
                        let (outcomes, inputs) = run_scenario(&mut g, len, &choices, (i * 8 + j) as u64);
                        pairs += 1;
                        if !judge(&what, &outcomes, &inputs, started.elapsed()) {
                            failures += 1;
                            g = make_group(&ctx, world, len, check);
                            continue;
                        }
                        // A group that agreed is right in its next call too.
                        let plain = vec![Choice::Plain; world];
                        let (outcomes, inputs) = run_scenario(&mut g, len, &plain, 999);
                        assert!(judge(
                            &format!("{what}, next call"),
                            &outcomes,
                            &inputs,
                            Duration::ZERO
                        ));
                    }
                }
            }
        }
    }
    eprintln!(
        "{pairs} pairs of choices: {} right on every rank, {failures} failed on every rank",
        pairs - failures
    );
}

/// `calls[r]` on rank r (length and whether f16 instead of bf16): every rank fails within
/// twice the timeout.
fn expect_failure_everywhere(
    ctx: &Arc<CudaContext>,
    what: &str,
    calls: &[(usize, bool, Algorithm)],
    check: bool,
) {
    let world = calls.len();
    let (comms, streams) = common::group(ctx, world, config(check));
    let started = Instant::now();
    let mut errors = Vec::new();
    for r in 0..world {
        let (len, is_f16, algo) = calls[r];
        let s = &streams[r];
        let launched = if is_f16 {
            let x: CudaSlice<f16> = s.clone_htod(&vec![f16::ONE; len]).unwrap();
            let mut y: CudaSlice<f16> = s.alloc_zeros(len).unwrap();
            let r = comms[r].all_reduce_with(&x, &mut y, s, algo);
            s.synchronize().ok();
            r
        } else {
            let x: CudaSlice<bf16> = s.clone_htod(&vec![bf16::ONE; len]).unwrap();
            let mut y: CudaSlice<bf16> = s.alloc_zeros(len).unwrap();
            comms[r].all_reduce_with(&x, &mut y, s, algo)
        };
        errors.push(launched.err());
    }
    for r in 0..world {
        let e = match errors[r].take() {
            Some(e) => e,
            None => comms[r]
                .synchronize(&streams[r])
                .err()
                .unwrap_or_else(|| panic!("{what}: rank {r} returned Ok")),
        };
        if r == 0 {
            eprintln!("{what}: {e}");
        }
    }
    let took = started.elapsed();
    assert!(took < 2 * TIMEOUT, "{what}: took {took:?}");
}

fn lengths_and_dtypes_that_differ_fail_on_every_rank(ctx: Arc<CudaContext>) {
    use Algorithm::{Auto, LowLatency, OneShot, TwoShot};
    // Divergence check off: the barrier kernels' flags tell the calls apart, and the
    // low-latency kernel's rotation of its lines (Auto at 4097: low-latency; 7 and 8 bf16
    // elements fill one line either way). Check on: the announcements do, before any data.
    for (algo, len, check) in [
        (OneShot, 1001usize, false),
        (OneShot, 70_001, false),
        (TwoShot, 1001, false),
        (TwoShot, 300_001, false),
        (Auto, 200_001, false),
        (LowLatency, 7, false),
        (LowLatency, 1001, false),
        (Auto, 4097, false),
        (LowLatency, 1001, true),
        (Auto, 4097, true),
    ] {
        expect_failure_everywhere(
            &ctx,
            &format!("{algo:?} check={check}: length {len} vs {}", len + 1),
            &[(len, false, algo), (len + 1, false, algo), (len, false, algo)],
            check,
        );
        expect_failure_everywhere(
            &ctx,
            &format!("{algo:?} check={check}: bf16 vs f16, length {len}"),
            &[(len, false, algo), (len, true, algo)],
            check,
        );
    }
    expect_failure_everywhere(
        &ctx,
        "one-shot vs two-shot",
        &[(100_000, false, OneShot), (100_000, false, TwoShot)],
        false,
    );
    expect_failure_everywhere(
        &ctx,
        "low-latency vs one-shot",
        &[(4000, false, LowLatency), (4000, false, OneShot)],
        false,
    );
}

/// Replays `graph` on `stream` (which need not be the stream it was captured on).
fn replay_on(graph: &symm_allreduce::cudarc::driver::CudaGraph, stream: &CudaStream) {
    // SAFETY: a live executable graph of this context and a live stream of it.
    let code = unsafe { sys::cuGraphLaunch(graph.cu_graph_exec(), stream.cu_stream()) };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuGraphLaunch");
}

/// eager on A → capture on B → eager on A → replay on B → eager on A (→ replay on C → eager on
/// B → replay on A with three streams), the first eager call queued behind a 30 ms kernel on
/// A: every call's result bit for bit, at W = 2 and 4, for the low-latency, one-shot and
/// two-shot kernels.
fn mixed_eager_captured_and_replayed_calls(ctx: Arc<CudaContext>) {
    const CALLS: usize = 8;
    for world in [2usize, 4] {
        for (algo, len) in [
            (Algorithm::LowLatency, 3000usize),
            (Algorithm::OneShot, 50_001),
            (Algorithm::TwoShot, 200_003),
        ] {
            // (2, false): eager on A, capture on B; (2, true): the capture on A itself, the
            // stream of the eager calls before it (as a cudarc user captures); 3: a third
            // stream for replays and eager calls.
            for (streams_per_rank, capture_on_a) in [(2usize, false), (2, true), (3, false)] {
                let what = format!(
                    "W={world} {algo:?} len {len}, {streams_per_rank} streams, capture on A {capture_on_a}"
                );
                let (comms, _) = common::group(&ctx, world, config(false));
                let streams: Vec<Vec<Arc<CudaStream>>> = (0..world)
                    .map(|_| (0..streams_per_rank).map(|_| ctx.new_stream().unwrap()).collect())
                    .collect();
                let mut gen = rng(len as u64);
                let inputs: Vec<Vec<Vec<f32>>> = (0..world)
                    .map(|_| (0..CALLS).map(|_| random_input(&mut gen, len)).collect())
                    .collect();
                let d_in: Vec<Vec<CudaSlice<f32>>> = (0..world)
                    .map(|r| {
                        inputs[r]
                            .iter()
                            .map(|x| streams[r][0].clone_htod(x).unwrap())
                            .collect()
                    })
                    .collect();
                let mut d_out: Vec<Vec<CudaSlice<f32>>> = (0..world)
                    .map(|r| {
                        (0..CALLS)
                            .map(|_| streams[r][0].alloc_zeros(len).unwrap())
                            .collect()
                    })
                    .collect();
                for s in streams.iter().flatten() {
                    s.synchronize().unwrap();
                }
                let call = |r: usize, k: usize, s: &Arc<CudaStream>, d_out: &mut Vec<Vec<CudaSlice<f32>>>| {
                    comms[r]
                        .all_reduce_with(&d_in[r][k], &mut d_out[r][k], s, algo)
                        .unwrap();
                };
                // 1: eager on A, behind a slow kernel.
                for r in 0..world {
                    comms[r].__delay(&streams[r][0], 30_000_000).unwrap();
                    call(r, 0, &streams[r][0], &mut d_out);
                }
                // 2: capture calls 1 and 2 on B (or on A).
                let mut graphs = Vec::new();
                for r in 0..world {
                    let b = &streams[r][usize::from(!capture_on_a)];
                    b.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                        .unwrap();
                    call(r, 1, b, &mut d_out);
                    call(r, 2, b, &mut d_out);
                    graphs.push(
                        b.end_capture(
                            CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY,
                        )
                        .unwrap()
                        .expect("a graph"),
                    );
                }
                // 3: eager on A; 4: replay on B; 5: eager on A.
                for r in 0..world {
                    call(r, 3, &streams[r][0], &mut d_out);
                }
                for r in 0..world {
                    replay_on(&graphs[r], &streams[r][1]);
                }
                for r in 0..world {
                    call(r, 4, &streams[r][0], &mut d_out);
                }
                if streams_per_rank == 3 {
                    // 6: replay on C; 7: eager on B; 8: replay on A; 9: eager on C.
                    for r in 0..world {
                        replay_on(&graphs[r], &streams[r][2]);
                    }
                    for r in 0..world {
                        call(r, 5, &streams[r][1], &mut d_out);
                    }
                    for r in 0..world {
                        replay_on(&graphs[r], &streams[r][0]);
                    }
                    for r in 0..world {
                        call(r, 6, &streams[r][2], &mut d_out);
                    }
                }
                let done = if streams_per_rank == 3 { 7 } else { 5 };
                for r in 0..world {
                    for s in &streams[r] {
                        comms[r]
                            .synchronize(s)
                            .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
                    }
                }
                for k in 0..done {
                    let ins: Vec<Vec<f32>> = (0..world).map(|r| inputs[r][k].clone()).collect();
                    let expected = emulate(&ins);
                    for r in 0..world {
                        let got = streams[r][0].clone_dtoh(&d_out[r][k]).unwrap();
                        check_bits(&format!("{what}: call {k} rank {r}"), &expected, &got).unwrap();
                    }
                }
                drop(graphs);
            }
        }
    }
}

/// The same sequence with cudarc's event tracking on (the default users have): the calls'
/// bookkeeping must not break the captures.
fn mixed_calls_with_event_tracking_on(ctx: Arc<CudaContext>) {
    assert!(ctx.is_event_tracking());
    mixed_eager_captured_and_replayed_calls(ctx);
}

/// A communicator leaves the application's context in the stream mode it found: cudarc's
/// per-buffer events start only when the application creates a stream of its own (the
/// crate's stream for its bookkeeping under capture is not one of cudarc's counted streams).
fn a_communicator_keeps_the_context_single_stream(_ctx: Arc<CudaContext>) {
    let ctx = symm_allreduce::context(0).unwrap();
    assert!(ctx.is_event_tracking() && !ctx.is_in_multi_stream_mode());
    let comms = Communicator::local_group(&[ctx.clone(), ctx.clone()], Config::default()).unwrap();
    assert!(
        !ctx.is_in_multi_stream_mode(),
        "creating a communicator switched the context into cudarc's multi-stream mode"
    );
    drop(comms);
    assert!(!ctx.is_in_multi_stream_mode());
}

/// A pool buffer passed to the zero-copy calls by one rank and as an ordinary buffer by the
/// others never changes a peer's pool buffer (the in-place kernel writes every rank's copy):
/// covered by `rank_local_choices`; this checks the plain f16 path's buffers stay untouched
/// around a view (nothing written outside the buffers passed).
fn nothing_is_written_around_a_view(ctx: Arc<CudaContext>) {
    let world = 3;
    let (comms, streams) = common::group(&ctx, world, config(false));
    for len in [1usize, 7, 1000, 16_385, 100_001] {
        let mut gen = rng(len as u64);
        let inputs: Vec<Vec<f16>> = (0..world).map(|_| random_input(&mut gen, len)).collect();
        let mut outs = Vec::new();
        for r in 0..world {
            let s = &streams[r];
            let x = s.clone_htod(&inputs[r]).unwrap();
            let mut y = s.clone_htod(&vec![f16::from_f32(3.0); len + 16]).unwrap();
            comms[r].all_reduce(&x, &mut y.slice_mut(5..len + 5), s).unwrap();
            outs.push((x, y));
        }
        let expected = emulate(&inputs);
        for r in 0..world {
            comms[r].synchronize(&streams[r]).unwrap();
            let y = streams[r].clone_dtoh(&outs[r].1).unwrap();
            check_bits(&format!("len {len} rank {r}"), &expected, &y[5..len + 5]).unwrap();
            assert!(
                y[..5].iter().chain(&y[len + 5..]).all(|v| v.to_f32() == 3.0),
                "len {len} rank {r}: written outside the view"
            );
        }
    }
}

/// The PDL contract: a consumer launched with programmatic serialization right after a
/// collective, which calls `griddepcontrol.wait` before reading, always sees the complete
/// output; with `Config::pdl_at_exit` one that does not wait sees it too. Low-latency,
/// one-shot and two-shot kernels, 30 rounds each, bit for bit.
fn pdl_consumers_see_the_complete_output(ctx: Arc<CudaContext>) {
    const W: usize = 4;
    for at_exit in [false, true] {
        let (comms, streams) = common::group(
            &ctx,
            W,
            Config {
                pdl_at_exit: at_exit,
                ..config(false)
            },
        );
        for (algo, len) in [
            (Algorithm::LowLatency, 8000usize),
            (Algorithm::OneShot, 100_000),
            (Algorithm::TwoShot, 500_000),
        ] {
            let waits: &[bool] = if at_exit { &[true, false] } else { &[true] };
            for &wait in waits {
                for round in 0..30u64 {
                    let mut gen = rng(round);
                    let inputs: Vec<Vec<f32>> = (0..W).map(|_| random_input(&mut gen, len)).collect();
                    let mut bufs = Vec::new();
                    for r in 0..W {
                        let s = &streams[r];
                        let x = s.clone_htod(&inputs[r]).unwrap();
                        let mut y = s.alloc_zeros::<f32>(len).unwrap();
                        let mut z = s.alloc_zeros::<f32>(len).unwrap();
                        s.synchronize().unwrap();
                        comms[r].all_reduce_with(&x, &mut y, s, algo).unwrap();
                        comms[r].__launch_consumer(&y, &mut z, wait, s).unwrap();
                        bufs.push((x, y, z));
                    }
                    let expected = emulate(&inputs);
                    for r in 0..W {
                        comms[r].synchronize(&streams[r]).unwrap();
                        let z = streams[r].clone_dtoh(&bufs[r].2).unwrap();
                        let what = format!("{algo:?} at_exit={at_exit} waits={wait} round {round} rank {r}");
                        check_bits(&what, &expected, &z).unwrap();
                    }
                }
            }
        }
    }
}

/// The PDL trigger each rank reports: early (at the start of a collective) only where the rank
/// owns its device (`Config::early_trigger`), after the first wait where ranks share one, at
/// exit with `pdl_at_exit`. A lone rank with the early trigger: a consumer that waits sees the
/// complete output (the all-reduce of one rank is its input), 30 rounds per algorithm.
fn the_early_trigger_is_for_ranks_with_a_device_of_their_own(ctx: Arc<CudaContext>) {
    let pdl_line = |c: &Communicator| {
        c.describe()
            .lines()
            .find(|l| l.starts_with("PDL: "))
            .expect("describe() has a PDL line")
            .to_string()
    };
    let (lone, streams) = common::group(&ctx, 1, config(false));
    let line = pdl_line(&lone[0]);
    if line.starts_with("PDL: off") {
        println!("skipped: {line}");
        return;
    }
    assert!(line.contains("as soon as a collective has begun"), "{line}");
    let (shared, _) = common::group(&ctx, 2, config(false));
    for c in &shared {
        let line = pdl_line(c);
        assert!(line.contains("first wait on the peers"), "{line}");
    }
    drop(shared);
    let (at_exit, _) = common::group(
        &ctx,
        1,
        Config {
            pdl_at_exit: true,
            ..config(false)
        },
    );
    assert!(pdl_line(&at_exit[0]).contains("when a collective exits"));
    drop(at_exit);
    let s = &streams[0];
    for (algo, len) in [
        (Algorithm::LowLatency, 8001usize),
        (Algorithm::OneShot, 100_003),
        (Algorithm::TwoShot, 500_001),
    ] {
        for round in 0..30u64 {
            let input = random_input(&mut rng(round), len);
            let x = s.clone_htod(&input).unwrap();
            let mut y = s.alloc_zeros::<f32>(len).unwrap();
            let mut z = s.alloc_zeros::<f32>(len).unwrap();
            lone[0].all_reduce_with(&x, &mut y, s, algo).unwrap();
            lone[0].__launch_consumer(&y, &mut z, true, s).unwrap();
            lone[0].synchronize(s).unwrap();
            let z = s.clone_dtoh(&z).unwrap();
            check_bits(&format!("{algo:?} round {round}"), &input, &z).unwrap();
        }
    }
}

fn main() -> std::process::ExitCode {
    common::harness::run(
        "agreement",
        vec![
            gpu_test!(rank_local_choices),
            gpu_test!(lengths_and_dtypes_that_differ_fail_on_every_rank),
            gpu_test!(mixed_eager_captured_and_replayed_calls),
            gpu_tracked_test!(mixed_calls_with_event_tracking_on),
            gpu_tracked_test!(a_communicator_keeps_the_context_single_stream),
            gpu_test!(nothing_is_written_around_a_view),
            gpu_test!(pdl_consumers_see_the_complete_output),
            gpu_test!(the_early_trigger_is_for_ranks_with_a_device_of_their_own),
        ],
    )
}
