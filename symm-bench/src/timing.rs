//! CUDA-event timing of rounds over W streams, with a launch gate so that what is timed is
//! the GPU's work, not the host's enqueue rate.
//!
//! A round is whatever the caller enqueues on the W streams (one all-reduce per rank, one
//! graph launch per rank, ...). A sample brackets `rounds_per_sample` rounds with a fork
//! and a join:
//!
//! ```text
//! stream 0:  record(start) ─┬─ round ... round ─ wait(done_1..done_{W-1}) ─ record(end)
//! stream r:  wait(start) ───┴─ round ... round ─ record(done_r)
//! ```
//!
//! Before a chunk of samples is enqueued, stream 0 is held by a host function that blocks
//! until the whole chunk is in the queues (the "gate"); then the GPU runs the chunk back to
//! back. Without it, W virtual ranks enqueued from one thread would leave the GPU idle
//! between rounds and the events would measure the host.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use symm_allreduce::cudarc::driver::{result, sys, CudaEvent, CudaStream, DriverError};

/// Most rounds enqueued behind one closed gate (keeps the launch queues far from full: a
/// full queue would block the host while the gate holds the GPU).
const ROUNDS_PER_GATE: usize = 16;
/// A gate opens by itself after this long (then its samples include host time).
const GATE_TIMEOUT: Duration = Duration::from_secs(5);

static GATE_TIMEOUTS: AtomicUsize = AtomicUsize::new(0);

/// How many gates opened by timeout instead of by the host (should be 0).
pub fn gate_timeouts() -> usize {
    GATE_TIMEOUTS.load(Ordering::Relaxed)
}

/// Holds a stream until dropped.
struct Gate {
    _release: Sender<()>,
}

impl Gate {
    fn close(stream: &CudaStream) -> Result<Gate, DriverError> {
        let (release, wait) = mpsc::channel::<()>();
        let wait = Box::into_raw(Box::new(wait));
        stream.context().bind_to_thread()?;
        // SAFETY: the stream is live; `hold` takes ownership of the boxed receiver, makes no
        // CUDA call, and returns when the sender is dropped (or after GATE_TIMEOUT).
        let launched = unsafe { result::stream::launch_host_function(stream.cu_stream(), hold, wait.cast()) };
        if let Err(e) = launched {
            // SAFETY: the launch failed, so the callback never runs and the box is still ours.
            drop(unsafe { Box::from_raw(wait) });
            return Err(e);
        }
        Ok(Gate { _release: release })
    }
}

unsafe extern "C" fn hold(data: *mut c_void) {
    // SAFETY: `data` is the `Box<Receiver<()>>` leaked by `Gate::close`; the driver calls
    // this function exactly once.
    let wait = unsafe { Box::from_raw(data.cast::<Receiver<()>>()) };
    if let Err(RecvTimeoutError::Timeout) = wait.recv_timeout(GATE_TIMEOUT) {
        GATE_TIMEOUTS.fetch_add(1, Ordering::Relaxed);
    }
}

/// What one timed run gives.
#[derive(Debug, Clone, PartialEq)]
pub struct Timed {
    /// Per sample: GPU microseconds per round.
    pub round_us: Vec<f64>,
    /// Host microseconds spent inside the round closure, per round, averaged.
    pub host_us_per_round: f64,
}

/// Fork/join timing over a fixed set of streams (stream 0 carries the timing events).
pub struct Timer {
    streams: Vec<Arc<CudaStream>>,
    starts: Vec<CudaEvent>,
    ends: Vec<CudaEvent>,
    done: Vec<CudaEvent>,
}

