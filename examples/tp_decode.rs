//! A tensor-parallel decode step: a small Llama-style decoder per rank, one thread per rank,
//! `--layers` layers captured into one CUDA graph per rank and replayed once per step.
//!
//! Per layer and rank (pre-norm Llama, weights split Megatron-style over the W ranks):
//! ```text
//! a       = normed · W_attn        [hidden → hidden/W]   column-parallel (attention stand-in)
//! partial = a · W_o                [hidden/W → hidden]   row-parallel
//! x, normed = all-reduce(partial) + x, RMSNorm           (the crate's fused call)
//! gu      = normed · W_gate_up     [hidden → 2·inter/W]  column-parallel
//! act     = silu(gate) · up                              (a tiny NVRTC kernel)
//! partial = act · W_down           [inter/W → hidden]    row-parallel
//! x, normed = all-reduce(partial) + x, RMSNorm
//! ```
//! GEMMs are cuBLAS (`cublasGemmEx`, bf16 in, fp32 compute). The same step is captured three
//! ways: **fused** (`all_reduce_add_rmsnorm`), **unfused** (`all_reduce` then
//! `residual_rmsnorm`) and **compute-only** (the all-reduce removed: `residual_rmsnorm` on
//! the rank's own partial sums), and each is timed in the same run; so are the fused step with
//! the low-latency and the one-shot kernel forced, and the all-reduce + norm points alone
//! (every algorithm, and the all-reduce without the norm).
//!
//! cudarc's defaults are kept (event tracking on). The crate's calls handle capture
//! themselves; cudarc's cuBLAS wrapper would wait on buffer events under capture, so the
//! GEMMs here go through `cublasGemmEx` on raw addresses taken once at setup (one stream per
//! rank orders everything).
//!
//! With fewer GPUs than ranks, ranks share GPUs ("virtual ranks": every rank its own stream,
//! the GPUs' SMs shared), and the output says so: the compute then runs W times on one GPU,
//! so the absolute step times are not those of a W-GPU node; the difference between the
//! fused, unfused and compute-only graphs is the all-reduce + norm cost in that setting.
//!
//! ```text
//! cargo run --release --example tp_decode -- --world 8 --hidden 8192 --batch 1,32
//! ```

use std::sync::{Arc, Barrier};
use std::time::Instant;

use clap::Parser;
use symm_allreduce::cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use symm_allreduce::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use symm_allreduce::cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use symm_allreduce::cudarc::nvrtc::compile_ptx;
use symm_allreduce::{Algorithm, Communicator, Config, DType};

/// Timed runs of `--steps` replays per variant (the median is reported).
const ROUNDS: usize = 5;

#[derive(Parser, Debug, Clone)]
#[command(about = "Tensor-parallel decode step: fused vs unfused all-reduce + RMSNorm vs compute only")]
struct Args {
    /// Tensor-parallel ranks (threads); ranks share GPUs when there are fewer GPUs.
    #[arg(long, default_value_t = 8)]
    world: usize,
    /// Hidden size (a multiple of 8 and of the world size, at most 16384).
    #[arg(long, default_value_t = 8192)]
    hidden: usize,
    /// MLP intermediate size (default: 3.5 × hidden, rounded to a multiple of 64 × world).
    #[arg(long)]
    intermediate: Option<usize>,
    /// Decoder layers captured in one graph.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Batch sizes (tokens per decode step), comma-separated, each 1..=64.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    batch: Vec<usize>,
    /// Timed steps per run; each variant's time is the median of 5 runs.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Untimed steps before each measurement.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Use at most this many GPUs (default: all visible).
    #[arg(long)]
    gpus: Option<usize>,
    /// Launch the all-reduce kernels without Programmatic Dependent Launch (`Config::pdl`).
    #[arg(long)]
    no_pdl: bool,
    /// `Config::shared_sm_percent` where ranks share a GPU (default: the crate's, 25): more
    /// blocks per rank, as a rank with a GPU of its own has, at the risk of a GEMM waiting
    /// for SMs that other ranks' collectives hold.
    #[arg(long)]
    shared_sm_percent: Option<u32>,
}

