//! Correctness on the GPU with virtual ranks (several ranks on one device, each with its own
//! stream and its own mapping of every peer's memory): every result is compared with the fp32
//! rank-order emulation bit for bit and with an f64 reference within a dtype-aware bound, and
//! every rank's output with rank 0's.
//!
//! Run by [`common::harness`] (`harness = false`): without a GPU every test is reported as
//! ignored with the reason, and the run ends with a line counting GPU tests ran and skipped.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{check_against_f64, check_bits, collect_outputs, emulate, group, random_input, rng, TestElem};
use half::{bf16, f16};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};
use rand::Rng;
use std::cell::RefCell;
use symm_allreduce::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use symm_allreduce::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use symm_allreduce::{Algorithm, Communicator, Config, DType, Error};

const ALGOS: [Algorithm; 4] = [
    Algorithm::OneShot,
    Algorithm::TwoShot,
    Algorithm::LowLatency,
    Algorithm::Auto,
];

/// The low-latency kernel only takes messages that fit its slots (by default 256 KiB up to 4
/// ranks, 64 KiB above): clamp the length when it is forced on `comm`'s group.
fn fit(comm: &Communicator, algo: Algorithm, dtype: DType, len: usize) -> usize {
    if algo == Algorithm::LowLatency {
        len.min(comm.config().low_latency_limit(comm.world_size()) / dtype.size())
    } else {
        len
    }
}

fn config(capacity_bytes: usize) -> Config {
    Config {
        capacity_bytes,
        ..Config::default()
    }
}

/// Uploads, reduces on every rank (rank order of launches 0..W), downloads.
/// Outputs start poisoned (0xFF bytes: NaN in every dtype) so unwritten elements show.
fn round<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    inputs: &[Vec<T>],
    algo: Algorithm,
) -> Result<Vec<Vec<T>>, String> {
    offset_round(comms, streams, inputs, algo, (0, 0))
}

/// The three properties every result must have.
fn verify<T: TestElem>(inputs: &[Vec<T>], outputs: &[Vec<T>], what: &str) -> Result<(), String> {
    for (r, out) in outputs.iter().enumerate().skip(1) {
        check_bits(&format!("{what}: rank {r} vs rank 0"), &outputs[0], out)?;
    }
    check_bits(
        &format!("{what}: fp32 rank-order emulation"),
        &emulate(inputs),
        &outputs[0],
    )?;
    check_against_f64(inputs, &outputs[0]).map_err(|e| format!("{what}: {e}"))
}

fn random_round<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    len: usize,
    algo: Algorithm,
    seed: u64,
) -> Result<(), String> {
    let mut g = rng(seed);
    let inputs: Vec<Vec<T>> = (0..comms.len()).map(|_| random_input(&mut g, len)).collect();
    let outputs = round(comms, streams, &inputs, algo)?;
    verify(
        &inputs,
        &outputs,
        &format!("{} W={} len={len} {algo}", T::DTYPE, comms.len()),
    )
}

fn dispatch(
    dtype: DType,
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    len: usize,
    algo: Algorithm,
    seed: u64,
) -> Result<(), String> {
    let len = fit(&comms[0], algo, dtype, len);
    match dtype {
        DType::F32 => random_round::<f32>(comms, streams, len, algo, seed),
        DType::F16 => random_round::<f16>(comms, streams, len, algo, seed),
        DType::BF16 => random_round::<bf16>(comms, streams, len, algo, seed),
    }
}

fn proptest_dtype_world_count_algorithm_against_references(ctx: Arc<CudaContext>) {
    let max_len = 4 << 20;
    let groups: RefCell<HashMap<usize, common::Group>> = RefCell::default();
    let strategy = (
        0usize..3,
        prop::sample::select(vec![2usize, 3, 4, 8]),
        prop_oneof![
            4 => 1usize..=64,
            4 => 65usize..=100_000,
            2 => 100_001usize..=max_len,
        ],
        0usize..ALGOS.len(),
        any::<u64>(),
    );
    let mut runner = TestRunner::new(PropConfig {
        cases: 96,
        failure_persistence: None,
        ..PropConfig::default()
    });
    runner
        .run(&strategy, |(d, world, len, a, seed)| {
            let mut groups = groups.borrow_mut();
            let (comms, streams) = groups
                .entry(world)
                .or_insert_with(|| group(&ctx, world, config(max_len * 4)));
            dispatch(DType::ALL[d], comms, streams, len, ALGOS[a], seed).map_err(TestCaseError::fail)
        })
        .unwrap();
}

