//! The all-gather kernel's extra parameter and error code; mirrors kernels/all_gather.cuh
//! (a test reads the header's constants).

use std::time::Duration;

use cudarc::driver::DeviceRepr;

use super::abi::{decode_error, DivergenceRecord, MAX_RANKS};
use crate::error::Error;

/// Error word kind written when the counts of an all-gather differ across ranks.
pub(crate) const ERROR_COUNTS_MISMATCH: u32 = 3;
/// Bytes at the end of each parity data buffer that hold the counts slots (one 64-byte slot
/// per block): the all-gather's per-rank chunk must fit in front of them.
pub(crate) const COUNT_SLOTS_BYTES: usize = 4096;

/// Per-rank byte counts of an all-gather, passed by value as the kernel's fifth parameter
/// (copied at launch: a captured graph keeps them). Mirrors `symm::GatherCounts`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct GatherCounts {
    pub(crate) bytes: [u64; MAX_RANKS],
}

const _: () = assert!(std::mem::size_of::<GatherCounts>() == 64);
const _: () = assert!(COUNT_SLOTS_BYTES == super::abi::MAX_BLOCKS * std::mem::size_of::<GatherCounts>());

// SAFETY: a #[repr(C)] array of u64, the layout of the device struct (asserted on both sides).
unsafe impl DeviceRepr for GatherCounts {}

impl GatherCounts {
    /// From per-rank byte counts (at most [`MAX_RANKS`]; the rest stay zero).
    pub(crate) fn from_bytes(counts: impl IntoIterator<Item = usize>) -> GatherCounts {
        let mut c = GatherCounts::default();
        for (slot, n) in c.bytes.iter_mut().zip(counts) {
            *slot = n as u64;
        }
        c
    }
}

/// The error a kernel left in the error word, including the collectives' own code.
pub(crate) fn decode(code: u32, rank: usize, record: DivergenceRecord, timeout: Duration) -> Error {
    if code & 0xff == ERROR_COUNTS_MISMATCH {
        Error::CountsMismatch {
            rank,
            peer: (code >> 16) as usize,
        }
    } else {
        decode_error(code, record, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_mismatch_decodes_with_the_peer() {
        let t = Duration::from_millis(1);
        assert!(matches!(
            decode(3 | (5 << 16), 1, [0; 4], t),
            Error::CountsMismatch { rank: 1, peer: 5 }
        ));
        assert!(matches!(
            decode(1 | (2 << 16), 0, [0; 4], t),
            Error::PeerTimeout { peer: 2, .. }
        ));
        let c = GatherCounts::from_bytes([3usize, 17, 0]);
        assert_eq!(c.bytes[..4], [3, 17, 0, 0]);
    }

    #[test]
    fn constants_match_the_device_header() {
        let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/all_gather.cuh"))
            .expect("kernels/all_gather.cuh");
        let value = |name: &str| -> u64 {
            header
                .lines()
                .filter_map(|l| l.trim().strip_prefix("constexpr "))
                .find_map(|l| {
                    let (lhs, rhs) = l.split_once('=')?;
                    (lhs.split_whitespace().last()? == name)
                        .then(|| rhs.trim().trim_end_matches(';').trim().parse().ok())?
                })
                .unwrap_or_else(|| panic!("kernels/all_gather.cuh has no constexpr {name}"))
        };
        assert_eq!(value("ERROR_COUNTS_MISMATCH"), ERROR_COUNTS_MISMATCH as u64);
        assert_eq!(value("COUNT_SLOTS_BYTES"), COUNT_SLOTS_BYTES as u64);
        assert!(header.contains("sizeof(GatherCounts) == 64"));
    }
}