const KERNELS: &str = r#"
__device__ __forceinline__ float bf2f(unsigned short x) { return __uint_as_float(((unsigned)x) << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
// out[b, j] = silu(gu[b, j]) * gu[b, inter + j]
extern "C" __global__ void silu_mul(const unsigned short* gu, unsigned short* out, unsigned long long batch,
                                     unsigned long long inter) {
    unsigned long long n = batch * inter;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long b = i / inter, j = i % inter;
        float g = bf2f(gu[b * 2 * inter + j]);
        float u = bf2f(gu[b * 2 * inter + inter + j]);
        out[i] = f2bf(g / (1.0f + expf(-g)) * u);
    }
}
// Uniform values in [-scale, scale) from a hash of (seed, index).
extern "C" __global__ void fill(unsigned short* p, unsigned long long n, unsigned seed, float scale,
                                 float offset) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 0x9E3779B1u ^ seed * 0x85EBCA77u ^ (unsigned)(i >> 32);
        h ^= h >> 15; h *= 0x2C1B3C6Du; h ^= h >> 12; h *= 0x297A2D39u; h ^= h >> 15;
        p[i] = f2bf(offset + scale * ((h >> 8) * (2.0f / 16777216.0f) - 1.0f));
    }
}
"#;

type Bf = half::bf16;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Fused,
    Unfused,
    ComputeOnly,
    /// The two all-reduce + norm points of every layer and nothing else.
    FusedAlone,
    UnfusedAlone,
    /// The fused call alone with its algorithm forced (low-latency only up to its limit).
    FusedAloneLowLatency,
    FusedAloneOneShot,
    FusedAloneTwoShot,
    /// The whole step with the fused call's algorithm forced (low-latency only up to its limit).
    FusedLowLatency,
    FusedOneShot,
    /// The all-reduce alone (no norm): what the fused call is measured against.
    AllReduceAlone,
}

const VARIANTS: [Variant; 11] = [
    Variant::Fused,
    Variant::Unfused,
    Variant::ComputeOnly,
    Variant::FusedAlone,
    Variant::UnfusedAlone,
    Variant::FusedAloneLowLatency,
    Variant::FusedAloneOneShot,
    Variant::FusedAloneTwoShot,
    Variant::FusedLowLatency,
    Variant::FusedOneShot,
    Variant::AllReduceAlone,
];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Fused => "fused AR+norm",
            Variant::Unfused => "unfused AR, norm",
            Variant::ComputeOnly => "compute only",
            Variant::FusedAlone => "fused AR+norm alone",
            Variant::UnfusedAlone => "unfused AR, norm alone",
            Variant::FusedAloneLowLatency => "fused alone, low-latency",
            Variant::FusedAloneOneShot => "fused alone, one-shot",
            Variant::FusedAloneTwoShot => "fused alone, two-shot",
            Variant::FusedLowLatency => "fused AR+norm, low-lat.",
            Variant::FusedOneShot => "fused AR+norm, one-shot",
            Variant::AllReduceAlone => "all-reduce alone",
        }
    }
}

/// One rank's weights and activations (bf16).
struct Rank {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    silu: CudaFunction,
    w_attn: CudaSlice<Bf>,
    w_o: CudaSlice<Bf>,
    w_gu: CudaSlice<Bf>,
    w_down: CudaSlice<Bf>,
    norm_w: CudaSlice<Bf>,
    x: CudaSlice<Bf>,
    normed: CudaSlice<Bf>,
    a: CudaSlice<Bf>,
    partial: CudaSlice<Bf>,
    sum: CudaSlice<Bf>,
    gu: CudaSlice<Bf>,
    act: CudaSlice<Bf>,
    /// cuBLAS's workspace (set explicitly, so nothing is allocated under capture).
    _workspace: CudaSlice<u8>,
    /// Raw addresses for cuBLAS and the activation, taken once, eagerly, at setup.
    ptr: Ptrs,
}

#[derive(Clone, Copy, Default)]
struct Ptrs {
    w_attn: u64,
    w_o: u64,
    w_gu: u64,
    w_down: u64,
    normed: u64,
    a: u64,
    partial: u64,
    gu: u64,
    act: u64,
}

struct Dims {
    batch: usize,
    hidden: usize,
    shard: usize,
    inter: usize,
}

fn addr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _record) = s.device_ptr(stream);
    p
}

