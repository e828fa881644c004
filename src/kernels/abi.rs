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
/// 64-bit signal slots per 128-byte signal row (one row per phase and block).
pub(crate) const SLOTS_PER_ROW: usize = 16;
/// Barrier phases with signal rows (start, middle, end).
pub(crate) const SIGNAL_PHASES: usize = 3;
/// Rotating low-latency buffers.
pub(crate) const LL_BUFFERS: usize = 3;
/// Bytes of one block's entry of the call state (`BlockState`: completed calls, poison word);
/// the call state holds MAX_BLOCKS of them.
pub(crate) const BLOCK_STATE_BYTES: usize = 16;

/// Error word: `kind | phase << 8 | peer << 16 | origin << 24`; kind 1 is a peer timeout,
/// `origin` the rank whose wait timed out (the kernels push a timeout to every rank).
pub(crate) const ERROR_PEER_TIMEOUT: u32 = 1;
/// Error kind 2: the divergence check found another call on a peer; the error word is then
/// followed by [`DivergenceRecord`].
pub(crate) const ERROR_DIVERGED: u32 = 2;
/// Offset of the divergence check's slots in every rank's allocation.
pub(crate) const CHECK_OFFSET: usize = 64 << 10;
/// Bytes of the divergence check's slots: [parity 2][block][source rank] × 32 bytes.
pub(crate) const CHECK_BYTES: usize = 2 * MAX_BLOCKS * MAX_RANKS * 32;

/// What a kernel that found a divergence leaves after the error word: this rank's call and
/// the peer's, as (shape, length) pairs ([`check_shape`]). A peer whose epoch differed is
/// recorded with shape 0 and its epoch as the length.
pub(crate) type DivergenceRecord = [u64; 4];

/// The divergence check's description of a call: which kernel (or the sync floor, `None`),
/// which dtype; the length travels beside it.
pub(crate) fn check_shape(
    kernel: Option<crate::kernels::registry::Kernel>,
    dtype: crate::dtype::DType,
) -> u64 {
    let kernel = kernel.map_or(0xff, |k| k.index() as u64 + 1);
    kernel << 8 | (dtype.index() as u64 + 1) << 16 | 1
}

/// The divergence check's length of a fused call: tokens and hidden size, so that two shapes
/// with the same number of elements still differ.
pub(crate) fn fused_check_len(tokens: u32, hidden: u32) -> u64 {
    u64::from(tokens) << 32 | u64::from(hidden)
}

/// Bits of [`gather_check_len`] that hold the total byte count.
const GATHER_TOTAL_BITS: u32 = 48;

/// The divergence check's length of a one-shot all-gather: the total bytes of the per-rank
/// `counts` (low 48 bits) and a 16-bit digest of the counts themselves (high bits), so that
/// counts which split the same total differently differ too (beyond what 16 bits tell apart,
/// the kernel's own counts check still reports `CountsMismatch` before any peer data is read).
pub(crate) fn gather_check_len(counts: &[u64]) -> u64 {
    let total = counts.iter().sum::<u64>() & ((1 << GATHER_TOTAL_BITS) - 1);
    // FNV-1a over the counts' bytes, folded to 16 bits.
    let h = crate::digest::fnv1a(counts.iter().flat_map(|c| c.to_le_bytes()));
    let digest = (h ^ h >> 16 ^ h >> 32 ^ h >> 48) & 0xffff;
    digest << GATHER_TOTAL_BITS | total
}

