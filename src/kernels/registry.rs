//! The one list of the device kernels: each protocol's symbol prefix, the oldest
//! architecture it runs on, and the family of block limits that bounds its grid. The kernel
//! table ([`super::Kernels`]) is loaded from this list × [`DType::ALL`]; a test checks the list
//! against the entries of the embedded PTX, so a kernel added on one side only fails CI.

#[cfg(test)]
use crate::dtype::DType;

/// Which residency limit bounds a kernel's grid (see [`crate::Limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    /// One barrier, reads every peer's whole input: one-shot and low-latency.
    OneShot,
    /// Reduce-scatter then all-gather: two-shot and the in-place kernel.
    TwoShot,
    /// No barrier, no workspace (the unfused residual + RMSNorm): any grid is resident.
    Local,
}

/// A device kernel (one per dtype in the fatbin).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kernel {
    OneShot,
    TwoShot,
    InPlace,
    LowLatency,
    /// All-gather (byte-typed: every dtype column is the same byte kernel).
    AllGather,
    /// Reduce-scatter, one-shot.
    ReduceScatter,
    /// All-gather, low-latency (flagged 8-byte lines; byte-typed like `AllGather`).
    AllGatherLowLatency,
    /// Reduce-scatter, low-latency (the all-reduce's 16-byte lines).
    ReduceScatterLowLatency,
    /// All-reduce + residual + RMSNorm, one barrier (kernels/fused_norm.cuh).
    FusedOneShot,
    /// All-reduce + residual + RMSNorm, rows split across ranks, two barriers.
    FusedTwoShot,
    /// Residual + RMSNorm of an all-reduced buffer (the unfused epilogue).
    RmsNorm,
    /// All-reduce + residual + RMSNorm over the low-latency lines, no barrier.
    FusedLowLatency,
    /// The in-place two-shot body over the multimem (NVLS) policy: sm_90+, needs a multicast
    /// object bound to every rank's allocation (kernels/multimem.cu).
    InPlaceMultimem,
    /// Zero-copy out of place from a pool buffer (kernels/pool_two_shot.cuh).
    PoolTwoShot,
    /// The one-shot body over the multimem policy: `multimem.ld_reduce` of the data buffers
    /// (sm_90+, multicast object needed; kernels/multimem.cu).
    OneShotMultimem,
    /// The low-latency body over the multimem policy: one multicast store per 32-bit word (per
    /// 16-byte line beyond the grid) (sm_90+, multicast object needed; kernels/multimem.cu).
    LowLatencyMultimem,
    /// The two-shot over the low-latency lines, no barrier (kernels/two_shot_ll.cuh).
    TwoShotLowLatency,
}

/// One registry row.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KernelSpec {
    pub(crate) kernel: Kernel,
    /// `symm_<prefix>_<dtype>` is the entry point.
    pub(crate) prefix: &'static str,
    /// Oldest compute capability, as `major * 10 + minor`.
    pub(crate) min_arch: u32,
    pub(crate) family: Family,
}

/// Every kernel, in table order.
pub(crate) const KERNELS: [KernelSpec; 17] = [
    KernelSpec {
        kernel: Kernel::OneShot,
        prefix: "one_shot",
        min_arch: 80,
        family: Family::OneShot,
    },
    KernelSpec {
        kernel: Kernel::TwoShot,
        prefix: "two_shot",
        min_arch: 80,
        family: Family::TwoShot,
    },
    KernelSpec {
        kernel: Kernel::InPlace,
        prefix: "in_place",
        min_arch: 80,
        family: Family::TwoShot,
    },
    KernelSpec {
        kernel: Kernel::LowLatency,
        prefix: "one_shot_ll",
        min_arch: 80,
        family: Family::OneShot,
    },
    KernelSpec {
        kernel: Kernel::AllGather,
        prefix: "all_gather",
        min_arch: 80,
        family: Family::OneShot,
    },
    KernelSpec {
        kernel: Kernel::ReduceScatter,
        prefix: "reduce_scatter",
        min_arch: 80,
        family: Family::OneShot,
    },
    KernelSpec {
        kernel: Kernel::FusedOneShot,
        prefix: "fused_one_shot",
        min_arch: 80,
        family: Family::OneShot,
    },
    KernelSpec {
        kernel: Kernel::FusedTwoShot,
        prefix: "fused_two_shot",
        min_arch: 80,
        family: Family::TwoShot,
    },
    KernelSpec {
        kernel: Kernel::RmsNorm,
        prefix: "rmsnorm",
        min_arch: 80,
        family: Family::Local,
    },
    KernelSpec {
        kernel: Kernel::InPlaceMultimem,
        prefix: "in_place_mm",
        min_arch: 90,
        family: Family::TwoShot,
    },
    KernelSpec {
        kernel: Kernel::PoolTwoShot,
        prefix: "pool_two_shot",
        min_arch: 80,
        family: Family::TwoShot,
    },
    KernelSpec {
        kernel: Kernel::AllGatherLowLatency,
        prefix: "all_gather_ll",
        min_arch: 80,
        family: Family::OneShot,
    },
    KernelSpec {
        kernel: Kernel::ReduceScatterLowLatency,
        prefix: "reduce_scatter_ll",
        min_arch: 80,
        family: Family::OneShot,
    },
    KernelSpec {
        kernel: Kernel::OneShotMultimem,
        prefix: "one_shot_mm",
        min_arch: 90,
        family: Family::OneShot,
    },
    KernelSpec {
        kernel: Kernel::LowLatencyMultimem,
        prefix: "one_shot_ll_mm",
        min_arch: 90,
        family: Family::OneShot,
    },
    KernelSpec {
        kernel: Kernel::FusedLowLatency,
        prefix: "fused_ll",
        min_arch: 80,
        family: Family::OneShot,
    },
    KernelSpec {
        kernel: Kernel::TwoShotLowLatency,
        prefix: "two_shot_ll",
        min_arch: 80,
        family: Family::TwoShot,
    },
];

