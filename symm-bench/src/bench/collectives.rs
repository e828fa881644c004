//! All-gather and reduce-scatter rows (`--collectives`), nccl-tests style: the size is the
//! gathered output (all-gather) or the input (reduce-scatter), W·k elements for k per rank;
//! algbw = size / t and busbw = algbw·(W-1)/W for both; hbm counts each rank's distinct
//! traffic, (W+1)·size / t over all ranks (all-gather: read k, write W·k per rank;
//! reduce-scatter: read W·k, write k). Each size is timed with the algorithm `Auto` picks and,
//! where the other kernel takes the size too, with the low-latency / one-shot kernel forced
//! (rows `all_gather→low_latency` beside `all_gather→one_shot`), so the crossover shows.
//! Verified once per size and algorithm before timing: every all-gather element on rank 0, and
//! rank 0's reduce-scatter slice against the same slice of an all-reduce of the same inputs,
//! bit for bit.

use symm_allreduce::cudarc::driver::CudaSlice;
use symm_allreduce::Algorithm;

use super::{measure, measured_row, Bench, BenchError};
use crate::args::{CollectiveChoice, RunPlan};
use crate::data::{random_input, seed, BenchElem};
use crate::report::Row;

/// Sizes the collective rows run at.
pub const SIZES: std::ops::RangeInclusive<usize> = (8 << 10)..=(64 << 20);

impl Bench {
    /// Times `which` at `size` bytes (if in [`SIZES`]) in every mode of `plan`.
    pub(crate) fn collective_rows<T: BenchElem>(
        &mut self,
        plan: &RunPlan,
        which: CollectiveChoice,
        size: usize,
        rows: &mut Vec<Row>,
    ) -> Result<(), BenchError> {
        let world = self.world();
        let elem = T::DTYPE.size();
        let k = size / (world * elem);
        if !SIZES.contains(&size) || k == 0 {
            return Ok(());
        }
        let bytes = k * world * elem;
        let gather = which == CollectiveChoice::AllGather;
        let (in_len, out_len) = if gather { (k, k * world) } else { (k * world, k) };
        let mut inputs: Vec<CudaSlice<T>> = Vec::with_capacity(world);
        let mut hosts: Vec<Vec<T>> = Vec::with_capacity(world);
        let mut outputs: Vec<CudaSlice<T>> = Vec::with_capacity(world);
        for (r, s) in self.streams.iter().enumerate() {
            let host = random_input::<T>(in_len, seed(bytes, T::DTYPE, r) ^ 0xC011);
            inputs.push(s.clone_htod(&host)?);
            outputs.push(s.alloc_zeros::<T>(out_len)?);
            s.synchronize()?;
            hosts.push(host);
        }
        let path = |algo| {
            if gather {
                self.comms[0].all_gather_path(k * elem, algo)
            } else {
                self.comms[0].reduce_scatter_path(k, T::DTYPE, algo)
            }
        };
        let auto = path(Algorithm::Auto)?;
        // Auto's choice, and the other kernel where it takes this size too.
        let mut algos = vec![(Algorithm::Auto, auto.clone())];
        for other in [Algorithm::LowLatency, Algorithm::OneShot] {
            if auto.algorithm != other {
                if let Ok(p) = path(other) {
                    algos.push((other, p));
                }
            }
        }

        let (comms, streams) = (&self.comms, &self.streams);
        let expected: Vec<T> = if gather {
            hosts.concat()
        } else {
            let mut sums: Vec<CudaSlice<T>> = Vec::with_capacity(world);
            for r in 0..world {
                let mut out = streams[r].alloc_zeros::<T>(k * world)?;
                comms[r].all_reduce(&inputs[r], &mut out, &streams[r])?;
                sums.push(out);
            }
            for (c, s) in comms.iter().zip(streams) {
                c.synchronize(s)?;
            }
            let mut all = streams[0].clone_dtoh(&sums[0])?;
            all.truncate(k);
            all
        };
        let name = if gather { "all_gather" } else { "reduce_scatter" };
        for (algo, path) in algos {
            let inputs = &inputs;
            let run = |outputs: &mut [CudaSlice<T>]| -> Result<(), BenchError> {
                for (r, out) in outputs.iter_mut().enumerate() {
                    if gather {
                        comms[r].all_gather_with(&inputs[r], out, &streams[r], algo)?;
                    } else {
                        comms[r].reduce_scatter_with(&inputs[r], out, &streams[r], algo)?;
                    }
                }
                Ok(())
            };
            // Verify once.
            run(&mut outputs)?;
            for (c, s) in comms.iter().zip(streams) {
                c.synchronize(s)?;
            }
            let got: Vec<T> = streams[0].clone_dtoh(&outputs[0])?;
            // Exact widening to f64 keeps every bit of the (finite, random) values.
            let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<u64>>();
            let (g, e) = (bits(&got), bits(&expected));
            if let Some(i) = g.iter().zip(&e).position(|(a, b)| a != b) {
                return Err(BenchError::Verify(format!(
                    "{which:?} ({}): rank 0 element {i} is {} but {} ({})",
                    path.algorithm,
                    got[i].to_f64(),
                    expected[i].to_f64(),
                    if gather {
                        "the input"
                    } else {
                        "the all-reduce slice"
                    }
                )));
            }
            let mut real = || run(&mut outputs);
            for &mode in &plan.modes {
                let rounds = plan.rounds(mode);
                let m = measure(
                    &mut self.timer,
                    streams,
                    mode,
                    rounds,
                    plan.warmup(mode),
                    &mut real,
                )?;
                for (c, s) in comms.iter().zip(streams) {
                    c.synchronize(s)?;
                }
                let mut row = Row {
                    dtype: T::DTYPE.name().into(),
                    mode,
                    algo: name.into(),
                    kernel: path.algorithm.name().into(),
                    placement: self.placement.name().into(),
                    world,
                    blocks: path.plan.map(|p| p.blocks),
                    size_bytes: bytes,
                    count: k,
                    ..measured_row(&m)
                }
                .with_derived();
                row.busbw_gbs = row.algbw_gbs * (world as f64 - 1.0) / world as f64;
                row.hbm_gbs = (world as f64 + 1.0) * bytes as f64 / row.time_us / 1e3;
                rows.push(row);
            }
        }
        Ok(())
    }
}
