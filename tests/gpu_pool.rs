//! The symmetric pool and views at any element offset, on the GPU with virtual ranks
//! W ∈ {2, 3, 4, 8}: pool buffers written by a cudarc kernel (or copy) and reduced zero-copy
//! eagerly and inside CUDA graphs replayed 100 times on new inputs; a cuBLAS GEMM writing its
//! output into a pool buffer that is then all-reduced (checked bit for bit against the fp32
//! rank-order emulation of the GEMM outputs and against an f64 host reference of the summed
//! products); views at element offsets 1, 3 and 8 for every dtype and algorithm; and bad input
//! (pool exhausted, a pool buffer of another communicator, diverged allocation sequences).
//!
//! Run by [`common::harness`] (`harness = false`).

mod common;

use std::marker::PhantomData;
use std::sync::Arc;

use common::{check_against_f64, check_bits, emulate, group, random_input, rng, TestElem};
use half::{bf16, f16};
use symm_allreduce::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use symm_allreduce::cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, LaunchConfig,
    PushKernelArg, SyncOnDrop, ValidAsZeroBits,
};
use symm_allreduce::{Algorithm, Communicator, Config, DType, Element, Error, SymmetricTensor};

const WORLDS: [usize; 4] = [2, 3, 4, 8];

/// `Config::default()`'s low-latency limit: pool calls up to it take the low-latency kernel.
/// What `Auto` runs for a pool call of `len` elements on `comm`'s group (docs/pool.md): the
/// low-latency kernel up to its threshold, the copy-in one-shot up to the one-shot crossover
/// within the capacity, the zero-copy kernels above (none of these groups has a tuning table or
/// an NCCL fallback).
fn pool_algorithm(comm: &Communicator, len: usize, dtype: DType) -> Option<Algorithm> {
    let (c, w, bytes) = (comm.config(), comm.world_size(), len * dtype.size());
    if bytes <= c.low_latency_limit(w) {
        Some(Algorithm::LowLatency)
    } else if w > 1 && bytes <= c.one_shot_limit(dtype, w).min(c.capacity_bytes) {
        Some(Algorithm::OneShot)
    } else {
        None
    }
}

/// Checks `comm.pool_path` against [`pool_algorithm`]: `zero_copy` starts the zero-copy
/// sentence.
fn check_pool_path(comm: &Communicator, len: usize, dtype: DType, out_of_place: bool, zero_copy: &str) {
    let p = comm.pool_path(len, dtype, out_of_place).unwrap();
    match pool_algorithm(comm, len, dtype) {
        Some(algorithm) => assert_eq!(p.algorithm, algorithm, "{p}"),
        None => assert!(p.reason.starts_with(zero_copy), "{p}"),
    }
}

fn config(capacity_bytes: usize, pool_bytes: usize) -> Config {
    Config {
        capacity_bytes,
        pool_bytes,
        ..Config::default()
    }
}

trait Elem: TestElem + DeviceRepr + ValidAsZeroBits + Default {}
impl<T: TestElem + DeviceRepr + ValidAsZeroBits + Default> Elem for T {}

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

fn sync_all(comms: &[Communicator], streams: &[Arc<CudaStream>]) -> Result<(), String> {
    for (r, (c, s)) in comms.iter().zip(streams).enumerate() {
        c.synchronize(s).map_err(|e| format!("rank {r}: {e}"))?;
    }
    Ok(())
}

/// A view of device memory by address (a sub-range of a pool buffer or of a cudarc slice).
struct Raw<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _t: PhantomData<T>,
}

