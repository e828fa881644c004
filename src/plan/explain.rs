//! The sentence that says why a call goes where it goes: [`PathDecision`], built from a
//! [`Route`] only when asked for ([`crate::Communicator::path`], `describe`).

use super::route::{two_shot_ll_bound, PathFacts, Route, Rule, Target};
use super::Plan;
use crate::config::{Algorithm, Config};
use crate::kernels::registry::Kernel;

/// Where one call goes and why (see [`crate::Communicator::path`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathDecision {
    /// The algorithm that runs (never `Auto`).
    pub algorithm: Algorithm,
    /// The kernel grid, for the peer kernels (`None` for NCCL).
    pub plan: Option<Plan>,
    /// One sentence naming the deciding rule.
    pub reason: String,
    /// The device kernel that runs, by its entry-point prefix (`one_shot_ll`, `one_shot`,
    /// `two_shot_ll`, `two_shot`, `in_place`, `pool_two_shot`, …); `None` for NCCL.
    pub kernel: Option<&'static str>,
}

impl std::fmt::Display for PathDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.plan {
            Some(p) => write!(f, "{} ({} blocks): {}", self.algorithm, p.blocks, self.reason),
            None => write!(f, "{}: {}", self.algorithm, self.reason),
        }
    }
}

/// The decision in words.
pub(crate) fn explain(
    route: &Route,
    requested: Algorithm,
    config: &Config,
    facts: PathFacts<'_>,
) -> PathDecision {
    let bytes = route.bytes;
    let th = config.thresholds(route.dtype, facts.world);
    let (limit, ll_limit) = (th.one_shot_max, th.low_latency_max);
    let from_table = if th.tuned { " from the tuning table" } else { "" };
    let algorithm = route.algorithm();
    let mut reason = match route.rule {
        Rule::NcclAskedFor => "Algorithm::Nccl was asked for".to_string(),
        Rule::NcclConfigured => "Config::algorithm is Nccl".to_string(),
        Rule::NoPeerKernels => format!(
            "the peer kernels are not set up: {}",
            facts.peer_kernels.err().unwrap_or("unknown reason")
        ),
        Rule::AboveNcclThreshold => match config.nccl_above_bytes {
            Some(n) => format!("{bytes} bytes > nccl_above_bytes ({n})"),
            None => format!(
                "{bytes} bytes > the tuning table's two-shot maximum ({})",
                th.nccl_above.unwrap_or(0)
            ),
        },
        Rule::AboveCapacity => format!(
            "{bytes} bytes exceed the symmetric capacity ({} bytes)",
            config.capacity_bytes
        ),
        Rule::Symmetric => match (facts.multicast, config.reproducible) {
            (Err(why), _) => format!("symmetric-buffer call: zero-copy in-place two-shot (multimem off: {why})"),
            (Ok(()), true) => "symmetric-buffer call: zero-copy in-place two-shot (multimem not chosen: \
                               Config::reproducible is on)"
                .to_string(),
            (Ok(()), false) => format!(
                "symmetric-buffer call: zero-copy in-place two-shot ({bytes} bytes <= one-shot limit ({limit}), \
                 below the multimem range)"
            ),
        },
        Rule::Multimem => format!(
            "symmetric-buffer call: multimem (NVLS) in-place two-shot ({bytes} bytes > one-shot limit ({limit}), \
             multicast set up, Config::reproducible off: the switch's summation order is not the peer kernels')"
        ),
        Rule::Pool => {
            "zero-copy (pool): in-place two-shot reading every rank's copy of the pool buffer, no copy-in"
                .to_string()
        }
        Rule::PoolInput => {
            "zero-copy (pool): two-shot reading every rank's copy of the pool input, no copy-in".to_string()
        }
        Rule::Size => match algorithm {
            Algorithm::LowLatency => format!("{bytes} bytes <= low-latency limit ({ll_limit}{from_table})"),
            _ if facts.world == 1 => "one rank: two-shot, a single pass from input to output".to_string(),
            Algorithm::OneShot if facts.multicast.is_ok() => format!(
                "{bytes} bytes <= one-shot limit ({limit}{from_table}) (multimem one-shot not chosen: \
                 Config::reproducible is on)"
            ),
            Algorithm::OneShot => format!("{bytes} bytes <= one-shot limit ({limit}{from_table})"),
            _ if bytes <= limit => format!(
                "{bytes} bytes <= the two-shot band over the low-latency lines ({}{from_table}), within the \
                 one-shot limit ({limit})",
                th.two_shot_ll_max.unwrap_or(0)
            ),
            _ => format!("{bytes} bytes > one-shot limit ({limit}{from_table})"),
        },
        Rule::MultimemSize => match algorithm {
            Algorithm::MultimemLowLatency => format!(
                "{bytes} bytes <= low-latency limit ({ll_limit}{from_table}), multicast set up: low-latency \
                 with one multicast store per word or line (rank-order sums: the same bits as the peer kernels)"
            ),
            _ => format!(
                "{bytes} bytes <= one-shot limit ({limit}{from_table}), multicast set up, Config::reproducible \
                 off: multimem one-shot (multimem.ld_reduce: the switch's summation order is not the peer \
                 kernels')"
            ),
        },
        Rule::Configured => format!("Config::algorithm is {}", config.algorithm),
        Rule::AskedFor => format!("{requested} was asked for"),
    };
    if let Target::Kernel(Kernel::TwoShotLowLatency, _) = route.target {
        reason += &format!(
            "; over the low-latency lines, no barrier (a shard's two halves fit {} bytes: the low-latency \
             limit and the kernel's own bound for the world, whichever is smaller)",
            two_shot_ll_bound(config.low_latency_limit(facts.world), facts.world)
        );
    }
    if route.threshold_ignored {
        reason += &format!(
            "; nccl_above_bytes ({}) is ignored: {}",
            th.nccl_above.unwrap_or(0),
            facts.nccl.err().unwrap_or("there is no NCCL fallback")
        );
    }
    PathDecision::of(route, reason)
}