impl Timer {
    /// Events for `streams` (each stream's own context).
    pub fn new(streams: &[Arc<CudaStream>]) -> Result<Timer, DriverError> {
        let ctx0 = streams[0].context();
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let starts = (0..ROUNDS_PER_GATE)
            .map(|_| ctx0.new_event(timing))
            .collect::<Result<Vec<_>, _>>()?;
        let ends = (0..ROUNDS_PER_GATE)
            .map(|_| ctx0.new_event(timing))
            .collect::<Result<Vec<_>, _>>()?;
        let done = streams[1..]
            .iter()
            .map(|s| s.context().new_event(None))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Timer {
            streams: streams.to_vec(),
            starts,
            ends,
            done,
        })
    }

    /// Times `samples` samples of `rounds_per_sample` rounds each. `round` enqueues one
    /// round on the streams; its errors stop the run (after the gate is opened).
    pub fn time<E: From<DriverError>>(
        &mut self,
        samples: usize,
        rounds_per_sample: usize,
        round: &mut dyn FnMut() -> Result<(), E>,
    ) -> Result<Timed, E> {
        let per_gate = (ROUNDS_PER_GATE / rounds_per_sample.max(1)).clamp(1, ROUNDS_PER_GATE);
        let mut round_us = Vec::with_capacity(samples);
        let mut host = Duration::ZERO;
        let mut left = samples;
        while left > 0 {
            let n = left.min(per_gate);
            let gate = Gate::close(&self.streams[0])?;
            let enqueued = self.enqueue(n, rounds_per_sample, round, &mut host);
            drop(gate);
            enqueued?;
            for i in 0..n {
                let ms = self.starts[i].elapsed_ms(&self.ends[i])?;
                round_us.push(f64::from(ms) * 1e3 / rounds_per_sample as f64);
            }
            left -= n;
        }
        let rounds = (samples * rounds_per_sample).max(1) as f64;
        Ok(Timed {
            round_us,
            host_us_per_round: host.as_secs_f64() * 1e6 / rounds,
        })
    }

    fn enqueue<E: From<DriverError>>(
        &self,
        samples: usize,
        rounds_per_sample: usize,
        round: &mut dyn FnMut() -> Result<(), E>,
        host: &mut Duration,
    ) -> Result<(), E> {
        let s0 = &self.streams[0];
        for i in 0..samples {
            self.starts[i].record(s0)?;
            for s in &self.streams[1..] {
                s.wait(&self.starts[i])?;
            }
            for _ in 0..rounds_per_sample {
                let t = Instant::now();
                round()?;
                *host += t.elapsed();
            }
            for (s, done) in self.streams[1..].iter().zip(&self.done) {
                done.record(s)?;
                s0.wait(done)?;
            }
            self.ends[i].record(s0)?;
        }
        Ok(())
    }
}

/// Median, 10th and 90th percentile (nearest rank) of a sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    /// 50th percentile.
    pub median: f64,
    /// 10th percentile.
    pub p10: f64,
    /// 90th percentile.
    pub p90: f64,
}

impl Stats {
    /// Of `samples` (`None` if empty).
    pub fn of(samples: &[f64]) -> Option<Stats> {
        if samples.is_empty() {
            return None;
        }
        let mut v = samples.to_vec();
        v.sort_by(f64::total_cmp);
        let pick = |q: f64| v[((q * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)];
        Some(Stats {
            median: pick(0.5),
            p10: pick(0.1),
            p90: pick(0.9),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        assert_eq!(Stats::of(&[]), None);
        let one = Stats::of(&[3.0]).unwrap();
        assert_eq!((one.median, one.p10, one.p90), (3.0, 3.0, 3.0));
        let v: Vec<f64> = (0..=100).rev().map(f64::from).collect();
        let s = Stats::of(&v).unwrap();
        assert_eq!((s.median, s.p10, s.p90), (50.0, 10.0, 90.0));
        let s = Stats::of(&[4.0, 1.0, 2.0, 3.0]).unwrap();
        assert_eq!(s.median, 3.0); // index round(1.5) = 2
        assert_eq!(s.p10, 1.0);
        assert_eq!(s.p90, 4.0);
    }
}
