//! The GPU side: placement, communicators, buffers, verification and the timed rows.

mod collectives;
mod fused;
mod producer;

pub use fused::FUSED_ALGOS;

use std::sync::Arc;

use indicatif::ProgressBar;
use symm_allreduce::cudarc::driver::{sys, CudaContext, CudaGraph, CudaSlice, CudaStream, DriverError};
use symm_allreduce::cudarc::nccl::{group_end, group_start, ReduceOp};
use symm_allreduce::{Algorithm, Communicator, Config, DType, LocalHub};

use crate::args::{format_size, round_to_elements, AlgoChoice, CollectiveChoice, Mode, RunPlan};
use crate::data::{random_input, seed, BenchElem, Expected};
use crate::nccl::Baseline;
use crate::report::Row;
use crate::timing::{Stats, Timer};

const GIB: usize = 1 << 30;
/// Device memory left free beside the benchmark's own (driver, NCCL, graphs).
const HEADROOM: usize = GIB;

/// What went wrong in a row or in setup.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// From symm-allreduce.
    #[error(transparent)]
    Symm(#[from] symm_allreduce::Error),
    /// A cudarc driver call (the code by name: cudarc's `Display` is its `Debug` form).
    #[error("CUDA call failed: {:?}", .0.0)]
    Cuda(#[from] DriverError),
    /// An NCCL call.
    #[error("NCCL call {0} failed: {1}")]
    Nccl(&'static str, String),
    /// Stream capture gave no graph.
    #[error("stream capture produced no graph")]
    EmptyCapture,
    /// Rank 0's output is not the sum.
    #[error("{0}")]
    Verify(String),
    /// A timing run produced no sample.
    #[error("no timing samples")]
    NoSamples,
    /// A rank of another process sent something malformed or failed (`--launcher processes`).
    #[error("{0}")]
    Ranks(String),
}

/// Rows whose output failed verification are skipped: the failure is printed above the
/// progress bar and kept in `failures` (the run then exits non-zero); any other error is
/// returned. `what` names the rows.
pub(crate) fn skip_unverified(
    result: Result<(), BenchError>,
    what: impl FnOnce() -> String,
    pb: &ProgressBar,
    failures: &mut Vec<String>,
) -> Result<(), BenchError> {
    match result {
        Err(BenchError::Verify(why)) => {
            let msg = format!("{}: verification failed, skipped: {why}", what());
            pb.suspend(|| eprintln!("symm-bench: {msg}"));
            failures.push(msg);
            Ok(())
        }
        other => other,
    }
}

/// Where the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// W ranks on one device.
    Virtual { device: usize },
    /// Rank r on device r.
    PerGpu,
}

impl Placement {
    /// `virtual` or `per_gpu`, as in the results.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Virtual { .. } => "virtual",
            Placement::PerGpu => "per_gpu",
        }
    }
}

/// The communicators, streams and timers of one run.
pub struct Bench {
    // Field order is drop order: timing events, then the communicators (whose Drop
    // synchronises), then NCCL (leaked in `Drop`), then streams.
    timer: Timer,
    nccl_timer: Option<Timer>,
    comms: Vec<Communicator>,
    /// With `--producer-chain`: the same group again with `Config::pdl` flipped (empty
    /// otherwise).
    pdl_twin: Vec<Communicator>,
    nccl: Baseline,
    nccl_broken: Option<String>,
    /// The `nccl_symm` rows' communicators (dropped before the streams).
    windowed: Windowed,
    streams: Vec<Arc<CudaStream>>,
    ctxs: Vec<Arc<CudaContext>>,
    placement: Placement,
}

impl Drop for Bench {
    fn drop(&mut self) {
        if let Baseline::Ready { comms } = &mut self.nccl {
            // cudarc's Comm::drop panics when ncclCommAbort fails; the process is about to
            // exit and the driver reclaims the communicators, so they are leaked instead.
            std::mem::forget(std::mem::take(comms));
        }
    }
}

/// The communicators of the `nccl_symm` rows, one per NCCL rank (the GPUs of the run), made
/// by `with_nccl_fallback` so that their symmetric allocations are registered as NCCL
/// windows; or why there are none.
enum Windowed {
    Ready { comms: Vec<Communicator>, timer: Timer },
    Skipped(String),
}

