//! Communicator settings: [`Config`], [`Algorithm`], their validation, and the fingerprint
//! every rank compares at setup. Every rank must use the same values.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::kernels::abi::{MAX_BLOCKS, MAX_RANKS};
use crate::wire::Writer;

/// Which all-reduce to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// One-shot up to the configured crossover, two-shot above it.
    #[default]
    Auto,
    /// Every rank reads every peer's whole input: one barrier, `(W-1)·S` bytes read per rank.
    OneShot,
    /// Reduce-scatter then all-gather: two barriers, `2·(W-1)/W·S` bytes per rank.
    TwoShot,
    /// One-shot without any barrier: every rank pushes its input to every rank as 16-byte
    /// lines that carry the call's epoch next to each 8 bytes of data, and polls its own
    /// slots until all lines have arrived (`2·W·S` bytes written per rank: small messages).
    LowLatency,
    /// `ncclAllReduce` through the communicator's NCCL fallback (only communicators created
    /// with one: [`crate::Communicator::from_nccl`], [`crate::Communicator::with_nccl_fallback`]).
    Nccl,
}

impl Algorithm {
    /// Lower-case name (`one_shot`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Auto => "auto",
            Algorithm::OneShot => "one_shot",
            Algorithm::TwoShot => "two_shot",
            Algorithm::LowLatency => "low_latency",
            Algorithm::Nccl => "nccl",
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Algorithm::Auto),
            "one_shot" | "oneshot" => Ok(Algorithm::OneShot),
            "two_shot" | "twoshot" => Ok(Algorithm::TwoShot),
            "low_latency" | "ll" => Ok(Algorithm::LowLatency),
            "nccl" => Ok(Algorithm::Nccl),
            _ => Err(format!(
                "unknown algorithm {s:?}: expected auto, low_latency (ll), one_shot, two_shot or nccl"
            )),
        }
    }
}

/// Communicator settings. Every rank must use the same values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Largest message, in bytes, one call may reduce. Each rank allocates three times this
    /// (two data buffers used alternately and the zero-copy symmetric buffer), plus 64 KiB of
    /// signals and call state, plus the low-latency slots (`2 · world · 2 ·
    /// min(low_latency_max_bytes, capacity)` bytes), rounded up to the device granularity.
    pub capacity_bytes: usize,
    /// Algorithm used when a call does not force one.
    pub algorithm: Algorithm,
    /// `Auto` uses one-shot up to this many bytes (inclusive). `None`: the published
    /// crossovers, 512 KiB for 4 or fewer ranks and 256 KiB above.
    pub one_shot_max_bytes: Option<usize>,
    /// Most blocks one rank launches (1..=64). Fewer may be used where the device cannot
    /// keep every rank's blocks resident at once.
    pub max_blocks_per_rank: usize,
    /// `Auto` uses the barrier-free low-latency kernel up to this many bytes (inclusive;
    /// 0 turns it off). Each rank reserves `4·W` times this for its slots.
    pub low_latency_max_bytes: usize,
    /// Bound on every wait for a peer. Expiry poisons the communicator and surfaces as
    /// [`Error::PeerTimeout`].
    pub timeout: Duration,
    /// With an NCCL fallback, `Auto` calls of more than this many bytes go to NCCL. `None`:
    /// only calls above `capacity_bytes` do. Without a fallback this is ignored (the kernels
    /// take every call that fits `capacity_bytes`; [`crate::Communicator::path`] says so).
    pub nccl_above_bytes: Option<usize>,
    /// `false`: never set up the symmetric workspace; every call goes to the NCCL fallback
    /// (which the communicator must then have). For measuring NCCL behind the same API, and
    /// for testing the fallback where the kernels would run.
    pub peer_kernels: bool,
    /// Bytes of the symmetric pool that [`crate::Communicator::alloc_symmetric`] carves
    /// buffers from (rounded up to 256 bytes; 0: no pool). Each rank allocates this much
    /// besides the workspace; every peer maps it. The pool does not grow (see the README's
    /// "zero-copy" section).
    pub pool_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            capacity_bytes: 64 << 20,
            algorithm: Algorithm::Auto,
            one_shot_max_bytes: None,
            max_blocks_per_rank: 32,
            low_latency_max_bytes: 32 << 10,
            timeout: Duration::from_secs(10),
            nccl_above_bytes: None,
            peer_kernels: true,
            pool_bytes: 64 << 20,
        }
    }
}

