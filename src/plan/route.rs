//! Where a call goes: the decision every call takes, as a `Copy` value without text (the
//! sentence that explains it is built only when asked for, by [`super::explain`]).

use super::grid::{choose, grid};
use super::{algorithm_of, kernel_for, Limits, Plan};
use crate::config::{Algorithm, Config};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::registry::Kernel;

/// What a call reduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallKind {
    /// The caller's buffers (out of place or in place): copied into the workspace.
    Buffers,
    /// The symmetric buffer itself: the zero-copy in-place two-shot kernel.
    Symmetric,
    /// A buffer of the communicator's symmetric pool, reduced in place
    /// (`all_reduce_pool`: the API call, the same on every rank, says so; never a pointer
    /// test): zero-copy above the low-latency and one-shot ranges (`copies_in_first`), not
    /// bounded by `capacity_bytes` or `nccl_above_bytes` (the data never passes the workspace).
    Pool,
    /// Out of place from a pool buffer (`all_reduce_from_pool`): the zero-copy two-shot above
    /// the low-latency and one-shot ranges, whose reduced slices pass the data buffers, so up
    /// to `capacity_bytes`.
    PoolInput,
}

/// What a communicator can do, as far as routing is concerned.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PathFacts<'a> {
    /// Number of ranks.
    pub(crate) world: usize,
    /// Agreed kernel grid limits.
    pub(crate) limits: Limits,
    /// `Err(why)` when the symmetric workspace is not set up (every call goes to NCCL).
    pub(crate) peer_kernels: std::result::Result<(), &'a str>,
    /// `Err(why)` when there is no NCCL fallback.
    pub(crate) nccl: std::result::Result<(), &'a str>,
    /// `Err(why)` when no multicast object is set up (the multimem kernel cannot run).
    pub(crate) multicast: std::result::Result<(), &'a str>,
    /// The device launches thread-block clusters (compute capability 9.0 and newer): the
    /// fused low-latency kernel spreads a row over several blocks.
    pub(crate) clusters: bool,
}

/// The rule that decided a route (rendered as a sentence by [`super::explain`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rule {
    /// `Algorithm::Nccl` passed to the call.
    NcclAskedFor,
    /// `Config::algorithm` is `Nccl`.
    NcclConfigured,
    /// No symmetric workspace.
    NoPeerKernels,
    /// `Auto` above `Config::nccl_above_bytes`.
    AboveNcclThreshold,
    /// `Auto` above the capacity, with a fallback.
    AboveCapacity,
    /// The size rule of `Auto` (see [`choose`]).
    Size,
    /// `Config::algorithm` names the kernel.
    Configured,
    /// The call names the kernel.
    AskedFor,
    /// A call on the symmetric buffer: the in-place kernel.
    Symmetric,
    /// `Auto` on the symmetric buffer above the one-shot range, multicast set up and
    /// `Config::reproducible` off: the multimem in-place kernel.
    Multimem,
    /// The size rule of `Auto` on a buffer call, with multicast set up: the multimem variant of
    /// the size rule's kernel (the low-latency one always, the one-shot one only with
    /// `Config::reproducible` off; see [`multimem_variant`]).
    MultimemSize,
    /// A call on a pool buffer: the in-place kernel on the pool, zero-copy.
    Pool,
    /// An out-of-place call from a pool buffer: the zero-copy two-shot.
    PoolInput,
}

/// Where one call goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// A peer kernel with its grid.
    Kernel(Kernel, Plan),
    /// `ncclAllReduce` through the fallback.
    Nccl,
}

/// The decision for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Route {
    pub(crate) target: Target,
    pub(crate) rule: Rule,
    /// Message bytes.
    pub(crate) bytes: usize,
    /// Element type (the thresholds of `Auto` depend on it).
    pub(crate) dtype: DType,
    /// Set when `Config::nccl_above_bytes` was passed but there is no fallback to use.
    pub(crate) threshold_ignored: bool,
}

