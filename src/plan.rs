//! Pure planning: which kernel, which grid. No CUDA types here, so it is tested on any
//! machine. The grid depends only on (element count, dtype, world, limits, config), and the
//! limits are agreed by all ranks at setup, so every rank launches the same grid.

use std::time::Duration;

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Largest world a communicator supports (the kernels' peer arrays are this wide).
pub const MAX_RANKS: usize = 8;
/// Signal slots per phase: the most blocks one rank launches.
pub const MAX_BLOCKS: usize = 64;
/// Threads per block of every kernel.
pub const THREADS_PER_BLOCK: u32 = 512;

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
                "unknown algorithm {s:?}: expected auto, one_shot, two_shot or nccl"
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

/// Per-kernel block limits agreed at setup: the most blocks per rank for which every rank's
/// blocks can be resident at once (a barrier needs all of them running).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// One-shot kernel.
    pub one_shot_blocks: usize,
    /// Two-shot kernel.
    pub two_shot_blocks: usize,
}

impl Limits {
    /// From the occupancy of each kernel: `blocks_per_sm · sms / ranks_sharing_the_device`,
    /// capped by the signal slots and the configuration.
    pub fn from_occupancy(
        one_shot_per_sm: usize,
        two_shot_per_sm: usize,
        sms: usize,
        ranks_per_device: usize,
        config: &Config,
    ) -> Result<Self> {
        let cap = |per_sm: usize| (per_sm * sms / ranks_per_device.max(1)).min(config.max_blocks_per_rank);
        let limits = Limits {
            one_shot_blocks: cap(one_shot_per_sm),
            two_shot_blocks: cap(two_shot_per_sm),
        };
        if limits.one_shot_blocks == 0 || limits.two_shot_blocks == 0 {
            return Err(Error::InvalidWorldSize {
                world: ranks_per_device,
                reason: format!(
                    "{ranks_per_device} ranks on one device cannot all keep a block resident \
                     ({sms} SMs, {one_shot_per_sm}/{two_shot_per_sm} blocks per SM)"
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
}

/// What one call launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// `OneShot` or `TwoShot` (never `Auto`).
    pub algorithm: Algorithm,
    /// Blocks per rank.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
}

/// Chooses the kernel and grid for `len` elements of `dtype` over `world` ranks.
/// `requested` overrides `config.algorithm` unless it is `Auto`.
pub fn plan_all_reduce(
    len: usize,
    dtype: DType,
    world: usize,
    limits: Limits,
    config: &Config,
    requested: Algorithm,
) -> Plan {
    let bytes = len * dtype.size();
    let choice = match (requested, config.algorithm) {
        (Algorithm::Auto, Algorithm::Auto) => {
            if bytes <= config.low_latency_limit() {
                Algorithm::LowLatency
            } else if world == 1 || bytes <= config.one_shot_limit(world) {
                Algorithm::OneShot
            } else {
                Algorithm::TwoShot
            }
        }
        (Algorithm::Auto, configured) => configured,
        (forced, _) => forced,
    };
    // The kernel plan of a call routed to NCCL is never launched; size it as one-shot.
    let choice = if choice == Algorithm::Nccl {
        Algorithm::OneShot
    } else {
        choice
    };
    let packs = len / dtype.per_pack();
    let (work, max_blocks) = match choice {
        Algorithm::TwoShot => (packs.div_ceil(world), limits.two_shot_blocks),
        // One thread per 8-byte line.
        Algorithm::LowLatency => (bytes.div_ceil(8), limits.one_shot_blocks),
        _ => (packs, limits.one_shot_blocks),
    };
    let wanted = work.div_ceil(THREADS_PER_BLOCK as usize).max(1);
    Plan {
        algorithm: choice,
        blocks: wanted.min(max_blocks).min(MAX_BLOCKS) as u32,
        threads: THREADS_PER_BLOCK,
    }
}

/// Everything [`validate_call`] looks at, as plain numbers.
#[derive(Debug, Clone, Copy)]
pub struct CallShape {
    /// Element type.
    pub dtype: DType,
    /// Input length in elements.
    pub input_len: usize,
    /// Output length in elements.
    pub output_len: usize,
    /// Input device address.
    pub input_addr: u64,
    /// Output device address.
    pub output_addr: u64,
    /// Device of the input, output and stream.
    pub input_device: usize,
    /// Device of the output.
    pub output_device: usize,
    /// Device of the stream.
    pub stream_device: usize,
}

impl CallShape {
    /// One buffer of `len` elements at `addr` on `device`, used as input and output.
    pub fn in_place(dtype: DType, len: usize, addr: u64, device: usize, stream_device: usize) -> CallShape {
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
pub fn validate_call(shape: &CallShape, rank_device: usize, capacity_bytes: usize) -> Result<()> {
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

/// Devices, and 16-byte alignment where the kernels run (NCCL needs none).
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
        if aligned && address % 16 != 0 {
            return Err(Error::Misaligned { which, address });
        }
    }
    Ok(())
}

/// Where one call goes and why (see [`crate::Communicator::path`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathDecision {
    /// `OneShot`, `TwoShot` or `Nccl` (never `Auto`).
    pub algorithm: Algorithm,
    /// The kernel grid, for `OneShot`/`TwoShot`.
    pub plan: Option<Plan>,
    /// One sentence naming the deciding rule.
    pub reason: String,
}

impl std::fmt::Display for PathDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.plan {
            Some(p) => write!(f, "{} ({} blocks): {}", self.algorithm, p.blocks, self.reason),
            None => write!(f, "{}: {}", self.algorithm, self.reason),
        }
    }
}

/// What a communicator can do, as far as routing is concerned.
#[derive(Debug, Clone, Copy)]
pub struct PathFacts<'a> {
    /// Number of ranks.
    pub world: usize,
    /// Agreed kernel grid limits.
    pub limits: Limits,
    /// `Err(why)` when the symmetric workspace is not set up (every call goes to NCCL).
    pub peer_kernels: std::result::Result<(), &'a str>,
    /// `Err(why)` when there is no NCCL fallback.
    pub nccl: std::result::Result<(), &'a str>,
}

/// Routes a call of `len` elements of `dtype` (pure; every rank decides the same):
/// 1. `Algorithm::Nccl` (asked for, or configured) → NCCL, or an error without a fallback;
/// 2. no symmetric workspace → NCCL;
/// 3. `OneShot`/`TwoShot` asked for (or configured) → that kernel;
/// 4. `Auto`: above `nccl_above_bytes`, or above `capacity_bytes`, → NCCL when there is a
///    fallback; otherwise the size rule of [`plan_all_reduce`].
///
/// A kernel route above `capacity_bytes` is refused with [`Error::ExceedsCapacity`].
pub fn decide_path(
    len: usize,
    dtype: DType,
    config: &Config,
    requested: Algorithm,
    facts: PathFacts<'_>,
) -> Result<PathDecision> {
    let bytes = len.saturating_mul(dtype.size());
    let nccl = |reason: String| {
        Ok(PathDecision {
            algorithm: Algorithm::Nccl,
            plan: None,
            reason,
        })
    };
    let chosen = if requested == Algorithm::Auto {
        config.algorithm
    } else {
        requested
    };
    if chosen == Algorithm::Nccl {
        return match facts.nccl {
            Ok(()) => nccl(if requested == Algorithm::Nccl {
                "Algorithm::Nccl was asked for".into()
            } else {
                "Config::algorithm is Nccl".into()
            }),
            Err(why) => Err(Error::NcclUnavailable {
                reason: format!("Algorithm::Nccl was asked for, but {why}"),
            }),
        };
    }
    if let Err(peer_why) = facts.peer_kernels {
        return match facts.nccl {
            Ok(()) => nccl(format!("the peer kernels are not set up: {peer_why}")),
            Err(why) => Err(Error::NcclUnavailable {
                reason: format!("the peer kernels are not set up ({peer_why}) and {why}"),
            }),
        };
    }
    let mut note = String::new();
    if chosen == Algorithm::Auto {
        if let Some(limit) = config.nccl_above_bytes.filter(|&l| bytes > l) {
            match facts.nccl {
                Ok(()) => return nccl(format!("{bytes} bytes > nccl_above_bytes ({limit})")),
                Err(why) => note = format!("; nccl_above_bytes ({limit}) is ignored: {why}"),
            }
        }
        if bytes > config.capacity_bytes && facts.nccl.is_ok() {
            return nccl(format!(
                "{bytes} bytes exceed the symmetric capacity ({} bytes)",
                config.capacity_bytes
            ));
        }
    }
    if bytes > config.capacity_bytes {
        return Err(Error::ExceedsCapacity {
            bytes,
            capacity: config.capacity_bytes,
        });
    }
    let plan = plan_all_reduce(len, dtype, facts.world, facts.limits, config, chosen);
    if plan.algorithm == Algorithm::LowLatency && bytes > config.low_latency_limit() {
        return Err(Error::ExceedsCapacity {
            bytes,
            capacity: config.low_latency_limit(),
        });
    }
    let limit = config.one_shot_limit(facts.world);
    let ll_limit = config.low_latency_limit();
    let reason = match (requested, config.algorithm, plan.algorithm) {
        (Algorithm::Auto, Algorithm::Auto, Algorithm::LowLatency) => {
            format!("{bytes} bytes <= low-latency limit ({ll_limit})")
        }
        (Algorithm::Auto, Algorithm::Auto, _) if facts.world == 1 => "one rank: one-shot copy".to_string(),
        (Algorithm::Auto, Algorithm::Auto, Algorithm::OneShot) => {
            format!("{bytes} bytes <= one-shot limit ({limit})")
        }
        (Algorithm::Auto, Algorithm::Auto, _) => format!("{bytes} bytes > one-shot limit ({limit})"),
        (Algorithm::Auto, configured, _) => format!("Config::algorithm is {configured}"),
        (forced, _, _) => format!("{forced} was asked for"),
    };
    Ok(PathDecision {
        algorithm: plan.algorithm,
        plan: Some(plan),
        reason: reason + &note,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const WIDE: Limits = Limits {
        one_shot_blocks: 32,
        two_shot_blocks: 32,
    };

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
    fn auto_follows_published_crossovers() {
        let c = Config::default();
        for (world, limit) in [(2, 512 << 10), (4, 512 << 10), (8, 256 << 10), (6, 256 << 10)] {
            let at = plan_all_reduce(limit / 2, DType::BF16, world, WIDE, &c, Algorithm::Auto);
            let above = plan_all_reduce(limit / 2 + 8, DType::BF16, world, WIDE, &c, Algorithm::Auto);
            assert_eq!(at.algorithm, Algorithm::OneShot, "world {world}");
            assert_eq!(above.algorithm, Algorithm::TwoShot, "world {world}");
        }
        // One rank never needs two-shot.
        let p = plan_all_reduce(64 << 20, DType::F32, 1, WIDE, &c, Algorithm::Auto);
        assert_eq!(p.algorithm, Algorithm::OneShot);
    }

    #[test]
    fn auto_uses_the_low_latency_kernel_for_small_messages() {
        let c = Config::default();
        for world in [1, 2, 8] {
            let at = plan_all_reduce(16 << 10, DType::BF16, world, WIDE, &c, Algorithm::Auto);
            let above = plan_all_reduce((16 << 10) + 1, DType::BF16, world, WIDE, &c, Algorithm::Auto);
            assert_eq!(at.algorithm, Algorithm::LowLatency, "world {world}");
            assert_eq!(above.algorithm, Algorithm::OneShot, "world {world}");
        }
        // One thread per 8-byte line: 8 KiB is 1024 lines, two blocks; a tail needs one more line.
        assert_eq!(
            plan_all_reduce(4096, DType::BF16, 8, WIDE, &c, Algorithm::Auto).blocks,
            2
        );
        assert_eq!(
            plan_all_reduce(1, DType::F32, 8, WIDE, &c, Algorithm::Auto).blocks,
            1
        );
        // Off when 0, and never beyond the capacity.
        let off = Config {
            low_latency_max_bytes: 0,
            ..Config::default()
        };
        assert_eq!(
            plan_all_reduce(4, DType::F32, 8, WIDE, &off, Algorithm::Auto).algorithm,
            Algorithm::OneShot
        );
        let tiny = Config {
            capacity_bytes: 1024,
            ..Config::default()
        };
        assert_eq!(tiny.low_latency_limit(), 1024);
    }

    #[test]
    fn forced_and_configured_algorithms_win_over_auto() {
        let mut c = Config::default();
        let p = plan_all_reduce(16, DType::F32, 8, WIDE, &c, Algorithm::TwoShot);
        assert_eq!(p.algorithm, Algorithm::TwoShot);
        c.algorithm = Algorithm::TwoShot;
        assert_eq!(
            plan_all_reduce(16, DType::F32, 8, WIDE, &c, Algorithm::Auto).algorithm,
            Algorithm::TwoShot
        );
        assert_eq!(
            plan_all_reduce(16, DType::F32, 8, WIDE, &c, Algorithm::OneShot).algorithm,
            Algorithm::OneShot
        );
    }

    #[test]
    fn grid_grows_with_work_and_respects_limits() {
        let c = Config::default();
        // 8 KiB bf16 = 512 packs: one block of 512 threads.
        assert_eq!(
            plan_all_reduce(4096, DType::BF16, 8, WIDE, &c, Algorithm::OneShot).blocks,
            1
        );
        assert_eq!(
            plan_all_reduce(4097 * 8, DType::BF16, 8, WIDE, &c, Algorithm::OneShot).blocks,
            9
        );
        // Tail-only message still launches one block.
        assert_eq!(
            plan_all_reduce(3, DType::F32, 8, WIDE, &c, Algorithm::OneShot).blocks,
            1
        );
        let tight = Limits {
            one_shot_blocks: 4,
            two_shot_blocks: 2,
        };
        assert_eq!(
            plan_all_reduce(1 << 24, DType::F32, 8, tight, &c, Algorithm::OneShot).blocks,
            4
        );
        assert_eq!(
            plan_all_reduce(1 << 24, DType::F32, 8, tight, &c, Algorithm::TwoShot).blocks,
            2
        );
        // Two-shot sizes its grid by the slice, not the whole message.
        let p = plan_all_reduce(8 * 512 * 8, DType::BF16, 8, WIDE, &c, Algorithm::TwoShot);
        assert_eq!(p.blocks, 1);
    }

    #[test]
    fn grid_is_a_function_of_the_call_only() {
        let c = Config::default();
        for len in [1usize, 7, 8, 9, 4095, 4096, 1 << 20, (1 << 22) + 3] {
            for w in 1..=MAX_RANKS {
                let a = plan_all_reduce(len, DType::F16, w, WIDE, &c, Algorithm::Auto);
                let b = plan_all_reduce(len, DType::F16, w, WIDE, &c, Algorithm::Auto);
                assert_eq!(a, b);
                assert!(a.blocks >= 1 && a.blocks as usize <= MAX_BLOCKS);
            }
        }
    }

    #[test]
    fn limits_account_for_ranks_sharing_a_device() {
        let c = Config::default();
        let l = Limits::from_occupancy(2, 1, 132, 8, &c).unwrap();
        assert_eq!(l.one_shot_blocks, 32); // 2*132/8 = 33, capped by config 32
        assert_eq!(l.two_shot_blocks, 16); // 132/8
        let l1 = Limits::from_occupancy(2, 1, 132, 1, &c).unwrap();
        assert_eq!(l.min(l1), l);
        assert!(Limits::from_occupancy(1, 1, 4, 8, &c).is_err());
    }

    fn facts<'a>(
        peer: std::result::Result<(), &'a str>,
        nccl: std::result::Result<(), &'a str>,
    ) -> PathFacts<'a> {
        PathFacts {
            world: 4,
            limits: WIDE,
            peer_kernels: peer,
            nccl,
        }
    }

    #[test]
    fn paths_follow_the_threshold_capacity_and_workspace() {
        let c = Config {
            capacity_bytes: 8 << 20,
            nccl_above_bytes: Some(1 << 20),
            ..Config::default()
        };
        let both = facts(Ok(()), Ok(()));
        let d = |len, algo, f| decide_path(len, DType::BF16, &c, algo, f);
        // Small: low-latency, then one-shot; middle: two-shot; above the threshold: NCCL.
        assert_eq!(
            d(1024, Algorithm::Auto, both).unwrap().algorithm,
            Algorithm::LowLatency
        );
        assert_eq!(
            d(40_000, Algorithm::Auto, both).unwrap().algorithm,
            Algorithm::OneShot
        );
        assert_eq!(
            d(300_000, Algorithm::Auto, both).unwrap().algorithm,
            Algorithm::TwoShot
        );
        let big = d((1 << 19) + 1, Algorithm::Auto, both).unwrap();
        assert_eq!(big.algorithm, Algorithm::Nccl);
        assert!(big.reason.contains("nccl_above_bytes"), "{big}");
        assert!(big.plan.is_none());
        // Exactly at the threshold stays on the kernels.
        assert_eq!(
            d(1 << 19, Algorithm::Auto, both).unwrap().algorithm,
            Algorithm::TwoShot
        );
        // Forced kernels ignore the threshold but not the capacity.
        assert_eq!(
            d(1 << 21, Algorithm::TwoShot, both).unwrap().algorithm,
            Algorithm::TwoShot
        );
        assert!(matches!(
            d(8 << 20, Algorithm::OneShot, both),
            Err(Error::ExceedsCapacity { .. })
        ));
        // Forced NCCL.
        assert_eq!(d(8, Algorithm::Nccl, both).unwrap().algorithm, Algorithm::Nccl);
        // No workspace: everything goes to NCCL, with the reason.
        let nccl_only = facts(Err("no P2P between ranks 0 and 1"), Ok(()));
        let p = d(8, Algorithm::Auto, nccl_only).unwrap();
        assert_eq!(p.algorithm, Algorithm::Nccl);
        assert!(p.reason.contains("no P2P"), "{p}");
        assert_eq!(
            d(8, Algorithm::OneShot, nccl_only).unwrap().algorithm,
            Algorithm::Nccl
        );
    }

    #[test]
    fn without_nccl_the_kernels_take_every_call_that_fits() {
        let c = Config {
            capacity_bytes: 8 << 20,
            nccl_above_bytes: Some(1 << 20),
            ..Config::default()
        };
        let kernels_only = facts(Ok(()), Err("created without NCCL"));
        let p = decide_path(2 << 20, DType::F32, &c, Algorithm::Auto, kernels_only).unwrap();
        assert_eq!(p.algorithm, Algorithm::TwoShot);
        assert!(p.reason.contains("ignored: created without NCCL"), "{p}");
        assert!(matches!(
            decide_path(3 << 20, DType::F32, &c, Algorithm::Auto, kernels_only),
            Err(Error::ExceedsCapacity { .. })
        ));
        let e = decide_path(8, DType::F32, &c, Algorithm::Nccl, kernels_only).unwrap_err();
        assert!(matches!(e, Error::NcclUnavailable { .. }), "{e}");
        assert!(e.to_string().contains("from_nccl"), "{e}");
        // With a fallback, a call above the capacity goes to NCCL even without a threshold.
        let c = Config {
            capacity_bytes: 1 << 20,
            ..Config::default()
        };
        let p = decide_path(1 << 20, DType::F32, &c, Algorithm::Auto, facts(Ok(()), Ok(()))).unwrap();
        assert_eq!(p.algorithm, Algorithm::Nccl);
        assert!(p.reason.contains("capacity"), "{p}");
    }

    #[test]
    fn path_reasons_name_the_rule() {
        let c = Config::default();
        let f = facts(Ok(()), Err("none"));
        let p = decide_path(100, DType::F32, &c, Algorithm::Auto, f).unwrap();
        assert!(p.reason.contains("<= low-latency limit"), "{p}");
        assert!(p.to_string().starts_with("low_latency (1 blocks)"), "{p}");
        let p = decide_path(10_000, DType::F32, &c, Algorithm::Auto, f).unwrap();
        assert!(p.reason.contains("<= one-shot limit"), "{p}");
        assert!(p.to_string().starts_with("one_shot (5 blocks)"), "{p}");
        // Forcing the low-latency kernel past its slots is refused, not silently rerouted.
        assert!(matches!(
            decide_path(10_000, DType::F32, &c, Algorithm::LowLatency, f),
            Err(Error::ExceedsCapacity { capacity, .. }) if capacity == 32 << 10
        ));
        assert_eq!("ll".parse::<Algorithm>().unwrap(), Algorithm::LowLatency);
        let p = decide_path(100, DType::F32, &c, Algorithm::TwoShot, f).unwrap();
        assert_eq!(p.reason, "two_shot was asked for");
        let one = PathFacts { world: 1, ..f };
        assert_eq!(
            decide_path(1 << 20, DType::F32, &c, Algorithm::Auto, one)
                .unwrap()
                .reason,
            "one rank: one-shot copy"
        );
        assert_eq!("nccl".parse::<Algorithm>().unwrap(), Algorithm::Nccl);
        assert_eq!(Algorithm::Nccl.to_string(), "nccl");
    }

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
        let mut s = shape(100);
        s.input_addr += 2;
        assert!(matches!(
            validate_call(&s, 0, 1 << 20),
            Err(Error::Misaligned { which: "input", .. })
        ));
        let mut s = shape(100);
        s.output_addr += 8;
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
