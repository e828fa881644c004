//! The adapter on a GPU: W = 2, 4 and 8 virtual ranks on device 0, one candle device (its own
//! stream) and one thread per rank. Every reduction dtype, tensors that start at an offset
//! into their storage, in place, inside a CUDA graph, and the refusals that only a CUDA
//! tensor reaches. Inputs are small integers, so every sum is exact in every dtype and the
//! results are compared bit for bit with sums computed here on the host.
//!
//! Every result is read on the host after `SymmComm::synchronize` (the adapter's rule for
//! several ranks in one process: see the crate docs), which also reports a peer timeout as
//! the error it is instead of an output that was never written.
//!
//! Under libtest-mimic: without a GPU each test is reported as ignored with the reason;
//! under REQUIRE_GPU=1 that is a failure.
//!
//! Diagnostics (environment):
//! - `SYMM_CANDLE_DIAG=1`: every rank prints its candle device, its `CudaContext` (the `Arc`
//!   and the driver context), its stream handle and cudarc's event-tracking state when a
//!   group is made, and how long each readback waited for the stream.
//! - `SYMM_CANDLE_READBACK=unsynced`: read results straight away (`to_vec1` right after the
//!   collective, as this suite did before), to reproduce the failure that readback causes
//!   with virtual ranks; a failing rank then also reports what `synchronize` says afterwards.

use std::process::ExitCode;

use candle_core::{DType, Device, IndexOp, Tensor};
use libtest_mimic::{Arguments, Failed, Trial};
use symm_allreduce::Config;
use symm_allreduce_candle::{AllReduce, SymmComm};

const WORLDS: [usize; 3] = [2, 4, 8];
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Why the GPU tests cannot run here, or `None`.
fn gpu_missing() -> Option<String> {
    match symm_allreduce::device_count() {
        Ok(0) => Some("no CUDA device is visible".into()),
        Ok(_) if symm_allreduce::kernels_available() => None,
        Ok(_) => Some("the kernels were not compiled into this build (no nvcc)".into()),
        Err(e) => Some(e.to_string()),
    }
}

type Res = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// A named GPU test.
type Named = (&'static str, fn() -> Res);

fn env_is(name: &str, value: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == value)
}

/// `SYMM_CANDLE_DIAG=1`: print what each rank runs on, and the readbacks' waits.
fn diag() -> bool {
    env_is("SYMM_CANDLE_DIAG", "1")
}

/// `SYMM_CANDLE_READBACK=unsynced`: read without `synchronize` first (the old readback).
fn unsynced() -> bool {
    env_is("SYMM_CANDLE_READBACK", "unsynced")
}

/// One line on what rank `r` runs on: the candle device, its cudarc context (the `Arc`, the
/// driver context it wraps: every device of one GPU has its own `Arc` of the one primary
/// context), its stream and cudarc's event tracking.
fn describe_rank(r: usize, dev: &Device) -> Result<String, candle_core::Error> {
    let cuda = dev.as_cuda_device()?;
    let stream = cuda.cuda_stream();
    let ctx = stream.context();
    Ok(format!(
        "rank {r}: candle {:?}, GPU {}, CudaContext Arc {:p}, CUcontext {:p}, stream {:p}, \
         event tracking {}, multi-stream {}",
        cuda.id(),
        ctx.ordinal(),
        std::sync::Arc::as_ptr(ctx),
        ctx.cu_ctx(),
        stream.cu_stream(),
        ctx.is_event_tracking(),
        ctx.is_in_multi_stream_mode(),
    ))
}

/// `t` on the host as f32, once this rank's collectives have completed: `synchronize` waits
/// for the stream (a peer timeout is its error), then candle copies the tensor out.
fn read(
    comm: &SymmComm,
    dev: &Device,
    t: &Tensor,
) -> Result<Vec<f32>, Box<dyn std::error::Error + Send + Sync>> {
    let start = std::time::Instant::now();
    if !unsynced() {
        comm.synchronize(dev)?;
    }
    let waited = start.elapsed();
    let host = to_f32(t)?;
    if diag() {
        eprintln!(
            "rank {}: readback waited {:.3} ms for the stream, copied in {:.3} ms{}",
            comm.rank(),
            waited.as_secs_f64() * 1e3,
            (start.elapsed() - waited).as_secs_f64() * 1e3,
            if unsynced() { " (unsynced)" } else { "" }
        );
    }
    Ok(host)
}