impl Route {
    /// The algorithm the route runs (never `Auto`).
    pub(crate) fn algorithm(&self) -> Algorithm {
        match self.target {
            Target::Kernel(k, _) => algorithm_of(k),
            Target::Nccl => Algorithm::Nccl,
        }
    }
}

/// Routes a call (pure; every rank decides the same; no allocation unless it refuses):
/// 1. `Algorithm::Nccl` (asked for, or configured) → NCCL, or an error without a fallback;
/// 2. no symmetric workspace → NCCL;
/// 3. a symmetric-buffer call → the multimem in-place kernel when asked for (an error without
///    multicast), or under `Auto` above the one-shot limit when multicast is set up and
///    `Config::reproducible` is off; otherwise the in-place kernel; a pool call → the in-place kernel on the pool buffer (any
///    size: it never passes the workspace);
/// 4. a kernel asked for (or configured) → that kernel; a multimem one without multicast is
///    [`Error::MulticastUnavailable`];
/// 5. `Auto`: above `nccl_above_bytes` (or the tuning table's two-shot maximum), or above
///    `capacity_bytes`, → NCCL when there is a fallback; otherwise the size rule of [`choose`],
///    with the size rule's kernel replaced by its multimem variant when multicast is set up
///    ([`multimem_variant`]).
///
/// A kernel route above `capacity_bytes` (or a low-latency one above its slots) is refused
/// with [`Error::ExceedsCapacity`], never silently rerouted.
pub(crate) fn route(
    kind: CallKind,
    len: usize,
    dtype: DType,
    config: &Config,
    requested: Algorithm,
    facts: PathFacts<'_>,
) -> Result<Route> {
    let bytes = len.saturating_mul(dtype.size());
    let to_nccl = |rule| {
        Ok(Route {
            target: Target::Nccl,
            rule,
            bytes,
            dtype,
            threshold_ignored: false,
        })
    };
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
    // Pool calls take what an ordinary buffer takes (in place too) where the size rule picks a
    // kernel with one barrier or none: the low-latency kernel copies nothing in anyway, and the
    // one-shot's copy-in costs less than the zero-copy kernels' second barrier (8 virtual ranks
    // on one H100, bf16, chain of 10: 128 KiB one-shot 7.52 µs, zero-copy in place 10.63). Above
    // the one-shot range (or past an NCCL threshold) the zero-copy kernels read the pool.
    let kind = match kind {
        CallKind::Pool | CallKind::PoolInput
            if copies_in_first(bytes, dtype, config, requested, facts.world) =>
        {
            CallKind::Buffers
        }
        other => other,
    };
    let zero_copy = match kind {
        CallKind::Pool => Some((Kernel::InPlace, Rule::Pool)),
        CallKind::PoolInput if bytes <= config.capacity_bytes => Some((Kernel::PoolTwoShot, Rule::PoolInput)),
        _ => None,
    };
    if let Some((kernel, rule)) = zero_copy {
        return Ok(Route {
            target: Target::Kernel(kernel, grid(kernel, len, dtype, facts.world, facts.limits)),
            rule,
            bytes,
            dtype,
            threshold_ignored: false,
        });
    }
    let mut threshold_ignored = false;
    if chosen == Algorithm::Auto {
        if config
            .thresholds(dtype, facts.world)
            .nccl_above
            .is_some_and(|l| bytes > l)
        {
            match facts.nccl {
                Ok(()) => return to_nccl(Rule::AboveNcclThreshold),
                Err(_) => threshold_ignored = true,
            }
        }
        if bytes > config.capacity_bytes && facts.nccl.is_ok() {
            return to_nccl(Rule::AboveCapacity);
        }
    }
    let ll_limit = config.low_latency_limit(facts.world);
    if bytes > config.capacity_bytes {
        return Err(Error::ExceedsCapacity {
            bytes,
            capacity: config.capacity_bytes,
        });
    }
    let (kernel, rule) = match kind {
        CallKind::Symmetric if chosen == Algorithm::Multimem => match facts.multicast {
            Ok(()) if requested == Algorithm::Multimem => (Kernel::InPlaceMultimem, Rule::AskedFor),
            Ok(()) => (Kernel::InPlaceMultimem, Rule::Configured),
            Err(why) => {
                return Err(Error::MulticastUnavailable {
                    reason: format!("Algorithm::Multimem was asked for, but {why}"),
                })
            }
        },
        CallKind::Symmetric
            if chosen == Algorithm::Auto
                && facts.multicast.is_ok()
                && !config.reproducible
                && facts.world > 1
                && bytes > config.one_shot_limit(dtype, facts.world) =>
        {
            (Kernel::InPlaceMultimem, Rule::Multimem)
        }
        CallKind::Symmetric | CallKind::Pool => (Kernel::InPlace, Rule::Symmetric),
        CallKind::Buffers if requested == Algorithm::Multimem => {
            return Err(Error::InvalidConfig(
                "Algorithm::Multimem runs only the zero-copy call on the symmetric buffer \
                 (all_reduce_symmetric); buffer calls take the peer kernels or NCCL"
                    .into(),
            ))
        }
        CallKind::Buffers | CallKind::PoolInput => {
            let rule = match (requested, config.algorithm) {
                (Algorithm::Auto, Algorithm::Auto) => Rule::Size,
                (Algorithm::Auto, _) => Rule::Configured,
                _ => Rule::AskedFor,
            };
            // The size rule decides (a configured Multimem leaves buffer calls to it).
            let sized = requested == Algorithm::Auto
                && matches!(config.algorithm, Algorithm::Auto | Algorithm::Multimem);
            let algorithm = choose(bytes, dtype, facts.world, config, requested);
            // Auto and Nccl were handled above: every other algorithm names a kernel.
            let kernel = kernel_for(algorithm).ok_or_else(|| {
                Error::InvalidConfig(format!("algorithm {algorithm} does not name a kernel"))
            })?;
            match multimem_variant(kernel, config, facts) {
                Some(multimem) if sized => (multimem, Rule::MultimemSize),
                _ => (two_shot_variant(kernel, bytes, facts.world, ll_limit), rule),
            }
        }
    };
    if matches!(kernel, Kernel::OneShotMultimem | Kernel::LowLatencyMultimem) {
        if let Err(why) = facts.multicast {
            return Err(Error::MulticastUnavailable {
                reason: format!("Algorithm::{:?} was asked for, but {why}", algorithm_of(kernel)),
            });
        }
    }
    if matches!(kernel, Kernel::LowLatency | Kernel::LowLatencyMultimem) && bytes > ll_limit {
        return Err(Error::ExceedsCapacity {
            bytes,
            capacity: ll_limit,
        });
    }
    Ok(Route {
        target: Target::Kernel(kernel, grid(kernel, len, dtype, facts.world, facts.limits)),
        rule,
        bytes,
        dtype,
        threshold_ignored,
    })
}

