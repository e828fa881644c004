//! The collectives beside the all-reduce: all-gather, all-gather-v and reduce-scatter.
//! Validation (once per call, before anything is launched), routing (a `Copy` [`Route`], no
//! text, no allocation) and the sentence `*_path` prints. Pure: tested on CPU.
//!
//! Sizes follow nccl-tests: an all-gather's `bytes` is the gathered output (W chunks), a
//! reduce-scatter's the input (W slices). What must fit the workspace is what each rank
//! copies in: its own chunk (all-gather, in front of the counts slots at the end of the data
//! buffer) or its whole input with every slice rounded up to 16 bytes (reduce-scatter).
//!
//! The low-latency kernels do not use the workspace: what must fit is what one rank pushes
//! into one peer's low-latency slot ([`CollShape::ll_slot_bytes`]), at most
//! [`Config::low_latency_limit`]. `Auto` takes them up to the all-reduce's low-latency
//! threshold in slot bytes (`Config::low_latency_max_bytes`, else the published value of the
//! world; the reduce-scatter also the tuning table's of its dtype and world); the
//! all-gather's lines carry 8 payload bytes each (see kernels/low_latency_bytes.cuh), so its
//! slot bytes are twice its chunk.
//!
//! Routes: `Algorithm::Nccl` (asked for or configured) → `ncclAllGather` /
//! `ncclReduceScatter` / grouped `ncclBroadcast`s for all-gather-v; no peer kernels → NCCL;
//! `Auto` (asked for and configured) above `nccl_above_bytes` with a fallback → NCCL;
//! `LowLatency` asked for or
//! configured, or `Auto` within the low-latency threshold → the low-latency kernel (refused
//! above the slots); `Auto` above the workspace with a fallback → NCCL; otherwise the
//! one-shot kernel, refused with a typed error above the workspace. All-gather-v has no
//! low-latency kernel (its one-shot detects counts that disagree across ranks).

use super::route::{PathFacts, Route, Rule, Target};
use super::{PathDecision, Plan};
use crate::config::{Algorithm, Config};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::abi::{MAX_BLOCKS, THREADS_PER_BLOCK};
use crate::kernels::coll::COUNT_SLOTS_BYTES;
use crate::kernels::registry::{Family, Kernel};

/// A collective other than the all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Collective {
    AllGather,
    AllGatherV,
    ReduceScatter,
}

impl Collective {
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Collective::AllGather => "all_gather",
            Collective::AllGatherV => "all_gather_v",
            Collective::ReduceScatter => "reduce_scatter",
        }
    }

    const fn kernel(self) -> Kernel {
        match self {
            Collective::AllGather | Collective::AllGatherV => Kernel::AllGather,
            Collective::ReduceScatter => Kernel::ReduceScatter,
        }
    }

    const fn low_latency_kernel(self) -> Option<Kernel> {
        match self {
            Collective::AllGather => Some(Kernel::AllGatherLowLatency),
            Collective::ReduceScatter => Some(Kernel::ReduceScatterLowLatency),
            Collective::AllGatherV => None,
        }
    }
}

/// A validated call, as the numbers routing needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CollShape {
    pub(crate) collective: Collective,
    /// Message bytes as nccl-tests count them (gathered output; reduce-scatter input).
    pub(crate) bytes: usize,
    /// Bytes one rank copies into its data buffer.
    pub(crate) workspace_bytes: usize,
    /// 16-byte packs one rank's grid walks (largest chunk; one slice).
    pub(crate) packs: usize,
    /// Bytes of 16-byte lines one rank pushes into one peer's low-latency slot (`None`: no
    /// low-latency kernel).
    pub(crate) ll_slot_bytes: Option<usize>,
    /// The element type whose low-latency threshold `Auto` uses (`None`: bytes, which skip the
    /// tuning table: [`Config::low_latency_threshold`]).
    pub(crate) dtype: Option<DType>,
}

/// Payload bytes per 16-byte line of the low-latency all-gather (`LL_BYTES_PER_LINE` in
/// kernels/low_latency_bytes.cuh).
pub(crate) const LL_GATHER_BYTES_PER_LINE: usize = 8;

fn invalid(call: &'static str, reason: String) -> Error {
    Error::InvalidCollective { call, reason }
}

