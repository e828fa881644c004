//! The fused all-reduce + residual + RMSNorm call on the GPU with virtual ranks, and the
//! crate's calls under CUDA-graph capture with cudarc's event tracking left on.
//!
//! Every fused result is checked three ways: against an f64 host reference within a
//! dtype-aware bound, bit for bit against the crate's unfused pair (`all_reduce`, then
//! `residual_rmsnorm`, with an independently chosen all-reduce algorithm), and every rank's
//! bits against rank 0's.
//!
//! Run by [`common::harness`] (`harness = false`): without a GPU every test is reported as
//! ignored with the reason.

#![allow(clippy::needless_range_loop)] // ranks index several parallel vectors

mod common;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use common::{check_bits, emulate, group, random_input, rng, TestElem};
use half::{bf16, f16};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};
use rand::Rng;
use symm_allreduce::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use symm_allreduce::cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream};
use symm_allreduce::{Algorithm, Communicator, Config, DType, Error};

const EPS: f32 = 1e-5;
const CAPACITY: usize = 32 << 20;
/// The low-latency slots of these groups (the published 32 KiB would leave the fused
/// low-latency kernel only the smallest shapes): `LowLatency` takes it up to here.
const LOW_LATENCY_MAX: usize = 256 << 10;

fn config() -> Config {
    Config {
        capacity_bytes: CAPACITY,
        low_latency_max_bytes: Some(LOW_LATENCY_MAX),
        ..Config::default()
    }
}

/// One call's data: every rank's partial sums, the (replicated) residual and the weight.
struct Case<T> {
    inputs: Vec<Vec<T>>,
    residual: Vec<T>,
    weight: Vec<T>,
    hidden: usize,
}

fn make_case<T: TestElem>(seed: u64, world: usize, tokens: usize, hidden: usize) -> Case<T> {
    let mut g = rng(seed);
    let inputs = (0..world)
        .map(|_| random_input(&mut g, tokens * hidden))
        .collect();
    let residual = random_input(&mut g, tokens * hidden);
    // Weights around 1 with both signs and some spread, never zero.
    let weight = (0..hidden)
        .map(|_| {
            let m: f32 = g.random_range(0.25f32..1.75);
            T::from_f32(if g.random::<bool>() { m } else { -m })
        })
        .collect();
    Case {
        inputs,
        residual,
        weight,
        hidden,
    }
}

/// Per rank: (residual after the call, norm_out).
type Outs<T> = Vec<(Vec<T>, Vec<T>)>;

fn poison<T: TestElem>(len: usize) -> Vec<T> {
    vec![bytemuck::cast_slice::<u8, T>(&[0xFFu8; 16])[0]; len]
}

struct Device<T> {
    input: Vec<CudaSlice<T>>,
    residual: Vec<CudaSlice<T>>,
    weight: Vec<CudaSlice<T>>,
    out: Vec<CudaSlice<T>>,
    sum: Vec<CudaSlice<T>>,
}

fn upload<T: TestElem>(streams: &[Arc<CudaStream>], case: &Case<T>) -> Device<T> {
    let len = case.residual.len();
    Device {
        input: streams
            .iter()
            .zip(&case.inputs)
            .map(|(s, x)| s.clone_htod(x).unwrap())
            .collect(),
        residual: streams
            .iter()
            .map(|s| s.clone_htod(&case.residual).unwrap())
            .collect(),
        weight: streams
            .iter()
            .map(|s| s.clone_htod(&case.weight).unwrap())
            .collect(),
        out: streams
            .iter()
            .map(|s| s.clone_htod(&poison::<T>(len)).unwrap())
            .collect(),
        sum: streams
            .iter()
            .map(|s| s.clone_htod(&poison::<T>(len)).unwrap())
            .collect(),
    }
}

fn download<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    d: &Device<T>,
) -> Result<Outs<T>, String> {
    let mut outs = Vec::new();
    for r in 0..comms.len() {
        comms[r]
            .synchronize(&streams[r])
            .map_err(|e| format!("rank {r}: {e}"))?;
        outs.push((
            streams[r].clone_dtoh(&d.residual[r]).unwrap(),
            streams[r].clone_dtoh(&d.out[r]).unwrap(),
        ));
    }
    Ok(outs)
}

