//! The sentence that says why a call goes where it goes: [`PathDecision`], built from a
//! [`Route`] only when asked for ([`crate::Communicator::path`], `describe`).

use super::route::{PathFacts, Route, Rule, Target};
use super::Plan;
use crate::config::{Algorithm, Config};

/// Where one call goes and why (see [`crate::Communicator::path`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathDecision {
    /// `LowLatency`, `OneShot`, `TwoShot` or `Nccl` (never `Auto`).
    pub algorithm: Algorithm,
    /// The kernel grid, for the peer kernels (`None` for NCCL).
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

/// The decision in words.
pub(crate) fn explain(
    route: &Route,
    requested: Algorithm,
    config: &Config,
    facts: PathFacts<'_>,
) -> PathDecision {
    let bytes = route.bytes;
    let limit = config.one_shot_limit(facts.world);
    let ll_limit = config.low_latency_limit();
    let algorithm = route.algorithm();
    let mut reason = match route.rule {
        Rule::NcclAskedFor => "Algorithm::Nccl was asked for".to_string(),
        Rule::NcclConfigured => "Config::algorithm is Nccl".to_string(),
        Rule::NoPeerKernels => format!(
            "the peer kernels are not set up: {}",
            facts.peer_kernels.err().unwrap_or("unknown reason")
        ),
        Rule::AboveNcclThreshold => format!(
            "{bytes} bytes > nccl_above_bytes ({})",
            config.nccl_above_bytes.unwrap_or(0)
        ),
        Rule::AboveCapacity => format!(
            "{bytes} bytes exceed the symmetric capacity ({} bytes)",
            config.capacity_bytes
        ),
        Rule::Symmetric => "symmetric-buffer call: zero-copy in-place two-shot".to_string(),
        Rule::Pool => {
            "zero-copy (pool): in-place two-shot reading every rank's copy of the pool buffer, no copy-in"
                .to_string()
        }
        Rule::PoolInput => {
            "zero-copy (pool): two-shot reading every rank's copy of the pool input, no copy-in".to_string()
        }
        Rule::Size => match algorithm {
            Algorithm::LowLatency => format!("{bytes} bytes <= low-latency limit ({ll_limit})"),
            _ if facts.world == 1 => "one rank: one-shot copy".to_string(),
            Algorithm::OneShot => format!("{bytes} bytes <= one-shot limit ({limit})"),
            _ => format!("{bytes} bytes > one-shot limit ({limit})"),
        },
        Rule::Configured => format!("Config::algorithm is {}", config.algorithm),
        Rule::AskedFor => format!("{requested} was asked for"),
    };
    if route.threshold_ignored {
        reason += &format!(
            "; nccl_above_bytes ({}) is ignored: {}",
            config.nccl_above_bytes.unwrap_or(0),
            facts.nccl.err().unwrap_or("there is no NCCL fallback")
        );
    }
    PathDecision {
        algorithm,
        plan: match route.target {
            Target::Kernel(_, plan) => Some(plan),
            Target::Nccl => None,
        },
        reason,
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

    #[test]
    fn pool_calls_are_zero_copy_at_any_size_unless_nccl_is_configured() {
        let c = Config {
            capacity_bytes: 1 << 20,
            nccl_above_bytes: Some(1 << 10),
            ..Config::default()
        };
        let f = facts(Ok(()), Ok(()));
        for len in [1usize, 100, 1 << 20, 64 << 20] {
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
        // Out of place from a pool buffer: the zero-copy two-shot up to the capacity, then
        // what an ordinary buffer gets (here NCCL, above the capacity with a fallback).
        for len in [1usize, 1000, 1 << 19] {
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