fn edge_sizes_every_dtype_world_and_algorithm(ctx: Arc<CudaContext>) {
    let sizes = [
        1usize, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 511, 4095, 4096, 4097, 65_537,
    ];
    for world in 1..=8 {
        let (comms, streams) = group(&ctx, world, config(1 << 20));
        for dtype in DType::ALL {
            for algo in ALGOS {
                for (i, &len) in sizes.iter().enumerate() {
                    dispatch(dtype, &comms, &streams, len, algo, (world * 1000 + i) as u64).unwrap();
                }
            }
        }
    }
}

fn one_shot_and_two_shot_agree_bit_for_bit(ctx: Arc<CudaContext>) {
    let (comms, streams) = group(&ctx, 8, config(8 << 20));
    let mut g = rng(7);
    for len in [13usize, 4099, 262_147, 1_000_003] {
        let inputs: Vec<Vec<bf16>> = (0..8).map(|_| random_input(&mut g, len)).collect();
        let one = round(&comms, &streams, &inputs, Algorithm::OneShot).unwrap();
        let two = round(&comms, &streams, &inputs, Algorithm::TwoShot).unwrap();
        for r in 0..8 {
            check_bits(&format!("len {len} rank {r}"), &one[r], &two[r]).unwrap();
        }
        if len * 2 <= comms[0].config().low_latency_limit(8) {
            let ll = round(&comms, &streams, &inputs, Algorithm::LowLatency).unwrap();
            for r in 0..8 {
                check_bits(&format!("low latency len {len} rank {r}"), &one[r], &ll[r]).unwrap();
            }
        }
    }
}

fn nan_and_inf_propagate_as_ieee_sums(ctx: Arc<CudaContext>) {
    let (comms, streams) = group(&ctx, 4, config(1 << 20));
    let len = 1027;
    let mut g = rng(11);
    let mut inputs: Vec<Vec<f32>> = (0..4).map(|_| random_input(&mut g, len)).collect();
    inputs[1][0] = f32::NAN;
    inputs[2][5] = f32::INFINITY;
    inputs[3][5] = f32::NEG_INFINITY; // inf + -inf = NaN
    inputs[0][9] = f32::INFINITY;
    inputs[2][1026] = f32::NAN; // in the scalar tail
    for algo in [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::LowLatency] {
        let out = round(&comms, &streams, &inputs, algo).unwrap();
        check_bits("nan/inf", &emulate(&inputs), &out[0]).unwrap();
        assert!(out[0][0].is_nan() && out[0][5].is_nan() && out[0][1026].is_nan());
        assert_eq!(out[0][9], f32::INFINITY);
        assert!(out[0][10].is_finite());
    }
}

fn in_place_all_reduce_matches_out_of_place(ctx: Arc<CudaContext>) {
    let (comms, streams) = group(&ctx, 4, config(4 << 20));
    let mut g = rng(3);
    for (len, algo) in [
        (1001usize, Algorithm::OneShot),
        (500_001, Algorithm::TwoShot),
        (77, Algorithm::Auto),
    ] {
        let inputs: Vec<Vec<f16>> = (0..4).map(|_| random_input(&mut g, len)).collect();
        let mut bufs: Vec<CudaSlice<f16>> = streams
            .iter()
            .zip(&inputs)
            .map(|(s, x)| s.clone_htod(x).unwrap())
            .collect();
        for r in 0..4 {
            comms[r]
                .all_reduce_in_place(&mut bufs[r], &streams[r], algo)
                .unwrap();
        }
        let outs: Vec<Vec<f16>> = collect_outputs(&comms, &streams, &bufs);
        verify(&inputs, &outs, &format!("in place len {len}")).unwrap();
    }
}