fn run_fused<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    case: &Case<T>,
    algo: Algorithm,
) -> Result<Outs<T>, String> {
    let mut d = upload(streams, case);
    for r in 0..comms.len() {
        comms[r]
            .all_reduce_add_rmsnorm_with(
                &d.input[r],
                &mut d.residual[r],
                &d.weight[r],
                EPS,
                &mut d.out[r],
                &streams[r],
                algo,
            )
            .map_err(|e| format!("rank {r}: {e}"))?;
    }
    download(comms, streams, &d)
}

fn run_unfused<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    case: &Case<T>,
    algo: Algorithm,
) -> Result<Outs<T>, String> {
    let mut d = upload(streams, case);
    for r in 0..comms.len() {
        comms[r]
            .all_reduce_with(&d.input[r], &mut d.sum[r], &streams[r], algo)
            .map_err(|e| format!("rank {r}: {e}"))?;
        comms[r]
            .residual_rmsnorm(
                &d.sum[r],
                &mut d.residual[r],
                &d.weight[r],
                EPS,
                &mut d.out[r],
                &streams[r],
            )
            .map_err(|e| format!("rank {r}: {e}"))?;
    }
    download(comms, streams, &d)
}

/// The f64 reference with a dtype-aware bound (see the module doc of the crate's fused call
/// for the arithmetic whose error it bounds):
/// - the sum: fp32 accumulation (`W·Σ|x|·2⁻²⁴`) plus one rounding to the dtype;
/// - the residual add: one more rounding of `|residual| + |sum|`;
/// - the norm: the residual's error scaled by `|w|/rms`, the relative error of the rms it
///   causes, and the two roundings of `round(round(r·inv)·w)` plus fp32 slack.
fn check_f64<T: TestElem>(case: &Case<T>, res_out: &[T], norm_out: &[T]) -> Result<(), String> {
    let h = case.hidden;
    let w = case.inputs.len() as f64;
    let u = T::ROUNDING;
    for row in 0..case.residual.len() / h {
        let mut r_exact = vec![0.0f64; h];
        let mut e_r = vec![0.0f64; h];
        for j in 0..h {
            let i = row * h + j;
            let (mut sum, mut abs) = (0.0f64, 0.0f64);
            for x in &case.inputs {
                let v = x[i].to_f32() as f64;
                sum += v;
                abs += v.abs();
            }
            let e_s = w * abs / (1u64 << 24) as f64 + u * sum.abs() * 1.0001 + T::TINY;
            let res = case.residual[i].to_f32() as f64;
            r_exact[j] = res + sum;
            e_r[j] = e_s + u * (res.abs() + sum.abs() + e_s) * 1.0001 + T::TINY;
            let got = res_out[i].to_f32() as f64;
            let within = (got - r_exact[j]).abs() <= e_r[j]; // false for NaN
            if !within {
                return Err(format!(
                    "row {row} col {j}: residual out {got}, f64 reference {}, tolerance {}",
                    r_exact[j], e_r[j]
                ));
            }
        }
        let ms: f64 = r_exact.iter().map(|r| r * r).sum::<f64>() / h as f64;
        let rms = (ms + EPS as f64).sqrt();
        // |Σ r_got² − Σ r²| ≤ Σ (2|r|e + e²), plus fp32 accumulation of h terms.
        let d_ss: f64 = r_exact
            .iter()
            .zip(&e_r)
            .map(|(r, e)| 2.0 * r.abs() * e + e * e)
            .sum::<f64>()
            + h as f64 * ms * h as f64 / (1u64 << 24) as f64;
        let rel_rms = 0.5 * d_ss / (h as f64 * rms * rms) + 8.0 / (1u64 << 24) as f64;
        for j in 0..h {
            let i = row * h + j;
            let wt = case.weight[j].to_f32() as f64;
            let exact = r_exact[j] / rms * wt;
            let tol = (wt.abs() * e_r[j] / rms + exact.abs() * (rel_rms + 2.0 * u)) * 1.01 + 2.0 * T::TINY;
            let got = norm_out[i].to_f32() as f64;
            let within = (got - exact).abs() <= tol; // false for NaN
            if !within {
                return Err(format!(
                    "row {row} col {j}: norm out {got}, f64 reference {exact}, tolerance {tol}"
                ));
            }
        }
    }
    Ok(())
}

