//! One validation pass over a call's buffers, before it is routed. Nothing is launched unless
//! it passes, so bad input never leaves a half-written output.

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Everything [`validate_call`] looks at, as plain numbers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallShape {
    /// Element type.
    pub(crate) dtype: DType,
    /// Input length in elements.
    pub(crate) input_len: usize,
    /// Output length in elements.
    pub(crate) output_len: usize,
    /// Input device address.
    pub(crate) input_addr: u64,
    /// Output device address.
    pub(crate) output_addr: u64,
    /// Device of the input, output and stream.
    pub(crate) input_device: usize,
    /// Device of the output.
    pub(crate) output_device: usize,
    /// Device of the stream.
    pub(crate) stream_device: usize,
}

impl CallShape {
    /// One buffer of `len` elements at `addr` on `device`, used as input and output.
    pub(crate) fn in_place(
        dtype: DType,
        len: usize,
        addr: u64,
        device: usize,
        stream_device: usize,
    ) -> CallShape {
        CallShape {
            dtype,
            input_len: len,
            output_len: len,
            input_addr: addr,
            output_addr: addr,
            input_device: device,
            output_device: device,
            stream_device,
        }
    }
}

/// Checks one call against the communicator's device and capacity. Nothing is launched
/// unless this passes.
pub(crate) fn validate_call(shape: &CallShape, rank_device: usize, capacity_bytes: usize) -> Result<()> {
    validate_lengths(shape)?;
    let bytes = shape.input_len.saturating_mul(shape.dtype.size());
    if bytes > capacity_bytes {
        return Err(Error::ExceedsCapacity {
            bytes,
            capacity: capacity_bytes,
        });
    }
    validate_placement(shape, rank_device, true)
}

/// Non-empty, equal lengths.
pub(crate) fn validate_lengths(shape: &CallShape) -> Result<()> {
    if shape.input_len == 0 || shape.output_len == 0 {
        return Err(Error::Empty);
    }
    if shape.input_len != shape.output_len {
        return Err(Error::LengthMismatch {
            input: shape.input_len,
            output: shape.output_len,
        });
    }
    Ok(())
}

/// Devices, and alignment to the element size where the kernels run (NCCL needs none). Any
/// element offset works: the kernels load and store unaligned views element by element
/// (kernels/unaligned.cuh); only a raw address inside an element is refused.
pub(crate) fn validate_placement(shape: &CallShape, rank_device: usize, aligned: bool) -> Result<()> {
    for (which, found) in [
        ("stream", shape.stream_device),
        ("input", shape.input_device),
        ("output", shape.output_device),
    ] {
        if found != rank_device {
            return Err(Error::WrongDevice {
                which,
                expected: rank_device,
                found,
            });
        }
    }
    for (which, address) in [("input", shape.input_addr), ("output", shape.output_addr)] {
        if aligned && address % shape.dtype.size() as u64 != 0 {
            return Err(Error::Misaligned { which, address });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(len: usize) -> CallShape {
        CallShape {
            dtype: DType::BF16,
            input_len: len,
            output_len: len,
            input_addr: 0x1000,
            output_addr: 0x2000,
            input_device: 0,
            output_device: 0,
            stream_device: 0,
        }
    }

    #[test]
    fn bad_calls_are_rejected_with_the_right_error() {
        assert!(validate_call(&shape(100), 0, 1 << 20).is_ok());
        assert!(matches!(validate_call(&shape(0), 0, 1 << 20), Err(Error::Empty)));
        let mut s = shape(100);
        s.output_len = 99;
        assert!(matches!(
            validate_call(&s, 0, 1 << 20),
            Err(Error::LengthMismatch {
                input: 100,
                output: 99
            })
        ));
        assert!(matches!(
            validate_call(&shape(513), 0, 1024),
            Err(Error::ExceedsCapacity {
                bytes: 1026,
                capacity: 1024
            })
        ));
        assert!(validate_call(&shape(512), 0, 1024).is_ok());
        // Views at any element offset are fine; an address inside an element is not.
        for offset in [2u64, 6, 8, 14] {
            let mut s = shape(100);
            s.input_addr += offset;
            s.output_addr += offset + 2;
            assert!(validate_call(&s, 0, 1 << 20).is_ok(), "offset {offset}");
        }
        let mut s = shape(100);
        s.input_addr += 1;
        assert!(matches!(
            validate_call(&s, 0, 1 << 20),
            Err(Error::Misaligned { which: "input", .. })
        ));
        let mut s = shape(100);
        s.dtype = DType::F32;
        s.output_addr += 2;
        assert!(matches!(
            validate_call(&s, 0, 1 << 20),
            Err(Error::Misaligned { which: "output", .. })
        ));
        let mut s = shape(100);
        s.stream_device = 1;
        assert!(matches!(
            validate_call(&s, 0, 1 << 20),
            Err(Error::WrongDevice {
                which: "stream",
                expected: 0,
                found: 1
            })
        ));
        let mut s = shape(100);
        s.input_device = 3;
        assert!(matches!(
            validate_call(&s, 0, 1 << 20),
            Err(Error::WrongDevice { which: "input", .. })
        ));
        let mut s = shape(100);
        s.output_device = 2;
        assert!(matches!(
            validate_call(&s, 0, 1 << 20),
            Err(Error::WrongDevice { which: "output", .. })
        ));
    }
}
