//! A Llama-architecture decoder on candle, split tensor-parallel over W ranks with
//! symm-allreduce-candle: column-parallel Q/K/V and gate/up, row-parallel O and down, an
//! all-reduce after each row-parallel layer, one thread per rank (as Rust engines drive
//! them). The model's shape comes from a config file (default: the one beside this file, a
//! Llama-3-8B shape with 4 layers, compiled in); the weights are random from `--seed`, each
//! tensor generated whole on every rank from its own seed and sliced there, so every W sees
//! the same model. Decode at each `--batches` size with a KV cache: `--prompt` tokens, then
//! `--steps` timed steps.
//!
//! Per (W, batch) it runs, in one process:
//! - `symm fused`: each all-reduce fused with the residual add and the next RMSNorm
//!   (`SymmComm::all_reduce_add_rmsnorm`);
//! - `symm unfused`: `SymmComm::all_reduce`, then candle's add and `rms_norm`;
//! - `nccl` (W = 1 only: NCCL refuses two ranks on one GPU): the unfused step over a
//!   communicator whose every call goes to its NCCL fallback (`Algorithm::Nccl`);
//! - `compute only`: no all-reduce at all (each rank's partial sums taken as the sum: the
//!   arithmetic is wrong for W > 1, the time is the step without communication);
//! - with `--graph`, `symm fused (graph)`: one step captured in a CUDA graph on every rank and
//!   replayed (the step at a fixed position, so its KV-cache write and attention length are
//!   the same on every replay).
//!
//! Correctness: after the prompt, every rank's logits must be bit-identical (the all-reduce
//! gives every rank the same bits), and the logits of each symm mode must match those of
//! the unsplit model (W = 1, compute only) within `--tolerance` (largest difference over the
//! largest reference logit); the graph row's logits (one replay) must match those of the same
//! step run eagerly. The process exits non-zero when a check or a row fails.
//!
//! The ranks are threads of this process (virtual ranks where they share a GPU), so the
//! example keeps the adapter's rules for that ("Several ranks in one process" in the crate
//! docs): a stream per rank, nothing read back to the host before `SymmComm::synchronize`,
//! no host-to-device upload between collectives (the tokens are uploaded first, candle's
//! upload cache is on). Every rank runs the same steps in lockstep: a step that fails on one
//! rank fails on all, so none is left waiting for another. `--diagnose` prints what each rank
//! runs on and each rank's progress.
//!
//!   cargo run --release -p symm-allreduce-candle --example candle_tp_llama -- --worlds 2,4,8

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module};
use clap::Parser;
use symm_allreduce::{Algorithm, Communicator, Config, LocalHub};
use symm_allreduce_candle::SymmComm;

const SHIPPED_CONFIG: &str = include_str!("llama3-8b-4-layers.json");

#[derive(Parser, Debug, Clone)]
#[command(about = "Tensor-parallel Llama decode on candle over symm-allreduce")]
struct Args {
    /// Model shape (JSON, the fields of a Hugging Face Llama config.json); default: the
    /// shipped Llama-3-8B shape with 4 layers.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Override the number of layers.
    #[arg(long)]
    layers: Option<usize>,
    /// World sizes to run (ranks are spread over the visible GPUs; several per GPU are
    /// virtual ranks).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    worlds: Vec<usize>,
    /// Batch sizes (sequences decoded together).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Prompt tokens per sequence (decoded one at a time into the KV cache).
    #[arg(long, default_value_t = 16)]
    prompt: usize,
    /// Timed decode steps per mode.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Seed of the random weights and tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// bf16 (default), f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Largest |TP − W=1| logit difference over the largest |W=1| logit. Default by dtype:
    /// bf16 3e-2, f16 1e-2, f32 1e-4 (each rank rounds its partial sums to the dtype before
    /// the reduction, twice per layer, where the unsplit model rounds the full sum once:
    /// a few units of the dtype's rounding error per layer).
    #[arg(long)]
    tolerance: Option<f32>,
    /// Also time the fused step replayed from a CUDA graph (its logits are checked against
    /// the same step run eagerly).
    #[arg(long)]
    graph: bool,
    /// Print what each rank runs on (candle device, cudarc context, stream, event tracking,
    /// the communicator's setup) and each rank's progress through every step, to stderr.
    #[arg(long)]
    diagnose: bool,
    /// Most decode steps a rank enqueues ahead of its GPU (0: no bound). Ranks in one
    /// process share one CUDA context, and a rank that had run far ahead was seen to stall a
    /// peer until the collective timed out (see `Pacer`).
    #[arg(long, default_value_t = 4)]
    max_ahead: usize,
    /// The communicators' bound on every wait for a peer, in seconds.
    #[arg(long, default_value_t = 10)]
    timeout: u64,
    /// The communicators' `Config::max_blocks_per_rank` (default: the library's).
    #[arg(long)]
    max_blocks: Option<usize>,
}

