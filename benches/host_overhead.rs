//! Host-side cost of one eager `all_reduce` call, beside a bare cudarc launch of an empty
//! kernel (the floor any CUDA launch pays).
//!
//! Each sample enqueues a batch of at most 256 calls and times only the enqueueing; the
//! stream is drained outside the timed region, so a full launch queue never turns the
//! measurement into GPU time. Without a GPU it prints why, measures nothing and exits with
//! code 2 (as symm-bench does); when the communicator cannot be created it exits with 1. Run
//! as a test (`cargo test --benches`, no `--bench` flag) it only says why and passes.
//!
//!     cargo bench --bench host_overhead

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::process::ExitCode;
use std::sync::atomic::{AtomicU8, Ordering};

use criterion::{criterion_group, Criterion};
use half::bf16;
use symm_allreduce::cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use symm_allreduce::cudarc::nvrtc::Ptx;
use symm_allreduce::{Algorithm, Communicator, Config, DType};

const EMPTY_PTX: &str = "
.version 8.0
.target sm_80
.address_size 64
.visible .entry empty_kernel(.param .u64 p) { ret; }
";

const BATCH: u64 = 256;

/// The exit code when nothing could be measured: 2 without a GPU, 1 when setup failed.
static NOT_MEASURED: AtomicU8 = AtomicU8::new(0);

/// Context (kept alive), stream, the empty kernel and a one-rank communicator.
type Setup = (Arc<CudaContext>, Arc<CudaStream>, CudaFunction, Vec<Communicator>);

fn setup() -> Option<Setup> {
    let ctx = match symm_allreduce::context(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("host_overhead: no GPU ({e}); nothing measured");
            NOT_MEASURED.store(2, Ordering::Relaxed);
            return None;
        }
    };
    // SAFETY: the benchmark passes raw pointers only; cudarc's per-buffer events would add
    // driver calls that a real hot path (and the bare launch) does not make.
    unsafe { ctx.disable_event_tracking() };
    let stream = failed("cuStreamCreate", ctx.new_stream())?;
    let module = failed("cuModuleLoadData", ctx.load_module(Ptx::from_src(EMPTY_PTX)))?;
    let empty = failed("cuModuleGetFunction", module.load_function("empty_kernel"))?;
    let comms = match Communicator::local_group(std::slice::from_ref(&ctx), Config::default()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("host_overhead: cannot create a communicator ({e}); nothing measured");
            NOT_MEASURED.store(1, Ordering::Relaxed);
            return None;
        }
    };
    Some((ctx, stream, empty, comms))
}

/// `r`'s value, or `None` after saying what failed (exit code 1).
fn failed<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> Option<T> {
    r.map_err(|e| {
        eprintln!("host_overhead: {what} failed ({e}); nothing measured");
        NOT_MEASURED.store(1, Ordering::Relaxed);
    })
    .ok()
}

/// Times `iters` calls of `f`, enqueueing at most BATCH at a time and draining the stream
/// outside the timed region.
fn enqueue_time(stream: &CudaStream, iters: u64, mut f: impl FnMut()) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(BATCH);
        let start = Instant::now();
        for _ in 0..n {
            f();
        }
        total += start.elapsed();
        stream.synchronize().expect("stream sync");
        left -= n;
    }
    total
}

fn host_overhead(c: &mut Criterion) {
    let Some((_ctx, stream, empty, comms)) = setup() else {
        return;
    };
    let comm = &comms[0];
    let len = 4096; // 8 KiB of bf16
    let input = stream.clone_htod(&vec![bf16::from_f32(1.0); len]).unwrap();
    let mut output = stream.alloc_zeros::<bf16>(len).unwrap();
    let arg = 0u64;

    let mut g = c.benchmark_group("host_overhead");
    g.bench_function("bare_cudarc_launch_empty_kernel", |b| {
        b.iter_custom(|iters| {
            enqueue_time(&stream, iters, || {
                let mut launch = stream.launch_builder(&empty);
                launch.arg(&arg);
                // SAFETY: the kernel takes one u64 it never reads.
                unsafe { launch.launch(LaunchConfig::for_num_elems(1)) }.expect("launch");
            })
        })
    });
    g.bench_function("symm_launch_empty_same_grid", |b| {
        b.iter_custom(|iters| {
            enqueue_time(&stream, iters, || {
                comm.launch_empty(len, DType::BF16, &stream, Algorithm::Auto)
                    .expect("launch")
            })
        })
    });
    g.bench_function("symm_all_reduce_8KiB_bf16_eager", |b| {
        b.iter_custom(|iters| {
            enqueue_time(&stream, iters, || {
                comm.all_reduce(&input, &mut output, &stream).expect("all_reduce")
            })
        })
    });
    g.finish();
    comm.synchronize(&stream).expect("no timeout");
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = host_overhead
}
/// `criterion_main!`, with an exit code: a benchmark run (`--bench`, as `cargo bench` passes)
/// that measured nothing fails; a test run (`cargo test --benches`) passes after saying why.
fn main() -> ExitCode {
    benches();
    Criterion::default().configure_from_args().final_summary();
    match NOT_MEASURED.load(Ordering::Relaxed) {
        0 => ExitCode::SUCCESS,
        code if std::env::args().any(|a| a == "--bench") => ExitCode::from(code),
        _ => ExitCode::SUCCESS,
    }
}