/// The kernels' arithmetic as documented (src/communicator/fused.rs), emulated on the host
/// bit for bit: rank-order fp32 sum rounded to T, fp32 residual add rounded to T, per-thread
/// FMA partials of a 512-thread block over packs t, t+512, …, the shuffle-down tree within
/// each warp and over the 16 warp sums, `1 / sqrt(ss / hidden + eps)`, then
/// `round(round(r · inv) · w)`.
fn emulate_fused<T: TestElem>(case: &Case<T>) -> (Vec<T>, Vec<T>) {
    let h = case.hidden;
    let per = T::DTYPE.per_pack();
    let packs = h / per;
    let sums = emulate(&case.inputs);
    let res: Vec<T> = case
        .residual
        .iter()
        .zip(&sums)
        .map(|(r, s)| T::from_f32(r.to_f32() + s.to_f32()))
        .collect();
    let tree = |v: &mut [f32; 32]| {
        for off in [16usize, 8, 4, 2, 1] {
            let old = *v;
            for lane in 0..32 {
                if lane + off < 32 {
                    v[lane] = old[lane] + old[lane + off];
                }
            }
        }
        v[0]
    };
    let mut norm = Vec::with_capacity(res.len());
    for row in res.chunks(h) {
        let mut partial = [0.0f32; 512];
        for (t, acc) in partial.iter_mut().enumerate() {
            for k in (t..packs).step_by(512) {
                for e in 0..per {
                    let v = row[k * per + e].to_f32();
                    *acc = v.mul_add(v, *acc);
                }
            }
        }
        let mut warps = [0.0f32; 32];
        for w in 0..16 {
            let mut v = [0.0f32; 32];
            v.copy_from_slice(&partial[w * 32..w * 32 + 32]);
            warps[w] = tree(&mut v);
        }
        let total = tree(&mut warps);
        let inv = 1.0f32 / (total / h as f32 + EPS).sqrt();
        for (j, r) in row.iter().enumerate() {
            let n = T::from_f32(r.to_f32() * inv).to_f32();
            norm.push(T::from_f32(n * case.weight[j].to_f32()));
        }
    }
    (res, norm)
}

/// All ranks identical; fused == unfused bit for bit; rank 0 against the host emulation of
/// the documented arithmetic (bit for bit) and against f64 (within a bound).
fn verify<T: TestElem>(case: &Case<T>, fused: &Outs<T>, unfused: &Outs<T>, what: &str) -> Result<(), String> {
    for (r, (res, out)) in fused.iter().enumerate() {
        check_bits(&format!("{what}: residual rank {r} vs rank 0"), &fused[0].0, res)?;
        check_bits(&format!("{what}: norm rank {r} vs rank 0"), &fused[0].1, out)?;
        check_bits(
            &format!("{what}: residual fused vs unfused rank {r}"),
            &unfused[r].0,
            res,
        )?;
        check_bits(
            &format!("{what}: norm fused vs unfused rank {r}"),
            &unfused[r].1,
            out,
        )?;
    }
    let (res, norm) = emulate_fused(case);
    check_bits(&format!("{what}: residual vs host emulation"), &res, &fused[0].0)?;
    check_bits(&format!("{what}: norm vs host emulation"), &norm, &fused[0].1)?;
    check_f64(case, &fused[0].0, &fused[0].1).map_err(|e| format!("{what}: {e}"))
}

fn case_round<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    tokens: usize,
    hidden: usize,
    fused_algo: Algorithm,
    unfused_algo: Algorithm,
    seed: u64,
) -> Result<(), String> {
    let what = format!(
        "{} W={} {tokens}x{hidden} fused {fused_algo} / all_reduce {unfused_algo}",
        T::DTYPE,
        comms.len()
    );
    let bytes = tokens * hidden * T::DTYPE.size();
    if fused_algo == Algorithm::LowLatency && bytes > LOW_LATENCY_MAX {
        // Beyond the low-latency slots: refused with a typed error before anything runs.
        return match comms[0].add_rmsnorm_path(tokens, hidden, T::DTYPE, fused_algo) {
            Err(Error::ExceedsCapacity { capacity, .. }) if capacity == LOW_LATENCY_MAX => Ok(()),
            other => Err(format!("{what}: expected ExceedsCapacity, got {other:?}")),
        };
    }
    let case = make_case::<T>(seed, comms.len(), tokens, hidden);
    let f = run_fused(comms, streams, &case, fused_algo).map_err(|e| format!("{what}: {e}"))?;
    let u = run_unfused(comms, streams, &case, unfused_algo).map_err(|e| format!("{what}: {e}"))?;
    verify(&case, &f, &u, &what)
}