#[derive(serde::Deserialize, Debug, Clone)]
struct ModelConfig {
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    vocab_size: usize,
    rms_norm_eps: f64,
    rope_theta: f64,
}

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// What every rank of a run shares: the flags, the model shape, the dtype.
struct Ctx<'a> {
    args: &'a Args,
    cfg: &'a ModelConfig,
    dtype: DType,
}

/// How a step combines a row-parallel layer's partial sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Fused,
    Unfused,
    Nccl,
    ComputeOnly,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Fused => "symm fused",
            Mode::Unfused => "symm unfused",
            Mode::Nccl => "nccl (fallback path)",
            Mode::ComputeOnly => "compute only",
        }
    }
}

/// One rank's part of one layer.
struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: Tensor,
    post_norm: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
}

/// One rank's model: sharded layers, replicated embedding, final norm and LM head.
struct Model {
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    cos: Tensor,
    sin: Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f32,
}

/// Every tensor of the model, generated whole from `seed + index` (so every rank of every
/// world size sees the same values) and cut to this rank's shard: `dim` 0 for
/// column-parallel, 1 for row-parallel, `None` for replicated.
struct Weights<'a> {
    dev: &'a Device,
    dtype: DType,
    seed: u64,
    next: u64,
    rank: usize,
    world: usize,
}

impl Weights<'_> {
    fn take(&mut self, dims: (usize, usize), std: f64, shard: Option<usize>) -> Res<Tensor> {
        self.dev
            .set_seed(self.seed.wrapping_mul(1_000_003).wrapping_add(self.next))?;
        self.next += 1;
        let full = Tensor::randn(0f32, std as f32, dims, self.dev)?.to_dtype(self.dtype)?;
        Ok(match shard {
            None => full,
            Some(dim) => {
                let n = full.dim(dim)? / self.world;
                full.narrow(dim, self.rank * n, n)?.contiguous()?
            }
        })
    }

    fn ones(&self, n: usize) -> Res<Tensor> {
        Ok(Tensor::ones(n, self.dtype, self.dev)?)
    }
}

impl Model {
    fn new(
        ctx: &Ctx,
        dev: &Device,
        (rank, world): (usize, usize),
        max_batch: usize,
        max_len: usize,
    ) -> Res<Model> {
        let (cfg, dtype, seed) = (ctx.cfg, ctx.dtype, ctx.args.seed);
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let head_dim = h / cfg.num_attention_heads;
        for (what, n) in [
            ("num_attention_heads", cfg.num_attention_heads),
            ("num_key_value_heads", cfg.num_key_value_heads),
            ("intermediate_size", i),
        ] {
            if n % world != 0 {
                return Err(format!("{what} ({n}) is not divisible by the world size {world}").into());
            }
        }
        let (heads, kv_heads) = (cfg.num_attention_heads / world, cfg.num_key_value_heads / world);
        let mut w = Weights {
            dev,
            dtype,
            seed,
            next: 0,
            rank,
            world,
        };
        let std = 0.02;
        let embed = w.take((cfg.vocab_size, h), 1.0, None)?;
        let mut layers = Vec::new();
        for _ in 0..cfg.num_hidden_layers {
            let lin = |t: Tensor| Linear::new(t, None);
            layers.push(Layer {
                q: lin(w.take((cfg.num_attention_heads * head_dim, h), std, Some(0))?),
                k: lin(w.take((cfg.num_key_value_heads * head_dim, h), std, Some(0))?),
                v: lin(w.take((cfg.num_key_value_heads * head_dim, h), std, Some(0))?),
                o: lin(w.take((h, cfg.num_attention_heads * head_dim), std, Some(1))?),
                gate: lin(w.take((i, h), std, Some(0))?),
                up: lin(w.take((i, h), std, Some(0))?),
                down: lin(w.take((h, i), std, Some(1))?),
                input_norm: w.ones(h)?,
                post_norm: w.ones(h)?,
                k_cache: Tensor::zeros((max_batch, kv_heads, max_len, head_dim), dtype, dev)?,
                v_cache: Tensor::zeros((max_batch, kv_heads, max_len, head_dim), dtype, dev)?,
            });
        }
        let norm = w.ones(h)?;
        let lm_head = Linear::new(w.take((cfg.vocab_size, h), std, None)?, None);
        // RoPE tables (non-interleaved halves, as Llama), positions 0..max_len.
        let inv: Vec<f32> = (0..head_dim / 2)
            .map(|j| 1.0 / (cfg.rope_theta as f32).powf(2.0 * j as f32 / head_dim as f32))
            .collect();
        let inv = Tensor::new(inv.as_slice(), dev)?;
        let pos = Tensor::arange(0u32, max_len as u32, dev)?.to_dtype(DType::F32)?;
        let angles = pos.unsqueeze(1)?.broadcast_mul(&inv.unsqueeze(0)?)?;
        Ok(Model {
            embed,
            layers,
            norm,
            lm_head,
            cos: angles.cos()?.to_dtype(dtype)?,
            sin: angles.sin()?.to_dtype(dtype)?,
            heads,
            kv_heads,
            head_dim,
            eps: cfg.rms_norm_eps as f32,
        })
    }