impl Windowed {
    /// Communicators over `ctxs` whose pools hold an input and an output of `capacity` bytes.
    fn new(ctxs: &[Arc<CudaContext>], streams: &[Arc<CudaStream>], capacity: usize) -> Windowed {
        if let Err(e) = symm_allreduce::nccl_library() {
            return Windowed::Skipped(e.to_string());
        }
        let config = Config {
            // Every timed call is forced to NCCL: the kernels' workspace stays small.
            capacity_bytes: 64 << 10,
            pool_bytes: 2 * capacity + (1 << 20),
            nccl_windows: true,
            ..Config::default()
        };
        let hub = LocalHub::new(ctxs.len(), std::time::Duration::from_secs(120));
        // NCCL's setup is collective: one thread per rank.
        let made: Result<Vec<Communicator>, symm_allreduce::Error> = std::thread::scope(|s| {
            let handles: Vec<_> = ctxs
                .iter()
                .enumerate()
                .map(|(r, ctx)| {
                    let (hub, ctx, config) = (hub.rank(r), ctx.clone(), config.clone());
                    s.spawn(move || Communicator::with_nccl_fallback(&hub, ctx, config))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(symm_allreduce::Error::InvalidConfig(
                            "a setup thread panicked".into(),
                        ))
                    })
                })
                .collect()
        });
        let comms = match made {
            Ok(comms) => comms,
            Err(e) => return Windowed::Skipped(format!("with_nccl_fallback failed: {e}")),
        };
        if let Some(why) = comms[0].nccl_windows_unavailable() {
            return Windowed::Skipped(format!("NCCL windows off: {why}"));
        }
        match Timer::new(streams) {
            Ok(timer) => Windowed::Ready { comms, timer },
            Err(e) => Windowed::Skipped(format!("timer: {e}")),
        }
    }
}

/// The kernel column of a row of `algo` (`plan`: the buffer call's plan): `in_place` for the
/// zero-copy calls (`in_place_mm` on multimem), `in_place_` and the kernel's name for a pool
/// call that takes the low-latency kernel or the copy-in one-shot (in place all the same),
/// `two_shot_ll` for the two-shot over the low-latency lines, else the plan's algorithm.
pub(crate) fn kernel_label(
    comm: &Communicator,
    algo: AlgoChoice,
    plan: Algorithm,
    len: usize,
    dtype: DType,
) -> String {
    match algo {
        AlgoChoice::Multimem => "in_place_mm".into(),
        AlgoChoice::Symmetric => "in_place".into(),
        AlgoChoice::Pool => match comm.pool_path(len, dtype, false).map(|p| p.algorithm) {
            Ok(a @ (Algorithm::LowLatency | Algorithm::OneShot)) => format!("in_place_{}", a.name()),
            _ => "in_place".into(),
        },
        _ => match comm.path(len, dtype, plan).ok().and_then(|p| p.kernel) {
            Some(k @ "two_shot_ll") => k.into(),
            _ => plan.name().into(),
        },
    }
}

/// Contexts with cudarc's per-buffer event tracking off.
pub fn contexts(placement: Placement, world: usize) -> Result<Vec<Arc<CudaContext>>, symm_allreduce::Error> {
    let ctxs = match placement {
        Placement::Virtual { device } => vec![symm_allreduce::context(device)?; world],
        Placement::PerGpu => (0..world)
            .map(symm_allreduce::context)
            .collect::<Result<Vec<_>, _>>()?,
    };
    for ctx in &ctxs {
        // SAFETY: this runs before any stream or buffer exists. Afterwards every buffer is
        // used only on streams that the fork/join events (or a synchronize) order, and all
        // streams are synchronised before a buffer is read back or dropped.
        unsafe { ctx.disable_event_tracking() };
    }
    Ok(ctxs)
}

/// Free device memory on the least free device of `ctxs`.
pub fn free_memory(ctxs: &[Arc<CudaContext>]) -> Result<usize, DriverError> {
    let mut free = usize::MAX;
    for ctx in ctxs {
        ctx.bind_to_thread()?;
        free = free.min(ctx.mem_get_info()?.0);
    }
    Ok(free)
}

/// The largest message per rank that fits when each rank needs `capacities` capacity-sized
/// buffers (`RunPlan::capacities_per_rank`: 3·capacity of workspace — two data buffers and
/// the symmetric buffer; the signals and low-latency slots fit in the headroom — plus an input
/// and an output, and more with `--producer-chain`), and `ranks_per_device` ranks share a
/// device.
pub fn max_fitting_size(free: usize, ranks_per_device: usize, capacities: usize) -> usize {
    free.saturating_sub(HEADROOM) / (capacities.max(1) * ranks_per_device.max(1))
}