/// Runs `body(rank, comm, device)` on `world` rank threads of one local group.
fn on_ranks(world: usize, body: impl Fn(usize, &SymmComm, &Device) -> Res + Sync) -> Res {
    let devices = (0..world)
        .map(|_| Device::new_cuda_with_stream(0))
        .collect::<Result<Vec<_>, _>>()?;
    // Every candle kernel the tests use runs once on every rank's device before any
    // collective: with virtual ranks on one GPU, CUDA's lazy module loading at a kernel's first
    // launch can wait on a peer's collective that waits for this rank (a timeout).
    for dev in &devices {
        warm_up(dev)?;
    }
    let comms = SymmComm::local_group(&devices, Config::default())?;
    if diag() {
        for (r, dev) in devices.iter().enumerate() {
            eprintln!("W={world} {}", describe_rank(r, dev)?);
        }
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .zip(&devices)
            .enumerate()
            .map(|(r, (c, d))| {
                let body = &body;
                s.spawn(move || -> Res {
                    let result = body(r, c, d);
                    match result {
                        // Whatever the body made sure of, every collective it enqueued is
                        // complete and succeeded.
                        Ok(()) => c.synchronize(d).map_err(|e| format!("rank {r}: {e}").into()),
                        Err(e) => {
                            let after = match c.synchronize(d) {
                                Ok(()) => "synchronize afterwards: ok".to_string(),
                                Err(s) => format!("synchronize afterwards: {s}"),
                            };
                            Err(format!("rank {r}: {e} ({after})").into())
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| "a rank thread panicked")?)
            .collect::<Result<Vec<()>, _>>()
    })?;
    Ok(())
}

/// Runs the candle kernels the tests use (fills, casts between every dtype, a strided copy)
/// once on `dev` and waits for them.
fn warm_up(dev: &Device) -> Res {
    symm_allreduce_candle::prepare_shared_gpu(dev)?;
    // Grow the pool once, before any collective.
    drop(Tensor::zeros((64 << 20) / 4, DType::F32, dev)?);
    for dtype in DTYPES {
        let t = Tensor::from_vec(vec![1f32; 48], (6, 8), dev)?.to_dtype(dtype)?;
        let _ = Tensor::zeros((6, 8), dtype, dev)?;
        let _ = Tensor::ones((6, 8), dtype, dev)?;
        let v = t.narrow(0, 2, 3)?.contiguous()?;
        for other in DTYPES {
            let _ = v.to_dtype(other)?.flatten_all()?.to_vec1::<f32>().ok();
        }
        let _ = (&t + &t)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let _ = (&t * 0.5)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    }
    // The byte tensors of the all-gather test: f32 → u8, a u8 view made contiguous, u8 → f32.
    let bytes = (Tensor::from_vec(vec![1f32; 48], (6, 8), dev)? + 5.0)?.to_dtype(DType::U8)?;
    let _ = bytes
        .narrow(0, 2, 3)?
        .contiguous()?
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()?;
    let _ = Tensor::zeros((6, 8), DType::U8, dev)?;
    dev.synchronize()?;
    Ok(())
}

/// Rank `r`'s value at element `i`: a small integer (exact in bf16 after summing 8 ranks).
fn value(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 3) % 11) as f32 - 5.0
}

fn host(r: usize, rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols).map(|i| value(r, i)).collect()
}

fn sum(world: usize, rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| (0..world).map(|r| value(r, i)).sum())
        .collect()
}

/// Rank `r`'s `(rows, cols)` tensor of `dtype`, as rows 2.. of a larger one: it starts
/// `2 · cols` elements into its storage. Returns (the whole tensor, the view).
fn offset_tensor(
    r: usize,
    rows: usize,
    cols: usize,
    dtype: DType,
    dev: &Device,
) -> Result<(Tensor, Tensor), candle_core::Error> {
    let mut data = vec![99f32; 2 * cols];
    data.extend(host(r, rows, cols));
    data.extend(vec![77f32; cols]);
    let whole = Tensor::from_vec(data, (rows + 3, cols), dev)?.to_dtype(dtype)?;
    let view = whole.narrow(0, 2, rows)?;
    assert_eq!(view.layout().start_offset(), 2 * cols);
    Ok((whole, view))
}