    /// One decode step at position `pos` for the `(batch,)` token ids `tokens`; the logits
    /// `(batch, vocab)` in f32.
    fn step(&self, tokens: &Tensor, pos: usize, comm: Option<&SymmComm>, mode: Mode) -> Res<Tensor> {
        let b = tokens.dim(0)?;
        let mut h = self.embed.embedding(tokens)?; // (b, hidden): the residual stream
        let mut x = candle_nn::ops::rms_norm(&h, &self.layers[0].input_norm, self.eps)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let attn = self.attention(layer, &x, pos, b)?;
            x = self.combine(attn, &mut h, &layer.post_norm, comm, mode)?;
            let mlp = layer
                .down
                .forward(&(layer.gate.forward(&x)?.silu()? * layer.up.forward(&x)?)?)?;
            let next_norm = self.layers.get(l + 1).map_or(&self.norm, |n| &n.input_norm);
            x = self.combine(mlp, &mut h, next_norm, comm, mode)?;
        }
        Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?)
    }

    /// The residual add and the next RMSNorm after a row-parallel layer's partial sums.
    fn combine(
        &self,
        partial: Tensor,
        h: &mut Tensor,
        norm: &Tensor,
        comm: Option<&SymmComm>,
        mode: Mode,
    ) -> Res<Tensor> {
        let sum = match (mode, comm) {
            (Mode::Fused, Some(c)) => return Ok(c.all_reduce_add_rmsnorm(&partial, h, norm, self.eps)?),
            (Mode::Unfused | Mode::Nccl, Some(c)) => c.all_reduce(&partial)?,
            (Mode::ComputeOnly, _) => partial,
            (_, None) => return Err("this mode needs a communicator".into()),
        };
        *h = (&*h + sum)?;
        Ok(candle_nn::ops::rms_norm(h, norm, self.eps)?)
    }

    fn attention(&self, layer: &Layer, x: &Tensor, pos: usize, b: usize) -> Res<Tensor> {
        let d = self.head_dim;
        let group = self.heads / self.kv_heads;
        let cos = self.cos.narrow(0, pos, 1)?;
        let sin = self.sin.narrow(0, pos, 1)?;
        let q = layer.q.forward(x)?.reshape((b, self.heads, 1, d))?;
        let q = candle_nn::rotary_emb::rope(&q, &cos, &sin)?;
        let k = layer.k.forward(x)?.reshape((b, self.kv_heads, 1, d))?;
        let k = candle_nn::rotary_emb::rope(&k, &cos, &sin)?;
        let v = layer.v.forward(x)?.reshape((b, self.kv_heads, 1, d))?;
        // The cache holds positions 0..=pos (written in place at `pos`).
        let k_cache = layer.k_cache.narrow(0, 0, b)?;
        let v_cache = layer.v_cache.narrow(0, 0, b)?;
        k_cache.slice_set(&k, 2, pos)?;
        v_cache.slice_set(&v, 2, pos)?;
        let keys = k_cache.narrow(2, 0, pos + 1)?.contiguous()?; // (b, kv, t, d)
        let values = v_cache.narrow(2, 0, pos + 1)?.contiguous()?;
        // Grouped-query attention without repeating the KV heads: (b, kv, group, d).
        let q = q.reshape((b, self.kv_heads, group, d))?;
        let scores = (q.matmul(&keys.t()?)? * (1.0 / (d as f64).sqrt()))?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs.matmul(&values)?.reshape((b, self.heads * d))?;
        Ok(layer.o.forward(&out)?)
    }
}

/// The token fed at `pos` to sequence `seq`.
fn token(seed: u64, seq: usize, pos: usize, vocab: usize) -> u32 {
    let x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((seq as u64) << 20)
        .wrapping_add(pos as u64 * 7919);
    ((x ^ (x >> 29)) % vocab as u64) as u32
}

fn tokens(seed: u64, batch: usize, pos: usize, vocab: usize, dev: &Device) -> Res<Tensor> {
    let ids: Vec<u32> = (0..batch).map(|s| token(seed, s, pos, vocab)).collect();
    Ok(Tensor::new(ids.as_slice(), dev)?)
}

