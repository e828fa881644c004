//! The collectives beside the all-reduce on the GPU with virtual ranks (several ranks on one
//! device, each with its own stream and its own mapping of every peer's memory):
//! `all_gather` and `all_gather_v` must be bit-exact copies (byte types and float types, odd
//! byte lengths), `reduce_scatter` bit-exact against the fp32 rank-order emulation and
//! identical to the same slice of an `all_reduce` of the same inputs; back-to-back calls
//! mixed with all-reduces, CUDA graph replays on new inputs, and bad input (typed errors,
//! counts that disagree across ranks reported on every rank).
//!
//! Run by [`common::harness`] (`harness = false`): without a GPU every test is reported as
//! ignored with the reason.

mod common;

mod support {
    pub mod counting_alloc;
}

#[global_allocator]
static GLOBAL: support::counting_alloc::Counting = support::counting_alloc::Counting;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use common::{check_bits, emulate, group, random_input, rng, TestElem};
use half::{bf16, f16};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};
use rand::rngs::StdRng;
use rand::Rng;
use symm_allreduce::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use symm_allreduce::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use symm_allreduce::{Algorithm, Communicator, Config, DType, Error, Gatherable};

const WORLDS: [usize; 4] = [2, 3, 4, 8];

fn config(capacity_bytes: usize) -> Config {
    Config {
        capacity_bytes,
        ..Config::default()
    }
}

/// Random bytes as `len` elements of `T` (NaN patterns included for the float types: the
/// gathers copy bits).
fn random_elems<T: Gatherable>(g: &mut StdRng, len: usize) -> Vec<T> {
    let bytes: Vec<u8> = (0..len * std::mem::size_of::<T>()).map(|_| g.random()).collect();
    from_bytes(&bytes)
}

fn from_bytes<T: Gatherable>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

fn poison<T: Gatherable>(len: usize) -> Vec<T> {
    from_bytes(&vec![0xA5u8; len * std::mem::size_of::<T>()])
}

fn same_bytes<T: Gatherable>(what: &str, expected: &[T], got: &[T]) -> Result<(), String> {
    let (e, g): (&[u8], &[u8]) = (bytemuck::cast_slice(expected), bytemuck::cast_slice(got));
    if e.len() != g.len() {
        return Err(format!("{what}: {} bytes vs {}", e.len(), g.len()));
    }
    match e.iter().zip(g).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: byte {i} of {} expected {:#04x} got {:#04x}",
            e.len(),
            e[i],
            g[i]
        )),
    }
}

/// One rank's outputs of a round of mixed calls: the all-reduce and the reduce-scatter
/// bit-exact against the emulation, the all-gather byte for byte.
fn check_mixed<A: TestElem, R: TestElem>(
    what: &str,
    s: &Arc<CudaStream>,
    (ar_ref, ar): (&[A], &CudaSlice<A>),
    (ag_ref, ag): (&[u8], &CudaSlice<u8>),
    (rs_ref, rs): (&[R], &CudaSlice<R>),
) {
    check_bits(&format!("{what} all_reduce"), ar_ref, &s.clone_dtoh(ar).unwrap()).unwrap();
    same_bytes(&format!("{what} all_gather"), ag_ref, &s.clone_dtoh(ag).unwrap()).unwrap();
    check_bits(
        &format!("{what} reduce_scatter"),
        rs_ref,
        &s.clone_dtoh(rs).unwrap(),
    )
    .unwrap();
}

fn sync_all(comms: &[Communicator], streams: &[Arc<CudaStream>]) -> Result<(), String> {
    for (r, (c, s)) in comms.iter().zip(streams).enumerate() {
        c.synchronize(s).map_err(|e| format!("rank {r}: {e}"))?;
    }
    Ok(())
}

/// Gathers `counts[q]` random elements from each rank (all_gather when `v` is false and the
/// counts are equal) and checks every rank's output against the concatenation.
fn gather_round<T: Gatherable>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    counts: &[usize],
    v: bool,
    algo: Algorithm,
    seed: u64,
) -> Result<(), String> {
    let mut g = rng(seed);
    let inputs: Vec<Vec<T>> = counts.iter().map(|&c| random_elems(&mut g, c)).collect();
    let what = format!(
        "{} W={} counts={:?} {}",
        std::any::type_name::<T>(),
        comms.len(),
        &counts[..counts.len().min(8)],
        if v { "all_gather_v" } else { "all_gather" }
    );
    gather_and_check(comms, streams, &inputs, v, algo, &what)
}

/// Gathers rank q's `inputs[q]` (all_gather_v when `v`, else all_gather with `algo`) into
/// poisoned outputs and checks every rank's output against the concatenation, byte for byte.
fn gather_and_check<T: Gatherable>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    inputs: &[Vec<T>],
    v: bool,
    algo: Algorithm,
    what: &str,
) -> Result<(), String> {
    let w = comms.len();
    let counts: Vec<usize> = inputs.iter().map(Vec::len).collect();
    let expected: Vec<T> = inputs.concat();
    let total = expected.len();
    // A rank that sends nothing passes an empty view of a one-element buffer.
    let d_in: Vec<CudaSlice<T>> = (0..w)
        .map(|r| {
            let mut host = inputs[r].clone();
            host.extend(poison::<T>(1));
            streams[r].clone_htod(&host).unwrap()
        })
        .collect();
    let mut d_out: Vec<CudaSlice<T>> = streams
        .iter()
        .map(|s| s.clone_htod(&poison::<T>(total)).unwrap())
        .collect();
    for r in 0..w {
        let input = d_in[r].slice(0..counts[r]);
        let res = if v {
            comms[r].all_gather_v(&input, &counts, &mut d_out[r], &streams[r])
        } else {
            comms[r].all_gather_with(&input, &mut d_out[r], &streams[r], algo)
        };
        res.map_err(|e| format!("rank {r}: {e}"))?;
    }
    sync_all(comms, streams)?;
    for r in 0..w {
        let out = streams[r].clone_dtoh(&d_out[r]).unwrap();
        same_bytes(&format!("{what} rank {r}"), &expected, &out)?;
    }
    Ok(())
}

fn gather_dispatch(
    t: usize,
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    counts: &[usize],
    v: bool,
    algo: Algorithm,
    seed: u64,
) -> Result<(), String> {
    match t {
        0 => gather_round::<u8>(comms, streams, counts, v, algo, seed),
        1 => gather_round::<i8>(comms, streams, counts, v, algo, seed),
        2 => gather_round::<f32>(comms, streams, counts, v, algo, seed),
        3 => gather_round::<f16>(comms, streams, counts, v, algo, seed),
        _ => gather_round::<bf16>(comms, streams, counts, v, algo, seed),
    }
}