/// 1000 calls enqueued back to back (no host sync in between), each on fresh random data
/// with its own length and algorithm, so the grid and the buffer parity change between
/// calls; one sync at the end, then all 1000 results are checked.
fn back_to_back(ctx: Arc<CudaContext>, world: usize, seed: u64) {
    const CALLS: usize = 1000;
    const SLOT: usize = 6000; // elements, a multiple of 8: every slot is 16-byte aligned
    let (comms, streams) = group(&ctx, world, config(SLOT * 2));
    let mut g = rng(seed);
    let lens: Vec<usize> = (0..CALLS).map(|_| g.random_range(1..=SLOT)).collect();
    let algos: Vec<Algorithm> = (0..CALLS)
        .map(|_| ALGOS[g.random_range(0..ALGOS.len())])
        .collect();
    let inputs: Vec<Vec<bf16>> = (0..world).map(|_| random_input(&mut g, CALLS * SLOT)).collect();
    let d_in: Vec<CudaSlice<bf16>> = streams
        .iter()
        .zip(&inputs)
        .map(|(s, x)| s.clone_htod(x).unwrap())
        .collect();
    let mut d_out: Vec<CudaSlice<bf16>> = streams
        .iter()
        .map(|s| s.alloc_zeros::<bf16>(CALLS * SLOT).unwrap())
        .collect();
    for c in 0..CALLS {
        let range = c * SLOT..c * SLOT + lens[c];
        for r in 0..world {
            let input = d_in[r].slice(range.clone());
            let mut output = d_out[r].slice_mut(range.clone());
            comms[r]
                .all_reduce_with(&input, &mut output, &streams[r], algos[c])
                .unwrap();
        }
    }
    let outs: Vec<Vec<bf16>> = collect_outputs(&comms, &streams, &d_out);
    for c in 0..CALLS {
        let range = c * SLOT..c * SLOT + lens[c];
        let ins: Vec<Vec<bf16>> = inputs.iter().map(|x| x[range.clone()].to_vec()).collect();
        let os: Vec<Vec<bf16>> = outs.iter().map(|x| x[range.clone()].to_vec()).collect();
        verify(&ins, &os, &format!("call {c} len {} {}", lens[c], algos[c])).unwrap();
    }
}

fn thousand_back_to_back_calls_world_8(ctx: Arc<CudaContext>) {
    back_to_back(ctx, 8, 1);
}

fn thousand_back_to_back_calls_world_3(ctx: Arc<CudaContext>) {
    back_to_back(ctx, 3, 2);
}