impl<T> Raw<T> {
    fn of(base: u64, offset: usize, len: usize, stream: &Arc<CudaStream>) -> Raw<T> {
        Raw {
            ptr: base + (offset * std::mem::size_of::<T>()) as u64,
            len,
            stream: stream.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> DeviceSlice<T> for Raw<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}
impl<T> DevicePtr<T> for Raw<T> {
    fn device_ptr<'a>(&'a self, _s: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}
impl<T> DevicePtrMut<T> for Raw<T> {
    fn device_ptr_mut<'a>(&'a mut self, _s: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

/// Uploads `inputs` into fresh pool buffers, reduces them zero-copy, downloads them.
fn pool_round<T: Elem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    inputs: &[Vec<T>],
) -> Result<Vec<Vec<T>>, String> {
    let len = inputs[0].len();
    let mut bufs: Vec<SymmetricTensor<T>> = comms
        .iter()
        .zip(streams)
        .map(|(c, s)| c.alloc_symmetric::<T>(len, s).unwrap())
        .collect();
    for r in 0..comms.len() {
        streams[r].memcpy_htod(&inputs[r], &mut bufs[r]).unwrap();
    }
    for r in 0..comms.len() {
        comms[r]
            .all_reduce_pool(&mut bufs[r], &streams[r])
            .map_err(|e| format!("rank {r}: {e}"))?;
    }
    sync_all(comms, streams)?;
    Ok(bufs
        .iter()
        .zip(streams)
        .map(|(b, s)| {
            let mut host = vec![T::default(); len];
            s.memcpy_dtoh(b, &mut host).unwrap();
            host
        })
        .collect())
}

/// Zero-copy all-reduce of pool buffers, every dtype and world, sizes far above the
/// configured capacity (64 KiB): a copy-in path would refuse them (no NCCL here), so every
/// success is the zero-copy path; `pool_path` says so. Buffers are allocated and dropped
/// call after call, so regions are reused at shifting offsets.
fn pool_zero_copy_every_dtype_and_world_back_to_back(ctx: Arc<CudaContext>) {
    fn run<T: Elem>(comms: &[Communicator], streams: &[Arc<CudaStream>], seed: u64) {
        let w = comms.len();
        let mut g = rng(seed);
        let mut keep = Vec::new();
        for (i, &len) in [1usize, 7, 8, 9, 1000, 65_537, 1_000_003, 3].iter().enumerate() {
            check_pool_path(&comms[0], len, T::DTYPE, false, "zero-copy (pool)");
            let inputs: Vec<Vec<T>> = (0..w).map(|_| random_input(&mut g, len)).collect();
            let outs = pool_round(comms, streams, &inputs).unwrap();
            verify(&inputs, &outs, &format!("pool {} W={w} len={len}", T::DTYPE)).unwrap();
            // Keep every other buffer alive: later buffers land at other offsets.
            if i % 2 == 0 {
                keep.push(
                    comms
                        .iter()
                        .zip(streams)
                        .map(|(c, s)| c.alloc_symmetric::<T>(len % 700 + 1, s).unwrap())
                        .collect::<Vec<_>>(),
                );
            }
        }
    }
    for w in WORLDS {
        let (comms, streams) = group(&ctx, w, config(64 << 10, 32 << 20));
        run::<f32>(&comms, &streams, w as u64);
        run::<f16>(&comms, &streams, 10 + w as u64);
        run::<bf16>(&comms, &streams, 20 + w as u64);
        assert_eq!(
            comms[0].pool_free().0,
            32 << 20,
            "every buffer went back to the pool"
        );
    }
}

/// Out of place from a pool buffer (`all_reduce_from_pool`): the low-latency kernel in its
/// range, the copy-in one-shot in the one-shot range, the zero-copy two-shot above it, every dtype and world, outputs at element offsets 0 and 3, the input
/// left as it was. Then 20 calls back to back per rank without a host sync, each rewriting the
/// pool input (a device copy on the rank's stream) right after the previous call: the input
/// may be overwritten as soon as the call is complete on the stream.
fn pool_input_out_of_place_zero_copy_every_dtype_and_world(ctx: Arc<CudaContext>) {
    fn run<T: Elem>(comms: &[Communicator], streams: &[Arc<CudaStream>], seed: u64) {
        let w = comms.len();
        let mut g = rng(seed);
        for &len in &[1usize, 7, 9, 1000, 65_537, 1_000_003] {
            check_pool_path(&comms[0], len, T::DTYPE, true, "zero-copy (pool): two-shot");
            let inputs: Vec<Vec<T>> = (0..w).map(|_| random_input(&mut g, len)).collect();
            let mut bufs: Vec<SymmetricTensor<T>> = (0..w)
                .map(|r| comms[r].alloc_symmetric::<T>(len, &streams[r]).unwrap())
                .collect();
            for off in [0usize, 3] {
                let mut outs: Vec<CudaSlice<T>> = (0..w)
                    .map(|r| streams[r].alloc_zeros::<T>(len + 3).unwrap())
                    .collect();
                for r in 0..w {
                    streams[r].memcpy_htod(&inputs[r], &mut bufs[r]).unwrap();
                }
                for r in 0..w {
                    let mut out = outs[r].slice_mut(off..off + len);
                    comms[r]
                        .all_reduce_from_pool(&bufs[r], &mut out, &streams[r])
                        .unwrap();
                }
                sync_all(comms, streams).unwrap();
                let got: Vec<Vec<T>> = (0..w)
                    .map(|r| streams[r].clone_dtoh(&outs[r]).unwrap()[off..off + len].to_vec())
                    .collect();
                verify(
                    &inputs,
                    &got,
                    &format!("pool input {} W={w} len={len} out+{off}", T::DTYPE),
                )
                .unwrap();
                for r in 0..w {
                    let mut h = vec![T::default(); len];
                    streams[r].memcpy_dtoh(&bufs[r], &mut h).unwrap();
                    check_bits(
                        &format!("pool input W={w} len={len} rank {r} unchanged"),
                        &inputs[r],
                        &h,
                    )
                    .unwrap();
                }
            }
        }
        // Back to back, the input rewritten right after each call.
        let (len, calls) = (200_003usize, 20usize);
        let all: Vec<Vec<Vec<T>>> = (0..calls)
            .map(|_| (0..w).map(|_| random_input(&mut g, len)).collect())
            .collect();
        let staging: Vec<Vec<CudaSlice<T>>> = (0..calls)
            .map(|c| {
                (0..w)
                    .map(|r| streams[r].clone_htod(&all[c][r]).unwrap())
                    .collect()
            })
            .collect();
        let mut bufs: Vec<SymmetricTensor<T>> = (0..w)
            .map(|r| comms[r].alloc_symmetric::<T>(len, &streams[r]).unwrap())
            .collect();
        let mut outs: Vec<Vec<CudaSlice<T>>> = (0..calls)
            .map(|_| {
                (0..w)
                    .map(|r| streams[r].alloc_zeros::<T>(len).unwrap())
                    .collect()
            })
            .collect();
        for s in streams {
            s.synchronize().unwrap();
        }
        for c in 0..calls {
            for r in 0..w {
                streams[r].memcpy_dtod(&staging[c][r], &mut bufs[r]).unwrap();
                comms[r]
                    .all_reduce_from_pool(&bufs[r], &mut outs[c][r], &streams[r])
                    .unwrap();
            }
        }
        sync_all(comms, streams).unwrap();
        for c in 0..calls {
            let got: Vec<Vec<T>> = (0..w)
                .map(|r| streams[r].clone_dtoh(&outs[c][r]).unwrap())
                .collect();
            verify(&all[c], &got, &format!("pool input back to back W={w} call {c}")).unwrap();
        }
    }
    for w in WORLDS {
        let (comms, streams) = group(&ctx, w, config(4 << 20, 16 << 20));
        run::<f32>(&comms, &streams, 500 + w as u64);
        run::<f16>(&comms, &streams, 600 + w as u64);
        run::<bf16>(&comms, &streams, 700 + w as u64);
    }
}

/// A producer kernel (compiled with NVRTC through cudarc when NVRTC loads; otherwise a cudarc
/// device-to-device copy) writes `2·x` into each rank's pool buffer, the pool buffer is
/// reduced zero-copy and copied out, all inside one CUDA graph per rank, replayed 100 times
/// on new inputs for every W.
fn pool_buffers_written_by_a_kernel_reduce_zero_copy_in_graphs_replayed_100_times(ctx: Arc<CudaContext>) {
    const SRC: &str = r#"
extern "C" __global__ void twice(const float* x, unsigned long long y_addr, unsigned long long n) {
    float* y = reinterpret_cast<float*>(y_addr);
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = 2.0f * x[i];
}"#;
    let producer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let ptx = symm_allreduce::cudarc::nvrtc::compile_ptx(SRC).map_err(|e| format!("{e:?}"))?;
        let module = ctx.load_module(ptx).map_err(|e| e.to_string())?;
        module.load_function("twice").map_err(|e| e.to_string())
    }));
    let producer = match producer {
        Ok(Ok(f)) => Some(f),
        Ok(Err(e)) => {
            eprintln!("note: NVRTC kernel unavailable ({e}); the producer is a cudarc copy");
            None
        }
        Err(_) => {
            eprintln!("note: NVRTC library not found; the producer is a cudarc copy");
            None
        }
    };
    eprintln!(
        "producer: {}",
        if producer.is_some() {
            "NVRTC kernel"
        } else {
            "memcpy_dtod"
        }
    );
    let len = 300_007usize;
    for w in WORLDS {
        let (comms, streams) = group(&ctx, w, config(64 << 10, 8 << 20));
        let mut staging: Vec<CudaSlice<f32>> = streams.iter().map(|s| s.alloc_zeros(len).unwrap()).collect();
        let mut outs: Vec<CudaSlice<f32>> = streams.iter().map(|s| s.alloc_zeros(len).unwrap()).collect();
        let mut bufs: Vec<SymmetricTensor<f32>> = comms
            .iter()
            .zip(&streams)
            .map(|(c, s)| c.alloc_symmetric::<f32>(len, s).unwrap())
            .collect();
        let graphs: Vec<_> = (0..w)
            .map(|r| {
                let s = &streams[r];
                s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                    .unwrap();
                match &producer {
                    Some(f) => {
                        let addr = bufs[r].device_address();
                        let n = len as u64;
                        let mut b = s.launch_builder(f);
                        b.arg(&staging[r]).arg(&addr).arg(&n);
                        // SAFETY: `twice` takes (const float*, u64 address, u64 n); staging and
                        // the pool buffer hold `len` f32 each.
                        unsafe { b.launch(LaunchConfig::for_num_elems(len as u32)) }.unwrap();
                    }
                    None => s.memcpy_dtod(&staging[r], &mut bufs[r]).unwrap(),
                }
                comms[r].all_reduce_pool(&mut bufs[r], s).unwrap();
                s.memcpy_dtod(&bufs[r], &mut outs[r]).unwrap();
                s.end_capture(CUgraphInstantiate_flags(0))
                    .unwrap()
                    .expect("graph")
            })
            .collect();
        let mut g = rng(1000 + w as u64);
        let scale = if producer.is_some() { 2.0f32 } else { 1.0 };
        for replay in 0..100 {
            let raw: Vec<Vec<f32>> = (0..w).map(|_| random_input(&mut g, len)).collect();
            for r in 0..w {
                streams[r].memcpy_htod(&raw[r], &mut staging[r]).unwrap();
                streams[r].synchronize().unwrap();
            }
            for graph in &graphs {
                graph.launch().unwrap();
            }
            sync_all(&comms, &streams).unwrap();
            // Every 10th replay is checked in full (each check is a host pass over W inputs).
            if replay % 10 == 9 || replay == 0 {
                let inputs: Vec<Vec<f32>> = raw
                    .iter()
                    .map(|x| x.iter().map(|v| v * scale).collect())
                    .collect();
                let got: Vec<Vec<f32>> = outs
                    .iter()
                    .zip(&streams)
                    .map(|(o, s)| s.clone_dtoh(o).unwrap())
                    .collect();
                verify(&inputs, &got, &format!("graph W={w} replay {replay}")).unwrap();
            }
        }
    }
}