/// Reduce-scatter of random inputs: every rank's slice must have the bits of the fp32
/// rank-order emulation and of the same slice of an all-reduce of the same inputs.
fn reduce_scatter_round<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    len: usize,
    algo: Algorithm,
    seed: u64,
) -> Result<(), String> {
    let w = comms.len();
    let mut g = rng(seed);
    let inputs: Vec<Vec<T>> = (0..w).map(|_| random_input(&mut g, len * w)).collect();
    let reference = emulate(&inputs);
    let d_in: Vec<CudaSlice<T>> = (0..w)
        .map(|r| streams[r].clone_htod(&inputs[r]).unwrap())
        .collect();
    let nan: T = bytemuck::cast_slice::<u8, T>(&[0xFFu8; 16])[0];
    let mut d_rs: Vec<CudaSlice<T>> = streams
        .iter()
        .map(|s| s.clone_htod(&vec![nan; len]).unwrap())
        .collect();
    let mut d_ar: Vec<CudaSlice<T>> = streams
        .iter()
        .map(|s| s.clone_htod(&vec![nan; len * w]).unwrap())
        .collect();
    for r in 0..w {
        comms[r]
            .reduce_scatter_with(&d_in[r], &mut d_rs[r], &streams[r], algo)
            .map_err(|e| format!("rank {r}: {e}"))?;
        comms[r]
            .all_reduce(&d_in[r], &mut d_ar[r], &streams[r])
            .map_err(|e| format!("rank {r}: {e}"))?;
    }
    sync_all(comms, streams)?;
    let what = format!("{} W={w} len={len} reduce_scatter {algo}", T::DTYPE);
    for r in 0..w {
        let rs = streams[r].clone_dtoh(&d_rs[r]).unwrap();
        let ar = streams[r].clone_dtoh(&d_ar[r]).unwrap();
        let slice = r * len..(r + 1) * len;
        check_bits(
            &format!("{what} rank {r} vs emulation"),
            &reference[slice.clone()],
            &rs,
        )?;
        check_bits(&format!("{what} rank {r} vs all_reduce slice"), &ar[slice], &rs)?;
    }
    Ok(())
}

fn rs_dispatch(
    dtype: DType,
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    len: usize,
    algo: Algorithm,
    seed: u64,
) -> Result<(), String> {
    match dtype {
        DType::F32 => reduce_scatter_round::<f32>(comms, streams, len, algo, seed),
        DType::F16 => reduce_scatter_round::<f16>(comms, streams, len, algo, seed),
        DType::BF16 => reduce_scatter_round::<bf16>(comms, streams, len, algo, seed),
    }
}

type Groups = RefCell<HashMap<usize, common::Group>>;

fn group_for<'a>(
    groups: &'a mut HashMap<usize, common::Group>,
    ctx: &Arc<CudaContext>,
    w: usize,
) -> &'a common::Group {
    groups.entry(w).or_insert_with(|| group(ctx, w, config(8 << 20)))
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(PropConfig {
        cases,
        failure_persistence: None,
        ..PropConfig::default()
    })
}

fn proptest_all_gather_every_type_world_and_length(ctx: Arc<CudaContext>) {
    let groups: Groups = RefCell::default();
    let strategy = (
        0usize..5,
        prop::sample::select(WORLDS.to_vec()),
        prop_oneof![4 => 1usize..=64, 4 => 65usize..=50_000, 1 => 50_001usize..=400_000],
        prop::bool::ANY,
        any::<u64>(),
    );
    runner(80)
        .run(&strategy, |(t, w, len, forced, seed)| {
            let mut groups = groups.borrow_mut();
            let (comms, streams) = group_for(&mut groups, &ctx, w);
            let algo = if forced {
                Algorithm::OneShot
            } else {
                Algorithm::Auto
            };
            gather_dispatch(t, comms, streams, &vec![len; w], false, algo, seed).map_err(TestCaseError::fail)
        })
        .unwrap();
}

fn proptest_all_gather_v_uneven_counts(ctx: Arc<CudaContext>) {
    let groups: Groups = RefCell::default();
    let strategy = (
        0usize..5,
        prop::sample::select(WORLDS.to_vec()),
        prop::collection::vec(
            prop_oneof![1 => Just(0usize), 4 => 1usize..=40, 3 => 41usize..=30_000],
            8,
        ),
        any::<u64>(),
    );
    runner(80)
        .run(&strategy, |(t, w, counts, seed)| {
            let mut counts = counts[..w].to_vec();
            if counts.iter().all(|&c| c == 0) {
                counts[w - 1] = 13;
            }
            let mut groups = groups.borrow_mut();
            let (comms, streams) = group_for(&mut groups, &ctx, w);
            gather_dispatch(t, comms, streams, &counts, true, Algorithm::Auto, seed)
                .map_err(TestCaseError::fail)
        })
        .unwrap();
}

fn proptest_reduce_scatter_matches_emulation_and_all_reduce_slice(ctx: Arc<CudaContext>) {
    let groups: Groups = RefCell::default();
    let strategy = (
        0usize..3,
        prop::sample::select(WORLDS.to_vec()),
        prop_oneof![4 => 1usize..=64, 4 => 65usize..=40_000, 1 => 40_001usize..=200_000],
        prop::bool::ANY,
        any::<u64>(),
    );
    runner(80)
        .run(&strategy, |(d, w, len, forced, seed)| {
            let mut groups = groups.borrow_mut();
            let (comms, streams) = group_for(&mut groups, &ctx, w);
            let algo = if forced {
                Algorithm::OneShot
            } else {
                Algorithm::Auto
            };
            rs_dispatch(DType::ALL[d], comms, streams, len, algo, seed).map_err(TestCaseError::fail)
        })
        .unwrap();
}

fn edge_lengths_every_world_from_1_to_8(ctx: Arc<CudaContext>) {
    let lens = [1usize, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 511, 4095, 4097, 65_537];
    for w in 1..=8 {
        let (comms, streams) = group(&ctx, w, config(4 << 20));
        for (i, &len) in lens.iter().enumerate() {
            let seed = (w * 100 + i) as u64;
            for t in 0..5 {
                gather_dispatch(t, &comms, &streams, &vec![len; w], false, Algorithm::Auto, seed).unwrap();
            }
            let counts: Vec<usize> = (0..w).map(|q| (len + q * 5) % 70_000).collect();
            if counts.iter().any(|&c| c > 0) {
                gather_dispatch(0, &comms, &streams, &counts, true, Algorithm::Auto, seed).unwrap();
            }
            for d in DType::ALL {
                rs_dispatch(d, &comms, &streams, len, Algorithm::Auto, seed).unwrap();
            }
        }
    }
}

