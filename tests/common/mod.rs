//! Shared test helpers: GPU detection (skip, or fail under REQUIRE_GPU=1), random inputs,
//! and two independent host references.
#![allow(dead_code)]

pub mod harness;

use std::sync::Arc;

use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use symm_allreduce::cudarc::driver::{CudaContext, CudaStream};
use symm_allreduce::{Communicator, Config, DType, Element};

/// Device 0 with the kernels loaded, or `None` with a printed reason. Under REQUIRE_GPU=1 a
/// missing GPU or missing kernels is a test failure instead. (The test files run by
/// [`harness`] get their context from it instead; this is for rank processes and plain
/// `#[test]`s.)
pub fn gpu(test: &str) -> Option<Arc<CudaContext>> {
    match harness::gpu_context() {
        Ok(ctx) => Some(ctx),
        Err(reason) => {
            assert!(
                !harness::gpu_required(),
                "REQUIRE_GPU=1 but {test} cannot run: {reason}"
            );
            skip(test, &reason);
            None
        }
    }
}

/// Prints a skip line past the test harness's output capture, so it shows in every run.
pub fn skip(test: &str, reason: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIP {test}: {reason}");
}

/// A group's communicators and their streams.
pub type Group = (Vec<Communicator>, Vec<Arc<CudaStream>>);

/// `world` virtual ranks on `ctx`, each with its own stream.
pub fn group(
    ctx: &Arc<CudaContext>,
    world: usize,
    config: Config,
) -> (Vec<Communicator>, Vec<Arc<CudaStream>>) {
    let comms = Communicator::local_group(&vec![ctx.clone(); world], config).expect("local_group");
    let streams = (0..world).map(|_| ctx.new_stream().expect("stream")).collect();
    (comms, streams)
}

/// Waits for every rank (reporting a peer timeout as a panic) and downloads its buffer.
pub fn collect_outputs<T: TestElem>(
    comms: &[Communicator],
    streams: &[Arc<CudaStream>],
    buffers: &[symm_allreduce::cudarc::driver::CudaSlice<T>],
) -> Vec<Vec<T>> {
    comms
        .iter()
        .zip(streams)
        .zip(buffers)
        .map(|((c, s), b)| {
            c.synchronize(s).unwrap();
            s.clone_dtoh(b).unwrap()
        })
        .collect()
}

/// Element conversions for the references.
pub trait TestElem: Element + Copy + PartialEq + std::fmt::Debug {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    fn bits(self) -> u32;
    fn is_nan(self) -> bool {
        self.to_f32().is_nan()
    }
    /// Relative error of one rounding to this type.
    const ROUNDING: f64;
    /// Smallest spacing near zero (subnormals).
    const TINY: f64;
}

impl TestElem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
    const ROUNDING: f64 = 1.0 / (1u64 << 24) as f64;
    const TINY: f64 = 1e-44;
}

impl TestElem for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
    const ROUNDING: f64 = 1.0 / (1u64 << 11) as f64;
    const TINY: f64 = 6.0e-8;
}

impl TestElem for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
    const ROUNDING: f64 = 1.0 / (1u64 << 8) as f64;
    const TINY: f64 = 1e-38;
}

/// Random values in ±[0.001, 2): never zero, mixed signs, varied exponents.
pub fn random_input<T: TestElem>(rng: &mut StdRng, len: usize) -> Vec<T> {
    (0..len)
        .map(|_| {
            let mag: f32 = rng.random_range(0.001f32..2.0);
            let v = if rng.random::<bool>() { mag } else { -mag };
            T::from_f32(v)
        })
        .collect()
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// The exact arithmetic the kernels promise: fp32 sum in rank order 0..W-1, one rounding.
pub fn emulate<T: TestElem>(inputs: &[Vec<T>]) -> Vec<T> {
    let len = inputs[0].len();
    (0..len)
        .map(|i| {
            let mut acc = inputs[0][i].to_f32();
            for input in &inputs[1..] {
                acc += input[i].to_f32();
            }
            T::from_f32(acc)
        })
        .collect()
}

/// Independent reference: the exact sum in f64, with a dtype-aware bound on the error of
/// fp32 accumulation plus the final rounding.
pub fn check_against_f64<T: TestElem>(inputs: &[Vec<T>], out: &[T]) -> Result<(), String> {
    let w = inputs.len() as f64;
    for (i, &got) in out.iter().enumerate() {
        let mut sum = 0.0f64;
        let mut abs = 0.0f64;
        for input in inputs {
            let x = input[i].to_f32() as f64;
            sum += x;
            abs += x.abs();
        }
        let tol = w * abs / (1u64 << 24) as f64 + T::ROUNDING * sum.abs() * 1.0001 + T::TINY;
        let g = got.to_f32() as f64;
        let within = (g - sum).abs() <= tol; // false for NaN too
        if !within {
            return Err(format!(
                "element {i}: got {g}, f64 reference {sum}, tolerance {tol}"
            ));
        }
    }
    Ok(())
}

/// Bitwise equality (NaN == NaN), with the first difference in the message.
pub fn check_bits<T: TestElem>(what: &str, expected: &[T], got: &[T]) -> Result<(), String> {
    if expected.len() != got.len() {
        return Err(format!("{what}: length {} vs {}", expected.len(), got.len()));
    }
    for (i, (e, g)) in expected.iter().zip(got).enumerate() {
        let same = e.bits() == g.bits() || (e.is_nan() && g.is_nan());
        if !same {
            return Err(format!("{what}: element {i} expected {e:?} got {g:?}"));
        }
    }
    Ok(())
}

pub fn dtype_name<T: Element>() -> &'static str {
    T::DTYPE.name()
}

pub fn all_dtypes() -> [DType; 3] {
    DType::ALL
}

/// Whether a GPU and the kernels are there, without creating a CUDA context in this process
/// (for a parent that only starts rank processes). Skips with a printed reason, or fails
/// under REQUIRE_GPU=1, exactly like [`gpu`].
pub fn gpu_available(test: &str) -> bool {
    let Some(reason) = harness::gpu_missing() else {
        return true;
    };
    assert!(
        !harness::gpu_required(),
        "REQUIRE_GPU=1 but {test} cannot run: {reason}"
    );
    skip(test, &reason);
    false
}

/// Open file descriptors of this process.
pub fn open_fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}