/// cuBLAS (cudarc's `cublas`) writes `C_r = A_r · B_r` straight into each rank's pool buffer;
/// the pool buffers are all-reduced zero-copy. The sum is bit-identical to the fp32 rank-order
/// emulation of the downloaded GEMM outputs and within an f64-derived bound of Σ_r A_r·B_r
/// computed on the host in f64.
fn cublas_gemm_writes_into_a_pool_buffer_then_all_reduce(ctx: Arc<CudaContext>) {
    use symm_allreduce::cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
    let (m, n, k) = (96usize, 130usize, 257usize);
    for w in WORLDS {
        let (comms, streams) = group(&ctx, w, config(64 << 10, 8 << 20));
        let blas = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            streams
                .iter()
                .map(|s| CudaBlas::new(s.clone()).map_err(|e| format!("{e:?}")))
                .collect::<Result<Vec<_>, _>>()
        }));
        let blas = match blas {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => panic!("cuBLAS handle: {e}"),
            Err(_) => {
                assert!(
                    !common::harness::gpu_required(),
                    "REQUIRE_GPU=1 but libcublas was not found (set LD_LIBRARY_PATH to its folder)"
                );
                common::skip(
                    "cublas_gemm_writes_into_a_pool_buffer_then_all_reduce",
                    "libcublas not found",
                );
                return;
            }
        };
        let mut g = rng(77 + w as u64);
        let a: Vec<Vec<f32>> = (0..w).map(|_| random_input(&mut g, m * k)).collect();
        let b: Vec<Vec<f32>> = (0..w).map(|_| random_input(&mut g, k * n)).collect();
        let mut c: Vec<SymmetricTensor<f32>> = comms
            .iter()
            .zip(&streams)
            .map(|(cm, s)| cm.alloc_symmetric::<f32>(m * n, s).unwrap())
            .collect();
        for r in 0..w {
            let da = streams[r].clone_htod(&a[r]).unwrap();
            let db = streams[r].clone_htod(&b[r]).unwrap();
            // Column-major: A is m×k (lda m), B is k×n (ldb k), C is m×n (ldc m).
            let cfg = GemmConfig {
                transa: cublasOperation_t::CUBLAS_OP_N,
                transb: cublasOperation_t::CUBLAS_OP_N,
                m: m as i32,
                n: n as i32,
                k: k as i32,
                alpha: 1.0f32,
                lda: m as i32,
                ldb: k as i32,
                beta: 0.0f32,
                ldc: m as i32,
            };
            // SAFETY: A, B and C hold m·k, k·n and m·n f32 in column-major order.
            unsafe { blas[r].gemm(cfg, &da, &db, &mut c[r]) }.unwrap();
            streams[r].synchronize().unwrap();
        }
        // The GEMM outputs, as each rank's input to the all-reduce.
        let products: Vec<Vec<f32>> = (0..w)
            .map(|r| {
                let mut h = vec![0.0f32; m * n];
                streams[r].memcpy_dtoh(&c[r], &mut h).unwrap();
                h
            })
            .collect();
        for r in 0..w {
            comms[r].all_reduce_pool(&mut c[r], &streams[r]).unwrap();
        }
        sync_all(&comms, &streams).unwrap();
        let outs: Vec<Vec<f32>> = (0..w)
            .map(|r| {
                let mut h = vec![0.0f32; m * n];
                streams[r].memcpy_dtoh(&c[r], &mut h).unwrap();
                h
            })
            .collect();
        for r in 1..w {
            check_bits(&format!("gemm W={w} rank {r}"), &outs[0], &outs[r]).unwrap();
        }
        check_bits(&format!("gemm W={w} emulation"), &emulate(&products), &outs[0]).unwrap();
        // f64 reference of Σ_r A_r·B_r; bound: fp32 accumulation over k products and W ranks
        // (also covers TF32-free cuBLAS summation orders) relative to Σ|a||b|.
        for col in 0..n {
            for row in 0..m {
                let (mut exact, mut abs) = (0.0f64, 0.0f64);
                for r in 0..w {
                    for l in 0..k {
                        let p = a[r][row + l * m] as f64 * b[r][l + col * k] as f64;
                        exact += p;
                        abs += p.abs();
                    }
                }
                let got = outs[0][row + col * m] as f64;
                let tol = (k + w) as f64 * abs / (1u64 << 23) as f64 + 1e-30;
                assert!(
                    (got - exact).abs() <= tol,
                    "gemm W={w} C[{row},{col}]: got {got}, f64 {exact}, tolerance {tol}"
                );
            }
        }
    }
}