/// Whether `Auto` sends a pool call of `bytes` through the buffer route: where the size rule
/// takes the low-latency kernel (whatever the NCCL threshold), or the one-shot (or the tuning
/// table's two-shot band, which lies within the one-shot's range and copies in as the one-shot
/// does) within the capacity and at most the NCCL threshold (`Config::thresholds`).
fn copies_in_first(bytes: usize, dtype: DType, config: &Config, requested: Algorithm, world: usize) -> bool {
    if requested != Algorithm::Auto || !matches!(config.algorithm, Algorithm::Auto | Algorithm::Multimem) {
        return false;
    }
    let th = config.thresholds(dtype, world);
    match choose(bytes, dtype, world, config, Algorithm::Auto) {
        Algorithm::LowLatency => true,
        Algorithm::OneShot | Algorithm::TwoShot if bytes <= th.one_shot_max => {
            bytes <= config.capacity_bytes && th.nccl_above.is_none_or(|l| bytes <= l)
        }
        _ => false,
    }
}

/// The two-shot's kernel for a call of `bytes`: the one over the low-latency lines (no
/// barrier) where both halves of a shard, `2·⌈⌈bytes/16⌉/W⌉` lines of 16 bytes, fit
/// [`two_shot_ll_bound`] of the low-latency limit `ll_limit`, the barrier two-shot above it
/// and for a lone rank. Every other kernel is returned as it is.
fn two_shot_variant(kernel: Kernel, bytes: usize, world: usize, ll_limit: usize) -> Kernel {
    if kernel == Kernel::TwoShot && world > 1 && two_shot_ll_fits(bytes, world, ll_limit) {
        Kernel::TwoShotLowLatency
    } else {
        kernel
    }
}