/// Row-major `c[m, n] = a[m, k] · b[k, n]` in bf16 with fp32 compute: column-major cuBLAS
/// computes `cᵀ = bᵀ · aᵀ`.
fn gemm(blas: &CudaBlas, (m, n, k): (usize, usize, usize), a: u64, b: u64, c: u64) -> Result<(), String> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: a, b, c are live device buffers of this rank of at least m·k, k·n and m·n bf16
    // elements (allocated in `Rank::new`, kept until the end), and the handle's stream is the
    // rank's stream that orders every use of them.
    unsafe {
        blas::gemm_ex(
            *blas.handle(),
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            m as i32,
            k as i32,
            (&alpha as *const f32).cast(),
            b as *const _,
            blas_sys::cudaDataType::CUDA_R_16BF,
            n as i32,
            a as *const _,
            blas_sys::cudaDataType::CUDA_R_16BF,
            k as i32,
            (&beta as *const f32).cast(),
            c as *mut _,
            blas_sys::cudaDataType::CUDA_R_16BF,
            n as i32,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| format!("cublasGemmEx: {e:?}"))
}

impl Rank {
    fn new(
        ctx: &Arc<CudaContext>,
        rank: usize,
        d: &Dims,
        fill: &CudaFunction,
        silu: CudaFunction,
    ) -> Result<Rank, String> {
        let stream = ctx.new_stream().map_err(|e| e.to_string())?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| format!("cuBLAS: {e:?}"))?;
        let alloc = |n: usize| stream.alloc_zeros::<Bf>(n).map_err(|e| e.to_string());
        let mut seed = rank as u32 * 101;
        let mut random = |n: usize, scale: f32, offset: f32| -> Result<CudaSlice<Bf>, String> {
            let buf = alloc(n)?;
            seed += 1;
            let p = addr(&buf, &stream);
            let (n64, s) = (n as u64, seed);
            let mut b = stream.launch_builder(fill);
            b.arg(&p).arg(&n64).arg(&s).arg(&scale).arg(&offset);
            // SAFETY: `fill(unsigned short*, u64, u32, float, float)` writes n elements of `buf`.
            unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.map_err(|e| e.to_string())?;
            Ok(buf)
        };
        let (h, s, i) = (d.hidden, d.shard, d.inter);
        let k = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        const WORKSPACE: usize = 32 << 20;
        let workspace = stream.alloc_zeros::<u8>(WORKSPACE).map_err(|e| e.to_string())?;
        let ws = addr(&workspace, &stream);
        // SAFETY: `ws` is a live device buffer of WORKSPACE bytes on the handle's stream's
        // device, kept in `Rank` as long as the handle.
        let status = unsafe { blas_sys::cublasSetWorkspace_v2(*blas.handle(), ws as *mut _, WORKSPACE) };
        if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(format!("cublasSetWorkspace: {status:?}"));
        }
        let mut r = Rank {
            _workspace: workspace,
            ptr: Ptrs::default(),
            w_attn: random(h * s, k(h), 0.0)?,
            w_o: random(s * h, k(h), 0.0)?,
            w_gu: random(h * 2 * i, k(h), 0.0)?,
            w_down: random(i * h, k(i), 0.0)?,
            norm_w: random(h, 0.2, 1.0)?,
            x: random(d.batch * h, 1.0, 0.0)?,
            normed: random(d.batch * h, 1.0, 0.0)?,
            a: alloc(d.batch * s)?,
            partial: alloc(d.batch * h)?,
            sum: alloc(d.batch * h)?,
            gu: alloc(d.batch * 2 * i)?,
            act: alloc(d.batch * i)?,
            silu,
            blas,
            stream,
        };
        let st = &r.stream;
        r.ptr = Ptrs {
            w_attn: addr(&r.w_attn, st),
            w_o: addr(&r.w_o, st),
            w_gu: addr(&r.w_gu, st),
            w_down: addr(&r.w_down, st),
            normed: addr(&r.normed, st),
            a: addr(&r.a, st),
            partial: addr(&r.partial, st),
            gu: addr(&r.gu, st),
            act: addr(&r.act, st),
        };
        Ok(r)
    }

    /// One all-reduce + residual + norm point of the layer, as the variant does it.
    fn reduce_norm(&mut self, comm: &Communicator, v: Variant) -> Result<(), String> {
        let e = |e: symm_allreduce::Error| e.to_string();
        let eps = 1e-5;
        match v {
            Variant::Fused | Variant::FusedAlone => comm
                .all_reduce_add_rmsnorm(
                    &self.partial,
                    &mut self.x,
                    &self.norm_w,
                    eps,
                    &mut self.normed,
                    &self.stream,
                )
                .map_err(e),
            Variant::FusedAloneLowLatency
            | Variant::FusedAloneOneShot
            | Variant::FusedAloneTwoShot
            | Variant::FusedLowLatency
            | Variant::FusedOneShot => {
                let algorithm = match v {
                    Variant::FusedAloneLowLatency | Variant::FusedLowLatency => Algorithm::LowLatency,
                    Variant::FusedAloneOneShot | Variant::FusedOneShot => Algorithm::OneShot,
                    _ => Algorithm::TwoShot,
                };
                comm.all_reduce_add_rmsnorm_with(
                    &self.partial,
                    &mut self.x,
                    &self.norm_w,
                    eps,
                    &mut self.normed,
                    &self.stream,
                    algorithm,
                )
                .map_err(e)
            }
            Variant::Unfused | Variant::UnfusedAlone => {
                comm.all_reduce(&self.partial, &mut self.sum, &self.stream)
                    .map_err(e)?;
                comm.residual_rmsnorm(
                    &self.sum,
                    &mut self.x,
                    &self.norm_w,
                    eps,
                    &mut self.normed,
                    &self.stream,
                )
                .map_err(e)
            }
            Variant::AllReduceAlone => comm
                .all_reduce(&self.partial, &mut self.sum, &self.stream)
                .map_err(e),
            Variant::ComputeOnly => comm
                .residual_rmsnorm(
                    &self.partial,
                    &mut self.x,
                    &self.norm_w,
                    eps,
                    &mut self.normed,
                    &self.stream,
                )
                .map_err(e),
        }
    }

    fn layer(&mut self, comm: &Communicator, d: &Dims, v: Variant) -> Result<(), String> {
        if matches!(
            v,
            Variant::FusedAlone
                | Variant::UnfusedAlone
                | Variant::FusedAloneLowLatency
                | Variant::FusedAloneOneShot
                | Variant::FusedAloneTwoShot
                | Variant::AllReduceAlone
        ) {
            self.reduce_norm(comm, v)?;
            return self.reduce_norm(comm, v);
        }
        let st = self.stream.clone();
        let Ptrs {
            w_attn,
            w_o,
            w_gu,
            w_down,
            normed,
            a,
            partial,
            gu,
            act,
        } = self.ptr;
        gemm(&self.blas, (d.batch, d.shard, d.hidden), normed, w_attn, a)?;
        gemm(&self.blas, (d.batch, d.hidden, d.shard), a, w_o, partial)?;
        self.reduce_norm(comm, v)?;
        gemm(&self.blas, (d.batch, 2 * d.inter, d.hidden), normed, w_gu, gu)?;
        let (b64, i64_) = (d.batch as u64, d.inter as u64);
        let mut l = st.launch_builder(&self.silu);
        l.arg(&gu).arg(&act).arg(&b64).arg(&i64_);
        let cfg = LaunchConfig {
            grid_dim: (((d.batch * d.inter).div_ceil(256)).min(1024) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `silu_mul(const u16*, u16*, u64, u64)` reads batch·2·inter and writes
        // batch·inter elements of the rank's live buffers.
        unsafe { l.launch(cfg) }.map_err(|e| e.to_string())?;
        gemm(&self.blas, (d.batch, d.hidden, d.inter), act, w_down, partial)?;
        self.reduce_norm(comm, v)
    }

    fn step(&mut self, comm: &Communicator, d: &Dims, layers: usize, v: Variant) -> Result<(), String> {
        for _ in 0..layers {
            self.layer(comm, d, v)?;
        }
        Ok(())
    }
}

/// One rank's thread: builds its model, runs each variant eagerly once, captures it, and
/// times the replays between barriers. Returns the seconds per step of each variant (rank 0).
fn rank_main(
    comm: Communicator,
    ctx: Arc<CudaContext>,
    args: &Args,
    batch: usize,
    barrier: &Barrier,
) -> Result<Vec<f64>, String> {
    let rank = comm.rank();
    let w = args.world;
    let inter = args
        .intermediate
        .unwrap_or((args.hidden * 7 / 2).next_multiple_of(64 * w))
        / w;
    let d = Dims {
        batch,
        hidden: args.hidden,
        shard: args.hidden / w,
        inter,
    };
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let ptx = compile_ptx(KERNELS).map_err(|e| format!("NVRTC: {e}"))?;
    let module = ctx.load_module(ptx).map_err(|e| e.to_string())?;
    let fill = module.load_function("fill").map_err(|e| e.to_string())?;
    let silu = module.load_function("silu_mul").map_err(|e| e.to_string())?;
    let mut r = Rank::new(&ctx, rank, &d, &fill, silu)?;
    // The low-latency kernel takes messages up to its limit only (ExceedsCapacity above).
    let low_latency_fits = comm
        .add_rmsnorm_path(batch, args.hidden, DType::BF16, Algorithm::LowLatency)
        .is_ok();
    // Load every kernel of the step before the first collective: with CUDA's lazy module
    // loading (the default since 12.2) the first launch of a kernel not yet loaded, such as the
    // GEMM cuBLAS picks for a new shape, may synchronise the context. Ranks sharing a GPU share
    // it, so a rank stuck there cannot launch its part of a call that its peers' kernels
    // already wait in. One step without collectives, between barriers, loads them all.
    barrier.wait();
    r.step(&comm, &d, 1, Variant::ComputeOnly)?;
    r.stream.synchronize().map_err(|e| e.to_string())?;
    barrier.wait();
    let mut times = Vec::new();
    for v in VARIANTS {
        if matches!(v, Variant::FusedAloneLowLatency | Variant::FusedLowLatency) && !low_latency_fits {
            times.push(f64::NAN);
            continue;
        }
        // Eager once (cuBLAS picks its kernels and workspace outside the capture).
        barrier.wait();
        r.step(&comm, &d, 1, v)?;
        comm.synchronize(&r.stream).map_err(|e| e.to_string())?;
        barrier.wait();
        r.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| e.to_string())?;
        let captured = r.step(&comm, &d, args.layers, v);
        let graph: Option<CudaGraph> = r
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(|e| format!("capture of {}: {e}", v.name()))?;
        captured?;
        let graph = graph.ok_or("empty capture")?;
        for _ in 0..args.warmup {
            graph.launch().map_err(|e| e.to_string())?;
        }
        comm.synchronize(&r.stream).map_err(|e| e.to_string())?;
        // The median of `ROUNDS` timed runs of `--steps` replays: one run that met a stall
        // (a preempted rank thread) does not become the variant's number.
        let mut runs = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            barrier.wait();
            let t0 = Instant::now();
            for _ in 0..args.steps {
                graph.launch().map_err(|e| e.to_string())?;
            }
            comm.synchronize(&r.stream).map_err(|e| e.to_string())?;
            barrier.wait();
            runs.push(t0.elapsed().as_secs_f64() / args.steps as f64);
        }
        runs.sort_by(f64::total_cmp);
        times.push(runs[ROUNDS / 2]);
    }
    let x = r.stream.clone_dtoh(&r.normed).map_err(|e| e.to_string())?;
    if x.iter().any(|v| !v.to_f32().is_finite()) {
        return Err(format!("rank {rank}: non-finite activations"));
    }
    Ok(times)
}