/// Out of place, in place and (for pool views) zero-copy, with input and output views at
/// element offsets 1, 3 and 8, every dtype, every algorithm and W ∈ {2, 3, 4, 8}: results
/// bit-identical to the emulation and to the aligned call, within the f64 bound, and the
/// elements around each view untouched.
fn views_at_element_offsets_every_dtype_algorithm_and_world(ctx: Arc<CudaContext>) {
    fn run<T: Elem>(comms: &[Communicator], streams: &[Arc<CudaStream>], seed: u64) {
        let w = comms.len();
        let mut g = rng(seed);
        let sentinel = T::from_f32(-1234.5);
        for algo in [
            Algorithm::OneShot,
            Algorithm::TwoShot,
            Algorithm::LowLatency,
            Algorithm::Auto,
        ] {
            for &len in &[1usize, 5, 17, 1000, 40_003] {
                let len = if algo == Algorithm::LowLatency {
                    len.min(comms[0].config().low_latency_limit(w) / T::DTYPE.size())
                } else {
                    len
                };
                for (oi, oo) in [(1usize, 3usize), (3, 8), (8, 1), (3, 3), (0, 1)] {
                    let what = format!("{} W={w} {algo} len={len} in+{oi} out+{oo}", T::DTYPE);
                    let inputs: Vec<Vec<T>> = (0..w).map(|_| random_input(&mut g, len)).collect();
                    let total = len + 16;
                    let d_in: Vec<CudaSlice<T>> = (0..w)
                        .map(|r| {
                            let mut h = vec![sentinel; total];
                            h[oi..oi + len].copy_from_slice(&inputs[r]);
                            streams[r].clone_htod(&h).unwrap()
                        })
                        .collect();
                    let mut d_out: Vec<CudaSlice<T>> = (0..w)
                        .map(|r| streams[r].clone_htod(&vec![sentinel; total]).unwrap())
                        .collect();
                    for r in 0..w {
                        let input = d_in[r].slice(oi..oi + len);
                        let mut output = d_out[r].slice_mut(oo..oo + len);
                        comms[r]
                            .all_reduce_with(&input, &mut output, &streams[r], algo)
                            .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
                    }
                    sync_all(comms, streams).unwrap();
                    let outs: Vec<Vec<T>> = (0..w)
                        .map(|r| {
                            let h = streams[r].clone_dtoh(&d_out[r]).unwrap();
                            for (i, x) in h.iter().enumerate() {
                                if i < oo || i >= oo + len {
                                    assert_eq!(
                                        x.bits(),
                                        sentinel.bits(),
                                        "{what}: rank {r} wrote element {i}"
                                    );
                                }
                            }
                            h[oo..oo + len].to_vec()
                        })
                        .collect();
                    verify(&inputs, &outs, &what).unwrap();
                    // In place on the input views (odd offsets included).
                    let mut d_io: Vec<CudaSlice<T>> = d_in.clone();
                    for r in 0..w {
                        let mut view = d_io[r].slice_mut(oi..oi + len);
                        comms[r]
                            .all_reduce_in_place(&mut view, &streams[r], algo)
                            .unwrap_or_else(|e| panic!("{what} in place: rank {r}: {e}"));
                    }
                    sync_all(comms, streams).unwrap();
                    for r in 0..w {
                        let h = streams[r].clone_dtoh(&d_io[r]).unwrap();
                        check_bits(&format!("{what} in place rank {r}"), &outs[0], &h[oi..oi + len]).unwrap();
                    }
                }
            }
        }
        // Views of pool buffers passed to all_reduce_in_place are ordinary buffers (copied
        // in: only all_reduce_pool reduces zero-copy), correct; the bytes around the view
        // untouched.
        for &len in &[1usize, 9, 4099] {
            for off in [1usize, 3, 8] {
                let what = format!("{} W={w} pool view len={len} +{off}", T::DTYPE);
                let inputs: Vec<Vec<T>> = (0..w).map(|_| random_input(&mut g, len)).collect();
                let total = len + 16;
                let mut bufs: Vec<SymmetricTensor<T>> = (0..w)
                    .map(|r| comms[r].alloc_symmetric::<T>(total, &streams[r]).unwrap())
                    .collect();
                for r in 0..w {
                    let mut h = vec![sentinel; total];
                    h[off..off + len].copy_from_slice(&inputs[r]);
                    streams[r].memcpy_htod(&h, &mut bufs[r]).unwrap();
                }
                for r in 0..w {
                    let mut view = Raw::<T>::of(bufs[r].device_address(), off, len, &streams[r]);
                    comms[r]
                        .all_reduce_in_place(&mut view, &streams[r], Algorithm::Auto)
                        .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
                }
                sync_all(comms, streams).unwrap();
                let outs: Vec<Vec<T>> = (0..w)
                    .map(|r| {
                        let mut h = vec![T::default(); total];
                        streams[r].memcpy_dtoh(&bufs[r], &mut h).unwrap();
                        for (i, x) in h.iter().enumerate() {
                            if i < off || i >= off + len {
                                assert_eq!(x.bits(), sentinel.bits(), "{what}: rank {r} wrote element {i}");
                            }
                        }
                        h[off..off + len].to_vec()
                    })
                    .collect();
                verify(&inputs, &outs, &what).unwrap();
            }
        }
    }
    for w in WORLDS {
        let (comms, streams) = group(&ctx, w, config(1 << 20, 4 << 20));
        run::<f32>(&comms, &streams, 100 + w as u64);
        run::<f16>(&comms, &streams, 200 + w as u64);
        run::<bf16>(&comms, &streams, 300 + w as u64);
    }
}