/// What one rank measured for one (batch, mode).
struct Measured {
    mode: &'static str,
    batch: usize,
    /// Logits after the prompt (the graph row: after one replay), bits as f32.
    logits: Vec<f32>,
    /// What `logits` is checked against when it is not the unsplit model's logits after the
    /// prompt: the graph row's eager fused step at the same position, on the same rank.
    reference: Option<Vec<f32>>,
    step_us: f64,
    error: Option<String>,
}

/// Keeps the ranks of one world in step. Every rank runs the same sequence of `step`s; each
/// ends at the same barriers on every rank, whatever failed where, and fails on every rank
/// when it failed on any. A rank that returned early on its own error would leave the
/// others waiting at a barrier forever (or at a collective until the timeout).
struct Lockstep {
    barrier: Barrier,
    failed: AtomicBool,
    /// `--diagnose`: each rank prints each step's start and end (a hang shows where).
    diagnose: bool,
}

impl Lockstep {
    fn new(world: usize, diagnose: bool) -> Lockstep {
        Lockstep {
            barrier: Barrier::new(world),
            failed: AtomicBool::new(false),
            diagnose,
        }
    }

    /// Runs `f` on this rank (`what` names it in errors), then waits for every rank: `Err` on
    /// every rank when `f` failed on any, so that `?` leaves every rank at the same step.
    fn step<T>(&self, rank: usize, what: &str, f: impl FnOnce() -> Res<T>) -> Res<T> {
        let start = Instant::now();
        if self.diagnose {
            eprintln!("rank {rank}: {what} ...");
        }
        let result =
            f().map_err(|e| -> Box<dyn std::error::Error + Send + Sync> { format!("{what}: {e}").into() });
        if self.diagnose {
            let how = match &result {
                Ok(_) => "done".to_string(),
                Err(e) => format!("FAILED: {e}"),
            };
            eprintln!(
                "rank {rank}: {what} {how} in {:.1} ms",
                start.elapsed().as_secs_f64() * 1e3
            );
        }
        if result.is_err() {
            self.failed.store(true, Ordering::SeqCst);
        }
        self.barrier.wait();
        let any = self.failed.load(Ordering::SeqCst);
        // Every rank has read the flag before it is cleared for the next step.
        if self.barrier.wait().is_leader() {
            self.failed.store(false, Ordering::SeqCst);
        }
        self.barrier.wait();
        match result {
            Ok(_) if any => Err(format!("{what}: another rank failed").into()),
            r => r,
        }
    }
}

/// Bounds how far a rank's host runs ahead of its GPU: an event after each step, and before
/// the next one a wait for the step `max_ahead` back. Ranks in one process share the device's
/// context. Unbounded, a rank that had queued hundreds of steps behind a collective waiting
/// for its peer stalled that peer's work until the collective timed out (W = 2, 256 steps;
/// docs/candle.md); bounded to 4 steps the same run completed. The likely coupling is the
/// context's shared launch queue; one rank per GPU (a context each) does not share it. The
/// bound costs nothing while the GPU is the slower side.
struct Pacer {
    stream: Arc<symm_allreduce::cudarc::driver::CudaStream>,
    max_ahead: usize,
    pending: std::collections::VecDeque<symm_allreduce::cudarc::driver::CudaEvent>,
}

impl Pacer {
    fn new(dev: &Device, max_ahead: usize) -> Res<Pacer> {
        Ok(Pacer {
            stream: dev.as_cuda_device()?.cuda_stream(),
            max_ahead,
            pending: Default::default(),
        })
    }

    /// After a step has been enqueued: waits for the step `max_ahead` back, then marks this
    /// one, reusing that step's event once `max_ahead` are in flight (no event made per step).
    fn step_done(&mut self) -> Res<()> {
        if self.max_ahead == 0 {
            return Ok(());
        }
        let event = if self.pending.len() >= self.max_ahead {
            let oldest = self.pending.pop_front().ok_or("the pacer lost its events")?;
            // Ends: the collectives in it end within the communicator's timeout.
            oldest.synchronize()?;
            oldest.record(&self.stream)?;
            oldest
        } else {
            use symm_allreduce::cudarc::driver::sys::CUevent_flags;
            self.stream
                .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?
        };
        self.pending.push_back(event);
        Ok(())
    }
}

/// Waits for this rank's stream: through the communicator when there is one, which also
/// reports a peer timeout. With several ranks in this process, nothing is read back to the
/// host before this: candle's readback into pageable memory blocks this thread in the driver
/// until the stream has drained, where a peer's own host copies can then wait behind it
/// before it has enqueued its part of the collective (symm_allreduce_candle's docs).
fn wait(dev: &Device, comm: Option<&SymmComm>) -> Res<()> {
    match comm {
        Some(c) => c.synchronize(dev)?,
        None => dev.synchronize()?,
    }
    Ok(())
}