/// Median bandwidth of a 1 GiB device-to-device copy on `stream`, counting read and write
/// bytes, in GB/s.
pub fn d2d_copy_gbs(stream: &Arc<CudaStream>) -> Result<f64, BenchError> {
    let src = stream.alloc_zeros::<u8>(GIB)?;
    let mut dst = stream.alloc_zeros::<u8>(GIB)?;
    let mut timer = Timer::new(std::slice::from_ref(stream))?;
    let mut copy = || -> Result<(), BenchError> { Ok(stream.memcpy_dtod(&src, &mut dst)?) };
    timer.time(1, 1, &mut copy)?;
    let t = timer.time(10, 1, &mut copy)?;
    stream.synchronize()?;
    let us = Stats::of(&t.round_us).map_or(f64::NAN, |s| s.median);
    Ok(2.0 * GIB as f64 / us / 1e3)
}

/// Timings of one launch structure.
pub(crate) struct Measured {
    pub stats: Stats,
    pub samples: usize,
    pub host_us: f64,
}

/// The timing columns of a row: `m` for the collective, `e` for the empty kernel of the same
/// grid and launch structure.
fn timed_row(m: &Measured, e: &Measured) -> Row {
    Row {
        empty_us: Some(e.stats.median),
        empty_host_us: Some(e.host_us),
        ..measured_row(m)
    }
}

/// A row's timing columns from `m` (no empty-kernel floor beside it).
pub(crate) fn measured_row(m: &Measured) -> Row {
    Row {
        time_us: m.stats.median,
        p10_us: m.stats.p10,
        p90_us: m.stats.p90,
        samples: m.samples,
        host_us: m.host_us,
        ..Row::default()
    }
}

/// Times `round` in `mode` with the plan's rounds and warm-up, then waits for every rank.
fn measure_synced(
    timer: &mut Timer,
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    plan: &RunPlan,
    mode: Mode,
    round: &mut dyn FnMut() -> Result<(), BenchError>,
) -> Result<Measured, BenchError> {
    let m = measure(timer, streams, mode, plan.rounds(mode), plan.warmup(mode), round)?;
    for (c, s) in comms.iter().zip(streams) {
        c.synchronize(s)?;
    }
    Ok(m)
}

/// Times `round` in `mode`, then the empty kernel with the grid of a call of `len` elements
/// of `dtype` under `algorithm`, then waits for every rank.
#[allow(clippy::too_many_arguments)]
fn measure_beside_empty(
    timer: &mut Timer,
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    plan: &RunPlan,
    mode: Mode,
    (len, dtype, algorithm): (usize, DType, Algorithm),
    round: &mut dyn FnMut() -> Result<(), BenchError>,
) -> Result<(Measured, Measured), BenchError> {
    let rounds = plan.rounds(mode);
    let m = measure(timer, streams, mode, rounds, plan.warmup(mode), round)?;
    let mut empty = || -> Result<(), BenchError> {
        for (c, s) in comms.iter().zip(streams) {
            c.launch_empty(len, dtype, s, algorithm)?;
        }
        Ok(())
    };
    let e = measure(timer, streams, mode, rounds, plan.warmup(mode), &mut empty)?;
    for (c, s) in comms.iter().zip(streams) {
        c.synchronize(s)?;
    }
    Ok((m, e))
}

/// Captures `ops` calls of `round` (which enqueues on every stream) into one graph per
/// stream, all streams captured together.
fn capture(
    streams: &[Arc<CudaStream>],
    ops: usize,
    round: &mut dyn FnMut() -> Result<(), BenchError>,
) -> Result<Vec<CudaGraph>, BenchError> {
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    let mut error: Option<BenchError> = None;
    let mut begun = 0;
    for s in streams {
        match s.begin_capture(mode) {
            Ok(()) => begun += 1,
            Err(e) => {
                error = Some(e.into());
                break;
            }
        }
    }
    if error.is_none() {
        for _ in 0..ops {
            if let Err(e) = round() {
                error = Some(e);
                break;
            }
        }
    }
    let mut graphs = Vec::with_capacity(begun);
    for s in &streams[..begun] {
        // Every begun capture is ended, also after an error, so the stream is usable again.
        match s.end_capture(sys::CUgraphInstantiate_flags(0)) {
            Ok(Some(g)) => graphs.push(g),
            Ok(None) => {
                error.get_or_insert(BenchError::EmptyCapture);
            }
            Err(e) => {
                error.get_or_insert(e.into());
            }
        }
    }
    if let Some(e) = error {
        return Err(e);
    }
    for g in &graphs {
        g.upload()?;
    }
    Ok(graphs)
}

