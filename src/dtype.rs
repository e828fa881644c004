//! Element types the kernels reduce.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

/// The element type of an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// `f32`, accumulated in f32.
    F32,
    /// `half::f16`, accumulated in f32.
    F16,
    /// `half::bf16`, accumulated in f32.
    BF16,
}

impl DType {
    /// Every supported type.
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Elements per 16-byte pack, the kernels' unit of work.
    pub const fn per_pack(self) -> usize {
        16 / self.size()
    }

    /// Lower-case name, as in kernel names (`symm_one_shot_bf16`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    pub(crate) const fn index(self) -> usize {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown dtype {s:?}: expected f32, f16 or bf16"))
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A type the all-reduce kernels accept: `f32`, `half::f16`, `half::bf16`.
pub trait Element:
    sealed::Sealed + DeviceRepr + ValidAsZeroBits + bytemuck::Pod + Send + Sync + 'static
{
    /// Its [`DType`].
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::F32.size(), std::mem::size_of::<f32>());
        assert_eq!(DType::F16.size(), std::mem::size_of::<half::f16>());
        assert_eq!(DType::BF16.size(), std::mem::size_of::<half::bf16>());
        for d in DType::ALL {
            assert_eq!(d.per_pack() * d.size(), 16);
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(DType::ALL[d.index()], d);
        }
        assert!("f64".parse::<DType>().is_err());
    }
}