/// Rounds of an all-reduce, an all-gather, a reduce-scatter and an all-gather-v issued back to
/// back on every rank with no host synchronisation between them (buffers of both epoch
/// parities, changing grid sizes), checked after each round.
fn back_to_back_calls_mixed_with_all_reduce(ctx: Arc<CudaContext>) {
    for w in [3usize, 8] {
        let (comms, streams) = group(&ctx, w, config(4 << 20));
        let mut g = rng(w as u64);
        for round in 0..60 {
            let len = [5usize, 1000, 30_001, 200_003][round % 4] + round;
            let ar_in: Vec<Vec<bf16>> = (0..w).map(|_| random_input(&mut g, len)).collect();
            let ag_in: Vec<Vec<u8>> = (0..w).map(|_| random_elems(&mut g, len + 3)).collect();
            let rs_in: Vec<Vec<f32>> = (0..w).map(|_| random_input(&mut g, (len / 2 + 1) * w)).collect();
            let counts: Vec<usize> = (0..w).map(|q| (len * (q + 1)) % 9_001).collect();
            let agv_in: Vec<Vec<f16>> = counts.iter().map(|&c| random_elems(&mut g, c)).collect();
            let up = |r: usize| {
                let s = &streams[r];
                (
                    s.clone_htod(&ar_in[r]).unwrap(),
                    s.clone_htod(&ag_in[r]).unwrap(),
                    s.clone_htod(&rs_in[r]).unwrap(),
                    s.clone_htod(&[agv_in[r].as_slice(), &[f16::ONE]].concat())
                        .unwrap(),
                )
            };
            let ins: Vec<_> = (0..w).map(up).collect();
            let total: usize = counts.iter().sum();
            let mut outs: Vec<_> = (0..w)
                .map(|r| {
                    let s = &streams[r];
                    (
                        s.alloc_zeros::<bf16>(len).unwrap(),
                        s.alloc_zeros::<u8>((len + 3) * w).unwrap(),
                        s.alloc_zeros::<f32>(len / 2 + 1).unwrap(),
                        s.alloc_zeros::<f16>(total.max(1)).unwrap(),
                    )
                })
                .collect();
            for r in 0..w {
                let (c, s, i, o) = (&comms[r], &streams[r], &ins[r], &mut outs[r]);
                c.all_reduce(&i.0, &mut o.0, s).unwrap();
                c.all_gather(&i.1, &mut o.1, s).unwrap();
                c.reduce_scatter(&i.2, &mut o.2, s).unwrap();
                if total > 0 {
                    c.all_gather_v(&i.3.slice(0..counts[r]), &counts, &mut o.3, s)
                        .unwrap();
                }
            }
            sync_all(&comms, &streams).unwrap();
            let ar_ref = emulate(&ar_in);
            let ag_ref = ag_in.concat();
            let rs_ref = emulate(&rs_in);
            let agv_ref = agv_in.concat();
            let k = len / 2 + 1;
            for r in 0..w {
                let s = &streams[r];
                let what = format!("W={w} round {round} rank {r}");
                check_mixed(
                    &what,
                    s,
                    (&ar_ref, &outs[r].0),
                    (&ag_ref, &outs[r].1),
                    (&rs_ref[r * k..(r + 1) * k], &outs[r].2),
                );
                if total > 0 {
                    same_bytes(
                        &format!("{what} all_gather_v"),
                        &agv_ref,
                        &s.clone_dtoh(&outs[r].3).unwrap(),
                    )
                    .unwrap();
                }
            }
        }
    }
}

/// Every rank captures one graph (all-gather bf16, reduce-scatter bf16, all-reduce bf16,
/// all-gather-v u8 with uneven counts); the graphs are replayed 50 times with new inputs
/// copied into the same buffers before each replay.
fn graph_of_collectives_replays_on_new_inputs(ctx: Arc<CudaContext>) {
    const W: usize = 4;
    let (comms, streams) = group(&ctx, W, config(4 << 20));
    let (ag_len, rs_len, ar_len) = (1001usize, 3003usize, 70_001usize);
    let counts = [17usize, 0, 4099, 260];
    let total: usize = counts.iter().sum();
    let alloc = |r: usize| {
        let s = &streams[r];
        (
            s.alloc_zeros::<bf16>(ag_len).unwrap(),
            s.alloc_zeros::<bf16>(rs_len * W).unwrap(),
            s.alloc_zeros::<bf16>(ar_len).unwrap(),
            s.alloc_zeros::<u8>(counts[r].max(1)).unwrap(),
        )
    };
    let mut ins: Vec<_> = (0..W).map(alloc).collect();
    let mut outs: Vec<_> = (0..W)
        .map(|r| {
            let s = &streams[r];
            (
                s.alloc_zeros::<bf16>(ag_len * W).unwrap(),
                s.alloc_zeros::<bf16>(rs_len).unwrap(),
                s.alloc_zeros::<bf16>(ar_len).unwrap(),
                s.alloc_zeros::<u8>(total).unwrap(),
            )
        })
        .collect();
    let graphs: Vec<_> = (0..W)
        .map(|r| {
            let (c, s, i, o) = (&comms[r], &streams[r], &ins[r], &mut outs[r]);
            s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .unwrap();
            c.all_gather(&i.0, &mut o.0, s).unwrap();
            c.reduce_scatter(&i.1, &mut o.1, s).unwrap();
            c.all_reduce(&i.2, &mut o.2, s).unwrap();
            if counts[r] == 0 {
                c.all_gather_v(&i.3.slice(0..0), &counts, &mut o.3, s).unwrap();
            } else {
                c.all_gather_v(&i.3, &counts, &mut o.3, s).unwrap();
            }
            s.end_capture(CUgraphInstantiate_flags(0))
                .unwrap()
                .expect("captured graph")
        })
        .collect();
    let mut g = rng(99);
    for replay in 0..50 {
        let ag_in: Vec<Vec<bf16>> = (0..W).map(|_| random_input(&mut g, ag_len)).collect();
        let rs_in: Vec<Vec<bf16>> = (0..W).map(|_| random_input(&mut g, rs_len * W)).collect();
        let ar_in: Vec<Vec<bf16>> = (0..W).map(|_| random_input(&mut g, ar_len)).collect();
        let v_in: Vec<Vec<u8>> = counts.iter().map(|&c| random_elems(&mut g, c)).collect();
        for r in 0..W {
            let s = &streams[r];
            s.memcpy_htod(&ag_in[r], &mut ins[r].0).unwrap();
            s.memcpy_htod(&rs_in[r], &mut ins[r].1).unwrap();
            s.memcpy_htod(&ar_in[r], &mut ins[r].2).unwrap();
            if counts[r] > 0 {
                s.memcpy_htod(&v_in[r], &mut ins[r].3).unwrap();
            }
        }
        for graph in &graphs {
            graph.launch().unwrap();
        }
        sync_all(&comms, &streams).unwrap();
        let (ag_ref, rs_ref, ar_ref, v_ref) =
            (ag_in.concat(), emulate(&rs_in), emulate(&ar_in), v_in.concat());
        for r in 0..W {
            let s = &streams[r];
            let what = format!("replay {replay} rank {r}");
            check_bits(
                &format!("{what} all_gather"),
                &ag_ref,
                &s.clone_dtoh(&outs[r].0).unwrap(),
            )
            .unwrap();
            let slice = &rs_ref[r * rs_len..(r + 1) * rs_len];
            check_bits(
                &format!("{what} reduce_scatter"),
                slice,
                &s.clone_dtoh(&outs[r].1).unwrap(),
            )
            .unwrap();
            check_bits(
                &format!("{what} all_reduce"),
                &ar_ref,
                &s.clone_dtoh(&outs[r].2).unwrap(),
            )
            .unwrap();
            same_bytes(
                &format!("{what} all_gather_v"),
                &v_ref,
                &s.clone_dtoh(&outs[r].3).unwrap(),
            )
            .unwrap();
        }
    }
}

