//! Inputs (random, non-zero, seeded) and the check of rank 0's output against an f64 sum.

use symm_allreduce::cudarc::driver::ValidAsZeroBits;
use symm_allreduce::cudarc::nccl::NcclType;
use symm_allreduce::{DType, Element};

/// Elements of rank 0's output that are compared (evenly spread, plus both ends).
const CHECKED: usize = 4096;

/// An element type the bench runs: the library's and NCCL's, with host conversions.
pub trait BenchElem: Element + symm_allreduce::Gatherable + NcclType + ValidAsZeroBits + Copy {
    /// Rounds an f32 to this type.
    fn from_f32(x: f32) -> Self;
    /// Exact widening.
    fn to_f64(self) -> f64;
    /// Tolerance relative to Σ|x|: two unit roundoffs of the type for bf16 and f16 (one
    /// final rounding; the f32 accumulation error is far smaller), sixteen for f32 (up to
    /// seven f32 additions).
    const REL_TOL: f64;
}

impl BenchElem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    const REL_TOL: f64 = 1.0 / (1u64 << 20) as f64;
}

impl BenchElem for half::bf16 {
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    const REL_TOL: f64 = 1.0 / 128.0;
}

impl BenchElem for half::f16 {
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    const REL_TOL: f64 = 1.0 / 1024.0;
}

/// The seed of one rank's input: a function of (size, dtype, rank) only.
pub fn seed(bytes: usize, dtype: DType, rank: usize) -> u64 {
    0x5eed_a11c_0000_0000 ^ ((bytes as u64) << 8) ^ ((dtype.size() as u64) << 4) ^ rank as u64
}

/// SplitMix64: a fast, well-mixed hash of a counter (the inputs are a function of
/// (seed, index), so large buffers fill at memory speed).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `len` pseudo-random values in ±[0.5, 1.5): never zero, so a missing peer contribution
/// shows.
pub fn random_input<T: BenchElem>(len: usize, seed: u64) -> Vec<T> {
    let base = splitmix64(seed);
    (0..len as u64).map(|i| random_value(base, i)).collect()
}