/// Every token a run of `batch` sequences feeds, uploaded before any collective runs: no
/// host-to-device copy between the collectives.
fn all_tokens(ctx: &Ctx, batch: usize, positions: std::ops::Range<usize>, dev: &Device) -> Res<Vec<Tensor>> {
    positions
        .map(|pos| tokens(ctx.args.seed, batch, pos, ctx.cfg.vocab_size, dev))
        .collect()
}

/// One rank's place in a world: its index, its device and the world's lockstep.
struct RankCtx<'a> {
    rank: usize,
    dev: &'a Device,
    lock: &'a Lockstep,
}

/// The prompt, then `steps` timed decode steps; every rank runs this at the same time.
fn run_mode(
    model: &Model,
    rc: &RankCtx,
    comm: Option<&SymmComm>,
    mode: Mode,
    batch: usize,
    ctx: &Ctx,
) -> Res<(Vec<f32>, f64)> {
    let (args, dev, lock, rank) = (ctx.args, rc.dev, rc.lock, rc.rank);
    let toks = lock.step(rank, "upload the tokens", || {
        let toks = all_tokens(ctx, batch, 0..args.prompt + args.steps, dev)?;
        dev.synchronize()?;
        Ok(toks)
    })?;
    let (prompt, timed) = toks.split_at(args.prompt);
    let logits = lock.step(rank, "prompt", || {
        let mut logits = None;
        let mut pacer = Pacer::new(dev, args.max_ahead)?;
        for (pos, t) in prompt.iter().enumerate() {
            logits = Some(model.step(t, pos, comm, mode)?);
            pacer.step_done()?;
        }
        let logits = logits.ok_or("--prompt must be at least 1")?;
        wait(dev, comm)?;
        Ok(logits.flatten_all()?.to_vec1::<f32>()?)
    })?;
    let step_us = lock.step(rank, "timed steps", || {
        let start = Instant::now();
        let mut pacer = Pacer::new(dev, args.max_ahead)?;
        for (i, t) in timed.iter().enumerate() {
            model.step(t, args.prompt + i, comm, mode)?;
            pacer.step_done()?;
        }
        wait(dev, comm)?;
        Ok(start.elapsed().as_secs_f64() * 1e6 / args.steps.max(1) as f64)
    })?;
    Ok((logits, step_us))
}

/// The fused step at position `args.prompt` captured in a CUDA graph on this rank's stream,
/// replayed `args.steps` times. Returns the time per replay, the logits of the first replay
/// and those of the same step run eagerly (the warm-up), which must agree.
fn run_graph(
    model: &Model,
    rc: &RankCtx,
    comm: &SymmComm,
    batch: usize,
    ctx: &Ctx,
) -> Res<(f64, Vec<f32>, Vec<f32>)> {
    use symm_allreduce::cudarc::driver::sys;
    let (args, dev, lock, rank) = (ctx.args, rc.dev, rc.lock, rc.rank);
    let stream = dev.as_cuda_device()?.cuda_stream();
    // Warm-up outside the capture: cuBLAS workspaces, candle's parameter caches (on for the
    // whole rank: rank_main), and the eager logits the replay must reproduce.
    let (t, eager) = lock.step(rank, "graph warm-up (eager)", || {
        let t = all_tokens(ctx, batch, args.prompt..args.prompt + 1, dev)?.remove(0);
        let logits = model.step(&t, args.prompt, Some(comm), Mode::Fused)?;
        wait(dev, Some(comm))?;
        let eager = logits.flatten_all()?.to_vec1::<f32>()?;
        Ok((t, eager))
    })?;
    let (graph, out) = lock.step(rank, "graph capture", || {
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let captured = model.step(&t, args.prompt, Some(comm), Mode::Fused);
        let graph = stream
            .end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        let out = captured?;
        let graph = graph?.ok_or("the capture recorded nothing")?;
        Ok((graph, out))
    })?;
    // `out` (the logits) was allocated inside the graph: its memory exists from the first
    // replay on (and each replay frees and remakes it: AUTO_FREE_ON_LAUNCH). It is kept until
    // after the last replay: freeing it before the first is an invalid free, which cudarc
    // records in the context and the next call (the launch) reports as
    // CUDA_ERROR_INVALID_VALUE.
    let replayed = lock.step(rank, "graph replay", || {
        graph.launch()?;
        wait(dev, Some(comm))?;
        Ok(out.flatten_all()?.to_vec1::<f32>()?)
    })?;
    let us = lock.step(rank, "graph timing", || {
        let start = Instant::now();
        let mut pacer = Pacer::new(dev, args.max_ahead)?;
        for _ in 0..args.steps {
            graph.launch()?;
            pacer.step_done()?;
        }
        wait(dev, Some(comm))?;
        Ok(start.elapsed().as_secs_f64() * 1e6 / args.steps.max(1) as f64)
    })?;
    // After the last replay: the logits' memory is live, and freed here, then the graph.
    drop(out);
    drop(graph);
    drop(t);
    Ok((us, replayed, eager))
}