/// `all_gather`: `input_len` elements of `elem_bytes` per rank into `world · input_len`.
pub(crate) fn validate_all_gather(
    elem_bytes: usize,
    input_len: usize,
    output_len: usize,
    world: usize,
) -> Result<CollShape> {
    if input_len == 0 {
        return Err(Error::Empty);
    }
    let wanted = input_len.checked_mul(world);
    if wanted != Some(output_len) {
        return Err(invalid(
            "all_gather",
            format!(
                "output has {output_len} elements; it must hold world size ({world}) × input ({input_len})"
            ),
        ));
    }
    let chunk = input_len.saturating_mul(elem_bytes);
    Ok(CollShape {
        collective: Collective::AllGather,
        bytes: chunk.saturating_mul(world),
        workspace_bytes: chunk,
        packs: chunk / 16,
        ll_slot_bytes: Some(chunk.div_ceil(LL_GATHER_BYTES_PER_LINE).saturating_mul(16)),
        dtype: None,
    })
}

/// `all_gather_v`: `counts[q]` elements from rank q (this rank's is its input length), the
/// output their sum, rank-major.
pub(crate) fn validate_all_gather_v(
    elem_bytes: usize,
    counts: &[usize],
    rank: usize,
    input_len: usize,
    output_len: usize,
    world: usize,
) -> Result<CollShape> {
    const CALL: &str = "all_gather_v";
    if counts.len() != world {
        return Err(invalid(
            CALL,
            format!(
                "counts has {} entries; pass one count per rank ({world})",
                counts.len()
            ),
        ));
    }
    if counts[rank] != input_len {
        return Err(invalid(
            CALL,
            format!(
                "counts[{rank}] is {} but this rank's input has {input_len} elements; they must be equal",
                counts[rank]
            ),
        ));
    }
    let total = counts
        .iter()
        .try_fold(0usize, |s, &c| s.checked_add(c))
        .ok_or_else(|| invalid(CALL, "the counts overflow usize".to_string()))?;
    if total == 0 {
        return Err(Error::Empty);
    }
    if total != output_len {
        return Err(invalid(
            CALL,
            format!("output has {output_len} elements; it must hold the sum of counts ({total})"),
        ));
    }
    let largest = counts
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .saturating_mul(elem_bytes);
    Ok(CollShape {
        collective: Collective::AllGatherV,
        bytes: total.saturating_mul(elem_bytes),
        workspace_bytes: largest,
        packs: largest / 16,
        ll_slot_bytes: None,
        dtype: None,
    })
}

/// `reduce_scatter`: `world · output_len` elements in, this rank's slice of `output_len` out.
pub(crate) fn validate_reduce_scatter(
    dtype: DType,
    input_len: usize,
    output_len: usize,
    world: usize,
) -> Result<CollShape> {
    if output_len == 0 {
        return Err(Error::Empty);
    }
    if output_len.checked_mul(world) != Some(input_len) {
        return Err(invalid(
            "reduce_scatter",
            format!(
                "input has {input_len} elements; it must hold world size ({world}) × output ({output_len})"
            ),
        ));
    }
    let slice = output_len.saturating_mul(dtype.size());
    let padded = slice.saturating_add(15) / 16 * 16;
    Ok(CollShape {
        collective: Collective::ReduceScatter,
        bytes: slice.saturating_mul(world),
        workspace_bytes: padded.saturating_mul(world),
        packs: slice / 16,
        ll_slot_bytes: Some(padded),
        dtype: Some(dtype),
    })
}

/// Bytes of the workspace a collective may fill.
pub(crate) fn capacity(collective: Collective, config: &Config) -> usize {
    match collective {
        Collective::AllGather | Collective::AllGatherV => {
            config.capacity_bytes.saturating_sub(COUNT_SLOTS_BYTES)
        }
        Collective::ReduceScatter => config.capacity_bytes,
    }
}

/// The grid: one thread per pack (low-latency: per line), capped by the one-shot family's
/// limit. All-gather-v always launches the whole limit, so that ranks whose counts disagree
/// still launch the same grid and every block meets its peers and reports the mismatch
/// (instead of timing out).
fn grid(shape: &CollShape, kernel: Kernel, limits: super::Limits) -> Plan {
    let cap = limits.blocks(Family::OneShot).min(MAX_BLOCKS);
    let work = match kernel {
        Kernel::AllGatherLowLatency | Kernel::ReduceScatterLowLatency => {
            shape.ll_slot_bytes.unwrap_or(0) / 16
        }
        _ => shape.packs,
    };
    let blocks = match shape.collective {
        Collective::AllGatherV => cap,
        _ => work.div_ceil(THREADS_PER_BLOCK as usize).max(1).min(cap),
    };
    Plan {
        algorithm: super::algorithm_of(kernel),
        blocks: blocks as u32,
        threads: THREADS_PER_BLOCK,
        cluster: 1,
    }
}