/// Pool exhaustion is a typed error on every rank that leaves the pool usable; a pool buffer
/// of another communicator is refused by `all_reduce_pool` and reduced correctly as an
/// ordinary buffer by `all_reduce_in_place`.
fn pool_exhausted_and_foreign_buffers_are_typed_errors(ctx: Arc<CudaContext>) {
    let (comms, streams) = group(&ctx, 2, config(1 << 20, 64 << 10));
    let first: Vec<SymmetricTensor<f32>> = (0..2)
        .map(|r| comms[r].alloc_symmetric::<f32>(10_000, &streams[r]).unwrap())
        .collect();
    for r in 0..2 {
        match comms[r].alloc_symmetric::<f32>(10_000, &streams[r]) {
            Err(Error::PoolExhausted {
                requested, capacity, ..
            }) => {
                assert_eq!(requested, 40_192);
                assert_eq!(capacity, 64 << 10);
            }
            other => panic!("rank {r}: expected PoolExhausted, got {other:?}"),
        }
        comms[r].check_usable().unwrap();
    }
    drop(first);
    let again: Vec<SymmetricTensor<f32>> = (0..2)
        .map(|r| comms[r].alloc_symmetric::<f32>(16_000, &streams[r]).unwrap())
        .collect();
    assert_eq!(again[0].pool_offset(), 0);
    assert_eq!(again[0].sequence(), 1);
    drop(again);

    // Another group's pool buffers.
    let (other, other_streams) = group(&ctx, 2, config(1 << 20, 64 << 10));
    let len = 5000;
    let mut g = rng(5);
    let inputs: Vec<Vec<f32>> = (0..2).map(|_| random_input(&mut g, len)).collect();
    let mut foreign: Vec<SymmetricTensor<f32>> = (0..2)
        .map(|r| other[r].alloc_symmetric::<f32>(len, &other_streams[r]).unwrap())
        .collect();
    for r in 0..2 {
        streams[r].memcpy_htod(&inputs[r], &mut foreign[r]).unwrap();
        streams[r].synchronize().unwrap();
        match comms[r].all_reduce_pool(&mut foreign[r], &streams[r]) {
            Err(Error::ForeignPoolBuffer { expected, found }) => {
                assert_ne!(expected, found);
                assert_eq!(found, foreign[r].pool_id());
            }
            other => panic!("rank {r}: expected ForeignPoolBuffer, got {other:?}"),
        }
    }
    // Nothing was launched; as an ordinary buffer it is reduced (copied in) correctly.
    for r in 0..2 {
        comms[r]
            .all_reduce_in_place(&mut foreign[r], &streams[r], Algorithm::Auto)
            .unwrap();
    }
    sync_all(&comms, &streams).unwrap();
    let outs: Vec<Vec<f32>> = (0..2)
        .map(|r| {
            let mut h = vec![0.0f32; len];
            streams[r].memcpy_dtoh(&foreign[r], &mut h).unwrap();
            h
        })
        .collect();
    verify(&inputs, &outs, "foreign pool buffer as an ordinary buffer").unwrap();
    // Both groups still work.
    let outs = pool_round(&other, &other_streams, &inputs).unwrap();
    verify(&inputs, &outs, "the other group's own pool").unwrap();
    // all_reduce_pool_buffer: a pool buffer seen through another handle (a raw view of its
    // whole allocation) is reduced, by the low-latency kernel (4 KB) and zero-copy (64 KB,
    // above this group's 16 KiB capacity, so above the copy-in range); another
    // communicator's buffer, a view inside an allocation and a plain buffer are refused
    // before anything runs.
    let (comms, streams) = group(&ctx, 2, config(16 << 10, 1 << 20));
    for n in [1000usize, 16_000] {
        let p = comms[0].pool_path(n, DType::F32, false).unwrap();
        if n == 1000 {
            assert_eq!(p.algorithm, Algorithm::LowLatency, "{p}");
        } else {
            assert!(p.reason.starts_with("zero-copy (pool)"), "{p}");
        }
        let mut own: Vec<SymmetricTensor<f32>> = (0..2)
            .map(|r| comms[r].alloc_symmetric::<f32>(n, &streams[r]).unwrap())
            .collect();
        let mut g = rng(n as u64);
        let ins: Vec<Vec<f32>> = (0..2).map(|_| random_input(&mut g, n)).collect();
        for r in 0..2 {
            streams[r].memcpy_htod(&ins[r], &mut own[r]).unwrap();
        }
        for r in 0..2 {
            let mut view = Raw::<f32>::of(own[r].device_address(), 0, n, &streams[r]);
            comms[r].all_reduce_pool_buffer(&mut view, &streams[r]).unwrap();
        }
        sync_all(&comms, &streams).unwrap();
        let outs: Vec<Vec<f32>> = (0..2)
            .map(|r| {
                let mut h = vec![0.0f32; n];
                streams[r].memcpy_dtoh(&own[r], &mut h).unwrap();
                h
            })
            .collect();
        verify(&ins, &outs, &format!("all_reduce_pool_buffer len {n}")).unwrap();
        let mut inside = Raw::<f32>::of(own[0].device_address(), 4, n - 4, &streams[0]);
        assert!(matches!(
            comms[0].all_reduce_pool_buffer(&mut inside, &streams[0]),
            Err(Error::ForeignPoolBuffer { .. })
        ));
        let mut plain = streams[0].alloc_zeros::<f32>(n).unwrap();
        assert!(matches!(
            comms[0].all_reduce_pool_buffer(&mut plain, &streams[0]),
            Err(Error::ForeignPoolBuffer { .. })
        ));
        let mut theirs = Raw::<f32>::of(foreign[0].device_address(), 0, len, &streams[0]);
        assert!(matches!(
            comms[0].all_reduce_pool_buffer(&mut theirs, &streams[0]),
            Err(Error::ForeignPoolBuffer { .. })
        ));
    }
}