/// One rank: its model, then every (batch, mode) in order, in lockstep with its peers.
fn rank_main(
    rc: &RankCtx,
    world: usize,
    comm: Option<SymmComm>,
    nccl: Option<SymmComm>,
    ctx: &Ctx,
) -> Res<Vec<Measured>> {
    let (args, dev, lock, rank) = (ctx.args, rc.dev, rc.lock, rc.rank);
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let max_len = args.prompt + args.steps + 1;
    // candle's cache of small host-to-device uploads (the dims and strides of strided ops)
    // for the whole rank, not only the graph capture: the compute-only step of each batch
    // fills it, so the steps with collectives copy nothing from the host.
    let _cache = dev.as_cuda_device()?.enable_cuda_graph_htod_cache();
    let model = lock.step(rank, "setup", || {
        // Ranks share the GPU: an allocation on this rank's stream must never wait for a
        // peer's stream, which may hold a collective that waits for this rank.
        symm_allreduce_candle::prepare_shared_gpu(dev)?;
        let model = Model::new(ctx, dev, (rank, world), max_batch, max_len)?;
        dev.synchronize()?;
        Ok(model)
    })?;
    let mut out = Vec::new();
    for &batch in &args.batches {
        // Compute only first: candle's upload cache is filled, and every kernel of this
        // batch's step (candle's, cuBLAS's) has run once, before any collective runs.
        let mut modes = vec![(Mode::ComputeOnly, None)];
        if let Some(c) = &comm {
            modes.push((Mode::Fused, Some(c)));
            modes.push((Mode::Unfused, Some(c)));
        }
        if let Some(n) = &nccl {
            modes.push((Mode::Nccl, Some(n)));
        }
        // Every rank has the same modes (the NCCL one is rank 0's of W = 1 only).
        for (mode, c) in modes {
            let (logits, step_us, error) = match run_mode(&model, rc, c, mode, batch, ctx) {
                Ok((l, us)) => (l, us, None),
                Err(e) => (Vec::new(), f64::NAN, Some(e.to_string())),
            };
            out.push(Measured {
                mode: mode.name(),
                batch,
                logits,
                reference: None,
                step_us,
                error,
            });
        }
        if let (true, Some(c)) = (args.graph, &comm) {
            let measured = match run_graph(&model, rc, c, batch, ctx) {
                Ok((us, replayed, eager)) => Measured {
                    mode: GRAPH,
                    batch,
                    logits: replayed,
                    reference: Some(eager),
                    step_us: us,
                    error: None,
                },
                Err(e) => Measured {
                    mode: GRAPH,
                    batch,
                    logits: Vec::new(),
                    reference: None,
                    step_us: f64::NAN,
                    error: Some(format!("CUDA graph capture/replay failed: {e}")),
                },
            };
            out.push(measured);
        }
    }
    Ok(out)
}

/// The graph row's mode name.
const GRAPH: &str = "symm fused (graph)";

/// `--diagnose`: what every rank runs on (the candle device, its cudarc context: the `Arc`
/// and the driver context it wraps, the stream, cudarc's event tracking) and the module
/// loading mode.
fn describe_ranks(devices: &[Device], comms: &[Option<SymmComm>]) -> Res<()> {
    for name in ["CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS"] {
        eprintln!(
            "{name}={}",
            std::env::var(name).unwrap_or_else(|_| "(unset)".into())
        );
    }
    for (rank, (dev, comm)) in devices.iter().zip(comms).enumerate() {
        let cuda = dev.as_cuda_device()?;
        let stream = cuda.cuda_stream();
        let c = stream.context();
        eprintln!(
            "rank {rank}: candle {:?}, GPU {}, CudaContext Arc {:p}, CUcontext {:p}, stream {:p}, \
             event tracking {}, multi-stream {}{}",
            cuda.id(),
            c.ordinal(),
            Arc::as_ptr(c),
            c.cu_ctx(),
            stream.cu_stream(),
            c.is_event_tracking(),
            c.is_in_multi_stream_mode(),
            comm.as_ref()
                .map(|c| format!(", communicator rank {} of {}", c.rank(), c.world_size()))
                .unwrap_or_default(),
        );
    }
    if let Some(Some(c)) = comms.first() {
        eprintln!("{}", c.communicator().describe());
    }
    Ok(())
}

