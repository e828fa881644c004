//! Element types the kernels reduce. The list in [`dtypes!`] is the one place a dtype is
//! named on the Rust side (the device side has its own one-line list in kernels/); NCCL's code
//! for each type comes from cudarc's [`NcclType`].

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::NcclType;

/// Defines [`DType`], its tables and the [`Element`] impls from one list:
/// `Variant, rust type, name, bytes, doc;`.
macro_rules! dtypes {
    ($($variant:ident, $ty:ty, $name:literal, $size:literal, $doc:literal;)*) => {
        /// The element type of an all-reduce.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum DType {
            $(#[doc = $doc] $variant,)*
        }

        impl DType {
            /// Every supported type, in kernel-table order.
            pub const ALL: [DType; DType::COUNT] = [$(DType::$variant),*];
            /// Number of supported types.
            pub const COUNT: usize = [$($name),*].len();

            /// Bytes per element.
            pub const fn size(self) -> usize {
                match self { $(DType::$variant => $size,)* }
            }

            /// Lower-case name, as in kernel names (`symm_one_shot_bf16`).
            pub const fn name(self) -> &'static str {
                match self { $(DType::$variant => $name,)* }
            }
        }

        mod sealed {
            pub trait Sealed {}
            $(impl Sealed for $ty {})*
        }

        $(impl Element for $ty {
            const DTYPE: DType = DType::$variant;
        })*
    };
}

dtypes! {
    F32, f32, "f32", 4, "`f32`, accumulated in f32.";
    F16, half::f16, "f16", 2, "`half::f16`, accumulated in f32.";
    BF16, half::bf16, "bf16", 2, "`half::bf16`, accumulated in f32.";
}

impl DType {
    /// Elements per 16-byte pack, the kernels' unit of work.
    pub const fn per_pack(self) -> usize {
        16 / self.size()
    }

    /// Its column in the kernel table.
    pub(crate) const fn index(self) -> usize {
        self as usize
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
        DType::ALL.into_iter().find(|d| d.name() == s).ok_or_else(|| {
            let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
            format!("unknown dtype {s:?}: expected one of {}", names.join(", "))
        })
    }
}

/// A type the all-reduce kernels accept: `f32`, `half::f16`, `half::bf16`.
pub trait Element:
    sealed::Sealed + DeviceRepr + ValidAsZeroBits + NcclType + bytemuck::Pod + Send + Sync + 'static
{
    /// Its [`DType`].
    const DTYPE: DType;
}

mod gather_sealed {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for i8 {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A type [`crate::Communicator::all_gather`] and `all_gather_v` move: they copy bytes, so
/// besides the three float types they take `u8` and `i8` buffers (packed fp8, fp4 or int8
/// data). Not a reduction type: [`Element`] (and [`DType`]) stay the types the sums take.
pub trait Gatherable:
    gather_sealed::Sealed + DeviceRepr + ValidAsZeroBits + bytemuck::Pod + Send + Sync + 'static
{
}

impl Gatherable for u8 {}
impl Gatherable for i8 {}
impl Gatherable for f32 {}
impl Gatherable for half::f16 {}
impl Gatherable for half::bf16 {}

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
        assert!("f64".parse::<DType>().unwrap_err().contains("bf16"));
    }
}