/// Human form of a call announced to the divergence check.
pub(crate) fn describe_call(shape: u64, len: u64) -> String {
    use crate::dtype::DType;
    use crate::kernels::registry::{Kernel, KERNELS};
    if shape == 0 {
        return format!("call number {len} (another count of calls)");
    }
    let kernel = ((shape >> 8) & 0xff) as usize;
    let spec = kernel.checked_sub(1).and_then(|i| KERNELS.get(i));
    let name = match spec {
        _ if kernel == 0xff => "sync_floor",
        Some(s) => s.prefix,
        None => "an unknown kernel",
    };
    let dtype = (((shape >> 16) & 0xff) as usize)
        .checked_sub(1)
        .and_then(|i| DType::ALL.get(i))
        .map_or("an unknown dtype", |d| d.name());
    match spec.map(|s| s.kernel) {
        Some(Kernel::FusedOneShot | Kernel::FusedTwoShot | Kernel::FusedLowLatency) => {
            format!(
                "{name} of {} x {} {dtype} (tokens x hidden)",
                len >> 32,
                len & 0xffff_ffff
            )
        }
        Some(Kernel::AllGather) => format!(
            "{name} of {} bytes in all (counts digest {:#06x})",
            len & ((1 << GATHER_TOTAL_BITS) - 1),
            len >> GATHER_TOTAL_BITS
        ),
        Some(Kernel::AllGatherLowLatency) => format!("{name} of {len} bytes per rank"),
        _ => format!("{name} of {len} {dtype} elements"),
    }
}
/// Error word kind 4: a zero-copy pool call whose pool tag differs between ranks.
pub(crate) const ERROR_POOL_MISMATCH: u32 = 4;
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
    /// Divergence check: this call's [`check_shape`] (0: check off) and length.
    pub(crate) check_shape: u64,
    pub(crate) check_len: u64,
    /// Zero-copy pool calls: the digest every rank compares on the device (kernels/pool.cuh).
    pub(crate) pool_tag: u64,
    /// The multicast address of the bound allocations (0 without a multicast object); read
    /// only by the multimem kernels (kernels/multimem.cuh).
    pub(crate) mc_base: u64,
    /// The call's identity ([`call_ident`]), carried by every barrier flag beside the epoch: a
    /// rank that meets another call's reports `Diverged`.
    pub(crate) ident: u32,
    /// `FLAG_*` bits.
    pub(crate) flags: u32,
    /// The low-latency kernels' rotation of this call's lines in their slots, in bytes
    /// ([`ll_rotation`]); 0 for the other kernels, which do not read it.
    pub(crate) ll_rot: u64,
}

/// `SymmArgs::flags`: the kernel lets the next one launch (PDL) only at its exit.
pub(crate) const FLAG_PDL_AT_EXIT: u32 = 1;
/// `SymmArgs::flags` of the test consumer kernel: it waits for its predecessor first.
pub(crate) const FLAG_CONSUMER_WAITS: u32 = 2;
/// `SymmArgs::flags`: the kernel lets the next one launch (PDL) as soon as it has begun its
/// call, not after its first wait on the peers (`Config::early_trigger`, only where no other
/// rank shares this rank's device).
pub(crate) const FLAG_PDL_EARLY: u32 = 4;
/// Bits of a barrier flag that carry the call's identity (the epoch is above them; checked
/// against the device header).
#[cfg(test)]
pub(crate) const IDENT_BITS: u32 = 16;
/// Epochs stay below `2^EPOCH_BITS` (446 years at 20 000 calls a second).
pub(crate) const EPOCH_BITS: u32 = 48;
/// Error word kind 5: the call counter reached `2^EPOCH_BITS`.
pub(crate) const ERROR_EPOCHS_EXHAUSTED: u32 = 5;
/// A divergence record's shape word with this bit holds a call identity ([`call_ident`]) (a
/// barrier flag found it).
pub(crate) const RECORD_IDENT: u64 = 1 << 63;
/// The length digest of a call identity: `len mod 511` (lengths that differ by less than 511
/// always differ in it).
const IDENT_LEN_MOD: u64 = 511;

/// The identity a call's barrier flags carry: `kernel << 11 | dtype << 9
/// | len mod 511` (`kernel`: its table index + 1, 31 for the sync floor; `len` as the
/// divergence check announces it). Never 0, below 2^16. Two ranks whose calls differ in
/// kernel or dtype, or in a length by less than 511 (elements, bytes, or tokens × hidden),
/// always differ in it.
pub(crate) fn call_ident(
    kernel: Option<crate::kernels::registry::Kernel>,
    dtype: crate::dtype::DType,
    len: u64,
) -> u32 {
    let kernel = kernel.map_or(31, |k| k.index() as u32 + 1);
    kernel << 11 | (dtype.index() as u32) << 9 | (len % IDENT_LEN_MOD) as u32
}