#[allow(clippy::too_many_arguments)]
fn dispatch(
    dtype: DType,
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    tokens: usize,
    hidden: usize,
    fused_algo: Algorithm,
    unfused_algo: Algorithm,
    seed: u64,
) -> Result<(), String> {
    match dtype {
        DType::F32 => case_round::<f32>(comms, streams, tokens, hidden, fused_algo, unfused_algo, seed),
        DType::F16 => case_round::<f16>(comms, streams, tokens, hidden, fused_algo, unfused_algo, seed),
        DType::BF16 => case_round::<bf16>(comms, streams, tokens, hidden, fused_algo, unfused_algo, seed),
    }
}

const FUSED_ALGOS: [Algorithm; 4] = [
    Algorithm::OneShot,
    Algorithm::TwoShot,
    Algorithm::Auto,
    Algorithm::LowLatency,
];
const REDUCE_ALGOS: [Algorithm; 3] = [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::Auto];

fn proptest_fused_against_f64_and_the_unfused_pair(ctx: Arc<CudaContext>) {
    let groups: RefCell<HashMap<usize, common::Group>> = RefCell::default();
    let strategy = (
        0usize..3,
        prop::sample::select(vec![2usize, 4, 8]),
        prop::sample::select(vec![8usize, 24, 1024, 1032, 2048, 4096, 5120, 7168, 8192, 16384]),
        prop_oneof![4 => 1usize..=8, 3 => 9usize..=64, 2 => 65usize..=512],
        0usize..FUSED_ALGOS.len(),
        0usize..REDUCE_ALGOS.len(),
        any::<u64>(),
    );
    let mut runner = TestRunner::new(PropConfig {
        cases: 48,
        failure_persistence: None,
        ..PropConfig::default()
    });
    runner
        .run(&strategy, |(d, world, hidden, tokens, fa, ua, seed)| {
            // Keep each case under 1M elements so 48 cases stay quick.
            let tokens = tokens.min((1usize << 20) / hidden).max(1);
            let mut groups = groups.borrow_mut();
            let (comms, streams) = groups
                .entry(world)
                .or_insert_with(|| group(&ctx, world, config()));
            dispatch(
                DType::ALL[d],
                comms,
                streams,
                tokens,
                hidden,
                FUSED_ALGOS[fa],
                REDUCE_ALGOS[ua],
                seed,
            )
            .map_err(TestCaseError::fail)
        })
        .unwrap();
}

/// The sizes of the brief at their edges: Llama 8192 and 16384, DeepSeek 7168, 1 and 512
/// tokens, every dtype, every fused algorithm (low-latency where the shape fits its slots:
/// the 512-token shapes are refused, `case_round` checks the error), W = 8; the largest at
/// the full capacity.
fn edge_shapes_every_dtype_at_world_8(ctx: Arc<CudaContext>) {
    let (comms, streams) = group(&ctx, 8, config());
    let shapes = [
        (1, 8192),
        (1, 16384),
        (1, 7168),
        (3, 1024),
        (512, 16384),
        (512, 7168),
    ];
    let algos = [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::LowLatency];
    every_dtype(&comms, &streams, &shapes, &algos, 1);
}

/// Every dtype × `shapes` (tokens, hidden) × fused `algos` against the f64 reference and the
/// unfused pair (`Auto`), each case with its own seed from `first_seed` on.
fn every_dtype(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    shapes: &[(usize, usize)],
    algos: &[Algorithm],
    first_seed: u64,
) {
    let mut seed = first_seed;
    for dtype in DType::ALL {
        for &(tokens, hidden) in shapes {
            for &algo in algos {
                seed += 1;
                dispatch(dtype, comms, streams, tokens, hidden, algo, Algorithm::Auto, seed).unwrap();
            }
        }
    }
}