/// The body-less kernel with the common signature (the benchmark's launch floor).
pub(crate) const EMPTY_KERNEL: &str = "symm_empty";
/// The protocol alone with the common signature: one flag exchange per block (the
/// benchmark's sync floor).
pub(crate) const SYNC_FLOOR_KERNEL: &str = "symm_sync_floor";
/// One thread spinning for `n` nanoseconds (a late rank, for tests and the benchmark).
pub(crate) const SPIN_KERNEL: &str = "symm_spin";
/// A byte copy launched as an ordinary kernel: the producer of an all-reduce's input in the
/// benchmark's producer → all-reduce chain.
pub(crate) const PRODUCE_KERNEL: &str = "symm_produce";
/// A byte copy launched with programmatic serialization, waiting for its predecessor or not:
/// the consumer of the PDL contract's test.
pub(crate) const CONSUME_KERNEL: &str = "symm_consume";

impl Kernel {
    /// Whether it is one of the low-latency kernels (no barrier: its lines carry the
    /// synchronisation, in the low-latency slots).
    pub(crate) const fn is_low_latency(self) -> bool {
        matches!(
            self,
            Kernel::LowLatency
                | Kernel::LowLatencyMultimem
                | Kernel::AllGatherLowLatency
                | Kernel::ReduceScatterLowLatency
                | Kernel::FusedLowLatency
                | Kernel::TwoShotLowLatency
        )
    }

    /// Its row in [`KERNELS`].
    pub(crate) const fn index(self) -> usize {
        match self {
            Kernel::OneShot => 0,
            Kernel::TwoShot => 1,
            Kernel::InPlace => 2,
            Kernel::LowLatency => 3,
            Kernel::AllGather => 4,
            Kernel::ReduceScatter => 5,
            Kernel::FusedOneShot => 6,
            Kernel::FusedTwoShot => 7,
            Kernel::RmsNorm => 8,
            Kernel::InPlaceMultimem => 9,
            Kernel::PoolTwoShot => 10,
            Kernel::AllGatherLowLatency => 11,
            Kernel::ReduceScatterLowLatency => 12,
            Kernel::OneShotMultimem => 13,
            Kernel::LowLatencyMultimem => 14,
            Kernel::FusedLowLatency => 15,
            Kernel::TwoShotLowLatency => 16,
        }
    }

    pub(crate) const fn spec(self) -> &'static KernelSpec {
        &KERNELS[self.index()]
    }

    /// One of the fused all-reduce + residual + RMSNorm kernels.
    pub(crate) const fn is_fused(self) -> bool {
        matches!(
            self,
            Kernel::FusedOneShot | Kernel::FusedTwoShot | Kernel::FusedLowLatency
        )
    }

    pub(crate) const fn family(self) -> Family {
        self.spec().family
    }
}

/// Every entry point the registry expects in the fatbin.
#[cfg(test)]
pub(crate) fn symbols() -> Vec<String> {
    let mut names: Vec<String> = KERNELS
        .iter()
        .flat_map(|k| DType::ALL.map(|d| format!("symm_{}_{}", k.prefix, d.name())))
        .collect();
    names.extend(
        [
            EMPTY_KERNEL,
            SYNC_FLOOR_KERNEL,
            SPIN_KERNEL,
            PRODUCE_KERNEL,
            CONSUME_KERNEL,
        ]
        .map(String::from),
    );
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_is_indexed_by_kernel() {
        for (i, k) in KERNELS.iter().enumerate() {
            assert_eq!(k.kernel.index(), i);
            assert_eq!(k.kernel.spec().prefix, k.prefix);
        }
    }

    #[test]
    fn the_embedded_ptx_has_exactly_the_registry_kernels() {
        let ptx = super::super::embedded_ptx();
        if ptx.is_empty() {
            assert!(
                std::env::var("SYMM_ALLREDUCE_REQUIRE_KERNELS").map_or(true, |v| v != "1"),
                "SYMM_ALLREDUCE_REQUIRE_KERNELS=1 but the build has no PTX"
            );
            eprintln!("SKIP the_embedded_ptx_has_exactly_the_registry_kernels: built without nvcc");
            return;
        }
        let mut entries: Vec<String> = ptx
            .lines()
            .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
            .map(|l| l.split('(').next().unwrap_or(l).trim().to_string())
            .collect();
        entries.sort();
        let mut expected = symbols();
        expected.sort();
        assert_eq!(entries, expected, "kernels/ and src/kernels/registry.rs disagree");
    }
}
