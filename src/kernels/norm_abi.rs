//! The parameter block of the fused all-reduce + residual + RMSNorm kernels and of the
//! unfused residual + RMSNorm kernel (`NormArgs` of kernels/fused_norm.cuh): the fused
//! kernels take `(NormArgs, SymmArgs)`, the unfused one `(NormArgs)`.

/// Largest hidden size the kernels take (one 512-thread block per row keeps at most eight
/// 16-byte packs per thread).
pub const MAX_HIDDEN: usize = 16384;

/// Mirrors `symm::NormArgs` field for field (plain C layout, 48 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct NormArgs {
    /// `[tokens, hidden]`: this rank's partial sums (unfused: the all-reduced sums).
    pub(crate) input: u64,
    /// `[tokens, hidden]`, read and overwritten with residual + sum.
    pub(crate) residual: u64,
    /// `[hidden]`.
    pub(crate) weight: u64,
    /// `[tokens, hidden]`.
    pub(crate) norm_out: u64,
    pub(crate) tokens: u32,
    pub(crate) hidden: u32,
    pub(crate) eps: f32,
    /// Blocks per row (a thread-block cluster) of the fused low-latency kernel; 1 for the
    /// others. Set at launch from the plan (`PeerBackend::launch_norm`).
    pub(crate) cluster: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_device_struct() {
        assert_eq!(std::mem::size_of::<NormArgs>(), 48);
        assert_eq!(std::mem::align_of::<NormArgs>(), 8);
        assert_eq!(std::mem::offset_of!(NormArgs, tokens), 32);
        assert_eq!(std::mem::offset_of!(NormArgs, eps), 40);
        let header = include_str!("../../kernels/fused_norm.cuh");
        assert!(header.contains("static_assert(sizeof(NormArgs) == 48"));
    }
}