/// Times `round` (one all-reduce, or one empty kernel, per rank) in `mode`.
pub(crate) fn measure(
    timer: &mut Timer,
    streams: &[Arc<CudaStream>],
    mode: Mode,
    rounds: usize,
    warmup: usize,
    round: &mut dyn FnMut() -> Result<(), BenchError>,
) -> Result<Measured, BenchError> {
    let per_sample = mode.rounds_per_sample();
    let samples = rounds.div_ceil(per_sample);
    let timed = match mode {
        Mode::Eager => {
            timer.time(warmup.div_ceil(per_sample), per_sample, round)?;
            timer.time(samples, per_sample, round)?
        }
        Mode::GraphAmortised | Mode::GraphIsolated => {
            let graphs = capture(streams, mode.ops_per_round(), round)?;
            let mut launch = || -> Result<(), BenchError> {
                for g in &graphs {
                    g.launch()?;
                }
                Ok(())
            };
            timer.time(warmup, 1, &mut launch)?;
            let t = timer.time(samples, 1, &mut launch)?;
            for s in streams {
                s.synchronize()?;
            }
            t
        }
    };
    let ops = mode.ops_per_round() as f64;
    let per_op: Vec<f64> = timed.round_us.iter().map(|t| t / ops).collect();
    Ok(Measured {
        stats: Stats::of(&per_op).ok_or(BenchError::NoSamples)?,
        samples: per_op.len(),
        host_us: timed.host_us_per_round / streams.len() as f64,
    })
}

/// One size's buffers: inputs, outputs and the expected sums.
struct Buffers<T> {
    inputs: Vec<CudaSlice<T>>,
    outputs: Vec<CudaSlice<T>>,
    /// Sum over all ranks.
    all: Expected,
    /// Rank 0's input alone (NCCL with world 1).
    first: Expected,
}

impl Bench {
    /// Streams, communicators and the NCCL baseline over `ctxs`; with `pdl_twin`, a second
    /// group with `Config::pdl` flipped (the producer chain's other half).
    pub fn new(
        ctxs: Vec<Arc<CudaContext>>,
        placement: Placement,
        config: Config,
        (with_nccl, with_nccl_symm): (bool, bool),
        pdl_twin: bool,
    ) -> Result<Bench, BenchError> {
        let streams = ctxs
            .iter()
            .map(|c| c.new_stream())
            .collect::<Result<Vec<_>, _>>()?;
        let pdl_twin = if pdl_twin {
            let twin = Config {
                pdl: !config.pdl,
                ..config.clone()
            };
            Communicator::local_group(&ctxs, twin)?
        } else {
            Vec::new()
        };
        let capacity = config.capacity_bytes;
        let comms = Communicator::local_group(&ctxs, config)?;
        let timer = Timer::new(&streams)?;
        let nccl_streams = match placement {
            Placement::Virtual { .. } => vec![streams[0].clone()],
            Placement::PerGpu => streams.clone(),
        };
        let windowed = if with_nccl_symm {
            Windowed::new(&ctxs[..nccl_streams.len()], &nccl_streams, capacity)
        } else {
            Windowed::Skipped("not requested".into())
        };
        let (nccl, nccl_timer) = if with_nccl {
            (
                Baseline::new(nccl_streams.clone()),
                Some(Timer::new(&nccl_streams)?),
            )
        } else {
            (Baseline::Skipped("not requested".into()), None)
        };
        Ok(Bench {
            timer,
            nccl_timer,
            comms,
            pdl_twin,
            nccl,
            nccl_broken: None,
            windowed,
            streams,
            ctxs,
            placement,
        })
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.comms.len()
    }