/// The most slot bytes `Auto` sends through the low-latency kernel: the all-reduce's
/// low-latency threshold of the dtype and world ([`Config::low_latency_threshold`]), never
/// above the slots.
fn low_latency_auto_max(shape: &CollShape, config: &Config, world: usize) -> usize {
    config
        .low_latency_threshold(shape.dtype, world)
        .min(config.low_latency_limit(world))
}

/// Routes a validated collective (pure; every rank decides the same for the same shape).
pub(crate) fn route_collective(
    shape: &CollShape,
    config: &Config,
    requested: Algorithm,
    facts: PathFacts<'_>,
) -> Result<Route> {
    let c = shape.collective;
    let bytes = shape.bytes;
    let nccl = |rule| {
        Ok(Route {
            target: Target::Nccl,
            rule,
            bytes,
            // Unused: the collectives' size rule does not depend on the element type.
            dtype: DType::F32,
            threshold_ignored: false,
        })
    };
    let chosen = if requested == Algorithm::Auto {
        config.algorithm
    } else {
        requested
    };
    let low_latency = c.low_latency_kernel();
    match requested {
        a if a == Algorithm::TwoShot || a.is_multimem() => {
            return Err(invalid(
                c.name(),
                format!("there is no {requested} kernel for it: pass Auto, LowLatency, OneShot or Nccl"),
            ))
        }
        Algorithm::LowLatency if low_latency.is_none() => {
            return Err(invalid(
                c.name(),
                "there is no low_latency kernel for it: pass Auto, OneShot or Nccl".to_string(),
            ))
        }
        _ => {}
    }
    if chosen == Algorithm::Nccl {
        return match facts.nccl {
            Ok(()) if requested == Algorithm::Nccl => nccl(Rule::NcclAskedFor),
            Ok(()) => nccl(Rule::NcclConfigured),
            Err(why) => Err(Error::NcclUnavailable {
                reason: format!("Algorithm::Nccl was asked for, but {why}"),
            }),
        };
    }
    if let Err(peer_why) = facts.peer_kernels {
        return match facts.nccl {
            Ok(()) => nccl(Rule::NoPeerKernels),
            Err(why) => Err(Error::NcclUnavailable {
                reason: format!("the peer kernels are not set up ({peer_why}) and {why}"),
            }),
        };
    }
    let rule = match (requested, config.algorithm) {
        (Algorithm::Auto, Algorithm::Auto) => Rule::Size,
        (Algorithm::Auto, _) => Rule::Configured,
        _ => Rule::AskedFor,
    };
    let mut threshold_ignored = false;
    if chosen == Algorithm::Auto && config.nccl_above_bytes.is_some_and(|l| bytes > l) {
        match facts.nccl {
            Ok(()) => return nccl(Rule::AboveNcclThreshold),
            Err(_) => threshold_ignored = true,
        }
    }
    let kernel_route = |kernel| Route {
        target: Target::Kernel(kernel, grid(shape, kernel, facts.limits)),
        rule,
        bytes,
        dtype: DType::F32,
        threshold_ignored,
    };
    if let (Some(kernel), Some(slot)) = (low_latency, shape.ll_slot_bytes) {
        let limit = config.low_latency_limit(facts.world);
        if chosen == Algorithm::LowLatency {
            if slot > limit {
                return Err(Error::ExceedsCapacity {
                    bytes: slot,
                    capacity: limit,
                });
            }
            return Ok(kernel_route(kernel));
        }
        if rule == Rule::Size && slot <= low_latency_auto_max(shape, config, facts.world) {
            return Ok(kernel_route(kernel));
        }
    }
    let cap = capacity(c, config);
    if shape.workspace_bytes > cap {
        if requested == Algorithm::Auto && facts.nccl.is_ok() {
            return nccl(Rule::AboveCapacity);
        }
        return Err(Error::ExceedsCapacity {
            bytes: shape.workspace_bytes,
            capacity: cap,
        });
    }
    Ok(kernel_route(c.kernel()))
}