/// Each rank captures one graph holding 10 all-reduces (sizes on both sides of the
/// crossover, forced and automatic algorithms); the graphs are replayed 100 times, with new
/// inputs copied in before every replay.
fn graph_of_ten_all_reduces_replays_100_times_on_new_inputs(ctx: Arc<CudaContext>) {
    const W: usize = 8;
    let ops: [(usize, Algorithm); 10] = [
        (1, Algorithm::Auto),
        (9, Algorithm::Auto),
        (100, Algorithm::TwoShot),
        (4097, Algorithm::LowLatency),
        (4096, Algorithm::Auto),
        (4099, Algorithm::OneShot),
        (131_072, Algorithm::Auto), // 256 KiB bf16: last one-shot size at W=8
        (131_080, Algorithm::Auto), // just above: two-shot
        (600_001, Algorithm::Auto),
        (7, Algorithm::LowLatency),
    ];
    let offsets: Vec<usize> = ops
        .iter()
        .scan(0usize, |acc, (len, _)| {
            let o = *acc;
            *acc += len.next_multiple_of(8);
            Some(o)
        })
        .collect();
    let total: usize = ops.iter().map(|(l, _)| l.next_multiple_of(8)).sum();
    let (comms, streams) = group(&ctx, W, config(2 << 20));
    let mut d_in: Vec<CudaSlice<bf16>> = streams.iter().map(|s| s.alloc_zeros(total).unwrap()).collect();
    let mut d_out: Vec<CudaSlice<bf16>> = streams.iter().map(|s| s.alloc_zeros(total).unwrap()).collect();

    let mut graphs = Vec::new();
    for r in 0..W {
        streams[r]
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        for (i, &(len, algo)) in ops.iter().enumerate() {
            let range = offsets[i]..offsets[i] + len;
            let input = d_in[r].slice(range.clone());
            let mut output = d_out[r].slice_mut(range);
            comms[r]
                .all_reduce_with(&input, &mut output, &streams[r], algo)
                .unwrap();
        }
        let graph = streams[r]
            .end_capture(CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("captured graph");
        graphs.push(graph);
    }

    replay_on_fresh_inputs(
        &comms,
        &streams,
        &graphs,
        &mut d_in,
        &d_out,
        100,
        99,
        |replay, inputs, outs| {
            for (i, &(len, algo)) in ops.iter().enumerate() {
                let range = offsets[i]..offsets[i] + len;
                let ins: Vec<Vec<bf16>> = inputs.iter().map(|x| x[range.clone()].to_vec()).collect();
                let os: Vec<Vec<bf16>> = outs.iter().map(|x| x[range.clone()].to_vec()).collect();
                verify(&ins, &os, &format!("replay {replay} op {i} len {len} {algo}")).unwrap();
            }
        },
    );
}

/// Replays every rank's graph `replays` times. Before each replay a fresh window of a random
/// pool is copied into every rank's input buffer (outside the graph); `check` gets the inputs
/// and every rank's output after the replay.
#[allow(clippy::too_many_arguments)]
fn replay_on_fresh_inputs(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    graphs: &[symm_allreduce::cudarc::driver::CudaGraph],
    d_in: &mut [CudaSlice<bf16>],
    d_out: &[CudaSlice<bf16>],
    replays: usize,
    seed: u64,
    mut check: impl FnMut(usize, &[Vec<bf16>], &[Vec<bf16>]),
) {
    let len = d_in[0].len();
    let mut g = rng(seed);
    let pool: Vec<bf16> = random_input(&mut g, len * 4);
    for replay in 0..replays {
        let inputs: Vec<Vec<bf16>> = (0..comms.len())
            .map(|r| {
                let start = (replay * 7919 + r * 104_729) % (pool.len() - len);
                pool[start..start + len].to_vec()
            })
            .collect();
        for (r, d) in d_in.iter_mut().enumerate() {
            streams[r].memcpy_htod(&inputs[r], d).unwrap();
        }
        for graph in graphs {
            graph.launch().unwrap();
        }
        let outs: Vec<Vec<bf16>> = collect_outputs(comms, streams, d_out);
        check(replay, &inputs, &outs);
    }
}

fn bad_inputs_return_typed_errors_and_touch_nothing(ctx: Arc<CudaContext>) {
    let (comms, streams) = group(&ctx, 2, config(4096));
    let s = &streams[0];
    let input = s.clone_htod(&[1.0f32; 2048]).unwrap();
    let sentinel = vec![-7.0f32; 2048];
    let mut output = s.clone_htod(&sentinel).unwrap();

    let empty = s.alloc_zeros::<f32>(0);
    if let Ok(empty) = empty {
        let mut empty_out = s.alloc_zeros::<f32>(0).unwrap();
        assert!(matches!(
            comms[0].all_reduce(&empty, &mut empty_out, s),
            Err(Error::Empty)
        ));
    }
    let short = input.slice(0..100);
    assert!(matches!(
        comms[0].all_reduce(&short, &mut output, s),
        Err(Error::LengthMismatch {
            input: 100,
            output: 2048
        })
    ));
    let big = s.alloc_zeros::<f32>(1025).unwrap();
    let mut big_out = s.alloc_zeros::<f32>(1025).unwrap();
    assert!(matches!(
        comms[0].all_reduce(&big, &mut big_out, s),
        Err(Error::ExceedsCapacity {
            bytes: 4100,
            capacity: 4096
        })
    ));
    // Views at any element offset are valid calls now (tests/gpu_pool.rs reduces them).
    // Nothing was launched: the output still holds the sentinel, and the communicator works.
    s.synchronize().unwrap();
    assert_eq!(s.clone_dtoh(&output).unwrap(), sentinel);
    comms[0].check_usable().unwrap();
    round(
        &comms,
        &streams,
        &[vec![1.0f32; 1000], vec![2.0f32; 1000]],
        Algorithm::Auto,
    )
    .unwrap();
}

/// The benchmark's producer kernel (`__launch_producer`): an exact copy at any length and
/// element offset (16-byte accesses where both ends allow, bytes elsewhere), typed errors
/// before any launch, and a producer → all-reduce chain (PDL on) equal to the plain call.
fn producer_kernel_copies_any_length_and_offset(ctx: Arc<CudaContext>) {
    let (comms, streams) = group(&ctx, 2, config(4 << 20));
    let s = &streams[0];
    let mut rng = rng(0x9D0D);
    let total = (1 << 20) + 64;
    let src_host: Vec<bf16> = random_input(&mut rng, total);
    let src = s.clone_htod(&src_host).unwrap();
    for len in [1, 7, 8, 9, 4099, 1 << 20] {
        for (from, to) in [(0, 0), (1, 1), (0, 3), (5, 0)] {
            let mut dst = s.alloc_zeros::<bf16>(total).unwrap();
            comms[0]
                .__launch_producer(&src.slice(from..from + len), &mut dst.slice_mut(to..to + len), s)
                .unwrap();
            let got = s.clone_dtoh(&dst).unwrap();
            let what = format!("len {len}, offsets {from} -> {to}");
            check_bits(&what, &src_host[from..from + len], &got[to..to + len]).unwrap();
            assert!(
                got[..to].iter().chain(&got[to + len..]).all(|x| x.to_bits() == 0),
                "{what}: wrote outside"
            );
        }
    }

    let sentinel = vec![bf16::from_f32(-7.0); 100];
    let mut dst = s.clone_htod(&sentinel).unwrap();
    assert!(matches!(
        comms[0].__launch_producer(&src.slice(0..99), &mut dst, s),
        Err(Error::LengthMismatch {
            input: 99,
            output: 100
        })
    ));
    if let (Ok(empty), Ok(mut empty_out)) = (s.alloc_zeros::<bf16>(0), s.alloc_zeros::<bf16>(0)) {
        assert!(matches!(
            comms[0].__launch_producer(&empty, &mut empty_out, s),
            Err(Error::Empty)
        ));
    }
    s.synchronize().unwrap();
    assert_eq!(s.clone_dtoh(&dst).unwrap(), sentinel);

    // The chain: each rank's producer writes the all-reduce's input, which the PDL launch of
    // the all-reduce must see whole.
    let len = 3000;
    let inputs: Vec<Vec<bf16>> = (0..2).map(|_| random_input(&mut rng, len)).collect();
    let d_src: Vec<CudaSlice<bf16>> = streams
        .iter()
        .zip(&inputs)
        .map(|(s, h)| s.clone_htod(h).unwrap())
        .collect();
    let mut staged: Vec<CudaSlice<bf16>> = streams.iter().map(|s| s.alloc_zeros(len).unwrap()).collect();
    let mut outs: Vec<CudaSlice<bf16>> = streams.iter().map(|s| s.alloc_zeros(len).unwrap()).collect();
    for r in 0..2 {
        comms[r]
            .__launch_producer(&d_src[r], &mut staged[r], &streams[r])
            .unwrap();
        comms[r]
            .all_reduce(&staged[r], &mut outs[r], &streams[r])
            .unwrap();
    }
    let expected = emulate(&inputs);
    for (r, out) in collect_outputs(&comms, &streams, &outs).iter().enumerate() {
        check_bits(&format!("chain, rank {r}"), &expected, out).unwrap();
    }
}

fn stuck_peer_times_out_poisons_and_does_not_hang(ctx: Arc<CudaContext>) {
    let timeout = Duration::from_millis(200);
    // The two-shot twice: over the low-latency lines (40 KB: a shard fits) and with barriers
    // (800 KB at W = 3: both halves of a shard exceed the 256 KiB limit).
    for (algo, len) in [
        (Algorithm::OneShot, 10_000),
        (Algorithm::TwoShot, 10_000),
        (Algorithm::TwoShot, 200_000),
        (Algorithm::LowLatency, 10_000),
    ] {
        let comms = Communicator::local_group(
            &[ctx.clone(), ctx.clone(), ctx.clone()],
            Config {
                capacity_bytes: 1 << 20,
                timeout,
                ..Config::default()
            },
        )
        .unwrap();
        let stream = ctx.new_stream().unwrap();
        let len = fit(&comms[0], algo, DType::F32, len);
        let input = stream.clone_htod(&vec![1.0f32; len]).unwrap();
        let mut output = stream.alloc_zeros::<f32>(len).unwrap();
        let started = Instant::now();
        // Ranks 1 and 2 never launch.
        comms[0]
            .all_reduce_with(&input, &mut output, &stream, algo)
            .unwrap();
        let err = comms[0].synchronize(&stream).unwrap_err();
        let waited = started.elapsed();
        assert!(waited >= timeout, "{algo}: returned after {waited:?}");
        assert!(waited < timeout * 20, "{algo}: took {waited:?}");
        // The low-latency kernels (the two-shot's too, where a shard fits its lines) wait for
        // the data itself; the barrier kernels at their start barrier.
        let kernel = comms[0].path(len, DType::F32, algo).unwrap().kernel.unwrap();
        let expected_phase = if kernel.ends_with("_ll") {
            symm_allreduce::BarrierPhase::Arrival
        } else {
            symm_allreduce::BarrierPhase::Start
        };
        match &err {
            Error::PeerTimeout {
                rank: 0, peer, phase, ..
            } if *phase == expected_phase => assert!(*peer == 1 || *peer == 2, "{err}"),
            _ => panic!("{algo}: unexpected {err:?}"),
        }
        // Poisoned: later calls fail at once, without launching.
        assert!(matches!(
            comms[0].all_reduce(&input, &mut output, &stream),
            Err(Error::Poisoned { .. })
        ));
        assert!(matches!(comms[0].check_usable(), Err(Error::Poisoned { .. })));
        // The ranks that never ran have nothing to report.
        comms[1].check_usable().unwrap();
    }
}

/// Zero-copy in place on the communicator's symmetric buffers: copy in, reduce, copy out,
/// over many calls enqueued back to back (the next call's copy-in overwrites the buffer right
/// after the previous reduction: the end barrier must make that safe).
fn symmetric_rounds<T: TestElem>(
    world: usize,
    lens: &[usize],
    seed: u64,
    ctx: &Arc<symm_allreduce::cudarc::driver::CudaContext>,
) {
    let slot = lens.iter().max().unwrap().next_multiple_of(8);
    let (comms, streams) = group(ctx, world, config(slot * 4));
    let mut g = rng(seed);
    let inputs: Vec<Vec<T>> = (0..world)
        .map(|_| random_input(&mut g, slot * lens.len()))
        .collect();
    let d_in: Vec<CudaSlice<T>> = streams
        .iter()
        .zip(&inputs)
        .map(|(s, x)| s.clone_htod(x).unwrap())
        .collect();
    let mut d_out: Vec<CudaSlice<T>> = streams
        .iter()
        .map(|s| s.alloc_zeros::<T>(slot * lens.len()).unwrap())
        .collect();
    for (c, &len) in lens.iter().enumerate() {
        let range = c * slot..c * slot + len;
        for r in 0..world {
            comms[r]
                .copy_to_symmetric(&d_in[r].slice(range.clone()), &streams[r])
                .unwrap();
        }
        for r in 0..world {
            comms[r].all_reduce_symmetric::<T>(len, &streams[r]).unwrap();
        }
        for r in 0..world {
            comms[r]
                .copy_from_symmetric(&mut d_out[r].slice_mut(range.clone()), &streams[r])
                .unwrap();
        }
    }
    let outs: Vec<Vec<T>> = collect_outputs(&comms, &streams, &d_out);
    for (c, &len) in lens.iter().enumerate() {
        let range = c * slot..c * slot + len;
        let ins: Vec<Vec<T>> = inputs.iter().map(|x| x[range.clone()].to_vec()).collect();
        let os: Vec<Vec<T>> = outs.iter().map(|x| x[range.clone()].to_vec()).collect();
        verify(
            &ins,
            &os,
            &format!("symmetric {} W={world} call {c} len {len}", T::DTYPE),
        )
        .unwrap();
    }
}

fn symmetric_in_place_every_dtype_and_world_back_to_back(ctx: Arc<CudaContext>) {
    let lens = [1usize, 7, 9, 4099, 100_003, 16, 65_536, 3, 250_001, 8];
    for world in [1usize, 2, 3, 4, 8] {
        symmetric_rounds::<f32>(world, &lens, world as u64, &ctx);
        symmetric_rounds::<f16>(world, &lens, 10 + world as u64, &ctx);
        symmetric_rounds::<bf16>(world, &lens, 20 + world as u64, &ctx);
    }
    // Many small calls back to back with varying sizes.
    let mut g = rng(5);
    let many: Vec<usize> = (0..300).map(|_| g.random_range(1..=5000)).collect();
    symmetric_rounds::<bf16>(8, &many, 77, &ctx);
}

fn symmetric_in_place_replays_in_a_graph(ctx: Arc<CudaContext>) {
    const W: usize = 4;
    let len = 200_003;
    let (comms, streams) = group(&ctx, W, config(len * 2));
    let mut d_in: Vec<CudaSlice<bf16>> = streams.iter().map(|s| s.alloc_zeros(len).unwrap()).collect();
    let mut d_out: Vec<CudaSlice<bf16>> = streams.iter().map(|s| s.alloc_zeros(len).unwrap()).collect();
    let graphs: Vec<_> = (0..W)
        .map(|r| {
            streams[r]
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .unwrap();
            comms[r].copy_to_symmetric(&d_in[r], &streams[r]).unwrap();
            comms[r].all_reduce_symmetric::<bf16>(len, &streams[r]).unwrap();
            comms[r].copy_from_symmetric(&mut d_out[r], &streams[r]).unwrap();
            streams[r]
                .end_capture(CUgraphInstantiate_flags(0))
                .unwrap()
                .expect("graph")
        })
        .collect();
    replay_on_fresh_inputs(
        &comms,
        &streams,
        &graphs,
        &mut d_in,
        &d_out,
        50,
        8,
        |replay, inputs, outs| {
            verify(inputs, outs, &format!("symmetric graph replay {replay}")).unwrap();
        },
    );
}

/// `round` on views at element offsets `in_off` / `out_off` of larger buffers (the kernels'
/// unaligned load and store paths when the offset is not a multiple of a 16-byte pack).
fn offset_round<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    inputs: &[Vec<T>],
    algo: Algorithm,
    (in_off, out_off): (usize, usize),
) -> Result<Vec<Vec<T>>, String> {
    let len = inputs[0].len();
    let nan = bytemuck::cast_slice::<u8, T>(&[0xFFu8; 16])[0];
    let d_in: Vec<CudaSlice<T>> = streams
        .iter()
        .zip(inputs)
        .map(|(s, x)| {
            let mut padded = vec![nan; in_off];
            padded.extend_from_slice(x);
            s.clone_htod(&padded).unwrap()
        })
        .collect();
    let mut d_out: Vec<CudaSlice<T>> = streams
        .iter()
        .map(|s| s.clone_htod(&vec![nan; out_off + len]).unwrap())
        .collect();
    for r in 0..comms.len() {
        let input = d_in[r].slice(in_off..in_off + len);
        let mut output = d_out[r].slice_mut(out_off..out_off + len);
        comms[r]
            .all_reduce_with(&input, &mut output, &streams[r], algo)
            .map_err(|e| format!("rank {r}: {e}"))?;
    }
    for r in 0..comms.len() {
        comms[r]
            .synchronize(&streams[r])
            .map_err(|e| format!("rank {r}: {e}"))?;
    }
    Ok(d_out
        .iter()
        .zip(streams)
        .map(|(d, s)| s.clone_dtoh(d).unwrap()[out_off..].to_vec())
        .collect())
}