/// The fused low-latency kernel where a cluster takes several rows, one after another (forced
/// `LowLatency`, W = 4, one, two and eight blocks a rank): clusters of one (16384-wide rows
/// parked in `norm_out`: a block's share exceeds its shared memory), of up to two, and one
/// cluster of eight. Every dtype, against the f64 reference and the unfused pair's bits.
fn fused_low_latency_rows_share_clusters(ctx: Arc<CudaContext>) {
    for max_blocks_per_rank in [1, 2, 8] {
        let (comms, streams) = group(
            &ctx,
            4,
            Config {
                max_blocks_per_rank,
                ..config()
            },
        );
        let shapes = [
            (1, 16384),
            (5, 16384),
            (9, 4096),
            (3, 1024),
            (2, 4096),
            (3, 4096),
            (24, 2048),
            (13, 7168),
        ];
        every_dtype(&comms, &streams, &shapes, &[Algorithm::LowLatency], 1000);
    }
}

/// Bad shapes and placements are refused with typed errors before anything runs: the
/// residual and the output are untouched.
fn bad_shapes_return_typed_errors_and_touch_nothing(ctx: Arc<CudaContext>) {
    let (comms, streams) = group(&ctx, 2, config());
    let (c, s) = (&comms[0], &streams[0]);
    let input = s.clone_htod(&vec![bf16::from_f32(1.0); 4096]).unwrap();
    let res_host = vec![bf16::from_f32(3.0); 4096];
    let mut residual = s.clone_htod(&res_host).unwrap();
    let mut out = s.clone_htod(&res_host).unwrap();
    let weight = s.clone_htod(&vec![bf16::from_f32(1.0); 1024]).unwrap();
    let odd_weight = s.clone_htod(&vec![bf16::from_f32(1.0); 1020]).unwrap();
    let big_weight = s.clone_htod(&vec![bf16::from_f32(1.0); 32768]).unwrap();
    let short = s.clone_htod(&vec![bf16::from_f32(1.0); 4095]).unwrap();
    let shape_err = |r: symm_allreduce::Result<()>, what: &str| match r {
        Err(Error::InvalidShape { what: w, .. }) if w == what => {}
        other => panic!("expected InvalidShape {{ what: {what} }}, got {other:?}"),
    };
    shape_err(
        c.all_reduce_add_rmsnorm(&input, &mut residual, &odd_weight, EPS, &mut out, s),
        "weight",
    );
    shape_err(
        c.all_reduce_add_rmsnorm(&input, &mut residual, &big_weight, EPS, &mut out, s),
        "weight",
    );
    shape_err(
        c.all_reduce_add_rmsnorm(&short, &mut residual, &weight, EPS, &mut out, s),
        "input",
    );
    shape_err(
        c.all_reduce_add_rmsnorm(&input, &mut residual, &weight, f32::NAN, &mut out, s),
        "eps",
    );
    let mut short_out = s.clone_htod(&vec![bf16::from_f32(0.0); 4095]).unwrap();
    shape_err(
        c.all_reduce_add_rmsnorm(&input, &mut residual, &weight, EPS, &mut short_out, s),
        "norm_out",
    );
    {
        let mut short_res = residual.slice_mut(0..1024);
        shape_err(
            c.all_reduce_add_rmsnorm(&input, &mut short_res, &weight, EPS, &mut out, s),
            "residual",
        );
    }
    shape_err(
        c.residual_rmsnorm(&input, &mut residual, &odd_weight, EPS, &mut out, s),
        "weight",
    );
    // A view that starts 2 bytes in: misaligned.
    {
        let misaligned = input.slice(1..1025);
        let mut res_view = residual.slice_mut(0..1024);
        let mut out_view = out.slice_mut(0..1024);
        let r = c.all_reduce_add_rmsnorm(&misaligned, &mut res_view, &weight, EPS, &mut out_view, s);
        assert!(
            matches!(r, Err(Error::Misaligned { which: "input", .. })),
            "{r:?}"
        );
    }
    // Over the capacity without a fallback.
    let huge = CAPACITY / 2 + 1024;
    let big_in = s.alloc_zeros::<bf16>(huge).unwrap();
    let mut big_res = s.alloc_zeros::<bf16>(huge).unwrap();
    let mut big_out = s.alloc_zeros::<bf16>(huge).unwrap();
    let r = c.all_reduce_add_rmsnorm(&big_in, &mut big_res, &weight, EPS, &mut big_out, s);
    assert!(matches!(r, Err(Error::ExceedsCapacity { .. })), "{r:?}");
    assert!(c
        .add_rmsnorm_path(1, 8192, DType::BF16, Algorithm::Auto)
        .unwrap()
        .to_string()
        .contains("fused"));
    s.synchronize().unwrap();
    assert_eq!(s.clone_dtoh(&residual).unwrap(), res_host);
    assert_eq!(s.clone_dtoh(&out).unwrap(), res_host);
    c.check_usable().unwrap();
}

