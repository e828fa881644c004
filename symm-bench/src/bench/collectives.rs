//! All-gather and reduce-scatter rows (`--collectives`), nccl-tests style: the size is the
//! gathered output (all-gather) or the input (reduce-scatter), W·k elements for k per rank;
//! algbw = size / t and busbw = algbw·(W-1)/W for both; hbm counts each rank's distinct
//! traffic, (W+1)·size / t over all ranks (all-gather: read k, write W·k per rank;
//! reduce-scatter: read W·k, write k). Verified once per size before timing: every
//! all-gather element on rank 0, and rank 0's reduce-scatter slice against the same slice of an
//! all-reduce of the same inputs, bit for bit.

use symm_allreduce::cudarc::driver::CudaSlice;
use symm_allreduce::Algorithm;

use super::{measure, Bench, BenchError};
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
        let path = if gather {
            self.comms[0].all_gather_path(k * elem, Algorithm::Auto)?
        } else {
            self.comms[0].reduce_scatter_path(k, T::DTYPE, Algorithm::Auto)?
        };

        // Verify once.
        let (comms, streams) = (&self.comms, &self.streams);
        for r in 0..world {
            if gather {
                comms[r].all_gather(&inputs[r], &mut outputs[r], &streams[r])?;
            } else {
                comms[r].reduce_scatter(&inputs[r], &mut outputs[r], &streams[r])?;
            }
        }
        for (c, s) in comms.iter().zip(streams) {
            c.synchronize(s)?;
        }
        let got: Vec<T> = streams[0].clone_dtoh(&outputs[0])?;
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
        // Exact widening to f64 keeps every bit of the (finite, random) values.
        let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<u64>>();
        let (g, e) = (bits(&got), bits(&expected));
        if let Some(i) = g.iter().zip(&e).position(|(a, b)| a != b) {
            return Err(BenchError::Verify(format!(
                "{which:?}: rank 0 element {i} is {} but {} ({})",
                got[i].to_f64(),
                expected[i].to_f64(),
                if gather {
                    "the input"
                } else {
                    "the all-reduce slice"
                }
            )));
        }

        let name = if gather { "all_gather" } else { "reduce_scatter" };
        for &mode in &plan.modes {
            let rounds = plan.rounds(mode);
            let (inputs, outputs) = (&inputs, &mut outputs);
            let mut real = || -> Result<(), BenchError> {
                for (r, out) in outputs.iter_mut().enumerate() {
                    if gather {
                        comms[r].all_gather(&inputs[r], out, &streams[r])?;
                    } else {
                        comms[r].reduce_scatter(&inputs[r], out, &streams[r])?;
                    }
                }
                Ok(())
            };
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
                time_us: m.stats.median,
                p10_us: m.stats.p10,
                p90_us: m.stats.p90,
                samples: m.samples,
                host_us: m.host_us,
                ..Row::default()
            }
            .with_derived();
            row.busbw_gbs = row.algbw_gbs * (world as f64 - 1.0) / world as f64;
            row.hbm_gbs = (world as f64 + 1.0) * bytes as f64 / row.time_us / 1e3;
            rows.push(row);
        }
        Ok(())
    }
}