/// Ranks whose allocation sequences diverge: a zero-copy call is refused on the device by
/// every rank (Error::PoolMismatch from synchronize on every rank), and no pool byte changes.
/// Case A: different offsets (rank 0 has one more live buffer). Case B: same offset, different
/// sequence numbers (rank 0 allocated and dropped one more buffer). Case C: the same
/// allocations everywhere, but the last rank passes its second buffer. Sizes above the
/// capacity, so zero-copy at every world (below, the pool call copies in or takes the
/// low-latency kernel, and reads no peer's pool memory).
fn diverged_allocation_sequences_are_refused_on_every_rank(ctx: Arc<CudaContext>) {
    for (case, w) in [("A", 2usize), ("B", 3), ("C", 4), ("A", 8)] {
        let cfg = Config {
            timeout: std::time::Duration::from_secs(2),
            ..config(1 << 20, 4 << 20)
        };
        let (comms, streams) = group(&ctx, w, cfg);
        let len = 300_000;
        let mut extra = None;
        if case == "A" {
            extra = Some(comms[0].alloc_symmetric::<f32>(100, &streams[0]).unwrap());
        }
        if case == "B" {
            drop(comms[0].alloc_symmetric::<f32>(100, &streams[0]).unwrap());
        }
        let mut bufs: Vec<SymmetricTensor<f32>> = (0..w)
            .map(|r| comms[r].alloc_symmetric::<f32>(len, &streams[r]).unwrap())
            .collect();
        let mut seconds: Vec<SymmetricTensor<f32>> = (0..w)
            .map(|r| comms[r].alloc_symmetric::<f32>(len, &streams[r]).unwrap())
            .collect();
        if case == "B" {
            assert_eq!(bufs[0].pool_offset(), bufs[1].pool_offset());
            assert_ne!(bufs[0].sequence(), bufs[1].sequence());
        }
        let mut g = rng(9 + w as u64);
        let inputs: Vec<Vec<f32>> = (0..w).map(|_| random_input(&mut g, len)).collect();
        for r in 0..w {
            streams[r].memcpy_htod(&inputs[r], &mut bufs[r]).unwrap();
            streams[r].memcpy_htod(&inputs[r], &mut seconds[r]).unwrap();
        }
        for r in 0..w {
            let buf = if case == "C" && r == w - 1 {
                &mut seconds[r]
            } else {
                &mut bufs[r]
            };
            comms[r].all_reduce_pool(buf, &streams[r]).unwrap();
        }
        for r in 0..w {
            match comms[r].synchronize(&streams[r]) {
                Err(Error::PoolMismatch { rank, .. }) => assert_eq!(rank, r),
                other => panic!("case {case} W={w} rank {r}: expected PoolMismatch, got {other:?}"),
            }
            // Poisoned afterwards, still typed.
            assert!(matches!(
                comms[r].check_usable(),
                Err(Error::Poisoned { ref cause }) if matches!(**cause, Error::PoolMismatch { .. })
            ));
            for (which, b) in [("first", &bufs[r]), ("second", &seconds[r])] {
                let mut h = vec![0.0f32; len];
                streams[r].memcpy_dtoh(b, &mut h).unwrap();
                check_bits(
                    &format!("case {case} W={w} rank {r} {which} untouched"),
                    &inputs[r],
                    &h,
                )
                .unwrap();
            }
        }
        drop(extra);
    }
}