/// `--diagnose --graph`: whether this driver refuses to free a graph's allocation before the
/// graph's first launch (what the graph row did before it kept its logits to the end: the
/// error is recorded by cudarc's drop and returned by the next call, the launch). Its own
/// device, one rank, nothing else running.
fn probe_early_free(ordinal: usize) -> Res<String> {
    use symm_allreduce::cudarc::driver::sys;
    let dev = Device::new_cuda_with_stream(ordinal)?;
    let cuda = dev.as_cuda_device()?;
    // SAFETY: one stream, nothing shared.
    unsafe { cuda.disable_event_tracking() };
    let stream = cuda.cuda_stream();
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let x = Tensor::zeros(1024, DType::F32, &dev);
    let graph =
        stream.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    let (x, graph) = (x?, graph?.ok_or("the probe's capture recorded nothing")?);
    drop(x); // a graph allocation, freed before the graph ever ran
    let free = stream.context().check_err();
    let launch = graph.launch().and_then(|()| stream.synchronize());
    Ok(format!(
        "freeing a graph allocation before the graph's first launch: {}; the launch after it: {}",
        free.map_or_else(|e| format!("{e:?}"), |()| "accepted".into()),
        launch.map_or_else(|e| format!("{e:?}"), |()| "ok".into()),
    ))
}

/// Runs `world` ranks (threads); returns every rank's measurements.
fn run_world(world: usize, ctx: &Ctx, with_comm: bool) -> Res<Vec<Vec<Measured>>> {
    let gpus = symm_allreduce::device_count()?.max(1);
    // A stream each (several ranks on one GPU need one each: SymmComm::local_group).
    let devices = (0..world)
        .map(|r| Device::new_cuda_with_stream(r % gpus))
        .collect::<Result<Vec<_>, _>>()?;
    for d in &devices {
        // SAFETY: every tensor of a rank is made and used on that rank's one stream, and
        // the communicator orders its own calls; cudarc's per-buffer events would only add
        // cross-stream waits, which a CUDA graph capture cannot contain (--graph).
        unsafe { d.as_cuda_device()?.disable_event_tracking() };
    }
    let comms: Vec<Option<SymmComm>> = if with_comm {
        let defaults = Config::default();
        let config = Config {
            timeout: std::time::Duration::from_secs(ctx.args.timeout),
            max_blocks_per_rank: ctx.args.max_blocks.unwrap_or(defaults.max_blocks_per_rank),
            ..defaults
        };
        SymmComm::local_group(&devices, config)?
            .into_iter()
            .map(Some)
            .collect()
    } else {
        vec![None; world]
    };
    if ctx.args.diagnose {
        describe_ranks(&devices, &comms)?;
    }
    // The NCCL fallback path: one rank per GPU only (NCCL refuses two ranks on one), so W = 1.
    let nccl = if world == 1 && with_comm {
        let ctx = devices[0].as_cuda_device()?.cuda_stream().context().clone();
        let hub = LocalHub::new(1, std::time::Duration::from_secs(60));
        let config = Config {
            algorithm: Algorithm::Nccl,
            ..Config::default()
        };
        match Communicator::with_nccl_fallback(&hub.rank(0), ctx, config) {
            Ok(c) => Some(SymmComm::new(c)),
            Err(e) => {
                eprintln!("nccl row skipped: {e}");
                None
            }
        }
    } else {
        None
    };
    let lock = Lockstep::new(world, ctx.args.diagnose);
    std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .zip(comms)
            .enumerate()
            .map(|(rank, (dev, comm))| {
                let lock = &lock;
                let nccl = if rank == 0 { nccl.clone() } else { None };
                s.spawn(move || rank_main(&RankCtx { rank, dev, lock }, world, comm, nccl, ctx))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| "a rank thread panicked")?)
            .collect()
    })
}