/// Where a low-latency call's lines lie in their slots: byte `o` of a slot is stored at
/// `(o + rotation) mod slot_bytes` (`slot_bytes` a power of two; the rotation a multiple of 128
/// bytes, whole cache lines, so that a warp's 32 words or 8 lines are one cache line of the
/// slot, as they are unrotated: a 16-byte rotation made every warp's stores and polls span two,
/// +0.55 µs at 32 KiB on 8 virtual ranks). The low-latency kernels carry no identity in their
/// words (every bit is payload); the rotation stands in for it at no cost in traffic. In
/// 128-byte chunks, it is
///
/// `units + dtype term + kernel term  (mod slot chunks)`
///
/// with `units` the length the call's lines grow with (elements; bytes for the all-gather;
/// for the fused call, see below), a dtype term of 0, 1/8 and 1/4 of the ring (of chunks) for
/// bf16, f16 and f32 (growing with the element size), and a kernel term.
///
/// Why it separates calls: a reader polls its window of lines and completes only if every
/// line of it is written by its peer in the same call. A window of more lines than the
/// peer's is never covered; a window of the same or fewer lines is covered only if it lies
/// inside the peer's, which the rotation prevents. A slot holds eight times the largest
/// message (`symmetric::Layout`), so a window is at most 1/8 of the ring. For one kernel and
/// dtype, lengths that differ by `d` elements shift the windows by `d` chunks (`8d` lines)
/// while their sizes differ by at most `d / 4` lines (elements of at most 4 bytes), so the
/// smaller window begins `8d` lines before the larger one and is never inside it while `8d`
/// is at most 7/8 of the ring: `d` below `slot_bytes / 256` elements (1024 at the default
/// 32 KiB low-latency limit, at least 256). The same length in two dtypes of one size shifts
/// them by 1/8 of the ring; a wider dtype's larger window lies 1/8 or 1/4 of the ring after
/// the narrower one's, so the narrower begins before it. Both ranks then wait for a line that
/// never comes and time out together.
///
/// The fused call (`len` = `tokens << 32 | hidden`) runs the other way, in rows: its rotation
/// (in chunks) is `hidden − tokens · (row chunks + 1) − dtype term + kernel term`. A batch larger
/// by `d` tokens starts `d · (row chunks + 1)` chunks earlier and is at most `d · row chunks`
/// chunks longer, so the smaller batch's window ends past the larger one's (no wrap: a window
/// is at most 1/8 of the ring); the same shape in a wider dtype starts 1/8 or 1/4 of the ring
/// earlier still. Shapes of another hidden size are not separated by construction (no rank of
/// a model runs another hidden size); the divergence check covers them.
pub(crate) fn ll_rotation(
    kernel: crate::kernels::registry::Kernel,
    dtype: crate::dtype::DType,
    len: u64,
    slot_bytes: u64,
) -> u64 {
    use crate::dtype::DType;
    use crate::kernels::registry::Kernel;
    debug_assert!(slot_bytes.is_power_of_two() && slot_bytes >= LL_ROTATION_BYTES * 32);
    let ring = slot_bytes / LL_ROTATION_BYTES;
    let dtype_term = match dtype {
        DType::BF16 => 0,
        DType::F16 => ring / 8,
        DType::F32 => ring / 4,
    };
    let base = match kernel {
        // A token more moves the window back by more than its growth: the smaller batch's
        // window starts after the larger one's and ends past it. A wider dtype's larger
        // window starts 1/8 or 1/4 of the ring further back.
        Kernel::FusedLowLatency => {
            let (tokens, hidden) = (len >> 32, len & 0xffff_ffff);
            let row_chunks = (hidden * dtype.size() as u64).div_ceil(LL_ROTATION_BYTES);
            hidden
                .wrapping_sub(tokens.wrapping_mul(row_chunks + 1))
                .wrapping_sub(dtype_term)
        }
        _ => len.wrapping_add(dtype_term),
    };
    let kernel_term = (kernel.index() as u64).wrapping_mul(ring / 32 + 1);
    let chunks = base.wrapping_add(kernel_term) & (ring - 1);
    chunks * LL_ROTATION_BYTES
}

/// The low-latency rotation's unit: one cache line.
pub(crate) const LL_ROTATION_BYTES: u64 = 128;

/// Human form of a call identity (a peer's call, of which only the identity is known).
pub(crate) fn describe_ident(ident: u32, len: Option<u64>) -> String {
    use crate::dtype::DType;
    use crate::kernels::registry::KERNELS;
    let kernel = (ident >> 11) as usize;
    let name = match kernel {
        31 => "sync_floor",
        k => k
            .checked_sub(1)
            .and_then(|i| KERNELS.get(i))
            .map_or("an unknown kernel", |s| s.prefix),
    };
    let dtype = DType::ALL
        .get(((ident >> 9) & 3) as usize)
        .map_or("an unknown dtype", |d| d.name());
    match len {
        Some(len) => format!("{name} ({dtype}, length {len})"),
        None => format!("{name} ({dtype}, length = {} mod {IDENT_LEN_MOD})", ident & 0x1ff),
    }
}