impl PathDecision {
    /// The decision for `route`, with its sentence.
    pub(crate) fn of(route: &Route, reason: String) -> Self {
        let (plan, kernel) = match route.target {
            Target::Kernel(k, plan) => (Some(plan), Some(k.spec().prefix)),
            Target::Nccl => (None, None),
        };
        PathDecision {
            algorithm: route.algorithm(),
            plan,
            reason,
            kernel,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::error::{Error, Result};
    use crate::plan::route::{route, CallKind};
    use crate::plan::Limits;

    const WIDE: Limits = Limits {
        one_shot_blocks: 32,
        two_shot_blocks: 32,
    };

    fn decide_path(
        len: usize,
        dtype: DType,
        config: &Config,
        requested: Algorithm,
        facts: PathFacts<'_>,
    ) -> Result<PathDecision> {
        let r = route(CallKind::Buffers, len, dtype, config, requested, facts)?;
        Ok(explain(&r, requested, config, facts))
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
            multicast: Err("Config::multicast is Off"),
            clusters: true,
        }
    }

    fn symmetric(
        len: usize,
        config: &Config,
        requested: Algorithm,
        f: PathFacts<'_>,
    ) -> Result<PathDecision> {
        let r = route(CallKind::Symmetric, len, DType::BF16, config, requested, f)?;
        Ok(explain(&r, requested, config, f))
    }

    #[test]
    fn auto_takes_multimem_only_with_multicast_set_up_and_reproducible_off() {
        let on = PathFacts {
            multicast: Ok(()),
            ..facts(Ok(()), Ok(()))
        };
        let off = facts(Ok(()), Ok(()));
        let fast = Config {
            reproducible: false,
            nccl_above_bytes: Some(64 << 20),
            ..Config::default()
        };
        let limit = fast.one_shot_limit(DType::BF16, 4);
        let big = (limit + 16) / 2; // bf16 elements just above the one-shot range
        let p = symmetric(big, &fast, Algorithm::Auto, on).unwrap();
        assert_eq!(p.algorithm, Algorithm::Multimem, "{p}");
        assert!(
            p.reason.contains("multimem") && p.reason.contains("reproducible off"),
            "{p}"
        );
        // At or below the one-shot range: the peer in-place kernel.
        let p = symmetric(limit / 2, &fast, Algorithm::Auto, on).unwrap();
        assert_eq!(p.algorithm, Algorithm::TwoShot, "{p}");
        assert!(p.reason.contains("below the multimem range"), "{p}");
        // Above the NCCL threshold: NCCL, not multimem.
        let p = symmetric(
            (64 << 20) / 2 + 8,
            &Config {
                capacity_bytes: 128 << 20,
                ..fast.clone()
            },
            Algorithm::Auto,
            on,
        )
        .unwrap();
        assert_eq!(p.algorithm, Algorithm::Nccl, "{p}");
        // Reproducible (the default) keeps Auto away, and says so.
        let p = symmetric(big, &Config::default(), Algorithm::Auto, on).unwrap();
        assert_eq!(p.algorithm, Algorithm::TwoShot);
        assert!(p.reason.contains("reproducible is on"), "{p}");
        // No multicast: in-place, with the reason.
        let p = symmetric(big, &fast, Algorithm::Auto, off).unwrap();
        assert_eq!(p.algorithm, Algorithm::TwoShot);
        assert!(p.reason.contains("multimem off: Config::multicast is Off"), "{p}");
        // Asked for: runs with multicast (even reproducible), a typed error without it; buffer
        // calls refuse it.
        let p = symmetric(8, &Config::default(), Algorithm::Multimem, on).unwrap();
        assert_eq!(p.algorithm, Algorithm::Multimem);
        assert!(matches!(
            symmetric(8, &fast, Algorithm::Multimem, off),
            Err(Error::MulticastUnavailable { reason }) if reason.contains("Config::multicast is Off")
        ));
        assert!(matches!(
            decide_path(big, DType::BF16, &fast, Algorithm::Multimem, on),
            Err(Error::InvalidConfig(_))
        ));
        // Configured Multimem: symmetric calls take it, buffer calls the size rule.
        let conf = Config {
            algorithm: Algorithm::Multimem,
            ..Config::default()
        };
        assert_eq!(
            symmetric(8, &conf, Algorithm::Auto, on).unwrap().algorithm,
            Algorithm::Multimem
        );
        // (Multicast is set up here, so the size rule's low-latency kernel is the multimem one.)
        assert_eq!(
            decide_path(100, DType::F32, &conf, Algorithm::Auto, on)
                .unwrap()
                .algorithm,
            Algorithm::MultimemLowLatency
        );
        assert_eq!(
            decide_path(100, DType::F32, &conf, Algorithm::Auto, off)
                .unwrap()
                .algorithm,
            Algorithm::LowLatency
        );
    }

    #[test]
    fn buffer_calls_take_the_multimem_kernels_only_with_multicast_and_ld_reduce_only_unreproducible() {
        use crate::kernels::registry::Kernel;
        let on = PathFacts {
            multicast: Ok(()),
            ..facts(Ok(()), Ok(()))
        };
        let off = facts(Ok(()), Ok(()));
        let reproducible = Config {
            nccl_above_bytes: Some(64 << 20),
            ..Config::default()
        };
        let fast = Config {
            reproducible: false,
            ..reproducible.clone()
        };
        let ll = reproducible.thresholds(DType::BF16, 4).low_latency_max;
        let one = reproducible.one_shot_limit(DType::BF16, 4);
        // bf16 element counts: low-latency range, one-shot range, two-shot range.
        let (small, mid, big) = (ll / 2, one / 2, one / 2 + 8);
        let algo = |len, c: &Config, f| decide_path(len, DType::BF16, c, Algorithm::Auto, f).unwrap();

        // Multicast set up, reproducible on: the multicast push (same bits) but no ld_reduce.
        let p = algo(small, &reproducible, on);
        assert_eq!(p.algorithm, Algorithm::MultimemLowLatency, "{p}");
        assert!(
            p.reason.contains("one multicast store per word or line") && p.reason.contains("same bits"),
            "{p}"
        );
        let p = algo(mid, &reproducible, on);
        assert_eq!(p.algorithm, Algorithm::OneShot, "{p}");
        assert!(
            p.reason
                .contains("multimem one-shot not chosen: Config::reproducible is on"),
            "{p}"
        );
        assert_eq!(algo(big, &reproducible, on).algorithm, Algorithm::TwoShot);

        // Reproducible off: the ld_reduce one-shot in the one-shot range.
        assert_eq!(algo(small, &fast, on).algorithm, Algorithm::MultimemLowLatency);
        let p = algo(mid, &fast, on);
        assert_eq!(p.algorithm, Algorithm::MultimemOneShot, "{p}");
        assert!(
            p.reason.contains("reproducible off") && p.reason.contains("multimem.ld_reduce"),
            "{p}"
        );
        // Above the one-shot range buffer calls keep the peer two-shot (no multimem copy-in
        // two-shot); the symmetric call takes the multimem in-place kernel.
        assert_eq!(algo(big, &fast, on).algorithm, Algorithm::TwoShot);
        assert_eq!(
            symmetric(big, &fast, Algorithm::Auto, on).unwrap().algorithm,
            Algorithm::Multimem
        );
        // Symmetric calls in the low-latency / one-shot range stay on the peer in-place kernel.
        assert_eq!(
            symmetric(small, &fast, Algorithm::Auto, on).unwrap().algorithm,
            Algorithm::TwoShot
        );

        // No multicast: the peer kernels, whatever reproducible says; the reason does not
        // mention multimem.
        for c in [&reproducible, &fast] {
            let p = algo(small, c, off);
            assert_eq!(p.algorithm, Algorithm::LowLatency, "{p}");
            let p = algo(mid, c, off);
            assert_eq!(p.algorithm, Algorithm::OneShot, "{p}");
            assert!(!p.reason.contains("multimem"), "{p}");
        }
        // One rank: never multimem.
        let one_rank = PathFacts { world: 1, ..on };
        assert_eq!(algo(small, &fast, one_rank).algorithm, Algorithm::LowLatency);

        // Asked for: runs with multicast (ld_reduce even with reproducible on: asked for), a
        // typed error naming why without it; the low-latency slots still bound it.
        for a in [Algorithm::MultimemOneShot, Algorithm::MultimemLowLatency] {
            let p = decide_path(small, DType::BF16, &reproducible, a, on).unwrap();
            assert_eq!(p.algorithm, a);
            assert_eq!(p.reason, format!("{a} was asked for"));
            let e = decide_path(small, DType::BF16, &reproducible, a, off).unwrap_err();
            assert!(
                matches!(&e, Error::MulticastUnavailable { reason } if reason.contains("Config::multicast is Off")),
                "{e:?}"
            );
        }
        assert!(matches!(
            decide_path(
                ll / 2 + 8,
                DType::BF16,
                &reproducible,
                Algorithm::MultimemLowLatency,
                on
            ),
            Err(Error::ExceedsCapacity { .. })
        ));
        // Configured: buffer calls take it at any size within the capacity (it is refused
        // without multicast); symmetric calls keep the in-place kernel.
        let conf = Config {
            algorithm: Algorithm::MultimemOneShot,
            ..reproducible.clone()
        };
        let p = algo(big, &conf, on);
        assert_eq!(p.algorithm, Algorithm::MultimemOneShot, "{p}");
        assert!(p.reason.contains("Config::algorithm is multimem_one_shot"), "{p}");
        assert!(matches!(
            decide_path(big, DType::BF16, &conf, Algorithm::Auto, off),
            Err(Error::MulticastUnavailable { .. })
        ));
        assert_eq!(
            symmetric(big, &conf, Algorithm::Auto, on).unwrap().algorithm,
            Algorithm::TwoShot
        );
        // Above the NCCL threshold NCCL still wins.
        let p = algo(
            (64 << 20) / 2 + 8,
            &Config {
                capacity_bytes: 128 << 20,
                ..fast.clone()
            },
            on,
        );
        assert_eq!(p.algorithm, Algorithm::Nccl, "{p}");

        // The multimem one-shot and low-latency kernels have the grids of their peer twins (the
        // low-latency ones a thread per 32-bit word).
        for (len, twin, multimem) in [
            (small, Kernel::LowLatency, Kernel::LowLatencyMultimem),
            (mid, Kernel::OneShot, Kernel::OneShotMultimem),
        ] {
            let r = route(CallKind::Buffers, len, DType::BF16, &fast, Algorithm::Auto, on).unwrap();
            let peer = route(CallKind::Buffers, len, DType::BF16, &fast, Algorithm::Auto, off).unwrap();
            match (r.target, peer.target) {
                (Target::Kernel(k, p), Target::Kernel(t, q)) => {
                    assert_eq!((k, t), (multimem, twin));
                    assert_eq!((p.blocks, p.threads), (q.blocks, q.threads));
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn paths_follow_the_threshold_capacity_and_workspace() {
        let c = Config {
            capacity_bytes: 8 << 20,
            nccl_above_bytes: Some(1 << 20),
            low_latency_max_bytes: Some(32 << 10),
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
        let c = Config {
            low_latency_max_bytes: Some(32 << 10),
            ..Config::default()
        };
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
        assert!(
            p.reason
                .starts_with("two_shot was asked for; over the low-latency lines"),
            "{p}"
        );
        let p = decide_path(1 << 20, DType::F32, &c, Algorithm::TwoShot, f).unwrap();
        assert_eq!(p.reason, "two_shot was asked for");
        let one = PathFacts { world: 1, ..f };
        assert_eq!(
            decide_path(1 << 20, DType::F32, &c, Algorithm::Auto, one)
                .unwrap()
                .reason,
            "one rank: two-shot, a single pass from input to output"
        );
        assert_eq!("nccl".parse::<Algorithm>().unwrap(), Algorithm::Nccl);
        assert_eq!(Algorithm::Nccl.to_string(), "nccl");
    }

    #[test]
    fn symmetric_calls_report_the_kernel_they_run() {
        let c = Config::default();
        let f = facts(Ok(()), Err("none"));
        for len in [8usize, 100, 1 << 20] {
            let r = route(CallKind::Symmetric, len, DType::BF16, &c, Algorithm::Auto, f).unwrap();
            let p = explain(&r, Algorithm::Auto, &c, f);
            assert_eq!(p.algorithm, Algorithm::TwoShot, "{p}");
            assert!(p.reason.contains("in-place"), "{p}");
            assert!(matches!(
                r.target,
                Target::Kernel(crate::kernels::registry::Kernel::InPlace, _)
            ));
        }
        // Without a workspace the symmetric call goes to NCCL, and says so.
        let nccl_only = facts(Err("no P2P"), Ok(()));
        let r = route(
            CallKind::Symmetric,
            8,
            DType::BF16,
            &c,
            Algorithm::Auto,
            nccl_only,
        )
        .unwrap();
        assert_eq!(r.target, Target::Nccl);
    }

    /// bf16 at W=8: low-latency up to 64 KiB, one-shot up to 1 MiB, two-shot up to 4 MiB.
    fn measured_table() -> crate::config::TuningTable {
        use crate::config::{Crossovers, Measured, TuningTable};
        TuningTable::from_json(
            &TuningTable::new(
                Measured::default(),
                vec![Crossovers {
                    dtype: DType::BF16,
                    world: 8,
                    low_latency_max_bytes: 96 << 10,
                    two_shot_ll_max_bytes: None,
                    one_shot_max_bytes: 1 << 20,
                    two_shot_max_bytes: Some(4 << 20),
                }],
            )
            .unwrap()
            .to_json(),
        )
        .unwrap()
    }

    #[test]
    fn a_loaded_table_changes_autos_choice() {
        let published = Config::default();
        let tuned = Config::default().with_tuning(measured_table());
        let w8 = PathFacts {
            world: 8,
            ..facts(Ok(()), Ok(()))
        };
        let algo = |c: &Config, bytes: usize, dtype: DType| {
            decide_path(bytes / dtype.size(), dtype, c, Algorithm::Auto, w8).unwrap()
        };
        // (bytes, published choice, choice with the table): every size flips.
        for (bytes, before, after) in [
            (80 << 10, Algorithm::OneShot, Algorithm::LowLatency),
            (512 << 10, Algorithm::TwoShot, Algorithm::OneShot),
            (1 << 20, Algorithm::TwoShot, Algorithm::OneShot),
            (8 << 20, Algorithm::TwoShot, Algorithm::Nccl),
        ] {
            assert_eq!(algo(&published, bytes, DType::BF16).algorithm, before, "{bytes}");
            let p = algo(&tuned, bytes, DType::BF16);
            assert_eq!(p.algorithm, after, "{bytes}: {p}");
            if after != Algorithm::Nccl {
                assert!(p.reason.contains("from the tuning table"), "{p}");
            } else {
                assert!(
                    p.reason.contains("tuning table's two-shot maximum (4194304)"),
                    "{p}"
                );
            }
        }
        // At the thresholds themselves the lower algorithm still runs.
        assert_eq!(
            algo(&tuned, 96 << 10, DType::BF16).algorithm,
            Algorithm::LowLatency
        );
        assert_eq!(
            algo(&tuned, (96 << 10) + 2, DType::BF16).algorithm,
            Algorithm::OneShot
        );
        assert_eq!(algo(&tuned, 4 << 20, DType::BF16).algorithm, Algorithm::TwoShot);
        // Entries the table does not have keep the published rule: f16 at W=8, bf16 at W=4.
        for bytes in [80 << 10, 512 << 10, 8 << 20] {
            assert_eq!(
                algo(&tuned, bytes, DType::F16).algorithm,
                algo(&published, bytes, DType::F16).algorithm
            );
            let w4 = PathFacts { world: 4, ..w8 };
            assert_eq!(
                decide_path(bytes / 2, DType::BF16, &tuned, Algorithm::Auto, w4)
                    .unwrap()
                    .algorithm,
                decide_path(bytes / 2, DType::BF16, &published, Algorithm::Auto, w4)
                    .unwrap()
                    .algorithm,
            );
        }
        // Explicit fields win over the table; forced algorithms ignore it.
        let overridden = Config {
            one_shot_max_bytes: Some(256 << 10),
            nccl_above_bytes: Some(64 << 20),
            ..tuned.clone()
        };
        assert_eq!(
            algo(&overridden, 512 << 10, DType::BF16).algorithm,
            Algorithm::TwoShot
        );
        assert_eq!(
            algo(&overridden, 8 << 20, DType::BF16).algorithm,
            Algorithm::TwoShot
        );
        assert_eq!(
            decide_path(100, DType::BF16, &tuned, Algorithm::TwoShot, w8)
                .unwrap()
                .algorithm,
            Algorithm::TwoShot
        );
        // Without a fallback the table's NCCL threshold is ignored, and the reason says so.
        let no_nccl = PathFacts {
            nccl: Err("created without NCCL"),
            ..w8
        };
        let p = decide_path(4 << 20, DType::BF16, &tuned, Algorithm::Auto, no_nccl).unwrap();
        assert_eq!(p.algorithm, Algorithm::TwoShot);
        assert!(p.reason.contains("(4194304) is ignored"), "{p}");
    }

    #[test]
    fn pool_calls_are_zero_copy_above_the_one_shot_range_unless_nccl_is_configured() {
        let c = Config {
            capacity_bytes: 1 << 20,
            nccl_above_bytes: Some(64 << 10),
            low_latency_max_bytes: Some(32 << 10),
            ..Config::default()
        };
        let f = facts(Ok(()), Ok(()));
        // In the low-latency range the low-latency kernel (it copies nothing in), in place or
        // not, whatever the NCCL threshold above it.
        for kind in [CallKind::Pool, CallKind::PoolInput] {
            for len in [1usize, 100, 16 << 10] {
                let r = route(kind, len, DType::BF16, &c, Algorithm::Auto, f).unwrap();
                assert!(
                    matches!(
                        r.target,
                        Target::Kernel(crate::kernels::registry::Kernel::LowLatency, _)
                    ),
                    "{kind:?} {len}: {r:?}"
                );
            }
        }
        // Above it, up to the NCCL threshold (64 KiB) in the one-shot range (512 KiB at W = 4):
        // the copy-in one-shot, in place or not.
        for kind in [CallKind::Pool, CallKind::PoolInput] {
            for len in [(16usize << 10) + 1, 32 << 10] {
                let r = route(kind, len, DType::BF16, &c, Algorithm::Auto, f).unwrap();
                assert!(
                    matches!(
                        r.target,
                        Target::Kernel(crate::kernels::registry::Kernel::OneShot, _)
                    ),
                    "{kind:?} {len}: {r:?}"
                );
                let p = explain(&r, Algorithm::Auto, &c, f);
                assert!(p.reason.contains("<= one-shot limit"), "{p}");
            }
        }
        // Past the NCCL threshold or the one-shot range: zero-copy, in place above the capacity
        // too.
        let no_threshold = Config {
            nccl_above_bytes: None,
            ..c.clone()
        };
        // Without the NCCL threshold: the one-shot up to 512 KiB (W = 4), zero-copy above.
        use crate::kernels::registry::Kernel::{InPlace, OneShot};
        for (len, kernel) in [(200usize << 10, OneShot), ((256 << 10) + 1, InPlace)] {
            let r = route(
                CallKind::Pool,
                len,
                DType::BF16,
                &no_threshold,
                Algorithm::Auto,
                f,
            )
            .unwrap();
            assert!(
                matches!(r.target, Target::Kernel(k, _) if k == kernel),
                "{len}: {r:?}"
            );
        }
        for len in [(32usize << 10) + 1, 1 << 20, 64 << 20] {
            let r = route(CallKind::Pool, len, DType::BF16, &c, Algorithm::Auto, f).unwrap();
            assert!(matches!(
                r.target,
                Target::Kernel(crate::kernels::registry::Kernel::InPlace, _)
            ));
            let p = explain(&r, Algorithm::Auto, &c, f);
            assert!(p.reason.starts_with("zero-copy (pool)"), "{p}");
            assert_eq!(p.algorithm, Algorithm::TwoShot);
        }
        let nccl = Config {
            algorithm: Algorithm::Nccl,
            ..c.clone()
        };
        let r = route(CallKind::Pool, 8, DType::BF16, &nccl, Algorithm::Auto, f).unwrap();
        assert_eq!(r.target, Target::Nccl);
        let r = route(
            CallKind::Pool,
            8,
            DType::BF16,
            &c,
            Algorithm::Auto,
            facts(Err("no P2P"), Ok(())),
        )
        .unwrap();
        assert_eq!(r.target, Target::Nccl);
        // Out of place from a pool buffer past the NCCL threshold: the zero-copy two-shot up to
        // the capacity, then what an ordinary buffer gets (here NCCL, above the capacity with a
        // fallback).
        for len in [(32usize << 10) + 1, 100_000, 1 << 19] {
            let r = route(CallKind::PoolInput, len, DType::BF16, &c, Algorithm::Auto, f).unwrap();
            assert!(matches!(
                r.target,
                Target::Kernel(crate::kernels::registry::Kernel::PoolTwoShot, _)
            ));
            let p = explain(&r, Algorithm::Auto, &c, f);
            assert!(p.reason.starts_with("zero-copy (pool)"), "{p}");
        }
        let r = route(
            CallKind::PoolInput,
            (1 << 19) + 1,
            DType::BF16,
            &c,
            Algorithm::Auto,
            f,
        )
        .unwrap();
        assert_eq!(r.target, Target::Nccl);
    }

    #[test]
    fn routing_allocates_nothing_and_is_copy() {
        fn assert_copy<T: Copy>() {}
        assert_copy::<Route>();
        // Route holds no heap data: its size is a handful of words.
        assert!(std::mem::size_of::<Route>() <= 64);
    }
}
