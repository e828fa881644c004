//! The fused all-reduce + residual + RMSNorm call, planned: its shape rules (typed errors
//! before anything is launched), its route (a `Copy` [`Route`] over the fused kernels, or NCCL
//! followed by the unfused epilogue) and the sentence [`crate::Communicator::add_rmsnorm_path`]
//! prints. Pure: tested on CPU.

use super::explain::{explain, PathDecision};
use super::grid::grid;
use super::route::{route, CallKind, PathFacts, Route, Rule, Target};
use super::{algorithm_of, Plan};
use crate::config::{Algorithm, Config, FusedLimit};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::abi::{MAX_BLOCKS, THREADS_PER_BLOCK};
use crate::kernels::norm_abi::MAX_HIDDEN;
use crate::kernels::registry::{Family, Kernel};

/// The lengths of one fused call, in elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct NormShape {
    pub(crate) dtype: DType,
    /// `input.len()`: `tokens × hidden`.
    pub(crate) input: usize,
    /// `residual.len()`.
    pub(crate) residual: usize,
    /// `norm_out.len()`.
    pub(crate) norm_out: usize,
    /// `weight.len()`: the hidden size.
    pub(crate) weight: usize,
    pub(crate) eps: f32,
}

fn bad(what: &'static str, reason: String) -> Error {
    Error::InvalidShape { what, reason }
}