// The device struct: ten u64, two u32, four u64, two u32, one u64, no padding: 136 bytes,
// 8-aligned.
const _: () = assert!(std::mem::size_of::<SymmArgs>() == 136);
const _: () = assert!(std::mem::align_of::<SymmArgs>() == 8);
const _: () = assert!(std::mem::offset_of!(SymmArgs, ll_offset) == 48);
const _: () = assert!(std::mem::offset_of!(SymmArgs, error) == 64);
const _: () = assert!(std::mem::offset_of!(SymmArgs, timeout_ns) == 72);
const _: () = assert!(std::mem::offset_of!(SymmArgs, rank) == 80);
const _: () = assert!(std::mem::offset_of!(SymmArgs, world) == 84);
const _: () = assert!(std::mem::offset_of!(SymmArgs, check_shape) == 88);
const _: () = assert!(std::mem::offset_of!(SymmArgs, check_len) == 96);
const _: () = assert!(std::mem::offset_of!(SymmArgs, pool_tag) == 104);
const _: () = assert!(std::mem::offset_of!(SymmArgs, mc_base) == 112);
const _: () = assert!(std::mem::offset_of!(SymmArgs, ident) == 120);
const _: () = assert!(std::mem::offset_of!(SymmArgs, flags) == 124);

// SAFETY: SymmArgs is a #[repr(C)] struct of plain integers with the same layout as the
// device-side struct (asserted above and in kernels/abi.cuh).
unsafe impl DeviceRepr for SymmArgs {}