fn main() -> std::process::ExitCode {
    // The ranks are threads on one GPU, whose kernels wait for each other on the device; two
    // settings keep one rank's work from queueing behind a peer's waiting collective
    // (docs/bench/README.md, "Virtual ranks"), each kept when set explicitly:
    // - CUDA_MODULE_LOADING=EAGER: with lazy loading (the driver's default) a rank's first
    //   launch of a kernel not loaded yet (candle's, or the cuBLAS kernel picked for a new
    //   shape) may wait for the context's running kernels;
    // - CUDA_DEVICE_MAX_CONNECTIONS=32: the driver spreads streams over this many hardware
    //   queues (8 by default); kernels of streams that share a queue start in the order they
    //   were queued, so a rank's kernel can wait behind a peer's collective that waits for it.
    for (name, value) in [
        ("CUDA_MODULE_LOADING", "EAGER"),
        ("CUDA_DEVICE_MAX_CONNECTIONS", "32"),
    ] {
        if std::env::var_os(name).is_none() {
            // Before any thread or CUDA call of this process: nothing reads the environment
            // concurrently.
            std::env::set_var(name, value);
        }
    }
    match run() {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("FAILED: a correctness check did not hold (see the table)");
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Res<bool> {
    let args = Args::parse();
    let mut cfg: ModelConfig = match &args.config {
        Some(p) => serde_json::from_str(&std::fs::read_to_string(p)?)?,
        None => serde_json::from_str(SHIPPED_CONFIG)?,
    };
    if let Some(l) = args.layers {
        cfg.num_hidden_layers = l;
    }
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        other => return Err(format!("--dtype {other}: expected bf16, f16 or f32").into()),
    };
    println!(
        "model: hidden {} x {} layers, {} heads / {} KV heads, MLP {}, vocab {}, {dtype:?}, seed {}; prompt {} + {} timed steps",
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        cfg.vocab_size,
        args.seed,
        args.prompt,
        args.steps
    );
    let tolerance = args.tolerance.unwrap_or(match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 1e-2,
        _ => 3e-2,
    });
    let ctx = Ctx {
        args: &args,
        cfg: &cfg,
        dtype,
    };
    if args.diagnose && args.graph {
        match probe_early_free(0) {
            Ok(line) => eprintln!("{line}"),
            Err(e) => eprintln!("the early-free probe failed: {e}"),
        }
    }
    // The reference: the unsplit model (W = 1), no communicator, plus the NCCL row.
    let reference = run_world(1, &ctx, true)?;
    let reference = &reference[0];
    let ref_logits = |batch: usize| {
        reference
            .iter()
            .find(|m| m.batch == batch && m.mode == Mode::ComputeOnly.name())
            .map(|m| m.logits.clone())
            .unwrap_or_default()
    };
    let mut ok = true;
    println!(
        "\n{:>2} {:>5}  {:<22} {:>10} {:>10} {:>10}  {:>12}  ranks",
        "W", "batch", "mode", "step us", "tokens/s", "comm share", "vs W=1"
    );
    let mut report = |world: usize, measured: &[Vec<Measured>]| {
        for (i, m) in measured[0].iter().enumerate() {
            if let Some(e) = &m.error {
                println!("{world:>2} {:>5}  {:<22} {e}", m.batch, m.mode);
                ok = false;
                continue;
            }
            let compute = measured[0]
                .iter()
                .find(|c| c.batch == m.batch && c.mode == Mode::ComputeOnly.name())
                .map_or(f64::NAN, |c| c.step_us);
            let share = if m.mode == Mode::ComputeOnly.name() {
                "-".to_string()
            } else {
                format!("{:.1}%", 100.0 * (m.step_us - compute) / m.step_us)
            };
            let checked = !m.logits.is_empty() && (m.mode != Mode::ComputeOnly.name() || world == 1);
            let (vs, ranks) = if checked {
                // The graph row against its own eager step; the others against the unsplit model.
                let r = m.reference.clone().unwrap_or_else(|| ref_logits(m.batch));
                let scale = r.iter().fold(0f32, |a, x| a.max(x.abs()));
                let diff = r
                    .iter()
                    .zip(&m.logits)
                    .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
                let rel = diff / scale.max(f32::MIN_POSITIVE);
                let identical = measured.iter().all(|rank| {
                    rank[i].logits.len() == m.logits.len()
                        && rank[i]
                            .logits
                            .iter()
                            .zip(&m.logits)
                            .all(|(a, b)| a.to_bits() == b.to_bits())
                });
                if rel > tolerance || !rel.is_finite() || !identical || r.len() != m.logits.len() {
                    ok = false;
                }
                (
                    format!("{rel:.2e}{}", if rel <= tolerance { "" } else { " FAIL" }),
                    if identical { "identical" } else { "DIFFER" },
                )
            } else {
                ("-".to_string(), "-")
            };
            println!(
                "{world:>2} {:>5}  {:<22} {:>10.1} {:>10.0} {:>10}  {:>12}  {}",
                m.batch,
                m.mode,
                m.step_us,
                m.batch as f64 / (m.step_us * 1e-6),
                share,
                vs,
                ranks
            );
        }
    };
    report(1, std::slice::from_ref(reference));
    for &world in &args.worlds {
        if world == 1 {
            continue;
        }
        let measured = run_world(world, &ctx, true)?;
        report(world, &measured);
    }
    println!(
        "\ncomm share = (step − compute-only step) / step; vs W=1 = max |logit − W=1 logit| / max |W=1 logit| \
         after the prompt (tolerance {:e}; the graph row: against the same step run eagerly); ranks = every \
         rank's logits bit-identical",
        tolerance
    );
    Ok(ok)
}