/// Element `i` of `random_input(_, seed)`, given `base = splitmix64(seed)`.
fn random_value<T: BenchElem>(base: u64, i: u64) -> T {
    let bits = splitmix64(base ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let magnitude = 0.5 + (bits >> 40) as f32 / (1u64 << 24) as f32;
    T::from_f32(if bits & 1 == 0 { magnitude } else { -magnitude })
}

/// The indices that are checked.
pub fn checked_indices(len: usize) -> Vec<usize> {
    if len <= CHECKED {
        return (0..len).collect();
    }
    let ends = 64.min(len / 2);
    let mut idx: Vec<usize> = (0..ends).chain(len - ends..len).collect();
    let middle = CHECKED - 2 * ends;
    idx.extend((0..middle).map(|i| ends + i * (len - 2 * ends) / middle));
    idx.sort_unstable();
    idx.dedup();
    idx
}

/// The expected value at each checked index: the f64 sum over ranks, and the sum of
/// magnitudes (the tolerance scale).
#[derive(Debug, Clone, Default)]
pub struct Expected {
    /// Checked indices.
    pub indices: Vec<usize>,
    /// Σ_r x_r\[i\].
    pub sum: Vec<f64>,
    /// Σ_r |x_r\[i\]|.
    pub abs_sum: Vec<f64>,
}

impl Expected {
    /// For a buffer of `len` elements.
    pub fn new(len: usize) -> Self {
        let indices = checked_indices(len);
        let n = indices.len();
        Expected {
            indices,
            sum: vec![0.0; n],
            abs_sum: vec![0.0; n],
        }
    }

    /// Adds one rank's input.
    pub fn add<T: BenchElem>(&mut self, input: &[T]) {
        for (k, &i) in self.indices.iter().enumerate() {
            let x = input[i].to_f64();
            self.sum[k] += x;
            self.abs_sum[k] += x.abs();
        }
    }

    /// Adds the input `random_input::<T>(_, seed)` of a rank in another process, computing
    /// only the checked elements.
    pub fn add_seeded<T: BenchElem>(&mut self, seed: u64) {
        let base = splitmix64(seed);
        for (k, &i) in self.indices.iter().enumerate() {
            let x = random_value::<T>(base, i as u64).to_f64();
            self.sum[k] += x;
            self.abs_sum[k] += x.abs();
        }
    }

    /// Compares an output; `Err` describes the first mismatch and how many there were.
    pub fn check<T: BenchElem>(&self, output: &[T]) -> Result<(), String> {
        let mut bad = 0usize;
        let mut first = None;
        for (k, &i) in self.indices.iter().enumerate() {
            let got = output[i].to_f64();
            let tol = T::REL_TOL * self.abs_sum[k];
            if !(got - self.sum[k]).abs().le(&tol) {
                bad += 1;
                first.get_or_insert((i, got, self.sum[k], tol));
            }
        }
        match first {
            None => Ok(()),
            Some((i, got, want, tol)) => Err(format!(
                "{bad} of {} checked elements wrong; first at index {i}: got {got}, expected {want} (±{tol:.3e})",
                self.indices.len()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_seeded_and_non_zero() {
        let a = random_input::<half::bf16>(1000, seed(2000, DType::BF16, 1));
        let b = random_input::<half::bf16>(1000, seed(2000, DType::BF16, 1));
        let c = random_input::<half::bf16>(1000, seed(2000, DType::BF16, 2));
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|x| (0.49..=1.51).contains(&x.to_f64().abs())));
        let negative = a.iter().filter(|x| x.to_f64() < 0.0).count();
        assert!((400..600).contains(&negative), "{negative} of 1000 negative");
        let f = random_input::<f32>(100_000, 7);
        let mean = f.iter().map(|x| f64::from(x.abs())).sum::<f64>() / f.len() as f64;
        assert!((mean - 1.0).abs() < 0.01, "mean magnitude {mean}");
        assert_ne!(seed(2000, DType::BF16, 0), seed(2000, DType::F32, 0));
    }

    #[test]
    fn seeded_expectation_matches_the_inputs() {
        let len = 100_000;
        let (mut from_inputs, mut from_seeds) = (Expected::new(len), Expected::new(len));
        for r in 0..3 {
            let s = seed(len * 2, DType::BF16, r);
            from_inputs.add(&random_input::<half::bf16>(len, s));
            from_seeds.add_seeded::<half::bf16>(s);
        }
        assert_eq!(from_inputs.sum, from_seeds.sum);
        assert_eq!(from_inputs.abs_sum, from_seeds.abs_sum);
    }

    #[test]
    fn checked_indices_cover_both_ends() {
        assert_eq!(checked_indices(5), vec![0, 1, 2, 3, 4]);
        let idx = checked_indices(1 << 20);
        assert!(idx.len() <= CHECKED && idx.len() > CHECKED - 10);
        assert_eq!(idx[0], 0);
        assert_eq!(*idx.last().unwrap(), (1 << 20) - 1);
        assert!(idx.windows(2).all(|w| w[0] < w[1]));
    }

    /// What the kernels do: f32 accumulation in rank order, one rounding.
    fn kernel_sum<T: BenchElem>(inputs: &[Vec<T>], ranks: usize, f: impl Fn(T) -> f32) -> Vec<T> {
        (0..inputs[0].len())
            .map(|i| T::from_f32(inputs[..ranks].iter().map(|x| f(x[i])).sum()))
            .collect()
    }

    fn check_dtype<T: BenchElem>(to_f32: impl Fn(T) -> f32 + Copy) {
        let world = 8;
        let len = 10_000;
        let inputs: Vec<Vec<T>> = (0..world)
            .map(|r| random_input(len, seed(len * 2, T::DTYPE, r)))
            .collect();
        let mut exp = Expected::new(len);
        for x in &inputs {
            exp.add(x);
        }
        exp.check(&kernel_sum(&inputs, world, to_f32)).unwrap();
        let err = exp.check(&kernel_sum(&inputs, world - 1, to_f32)).unwrap_err();
        assert!(err.contains("checked elements wrong"), "{err}");
        assert!(exp.check(&vec![T::from_f32(0.0); len]).is_err());
        assert!(exp.check(&vec![T::from_f32(f32::NAN); len]).is_err());
        // One element off by a little more than the tolerance is caught.
        let mut off = kernel_sum(&inputs, world, to_f32);
        off[len - 1] = T::from_f32(to_f32(off[len - 1]) + 0.25);
        assert!(exp.check(&off).unwrap_err().starts_with("1 of"));
    }

    #[test]
    fn check_accepts_rounding_and_rejects_missing_ranks() {
        check_dtype::<half::bf16>(half::bf16::to_f32);
        check_dtype::<half::f16>(half::f16::to_f32);
        check_dtype::<f32>(|x| x);
    }
}
