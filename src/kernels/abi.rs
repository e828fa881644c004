//! The interface between the Rust side and the device code: the kernel argument block, the
//! constants both sides size their arrays by, and the error word the kernels write. Mirrors
//! `kernels/abi.cuh`; both sides check the layout (`static_assert` there, `const` asserts
//! and a test that reads the header here).

use std::time::Duration;

use cudarc::driver::DeviceRepr;

use crate::error::{BarrierPhase, Error};

/// Largest world a communicator supports (the kernels' peer arrays are this wide).
pub const MAX_RANKS: usize = 8;
/// Signal slots per phase: the most blocks one rank launches.
pub(crate) const MAX_BLOCKS: usize = 64;
/// Threads per block of every kernel.
pub(crate) const THREADS_PER_BLOCK: u32 = 512;

/// Error word: `kind | phase << 8 | peer << 16`; kind 1 is a peer timeout.
pub(crate) const ERROR_PEER_TIMEOUT: u32 = 1;
/// Error word kind 2: a zero-copy pool call whose pool tag differs between ranks.
pub(crate) const ERROR_POOL_MISMATCH: u32 = 2;
/// The last bytes of every rank's allocation: the pool tags, `[parity 2]` of u64.
pub(crate) const POOL_TAG_BYTES: usize = 256;

/// Kernel parameter block; mirrors `symm::SymmArgs` in kernels/abi.cuh.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SymmArgs {
    pub(crate) base: u64,
    pub(crate) stride: u64,
    pub(crate) signal_offset: u64,
    pub(crate) state_offset: u64,
    pub(crate) data_offset: u64,
    pub(crate) data_bytes: u64,
    pub(crate) ll_offset: u64,
    pub(crate) ll_slot_bytes: u64,
    pub(crate) error: u64,
    pub(crate) timeout_ns: u64,
    pub(crate) rank: u32,
    pub(crate) world: u32,
    /// Zero-copy pool calls: the digest every rank compares on the device (kernels/pool.cuh).
    pub(crate) pool_tag: u64,
}

// The device struct: ten u64, two u32, one u64, no padding: 96 bytes, 8-aligned.
const _: () = assert!(std::mem::size_of::<SymmArgs>() == 96);
const _: () = assert!(std::mem::align_of::<SymmArgs>() == 8);
const _: () = assert!(std::mem::offset_of!(SymmArgs, ll_offset) == 48);
const _: () = assert!(std::mem::offset_of!(SymmArgs, error) == 64);
const _: () = assert!(std::mem::offset_of!(SymmArgs, timeout_ns) == 72);
const _: () = assert!(std::mem::offset_of!(SymmArgs, rank) == 80);
const _: () = assert!(std::mem::offset_of!(SymmArgs, world) == 84);
const _: () = assert!(std::mem::offset_of!(SymmArgs, pool_tag) == 88);

// SAFETY: SymmArgs is a #[repr(C)] struct of plain integers with the same layout as the
// device-side struct (asserted above and in kernels/abi.cuh).
unsafe impl DeviceRepr for SymmArgs {}

/// The error a kernel left in the error word (`code != 0`).
pub(crate) fn decode_error(code: u32, rank: usize, timeout: Duration) -> Error {
    if code & 0xff == ERROR_PEER_TIMEOUT {
        let phase = match (code >> 8) & 0xff {
            0 => BarrierPhase::Start,
            1 => BarrierPhase::Middle,
            2 => BarrierPhase::End,
            3 => BarrierPhase::Arrival,
            p => BarrierPhase::Unknown(p),
        };
        Error::PeerTimeout {
            rank,
            peer: (code >> 16) as usize,
            phase,
            timeout,
        }
    } else if code & 0xff == ERROR_POOL_MISMATCH {
        Error::PoolMismatch {
            rank,
            peer: (code >> 16) as usize,
        }
    } else {
        Error::KernelFault { code }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_decode_to_peer_timeouts() {
        let t = Duration::from_millis(5);
        match decode_error(1 | (1 << 8) | (5 << 16), 2, t) {
            Error::PeerTimeout {
                rank: 2,
                peer: 5,
                phase: BarrierPhase::Middle,
                timeout,
            } => assert_eq!(timeout, t),
            e => panic!("unexpected {e:?}"),
        }
        assert!(matches!(
            decode_error(1 | (3 << 16), 0, t),
            Error::PeerTimeout {
                peer: 3,
                phase: BarrierPhase::Start,
                ..
            }
        ));
        assert!(matches!(
            decode_error(2 | (6 << 16), 1, t),
            Error::PoolMismatch { rank: 1, peer: 6 }
        ));
        assert!(matches!(
            decode_error(0x42, 0, t),
            Error::KernelFault { code: 0x42 }
        ));
    }

    /// `constexpr <type> NAME = <value>;` lines of the device header.
    fn device_constants(header: &str) -> Vec<(String, u64)> {
        header
            .lines()
            .filter_map(|l| {
                let l = l.trim().strip_prefix("constexpr ")?;
                let (lhs, rhs) = l.split_once('=')?;
                let name = lhs.split_whitespace().last()?.to_string();
                let value = rhs.trim().trim_end_matches(';').trim().trim_end_matches('u');
                Some((name, value.parse().ok()?))
            })
            .collect()
    }

    #[test]
    fn constants_match_the_device_header() {
        let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/abi.cuh"))
            .expect("kernels/abi.cuh");
        let header = header.as_str();
        let found = device_constants(header);
        let get = |name: &str| {
            found
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| *v)
                .unwrap_or_else(|| panic!("kernels/abi.cuh has no constexpr {name}"))
        };
        assert_eq!(get("MAX_RANKS"), MAX_RANKS as u64);
        assert_eq!(get("MAX_BLOCKS"), MAX_BLOCKS as u64);
        assert_eq!(get("THREADS"), THREADS_PER_BLOCK as u64);
        assert_eq!(get("ERROR_PEER_TIMEOUT"), ERROR_PEER_TIMEOUT as u64);
        assert_eq!(get("ERROR_POOL_MISMATCH"), ERROR_POOL_MISMATCH as u64);
        assert_eq!(get("POOL_TAG_BYTES"), POOL_TAG_BYTES as u64);
        assert!(
            header.contains("sizeof(SymmArgs) == 96"),
            "abi.cuh asserts the size"
        );
    }
}