/// The decision in words.
pub(crate) fn explain_collective(
    shape: &CollShape,
    route: &Route,
    config: &Config,
    facts: PathFacts<'_>,
) -> PathDecision {
    let name = shape.collective.name();
    let cap = capacity(shape.collective, config);
    let ws = shape.workspace_bytes;
    let slot = shape.ll_slot_bytes.unwrap_or(0);
    let kernel = match route.algorithm() {
        Algorithm::LowLatency => "low-latency",
        _ => "one-shot",
    };
    let mut reason = match route.rule {
        Rule::NcclAskedFor => format!("Algorithm::Nccl was asked for: nccl {name}"),
        Rule::NcclConfigured => format!("Config::algorithm is Nccl: nccl {name}"),
        Rule::NoPeerKernels => format!(
            "the peer kernels are not set up: {}",
            facts.peer_kernels.err().unwrap_or("unknown reason")
        ),
        Rule::AboveNcclThreshold => format!(
            "{} bytes > nccl_above_bytes ({}): nccl {name}",
            route.bytes,
            config.nccl_above_bytes.unwrap_or(0)
        ),
        Rule::AboveCapacity => {
            format!("{ws} bytes to copy in exceed the {name} workspace ({cap} bytes): nccl {name}")
        }
        _ if route.algorithm() == Algorithm::LowLatency && route.rule == Rule::Size => format!(
            "low-latency {name} kernel: {slot} bytes of lines per peer <= low-latency limit ({})",
            low_latency_auto_max(shape, config, facts.world)
        ),
        Rule::Size | Rule::Symmetric | Rule::Multimem | Rule::MultimemSize | Rule::Pool | Rule::PoolInput => {
            format!("one-shot {name} kernel: {ws} bytes to copy in <= workspace ({cap} bytes)")
        }
        Rule::Configured if route.algorithm() == Algorithm::LowLatency => {
            format!("Config::algorithm is low_latency: the low-latency {name} kernel")
        }
        Rule::Configured => format!(
            "Config::algorithm is {}, which {name} does not have: its one-shot kernel",
            config.algorithm
        ),
        Rule::AskedFor => format!("{} was asked for: the {kernel} {name} kernel", route.algorithm()),
    };
    if route.threshold_ignored {
        reason += &format!(
            "; nccl_above_bytes ({}) is ignored: {}",
            config.nccl_above_bytes.unwrap_or(0),
            facts.nccl.err().unwrap_or("there is no NCCL fallback")
        );
    }
    PathDecision::of(route, reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Limits;

    const LIMITS: Limits = Limits {
        one_shot_blocks: 24,
        two_shot_blocks: 12,
    };

    fn facts<'a>(
        peer: std::result::Result<(), &'a str>,
        nccl: std::result::Result<(), &'a str>,
    ) -> PathFacts<'a> {
        PathFacts {
            world: 4,
            limits: LIMITS,
            peer_kernels: peer,
            nccl,
            multicast: Err("no multicast in these tests"),
            clusters: true,
        }
    }

    #[test]
    fn all_gather_shapes_are_validated() {
        let s = validate_all_gather(1, 13, 52, 4).unwrap();
        assert_eq!((s.bytes, s.workspace_bytes, s.packs), (52, 13, 0));
        let s = validate_all_gather(2, 1000, 8000, 8).unwrap();
        assert_eq!((s.bytes, s.workspace_bytes, s.packs), (16000, 2000, 125));
        assert!(matches!(validate_all_gather(4, 0, 0, 2), Err(Error::Empty)));
        let e = validate_all_gather(4, 10, 39, 4).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidCollective {
                    call: "all_gather",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("world size (4) × input (10)"), "{e}");
        // Overflow is a refusal, not a wrap.
        assert!(validate_all_gather(1, usize::MAX / 2 + 1, 0, 2).is_err());
    }

    #[test]
    fn all_gather_v_counts_are_validated() {
        let s = validate_all_gather_v(1, &[3, 0, 17], 2, 17, 20, 3).unwrap();
        assert_eq!((s.bytes, s.workspace_bytes, s.packs), (20, 17, 1));
        // Own count 0 is fine as long as someone sends something.
        assert!(validate_all_gather_v(4, &[3, 0, 17], 1, 0, 20, 3).is_ok());
        let bad = [
            validate_all_gather_v(1, &[3, 4], 0, 3, 7, 3), // wrong number of counts
            validate_all_gather_v(1, &[3, 4, 5], 1, 5, 12, 3), // own count != input
            validate_all_gather_v(1, &[3, 4, 5], 0, 3, 11, 3), // output != sum
            validate_all_gather_v(1, &[usize::MAX, 4], 0, usize::MAX, 3, 2), // overflow
        ];
        for r in bad {
            let e = r.unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidCollective {
                        call: "all_gather_v",
                        ..
                    }
                ),
                "{e}"
            );
        }
        assert!(matches!(
            validate_all_gather_v(1, &[0, 0], 0, 0, 0, 2),
            Err(Error::Empty)
        ));
    }

    #[test]
    fn reduce_scatter_shapes_are_validated_and_slices_padded() {
        let s = validate_reduce_scatter(DType::F16, 3 * 9, 9, 3).unwrap();
        // 18-byte slices pad to 32 bytes each in the workspace.
        assert_eq!((s.bytes, s.workspace_bytes, s.packs), (54, 96, 1));
        assert!(matches!(
            validate_reduce_scatter(DType::F16, 0, 0, 3),
            Err(Error::Empty)
        ));
        let e = validate_reduce_scatter(DType::F32, 10, 4, 2).unwrap_err();
        assert!(e.to_string().contains("world size (2) × output (4)"), "{e}");
    }

    #[test]
    fn routes_follow_threshold_capacity_and_fallback() {
        let c = Config {
            capacity_bytes: 1 << 20,
            nccl_above_bytes: Some(256 << 10),
            low_latency_max_bytes: Some(32 << 10),
            ..Config::default()
        };
        let both = facts(Ok(()), Ok(()));
        let ag = |len| validate_all_gather(1, len, len * 4, 4).unwrap();
        // 16 KiB chunks are 32 KiB of lines per peer: the low-latency limit; one more is one-shot.
        let r = route_collective(&ag(16 << 10), &c, Algorithm::Auto, both).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::AllGatherLowLatency, p) if p.blocks == 4));
        let r = route_collective(&ag((16 << 10) + 1), &c, Algorithm::Auto, both).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::AllGather, p) if p.blocks == 2));
        // Gathered output above the threshold: NCCL.
        let r = route_collective(&ag(100 << 10), &c, Algorithm::Auto, both).unwrap();
        assert_eq!(r.target, Target::Nccl);
        assert!(explain_collective(&ag(100 << 10), &r, &c, both)
            .reason
            .contains("nccl_above_bytes"));
        // Forced one-shot ignores the threshold, not the workspace (capacity minus the counts slots).
        let r = route_collective(&ag(100 << 10), &c, Algorithm::OneShot, both).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::AllGather, p) if p.blocks == 13));
        let full = ag((1 << 20) - COUNT_SLOTS_BYTES + 1);
        assert!(matches!(
            route_collective(&full, &c, Algorithm::OneShot, both),
            Err(Error::ExceedsCapacity { capacity, .. }) if capacity == (1 << 20) - COUNT_SLOTS_BYTES
        ));
        let r = route_collective(&full, &c, Algorithm::Auto, both).unwrap();
        assert_eq!(r.target, Target::Nccl);
        // No fallback: the threshold is ignored and said so; above the workspace is refused.
        let kernels_only = facts(Ok(()), Err("created without NCCL"));
        let r = route_collective(&ag(100 << 10), &c, Algorithm::Auto, kernels_only).unwrap();
        assert!(r.threshold_ignored);
        let p = explain_collective(&ag(100 << 10), &r, &c, kernels_only);
        assert!(p.reason.contains("ignored: created without NCCL"), "{p}");
        assert!(matches!(
            route_collective(&full, &c, Algorithm::Auto, kernels_only),
            Err(Error::ExceedsCapacity { .. })
        ));
        assert!(matches!(
            route_collective(&ag(8), &c, Algorithm::Nccl, kernels_only),
            Err(Error::NcclUnavailable { .. })
        ));
        // There is no two-shot or multimem all-gather.
        for a in [
            Algorithm::TwoShot,
            Algorithm::Multimem,
            Algorithm::MultimemOneShot,
            Algorithm::MultimemLowLatency,
        ] {
            assert!(matches!(
                route_collective(&ag(8), &c, a, both),
                Err(Error::InvalidCollective { .. })
            ));
        }
        // A configured all-reduce algorithm runs the one-shot kernel and says why.
        let two = Config {
            algorithm: Algorithm::TwoShot,
            ..c.clone()
        };
        let r = route_collective(&ag(8), &two, Algorithm::Auto, both).unwrap();
        let p = explain_collective(&ag(8), &r, &two, both);
        assert_eq!(p.algorithm, Algorithm::OneShot);
        assert!(p.reason.contains("does not have"), "{p}");
        // No peer kernels: NCCL.
        let nccl_only = facts(Err("no P2P"), Ok(()));
        let r = route_collective(&ag(8), &c, Algorithm::Auto, nccl_only).unwrap();
        assert_eq!(r.target, Target::Nccl);
        assert!(explain_collective(&ag(8), &r, &c, nccl_only)
            .reason
            .contains("no P2P"));
    }

    #[test]
    fn reduce_scatter_routes_on_the_padded_input() {
        let c = Config {
            capacity_bytes: 64 << 10,
            low_latency_max_bytes: Some(4 << 10),
            ..Config::default()
        };
        let both = facts(Ok(()), Ok(()));
        let rs = |len| validate_reduce_scatter(DType::F32, len * 4, len, 4).unwrap();
        // Up to 4 KiB slices: the low-latency kernel, one thread per 16-byte line.
        let r = route_collective(&rs(1024), &c, Algorithm::Auto, both).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::ReduceScatterLowLatency, p) if p.blocks == 1));
        let r = route_collective(&rs(4096), &c, Algorithm::Auto, both).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::ReduceScatter, p) if p.blocks == 2));
        let p = explain_collective(&rs(4096), &r, &c, both);
        assert!(
            p.to_string()
                .starts_with("one_shot (2 blocks): one-shot reduce_scatter"),
            "{p}"
        );
        // 4 slices of 4095 f32 = 65520 bytes fit; padded they are 4 × 16384 = 65536: fits exactly.
        assert!(route_collective(&rs(4095), &c, Algorithm::OneShot, both).is_ok());
        // `nccl_above_bytes` is a rule of `Auto`, as for the all-reduce: a configured
        // algorithm keeps the kernel above it (the workspace still sends larger calls to NCCL).
        let threshold = Config {
            nccl_above_bytes: Some(1024),
            ..c.clone()
        };
        let configured = Config {
            algorithm: Algorithm::OneShot,
            ..threshold.clone()
        };
        let r = route_collective(&rs(1024), &threshold, Algorithm::Auto, both).unwrap();
        assert_eq!((r.target, r.rule), (Target::Nccl, Rule::AboveNcclThreshold));
        let r = route_collective(&rs(1024), &configured, Algorithm::Auto, both).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::ReduceScatter, _)));
        assert_eq!(r.rule, Rule::Configured);
        let r = route_collective(&rs(4097), &configured, Algorithm::Auto, both).unwrap();
        assert_eq!(r.target, Target::Nccl);
        let r = route_collective(&rs(4097), &c, Algorithm::Auto, both).unwrap();
        assert_eq!(r.target, Target::Nccl);
        assert!(explain_collective(&rs(4097), &r, &c, both)
            .reason
            .contains("exceed the reduce_scatter workspace"));
    }

    #[test]
    fn all_gather_v_takes_nccl_where_all_gather_does_and_keeps_a_fixed_grid() {
        let c = Config {
            capacity_bytes: 1 << 20,
            nccl_above_bytes: Some(1024),
            ..Config::default()
        };
        let both = facts(Ok(()), Ok(()));
        let v = validate_all_gather_v(1, &[5, 7, 0, 9], 0, 5, 21, 4).unwrap();
        // Small: the one-shot kernel (never low-latency), with the whole one-shot grid.
        let r = route_collective(&v, &c, Algorithm::Auto, both).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::AllGather, p) if p.blocks == 24));
        let e = route_collective(&v, &c, Algorithm::LowLatency, both).unwrap_err();
        assert!(
            matches!(e, Error::InvalidCollective { .. }) && e.to_string().contains("no low_latency kernel"),
            "{e}"
        );
        // Asked for, configured, above the threshold, above the workspace, no peer kernels: NCCL.
        let nccl_cfg = Config {
            algorithm: Algorithm::Nccl,
            ..c.clone()
        };
        let above = validate_all_gather_v(1, &[500, 700, 0, 9], 0, 500, 1209, 4).unwrap();
        let big = validate_all_gather_v(1, &[1 << 20, 0, 0, 0], 0, 1 << 20, 1 << 20, 4).unwrap();
        for (shape, config, algo, facts, rule) in [
            (v, &c, Algorithm::Nccl, both, Rule::NcclAskedFor),
            (v, &nccl_cfg, Algorithm::Auto, both, Rule::NcclConfigured),
            (above, &c, Algorithm::Auto, both, Rule::AboveNcclThreshold),
            (
                v,
                &c,
                Algorithm::Auto,
                facts(Err("no P2P"), Ok(())),
                Rule::NoPeerKernels,
            ),
        ] {
            let r = route_collective(&shape, config, algo, facts).unwrap();
            assert_eq!((r.target, r.rule), (Target::Nccl, rule));
        }
        let no_threshold = Config {
            nccl_above_bytes: None,
            ..c.clone()
        };
        let r = route_collective(&big, &no_threshold, Algorithm::Auto, both).unwrap();
        assert_eq!((r.target, r.rule), (Target::Nccl, Rule::AboveCapacity));
        assert!(explain_collective(&big, &r, &no_threshold, both)
            .reason
            .contains("exceed the all_gather_v workspace"));
        // Without a fallback: refused above the workspace, typed.
        let kernels_only = facts(Ok(()), Err("created without NCCL"));
        assert!(matches!(
            route_collective(&big, &c, Algorithm::Auto, kernels_only),
            Err(Error::ExceedsCapacity { .. })
        ));
        assert!(matches!(
            route_collective(&big, &c, Algorithm::OneShot, both),
            Err(Error::ExceedsCapacity { .. })
        ));
        assert!(matches!(
            route_collective(&v, &c, Algorithm::Auto, facts(Err("no P2P"), Err("no NCCL"))),
            Err(Error::NcclUnavailable { .. })
        ));
    }

    #[test]
    fn low_latency_slots_are_sized_for_each_collective() {
        // All-gather: 8 payload bytes per 16-byte line, any byte length.
        for (chunk, slot) in [
            (1usize, 16usize),
            (8, 16),
            (9, 32),
            (13, 32),
            (16 << 10, 32 << 10),
        ] {
            let s = validate_all_gather(1, chunk, chunk * 3, 3).unwrap();
            assert_eq!(s.ll_slot_bytes, Some(slot), "chunk {chunk}");
        }
        // Reduce-scatter: the slice rounded up to 16-byte lines; all-gather-v: none.
        let s = validate_reduce_scatter(DType::BF16, 9 * 4, 9, 4).unwrap();
        assert_eq!((s.ll_slot_bytes, s.dtype), (Some(32), Some(DType::BF16)));
        let s = validate_all_gather_v(1, &[3, 4], 0, 3, 7, 2).unwrap();
        assert_eq!(s.ll_slot_bytes, None);
    }

    #[test]
    fn low_latency_is_chosen_by_size_forced_or_configured_and_bounded_by_the_slots() {
        let c = Config {
            capacity_bytes: 1 << 20,
            low_latency_max_bytes: Some(8 << 10),
            ..Config::default()
        };
        let both = facts(Ok(()), Ok(()));
        let ag = |len| validate_all_gather(1, len, len * 4, 4).unwrap();
        let rs = |len| validate_reduce_scatter(DType::F16, len * 4, len, 4).unwrap();
        // Auto: up to 8 KiB of lines per peer (4 KiB chunks; 4096 f16 slices).
        let kernel_of = |s: &CollShape, a| match route_collective(s, &c, a, both).unwrap().target {
            Target::Kernel(k, _) => Some(k),
            Target::Nccl => None,
        };
        assert_eq!(
            kernel_of(&ag(4096), Algorithm::Auto),
            Some(Kernel::AllGatherLowLatency)
        );
        assert_eq!(kernel_of(&ag(4097), Algorithm::Auto), Some(Kernel::AllGather));
        assert_eq!(
            kernel_of(&rs(4096), Algorithm::Auto),
            Some(Kernel::ReduceScatterLowLatency)
        );
        assert_eq!(kernel_of(&rs(4097), Algorithm::Auto), Some(Kernel::ReduceScatter));
        // Forced either way within the slots (the slots hold low_latency_limit bytes).
        assert_eq!(kernel_of(&ag(8), Algorithm::OneShot), Some(Kernel::AllGather));
        assert_eq!(kernel_of(&rs(8), Algorithm::OneShot), Some(Kernel::ReduceScatter));
        assert_eq!(
            kernel_of(&ag(4096), Algorithm::LowLatency),
            Some(Kernel::AllGatherLowLatency)
        );
        let e = route_collective(&ag(4097), &c, Algorithm::LowLatency, both).unwrap_err();
        assert!(
            matches!(
                e,
                Error::ExceedsCapacity {
                    bytes: 8208,
                    capacity: 8192
                }
            ),
            "{e}"
        );
        assert!(matches!(
            route_collective(&rs(4097), &c, Algorithm::LowLatency, both),
            Err(Error::ExceedsCapacity { .. })
        ));
        // Configured: low-latency where it fits, refused beyond (as the all-reduce).
        let ll = Config {
            algorithm: Algorithm::LowLatency,
            ..c.clone()
        };
        let r = route_collective(&rs(100), &ll, Algorithm::Auto, both).unwrap();
        assert!(matches!(
            r.target,
            Target::Kernel(Kernel::ReduceScatterLowLatency, _)
        ));
        let p = explain_collective(&rs(100), &r, &ll, both);
        assert!(p.reason.contains("Config::algorithm is low_latency"), "{p}");
        assert!(route_collective(&rs(5000), &ll, Algorithm::Auto, both).is_err());
        // Off when low_latency_max_bytes is 0 (forced still works while the slots hold it).
        let off = Config {
            low_latency_max_bytes: Some(0),
            ..c.clone()
        };
        let r = route_collective(&ag(1), &off, Algorithm::Auto, both).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::AllGather, _)));
        // The path says which kernel and why; the grid is one thread per line.
        let r = route_collective(&ag(4096), &c, Algorithm::Auto, both).unwrap();
        let p = explain_collective(&ag(4096), &r, &c, both);
        assert_eq!(p.algorithm, Algorithm::LowLatency);
        assert_eq!(p.plan.map(|p| p.blocks), Some(1));
        assert!(
            p.to_string().starts_with(
                "low_latency (1 blocks): low-latency all_gather kernel: 8192 bytes of lines per peer"
            ),
            "{p}"
        );
        let r = route_collective(&rs(4096), &c, Algorithm::LowLatency, both).unwrap();
        let p = explain_collective(&rs(4096), &r, &c, both);
        assert!(
            p.reason
                .contains("low_latency was asked for: the low-latency reduce_scatter"),
            "{p}"
        );
        // The reduce-scatter follows a tuning table's per-dtype threshold.
        let mut entries = Vec::new();
        for dtype in DType::ALL {
            entries.push(crate::config::Crossovers {
                dtype,
                world: 4,
                low_latency_max_bytes: if dtype == DType::F16 { 2048 } else { 16 << 10 },
                two_shot_ll_max_bytes: None,
                one_shot_max_bytes: 200_000,
                two_shot_max_bytes: None,
            });
        }
        let table = crate::config::TuningTable::new(crate::config::Measured::default(), entries).unwrap();
        // (An explicit low_latency_max_bytes would win over the table.)
        let tuned = Config {
            low_latency_max_bytes: None,
            ..c.clone()
        }
        .with_tuning(table);
        let r = route_collective(&rs(1024), &tuned, Algorithm::Auto, both).unwrap();
        assert!(matches!(
            r.target,
            Target::Kernel(Kernel::ReduceScatterLowLatency, _)
        ));
        let r = route_collective(&rs(1025), &tuned, Algorithm::Auto, both).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::ReduceScatter, _)));
    }

    #[test]
    fn collective_routing_allocates_nothing() {
        let c = Config::default();
        let both = facts(Ok(()), Ok(()));
        let shapes = [
            validate_all_gather(2, 1000, 4000, 4).unwrap(),
            validate_all_gather_v(1, &[1, 2, 3, 4], 0, 1, 10, 4).unwrap(),
            validate_reduce_scatter(DType::F32, 4000, 1000, 4).unwrap(),
            validate_all_gather(1, 100 << 10, 400 << 10, 4).unwrap(),
            validate_reduce_scatter(DType::BF16, 4 << 20, 1 << 20, 4).unwrap(),
        ];
        let before = super::super::route::allocations_for_tests();
        let mut sink = 0;
        for _ in 0..100 {
            for s in &shapes {
                sink += route_collective(s, &c, Algorithm::Auto, both).map_or(0, |r| r.bytes);
            }
        }
        assert!(sink > 0);
        assert_eq!(super::super::route::allocations_for_tests() - before, 0);
    }
}