/// Each rank captures one graph holding fused calls (low-latency, one-shot, two-shot,
/// automatic: 1 × 8192 takes the low-latency kernel (the one-shot without clusters), 32 × 8192
/// the two-shot at W = 8 and the one-shot
/// at W = 2, whose one-shot limit is 2 MiB) and the unfused pair on the same inputs; the
/// graphs are replayed 100 times with new inputs
/// and a new residual copied in before every replay (outside the graph).
fn fused_graph_replays(ctx: Arc<CudaContext>, world: usize) {
    const H: usize = 8192;
    let ops: [(usize, usize, Algorithm); 5] = [
        (1, H, Algorithm::Auto),
        (32, H, Algorithm::Auto),
        (5, 7168, Algorithm::TwoShot),
        (3, 1024, Algorithm::OneShot),
        (7, 4096, Algorithm::LowLatency),
    ];
    let (comms, streams) = group(&ctx, world, config());
    let path = |t, h| {
        comms[0]
            .add_rmsnorm_path(t, h, DType::BF16, Algorithm::Auto)
            .unwrap()
            .to_string()
    };
    // 16 KiB: the low-latency kernel where rows spread over thread-block clusters (sm_90+).
    let small = if ctx.compute_capability().unwrap().0 >= 9 {
        "low-latency"
    } else {
        "one-shot"
    };
    assert!(path(1, H).contains(small), "{}", path(1, H));
    let above = 32 * H * 2 > comms[0].config().one_shot_limit(DType::BF16, world);
    assert_eq!(above, world == 8);
    let expected = if above { "two-shot" } else { "one-shot" };
    assert!(path(32, H).contains(expected), "{}", path(32, H));
    let alloc = |s: &Arc<CudaStream>, n: usize| s.alloc_zeros::<bf16>(n).unwrap();
    struct Op {
        input: Vec<CudaSlice<bf16>>,
        res: Vec<CudaSlice<bf16>>,
        res2: Vec<CudaSlice<bf16>>,
        weight: Vec<CudaSlice<bf16>>,
        out: Vec<CudaSlice<bf16>>,
        out2: Vec<CudaSlice<bf16>>,
        sum: Vec<CudaSlice<bf16>>,
    }
    let mut bufs: Vec<Op> = ops
        .iter()
        .map(|&(t, h, _)| Op {
            input: streams.iter().map(|s| alloc(s, t * h)).collect(),
            res: streams.iter().map(|s| alloc(s, t * h)).collect(),
            res2: streams.iter().map(|s| alloc(s, t * h)).collect(),
            weight: streams.iter().map(|s| alloc(s, h)).collect(),
            out: streams.iter().map(|s| alloc(s, t * h)).collect(),
            out2: streams.iter().map(|s| alloc(s, t * h)).collect(),
            sum: streams.iter().map(|s| alloc(s, t * h)).collect(),
        })
        .collect();
    let mut graphs: Vec<CudaGraph> = Vec::new();
    for r in 0..world {
        let s = &streams[r];
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        for (o, &(_, _, algo)) in bufs.iter_mut().zip(&ops) {
            comms[r]
                .all_reduce_add_rmsnorm_with(
                    &o.input[r],
                    &mut o.res[r],
                    &o.weight[r],
                    EPS,
                    &mut o.out[r],
                    s,
                    algo,
                )
                .unwrap();
            comms[r].all_reduce(&o.input[r], &mut o.sum[r], s).unwrap();
            comms[r]
                .residual_rmsnorm(&o.sum[r], &mut o.res2[r], &o.weight[r], EPS, &mut o.out2[r], s)
                .unwrap();
        }
        graphs.push(
            s.end_capture(CUgraphInstantiate_flags(0))
                .unwrap()
                .expect("captured graph"),
        );
    }
    for replay in 0..100u64 {
        let cases: Vec<Case<bf16>> = ops
            .iter()
            .enumerate()
            .map(|(i, &(t, h, _))| make_case(replay * 31 + i as u64, world, t, h))
            .collect();
        for (o, case) in bufs.iter_mut().zip(&cases) {
            for r in 0..world {
                let s = &streams[r];
                s.memcpy_htod(&case.inputs[r], &mut o.input[r]).unwrap();
                s.memcpy_htod(&case.residual, &mut o.res[r]).unwrap();
                s.memcpy_htod(&case.residual, &mut o.res2[r]).unwrap();
                s.memcpy_htod(&case.weight, &mut o.weight[r]).unwrap();
            }
        }
        for g in &graphs {
            g.launch().unwrap();
        }
        for (i, (o, case)) in bufs.iter().zip(&cases).enumerate() {
            let mut fused = Vec::new();
            let mut unfused = Vec::new();
            for r in 0..world {
                comms[r].synchronize(&streams[r]).unwrap();
                let s = &streams[r];
                fused.push((s.clone_dtoh(&o.res[r]).unwrap(), s.clone_dtoh(&o.out[r]).unwrap()));
                unfused.push((
                    s.clone_dtoh(&o.res2[r]).unwrap(),
                    s.clone_dtoh(&o.out2[r]).unwrap(),
                ));
            }
            let what = format!("W={world} replay {replay} op {i} {:?}", ops[i]);
            verify(case, &fused, &unfused, &what).unwrap();
        }
    }
    ctx.check_err().unwrap();
}

