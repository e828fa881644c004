//! The fused all-reduce + residual + RMSNorm call, planned: its shape rules (typed errors
//! before anything is launched), its route (a `Copy` [`Route`] over the fused kernels, or NCCL
//! followed by the unfused epilogue) and the sentence [`crate::Communicator::add_rmsnorm_path`]
//! prints. Pure: tested on CPU.

use super::explain::{explain, PathDecision};
use super::grid::grid;
use super::route::{PathFacts, Route, Rule, Target};
use crate::config::{Algorithm, Config};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::registry::Kernel;

/// Largest hidden size the kernels take (one 512-thread block per row keeps at most eight
/// 16-byte packs per thread).
pub const MAX_HIDDEN: usize = 16384;

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

/// The fused kernel of an algorithm: low-latency has none (its slots carry 8 bytes per line,
/// not rows), so it takes the barrier one-shot.
fn fused_kernel(algorithm: Algorithm) -> Kernel {
    match algorithm {
        Algorithm::TwoShot => Kernel::FusedTwoShot,
        _ => Kernel::FusedOneShot,
    }
}

/// Routes a fused call of `tokens × hidden` elements (pure, allocation-free unless refused):
/// NCCL when asked for or configured, when there is no workspace, or (for `Auto` with a
/// fallback) above `nccl_above_bytes` or the capacity: the all-reduce then runs on NCCL and
/// the unfused epilogue kernel follows. Otherwise `Auto` takes the fused one-shot up to the
/// one-shot limit of the world size (one rank: always) and the fused two-shot above it.
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
        (Algorithm::Auto, Algorithm::Auto) => {
            let one_shot = facts.world == 1 || bytes <= config.one_shot_limit(facts.world);
            let a = if one_shot {
                Algorithm::OneShot
            } else {
                Algorithm::TwoShot
            };
            (a, Rule::Size)
        }
        (Algorithm::Auto, configured) => (configured, Rule::Configured),
        (asked, _) => (asked, Rule::AskedFor),
    };
    let kernel = fused_kernel(algorithm);
    Ok(Route {
        target: Target::Kernel(kernel, grid(kernel, tokens, dtype, facts.world, facts.limits)),
        rule,
        bytes,
        threshold_ignored,
    })
}

/// The sentence for a fused route: the all-reduce's sentence, prefixed with what runs.
pub(crate) fn explain_fused(
    route: &Route,
    requested: Algorithm,
    config: &Config,
    facts: PathFacts<'_>,
) -> PathDecision {
    let mut d = explain(route, requested, config, facts);
    let what = match route.target {
        Target::Kernel(Kernel::FusedTwoShot, _) => {
            "fused all-reduce + residual + RMSNorm, two-shot (rows split across ranks)"
        }
        Target::Kernel(..) => "fused all-reduce + residual + RMSNorm, one-shot",
        Target::Nccl => "NCCL all-reduce, then the residual + RMSNorm kernel",
    };
    d.reason = format!("{what}: {}", d.reason);
    if requested == Algorithm::LowLatency
        || (requested == Algorithm::Auto && config.algorithm == Algorithm::LowLatency)
    {
        d.reason += " (there is no fused low-latency kernel: the barrier one-shot runs)";
    }
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
        // 8192 × 1 bf16 = 16 KiB: one-shot, one block.
        let r = route_fused(1, 8192, DType::BF16, &c, Algorithm::Auto, f).unwrap();
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
        assert_eq!(p.blocks, 1);
        // 8192 × 32 bf16 = 512 KiB > 256 KiB at W=8: two-shot, 4 rows per rank.
        let r = route_fused(32, 8192, DType::BF16, &c, Algorithm::Auto, f).unwrap();
        let Target::Kernel(k, p) = r.target else { panic!() };
        assert_eq!(
            (k, p.blocks, p.algorithm),
            (Kernel::FusedTwoShot, 4, Algorithm::TwoShot)
        );
        // Grids are capped by the agreed limits.
        let r = route_fused(512, 1024, DType::BF16, &c, Algorithm::OneShot, f).unwrap();
        let Target::Kernel(_, p) = r.target else { panic!() };
        assert_eq!(p.blocks, 32);
        let r = route_fused(512, 1024, DType::BF16, &c, Algorithm::TwoShot, f).unwrap();
        let Target::Kernel(_, p) = r.target else { panic!() };
        assert_eq!(p.blocks, 16);
        // Low-latency has no fused kernel.
        let r = route_fused(1, 1024, DType::BF16, &c, Algorithm::LowLatency, f).unwrap();
        assert!(matches!(r.target, Target::Kernel(Kernel::FusedOneShot, _)));
        let d = explain_fused(&r, Algorithm::LowLatency, &c, f);
        assert!(d.reason.contains("no fused low-latency kernel"), "{}", d.reason);
        // The unfused kernel takes any grid.
        assert_eq!(grid(Kernel::RmsNorm, 512, DType::BF16, 8, WIDE).blocks, 512);
    }

    #[test]
    fn nccl_and_capacity_rules() {
        let c = Config {
            capacity_bytes: 1 << 20,
            ..Config::default()
        };
        let with = facts(4, Ok(()));
        let without = facts(4, Err("no fallback"));
        let r = route_fused(512, 8192, DType::BF16, &c, Algorithm::Auto, with).unwrap();
        assert_eq!(r.target, Target::Nccl);
        let d = explain_fused(&r, Algorithm::Auto, &c, with);
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
            &route_fused(1, 8192, DType::F16, &c, Algorithm::Auto, with).unwrap(),
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
}