fn to_f32(t: &Tensor) -> Result<Vec<f32>, candle_core::Error> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

fn expect_eq(what: &str, got: &[f32], want: &[f32]) -> Res {
    if got.len() != want.len() {
        return Err(format!("{what}: {} elements, expected {}", got.len(), want.len()).into());
    }
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        return Err(format!("{what}: element {i} is {}, expected {}", got[i], want[i]).into());
    }
    Ok(())
}

fn all_reduce_op_every_dtype_from_an_offset() -> Res {
    let (rows, cols) = (5, 1024 + 8);
    for world in WORLDS {
        for dtype in DTYPES {
            on_ranks(world, |r, comm, dev| {
                let (_, x) = offset_tensor(r, rows, cols, dtype, dev)?;
                // The drop-in op, as llama_multiprocess and mistral.rs apply it.
                let y = x.apply_op1_no_bwd(&AllReduce::new(comm))?;
                assert_eq!(y.dims(), x.dims());
                assert_eq!(y.dtype(), dtype);
                expect_eq(
                    &format!("W={world} {dtype:?} AllReduce"),
                    &read(comm, dev, &y)?,
                    &sum(world, rows, cols),
                )?;
                // The input is left as it was.
                expect_eq("the input", &to_f32(&x)?, &host(r, rows, cols))?;
                Ok(())
            })?;
        }
    }
    Ok(())
}

fn in_place_sums_only_the_view() -> Res {
    let (rows, cols) = (3, 4096);
    for world in WORLDS {
        for dtype in DTYPES {
            on_ranks(world, |r, comm, dev| {
                let (whole, x) = offset_tensor(r, rows, cols, dtype, dev)?;
                comm.all_reduce_(&x)?;
                expect_eq(
                    &format!("W={world} {dtype:?} in place"),
                    &read(comm, dev, &x)?,
                    &sum(world, rows, cols),
                )?;
                // The rows around the view are untouched.
                expect_eq(
                    "rows before",
                    &to_f32(&whole.narrow(0, 0, 2)?)?,
                    &vec![99.0; 2 * cols],
                )?;
                expect_eq("row after", &to_f32(&whole.i(rows + 2)?)?, &vec![77.0; cols])?;
                Ok(())
            })?;
        }
    }
    Ok(())
}

fn all_gather_stacks_ranks_along_dim_0() -> Res {
    let (rows, cols) = (2, 512);
    for world in WORLDS {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::U8] {
            on_ranks(world, |r, comm, dev| {
                let x = if dtype == DType::U8 {
                    // Bytes 0..=10, still starting 2 rows into the storage.
                    let (whole, _) = offset_tensor(r, rows, cols, DType::F32, dev)?;
                    (whole + 5.0)?.to_dtype(DType::U8)?.narrow(0, 2, rows)?
                } else {
                    offset_tensor(r, rows, cols, dtype, dev)?.1
                };
                assert_eq!(x.layout().start_offset(), 2 * cols);
                let y = comm.all_gather(&x)?;
                assert_eq!(y.dims(), &[world * rows, cols]);
                let want: Vec<f32> = (0..world)
                    .flat_map(|q| host(q, rows, cols))
                    .map(|v| if dtype == DType::U8 { v + 5.0 } else { v })
                    .collect();
                expect_eq(
                    &format!("W={world} {dtype:?} all_gather"),
                    &read(comm, dev, &y)?,
                    &want,
                )
            })?;
        }
    }
    Ok(())
}

fn reduce_scatter_keeps_this_ranks_rows_of_the_sum() -> Res {
    let cols = 256;
    for world in WORLDS {
        let rows = 2 * world;
        for dtype in DTYPES {
            on_ranks(world, |r, comm, dev| {
                let (_, x) = offset_tensor(r, rows, cols, dtype, dev)?;
                let y = comm.reduce_scatter(&x)?;
                assert_eq!(y.dims(), &[2, cols]);
                let full = sum(world, rows, cols);
                expect_eq(
                    &format!("W={world} {dtype:?} reduce_scatter"),
                    &read(comm, dev, &y)?,
                    &full[r * 2 * cols..(r + 1) * 2 * cols],
                )
            })?;
        }
    }
    Ok(())
}

