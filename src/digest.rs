//! The one digest the ranks compare with each other.

/// FNV-1a, 64 bits: a stable digest (the same on every machine and Rust version) of what
/// ranks compare (tuning tables, all-gather counts, host names). It detects disagreement, not
/// tampering.
pub(crate) fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
