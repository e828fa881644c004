//! Producer → all-reduce chain rows (`--producer-chain`). One round is, on every rank, the
//! producer kernel (`Communicator::__launch_producer`: a copy launched as an ordinary kernel,
//! standing for the GEMM that writes the all-reduce's input) copying the rank's input into a
//! staged buffer, then `all_reduce_with(staged, output, Auto)`; graph_amortised captures 10
//! such pairs a rank. The chain is timed on both groups of the run in turn: the one with PDL on
//! (`chain_pdl`: the all-reduce's launch may overlap the producer's tail) and the twin with
//! `Config::pdl` flipped (`chain_no_pdl`), everything else equal. `producer_only` times the
//! producer alone in the same structure, so the all-reduce's share of a chain row is what it
//! spends above that. Before timing, each group's chain is verified once: rank 0's output
//! against the sum of the inputs, and bit for bit against a plain all-reduce of the same inputs.

use std::sync::Arc;

use symm_allreduce::cudarc::driver::{CudaSlice, CudaStream};
use symm_allreduce::{Algorithm, Communicator};

use super::{measure_synced, measured_row, Bench, BenchError, Buffers};
use crate::args::RunPlan;
use crate::data::BenchElem;
use crate::report::{Row, CHAIN_NO_PDL, CHAIN_PDL, PRODUCER_ONLY};

/// One round of the chain on `comms`: per rank, the producer from `inputs` into `staged`,
/// then the all-reduce of `staged` into `outputs` (`None`: the producer alone).
fn chain_round<T: BenchElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    inputs: &[CudaSlice<T>],
    staged: &mut [CudaSlice<T>],
    mut outputs: Option<&mut [CudaSlice<T>]>,
) -> Result<(), BenchError> {
    for (r, stage) in staged.iter_mut().enumerate() {
        comms[r].__launch_producer(&inputs[r], stage, &streams[r])?;
        if let Some(outputs) = outputs.as_deref_mut() {
            comms[r].all_reduce_with(stage, &mut outputs[r], &streams[r], Algorithm::Auto)?;
        }
    }
    Ok(())
}

/// The values as bits (the widening to f64 is exact for every dtype).
fn bits<T: BenchElem>(values: &[T]) -> Vec<u64> {
    values.iter().map(|x| x.to_f64().to_bits()).collect()
}

impl Bench {
    /// The chain rows at one size (`bytes`, `len` elements) in every mode of `plan`.
    pub(super) fn producer_rows<T: BenchElem>(
        &mut self,
        plan: &RunPlan,
        bytes: usize,
        len: usize,
        b: &mut Buffers<T>,
        rows: &mut Vec<Row>,
    ) -> Result<(), BenchError> {
        let dtype = T::DTYPE;
        let world = self.world();
        let kernel = self.comms[0].plan(len, dtype, Algorithm::Auto);
        let mut staged = Vec::with_capacity(world);
        for s in &self.streams {
            staged.push(s.alloc_zeros::<T>(len)?);
        }
        let (comms, twin, streams) = (&self.comms, &self.pdl_twin, &self.streams);
        let groups = if plan.pdl {
            [(comms, CHAIN_PDL), (twin, CHAIN_NO_PDL)]
        } else {
            [(twin, CHAIN_PDL), (comms, CHAIN_NO_PDL)]
        };

        // The reference: a plain all-reduce of the same inputs, checked against the sum.
        self.clear(b, world)?;
        for (r, out) in b.outputs.iter_mut().enumerate() {
            comms[r].all_reduce_with(&b.inputs[r], out, &streams[r], Algorithm::Auto)?;
        }
        for (c, s) in comms.iter().zip(streams) {
            c.synchronize(s)?;
        }
        let reference = streams[0].clone_dtoh(&b.outputs[0])?;
        b.all.check(&reference).map_err(BenchError::Verify)?;
        let reference = bits(&reference);
        for (group, name) in groups {
            for ((s, stage), out) in streams.iter().zip(&mut staged).zip(&mut b.outputs) {
                s.memset_zeros(stage)?;
                s.memset_zeros(out)?;
            }
            chain_round(group, streams, &b.inputs, &mut staged, Some(&mut b.outputs))?;
            for (c, s) in group.iter().zip(streams) {
                c.synchronize(s)?;
            }
            let got = bits(&streams[0].clone_dtoh(&b.outputs[0])?);
            if let Some(i) = got.iter().zip(&reference).position(|(g, e)| g != e) {
                return Err(BenchError::Verify(format!(
                    "{name}: element {i} differs from the plain all-reduce's"
                )));
            }
        }

        let (inputs, outputs) = (&b.inputs, &mut b.outputs);
        for &mode in &plan.modes {
            for (group, name, with_all_reduce) in [
                (groups[0].0, groups[0].1, true),
                (groups[1].0, groups[1].1, true),
                (comms, PRODUCER_ONLY, false),
            ] {
                let mut round = || {
                    let outputs = with_all_reduce.then_some(&mut outputs[..]);
                    chain_round(group, streams, inputs, &mut staged, outputs)
                };
                let m = measure_synced(&mut self.timer, group, streams, plan, mode, &mut round)?;
                rows.push(
                    Row {
                        dtype: dtype.name().into(),
                        mode,
                        algo: name.into(),
                        kernel: if with_all_reduce {
                            kernel.algorithm.name().into()
                        } else {
                            PRODUCER_ONLY.into()
                        },
                        placement: self.placement.name().into(),
                        world,
                        blocks: with_all_reduce.then_some(kernel.blocks),
                        size_bytes: bytes,
                        count: len,
                        ..measured_row(&m)
                    }
                    .with_derived(),
                );
            }
        }
        Ok(())
    }
}