fn bad_collective_inputs_are_typed_errors(ctx: Arc<CudaContext>) {
    // The 32 KiB low-latency slots (the published limit at 2 ranks is 256 KiB, above this
    // group's capacity): the boundaries below are theirs.
    let config = Config {
        low_latency_max_bytes: Some(32 << 10),
        ..config(64 << 10)
    };
    let (comms, streams) = group(&ctx, 2, config);
    let s = &streams[0];
    let c = &comms[0];
    let input = s.clone_htod(&[1.0f32; 100]).unwrap();
    let sentinel = vec![-7.0f32; 300];
    let mut out = s.clone_htod(&sentinel).unwrap();
    let mut short = s.alloc_zeros::<f32>(199).unwrap();
    let expect_invalid = |r: Result<(), Error>, what: &str| match r {
        Err(Error::InvalidCollective { .. }) => {}
        other => panic!("{what}: expected InvalidCollective, got {other:?}"),
    };
    expect_invalid(
        c.all_gather(&input, &mut short, s),
        "all_gather output 199 for 2 × 100",
    );
    expect_invalid(
        c.reduce_scatter(&input, &mut short, s),
        "reduce_scatter 100 into 199",
    );
    let mut fifty = s.alloc_zeros::<f32>(49).unwrap();
    expect_invalid(
        c.reduce_scatter(&input, &mut fifty, s),
        "reduce_scatter 100 into 49",
    );
    expect_invalid(
        c.all_gather_v(&input, &[100], &mut out, s),
        "one count for two ranks",
    );
    expect_invalid(
        c.all_gather_v(&input, &[99, 100], &mut out, s),
        "own count != input",
    );
    expect_invalid(c.all_gather_v(&input, &[100, 100], &mut out, s), "output != sum");
    expect_invalid(
        c.all_gather_with(
            &input,
            &mut s.alloc_zeros::<f32>(200).unwrap(),
            s,
            Algorithm::TwoShot,
        ),
        "two-shot all_gather",
    );
    assert!(matches!(
        c.all_gather_with(
            &input,
            &mut s.alloc_zeros::<f32>(200).unwrap(),
            s,
            Algorithm::Nccl
        ),
        Err(Error::NcclUnavailable { .. })
    ));
    // Above the workspace without a fallback: refused, with the capacity named.
    let big = s.alloc_zeros::<u8>(64 << 10).unwrap();
    let mut big_out = s.alloc_zeros::<u8>(128 << 10).unwrap();
    assert!(matches!(
        c.all_gather(&big, &mut big_out, s),
        Err(Error::ExceedsCapacity { .. })
    ));
    let p = c.all_gather_path(1000, Algorithm::Auto).unwrap();
    assert!(p.to_string().contains("low-latency all_gather"), "{p}");
    let p = c.all_gather_path(20_000, Algorithm::Auto).unwrap();
    assert!(p.to_string().contains("one-shot all_gather"), "{p}");
    let p = c.reduce_scatter_path(1000, DType::BF16, Algorithm::Auto).unwrap();
    assert!(p.to_string().contains("low-latency reduce_scatter"), "{p}");
    // (At W = 2 every slice the workspace holds fits the 32 KiB low-latency slots.)
    let p = c
        .reduce_scatter_path(1000, DType::BF16, Algorithm::OneShot)
        .unwrap();
    assert!(p.to_string().contains("one-shot reduce_scatter"), "{p}");
    // Forced low-latency beyond its slots (32 KiB of lines: 16 KiB chunks) is refused.
    let chunk = s.alloc_zeros::<u8>((16 << 10) + 1).unwrap();
    let mut gathered = s.alloc_zeros::<u8>(2 * ((16 << 10) + 1)).unwrap();
    assert!(matches!(
        c.all_gather_with(&chunk, &mut gathered, s, Algorithm::LowLatency),
        Err(Error::ExceedsCapacity { .. })
    ));
    assert!(c.all_gather_v_path(&[5, 7]).is_ok());
    assert!(c.all_gather_v_path(&[5, 70 << 10]).is_err());
    // Nothing was written.
    c.synchronize(s).unwrap();
    assert_eq!(s.clone_dtoh(&out).unwrap(), sentinel);
}

/// Rank `odd` passes counts that differ from everyone else's (each rank's own counts are
/// locally consistent). Every rank's `synchronize` reports `CountsMismatch`, the peer chunks
/// of every output stay untouched, and the communicators work afterwards.
fn all_gather_v_counts_that_disagree_error_on_every_rank(ctx: Arc<CudaContext>) {
    for (w, odd) in [(3usize, 2usize), (4, 0), (8, 5)] {
        let (comms, streams) = group(&ctx, w, config(1 << 20));
        let good: Vec<usize> = (0..w).map(|q| 1000 + 37 * q).collect();
        let mut bad = good.clone();
        bad[(odd + 1) % w] += 16;
        let mut g = rng(w as u64);
        let inputs: Vec<Vec<u8>> = good.iter().map(|&c| random_elems(&mut g, c)).collect();
        let d_in: Vec<_> = (0..w)
            .map(|r| streams[r].clone_htod(&inputs[r]).unwrap())
            .collect();
        let mut d_out: Vec<_> = (0..w)
            .map(|r| {
                let counts = if r == odd { &bad } else { &good };
                streams[r].clone_htod(&poison::<u8>(counts.iter().sum())).unwrap()
            })
            .collect();
        for r in 0..w {
            let counts = if r == odd { &bad } else { &good };
            comms[r]
                .all_gather_v(&d_in[r], counts, &mut d_out[r], &streams[r])
                .unwrap();
        }
        for r in 0..w {
            match comms[r].synchronize(&streams[r]) {
                Err(Error::CountsMismatch { rank, .. }) => assert_eq!(rank, r),
                other => panic!("W={w} rank {r}: expected CountsMismatch, got {other:?}"),
            }
        }
        // Only the rank's own chunk was written (before the check); every peer chunk is poison.
        for r in 0..w {
            let counts = if r == odd { &bad } else { &good };
            let out = streams[r].clone_dtoh(&d_out[r]).unwrap();
            let mut at = 0;
            for (q, &c) in counts.iter().enumerate() {
                let chunk = &out[at..at + c];
                if q == r {
                    assert_eq!(chunk, &inputs[r][..], "W={w} rank {r}: own chunk");
                } else {
                    assert!(
                        chunk.iter().all(|&b| b == 0xA5),
                        "W={w} rank {r}: chunk {q} was written"
                    );
                }
                at += c;
            }
        }
        // Reported once; the communicators stay usable.
        for r in 0..w {
            comms[r].synchronize(&streams[r]).unwrap();
        }
        gather_round::<u8>(&comms, &streams, &good, true, Algorithm::Auto, 5).unwrap();
        reduce_scatter_round::<bf16>(&comms, &streams, 777, Algorithm::Auto, 6).unwrap();
    }
}