fn fused_norm_matches_the_host_and_updates_the_residual() -> Res {
    let (tokens, hidden) = (4, 2048);
    for world in WORLDS {
        for dtype in DTYPES {
            on_ranks(world, |r, comm, dev| {
                let (_, partial) = offset_tensor(r, tokens, hidden, dtype, dev)?;
                let residual = Tensor::ones((tokens, hidden), dtype, dev)?;
                let weight = (Tensor::ones(hidden, dtype, dev)? * 0.5)?;
                let normed = comm.all_reduce_add_rmsnorm(&partial, &residual, &weight, 1e-5)?;
                // residual ← 1 + Σ partial, exactly (small integers).
                let res_want: Vec<f32> = sum(world, tokens, hidden).iter().map(|s| s + 1.0).collect();
                expect_eq(
                    &format!("W={world} {dtype:?} residual"),
                    &read(comm, dev, &residual)?,
                    &res_want,
                )?;
                // normed = 0.5 · residual / rms(residual row), against f64 on the host.
                let got = to_f32(&normed)?;
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                for t in 0..tokens {
                    let row = &res_want[t * hidden..(t + 1) * hidden];
                    let rms =
                        (row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / hidden as f64 + 1e-5).sqrt();
                    for (i, &v) in row.iter().enumerate() {
                        let want = 0.5 * v as f64 / rms;
                        let g = got[t * hidden + i] as f64;
                        if (g - want).abs() > tol * want.abs().max(1.0) {
                            return Err(format!(
                                "W={world} {dtype:?} rank {r}: normed[{t}][{i}] = {g}, expected {want}"
                            )
                            .into());
                        }
                    }
                }
                Ok(())
            })?;
        }
    }
    Ok(())
}

fn ranks_get_identical_bits_from_the_fused_call() -> Res {
    // Random-looking fractions (not exact): every rank must still hold the same bits.
    let (tokens, hidden) = (3, 4096);
    let outputs = std::sync::Mutex::new(Vec::new());
    on_ranks(4, |r, comm, dev| {
        let partial = (Tensor::arange(0f32, (tokens * hidden) as f32, dev)?.reshape((tokens, hidden))?
            * (0.013 + r as f64 * 0.007))?
            .sin()?
            .to_dtype(DType::BF16)?;
        let residual = Tensor::ones((tokens, hidden), DType::BF16, dev)?;
        let weight = Tensor::ones(hidden, DType::BF16, dev)?;
        let normed = comm.all_reduce_add_rmsnorm(&partial, &residual, &weight, 1e-6)?;
        let bits: Vec<u32> = read(comm, dev, &normed)?.iter().map(|v| v.to_bits()).collect();
        outputs.lock().unwrap().push(bits);
        Ok(())
    })?;
    let outputs = outputs.into_inner().unwrap();
    if outputs.windows(2).any(|w| w[0] != w[1]) {
        return Err("ranks hold different bits".into());
    }
    Ok(())
}

fn in_place_all_reduce_replays_from_a_cuda_graph() -> Res {
    use symm_allreduce::cudarc::driver::sys;
    let (rows, cols) = (2, 1024);
    for world in WORLDS {
        on_ranks(world, |r, comm, dev| {
            let (_, x) = offset_tensor(r, rows, cols, DType::F32, dev)?;
            let stream = dev.as_cuda_device()?.cuda_stream();
            comm.all_reduce_(&x)?; // eager: x = S
            comm.synchronize(dev)?;
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let captured = comm.all_reduce_(&x);
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            captured?;
            let graph = graph?.ok_or("empty capture")?;
            // Every rank holds S, so each replay multiplies by W: after 3, W³ · S.
            for _ in 0..3 {
                graph.launch()?;
            }
            let w3 = (world * world * world) as f32;
            let want: Vec<f32> = sum(world, rows, cols).iter().map(|s| s * w3).collect();
            expect_eq(&format!("W={world} graph replays"), &read(comm, dev, &x)?, &want)
        })?;
    }
    Ok(())
}