/// The legacy zero-copy API (`symmetric_buffer` + `all_reduce_symmetric`) still works beside
/// the pool, and a pool buffer and the symmetric buffer do not overlap.
fn legacy_symmetric_buffer_and_pool_coexist(ctx: Arc<CudaContext>) {
    let (comms, streams) = group(&ctx, 3, config(1 << 20, 1 << 20));
    let len = 10_001;
    let mut g = rng(3);
    let a: Vec<Vec<bf16>> = (0..3).map(|_| random_input(&mut g, len)).collect();
    let b: Vec<Vec<bf16>> = (0..3).map(|_| random_input(&mut g, len)).collect();
    let mut pool: Vec<SymmetricTensor<bf16>> = (0..3)
        .map(|r| comms[r].alloc_symmetric::<bf16>(len, &streams[r]).unwrap())
        .collect();
    let d_a: Vec<CudaSlice<bf16>> = (0..3).map(|r| streams[r].clone_htod(&a[r]).unwrap()).collect();
    for r in 0..3 {
        streams[r].memcpy_htod(&b[r], &mut pool[r]).unwrap();
        comms[r].copy_to_symmetric(&d_a[r], &streams[r]).unwrap();
        let sym = comms[r].symmetric_buffer();
        let p = pool[r].device_address();
        let layout = comms[r].layout();
        assert!(p >= sym + layout.data_bytes as u64 || p + (len * 2) as u64 <= sym);
    }
    for r in 0..3 {
        comms[r].all_reduce_symmetric::<bf16>(len, &streams[r]).unwrap();
        comms[r].all_reduce_pool(&mut pool[r], &streams[r]).unwrap();
    }
    sync_all(&comms, &streams).unwrap();
    let mut outs_a = Vec::new();
    let mut outs_b = Vec::new();
    for r in 0..3 {
        let mut d = streams[r].alloc_zeros::<bf16>(len).unwrap();
        comms[r].copy_from_symmetric(&mut d, &streams[r]).unwrap();
        outs_a.push(streams[r].clone_dtoh(&d).unwrap());
        let mut h = vec![bf16::ZERO; len];
        streams[r].memcpy_dtoh(&pool[r], &mut h).unwrap();
        outs_b.push(h);
    }
    verify(&a, &outs_a, "legacy symmetric buffer").unwrap();
    verify(&b, &outs_b, "pool buffer").unwrap();
}

/// Compile-time: the pool tensor is what cudarc APIs take.
fn _pool_tensor_is_a_cudarc_buffer<T: Element>(t: &mut SymmetricTensor<T>) {
    fn takes<T, B: DevicePtr<T> + DevicePtrMut<T> + Send>(_: &mut B) {}
    takes::<T, _>(t);
    let _ = DType::ALL;
}

fn main() -> std::process::ExitCode {
    common::harness::run(
        "gpu_pool",
        vec![
            gpu_test!(pool_zero_copy_every_dtype_and_world_back_to_back),
            gpu_test!(pool_input_out_of_place_zero_copy_every_dtype_and_world),
            gpu_test!(pool_buffers_written_by_a_kernel_reduce_zero_copy_in_graphs_replayed_100_times),
            gpu_test!(cublas_gemm_writes_into_a_pool_buffer_then_all_reduce),
            gpu_test!(views_at_element_offsets_every_dtype_algorithm_and_world),
            gpu_test!(pool_exhausted_and_foreign_buffers_are_typed_errors),
            gpu_test!(diverged_allocation_sequences_are_refused_on_every_rank),
            gpu_test!(legacy_symmetric_buffer_and_pool_coexist),
        ],
    )
}