/// Thousands of eager all_gather / all_gather_v / reduce_scatter calls (kernel routes) after
/// a warm-up: the call path makes no heap allocation (a counting global allocator, per
/// thread), the property graph capture needs.
fn collective_calls_allocate_nothing(ctx: Arc<CudaContext>) {
    const W: usize = 2;
    let (comms, streams) = group(&ctx, W, config(1 << 20));
    let counts = [1000usize, 37];
    let ins: Vec<_> = (0..W)
        .map(|r| {
            let s = &streams[r];
            (
                s.clone_htod(&vec![bf16::ONE; 4099]).unwrap(),
                s.clone_htod(&vec![1u8; counts[r]]).unwrap(),
                s.clone_htod(&vec![f16::ONE; 2 * 777]).unwrap(),
            )
        })
        .collect();
    let mut outs: Vec<_> = (0..W)
        .map(|r| {
            let s = &streams[r];
            (
                s.alloc_zeros::<bf16>(4099 * W).unwrap(),
                s.alloc_zeros::<u8>(1037).unwrap(),
                s.alloc_zeros::<f16>(777).unwrap(),
            )
        })
        .collect();
    let mut round = || {
        for r in 0..W {
            let (c, s, i, o) = (&comms[r], &streams[r], &ins[r], &mut outs[r]);
            c.all_gather(&i.0, &mut o.0, s).unwrap();
            c.all_gather_v(&i.1, &counts, &mut o.1, s).unwrap();
            c.reduce_scatter(&i.2, &mut o.2, s).unwrap();
            c.check_usable().unwrap();
        }
    };
    round();
    sync_all(&comms, &streams).unwrap();
    let before = support::counting_alloc::allocations();
    for _ in 0..1000 {
        round();
    }
    let made = support::counting_alloc::allocations() - before;
    sync_all(&comms, &streams).unwrap();
    assert_eq!(made, 0, "3000 collective calls per rank allocated {made} times");
    let out = streams[0].clone_dtoh(&outs[0].2).unwrap();
    assert!(
        out.iter().all(|&x| x == f16::from_f32(2.0)),
        "reduce_scatter of ones over 2 ranks"
    );
}

// ---- Low-latency all-gather and reduce-scatter ------------------------------------------------

/// Byte patterns the low-latency lines must carry unchanged: all ones (the sentinel's bits),
/// runs of 0xFF, whole 16-byte lines of all ones between random ones, and random bytes.
fn adversarial_bytes(g: &mut StdRng, pattern: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| match pattern {
            0 => 0xFF,
            1 => {
                if (i / 5) % 2 == 0 {
                    0xFF
                } else {
                    g.random()
                }
            }
            2 => {
                if (i / 16) % 2 == 0 {
                    0xFF
                } else {
                    g.random()
                }
            }
            3 => {
                if i % 8 < 4 {
                    0xFF
                } else {
                    0x00
                }
            }
            _ => g.random(),
        })
        .collect()
}

/// Low-latency all-gather of `chunk` bytes per rank (as `T`), forced, checked on every rank.
fn low_latency_gather_round<T: Gatherable>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    chunk_elems: usize,
    pattern: usize,
    seed: u64,
) -> Result<(), String> {
    let w = comms.len();
    let mut g = rng(seed);
    let size = std::mem::size_of::<T>();
    let inputs: Vec<Vec<T>> = (0..w)
        .map(|_| from_bytes(&adversarial_bytes(&mut g, pattern, chunk_elems * size)))
        .collect();
    let what = format!(
        "{} W={w} chunk={chunk_elems} pattern {pattern} low-latency all_gather",
        std::any::type_name::<T>()
    );
    gather_and_check(comms, streams, &inputs, false, Algorithm::LowLatency, &what)
}

fn low_latency_all_gather_is_bit_exact_for_adversarial_bytes(ctx: Arc<CudaContext>) {
    let lens = [
        1usize,
        3,
        7,
        8,
        9,
        15,
        16,
        17,
        31,
        100,
        1001,
        4095,
        8193,
        16 << 10,
    ];
    for w in WORLDS {
        let (comms, streams) = group(&ctx, w, config(1 << 20));
        let p = comms[0].all_gather_path(16 << 10, Algorithm::Auto).unwrap();
        assert_eq!(p.algorithm, Algorithm::LowLatency, "{p}");
        for (i, &len) in lens.iter().enumerate() {
            for pattern in 0..5 {
                let seed = (w * 1000 + i * 10 + pattern) as u64;
                low_latency_gather_round::<u8>(&comms, &streams, len, pattern, seed).unwrap();
                if len % 2 == 0 {
                    low_latency_gather_round::<bf16>(&comms, &streams, len / 2, pattern, seed).unwrap();
                }
                if len % 4 == 0 {
                    low_latency_gather_round::<f32>(&comms, &streams, len / 4, pattern, seed).unwrap();
                }
            }
        }
        for (r, c) in comms.iter().enumerate() {
            assert!(
                c.__low_latency_slots_armed().unwrap(),
                "W={w} rank {r}: a line left un-armed"
            );
        }
    }
}

/// Reduce-scatter of `inputs` with `algo`: every rank's output slice.
fn reduce_scatter_with<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    inputs: &[Vec<T>],
    algo: Algorithm,
) -> Result<Vec<Vec<T>>, String> {
    let w = comms.len();
    let len = inputs[0].len() / w;
    let d_in: Vec<CudaSlice<T>> = (0..w)
        .map(|r| streams[r].clone_htod(&inputs[r]).unwrap())
        .collect();
    let mut d_out: Vec<CudaSlice<T>> = streams.iter().map(|s| s.alloc_zeros::<T>(len).unwrap()).collect();
    for r in 0..w {
        comms[r]
            .reduce_scatter_with(&d_in[r], &mut d_out[r], &streams[r], algo)
            .map_err(|e| format!("rank {r}: {e}"))?;
    }
    sync_all(comms, streams)?;
    Ok(d_out
        .iter()
        .zip(streams)
        .map(|(d, s)| s.clone_dtoh(d).unwrap())
        .collect())
}