/// Whether both halves of a shard of a `bytes` call, `2·⌈⌈bytes/16⌉/W⌉` lines of 16 bytes,
/// fit [`two_shot_ll_bound`] of the low-latency limit `ll_limit`.
pub(crate) fn two_shot_ll_fits(bytes: usize, world: usize, ll_limit: usize) -> bool {
    let shard_lines = bytes.div_ceil(16).div_ceil(world.max(1));
    2 * 16 * shard_lines <= two_shot_ll_bound(ll_limit, world)
}

/// The most bytes both halves of a shard of the two-shot over the low-latency lines may take
/// at `world` ranks: the low-latency limit `ll_limit` (so its window is no larger than a
/// low-latency call's, and the slots' rotation keeps differing calls apart the same way) and
/// the kernel's own measured bound, whichever is smaller: 256 KiB up to four ranks, 32 KiB
/// above (W = 2 and 4 calls up to 256 and 512 KiB, W = 8 to 128 KiB).
///
/// The bound is the kernel's own, not the low-latency threshold's. One H100, eight virtual
/// ranks, bf16, chain of 10: with the bound at 256 KiB, 384 KiB took 10.4 µs against the
/// barrier kernel's 12.3, 512 KiB 12.9 against 12.6 and 1 MiB 22.2 against 15.3
/// (docs/bench/h100-tune-v17); with it at 64 KiB (W = 8 calls to 256 KiB) it beat the one-shot
/// at 192–256 KiB but lost at 96–128 KiB (docs/bench/h100-ll64-v18): a band apart from the
/// low-latency range, which a tuning table's `two_shot_ll` (a band right above that range)
/// cannot hold, so `Auto` could not have taken it there anyway.
pub(crate) fn two_shot_ll_bound(ll_limit: usize, world: usize) -> usize {
    let own = if world <= 4 { 256 << 10 } else { 32 << 10 };
    ll_limit.min(own)
}

/// The multimem kernel `Auto` runs instead of the size rule's peer `kernel`, if any: only with
/// a multicast object (and more than one rank); the low-latency kernel's multicast push gives
/// the same bits as the peer kernels, so it is taken whatever `Config::reproducible` says; the
/// one-shot's `multimem.ld_reduce` sums in the switch's order, so only with `reproducible` off.
/// The two-shot has no multimem variant with a copy-in (the symmetric call's in-place one is
/// routed above).
pub(crate) fn multimem_variant(kernel: Kernel, config: &Config, facts: PathFacts<'_>) -> Option<Kernel> {
    if facts.multicast.is_err() || facts.world < 2 {
        return None;
    }
    match kernel {
        Kernel::LowLatency => Some(Kernel::LowLatencyMultimem),
        Kernel::OneShot if !config.reproducible => Some(Kernel::OneShotMultimem),
        _ => None,
    }
}

/// The lib's test binary counts allocations per thread (see `routing_a_call_allocates_nothing`).
#[cfg(test)]
#[path = "../../tests/support/counting_alloc.rs"]
mod counting;

#[cfg(test)]
#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

