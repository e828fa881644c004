//! Pure planning: where a call goes, which kernel, which grid, and why. No CUDA types here,
//! so it is tested on any machine. The route depends only on (call kind, element count,
//! dtype, world, limits, config, what the communicator has), and the limits are agreed by all
//! ranks at setup, so every rank takes the same route with the same grid.
//!
//! - [`validate`]: one pass over a call's buffers, before routing;
//! - [`route`]: the decision, a `Copy` value with no text (the hot path allocates nothing);
//! - [`grid`]: blocks and threads for a kernel route;
//! - [`explain`]: the sentence [`crate::Communicator::path`] and `describe` print.

pub(crate) mod collective;
pub(crate) mod explain;
pub(crate) mod fused;
pub(crate) mod grid;
pub(crate) mod route;
pub(crate) mod validate;

pub use explain::PathDecision;

use crate::config::{Algorithm, Config};
use crate::error::{Error, Result};
use crate::kernels::registry::{Family, Kernel};

/// The algorithm a kernel implements (the in-place kernel is a two-shot).
pub(crate) const fn algorithm_of(kernel: Kernel) -> Algorithm {
    match kernel {
        Kernel::OneShot
        | Kernel::AllGather
        | Kernel::ReduceScatter
        | Kernel::FusedOneShot
        | Kernel::RmsNorm => Algorithm::OneShot,
        Kernel::TwoShot
        | Kernel::TwoShotLowLatency
        | Kernel::InPlace
        | Kernel::FusedTwoShot
        | Kernel::PoolTwoShot => Algorithm::TwoShot,
        Kernel::LowLatency
        | Kernel::AllGatherLowLatency
        | Kernel::ReduceScatterLowLatency
        | Kernel::FusedLowLatency => Algorithm::LowLatency,
        Kernel::InPlaceMultimem => Algorithm::Multimem,
        Kernel::OneShotMultimem => Algorithm::MultimemOneShot,
        Kernel::LowLatencyMultimem => Algorithm::MultimemLowLatency,
    }
}

/// The buffer kernel of an algorithm (`None` for `Auto` and `Nccl`).
pub(crate) const fn kernel_for(algorithm: Algorithm) -> Option<Kernel> {
    match algorithm {
        Algorithm::OneShot => Some(Kernel::OneShot),
        Algorithm::TwoShot => Some(Kernel::TwoShot),
        Algorithm::LowLatency => Some(Kernel::LowLatency),
        Algorithm::MultimemOneShot => Some(Kernel::OneShotMultimem),
        Algorithm::MultimemLowLatency => Some(Kernel::LowLatencyMultimem),
        Algorithm::Auto | Algorithm::Nccl | Algorithm::Multimem => None,
    }
}

/// Per-kernel block limits agreed at setup: the most blocks per rank for which every rank's
/// blocks can be resident at once (a barrier needs all of them running) and, where ranks
/// share a device, the rest of each rank's work can still run beside them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// One-shot kernel.
    pub one_shot_blocks: usize,
    /// Two-shot kernel.
    pub two_shot_blocks: usize,
}

impl Limits {
    /// From the occupancy of each kernel: `blocks_per_sm · sms / ranks_sharing_the_device`
    /// (every rank's blocks resident at once), capped by the signal slots and the
    /// configuration, and, where ranks share a device, by `sms · shared_sm_percent / 100 /
    /// ranks_sharing_the_device` (at least one): while all but one of those ranks wait in a
    /// collective, the rest of the SMs stay free for that rank's earlier work (a GEMM), so
    /// it reaches its collective ([`Config::shared_sm_percent`]). One rank per device is not
    /// limited by it.
    pub fn from_occupancy(
        one_shot_per_sm: usize,
        two_shot_per_sm: usize,
        sms: usize,
        ranks_per_device: usize,
        config: &Config,
    ) -> Result<Self> {
        let ranks = ranks_per_device.max(1);
        let shared_cap = if ranks > 1 {
            (sms * config.shared_sm_percent as usize / 100 / ranks).max(1)
        } else {
            usize::MAX
        };
        let cap = |per_sm: usize| {
            (per_sm * sms / ranks)
                .min(shared_cap)
                .min(config.max_blocks_per_rank)
        };
        let limits = Limits {
            one_shot_blocks: cap(one_shot_per_sm),
            two_shot_blocks: cap(two_shot_per_sm),
        };
        if limits.one_shot_blocks == 0 || limits.two_shot_blocks == 0 {
            return Err(Error::InvalidWorldSize {
                world: ranks_per_device,
                reason: format!(
                    "{ranks_per_device} ranks on one device cannot each keep a block resident with \
                     SMs to spare ({sms} SMs, {one_shot_per_sm}/{two_shot_per_sm} blocks per SM): \
                     use fewer ranks per device"
                ),
            });
        }
        Ok(limits)
    }