/// Inputs with every element's bits all ones (the sentinel) on some ranks, ±0 and random
/// values on the others: the low-latency kernel must give the one-shot kernel's bits.
fn reduce_scatter_algorithms_agree<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    len: usize,
    seed: u64,
) -> Result<(), String> {
    let w = comms.len();
    let mut g = rng(seed);
    let ones: T = bytemuck::cast_slice::<u8, T>(&[0xFFu8; 16])[0];
    let inputs: Vec<Vec<T>> = (0..w)
        .map(|r| {
            let mut v: Vec<T> = random_input(&mut g, len * w);
            for (i, x) in v.iter_mut().enumerate() {
                if (i + r) % 7 == 0 {
                    *x = ones;
                } else if (i + r) % 11 == 0 {
                    *x = T::from_f32(-0.0);
                }
            }
            v
        })
        .collect();
    let ll = reduce_scatter_with(comms, streams, &inputs, Algorithm::LowLatency)?;
    let one = reduce_scatter_with(comms, streams, &inputs, Algorithm::OneShot)?;
    for r in 0..w {
        check_bits(
            &format!("{} W={w} len={len} rank {r} low-latency vs one-shot", T::DTYPE),
            &one[r],
            &ll[r],
        )?;
    }
    Ok(())
}

fn low_latency_reduce_scatter_matches_emulation_one_shot_and_all_reduce(ctx: Arc<CudaContext>) {
    let lens = [1usize, 2, 3, 7, 8, 9, 17, 100, 1001, 2047, 4096];
    for w in WORLDS {
        let (comms, streams) = group(&ctx, w, config(1 << 20));
        let p = comms[0]
            .reduce_scatter_path(4096, DType::F32, Algorithm::Auto)
            .unwrap();
        assert_eq!(p.algorithm, Algorithm::LowLatency, "{p}");
        for (i, &len) in lens.iter().enumerate() {
            let seed = (w * 100 + i) as u64;
            for d in DType::ALL {
                rs_dispatch(d, &comms, &streams, len, Algorithm::LowLatency, seed).unwrap();
            }
            reduce_scatter_algorithms_agree::<f32>(&comms, &streams, len, seed).unwrap();
            reduce_scatter_algorithms_agree::<f16>(&comms, &streams, len, seed).unwrap();
            reduce_scatter_algorithms_agree::<bf16>(&comms, &streams, len, seed).unwrap();
        }
        for (r, c) in comms.iter().enumerate() {
            assert!(
                c.__low_latency_slots_armed().unwrap(),
                "W={w} rank {r}: a line left un-armed"
            );
        }
    }
}

/// 300 rounds of low-latency all-reduce, all-gather and reduce-scatter (and a one-shot
/// all-gather every fifth round) back to back with no host synchronisation, on sizes that
/// change every round, so every line of the shared low-latency region is written by one
/// collective and read by another: results bit-exact each round, every line re-armed at the
/// end.
fn low_latency_collectives_share_the_region_without_breaking_the_sentinel(ctx: Arc<CudaContext>) {
    for w in [3usize, 8] {
        let (comms, streams) = group(&ctx, w, config(1 << 20));
        let mut g = rng(7 + w as u64);
        for round in 0..300 {
            let len = [3usize, 500, 2048, 4001, 777][round % 5] + round % 13;
            let ar_in: Vec<Vec<f32>> = (0..w).map(|_| random_input(&mut g, len)).collect();
            let ag_in: Vec<Vec<u8>> = (0..w)
                .map(|_| adversarial_bytes(&mut g, round % 5, 2 * len + 1))
                .collect();
            let rs_in: Vec<Vec<bf16>> = (0..w).map(|_| random_input(&mut g, len * w)).collect();
            let ins: Vec<_> = (0..w)
                .map(|r| {
                    let s = &streams[r];
                    (
                        s.clone_htod(&ar_in[r]).unwrap(),
                        s.clone_htod(&ag_in[r]).unwrap(),
                        s.clone_htod(&rs_in[r]).unwrap(),
                    )
                })
                .collect();
            let mut outs: Vec<_> = (0..w)
                .map(|r| {
                    let s = &streams[r];
                    (
                        s.alloc_zeros::<f32>(len).unwrap(),
                        s.alloc_zeros::<u8>((2 * len + 1) * w).unwrap(),
                        s.alloc_zeros::<bf16>(len).unwrap(),
                        s.alloc_zeros::<u8>((2 * len + 1) * w).unwrap(),
                    )
                })
                .collect();
            for r in 0..w {
                let (c, s, i, o) = (&comms[r], &streams[r], &ins[r], &mut outs[r]);
                c.all_reduce_with(&i.0, &mut o.0, s, Algorithm::LowLatency)
                    .unwrap();
                c.all_gather_with(&i.1, &mut o.1, s, Algorithm::LowLatency)
                    .unwrap();
                c.reduce_scatter_with(&i.2, &mut o.2, s, Algorithm::LowLatency)
                    .unwrap();
                if round % 5 == 0 {
                    c.all_gather_with(&i.1, &mut o.3, s, Algorithm::OneShot).unwrap();
                }
            }
            sync_all(&comms, &streams).unwrap();
            let (ar_ref, ag_ref, rs_ref) = (emulate(&ar_in), ag_in.concat(), emulate(&rs_in));
            for r in 0..w {
                let s = &streams[r];
                let what = format!("W={w} round {round} rank {r}");
                check_mixed(
                    &what,
                    s,
                    (&ar_ref, &outs[r].0),
                    (&ag_ref, &outs[r].1),
                    (&rs_ref[r * len..(r + 1) * len], &outs[r].2),
                );
                if round % 5 == 0 {
                    same_bytes(
                        &format!("{what} one-shot all_gather"),
                        &ag_ref,
                        &s.clone_dtoh(&outs[r].3).unwrap(),
                    )
                    .unwrap();
                }
            }
        }
        for (r, c) in comms.iter().enumerate() {
            assert!(
                c.__low_latency_slots_armed().unwrap(),
                "W={w} rank {r}: a line left un-armed"
            );
        }
    }
}