    /// Names of the devices in use, rank order, without repeats.
    pub fn device_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        let mut seen = Vec::new();
        for ctx in &self.ctxs {
            if !seen.contains(&ctx.ordinal()) {
                seen.push(ctx.ordinal());
                let name = ctx.name().unwrap_or_else(|e| format!("unknown ({e})"));
                names.push(format!("{}: {name}", ctx.ordinal()));
            }
        }
        names
    }

    /// Whether NCCL rows run.
    pub fn nccl_ready(&self) -> bool {
        matches!(self.nccl, Baseline::Ready { .. }) && self.nccl_broken.is_none()
    }

    /// The NCCL line for the header.
    pub fn nccl_status(&self) -> String {
        match &self.nccl_broken {
            Some(why) => format!("{} — stopped after an error: {why}", self.nccl.describe()),
            None => self.nccl.describe(),
        }
    }

    /// Whether `nccl_symm` rows run.
    pub fn nccl_symm_ready(&self) -> bool {
        matches!(self.windowed, Windowed::Ready { .. })
    }

    /// The `nccl_symm` line for the header.
    pub fn nccl_symm_status(&self) -> String {
        match &self.windowed {
            Windowed::Ready { comms, .. } => format!(
                "NCCL on pool buffers registered as symmetric windows, world {} (with_nccl_fallback)",
                comms.len()
            ),
            Windowed::Skipped(why) => format!("nccl_symm skipped: {why}"),
        }
    }

    /// Median replay of one graph per rank holding one empty kernel with the grid of an
    /// 8 KiB bf16 one-shot: the W-rank graph replay floor. Returns (µs, blocks per rank).
    pub fn empty_graph_floor(&mut self) -> Result<(f64, u32), BenchError> {
        let len = 4096;
        let plan = self.comms[0].plan(len, DType::BF16, Algorithm::OneShot);
        let (comms, streams) = (&self.comms, &self.streams);
        let mut round = || -> Result<(), BenchError> {
            for (c, s) in comms.iter().zip(streams) {
                c.launch_empty(len, DType::BF16, s, Algorithm::OneShot)?;
            }
            Ok(())
        };
        let m = measure(&mut self.timer, streams, Mode::GraphIsolated, 200, 2, &mut round)?;
        Ok((m.stats.median, plan.blocks))
    }

    /// Runs every algorithm and mode at one size. Row-level problems (verification, NCCL)
    /// are reported through `pb` and in `failures`; other errors end the run.
    pub fn run_size<T: BenchElem>(
        &mut self,
        plan: &RunPlan,
        size: usize,
        rows: &mut Vec<Row>,
        failures: &mut Vec<String>,
        pb: &ProgressBar,
    ) -> Result<(), BenchError> {
        let algos: Vec<AlgoChoice> = plan
            .algos
            .iter()
            .copied()
            .filter(|&a| plan.runs(a, size, self.world()))
            .collect();
        self.run_algos::<T>(plan, size, &algos, rows, failures, pb)
    }

    /// [`Bench::run_size`] for the algorithms given (no size filter: `--tune` picks them).
    pub fn run_algos<T: BenchElem>(
        &mut self,
        plan: &RunPlan,
        size: usize,
        algos: &[AlgoChoice],
        rows: &mut Vec<Row>,
        failures: &mut Vec<String>,
        pb: &ProgressBar,
    ) -> Result<(), BenchError> {
        let dtype = T::DTYPE;
        let bytes = round_to_elements(size, dtype);
        let len = bytes / dtype.size();
        pb.set_message(format!("{dtype} {}: filling inputs", format_size(bytes)));
        let mut buffers = self.buffers::<T>(bytes, len)?;
        let all_reduce = plan.collectives.contains(&CollectiveChoice::AllReduce);
        for &algo in algos.iter().filter(|_| all_reduce) {
            pb.set_message(format!("{dtype} {} {}", format_size(bytes), algo.name()));
            let result = match algo.symm() {
                Some(a) => self.symm_rows(plan, a, algo, bytes, len, &mut buffers, rows),
                None if algo == AlgoChoice::NcclSymm => self.nccl_symm_rows(plan, bytes, len, &buffers, rows),
                None => self.nccl_rows(plan, bytes, len, &mut buffers, rows),
            };
            let what = || format!("{dtype} {bytes} B {}", algo.name());
            match skip_unverified(result, what, pb, failures) {
                Ok(()) => {}
                Err(e) if algo == AlgoChoice::NcclSymm => {
                    let msg = format!("{dtype} {bytes} B nccl_symm: {e}; nccl_symm rows stop here");
                    pb.suspend(|| eprintln!("symm-bench: {msg}"));
                    failures.push(msg);
                    self.windowed = Windowed::Skipped(format!("stopped after an error: {e}"));
                }
                Err(e) if algo == AlgoChoice::Nccl => {
                    let msg = format!("{dtype} {bytes} B nccl: {e}; NCCL rows stop here");
                    pb.suspend(|| eprintln!("symm-bench: {msg}"));
                    failures.push(msg);
                    self.nccl_broken = Some(e.to_string());
                }
                Err(e) => return Err(e),
            }
            pb.inc(1);
        }
        if plan.producer_chain {
            pb.set_message(format!("{dtype} {} producer chain", format_size(bytes)));
            let result = self.producer_rows(plan, bytes, len, &mut buffers, rows);
            skip_unverified(
                result,
                || format!("{dtype} {bytes} B producer chain"),
                pb,
                failures,
            )?;
            pb.inc(1);
        }
        self.sync_floor_rows(plan, dtype, bytes, len, rows)?;
        for &c in &plan.collectives {
            if c != CollectiveChoice::AllReduce {
                let result = self.collective_rows::<T>(plan, c, size, rows);
                skip_unverified(result, || format!("{dtype} {size} B {c:?}"), pb, failures)?;
            }
        }
        for s in &self.streams {
            s.synchronize()?;
        }
        Ok(())
    }

    fn buffers<T: BenchElem>(&self, bytes: usize, len: usize) -> Result<Buffers<T>, BenchError> {
        let mut all = Expected::new(len);
        let mut first = Expected::new(len);
        let mut inputs = Vec::with_capacity(self.world());
        let mut outputs = Vec::with_capacity(self.world());
        for (r, s) in self.streams.iter().enumerate() {
            let host = random_input::<T>(len, seed(bytes, T::DTYPE, r));
            all.add(&host);
            if r == 0 {
                first.add(&host);
            }
            inputs.push(s.clone_htod(&host)?);
            outputs.push(s.alloc_zeros::<T>(len)?);
            // The upload reads `host` asynchronously: wait before it is dropped.
            s.synchronize()?;
        }
        Ok(Buffers {
            inputs,
            outputs,
            all,
            first,
        })
    }

    /// Zeroes the outputs of the first `ranks` ranks.
    fn clear<T: BenchElem>(&self, b: &mut Buffers<T>, ranks: usize) -> Result<(), BenchError> {
        for (s, out) in self.streams.iter().zip(&mut b.outputs).take(ranks) {
            s.memset_zeros(out)?;
            s.synchronize()?;
        }
        Ok(())
    }

    /// The sync floor at one size (algo `sync_floor`): the one-shot grid doing nothing but
    /// the protocol's minimum — one all-to-all flag exchange per block, relaxed flag stores
    /// (it publishes no data) — beside the empty kernel of the same grid. No kernel that
    /// synchronises ranks can be faster; an all-reduce's own cost (its data, and a barrier
    /// kernel's release fence) is what it spends above this.
    fn sync_floor_rows(
        &mut self,
        plan: &RunPlan,
        dtype: DType,
        bytes: usize,
        len: usize,
        rows: &mut Vec<Row>,
    ) -> Result<(), BenchError> {
        let (comms, streams) = (&self.comms, &self.streams);
        let blocks = comms[0].plan(len, dtype, Algorithm::OneShot).blocks;
        for &mode in &plan.modes {
            let mut sync = || -> Result<(), BenchError> {
                for (c, s) in comms.iter().zip(streams) {
                    c.launch_sync_floor(len, dtype, s, Algorithm::OneShot)?;
                }
                Ok(())
            };
            let (m, e) = measure_beside_empty(
                &mut self.timer,
                comms,
                streams,
                plan,
                mode,
                (len, dtype, Algorithm::OneShot),
                &mut sync,
            )?;
            rows.push(
                Row {
                    dtype: dtype.name().into(),
                    mode,
                    algo: "sync_floor".into(),
                    kernel: "sync_floor".into(),
                    placement: self.placement.name().into(),
                    world: comms.len(),
                    blocks: Some(blocks),
                    size_bytes: bytes,
                    count: len,
                    ..timed_row(&m, &e)
                }
                .with_derived(),
            );
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn symm_rows<T: BenchElem>(
        &mut self,
        plan: &RunPlan,
        algorithm: Algorithm,
        algo: AlgoChoice,
        bytes: usize,
        len: usize,
        b: &mut Buffers<T>,
        rows: &mut Vec<Row>,
    ) -> Result<(), BenchError> {
        let dtype = T::DTYPE;
        let world = self.world();
        let symmetric = matches!(algo, AlgoChoice::Symmetric | AlgoChoice::Multimem);
        let pool = algo == AlgoChoice::Pool;
        let kernel = self.comms[0].plan(len, dtype, algorithm);
        // Pool rows: one pool buffer per rank, the input copied in once (untimed), as a
        // producer kernel would have written it.
        let mut pool_bufs = Vec::new();
        if pool {
            for (c, s) in self.comms.iter().zip(&self.streams) {
                pool_bufs.push(c.alloc_symmetric::<T>(len, s)?);
            }
        }
        let kernel_name = kernel_label(&self.comms[0], algo, kernel.algorithm, len, dtype);

        // Verify once: zeroed outputs, one call per rank, compare rank 0 with the sum.
        self.clear(b, world)?;
        for (r, out) in b.outputs.iter_mut().enumerate() {
            if symmetric {
                self.comms[r].copy_to_symmetric(&b.inputs[r], &self.streams[r])?;
            } else if pool {
                self.streams[r].memcpy_dtod(&b.inputs[r], &mut pool_bufs[r])?;
            } else {
                self.comms[r].all_reduce_with(&b.inputs[r], out, &self.streams[r], algorithm)?;
            }
        }
        if symmetric {
            for (c, s) in self.comms.iter().zip(&self.streams) {
                c.all_reduce_symmetric_with::<T>(len, s, algorithm)?;
            }
            for (r, out) in b.outputs.iter_mut().enumerate() {
                self.comms[r].copy_from_symmetric(out, &self.streams[r])?;
            }
        }
        if pool {
            for ((c, s), buf) in self.comms.iter().zip(&self.streams).zip(&mut pool_bufs) {
                c.all_reduce_pool(buf, s)?;
            }
            for (r, out) in b.outputs.iter_mut().enumerate() {
                self.streams[r].memcpy_dtod(&pool_bufs[r], out)?;
            }
        }
        for (c, s) in self.comms.iter().zip(&self.streams) {
            c.synchronize(s)?;
        }
        if plan.check {
            let got = self.streams[0].clone_dtoh(&b.outputs[0])?;
            b.all.check(&got).map_err(BenchError::Verify)?;
        }

        let (comms, streams) = (&self.comms, &self.streams);
        let (inputs, outputs) = (&b.inputs, &mut b.outputs);
        for &mode in &plan.modes {
            // Timed symmetric rounds reduce the buffer in place again and again: the values
            // grow (and may overflow to inf), which costs the kernels nothing.
            let mut real = || -> Result<(), BenchError> {
                for (r, out) in outputs.iter_mut().enumerate() {
                    if symmetric {
                        comms[r].all_reduce_symmetric_with::<T>(len, &streams[r], algorithm)?;
                    } else if pool {
                        comms[r].all_reduce_pool(&mut pool_bufs[r], &streams[r])?;
                    } else {
                        comms[r].all_reduce_with(&inputs[r], out, &streams[r], algorithm)?;
                    }
                }
                Ok(())
            };
            let (m, e) = measure_beside_empty(
                &mut self.timer,
                comms,
                streams,
                plan,
                mode,
                (len, dtype, algorithm),
                &mut real,
            )?;
            rows.push(
                Row {
                    dtype: dtype.name().into(),
                    mode,
                    algo: algo.name().into(),
                    kernel: kernel_name.clone(),
                    placement: self.placement.name().into(),
                    world,
                    blocks: Some(kernel.blocks),
                    size_bytes: bytes,
                    count: len,
                    ..timed_row(&m, &e)
                }
                .with_derived(),
            );
        }
        Ok(())
    }

    fn nccl_rows<T: BenchElem>(
        &mut self,
        plan: &RunPlan,
        bytes: usize,
        len: usize,
        b: &mut Buffers<T>,
        rows: &mut Vec<Row>,
    ) -> Result<(), BenchError> {
        let Some(mut timer) = self.nccl_timer.take() else {
            return Ok(());
        };
        let comms = match (&self.nccl, &self.nccl_broken) {
            (Baseline::Ready { comms }, None) => comms.as_slice(),
            _ => {
                self.nccl_timer = Some(timer);
                return Ok(());
            }
        };
        let n = comms.len();
        let result = (|| {
            self.clear(b, n)?;
            nccl_round(comms, &b.inputs, &mut b.outputs)?;
            for s in &self.streams[..n] {
                s.synchronize()?;
            }
            if plan.check {
                let got = self.streams[0].clone_dtoh(&b.outputs[0])?;
                let expected = if n == 1 { &b.first } else { &b.all };
                expected.check(&got).map_err(BenchError::Verify)?;
            }
            let (inputs, outputs) = (&b.inputs, &mut b.outputs);
            let mut round = || nccl_round(comms, inputs, outputs);
            for &mode in &plan.modes {
                let m = measure(
                    &mut timer,
                    &self.streams[..n],
                    mode,
                    plan.rounds(mode),
                    plan.warmup(mode),
                    &mut round,
                )?;
                rows.push(nccl_row(
                    T::DTYPE.name(),
                    "nccl",
                    mode,
                    self.placement.name(),
                    n,
                    bytes,
                    len,
                    &m,
                ));
            }
            Ok(())
        })();
        self.nccl_timer = Some(timer);
        result
    }
}

impl Bench {
    /// The `nccl_symm` rows: NCCL's all-reduce from a pool buffer into a pool buffer of the
    /// windowed communicators (through the crate's one NCCL call path, `Algorithm::Nccl`),
    /// one call per NCCL rank in one NCCL group, verified once, then timed like `nccl`.
    fn nccl_symm_rows<T: BenchElem>(
        &mut self,
        plan: &RunPlan,
        bytes: usize,
        len: usize,
        b: &Buffers<T>,
        rows: &mut Vec<Row>,
    ) -> Result<(), BenchError> {
        let Windowed::Ready { comms, timer } = &mut self.windowed else {
            return Ok(());
        };
        let n = comms.len();
        let streams = &self.streams[..n];
        let mut inputs = Vec::with_capacity(n);
        let mut outputs = Vec::with_capacity(n);
        for ((c, s), host_side) in comms.iter().zip(streams).zip(&b.inputs) {
            let mut input = c.alloc_symmetric::<T>(len, s)?;
            s.memcpy_dtod(host_side, &mut input)?;
            inputs.push(input);
            let mut output = c.alloc_symmetric::<T>(len, s)?;
            s.memset_zeros(&mut output)?;
            outputs.push(output);
        }
        nccl_symm_round(comms, streams, &inputs, &mut outputs)?;
        for (c, s) in comms.iter().zip(streams) {
            c.synchronize(s)?;
        }
        if plan.check {
            let got = streams[0].clone_dtoh(&outputs[0])?;
            let expected = if n == 1 { &b.first } else { &b.all };
            expected.check(&got).map_err(BenchError::Verify)?;
        }
        let mut round = || nccl_symm_round(comms, streams, &inputs, &mut outputs);
        for &mode in &plan.modes {
            let m = measure(
                timer,
                streams,
                mode,
                plan.rounds(mode),
                plan.warmup(mode),
                &mut round,
            )?;
            for (c, s) in comms.iter().zip(streams) {
                c.synchronize(s)?;
            }
            rows.push(nccl_row(
                T::DTYPE.name(),
                "nccl_symm",
                mode,
                self.placement.name(),
                n,
                bytes,
                len,
                &m,
            ));
        }
        Ok(())
    }
}

/// A measured row of an NCCL path (`nccl`, `nccl_symm`): no blocks of ours.
#[allow(clippy::too_many_arguments)]
fn nccl_row(
    dtype: &str,
    algo: &str,
    mode: Mode,
    placement: &str,
    world: usize,
    bytes: usize,
    len: usize,
    m: &Measured,
) -> Row {
    Row {
        dtype: dtype.into(),
        mode,
        algo: algo.into(),
        kernel: algo.into(),
        placement: placement.into(),
        world,
        blocks: None,
        size_bytes: bytes,
        count: len,
        ..measured_row(m)
    }
    .with_derived()
}

/// One NCCL all-reduce per windowed rank, pool buffer to pool buffer, in one NCCL group.
fn nccl_symm_round<T: BenchElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    inputs: &[symm_allreduce::SymmetricTensor<T>],
    outputs: &mut [symm_allreduce::SymmetricTensor<T>],
) -> Result<(), BenchError> {
    symm_allreduce::nccl_group(|| {
        for (((c, s), i), o) in comms.iter().zip(streams).zip(inputs).zip(outputs.iter_mut()) {
            c.all_reduce_with(i, o, s, Algorithm::Nccl)?;
        }
        Ok(())
    })?;
    Ok(())
}