impl Config {
    /// Checks ranges; called by every constructor.
    pub fn validate(&self) -> Result<()> {
        if self.capacity_bytes == 0 {
            return Err(Error::InvalidConfig("capacity_bytes must be at least 1".into()));
        }
        if self.capacity_bytes > (1usize << 40) {
            return Err(Error::InvalidConfig(format!(
                "capacity_bytes {} is above 1 TiB",
                self.capacity_bytes
            )));
        }
        if self.pool_bytes > (1usize << 40) {
            return Err(Error::InvalidConfig(format!(
                "pool_bytes {} is above 1 TiB",
                self.pool_bytes
            )));
        }
        if !(1..=MAX_BLOCKS).contains(&self.max_blocks_per_rank) {
            return Err(Error::InvalidConfig(format!(
                "max_blocks_per_rank must be in 1..={MAX_BLOCKS}, got {}",
                self.max_blocks_per_rank
            )));
        }
        if self.timeout.is_zero() || self.timeout > Duration::from_secs(3600) {
            return Err(Error::InvalidConfig(format!(
                "timeout must be in (0, 1 h], got {:?}",
                self.timeout
            )));
        }
        Ok(())
    }

    /// Largest message the low-latency kernel takes (its slots never exceed the capacity).
    pub fn low_latency_limit(&self) -> usize {
        self.low_latency_max_bytes.min(self.capacity_bytes)
    }

    /// The `Auto` crossover for a world size.
    pub fn one_shot_limit(&self, world: usize) -> usize {
        self.one_shot_max_bytes
            .unwrap_or(if world <= 4 { 512 << 10 } else { 256 << 10 })
    }
}

/// Checks a world size.
pub fn validate_world(world: usize) -> Result<()> {
    if (1..=MAX_RANKS).contains(&world) {
        Ok(())
    } else {
        Err(Error::InvalidWorldSize {
            world,
            reason: format!("supported world sizes are 1..={MAX_RANKS}"),
        })
    }
}

impl Config {
    /// The bytes every rank compares at setup. Built by destructuring, so a field added to
    /// `Config` does not compile until it is part of the comparison.
    pub(crate) fn fingerprint(&self) -> Vec<u8> {
        let Config {
            capacity_bytes,
            algorithm,
            one_shot_max_bytes,
            max_blocks_per_rank,
            low_latency_max_bytes,
            timeout,
            nccl_above_bytes,
            peer_kernels,
            pool_bytes,
        } = self;
        let mut w = Writer::with_capacity(64);
        w.put(capacity_bytes)
            .put(&(*algorithm as u8))
            .put(one_shot_max_bytes)
            .put(max_blocks_per_rank)
            .put(low_latency_max_bytes)
            .put(&(timeout.as_nanos().min(u64::MAX as u128) as u64))
            .put(nccl_above_bytes)
            .put(peer_kernels)
            .put(pool_bytes);
        w.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_ranges_are_checked() {
        assert!(Config::default().validate().is_ok());
        for bad in [
            Config {
                capacity_bytes: 0,
                ..Config::default()
            },
            Config {
                max_blocks_per_rank: 0,
                ..Config::default()
            },
            Config {
                max_blocks_per_rank: 65,
                ..Config::default()
            },
            Config {
                timeout: Duration::ZERO,
                ..Config::default()
            },
            Config {
                pool_bytes: (1 << 40) + 1,
                ..Config::default()
            },
        ] {
            assert!(matches!(bad.validate(), Err(Error::InvalidConfig(_))), "{bad:?}");
        }
        assert!(validate_world(0).is_err());
        assert!(validate_world(9).is_err());
        for w in 1..=8 {
            validate_world(w).unwrap();
        }
    }

    #[test]
    fn every_field_changes_the_fingerprint() {
        let base = Config::default();
        let variants = [
            Config {
                capacity_bytes: 1 << 20,
                ..base.clone()
            },
            Config {
                algorithm: Algorithm::TwoShot,
                ..base.clone()
            },
            Config {
                one_shot_max_bytes: Some(1),
                ..base.clone()
            },
            Config {
                max_blocks_per_rank: 7,
                ..base.clone()
            },
            Config {
                low_latency_max_bytes: 0,
                ..base.clone()
            },
            Config {
                timeout: Duration::from_millis(1),
                ..base.clone()
            },
            Config {
                nccl_above_bytes: Some(0),
                ..base.clone()
            },
            Config {
                peer_kernels: false,
                ..base.clone()
            },
            Config {
                pool_bytes: 1 << 20,
                ..base.clone()
            },
        ];
        for v in &variants {
            assert_ne!(v.fingerprint(), base.fingerprint(), "{v:?}");
        }
        assert_eq!(base.fingerprint(), Config::default().fingerprint());
    }

    #[test]
    fn algorithm_names_round_trip_and_the_error_lists_all() {
        for a in [
            Algorithm::Auto,
            Algorithm::OneShot,
            Algorithm::TwoShot,
            Algorithm::LowLatency,
            Algorithm::Nccl,
        ] {
            assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
            assert!(
                "bogus".parse::<Algorithm>().unwrap_err().contains(a.name()),
                "{a}"
            );
        }
        assert_eq!("ll".parse::<Algorithm>().unwrap(), Algorithm::LowLatency);
    }
}