fn cuda_tensors_the_ops_refuse() -> Res {
    on_ranks(2, |_, comm, dev| {
        let x = Tensor::ones((64, 32), DType::F32, dev)?;
        let e = comm.all_reduce(&x.t()?).unwrap_err().to_string();
        if !e.contains("not contiguous") {
            return Err(format!("transpose: {e}").into());
        }
        let e = comm.all_reduce(&x.to_dtype(DType::F64)?).unwrap_err().to_string();
        if !e.contains("F64") || !e.contains("f32, f16, bf16") {
            return Err(format!("f64: {e}").into());
        }
        let e = comm
            .reduce_scatter(&Tensor::ones((3, 8), DType::F32, dev)?)
            .unwrap_err()
            .to_string();
        if !e.contains("multiple of the world size (2)") {
            return Err(format!("reduce_scatter rows: {e}").into());
        }
        let w = Tensor::ones(32, DType::BF16, dev)?;
        let e = comm
            .all_reduce_add_rmsnorm(&x, &x.clone(), &w, 1e-5)
            .unwrap_err()
            .to_string();
        if !e.contains("dtype BF16") {
            return Err(format!("fused dtypes: {e}").into());
        }
        // Every rank refused alike, and the group still works.
        let y = comm.all_reduce(&x)?;
        expect_eq("after refusals", &read(comm, dev, &y)?, &vec![2.0; 64 * 32])
    })
}

fn local_group_refuses_ranks_without_a_stream_each() -> Res {
    // One device given to two ranks: one stream, on which the second rank's collective would
    // queue behind the first's, which waits for it.
    let dev = Device::new_cuda_with_stream(0)?;
    let e = SymmComm::local_group(&[dev.clone(), dev], Config::default())
        .unwrap_err()
        .to_string();
    if !e.contains("share one stream") || !e.contains("Device::new_cuda_with_stream(0)") {
        return Err(format!("one device twice: {e}").into());
    }
    // Device::new_cuda: the per-thread default stream, another stream on every thread.
    let implicit = [Device::new_cuda(0)?, Device::new_cuda(0)?];
    let e = SymmComm::local_group(&implicit, Config::default())
        .unwrap_err()
        .to_string();
    if !e.contains("implicit stream") {
        return Err(format!("Device::new_cuda: {e}").into());
    }
    Ok(())
}

fn main() -> ExitCode {
    // The ranks share one GPU: more hardware queues than the driver's default 8, so that no
    // rank's stream shares one with a peer's (where its kernel could wait behind the peer's
    // waiting collective; docs/bench/README.md, "Virtual ranks"). Before CUDA starts; an
    // explicit setting is kept.
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        // Nothing else runs yet: no thread reads the environment concurrently.
        std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    }
    let args = Arguments::from_args();
    let missing = gpu_missing();
    let required = std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1");
    let tests: [Named; 9] = [
        (
            "all_reduce_op_every_dtype_from_an_offset",
            all_reduce_op_every_dtype_from_an_offset,
        ),
        ("in_place_sums_only_the_view", in_place_sums_only_the_view),
        (
            "all_gather_stacks_ranks_along_dim_0",
            all_gather_stacks_ranks_along_dim_0,
        ),
        (
            "reduce_scatter_keeps_this_ranks_rows_of_the_sum",
            reduce_scatter_keeps_this_ranks_rows_of_the_sum,
        ),
        (
            "fused_norm_matches_the_host_and_updates_the_residual",
            fused_norm_matches_the_host_and_updates_the_residual,
        ),
        (
            "ranks_get_identical_bits_from_the_fused_call",
            ranks_get_identical_bits_from_the_fused_call,
        ),
        (
            "in_place_all_reduce_replays_from_a_cuda_graph",
            in_place_all_reduce_replays_from_a_cuda_graph,
        ),
        ("cuda_tensors_the_ops_refuse", cuda_tensors_the_ops_refuse),
        (
            "local_group_refuses_ranks_without_a_stream_each",
            local_group_refuses_ranks_without_a_stream_each,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, f)| {
            let why = missing.clone();
            let trial = Trial::test(name, move || match (&why, required) {
                (None, _) => f().map_err(|e| Failed::from(e.to_string())),
                (Some(why), true) => Err(Failed::from(format!("REQUIRE_GPU=1 but {why}"))),
                (Some(_), false) => Ok(()),
            });
            match (&missing, required) {
                (Some(why), false) => {
                    println!("SKIP {name}: {why}");
                    trial.with_ignored_flag(true)
                }
                _ => trial,
            }
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}