    /// The element-wise minimum (all ranks must agree on one grid).
    pub fn min(self, other: Limits) -> Limits {
        Limits {
            one_shot_blocks: self.one_shot_blocks.min(other.one_shot_blocks),
            two_shot_blocks: self.two_shot_blocks.min(other.two_shot_blocks),
        }
    }

    /// The bound for a kernel family.
    pub(crate) fn blocks(self, family: Family) -> usize {
        match family {
            Family::OneShot => self.one_shot_blocks,
            Family::TwoShot => self.two_shot_blocks,
            Family::Local => usize::MAX,
        }
    }

    /// No kernels (every call goes to NCCL).
    pub(crate) const NONE: Limits = Limits {
        one_shot_blocks: 0,
        two_shot_blocks: 0,
    };
}

/// What one call launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// The algorithm of the kernel (never `Auto` or `Nccl`); the zero-copy symmetric call
    /// runs the two-shot (or `Multimem`) in place.
    pub algorithm: Algorithm,
    /// Blocks per rank.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
    /// Blocks per thread-block cluster: 1, except for the fused low-latency kernel on
    /// compute capability 9.0 and newer, which spreads each row over a cluster of up to 8
    /// blocks (`blocks` is then a multiple of it).
    pub cluster: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_account_for_ranks_sharing_a_device() {
        let full = Config {
            shared_sm_percent: 100,
            ..Config::default()
        };
        let l = Limits::from_occupancy(2, 1, 132, 8, &full).unwrap();
        assert_eq!(l.one_shot_blocks, 16); // 132/8: one block per SM between them
        assert_eq!(l.two_shot_blocks, 16); // 1·132/8
        let capped = Config {
            max_blocks_per_rank: 12,
            ..full.clone()
        };
        assert_eq!(
            Limits::from_occupancy(2, 1, 132, 8, &capped)
                .unwrap()
                .one_shot_blocks,
            12
        );
        let l1 = Limits::from_occupancy(2, 1, 132, 1, &full).unwrap();
        assert_eq!(l.min(l1), l);
        assert!(Limits::from_occupancy(1, 1, 4, 8, &full).is_err());
        assert_eq!(l.blocks(Family::OneShot), 16);
        assert_eq!(l.blocks(Family::TwoShot), 16);
        // A lone rank: occupancy and the signal slots' 64 blocks only, whatever the share.
        assert_eq!(l1.two_shot_blocks, 64);
        let c = Config::default();
        assert_eq!(
            Limits::from_occupancy(4, 4, 132, 1, &c).unwrap().one_shot_blocks,
            64
        );
        // The default share, a quarter of the SMs: 132/4/8 = 4 blocks a rank at W = 8, 8 at
        // W = 4 (what candle's tensor-parallel Llama needed at batch 32), 16 at W = 2.
        for (ranks, blocks) in [(8, 4), (4, 8), (2, 16)] {
            let l = Limits::from_occupancy(4, 4, 132, ranks, &c).unwrap();
            assert_eq!(
                (l.one_shot_blocks, l.two_shot_blocks),
                (blocks, blocks),
                "{ranks} ranks"
            );
        }
        // At least one block, where the share rounds to none.
        assert_eq!(
            Limits::from_occupancy(4, 4, 16, 8, &c).unwrap().one_shot_blocks,
            1
        );
    }

    #[test]
    fn ranks_sharing_a_device_leave_sms_to_the_last_one() {
        for percent in [1, 25, 50, 100] {
            let c = Config {
                shared_sm_percent: percent,
                ..Config::default()
            };
            for sms in [16, 78, 108, 132, 144] {
                for ranks in 2..=8 {
                    let Ok(l) = Limits::from_occupancy(4, 4, sms, ranks, &c) else {
                        continue;
                    };
                    for blocks in [l.one_shot_blocks, l.two_shot_blocks] {
                        // Every rank's blocks fit at once, and all ranks' blocks together
                        // take at most the share (or one block a rank).
                        assert!(ranks * blocks <= 4 * sms, "{sms} SMs, {ranks} ranks");
                        assert!(blocks == 1 || 100 * ranks * blocks <= percent as usize * sms);
                        assert!(blocks >= 1);
                    }
                }
            }
        }
    }
}