/// This thread's allocation count, for the other planning tests of the lib's test binary.
#[cfg(test)]
pub(crate) fn allocations_for_tests() -> usize {
    counting::allocations()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::abi::MAX_RANKS;

    #[test]
    fn routing_a_call_allocates_nothing() {
        let with_threshold = Config {
            nccl_above_bytes: Some(8 << 20),
            ..Config::default()
        };
        // A measured table for every dtype and world (resolved when it was built).
        let mut entries = Vec::new();
        for dtype in DType::ALL {
            for world in 1..=MAX_RANKS {
                entries.push(crate::config::Crossovers {
                    dtype,
                    world,
                    low_latency_max_bytes: 16 << 10,
                    two_shot_ll_max_bytes: None,
                    one_shot_max_bytes: 200_000,
                    two_shot_max_bytes: Some(2 << 20),
                });
            }
        }
        // And fused entries at three hidden sizes for each (the fused call scans them).
        let mut fused = Vec::new();
        for dtype in DType::ALL {
            for world in 1..=MAX_RANKS {
                for hidden in [4096, 7168, 8192] {
                    fused.push(crate::config::FusedCrossovers {
                        dtype,
                        world,
                        hidden,
                        one_shot_max_tokens: hidden / 512,
                    });
                }
            }
        }
        let table = crate::config::TuningTable::new(crate::config::Measured::default(), entries)
            .unwrap()
            .with_fused(fused)
            .unwrap();
        let tuned = Config::default().with_tuning(table);
        let fast = Config {
            reproducible: false,
            ..with_threshold.clone()
        };
        for config in [with_threshold, fast, tuned] {
            routes_without_allocating(&config);
        }
    }

    /// A device with peer kernels and clusters, without NCCL or multicast.
    fn peer_facts(world: usize) -> PathFacts<'static> {
        PathFacts {
            world,
            limits: Limits {
                one_shot_blocks: 32,
                two_shot_blocks: 16,
            },
            peer_kernels: Ok(()),
            nccl: Err("no NCCL"),
            multicast: Err("no multicast"),
            clusters: true,
        }
    }

    #[test]
    fn the_two_shot_runs_over_the_low_latency_lines_where_both_halves_of_a_shard_fit() {
        let facts = peer_facts;
        let kernel = |len: usize, dtype: DType, world: usize, config: &Config, algo: Algorithm| match route(
            CallKind::Buffers,
            len,
            dtype,
            config,
            algo,
            facts(world),
        )
        .unwrap()
        .target
        {
            Target::Kernel(k, _) => k,
            Target::Nccl => panic!("no NCCL here"),
        };
        let c = Config::default();
        for world in 2..=MAX_RANKS {
            let limit = two_shot_ll_bound(c.low_latency_limit(world), world);
            for dtype in DType::ALL {
                // The largest message whose shard's two halves fit the limit, in whole lines,
                // and one line more.
                let lines = limit / 32 * world;
                let fits = lines * 16 / dtype.size();
                let over = (lines + 1) * 16 / dtype.size();
                assert_eq!(
                    kernel(fits, dtype, world, &c, Algorithm::TwoShot),
                    Kernel::TwoShotLowLatency
                );
                assert_eq!(
                    kernel(over, dtype, world, &c, Algorithm::TwoShot),
                    Kernel::TwoShot
                );
                // An odd length: the last line is partial.
                assert_eq!(
                    kernel(fits - 1, dtype, world, &c, Algorithm::TwoShot),
                    Kernel::TwoShotLowLatency
                );
                // Configured rather than asked for: the same kernels.
                let configured = Config {
                    algorithm: Algorithm::TwoShot,
                    ..c.clone()
                };
                assert_eq!(
                    kernel(fits, dtype, world, &configured, Algorithm::Auto),
                    Kernel::TwoShotLowLatency
                );
            }
        }
        // A lone rank's two-shot is a copy: always the barrier kernel's one pass.
        assert_eq!(
            kernel(1000, DType::F32, 1, &c, Algorithm::TwoShot),
            Kernel::TwoShot
        );
        // A smaller low-latency limit moves the switch with it.
        let small = Config {
            low_latency_max_bytes: Some(4 << 10),
            ..c.clone()
        };
        // (16 KiB of f32 at W = 8: shards of 128 lines, 4 KiB for both halves.)
        assert_eq!(
            kernel(4 << 10, DType::F32, 8, &small, Algorithm::TwoShot),
            Kernel::TwoShotLowLatency
        );
        assert_eq!(
            kernel((4 << 10) + 4, DType::F32, 8, &small, Algorithm::TwoShot),
            Kernel::TwoShot
        );
        // A larger one (or a tuning table's, which sizes the slots of every world) does not
        // carry it past the kernel's own bound: calls to 128 KiB at W = 8, then the barrier
        // kernel (bf16).
        let large = Config {
            low_latency_max_bytes: Some(256 << 10),
            ..c.clone()
        };
        for (world, fits) in [(8, 128usize << 10), (4, 512 << 10), (2, 256 << 10)] {
            assert_eq!(
                kernel(fits / 2, DType::BF16, world, &large, Algorithm::TwoShot),
                Kernel::TwoShotLowLatency
            );
            assert_eq!(
                kernel(fits / 2 + 8, DType::BF16, world, &large, Algorithm::TwoShot),
                Kernel::TwoShot,
                "W = {world}"
            );
        }
        assert_eq!(
            kernel(1 << 19, DType::BF16, 8, &large, Algorithm::TwoShot),
            Kernel::TwoShot
        );
        // The path names the kernel.
        let d = crate::plan::explain::explain(
            &route(
                CallKind::Buffers,
                1000,
                DType::F32,
                &c,
                Algorithm::TwoShot,
                facts(8),
            )
            .unwrap(),
            Algorithm::TwoShot,
            &c,
            facts(8),
        );
        assert_eq!(d.kernel, Some("two_shot_ll"));
        assert!(
            d.reason.contains("over the low-latency lines, no barrier"),
            "{}",
            d.reason
        );
        // It names the bound that decided, the smaller of the limit and the kernel's own.
        let d = crate::plan::explain::explain(
            &route(
                CallKind::Buffers,
                1000,
                DType::F32,
                &large,
                Algorithm::TwoShot,
                facts(8),
            )
            .unwrap(),
            Algorithm::TwoShot,
            &large,
            facts(8),
        );
        assert!(d.reason.contains("fit 32768 bytes"), "{}", d.reason);
    }

    #[test]
    fn a_tuning_tables_two_shot_band_takes_the_low_latency_lines_ahead_of_the_one_shot() {
        let facts = peer_facts(4);
        let entry = crate::config::Crossovers {
            dtype: DType::BF16,
            world: 4,
            low_latency_max_bytes: 256 << 10,
            two_shot_ll_max_bytes: Some(512 << 10),
            one_shot_max_bytes: 3 << 19,
            two_shot_max_bytes: None,
        };
        let table = crate::config::TuningTable::new(crate::config::Measured::default(), vec![entry]).unwrap();
        let tuned = Config::default().with_tuning(table);
        let kernel_of = |kind: CallKind, bytes: usize, config: &Config| match route(
            kind,
            bytes / 2,
            DType::BF16,
            config,
            Algorithm::Auto,
            facts,
        )
        .unwrap()
        .target
        {
            Target::Kernel(k, _) => k,
            Target::Nccl => panic!("no NCCL here"),
        };
        for (bytes, kernel) in [
            (256 << 10, Kernel::LowLatency),
            ((256 << 10) + 16, Kernel::TwoShotLowLatency),
            (384 << 10, Kernel::TwoShotLowLatency),
            (512 << 10, Kernel::TwoShotLowLatency),
            ((512 << 10) + 16, Kernel::OneShot),
            (3 << 19, Kernel::OneShot),
            ((3 << 19) + 16, Kernel::TwoShot),
        ] {
            assert_eq!(
                kernel_of(CallKind::Buffers, bytes, &tuned),
                kernel,
                "{bytes} bytes"
            );
            // A pool input in the band copies in as the one-shot does.
            if kernel == Kernel::TwoShotLowLatency {
                assert_eq!(
                    kernel_of(CallKind::PoolInput, bytes, &tuned),
                    kernel,
                    "{bytes} bytes"
                );
            }
        }
        // The other dtypes, the published rule and an explicit threshold field: no band.
        let f16 = route(
            CallKind::Buffers,
            192 << 10,
            DType::F16,
            &tuned,
            Algorithm::Auto,
            facts,
        )
        .unwrap();
        assert_eq!(f16.algorithm(), Algorithm::OneShot);
        assert_eq!(
            kernel_of(CallKind::Buffers, 384 << 10, &Config::default()),
            Kernel::OneShot
        );
        let explicit = Config {
            one_shot_max_bytes: Some(1 << 20),
            ..tuned.clone()
        };
        assert_eq!(
            kernel_of(CallKind::Buffers, 384 << 10, &explicit),
            Kernel::OneShot
        );
        // The band stops where a shard's halves no longer fit the lines (W = 4: 512 KiB), even
        // where the table's band reaches further.
        let wide = crate::config::Crossovers {
            two_shot_ll_max_bytes: Some(1 << 20),
            ..entry
        };
        let table = crate::config::TuningTable::new(crate::config::Measured::default(), vec![wide]).unwrap();
        let wide = Config::default().with_tuning(table);
        assert_eq!(
            kernel_of(CallKind::Buffers, 512 << 10, &wide),
            Kernel::TwoShotLowLatency
        );
        assert_eq!(kernel_of(CallKind::Buffers, 768 << 10, &wide), Kernel::OneShot);
        // The path says why.
        let r = route(
            CallKind::Buffers,
            192 << 10,
            DType::BF16,
            &tuned,
            Algorithm::Auto,
            facts,
        )
        .unwrap();
        let d = crate::plan::explain::explain(&r, Algorithm::Auto, &tuned, facts);
        assert_eq!(d.kernel, Some("two_shot_ll"));
        assert!(
            d.reason
                .contains("the two-shot band over the low-latency lines (524288 from the tuning table)"),
            "{}",
            d.reason
        );
    }

    fn routes_without_allocating(config: &Config) {
        let limits = Limits {
            one_shot_blocks: 32,
            two_shot_blocks: 16,
        };
        let mut sink = 0usize;
        let before = counting::allocations();
        for world in 1..=MAX_RANKS {
            let facts = PathFacts {
                world,
                limits,
                peer_kernels: Ok(()),
                nccl: Ok(()),
                multicast: Ok(()),
                clusters: true,
            };
            for len in [1usize, 100, 8 << 10, 300_000, 3 << 20, 40 << 20] {
                for dtype in DType::ALL {
                    for algo in [
                        Algorithm::Auto,
                        Algorithm::LowLatency,
                        Algorithm::OneShot,
                        Algorithm::TwoShot,
                        Algorithm::Nccl,
                        Algorithm::Multimem,
                        Algorithm::MultimemOneShot,
                        Algorithm::MultimemLowLatency,
                    ] {
                        for kind in [
                            CallKind::Buffers,
                            CallKind::Symmetric,
                            CallKind::Pool,
                            CallKind::PoolInput,
                        ] {
                            // A refusal may allocate its message (Multimem on a buffer call).
                            if algo == Algorithm::Multimem
                                && matches!(kind, CallKind::Buffers | CallKind::PoolInput)
                            {
                                continue;
                            }
                            if let Ok(r) = route(kind, len, dtype, config, algo, facts) {
                                sink += r.bytes + matches!(r.target, Target::Nccl) as usize;
                            }
                        }
                        // The fused call, whose Auto scans the table's fused entries (it
                        // refuses the multimem algorithms with a message).
                        if algo.is_multimem() {
                            continue;
                        }
                        for (tokens, hidden) in [(1, 4096), (12, 5120), (40, 8192), (512, 16384)] {
                            if let Ok(r) =
                                super::super::fused::route_fused(tokens, hidden, dtype, config, algo, facts)
                            {
                                sink += r.bytes;
                            }
                        }
                    }
                }
            }
        }
        let after = counting::allocations();
        assert!(sink > 0);
        assert_eq!(after - before, 0, "routing allocated {} times", after - before);
        // The counter does count: a String allocates.
        let s = String::from("x").repeat(3);
        assert!(counting::allocations() > after, "{s}");
    }
}