/// One graph per rank of a low-latency all-gather (bytes with all-ones lines), reduce-scatter
/// and all-reduce, replayed 100 times with new inputs.
fn low_latency_graph_replays_100_times_on_new_inputs(ctx: Arc<CudaContext>) {
    const W: usize = 4;
    let (comms, streams) = group(&ctx, W, config(1 << 20));
    let (ag_len, rs_len, ar_len) = (3001usize, 1999usize, 4097usize);
    let mut ins: Vec<_> = (0..W)
        .map(|r| {
            let s = &streams[r];
            (
                s.alloc_zeros::<u8>(ag_len).unwrap(),
                s.alloc_zeros::<f16>(rs_len * W).unwrap(),
                s.alloc_zeros::<bf16>(ar_len).unwrap(),
            )
        })
        .collect();
    let mut outs: Vec<_> = (0..W)
        .map(|r| {
            let s = &streams[r];
            (
                s.alloc_zeros::<u8>(ag_len * W).unwrap(),
                s.alloc_zeros::<f16>(rs_len).unwrap(),
                s.alloc_zeros::<bf16>(ar_len).unwrap(),
            )
        })
        .collect();
    for (what, path) in [
        (
            "all_gather",
            comms[0].all_gather_path(ag_len, Algorithm::Auto).unwrap(),
        ),
        (
            "reduce_scatter",
            comms[0]
                .reduce_scatter_path(rs_len, DType::F16, Algorithm::Auto)
                .unwrap(),
        ),
        (
            "all_reduce",
            comms[0].path(ar_len, DType::BF16, Algorithm::Auto).unwrap(),
        ),
    ] {
        assert_eq!(path.algorithm, Algorithm::LowLatency, "{what}: {path}");
    }
    let graphs: Vec<_> = (0..W)
        .map(|r| {
            let (c, s, i, o) = (&comms[r], &streams[r], &ins[r], &mut outs[r]);
            s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .unwrap();
            c.all_gather(&i.0, &mut o.0, s).unwrap();
            c.reduce_scatter(&i.1, &mut o.1, s).unwrap();
            c.all_reduce(&i.2, &mut o.2, s).unwrap();
            s.end_capture(CUgraphInstantiate_flags(0))
                .unwrap()
                .expect("captured graph")
        })
        .collect();
    let mut g = rng(1313);
    for replay in 0..100 {
        let ag_in: Vec<Vec<u8>> = (0..W)
            .map(|_| adversarial_bytes(&mut g, replay % 5, ag_len))
            .collect();
        let rs_in: Vec<Vec<f16>> = (0..W).map(|_| random_input(&mut g, rs_len * W)).collect();
        let ar_in: Vec<Vec<bf16>> = (0..W).map(|_| random_input(&mut g, ar_len)).collect();
        for r in 0..W {
            let s = &streams[r];
            s.memcpy_htod(&ag_in[r], &mut ins[r].0).unwrap();
            s.memcpy_htod(&rs_in[r], &mut ins[r].1).unwrap();
            s.memcpy_htod(&ar_in[r], &mut ins[r].2).unwrap();
        }
        for graph in &graphs {
            graph.launch().unwrap();
        }
        sync_all(&comms, &streams).unwrap();
        let (ag_ref, rs_ref, ar_ref) = (ag_in.concat(), emulate(&rs_in), emulate(&ar_in));
        for r in 0..W {
            let s = &streams[r];
            let what = format!("replay {replay} rank {r}");
            check_mixed(
                &what,
                s,
                (&ar_ref, &outs[r].2),
                (&ag_ref, &outs[r].0),
                (&rs_ref[r * rs_len..(r + 1) * rs_len], &outs[r].1),
            );
        }
    }
    for (r, c) in comms.iter().enumerate() {
        assert!(
            c.__low_latency_slots_armed().unwrap(),
            "rank {r}: a line left un-armed"
        );
    }
}

// ---- all_gather_v through NCCL --------------------------------------------------------------

/// An all_gather_v on a communicator with an NCCL fallback (NCCL refuses two ranks on one
/// GPU, so a world of one: one broadcast in the group): below the threshold the kernel;
/// above `nccl_above_bytes` or the workspace NCCL; every byte copied either way.
fn all_gather_v_routes_to_nccl_bit_exact(comm: &Communicator, stream: &Arc<CudaStream>) {
    assert!(comm.has_nccl_fallback(), "{:?}", comm.nccl_unavailable());
    let mut g = rng(4242);
    for (len, expect) in [
        (100usize, Algorithm::OneShot),
        (40_000, Algorithm::Nccl),  // above nccl_above_bytes
        (200_001, Algorithm::Nccl), // above the workspace
        (3, Algorithm::OneShot),
    ] {
        let path = comm.all_gather_v_path(&[len]).unwrap();
        assert_eq!(path.algorithm, expect, "len {len}: {path}");
        let host = adversarial_bytes(&mut g, len % 5, len);
        let input = stream.clone_htod(&host).unwrap();
        let mut out = stream.clone_htod(&poison::<u8>(len)).unwrap();
        comm.all_gather_v(&input, &[len], &mut out, stream).unwrap();
        comm.synchronize(stream).unwrap();
        let got = stream.clone_dtoh(&out).unwrap();
        same_bytes(&format!("all_gather_v of {len} bytes ({expect})"), &host, &got).unwrap();
    }
}

fn nccl_config() -> Config {
    Config {
        capacity_bytes: 64 << 10,
        nccl_above_bytes: Some(32 << 10),
        ..Config::default()
    }
}

fn all_gather_v_goes_to_nccl_through_the_callers_communicator(ctx: Arc<CudaContext>) {
    use symm_allreduce::cudarc::nccl::{Comm, Id};
    let nccl_stream = ctx.new_stream().unwrap();
    ctx.bind_to_thread().unwrap();
    let nccl = Comm::from_rank(nccl_stream.clone(), 0, 1, Id::new().expect("ncclGetUniqueId"))
        .expect("ncclCommInitRank");
    let comm = Communicator::from_nccl(nccl, nccl_config()).unwrap();
    // On another stream (event fork and join) and on the communicator's own.
    all_gather_v_routes_to_nccl_bit_exact(&comm, &ctx.new_stream().unwrap());
    all_gather_v_routes_to_nccl_bit_exact(&comm, &nccl_stream);
}

fn all_gather_v_goes_to_nccl_through_its_own_fallback(ctx: Arc<CudaContext>) {
    use std::time::Duration;
    use symm_allreduce::{SocketStore, StoreAddress};
    let address = StoreAddress::unique("symm-agv-test").unwrap();
    let store = SocketStore::new(&address, 0, 1, Duration::from_secs(10)).unwrap();
    let comm = Communicator::with_nccl_fallback(&store, ctx.clone(), nccl_config()).unwrap();
    all_gather_v_routes_to_nccl_bit_exact(&comm, &ctx.new_stream().unwrap());
}