/// One NCCL all-reduce per NCCL rank (grouped when there are several).
fn nccl_round<T: BenchElem>(
    comms: &[symm_allreduce::cudarc::nccl::Comm],
    inputs: &[CudaSlice<T>],
    outputs: &mut [CudaSlice<T>],
) -> Result<(), BenchError> {
    let nccl_err = |call: &'static str| {
        move |e: symm_allreduce::cudarc::nccl::result::NcclError| BenchError::Nccl(call, format!("{:?}", e.0))
    };
    if comms.len() == 1 {
        comms[0]
            .all_reduce(&inputs[0], &mut outputs[0], &ReduceOp::Sum)
            .map_err(nccl_err("ncclAllReduce"))?;
        return Ok(());
    }
    group_start().map_err(nccl_err("ncclGroupStart"))?;
    let mut result = Ok(());
    for ((c, i), o) in comms.iter().zip(inputs).zip(outputs.iter_mut()) {
        if let Err(e) = c.all_reduce(i, o, &ReduceOp::Sum) {
            result = Err(nccl_err("ncclAllReduce")(e));
            break;
        }
    }
    // The group is always closed, also after a failed call.
    let end = group_end().map_err(nccl_err("ncclGroupEnd"));
    result.and(end.map(|_| ()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_fit_in_free_memory() {
        // 141 GB free, 8 virtual ranks: (141 - 1) GiB / 40.
        let free = 141usize << 30;
        assert_eq!(max_fitting_size(free, 8, 5), (140usize << 30) / 40);
        assert!(max_fitting_size(free, 8, 5) >= 256 << 20);
        assert_eq!(max_fitting_size(free, 1, 5), (140usize << 30) / 5);
        assert_eq!(max_fitting_size(1 << 20, 8, 5), 0);
        // --producer-chain: the twin's workspace and the staged input, 9 a rank.
        assert_eq!(max_fitting_size(free, 8, 9), (140usize << 30) / 72);
    }
}
