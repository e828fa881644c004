//! Fused all-reduce + residual + RMSNorm rows (`--tune`): the fused one-shot and two-shot
//! kernels at one hidden size over a grid of token counts, algo `fused_one_shot` /
//! `fused_two_shot`, `count` = tokens × hidden elements, `hidden` set. Every (tokens,
//! algorithm) is verified before it is timed: rank 0's residual and norm_out, bit for bit,
//! against the crate's unfused pair (`all_reduce`, then `residual_rmsnorm`) from the same
//! residual, which the fused call matches exactly by contract.

use indicatif::ProgressBar;
use symm_allreduce::cudarc::driver::CudaSlice;
use symm_allreduce::Algorithm;

use super::{measure_synced, measured_row, skip_unverified, Bench, BenchError};
use crate::args::RunPlan;
use crate::data::{random_input, seed, BenchElem};
use crate::report::Row;

/// The fused kernels `Auto` chooses between, with their row names.
pub const FUSED_ALGOS: [(Algorithm, &str); 2] = [
    (Algorithm::OneShot, "fused_one_shot"),
    (Algorithm::TwoShot, "fused_two_shot"),
];

const EPS: f32 = 1e-5;

/// One rank's buffers, `max_tokens × hidden` elements (the weight: `hidden`).
struct RankBuffers<T> {
    input: CudaSlice<T>,
    /// The residual every call starts from (replicated: the same on every rank).
    residual0: CudaSlice<T>,
    residual: CudaSlice<T>,
    weight: CudaSlice<T>,
    out: CudaSlice<T>,
}

impl Bench {
    /// Times the fused call with each of [`FUSED_ALGOS`] at every token count of `tokens`
    /// (rows of `hidden` elements) in every mode of `plan`. A row that fails verification is
    /// reported through `pb` and in `failures` and skipped; other errors end the run.
    pub(crate) fn fused_rows<T: BenchElem>(
        &mut self,
        plan: &RunPlan,
        hidden: usize,
        tokens: &[usize],
        rows: &mut Vec<Row>,
        failures: &mut Vec<String>,
        pb: &ProgressBar,
    ) -> Result<(), BenchError> {
        let dtype = T::DTYPE;
        let Some(most) = tokens.iter().max().map(|t| t * hidden) else {
            return Ok(());
        };
        let tag = seed(most * dtype.size(), dtype, 0) ^ 0xF05E_D000;
        let residual0 = random_input::<T>(most, tag);
        let weight = random_input::<T>(hidden, tag ^ 1);
        let mut bufs = Vec::with_capacity(self.world());
        for (r, s) in self.streams.iter().enumerate() {
            let input = random_input::<T>(most, seed(most * dtype.size(), dtype, r) ^ 0xF05E);
            bufs.push(RankBuffers {
                input: s.clone_htod(&input)?,
                residual0: s.clone_htod(&residual0)?,
                residual: s.alloc_zeros::<T>(most)?,
                weight: s.clone_htod(&weight)?,
                out: s.alloc_zeros::<T>(most)?,
            });
            // The uploads read the host vectors asynchronously: wait before they are dropped.
            s.synchronize()?;
        }
        // Rank 0's norm_out of the unfused reference (its all-reduce writes `out`).
        let mut reference_out = self.streams[0].alloc_zeros::<T>(most)?;
        for &t in tokens {
            let len = t * hidden;
            pb.set_message(format!("{dtype} fused {t}x{hidden}: reference"));
            let reference = self.fused_reference(&mut bufs, &mut reference_out, len, hidden)?;
            for (algorithm, name) in FUSED_ALGOS {
                pb.set_message(format!("{dtype} fused {t}x{hidden} {name}"));
                let result =
                    self.fused_algo_rows(plan, &mut bufs, &reference, (t, hidden), (algorithm, name), rows);
                skip_unverified(
                    result,
                    || format!("{dtype} fused {t}x{hidden} {name}"),
                    pb,
                    failures,
                )?;
            }
        }
        for s in &self.streams {
            s.synchronize()?;
        }
        Ok(())
    }

    /// Sets every rank's residual back to `residual0` (the first `len` elements).
    fn reset_residuals<T: BenchElem>(
        &self,
        bufs: &mut [RankBuffers<T>],
        len: usize,
    ) -> Result<(), BenchError> {
        for (b, s) in bufs.iter_mut().zip(&self.streams) {
            s.memcpy_dtod(&b.residual0.slice(..len), &mut b.residual.slice_mut(..len))?;
        }
        Ok(())
    }