/// Views at element offsets 1 and 3 (input and output, both ways round) for the all-gather,
/// the all-gather-v and the reduce-scatter, with every algorithm that takes them (low-latency,
/// one-shot), W = 2, 3 and 8, bf16, f32 and u8: the bytes (or the fp32 rank-order bits) of
/// the aligned call, and nothing written around the output view.
fn collectives_take_views_at_element_offsets(ctx: Arc<CudaContext>) {
    fn gather<T: Gatherable>(
        comms: &[Communicator],
        streams: &[Arc<CudaStream>],
        algo: Algorithm,
        g: &mut StdRng,
    ) {
        let w = comms.len();
        for (ioff, ooff) in [(1usize, 3usize), (3, 1)] {
            let len = 1001;
            let ins: Vec<Vec<T>> = (0..w).map(|_| random_elems(g, len)).collect();
            let mut outs = Vec::new();
            for r in 0..w {
                let s = &streams[r];
                let mut host_in = poison::<T>(len + 8);
                host_in[ioff..ioff + len].copy_from_slice(&ins[r]);
                let x = s.clone_htod(&host_in).unwrap();
                let mut y = s.clone_htod(&poison::<T>(w * len + 8)).unwrap();
                comms[r]
                    .all_gather_with(
                        &x.slice(ioff..ioff + len),
                        &mut y.slice_mut(ooff..ooff + w * len),
                        s,
                        algo,
                    )
                    .unwrap();
                outs.push((x, y));
            }
            sync_all(comms, streams).unwrap();
            for r in 0..w {
                let got = streams[r].clone_dtoh(&outs[r].1).unwrap();
                let what = format!("{algo:?} all_gather W={w} +{ioff}/+{ooff} rank {r}");
                same_bytes(&what, &ins.concat(), &got[ooff..ooff + w * len]).unwrap();
                same_bytes(&format!("{what} before"), &poison::<T>(ooff), &got[..ooff]).unwrap();
                same_bytes(
                    &format!("{what} after"),
                    &poison::<T>(8 - ooff),
                    &got[ooff + w * len..],
                )
                .unwrap();
            }
            // all_gather_v (one-shot kernel) with uneven counts at the same offsets.
            let counts: Vec<usize> = (0..w).map(|q| 100 + 37 * q).collect();
            let total: usize = counts.iter().sum();
            let vins: Vec<Vec<T>> = counts.iter().map(|&c| random_elems(g, c)).collect();
            let mut vouts = Vec::new();
            for r in 0..w {
                let s = &streams[r];
                let mut host_in = poison::<T>(counts[r] + 8);
                host_in[ioff..ioff + counts[r]].copy_from_slice(&vins[r]);
                let x = s.clone_htod(&host_in).unwrap();
                let mut y = s.clone_htod(&poison::<T>(total + 8)).unwrap();
                comms[r]
                    .all_gather_v(
                        &x.slice(ioff..ioff + counts[r]),
                        &counts,
                        &mut y.slice_mut(ooff..ooff + total),
                        s,
                    )
                    .unwrap();
                vouts.push((x, y));
            }
            sync_all(comms, streams).unwrap();
            for r in 0..w {
                let got = streams[r].clone_dtoh(&vouts[r].1).unwrap();
                same_bytes(
                    &format!("all_gather_v W={w} +{ioff}/+{ooff} rank {r}"),
                    &vins.concat(),
                    &got[ooff..ooff + total],
                )
                .unwrap();
            }
        }
    }
    fn scatter<T: TestElem>(
        comms: &[Communicator],
        streams: &[Arc<CudaStream>],
        algo: Algorithm,
        g: &mut StdRng,
    ) {
        let w = comms.len();
        for (ioff, ooff) in [(1usize, 3usize), (3, 1)] {
            let len = 777;
            let ins: Vec<Vec<T>> = (0..w).map(|_| random_input(g, w * len)).collect();
            let mut outs = Vec::new();
            for r in 0..w {
                let s = &streams[r];
                let mut host_in = vec![T::from_f32(0.25); w * len + 8];
                host_in[ioff..ioff + w * len].copy_from_slice(&ins[r]);
                let x = s.clone_htod(&host_in).unwrap();
                let mut y = s.clone_htod(&vec![T::from_f32(-3.0); len + 8]).unwrap();
                comms[r]
                    .reduce_scatter_with(
                        &x.slice(ioff..ioff + w * len),
                        &mut y.slice_mut(ooff..ooff + len),
                        s,
                        algo,
                    )
                    .unwrap();
                outs.push((x, y));
            }
            sync_all(comms, streams).unwrap();
            let sum = emulate(&ins);
            for r in 0..w {
                let got = streams[r].clone_dtoh(&outs[r].1).unwrap();
                let what = format!("{algo:?} reduce_scatter W={w} +{ioff}/+{ooff} rank {r}");
                check_bits(&what, &sum[r * len..(r + 1) * len], &got[ooff..ooff + len]).unwrap();
                assert!(
                    got[..ooff]
                        .iter()
                        .chain(&got[ooff + len..])
                        .all(|v| v.to_f32() == -3.0),
                    "{what}: written outside the view"
                );
            }
        }
    }
    let mut g = rng(31);
    for w in [2usize, 3, 8] {
        let (comms, streams) = group(&ctx, w, config(1 << 20));
        for algo in [Algorithm::LowLatency, Algorithm::OneShot] {
            gather::<bf16>(&comms, &streams, algo, &mut g);
            gather::<f32>(&comms, &streams, algo, &mut g);
            gather::<u8>(&comms, &streams, algo, &mut g);
            scatter::<bf16>(&comms, &streams, algo, &mut g);
            scatter::<f32>(&comms, &streams, algo, &mut g);
        }
    }
}

/// `graph_of_collectives_replays_on_new_inputs` with cudarc's event tracking on (its
/// default): every collective takes its buffers through the same bookkeeping as the
/// all-reduce, so the capture stays legal.
fn graph_of_collectives_with_event_tracking_on(ctx: Arc<CudaContext>) {
    assert!(ctx.is_event_tracking());
    graph_of_collectives_replays_on_new_inputs(ctx);
}

/// `collectives_take_views_at_element_offsets` with cudarc's event tracking on.
fn collectives_at_element_offsets_with_event_tracking_on(ctx: Arc<CudaContext>) {
    assert!(ctx.is_event_tracking());
    collectives_take_views_at_element_offsets(ctx);
}

fn main() -> std::process::ExitCode {
    common::harness::run(
        "gpu_collectives",
        vec![
            gpu_test!(proptest_all_gather_every_type_world_and_length),
            gpu_test!(proptest_all_gather_v_uneven_counts),
            gpu_test!(proptest_reduce_scatter_matches_emulation_and_all_reduce_slice),
            gpu_test!(edge_lengths_every_world_from_1_to_8),
            gpu_test!(back_to_back_calls_mixed_with_all_reduce),
            gpu_test!(graph_of_collectives_replays_on_new_inputs),
            gpu_tracked_test!(graph_of_collectives_with_event_tracking_on),
            gpu_test!(collectives_take_views_at_element_offsets),
            gpu_tracked_test!(collectives_at_element_offsets_with_event_tracking_on),
            gpu_test!(bad_collective_inputs_are_typed_errors),
            gpu_test!(all_gather_v_counts_that_disagree_error_on_every_rank),
            gpu_test!(collective_calls_allocate_nothing),
            gpu_test!(low_latency_all_gather_is_bit_exact_for_adversarial_bytes),
            gpu_test!(low_latency_reduce_scatter_matches_emulation_one_shot_and_all_reduce),
            gpu_test!(low_latency_collectives_share_the_region_without_breaking_the_sentinel),
            gpu_test!(low_latency_graph_replays_100_times_on_new_inputs),
            gpu_nccl_test!(all_gather_v_goes_to_nccl_through_the_callers_communicator),
            gpu_nccl_test!(all_gather_v_goes_to_nccl_through_its_own_fallback),
        ],
    )
}