/// One case of [`coll_bodies_odd_sizes_and_offsets_proptest`]: `algo` (the unicast
/// instantiation of a policy body) against the emulation bit for bit, and against the peer
/// two-shot (aligned views) bit for bit.
fn coll_case<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    len: usize,
    algo: Algorithm,
    offsets: (usize, usize),
    seed: u64,
) -> Result<(), String> {
    let mut g = rng(seed);
    let inputs: Vec<Vec<T>> = (0..comms.len()).map(|_| random_input(&mut g, len)).collect();
    let what = format!(
        "{} W={} len={len} {algo} offsets {offsets:?}",
        T::DTYPE,
        comms.len()
    );
    let outputs = offset_round(comms, streams, &inputs, algo, offsets)?;
    verify(&inputs, &outputs, &what)?;
    let two = round(comms, streams, &inputs, Algorithm::TwoShot)?;
    for r in 0..comms.len() {
        check_bits(&format!("{what}: rank {r} vs two-shot"), &two[r], &outputs[r])?;
    }
    Ok(())
}

/// The one-shot and low-latency kernels are the unicast instantiations of the bodies written
/// over the collective policy (`one_shot<Coll, T>`, `one_shot_ll<Coll, T>`; the multimem
/// instantiations run the same bodies and are checked in the PTX, tests/multimem_code.rs):
/// random dtype × W ∈ {2, 3, 4, 8} × odd lengths (a scalar tail, a partial last line) × element
/// offsets of the input and output views, bit for bit against the fp32 rank-order emulation,
/// every rank against rank 0, and the peer two-shot.
fn coll_bodies_odd_sizes_and_offsets_proptest(ctx: Arc<CudaContext>) {
    let groups: RefCell<HashMap<usize, common::Group>> = RefCell::default();
    let bodies = [Algorithm::OneShot, Algorithm::LowLatency];
    let strategy = (
        0usize..3,
        prop::sample::select(vec![2usize, 3, 4, 8]),
        prop_oneof![
            4 => 1usize..=64,
            4 => 65usize..=20_000,
            2 => 20_001usize..=600_000,
        ],
        0usize..bodies.len(),
        (0usize..4, 0usize..4),
        any::<u64>(),
    );
    let mut runner = TestRunner::new(PropConfig {
        cases: 96,
        failure_persistence: None,
        ..PropConfig::default()
    });
    runner
        .run(&strategy, |(d, world, len, b, offsets, seed)| {
            let mut groups = groups.borrow_mut();
            let (comms, streams) = groups
                .entry(world)
                .or_insert_with(|| group(&ctx, world, config(4 << 20)));
            let (dtype, algo) = (DType::ALL[d], bodies[b]);
            // Odd, and within the low-latency slots when forced.
            let len = fit(&comms[0], algo, dtype, len);
            let len = if len % 2 == 0 { len - 1 } else { len };
            let r = match dtype {
                DType::F32 => coll_case::<f32>(comms, streams, len, algo, offsets, seed),
                DType::F16 => coll_case::<f16>(comms, streams, len, algo, offsets, seed),
                DType::BF16 => coll_case::<bf16>(comms, streams, len, algo, offsets, seed),
            };
            r.map_err(TestCaseError::fail)
        })
        .unwrap();
}