/// The error a kernel left in the error word (`code != 0`). `rank` in the error is the rank
/// whose wait timed out, which is another rank's when that rank pushed its timeout here.
/// `record` is what follows the error word ([`DivergenceRecord`]); all zero when the rank that
/// found a divergence is another one (it pushed only the code here).
pub(crate) fn decode_error(code: u32, record: DivergenceRecord, timeout: Duration) -> Error {
    let rank = (code >> 24) as usize;
    let peer = ((code >> 16) & 0xff) as usize;
    match code & 0xff {
        ERROR_PEER_TIMEOUT => {
            let phase = match (code >> 8) & 0xff {
                0 => BarrierPhase::Start,
                1 => BarrierPhase::Middle,
                2 => BarrierPhase::End,
                3 => BarrierPhase::Arrival,
                4 => BarrierPhase::Check,
                p => BarrierPhase::Unknown(p),
            };
            Error::PeerTimeout {
                rank,
                peer,
                phase,
                timeout,
            }
        }
        ERROR_DIVERGED => {
            let [shape, len, peer_shape, peer_len] = record;
            let (this_call, peer_call) = if shape & RECORD_IDENT != 0 {
                (
                    describe_ident(shape as u32, Some(len)),
                    describe_ident(peer_shape as u32, None),
                )
            } else if shape == 0 {
                (
                    "its call".to_string(),
                    format!("another call (rank {rank} found it; see that rank's error)"),
                )
            } else {
                (describe_call(shape, len), describe_call(peer_shape, peer_len))
            };
            Error::Diverged {
                rank,
                peer,
                this_call,
                peer_call,
            }
        }
        ERROR_POOL_MISMATCH => Error::PoolMismatch { rank, peer },
        ERROR_EPOCHS_EXHAUSTED => Error::CallsExhausted {
            calls: (1u64 << EPOCH_BITS) - 1,
        },
        _ => Error::KernelFault { code },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    /// The 16-byte lines a low-latency all-reduce of `n` elements of `dtype` polls and writes,
    /// as (first line after rotation, count) in a ring of `ring` lines.
    fn window(kernel: crate::kernels::registry::Kernel, dtype: DType, n: u64, ring: u64) -> (u64, u64) {
        let lines = (n * dtype.size() as u64).div_ceil(16);
        (ll_rotation(kernel, dtype, n, ring * 16) / 16, lines)
    }

    /// Whether every line of `inner` is a line of `outer` (windows on a ring of `ring` lines).
    fn inside(inner: (u64, u64), outer: (u64, u64), ring: u64) -> bool {
        let start = (inner.0 + ring - outer.0) % ring;
        start + inner.1 <= outer.1
    }

    #[test]
    fn low_latency_calls_that_differ_poll_a_line_the_peer_never_writes() {
        use crate::kernels::registry::Kernel;
        let mut g = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |below: u64| {
            g ^= g << 13;
            g ^= g >> 7;
            g ^= g << 17;
            g % below
        };
        for ring in [4096u64, 16384, 1 << 16] {
            // The largest message fills 1/8 of the ring (symmetric::Layout); lengths differ
            // by fewer than ring / 16 elements (slot_bytes / 256).
            for kernel in [Kernel::LowLatency, Kernel::ReduceScatterLowLatency] {
                for a in DType::ALL {
                    let max = ring / 8 * 16 / a.size() as u64;
                    let mut pairs: Vec<(u64, u64)> = (1..300).map(|n| (n, n + 1)).collect();
                    pairs.extend((0..3000).map(|_| {
                        let n = 1 + next(max - 1);
                        let d = 1 + next(ring / 16 - 1);
                        (n, (n + d).min(max))
                    }));
                    for (n, m) in pairs.into_iter().filter(|(n, m)| n != m) {
                        let (small, large) = (window(kernel, a, n, ring), window(kernel, a, m, ring));
                        assert!(
                            !inside(small, large, ring) && !inside(large, small, ring),
                            "{kernel:?} {a:?}: {n} and {m} elements share lines on a ring of {ring}"
                        );
                    }
                    // The same length in another dtype.
                    for b in DType::ALL.into_iter().filter(|&b| b != a) {
                        for _ in 0..500 {
                            let n = 1 + next(max.min(ring / 8 * 16 / b.size() as u64) - 1);
                            let (x, y) = (window(kernel, a, n, ring), window(kernel, b, n, ring));
                            assert!(
                                !inside(x, y, ring) && !inside(y, x, ring),
                                "{kernel:?}: {n} elements of {a:?} and of {b:?} share lines on a ring of {ring}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_rotation_is_whole_cache_lines_inside_the_slot() {
        use crate::kernels::registry::Kernel;
        for kernel in [
            Kernel::LowLatency,
            Kernel::AllGatherLowLatency,
            Kernel::ReduceScatterLowLatency,
            Kernel::FusedLowLatency,
        ] {
            for dtype in DType::ALL {
                for len in [0u64, 1, 7, 4096, u64::MAX, 3 << 32 | 4096] {
                    let r = ll_rotation(kernel, dtype, len, 64 << 10);
                    assert!(r % 128 == 0 && r < 64 << 10, "{kernel:?} {dtype:?} {len}: {r}");
                }
            }
        }
    }

    /// The fused call at model shapes: every pair of batches of one hidden size, and one
    /// shape in two dtypes, polls a line the peer never writes.
    #[test]
    fn fused_calls_of_other_batches_or_dtypes_poll_a_line_the_peer_never_writes() {
        use crate::kernels::registry::Kernel;
        let hiddens = [
            512u64, 1024, 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192, 12288, 16384,
        ];
        for ring in [4096u64, 16384, 1 << 16] {
            let window = |dtype: DType, t: u64, h: u64| {
                let rot = ll_rotation(Kernel::FusedLowLatency, dtype, t << 32 | h, ring * 16) / 16;
                (rot, (t * h * dtype.size() as u64).div_ceil(16))
            };
            // A batch fits when its rows fill at most 1/8 of the ring (symmetric::Layout).
            let fits = |dtype: DType, t: u64, h: u64| t * h * dtype.size() as u64 <= ring / 8 * 16;
            for h in hiddens {
                for dtype in DType::ALL {
                    let batches: Vec<u64> = (1..).take_while(|&t| fits(dtype, t, h)).collect();
                    for (i, &a) in batches.iter().enumerate() {
                        for &b in &batches[i + 1..] {
                            let (x, y) = (window(dtype, a, h), window(dtype, b, h));
                            assert!(
                                !inside(x, y, ring) && !inside(y, x, ring),
                                "{dtype:?}, hidden {h}: {a} and {b} tokens share lines on a ring of {ring}"
                            );
                        }
                    }
                    for other in DType::ALL.into_iter().filter(|&o| o != dtype) {
                        for t in batches.iter().copied().filter(|&t| fits(other, t, h)) {
                            let (x, y) = (window(dtype, t, h), window(other, t, h));
                            assert!(
                                !inside(x, y, ring) && !inside(y, x, ring),
                                "hidden {h}, {t} tokens: {dtype:?} and {other:?} share lines on a ring of {ring}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn error_codes_decode_to_peer_timeouts() {
        let t = Duration::from_millis(5);
        match decode_error(1 | (1 << 8) | (5 << 16) | (2 << 24), [0; 4], t) {
            Error::PeerTimeout {
                rank: 2,
                peer: 5,
                phase: BarrierPhase::Middle,
                timeout,
            } => assert_eq!(timeout, t),
            e => panic!("unexpected {e:?}"),
        }
        assert!(matches!(
            decode_error(1 | (3 << 16), [0; 4], t),
            Error::PeerTimeout {
                rank: 0,
                peer: 3,
                phase: BarrierPhase::Start,
                ..
            }
        ));
        assert!(matches!(
            decode_error(4 | (6 << 16) | (1 << 24), [0; 4], t),
            Error::PoolMismatch { rank: 1, peer: 6 }
        ));
        assert!(matches!(
            decode_error(0x42, [0; 4], t),
            Error::KernelFault { code: 0x42 }
        ));
    }

    #[test]
    fn divergences_name_both_calls() {
        use crate::dtype::DType;
        use crate::kernels::registry::Kernel;
        let t = Duration::from_secs(1);
        let mine = check_shape(Some(Kernel::OneShot), DType::BF16);
        let theirs = check_shape(Some(Kernel::TwoShot), DType::F32);
        assert_ne!(mine, theirs);
        assert_ne!(mine, 0, "0 means the check is off");
        match decode_error(2 | (4 << 8) | (1 << 16), [mine, 1000, theirs, 999], t) {
            Error::Diverged {
                rank: 0,
                peer: 1,
                this_call,
                peer_call,
            } => {
                assert_eq!(this_call, "one_shot of 1000 bf16 elements");
                assert_eq!(peer_call, "two_shot of 999 f32 elements");
            }
            e => panic!("unexpected {e:?}"),
        }
        let e = decode_error(2 | (3 << 16) | (2 << 24), [mine, 8, 0, 41], t);
        assert!(e.to_string().contains("call number 41"), "{e}");
        assert!(e.to_string().contains("rank 2 ran one_shot of 8 bf16"), "{e}");
        let fused = check_shape(Some(Kernel::FusedOneShot), DType::BF16);
        let e = decode_error(
            2 | (1 << 16),
            [fused, fused_check_len(2, 4096), fused, fused_check_len(1, 8192)],
            t,
        );
        assert!(
            e.to_string()
                .contains("fused_one_shot of 2 x 4096 bf16 (tokens x hidden)"),
            "{e}"
        );
        assert!(e.to_string().contains("fused_one_shot of 1 x 8192 bf16"), "{e}");
        let gather = check_shape(Some(Kernel::AllGather), DType::F32);
        let (a, b) = (gather_check_len(&[16, 32]), gather_check_len(&[32, 16]));
        assert_ne!(a, b, "the same total split differently");
        let e = decode_error(2 | (1 << 16), [gather, a, gather, b], t);
        assert!(
            e.to_string()
                .contains("all_gather of 48 bytes in all (counts digest 0x"),
            "{e}"
        );
        let ll = check_shape(Some(Kernel::AllGatherLowLatency), DType::F32);
        let e = decode_error(2 | (1 << 16), [ll, 96, ll, 80], t);
        assert!(
            e.to_string().contains("all_gather_ll of 96 bytes per rank"),
            "{e}"
        );
        // A record whose kernel or dtype byte is 0 (never written by a kernel) is described,
        // not a panic.
        let e = decode_error(2 | (1 << 16), [1, 8, 1 << 8, 8], t);
        assert!(
            e.to_string().contains("an unknown kernel of 8 an unknown dtype"),
            "{e}"
        );
        let pushed = decode_error(2 | (3 << 16) | (2 << 24), [0; 4], t);
        assert!(
            matches!(pushed, Error::Diverged { rank: 2, peer: 3, .. }),
            "{pushed:?}"
        );
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
    fn call_identities_tell_apart_kernels_dtypes_and_nearby_lengths() {
        use crate::dtype::DType;
        use crate::kernels::registry::{Kernel, KERNELS};
        let kernels: Vec<Option<Kernel>> = std::iter::once(None)
            .chain(KERNELS.iter().map(|s| Some(s.kernel)))
            .collect();
        for &k in &kernels {
            for d in DType::ALL {
                for len in [1u64, 2, 1000, 1001, (1 << 20) + 5, 1 << 40] {
                    let id = call_ident(k, d, len);
                    assert!(id != 0 && id < 1 << IDENT_BITS, "{k:?} {d} {len}: {id:#x}");
                    // Lengths that differ by less than 511 always differ in the identity.
                    for delta in 1..511u64 {
                        assert_ne!(
                            id,
                            call_ident(k, d, len.wrapping_add(delta)),
                            "{k:?} {d} {len} +{delta}"
                        );
                    }
                }
                for &other in &kernels {
                    if other != k {
                        assert_ne!(
                            call_ident(k, d, 77),
                            call_ident(other, d, 77),
                            "{k:?} vs {other:?}"
                        );
                    }
                }
            }
            assert_ne!(call_ident(k, DType::BF16, 9), call_ident(k, DType::F16, 9));
            assert_ne!(call_ident(k, DType::BF16, 9), call_ident(k, DType::F32, 9));
        }
        // The fused call's (tokens, hidden) length: one token more or less differs.
        let (t, h) = (fused_check_len(8, 4096), fused_check_len(9, 4096));
        assert_ne!(
            call_ident(Some(Kernel::FusedOneShot), DType::BF16, t),
            call_ident(Some(Kernel::FusedOneShot), DType::BF16, h)
        );
    }

    #[test]
    fn a_divergence_found_by_a_flag_names_both_calls() {
        use crate::dtype::DType;
        use crate::kernels::registry::Kernel;
        let mine = call_ident(Some(Kernel::OneShot), DType::BF16, 4096);
        let theirs = call_ident(Some(Kernel::TwoShot), DType::BF16, 4097);
        let code = ERROR_DIVERGED | 1 << 16 | 2 << 24;
        let record = [
            RECORD_IDENT | u64::from(mine),
            4096,
            RECORD_IDENT | u64::from(theirs),
            0,
        ];
        match decode_error(code, record, Duration::from_secs(1)) {
            Error::Diverged {
                rank,
                peer,
                this_call,
                peer_call,
            } => {
                assert_eq!((rank, peer), (2, 1));
                assert_eq!(this_call, "one_shot (bf16, length 4096)");
                assert_eq!(
                    peer_call,
                    format!("two_shot (bf16, length = {} mod 511)", 4097 % 511)
                );
            }
            e => panic!("unexpected {e:?}"),
        }
        assert!(matches!(
            decode_error(ERROR_EPOCHS_EXHAUSTED, [0; 4], Duration::from_secs(1)),
            Error::CallsExhausted { .. }
        ));
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
        assert_eq!(get("ERROR_DIVERGED"), ERROR_DIVERGED as u64);
        assert_eq!(get("ERROR_POOL_MISMATCH"), ERROR_POOL_MISMATCH as u64);
        assert_eq!(get("POOL_TAG_BYTES"), POOL_TAG_BYTES as u64);
        assert_eq!(get("CHECK_OFFSET"), CHECK_OFFSET as u64);
        assert_eq!(get("SLOTS_PER_ROW"), SLOTS_PER_ROW as u64);
        assert_eq!(get("SIGNAL_PHASES"), SIGNAL_PHASES as u64);
        assert_eq!(get("LL_BUFFERS"), LL_BUFFERS as u64);
        assert_eq!(get("IDENT_BITS"), IDENT_BITS as u64);
        assert_eq!(get("EPOCH_BITS"), EPOCH_BITS as u64);
        assert_eq!(get("ERROR_EPOCHS_EXHAUSTED"), ERROR_EPOCHS_EXHAUSTED as u64);
        assert_eq!(get("FLAG_PDL_AT_EXIT"), FLAG_PDL_AT_EXIT as u64);
        assert_eq!(get("FLAG_CONSUMER_WAITS"), FLAG_CONSUMER_WAITS as u64);
        assert_eq!(get("FLAG_PDL_EARLY"), FLAG_PDL_EARLY as u64);
        assert!(
            header.contains("RECORD_IDENT = 1ull << 63;"),
            "abi.cuh's RECORD_IDENT is bit 63"
        );
        assert!(
            header.contains(&format!("sizeof(BlockState) == {BLOCK_STATE_BYTES}")),
            "abi.cuh asserts the call state's size"
        );
        assert!(
            header.contains("sizeof(SymmArgs) == 136"),
            "abi.cuh asserts the size"
        );
    }
}