impl NormShape {
    /// Checks the shape and returns `(tokens, hidden)`.
    pub(crate) fn validate(&self) -> Result<(usize, usize)> {
        let hidden = self.weight;
        let per_pack = self.dtype.per_pack();
        if self.input == 0 {
            return Err(Error::Empty);
        }
        if hidden == 0 || hidden % per_pack != 0 || hidden > MAX_HIDDEN {
            return Err(bad(
                "weight",
                format!(
                    "hidden size (weight length) {hidden} must be a multiple of {per_pack} ({} elements per \
                     16-byte pack) between {per_pack} and {MAX_HIDDEN}",
                    self.dtype
                ),
            ));
        }
        if self.input % hidden != 0 {
            return Err(bad(
                "input",
                format!(
                    "input length {} is not a whole number of rows of {hidden} (the weight length)",
                    self.input
                ),
            ));
        }
        for (what, len) in [("residual", self.residual), ("norm_out", self.norm_out)] {
            if len != self.input {
                return Err(bad(
                    what,
                    format!(
                        "{what} has {len} elements but input has {}: they must be equal",
                        self.input
                    ),
                ));
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(bad("eps", format!("eps {} must be finite and >= 0", self.eps)));
        }
        let tokens = self.input / hidden;
        if tokens > u32::MAX as usize {
            return Err(bad("input", format!("{tokens} rows exceed u32::MAX")));
        }
        Ok((tokens, hidden))
    }
}

/// The fused kernel of an algorithm (the multimem ones have none: asked for, they are refused
/// in `route_fused`; configured, the size rule decides).
fn fused_kernel(algorithm: Algorithm) -> Kernel {
    match algorithm {
        Algorithm::TwoShot => Kernel::FusedTwoShot,
        Algorithm::LowLatency => Kernel::FusedLowLatency,
        _ => Kernel::FusedOneShot,
    }
}

/// Routes a fused call of `tokens × hidden` elements (pure, allocation-free unless refused):
/// NCCL when asked for or configured, when there is no workspace, or (for `Auto` with a
/// fallback) above `nccl_above_bytes` or the capacity: the all-reduce then runs on NCCL and
/// the unfused epilogue kernel follows. Otherwise `Auto` takes, between ranks, the fused
/// low-latency kernel up to the all-reduce's low-latency limit where the device launches
/// thread-block clusters (each row spread over a cluster: [`fused_ll_plan`]; without clusters
/// a row is one block, too few threads polling, and the one-shot wins), the fused one-shot up
/// to the limit of [`Config::fused_limit`] (the tuning table's fused token limit for the
/// nearest measured hidden size, else the all-reduce's one-shot limit in bytes; one rank:
/// always) and the fused two-shot above it. `LowLatency` asked for or configured runs the
/// low-latency kernel; above the low-latency slots that is [`Error::ExceedsCapacity`], as for
/// the all-reduce.
pub(crate) fn route_fused(
    tokens: usize,
    hidden: usize,
    dtype: DType,
    config: &Config,
    requested: Algorithm,
    facts: PathFacts<'_>,
) -> Result<Route> {
    let bytes = tokens.saturating_mul(hidden).saturating_mul(dtype.size());
    let to_nccl = |rule| {
        Ok(Route {
            target: Target::Nccl,
            rule,
            bytes,
            dtype,
            threshold_ignored: false,
        })
    };
    if requested.is_multimem() {
        return Err(Error::InvalidConfig(format!(
            "Algorithm::{requested:?} has no fused kernel: pass Auto, LowLatency, OneShot, TwoShot or Nccl"
        )));
    }
    let chosen = if requested == Algorithm::Auto {
        config.algorithm
    } else {
        requested
    };
    if chosen == Algorithm::Nccl {
        return match facts.nccl {
            Ok(()) if requested == Algorithm::Nccl => to_nccl(Rule::NcclAskedFor),
            Ok(()) => to_nccl(Rule::NcclConfigured),
            Err(why) => Err(Error::NcclUnavailable {
                reason: format!("Algorithm::Nccl was asked for, but {why}"),
            }),
        };
    }
    if let Err(peer_why) = facts.peer_kernels {
        return match facts.nccl {
            Ok(()) => to_nccl(Rule::NoPeerKernels),
            Err(why) => Err(Error::NcclUnavailable {
                reason: format!("the peer kernels are not set up ({peer_why}) and {why}"),
            }),
        };
    }
    let mut threshold_ignored = false;
    if chosen == Algorithm::Auto {
        if config.nccl_above_bytes.is_some_and(|l| bytes > l) {
            match facts.nccl {
                Ok(()) => return to_nccl(Rule::AboveNcclThreshold),
                Err(_) => threshold_ignored = true,
            }
        }
        if bytes > config.capacity_bytes && facts.nccl.is_ok() {
            return to_nccl(Rule::AboveCapacity);
        }
    }
    if bytes > config.capacity_bytes {
        return Err(Error::ExceedsCapacity {
            bytes,
            capacity: config.capacity_bytes,
        });
    }
    let (algorithm, rule) = match (requested, config.algorithm) {
        // A configured multimem algorithm has no fused kernel: the size rule decides.
        (Algorithm::Auto, configured) if configured == Algorithm::Auto || configured.is_multimem() => (
            algorithm_of(size_rule_kernel(tokens, hidden, dtype, config, facts)),
            Rule::Size,
        ),
        (Algorithm::Auto, configured) => (configured, Rule::Configured),
        (asked, _) => (asked, Rule::AskedFor),
    };
    let kernel = fused_kernel(algorithm);
    if rule == Rule::Size && rows_outnumber_blocks(kernel, tokens, dtype, facts).is_some() {
        let all_reduce = route(
            CallKind::Buffers,
            tokens * hidden,
            dtype,
            config,
            Algorithm::Auto,
            facts,
        )?;
        return Ok(Route {
            rule: Rule::Size,
            threshold_ignored,
            ..all_reduce
        });
    }
    let plan = if kernel == Kernel::FusedLowLatency {
        let limit = config.low_latency_limit(facts.world);
        if bytes > limit {
            return Err(Error::ExceedsCapacity {
                bytes,
                capacity: limit,
            });
        }
        fused_ll_plan(tokens, hidden, dtype, facts)
    } else {
        grid(kernel, tokens, dtype, facts.world, facts.limits)
    };
    Ok(Route {
        target: Target::Kernel(kernel, plan),
        rule,
        bytes,
        dtype,
        threshold_ignored,
    })
}

/// The fused kernel of `Auto`'s size rule between ranks: the low-latency kernel up to the
/// all-reduce's low-latency limit where rows spread over thread-block clusters and every row
/// has a cluster (or a block) of its own, the one-shot up to [`Config::fused_limit`] (one rank: always),
/// the two-shot above.
fn size_rule_kernel(
    tokens: usize,
    hidden: usize,
    dtype: DType,
    config: &Config,
    facts: PathFacts<'_>,
) -> Kernel {
    let bytes = tokens.saturating_mul(hidden).saturating_mul(dtype.size());
    if facts.world > 1 && facts.clusters && bytes <= config.thresholds(dtype, facts.world).low_latency_max {
        // Only where every row has a cluster (or a block) of its own, which `fused_ll_plan`
        // makes so where the block limit allows: a cluster takes its rows in turns (4096 × 8
        // bf16 at W = 8 on a limit of 4 blocks, two rows a block: 11.6 µs, the one-shot 9.5).
        let plan = fused_ll_plan(tokens, hidden, dtype, facts);
        if plan.blocks as usize >= tokens * plan.cluster as usize {
            return Kernel::FusedLowLatency;
        }
    }
    let one_shot = facts.world == 1
        || match config.fused_limit(dtype, facts.world, hidden) {
            FusedLimit::Bytes(max) => bytes <= max,
            FusedLimit::Tokens { max, .. } => tokens <= max,
        };
    if one_shot {
        Kernel::FusedOneShot
    } else {
        Kernel::FusedTwoShot
    }
}

/// `Some(blocks)` when the fused one-shot or two-shot `kernel` would have fewer blocks than
/// `tokens` rows (between ranks): each block would then normalise its rows one after another,
/// while the all-reduce spreads the bytes over its whole grid and the epilogue kernel takes a
/// block per row, so `Auto` runs that pair instead (the same arithmetic, so the same bits).
fn rows_outnumber_blocks(kernel: Kernel, tokens: usize, dtype: DType, facts: PathFacts<'_>) -> Option<usize> {
    if facts.world < 2 || kernel == Kernel::FusedLowLatency {
        return None;
    }
    let blocks = grid(kernel, tokens, dtype, facts.world, facts.limits).blocks as usize;
    (tokens > blocks).then_some(blocks)
}

/// The largest thread-block cluster the fused low-latency kernel uses (the portable size).
const MAX_CLUSTER: usize = 8;
/// The fixed sum-of-squares tree's threads (kernels/fused_norm.cuh: 512 virtual threads).
const TREE_THREADS: usize = THREADS_PER_BLOCK as usize;

/// The grid of the fused low-latency kernel for `tokens` rows of `hidden`: each row spread
/// over a thread-block cluster of `cluster` blocks, block c owning the packs of virtual
/// threads `[c·512/cluster, (c+1)·512/cluster)` (a word of them per thread), so that the
/// row's sum of squares keeps the one-block tree's bits (kernels/fused_norm.cuh). The cluster
/// is as large as gives each thread about one word (blocks of at least 256 threads) and as
/// the row's stripes of 512 packs (so a block's share fits its 8 KiB of shared memory), at
/// most 8 and within the agreed block limit, and never so large that a block owns no pack;
/// where the rows outnumber such clusters, smaller ones (down to a block per row, as long as a
/// block's share still fits its shared memory), so that each row gets its own where the limit
/// allows (rows that share a cluster take turns).
/// Without clusters (compute capability below 9.0) a row is one block.
pub(crate) fn fused_ll_plan(tokens: usize, hidden: usize, dtype: DType, facts: PathFacts<'_>) -> Plan {
    let packs = hidden / dtype.per_pack();
    let stripes = packs.div_ceil(TREE_THREADS);
    let words = hidden * dtype.size() / 4;
    let cap = facts.limits.blocks(Family::OneShot).clamp(1, MAX_BLOCKS);
    let largest = if facts.clusters {
        MAX_CLUSTER.min(1 << cap.ilog2())
    } else {
        1
    };
    let wanted = 1 << (words / 256).clamp(1, MAX_CLUSTER).ilog2();
    let mut cluster = wanted.max(stripes.next_power_of_two()).min(largest);
    while cluster > 1 && (cluster - 1) * TREE_THREADS / cluster >= packs {
        cluster /= 2;
    }
    // Rows that outnumber the clusters the block limit allows: smaller clusters, down to a
    // block per row, so that every cluster takes one row (or the fewest), but never so small
    // that a block's share of a row leaves shared memory (more than `stripes` packs a virtual
    // thread). Measured at W = 8 on a limit of 4 blocks (docs/bench/fused-ll-groups-v21):
    // 8192 × 2 bf16 over two clusters of 2, 7.8 µs, against 8.0 on one cluster of 4 and 8.8
    // for the one-shot; 8192 × 4 on a block per row, parked in `norm_out`, 11.2 against the
    // one-shot's 9.0.
    while cluster > 1 && tokens > cap / cluster && cluster / 2 >= stripes {
        cluster /= 2;
    }
    let local_words = TREE_THREADS / cluster * stripes * 4;
    Plan {
        algorithm: Algorithm::LowLatency,
        blocks: (cluster * tokens.min(cap / cluster).max(1)) as u32,
        threads: local_words.min(TREE_THREADS) as u32,
        cluster: cluster as u32,
    }
}

/// The sentence for a fused route of `tokens` rows of `hidden`: the all-reduce's sentence (or,
/// where the tuning table's fused entry decided, its token limit), prefixed with what runs.
pub(crate) fn explain_fused(
    route: &Route,
    (tokens, hidden): (usize, usize),
    requested: Algorithm,
    config: &Config,
    facts: PathFacts<'_>,
) -> PathDecision {
    let mut d = explain(route, requested, config, facts);
    let size_rule = route.rule == Rule::Size;
    if let (true, Target::Kernel(kernel, _)) = (size_rule, route.target) {
        if !kernel.is_fused() {
            let fused = size_rule_kernel(tokens, hidden, route.dtype, config, facts);
            let blocks = rows_outnumber_blocks(fused, tokens, route.dtype, facts).unwrap_or(0);
            d.reason = format!(
                "all-reduce into norm_out, then the residual + RMSNorm kernel ({tokens} rows > the {} blocks \
                 of the fused {} kernel): {}",
                blocks,
                if fused == Kernel::FusedOneShot {
                    "one-shot"
                } else {
                    "two-shot"
                },
                d.reason
            );
            return d;
        }
    }
    if size_rule && facts.world == 1 {
        // The all-reduce's sentence would name its one-rank two-shot.
        d.reason = "one rank: the fused one-shot (no peers to wait for)".to_string();
    }
    if let (
        true,
        FusedLimit::Tokens {
            max,
            hidden: measured,
        },
    ) = (
        size_rule && facts.world > 1 && route.algorithm() != Algorithm::LowLatency,
        config.fused_limit(route.dtype, facts.world, hidden),
    ) {
        let cmp = if tokens <= max { "<=" } else { ">" };
        d.reason = format!(
            "{tokens} tokens {cmp} fused one-shot limit ({max} tokens, from the tuning table's entry for \
             hidden {measured})"
        );
    }
    let what = match route.target {
        Target::Kernel(Kernel::FusedTwoShot, _) => {
            "fused all-reduce + residual + RMSNorm, two-shot (reduction split by rows across ranks)"
        }
        Target::Kernel(Kernel::FusedLowLatency, plan) if plan.cluster > 1 => &format!(
            "fused all-reduce + residual + RMSNorm, low-latency (no barrier; each row over a cluster of {} blocks)",
            plan.cluster
        ),
        Target::Kernel(Kernel::FusedLowLatency, _) => {
            "fused all-reduce + residual + RMSNorm, low-latency (no barrier)"
        }
        Target::Kernel(..) => "fused all-reduce + residual + RMSNorm, one-shot",
        Target::Nccl => "NCCL all-reduce, then the residual + RMSNorm kernel",
    };
    d.reason = format!("{what}: {}", d.reason);
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Limits;

    const WIDE: Limits = Limits {
        one_shot_blocks: 32,
        two_shot_blocks: 16,
    };

    fn facts<'a>(world: usize, nccl: std::result::Result<(), &'a str>) -> PathFacts<'a> {
        PathFacts {
            world,
            limits: WIDE,
            peer_kernels: Ok(()),
            nccl,
            multicast: Err("no multicast in these tests"),
            clusters: true,
        }
    }

    fn shape(input: usize, weight: usize) -> NormShape {
        NormShape {
            dtype: DType::BF16,
            input,
            residual: input,
            norm_out: input,
            weight,
            eps: 1e-6,
        }
    }

    #[test]
    fn fused_low_latency_rows_spread_over_clusters() {
        // The decode shapes: a word per thread, 8 blocks a row.
        let at = |tokens, hidden, dtype, facts| {
            let p = fused_ll_plan(tokens, hidden, dtype, facts);
            (p.cluster, p.blocks, p.threads)
        };
        let f = facts(8, Ok(()));
        assert_eq!(at(1, 4096, DType::BF16, f), (8, 8, 256));
        assert_eq!(at(1, 8192, DType::BF16, f), (8, 8, 512));
        assert_eq!(at(2, 8192, DType::BF16, f), (8, 16, 512));
        // More rows than clusters of 8 in the 32 blocks: clusters of 2, a row each.
        assert_eq!(at(9, 8192, DType::BF16, f), (2, 18, 512));
        // Not below 2 blocks a row of 8192 bf16 (a block's share would leave shared memory):
        // 16 clusters of 2, 4 rows each.
        assert_eq!(at(64, 8192, DType::BF16, f), (2, 32, 512));
        assert_eq!(at(64, 4096, DType::BF16, f), (1, 32, 512)); // a block per row, 2 rows each
        let no_clusters = PathFacts { clusters: false, ..f };
        assert_eq!(at(3, 8192, DType::BF16, no_clusters), (1, 3, 512));
        let narrow = PathFacts {
            limits: Limits {
                one_shot_blocks: 6,
                two_shot_blocks: 6,
            },
            ..f
        };
        assert_eq!(at(1, 16384, DType::F32, narrow), (4, 4, 512));
        // Five rows of 16384 f32 (8 stripes) cannot shrink below the cluster of 4: they take turns.
        assert_eq!(at(5, 16384, DType::F32, narrow), (4, 4, 512));
        // Every shape: a power-of-two cluster of at most 8 (1 without clusters), whole
        // clusters within the block limit, every block owning packs of the row, and a
        // thread for each of its virtual threads.
        for clusters in [true, false] {
            for cap in [1, 3, 4, 8, 32, 64] {
                let facts = PathFacts {
                    clusters,
                    limits: Limits {
                        one_shot_blocks: cap,
                        two_shot_blocks: cap,
                    },
                    ..f
                };
                for dtype in DType::ALL {
                    for hidden in (1..=MAX_HIDDEN / dtype.per_pack())
                        .map(|p| p * dtype.per_pack())
                        .step_by(7)
                    {
                        for tokens in [1, 2, 5, 64] {
                            let p = fused_ll_plan(tokens, hidden, dtype, facts);
                            let (c, b, t) = (p.cluster as usize, p.blocks as usize, p.threads as usize);
                            let what =
                                format!("{dtype} {tokens}x{hidden} cap {cap} clusters {clusters}: {p:?}");
                            assert!(c.is_power_of_two() && c <= if clusters { 8 } else { 1 }, "{what}");
                            assert!(b % c == 0 && b <= cap.max(c) && b / c <= tokens, "{what}");
                            // Clusters shrink until every row has its own (down to a block),
                            // while a block's share of a row fits its shared memory.
                            let packs = hidden / dtype.per_pack();
                            let stripes = packs.div_ceil(512);
                            assert!(
                                c == 1 || b / c == tokens || c / 2 < stripes,
                                "{what}: rows share clusters"
                            );
                            assert!((c - 1) * 512 / c < packs, "{what}: the last block owns no pack");
                            assert!(t >= 512 / c && t <= 512 && t % 32 == 0, "{what}");
                            assert_eq!(p.algorithm, Algorithm::LowLatency);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn shapes_are_checked_with_typed_errors() {
        assert_eq!(shape(8192 * 3, 8192).validate().unwrap(), (3, 8192));
        assert_eq!(shape(7168, 7168).validate().unwrap(), (1, 7168));
        assert_eq!(shape(16384 * 512, 16384).validate().unwrap(), (512, 16384));
        assert!(matches!(shape(0, 8192).validate(), Err(Error::Empty)));
        for (input, weight) in [(8192, 0), (8196, 4100), (32768 * 2, 32768), (100, 12)] {
            assert!(
                matches!(
                    shape(input, weight).validate(),
                    Err(Error::InvalidShape { what: "weight", .. })
                ),
                "{input} {weight}"
            );
        }
        assert!(matches!(
            shape(8192 + 8, 8192).validate(),
            Err(Error::InvalidShape { what: "input", .. })
        ));
        let mut s = shape(8192, 1024);
        s.residual = 1024;
        assert!(matches!(
            s.validate(),
            Err(Error::InvalidShape { what: "residual", .. })
        ));
        let mut s = shape(8192, 1024);
        s.norm_out = 8200;
        assert!(matches!(
            s.validate(),
            Err(Error::InvalidShape { what: "norm_out", .. })
        ));
        for eps in [f32::NAN, -1e-6, f32::INFINITY] {
            let mut s = shape(8192, 1024);
            s.eps = eps;
            assert!(matches!(
                s.validate(),
                Err(Error::InvalidShape { what: "eps", .. })
            ));
        }
        // f32 packs hold 4 elements: a hidden size of 4 is fine there, not for bf16.
        let mut s = shape(12, 4);
        s.dtype = DType::F32;
        assert_eq!(s.validate().unwrap(), (3, 4));
    }

    #[test]
    fn auto_routes_by_size_and_grids_are_one_block_per_row() {
        let c = Config::default();
        let f = facts(8, Ok(()));
        // 8192 × 1 bf16 = 16 KiB, within the all-reduce's low-latency limit: with clusters the
        // fused low-latency kernel, a row over 8 blocks.
        let r = route_fused(1, 8192, DType::BF16, &c, Algorithm::Auto, f).unwrap();
        assert_eq!(
            r.target,
            Target::Kernel(Kernel::FusedLowLatency, fused_ll_plan(1, 8192, DType::BF16, f))
        );
        let d = explain_fused(&r, (1, 8192), Algorithm::Auto, &c, f);
        assert!(
            d.reason.starts_with(
                "fused all-reduce + residual + RMSNorm, low-latency (no barrier; each row over a cluster of 8 \
                 blocks): 16384 bytes <= low-latency limit"
            ),
            "{}",
            d.reason
        );
        // Up to the limit (4 rows of 8192 bf16 = 64 KiB), then the one-shot.
        let route_of = |tokens, f| route_fused(tokens, 8192, DType::BF16, &c, Algorithm::Auto, f).unwrap();
        assert_eq!(route_of(4, f).algorithm(), Algorithm::LowLatency);
        assert_eq!(route_of(5, f).algorithm(), Algorithm::OneShot);
        // Four blocks a rank (eight virtual ranks sharing 132 SMs): one row over a cluster of
        // four, two over two clusters of two; three or four would share them (a block's share
        // of a row of 8192 bf16 past two blocks leaves shared memory): the one-shot.
        let narrow = PathFacts {
            limits: Limits {
                one_shot_blocks: 4,
                two_shot_blocks: 4,
            },
            ..f
        };
        let r = route_of(1, narrow);
        assert_eq!(
            r.target,
            Target::Kernel(
                Kernel::FusedLowLatency,
                fused_ll_plan(1, 8192, DType::BF16, narrow)
            )
        );
        let Target::Kernel(_, p) = r.target else {
            unreachable!()
        };
        assert_eq!((p.blocks, p.cluster), (4, 4));
        let Target::Kernel(kernel, p) = route_of(2, narrow).target else {
            panic!("NCCL")
        };
        assert_eq!((kernel, p.blocks, p.cluster), (Kernel::FusedLowLatency, 4, 2));
        for tokens in [3, 4] {
            assert_eq!(route_of(tokens, narrow).algorithm(), Algorithm::OneShot);
        }
        // A row of 4096 bf16 fits one block's shared memory: every row its own cluster or
        // block, up to 4 rows.
        for tokens in 1..=4 {
            let r = route_fused(tokens, 4096, DType::BF16, &c, Algorithm::Auto, narrow).unwrap();
            let Target::Kernel(kernel, p) = r.target else {
                panic!("NCCL")
            };
            assert_eq!(kernel, Kernel::FusedLowLatency, "{tokens} rows");
            assert_eq!(p.blocks as usize, tokens * p.cluster as usize, "{tokens} rows");
        }
        // One rank, or a device without clusters: never the low-latency kernel.
        assert_eq!(route_of(1, facts(1, Ok(()))).algorithm(), Algorithm::OneShot);
        let no_clusters = PathFacts { clusters: false, ..f };
        let r = route_of(1, no_clusters);
        assert_eq!(
            r.target,
            Target::Kernel(
                Kernel::FusedOneShot,
                grid(Kernel::FusedOneShot, 1, DType::BF16, 8, WIDE)
            )
        );
        let Target::Kernel(_, p) = r.target else {
            unreachable!()
        };
        assert_eq!((p.blocks, p.algorithm), (1, Algorithm::OneShot));
        let d = explain_fused(&r, (1, 8192), Algorithm::Auto, &c, no_clusters);
        assert!(
            d.reason.starts_with(
                "fused all-reduce + residual + RMSNorm, one-shot: 16384 bytes <= one-shot limit"
            ),
            "{}",
            d.reason
        );
        let kernel = |tokens| match route_fused(tokens, 8192, DType::BF16, &c, Algorithm::Auto, no_clusters)
            .unwrap()
            .target
        {
            Target::Kernel(k, _) => k,
            Target::Nccl => panic!("NCCL"),
        };
        for tokens in 1..=16 {
            assert_eq!(kernel(tokens), Kernel::FusedOneShot, "{tokens} tokens");
        }
        // 8192 × 16 bf16 = 256 KiB: one-shot, one block per row.
        let r = route_fused(16, 8192, DType::BF16, &c, Algorithm::Auto, f).unwrap();
        let Target::Kernel(k, p) = r.target else { panic!() };
        assert_eq!((k, p.blocks), (Kernel::FusedOneShot, 16));
        // 16 rows of 8200 bf16 = 262400 bytes > 256 KiB: two-shot, one block per row up to the
        // two-shot limit (16 here)...
        let r = route_fused(16, 8200, DType::BF16, &c, Algorithm::Auto, f).unwrap();
        let Target::Kernel(k, p) = r.target else { panic!() };
        assert_eq!(
            (k, p.blocks, p.algorithm),
            (Kernel::FusedTwoShot, 16, Algorithm::TwoShot)
        );
        // ... and with more rows than that the all-reduce, then the epilogue kernel: 8192 × 32
        // bf16 = 512 KiB > 256 KiB at W=8, the all-reduce's own choice (two-shot) and grid.
        let r = route_fused(32, 8192, DType::BF16, &c, Algorithm::Auto, f).unwrap();
        assert_eq!(
            r.target,
            route(CallKind::Buffers, 32 * 8192, DType::BF16, &c, Algorithm::Auto, f)
                .unwrap()
                .target
        );
        assert_eq!(
            r.target,
            Target::Kernel(
                Kernel::TwoShot,
                grid(Kernel::TwoShot, 32 * 8192, DType::BF16, 8, WIDE)
            )
        );
        let d = explain_fused(&r, (32, 8192), Algorithm::Auto, &c, f);
        assert!(
            d.reason.starts_with(
                "all-reduce into norm_out, then the residual + RMSNorm kernel (32 rows > the 16 blocks of the \
                 fused two-shot kernel): 524288 bytes > one-shot limit"
            ),
            "{}",
            d.reason
        );
        // Asked for, the fused kernel runs whatever the rows (a block takes several).
        let r = route_fused(32, 8192, DType::BF16, &c, Algorithm::TwoShot, f).unwrap();
        assert_eq!(
            r.target,
            Target::Kernel(
                Kernel::FusedTwoShot,
                grid(Kernel::FusedTwoShot, 32, DType::BF16, 8, WIDE)
            )
        );
        let r = route_fused(5, 8192, DType::BF16, &c, Algorithm::TwoShot, f).unwrap();
        let Target::Kernel(_, p) = r.target else { panic!() };
        assert_eq!(p.blocks, 5);
        // Grids are capped by the agreed limits.
        let r = route_fused(512, 1024, DType::BF16, &c, Algorithm::OneShot, f).unwrap();
        let Target::Kernel(_, p) = r.target else { panic!() };
        assert_eq!(p.blocks, 32);
        let r = route_fused(512, 1024, DType::BF16, &c, Algorithm::TwoShot, f).unwrap();
        let Target::Kernel(_, p) = r.target else { panic!() };
        assert_eq!(p.blocks, 16);
        // Low-latency asked for: its fused kernel (a row of 1024 bf16 is 128 packs, too few
        // for a second block of the tree's 512 virtual threads: one block per row); beyond
        // the low-latency slots a typed error, as for the all-reduce.
        let r = route_fused(7, 1024, DType::BF16, &c, Algorithm::LowLatency, f).unwrap();
        let Target::Kernel(k, p) = r.target else { panic!() };
        assert_eq!((k, p.blocks, p.cluster), (Kernel::FusedLowLatency, 7, 1));
        let d = explain_fused(&r, (7, 1024), Algorithm::LowLatency, &c, f);
        assert!(d.reason.contains("low-latency (no barrier)"), "{}", d.reason);
        assert!(matches!(
            route_fused(5, 8192, DType::BF16, &c, Algorithm::LowLatency, f),
            Err(Error::ExceedsCapacity {
                bytes: 81920,
                capacity: 65536
            })
        ));
        let configured = Config {
            algorithm: Algorithm::LowLatency,
            ..Config::default()
        };
        let r = route_fused(4, 8192, DType::BF16, &configured, Algorithm::Auto, f).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::FusedLowLatency, _)));
        assert!(route_fused(5, 8192, DType::BF16, &configured, Algorithm::Auto, f).is_err());
        // The multimem algorithms have no fused kernel: refused when asked for, the size rule
        // when configured.
        for mm in [
            Algorithm::Multimem,
            Algorithm::MultimemOneShot,
            Algorithm::MultimemLowLatency,
        ] {
            assert!(matches!(
                route_fused(1, 8192, DType::BF16, &c, mm, f),
                Err(Error::InvalidConfig(why)) if why.contains("no fused kernel")
            ));
            let configured = Config {
                algorithm: mm,
                ..Config::default()
            };
            let r = route_fused(1, 8192, DType::BF16, &configured, Algorithm::Auto, f).unwrap();
            assert_eq!((r.algorithm(), r.rule), (Algorithm::LowLatency, Rule::Size));
            let r = route_fused(5, 8192, DType::BF16, &configured, Algorithm::Auto, f).unwrap();
            assert_eq!((r.algorithm(), r.rule), (Algorithm::OneShot, Rule::Size));
        }
        // The unfused kernel takes any grid.
        assert_eq!(grid(Kernel::RmsNorm, 512, DType::BF16, 8, WIDE).blocks, 512);
    }

    #[test]
    fn nccl_and_capacity_rules() {
        let c = Config {
            capacity_bytes: 1 << 20,
            low_latency_max_bytes: Some(32 << 10),
            ..Config::default()
        };
        let with = facts(4, Ok(()));
        let without = facts(4, Err("no fallback"));
        let r = route_fused(512, 8192, DType::BF16, &c, Algorithm::Auto, with).unwrap();
        assert_eq!(r.target, Target::Nccl);
        let d = explain_fused(&r, (512, 8192), Algorithm::Auto, &c, with);
        assert!(d.reason.starts_with("NCCL all-reduce, then"), "{}", d.reason);
        assert!(matches!(
            route_fused(512, 8192, DType::BF16, &c, Algorithm::Auto, without),
            Err(Error::ExceedsCapacity { .. })
        ));
        assert!(matches!(
            route_fused(1, 8192, DType::BF16, &c, Algorithm::Nccl, without),
            Err(Error::NcclUnavailable { .. })
        ));
        let r = route_fused(1, 8192, DType::BF16, &c, Algorithm::Nccl, with).unwrap();
        assert_eq!(r.target, Target::Nccl);
        let d = explain_fused(
            &route_fused(4, 8192, DType::F16, &c, Algorithm::Auto, with).unwrap(),
            (4, 8192),
            Algorithm::Auto,
            &c,
            with,
        );
        assert!(
            d.reason
                .starts_with("fused all-reduce + residual + RMSNorm, one-shot"),
            "{}",
            d.reason
        );
    }

    /// A table whose only fused entries are bf16 at W=8: one-shot up to 4 tokens at hidden
    /// 4096, up to 64 at 8192 (no all-reduce entries).
    fn fused_table() -> crate::config::TuningTable {
        use crate::config::{FusedCrossovers, Measured, TuningTable};
        let entry = |hidden, one_shot_max_tokens| FusedCrossovers {
            dtype: DType::BF16,
            world: 8,
            hidden,
            one_shot_max_tokens,
        };
        TuningTable::new(Measured::default(), vec![])
            .unwrap()
            .with_fused(vec![entry(4096, 4), entry(8192, 64)])
            .unwrap()
    }

    fn auto(tokens: usize, hidden: usize, dtype: DType, c: &Config, world: usize) -> Kernel {
        // Grids large enough that no row count here outnumbers the blocks.
        let roomy = PathFacts {
            limits: Limits {
                one_shot_blocks: 128,
                two_shot_blocks: 128,
            },
            ..facts(world, Ok(()))
        };
        match route_fused(tokens, hidden, dtype, c, Algorithm::Auto, roomy)
            .unwrap()
            .target
        {
            Target::Kernel(k, _) => k,
            Target::Nccl => panic!("{tokens}x{hidden}: NCCL"),
        }
    }

    #[test]
    fn a_loaded_table_moves_the_fused_auto_choice() {
        // Low-latency off: this is about the one-shot / two-shot split.
        let published = Config {
            low_latency_max_bytes: Some(0),
            ..Config::default()
        };
        let tuned = published.clone().with_tuning(fused_table());
        // 8192 × 32 bf16 = 512 KiB: above the published 256 KiB at W=8 (two-shot); the table
        // keeps one-shot up to 64 tokens.
        assert_eq!(auto(32, 8192, DType::BF16, &published, 8), Kernel::FusedTwoShot);
        assert_eq!(auto(32, 8192, DType::BF16, &tuned, 8), Kernel::FusedOneShot);
        assert_eq!(auto(64, 8192, DType::BF16, &tuned, 8), Kernel::FusedOneShot);
        // 65 rows outnumber any grid (at most 64 blocks): the all-reduce and the epilogue.
        assert_eq!(auto(65, 8192, DType::BF16, &tuned, 8), Kernel::TwoShot);
        // 4096 × 8 bf16 = 64 KiB: one-shot by the published rule, two-shot by the table.
        assert_eq!(auto(8, 4096, DType::BF16, &published, 8), Kernel::FusedOneShot);
        assert_eq!(auto(8, 4096, DType::BF16, &tuned, 8), Kernel::FusedTwoShot);
        assert_eq!(auto(4, 4096, DType::BF16, &tuned, 8), Kernel::FusedOneShot);
        // An unmeasured hidden size takes the nearest entry: 7168 -> 8192, 5120 -> 4096.
        assert_eq!(auto(64, 7168, DType::BF16, &tuned, 8), Kernel::FusedOneShot);
        assert_eq!(auto(5, 5120, DType::BF16, &tuned, 8), Kernel::FusedTwoShot);
        // Another dtype or world: the published rule (f16 8192 × 32 = 512 KiB > 256 KiB;
        // W=4: bf16 8192 × 32 = 512 KiB <= 512 KiB).
        assert_eq!(auto(32, 8192, DType::F16, &tuned, 8), Kernel::FusedTwoShot);
        assert_eq!(auto(32, 8192, DType::BF16, &tuned, 4), Kernel::FusedOneShot);
        assert_eq!(auto(33, 8192, DType::BF16, &tuned, 4), Kernel::FusedTwoShot);
        // One rank: always the one-shot copy, and the sentence says so.
        assert_eq!(auto(512, 8192, DType::BF16, &tuned, 1), Kernel::FusedOneShot);
        let one = facts(1, Ok(()));
        let r = route_fused(512, 8192, DType::BF16, &tuned, Algorithm::Auto, one).unwrap();
        let d = explain_fused(&r, (512, 8192), Algorithm::Auto, &tuned, one);
        assert_eq!(
            d.reason,
            "fused all-reduce + residual + RMSNorm, one-shot: one rank: the fused one-shot (no peers to wait for)"
        );
        // The explicit field wins over the table.
        let explicit = Config {
            one_shot_max_bytes: Some(16 << 10),
            ..tuned.clone()
        };
        assert_eq!(auto(2, 8192, DType::BF16, &explicit, 8), Kernel::FusedTwoShot);
        // A forced algorithm is not moved, and the table does not route to NCCL.
        let r = route_fused(1, 8192, DType::BF16, &tuned, Algorithm::TwoShot, facts(8, Ok(()))).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::FusedTwoShot, _)));
        // (512 rows: the all-reduce and the epilogue kernel.)
        let r = route_fused(512, 8192, DType::BF16, &tuned, Algorithm::Auto, facts(8, Ok(()))).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::TwoShot, _)));
        // The sentence names the token limit and the measured hidden size it came from.
        let f = facts(8, Ok(()));
        let why = |tokens, hidden, c: &Config| {
            let r = route_fused(tokens, hidden, DType::BF16, c, Algorithm::Auto, f).unwrap();
            explain_fused(&r, (tokens, hidden), Algorithm::Auto, c, f).reason
        };
        assert_eq!(
            why(32, 7168, &tuned),
            "fused all-reduce + residual + RMSNorm, one-shot: 32 tokens <= fused one-shot limit \
             (64 tokens, from the tuning table's entry for hidden 8192)"
        );
        assert!(why(65, 8192, &tuned).starts_with(
            "all-reduce into norm_out, then the residual + RMSNorm kernel (65 rows > the 16 blocks of the fused \
             two-shot kernel)"
        ));
        assert!(why(32, 8192, &published).ends_with("524288 bytes > one-shot limit (262144)"));
        assert!(why(2, 8192, &explicit).contains("bytes > one-shot limit (16384)"));
    }
}