fn main() -> std::process::ExitCode {
    // No driver or no GPU: 2, as symm-bench; any other failure: 1.
    if let Err(e) = symm_allreduce::device_count() {
        eprintln!("tp_decode: no GPU: {e}");
        return std::process::ExitCode::from(2);
    }
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tp_decode: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let args = Args::parse();
    let w = args.world;
    if !(1..=symm_allreduce::MAX_RANKS).contains(&w) || args.hidden % (8 * w) != 0 || args.hidden > 16384 {
        return Err(format!(
            "--world must be 1..={} and --hidden a multiple of 8·world up to 16384",
            symm_allreduce::MAX_RANKS
        ));
    }
    if args.batch.iter().any(|&b| !(1..=64).contains(&b)) {
        return Err("--batch values must be in 1..=64".into());
    }
    let visible = symm_allreduce::device_count().map_err(|e| e.to_string())?;
    let gpus = args.gpus.unwrap_or(visible).min(visible).max(1);
    let ctxs: Vec<Arc<CudaContext>> = (0..gpus)
        .map(|g| symm_allreduce::context(g).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let inter = args
        .intermediate
        .unwrap_or((args.hidden * 7 / 2).next_multiple_of(64 * w));
    println!(
        "tp_decode: W={w} ranks on {gpus} GPU(s){}, hidden {}, intermediate {inter}, {} layers per graph, bf16, \
         event tracking {}",
        if gpus < w {
            format!(" -- VIRTUAL RANKS: {} ranks share each GPU (own stream each), compute runs {}x per GPU", w.div_ceil(gpus), w.div_ceil(gpus))
        } else {
            String::new()
        },
        args.hidden,
        args.layers,
        if ctxs[0].is_event_tracking() { "on (cudarc default)" } else { "off" },
    );
    let rank_ctx: Vec<Arc<CudaContext>> = (0..w).map(|r| ctxs[r % gpus].clone()).collect();
    let config = Config {
        capacity_bytes: 8 << 20,
        pdl: !args.no_pdl,
        shared_sm_percent: args
            .shared_sm_percent
            .unwrap_or(Config::default().shared_sm_percent),
        ..Config::default()
    };
    for &batch in &args.batch {
        let comms = Communicator::local_group(&rank_ctx, config.clone()).map_err(|e| e.to_string())?;
        if batch == args.batch[0] {
            let p = comms[0]
                .add_rmsnorm_path(batch, args.hidden, DType::BF16, Algorithm::Auto)
                .map_err(|e| e.to_string())?;
            println!("  path at batch {batch}: {p}");
        }
        let barrier = Barrier::new(w);
        let results: Vec<Result<Vec<f64>, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .zip(&rank_ctx)
                .map(|(c, ctx)| {
                    let (args, barrier, ctx) = (&args, &barrier, ctx.clone());
                    s.spawn(move || rank_main(c, ctx, args, batch, barrier))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("a rank thread panicked".into())))
                .collect()
        });
        // Every rank's error, not only the first: a rank that failed on its own (and never
        // launched its part of a call) shows up beside the peers that then timed out.
        let mut per_rank = Vec::new();
        let mut errors = Vec::new();
        for (r, res) in results.into_iter().enumerate() {
            match res {
                Ok(t) => per_rank.push(t),
                Err(e) => errors.push(format!("rank {r}: {e}")),
            }
        }
        if !errors.is_empty() {
            return Err(format!("batch {batch}:\n  {}", errors.join("\n  ")));
        }
        let t = &per_rank[0];
        let layers = args.layers as f64;
        println!(
            "batch {batch} ({} KiB per all-reduce):",
            batch * args.hidden * 2 / 1024
        );
        for (v, secs) in VARIANTS.iter().zip(t).filter(|(_, s)| !s.is_nan()) {
            println!(
                "  {:<24} {:>9.1} us/step  {:>8.2} us/layer",
                v.name(),
                secs * 1e6,
                secs * 1e6 / layers
            );
        }
        let per_call = |s: f64| (s - t[2]) * 1e6 / (2.0 * layers);
        let alone = |s: f64| s * 1e6 / (2.0 * layers);
        println!(
            "  per all-reduce + residual + norm call: in the step (over compute-only) fused {:.2} us, unfused {:.2} us; \
             alone fused {:.2} us, unfused {:.2} us -> fused is {} in the step, {} alone",
            per_call(t[0]),
            per_call(t[1]),
            alone(t[3]),
            alone(t[4]),
            if t[0] < t[1] { "FASTER" } else { "NOT faster" },
            if t[3] < t[4] { "FASTER" } else { "NOT faster" },
        );
        let low_latency = if t[5].is_nan() {
            "n/a (above the low-latency limit)".to_string()
        } else {
            format!("{:.2} us", alone(t[5]))
        };
        let low_latency_step = if t[8].is_nan() {
            "n/a".to_string()
        } else {
            format!("{:.2} us", per_call(t[8]))
        };
        println!(
            "  fused alone per call, algorithm forced: low-latency {low_latency}, one-shot {:.2} us, two-shot {:.2} us; \
             in the step: low-latency {low_latency_step}, one-shot {:.2} us",
            alone(t[6]),
            alone(t[7]),
            per_call(t[9])
        );
        println!(
            "  alone per call: all-reduce {:.2} us, fused {:.2} us (fused - all-reduce = {:+.2} us)",
            alone(t[10]),
            alone(t[3]),
            alone(t[3]) - alone(t[10])
        );
    }
    Ok(())
}