/// The same bodies on every odd length around the pack and line boundaries, every dtype and
/// W ∈ {2, 3, 4, 8}, aligned and at an odd element offset.
fn coll_bodies_every_boundary_length(ctx: Arc<CudaContext>) {
    let lens = [
        1usize, 3, 5, 7, 9, 15, 17, 31, 33, 511, 513, 4095, 4097, 8191, 16_383, 65_537,
    ];
    for world in [2usize, 3, 4, 8] {
        let (comms, streams) = group(&ctx, world, config(1 << 20));
        for dtype in DType::ALL {
            for algo in [Algorithm::OneShot, Algorithm::LowLatency] {
                for (i, &len) in lens.iter().enumerate() {
                    let len = fit(&comms[0], algo, dtype, len);
                    let len = if len % 2 == 0 { len - 1 } else { len };
                    for offsets in [(0, 0), (1, 3)] {
                        let seed = (world * 10_000 + i * 10 + offsets.0) as u64;
                        let r = match dtype {
                            DType::F32 => coll_case::<f32>(&comms, &streams, len, algo, offsets, seed),
                            DType::F16 => coll_case::<f16>(&comms, &streams, len, algo, offsets, seed),
                            DType::BF16 => coll_case::<bf16>(&comms, &streams, len, algo, offsets, seed),
                        };
                        r.unwrap();
                    }
                }
            }
        }
    }
}

fn main() -> std::process::ExitCode {
    common::harness::run(
        "gpu_all_reduce",
        vec![
            gpu_test!(proptest_dtype_world_count_algorithm_against_references),
            gpu_test!(edge_sizes_every_dtype_world_and_algorithm),
            gpu_test!(one_shot_and_two_shot_agree_bit_for_bit),
            gpu_test!(nan_and_inf_propagate_as_ieee_sums),
            gpu_test!(in_place_all_reduce_matches_out_of_place),
            gpu_test!(thousand_back_to_back_calls_world_8),
            gpu_test!(thousand_back_to_back_calls_world_3),
            gpu_test!(graph_of_ten_all_reduces_replays_100_times_on_new_inputs),
            gpu_test!(bad_inputs_return_typed_errors_and_touch_nothing),
            gpu_test!(producer_kernel_copies_any_length_and_offset),
            gpu_test!(stuck_peer_times_out_poisons_and_does_not_hang),
            gpu_test!(symmetric_in_place_every_dtype_and_world_back_to_back),
            gpu_test!(symmetric_in_place_replays_in_a_graph),
            gpu_test!(coll_bodies_odd_sizes_and_offsets_proptest),
            gpu_test!(coll_bodies_every_boundary_length),
        ],
    )
}