fn fused_graph_replays_100_times_world_8(ctx: Arc<CudaContext>) {
    fused_graph_replays(ctx, 8);
}

fn fused_graph_replays_100_times_world_2_event_tracking_on(ctx: Arc<CudaContext>) {
    assert!(ctx.is_event_tracking());
    fused_graph_replays(ctx, 2);
}

/// cudarc's defaults: event tracking ON. Eager calls first (their inputs uploaded on
/// another stream and not waited for: cudarc's events must order the call after the upload),
/// then each rank captures a graph of all-reduces of every kind (low-latency, one-shot,
/// two-shot, in place, the symmetric copy + zero-copy call) and replays it 100 times with
/// new inputs; every output against the fp32 rank-order emulation, bit for bit.
fn graph_of_all_reduces_with_event_tracking_on(ctx: Arc<CudaContext>) {
    const W: usize = 4;
    assert!(ctx.is_event_tracking(), "the test needs cudarc's default context");
    let (comms, streams) = group(&ctx, W, Config::default());
    let upload_stream = ctx.new_stream().unwrap();
    let mut g = rng(5);

    // Eager, cross-stream: uploaded on `upload_stream`, reduced on the rank's stream.
    for len in [100usize, 40_000, 400_000] {
        let inputs: Vec<Vec<bf16>> = (0..W).map(|_| random_input(&mut g, len)).collect();
        let d_in: Vec<CudaSlice<bf16>> = inputs
            .iter()
            .map(|x| upload_stream.clone_htod(x).unwrap())
            .collect();
        let mut d_out: Vec<CudaSlice<bf16>> =
            (0..W).map(|_| upload_stream.alloc_zeros(len).unwrap()).collect();
        for r in 0..W {
            comms[r].all_reduce(&d_in[r], &mut d_out[r], &streams[r]).unwrap();
        }
        let expected = emulate(&inputs);
        for r in 0..W {
            comms[r].synchronize(&streams[r]).unwrap();
            check_bits(
                &format!("eager len {len} rank {r}"),
                &expected,
                &streams[r].clone_dtoh(&d_out[r]).unwrap(),
            )
            .unwrap();
        }
    }

    let ops: [(usize, Algorithm); 5] = [
        (1000, Algorithm::LowLatency),
        (4099, Algorithm::OneShot),
        (300_000, Algorithm::TwoShot),
        (77, Algorithm::Auto),
        (65_536, Algorithm::Auto),
    ];
    let sym_len = 5000usize;
    let mut d_in: Vec<Vec<CudaSlice<bf16>>> = ops
        .iter()
        .map(|&(n, _)| streams.iter().map(|s| s.alloc_zeros(n).unwrap()).collect())
        .collect();
    let mut d_out: Vec<Vec<CudaSlice<bf16>>> = ops
        .iter()
        .map(|&(n, _)| streams.iter().map(|s| s.alloc_zeros(n).unwrap()).collect())
        .collect();
    let mut in_place: Vec<CudaSlice<bf16>> = streams.iter().map(|s| s.alloc_zeros(3000).unwrap()).collect();
    let mut sym_in: Vec<CudaSlice<bf16>> = streams.iter().map(|s| s.alloc_zeros(sym_len).unwrap()).collect();
    let mut sym_out: Vec<CudaSlice<bf16>> = streams.iter().map(|s| s.alloc_zeros(sym_len).unwrap()).collect();
    let mut graphs = Vec::new();
    for r in 0..W {
        let s = &streams[r];
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        for (i, &(_, algo)) in ops.iter().enumerate() {
            comms[r]
                .all_reduce_with(&d_in[i][r], &mut d_out[i][r], s, algo)
                .unwrap();
        }
        comms[r]
            .all_reduce_in_place(&mut in_place[r], s, Algorithm::Auto)
            .unwrap();
        comms[r].copy_to_symmetric(&sym_in[r], s).unwrap();
        comms[r].all_reduce_symmetric::<bf16>(sym_len, s).unwrap();
        comms[r].copy_from_symmetric(&mut sym_out[r], s).unwrap();
        graphs.push(
            s.end_capture(CUgraphInstantiate_flags(0))
                .unwrap()
                .expect("captured graph"),
        );
    }
    for replay in 0..100 {
        let ins: Vec<Vec<Vec<bf16>>> = ops
            .iter()
            .map(|&(n, _)| (0..W).map(|_| random_input(&mut g, n)).collect())
            .collect();
        let ip: Vec<Vec<bf16>> = (0..W).map(|_| random_input(&mut g, 3000)).collect();
        let sy: Vec<Vec<bf16>> = (0..W).map(|_| random_input(&mut g, sym_len)).collect();
        for r in 0..W {
            // Eager cudarc copies into buffers the graph uses: their events must be valid.
            for (i, x) in ins.iter().enumerate() {
                streams[r].memcpy_htod(&x[r], &mut d_in[i][r]).unwrap();
            }
            streams[r].memcpy_htod(&ip[r], &mut in_place[r]).unwrap();
            streams[r].memcpy_htod(&sy[r], &mut sym_in[r]).unwrap();
        }
        for graph in &graphs {
            graph.launch().unwrap();
        }
        for r in 0..W {
            comms[r].synchronize(&streams[r]).unwrap();
            for (i, x) in ins.iter().enumerate() {
                let got = streams[r].clone_dtoh(&d_out[i][r]).unwrap();
                check_bits(&format!("replay {replay} op {i} rank {r}"), &emulate(x), &got).unwrap();
            }
            let got = streams[r].clone_dtoh(&in_place[r]).unwrap();
            check_bits(&format!("replay {replay} in place rank {r}"), &emulate(&ip), &got).unwrap();
            let got = streams[r].clone_dtoh(&sym_out[r]).unwrap();
            check_bits(
                &format!("replay {replay} symmetric rank {r}"),
                &emulate(&sy),
                &got,
            )
            .unwrap();
        }
    }
    assert!(ctx.is_event_tracking());
    ctx.check_err().unwrap();
}

fn main() -> std::process::ExitCode {
    common::harness::run(
        "gpu_fused",
        vec![
            gpu_test!(proptest_fused_against_f64_and_the_unfused_pair),
            gpu_test!(edge_shapes_every_dtype_at_world_8),
            gpu_test!(fused_low_latency_rows_share_clusters),
            gpu_test!(bad_shapes_return_typed_errors_and_touch_nothing),
            gpu_test!(fused_graph_replays_100_times_world_8),
            gpu_tracked_test!(fused_graph_replays_100_times_world_2_event_tracking_on),
            gpu_tracked_test!(graph_of_all_reduces_with_event_tracking_on),
        ],
    )
}