    /// Rank 0's (residual, norm_out) from the unfused pair on the first `len` elements.
    fn fused_reference<T: BenchElem>(
        &self,
        bufs: &mut [RankBuffers<T>],
        reference_out: &mut CudaSlice<T>,
        len: usize,
        hidden: usize,
    ) -> Result<(Vec<T>, Vec<T>), BenchError> {
        let (comms, streams) = (&self.comms, &self.streams);
        self.reset_residuals(bufs, len)?;
        for ((c, s), b) in comms.iter().zip(streams).zip(bufs.iter_mut()) {
            c.all_reduce_with(
                &b.input.slice(..len),
                &mut b.out.slice_mut(..len),
                s,
                Algorithm::OneShot,
            )?;
        }
        let b = &mut bufs[0];
        comms[0].residual_rmsnorm(
            &b.out.slice(..len),
            &mut b.residual.slice_mut(..len),
            &b.weight.slice(..hidden),
            EPS,
            &mut reference_out.slice_mut(..len),
            &streams[0],
        )?;
        for (c, s) in comms.iter().zip(streams) {
            c.synchronize(s)?;
        }
        Ok((
            streams[0].clone_dtoh(&b.residual.slice(..len))?,
            streams[0].clone_dtoh(&reference_out.slice(..len))?,
        ))
    }

    /// Verifies, then times, the fused call of `tokens × hidden` elements with `algorithm`.
    fn fused_algo_rows<T: BenchElem>(
        &mut self,
        plan: &RunPlan,
        bufs: &mut [RankBuffers<T>],
        (residual_ref, out_ref): &(Vec<T>, Vec<T>),
        (tokens, hidden): (usize, usize),
        (algorithm, name): (Algorithm, &str),
        rows: &mut Vec<Row>,
    ) -> Result<(), BenchError> {
        let dtype = T::DTYPE;
        let len = tokens * hidden;
        let path = self.comms[0].add_rmsnorm_path(tokens, hidden, dtype, algorithm)?;
        let (comms, streams) = (&self.comms, &self.streams);
        self.reset_residuals(bufs, len)?;
        fused_round(comms, streams, bufs, (tokens, hidden), algorithm)?;
        for (c, s) in comms.iter().zip(streams) {
            c.synchronize(s)?;
        }
        let b = &bufs[0];
        check_bits(
            "residual",
            &streams[0].clone_dtoh(&b.residual.slice(..len))?,
            residual_ref,
        )?;
        check_bits("norm_out", &streams[0].clone_dtoh(&b.out.slice(..len))?, out_ref)?;

        // Timed rounds add to the residual again and again (it grows by the sum each call,
        // which costs the kernels nothing).
        for &mode in &plan.modes {
            let mut round = || fused_round(comms, streams, bufs, (tokens, hidden), algorithm);
            let m = measure_synced(&mut self.timer, comms, streams, plan, mode, &mut round)?;
            rows.push(
                Row {
                    dtype: dtype.name().into(),
                    mode,
                    algo: name.into(),
                    kernel: name.into(),
                    placement: self.placement.name().into(),
                    world: comms.len(),
                    blocks: path.plan.map(|p| p.blocks),
                    size_bytes: len * dtype.size(),
                    count: len,
                    hidden: Some(hidden),
                    ..measured_row(&m)
                }
                .with_derived(),
            );
        }
        Ok(())
    }
}

/// One fused call per rank on the first `tokens × hidden` elements.
fn fused_round<T: BenchElem>(
    comms: &[symm_allreduce::Communicator],
    streams: &[std::sync::Arc<symm_allreduce::cudarc::driver::CudaStream>],
    bufs: &mut [RankBuffers<T>],
    (tokens, hidden): (usize, usize),
    algorithm: Algorithm,
) -> Result<(), BenchError> {
    let len = tokens * hidden;
    for ((c, s), b) in comms.iter().zip(streams).zip(bufs.iter_mut()) {
        c.all_reduce_add_rmsnorm_with(
            &b.input.slice(..len),
            &mut b.residual.slice_mut(..len),
            &b.weight.slice(..hidden),
            EPS,
            &mut b.out.slice_mut(..len),
            s,
            algorithm,
        )?;
    }
    Ok(())
}

/// Bitwise equality of rank 0's `what` with the reference (exact widening to f64 keeps every
/// bit of the finite values).
fn check_bits<T: BenchElem>(what: &str, got: &[T], expected: &[T]) -> Result<(), BenchError> {
    match got
        .iter()
        .zip(expected)
        .position(|(g, e)| g.to_f64().to_bits() != e.to_f64().to_bits())
    {
        Some(i) => Err(BenchError::Verify(format!(
            "rank 0 {what} element {i} is {} but the unfused pair gives {}",
            got[i].to_f64(),
            expected[i].to_f64()
        ))),
        None if got.len() != expected.len() => Err(BenchError::Verify(format!(
            "rank 0 {what} has {} elements, the reference {}",
            got.len(),
            expected.len()
        ))),
        None => Ok(()),
    }
}
