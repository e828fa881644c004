//! The size rule of `Auto` and the kernel grid of a route.

use super::route::two_shot_ll_fits;
use super::{algorithm_of, kernel_for, Limits, Plan};
use crate::config::{Algorithm, Config};
use crate::dtype::DType;
use crate::kernels::abi::{MAX_BLOCKS, THREADS_PER_BLOCK};
use crate::kernels::registry::{Family, Kernel};

/// The algorithm a call of `bytes` of `dtype` takes: `requested` unless it is `Auto`, then
/// the configured one unless that is `Auto`, then the size rule with the thresholds of
/// [`Config::thresholds`] (low-latency up to its limit, one-shot up to the crossover,
/// two-shot above; one rank: two-shot above the low-latency limit).
pub(crate) fn choose(
    bytes: usize,
    dtype: DType,
    world: usize,
    config: &Config,
    requested: Algorithm,
) -> Algorithm {
    match (requested, config.algorithm) {
        // A configured Multimem applies to symmetric calls only; buffer calls size-rule.
        (Algorithm::Auto, Algorithm::Auto | Algorithm::Multimem) => {
            let th = config.thresholds(dtype, world);
            if bytes <= th.low_latency_max {
                Algorithm::LowLatency
            } else if world > 1
                && th.two_shot_ll_max.is_some_and(|band| bytes <= band)
                && two_shot_ll_fits(bytes, world, config.low_latency_limit(world))
            {
                // The tuning table's band: the two-shot, which runs over the low-latency
                // lines here (plan::route::two_shot_variant).
                Algorithm::TwoShot
            } else if world > 1 && bytes <= th.one_shot_max {
                Algorithm::OneShot
            } else {
                // One rank: the two-shot is a single pass from input to output (no copy-in,
                // no peers), the one-shot would copy the input in first.
                Algorithm::TwoShot
            }
        }
        (Algorithm::Auto, configured) => configured,
        (forced, _) => forced,
    }
}

/// Threads per block of the low-latency all-reduce while its block limit does not bind.
const LOW_LATENCY_THREADS: u32 = 128;

/// The grid of `kernel` for `len` elements of `dtype` over `world` ranks: one thread per
/// 16-byte pack (of the rank's 1/W slice for the two-shot family; the low-latency
/// all-reduce, unicast or multicast, takes one thread per 32-bit word), capped by the agreed
/// limits and the signal slots.
pub(crate) fn grid(kernel: Kernel, len: usize, dtype: DType, world: usize, limits: Limits) -> Plan {
    let packs = len / dtype.per_pack();
    let work = match kernel {
        Kernel::TwoShot | Kernel::InPlace | Kernel::InPlaceMultimem | Kernel::PoolTwoShot => {
            packs.div_ceil(world)
        }
        // The low-latency all-reduce moves one 32-bit word per thread, pushed with W - 1
        // unicast stores or one multicast store (kernels/low_latency.cuh).
        Kernel::LowLatency | Kernel::LowLatencyMultimem => (len * dtype.size()).div_ceil(4),
        // Reduce-scatter: `len` is the per-rank output (one slice); all-gather: `len` is the
        // largest per-rank chunk (the collectives' grids are sized in plan::collective).
        Kernel::OneShot
        | Kernel::OneShotMultimem
        | Kernel::AllGather
        | Kernel::ReduceScatter
        | Kernel::AllGatherLowLatency
        | Kernel::ReduceScatterLowLatency
        // The low-latency two-shot: a thread per line pushes it to its shard's owner; the
        // first threads then sum this rank's shard, and every thread gathers.
        | Kernel::TwoShotLowLatency => packs,
        // One block per row (see plan::fused; the two-shot maps rows to blocks as the
        // one-shot does and splits only the reduction by owner); `len` is rows here.
        Kernel::FusedOneShot | Kernel::FusedTwoShot | Kernel::FusedLowLatency | Kernel::RmsNorm => len,
    };
    if matches!(
        kernel,
        Kernel::FusedOneShot | Kernel::FusedTwoShot | Kernel::FusedLowLatency | Kernel::RmsNorm
    ) {
        let cap = match kernel.family() {
            Family::Local => usize::MAX,
            family => limits.blocks(family).min(MAX_BLOCKS),
        };
        return Plan {
            algorithm: algorithm_of(kernel),
            blocks: work.min(cap).min(u16::MAX as usize).max(1) as u32,
            threads: THREADS_PER_BLOCK,
            cluster: 1,
        };
    }
    if matches!(kernel, Kernel::LowLatency | Kernel::LowLatencyMultimem) {
        // Small blocks spread a small message over more SMs: every thread pushes its word or
        // line to every peer and polls for theirs, so more, smaller blocks start sooner and
        // contend less. On the H200 (8 virtual ranks, chain of 10, a thread per 16-byte line
        // then) 128-thread blocks were 0.4–0.6 µs faster at 8 KiB and 0.9 µs at 32 KiB than
        // 512-thread ones; 64- and 32-thread blocks lost at 8 KiB (and at 1 KiB, partly the
        // idle threads' early trigger since removed; docs/bench/h200-w8-virtual-v5). Blocks
        // grow back to 512 threads once the block limit binds.
        let cap = limits.blocks(kernel.family()).clamp(1, MAX_BLOCKS);
        let threads = work
            .div_ceil(cap)
            .next_multiple_of(32)
            .clamp(LOW_LATENCY_THREADS as usize, THREADS_PER_BLOCK as usize);
        return Plan {
            algorithm: algorithm_of(kernel),
            blocks: work.div_ceil(threads).clamp(1, cap) as u32,
            threads: threads as u32,
            cluster: 1,
        };
    }
    let wanted = work.div_ceil(THREADS_PER_BLOCK as usize).max(1);
    Plan {
        algorithm: algorithm_of(kernel),
        blocks: wanted.min(limits.blocks(kernel.family())).min(MAX_BLOCKS) as u32,
        threads: THREADS_PER_BLOCK,
        cluster: 1,
    }
}

/// [`choose`] then [`grid`], for [`crate::Communicator::plan`]: the grid a buffer call would
/// use if the kernels take it (`Nccl` is sized as one-shot; it is never launched; `Multimem`
/// is the grid of the symmetric call's multimem kernel).
pub(crate) fn plan_all_reduce(
    len: usize,
    dtype: DType,
    world: usize,
    limits: Limits,
    config: &Config,
    requested: Algorithm,
) -> Plan {
    let algorithm = choose(len * dtype.size(), dtype, world, config, requested);
    let kernel = match algorithm {
        Algorithm::Multimem => Kernel::InPlaceMultimem,
        _ => kernel_for(algorithm).unwrap_or(Kernel::OneShot),
    };
    grid(kernel, len, dtype, world, limits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::abi::MAX_RANKS;

    const WIDE: Limits = Limits {
        one_shot_blocks: 32,
        two_shot_blocks: 32,
    };

    /// The committed tuning rows (docs/tuning/h100-virtual-rows.csv: W = 2, 4, 8 virtual ranks
    /// on one H100, every dtype, 1 KiB – 32 MiB, chain of 10 in a graph): per (dtype, world,
    /// size), the time of each of the crate's all-reduce kernels.
    fn committed_rows() -> std::collections::HashMap<(DType, usize, usize), Vec<(Algorithm, f64)>> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/tuning/h100-virtual-rows.csv");
        let text = std::fs::read_to_string(path).unwrap();
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
        let (d, m, a, w, s, t) = (
            col("dtype"),
            col("mode"),
            col("algo"),
            col("world"),
            col("size_bytes"),
            col("time_us"),
        );
        let mut rows = std::collections::HashMap::<_, Vec<_>>::new();
        for line in lines {
            let f: Vec<&str> = line.split(',').collect();
            let algo = match f[a] {
                "low_latency" => Algorithm::LowLatency,
                "one_shot" => Algorithm::OneShot,
                "two_shot" => Algorithm::TwoShot,
                _ => continue,
            };
            assert_eq!(f[m], "graph_amortised");
            let key = (
                f[d].parse().unwrap(),
                f[w].parse().unwrap(),
                f[s].parse().unwrap(),
            );
            rows.entry(key).or_default().push((algo, f[t].parse().unwrap()));
        }
        assert_eq!(rows.len(), 3 * 3 * 31, "dtypes × worlds × sizes");
        rows
    }

    /// How much slower `Auto`'s choice under `config` is than the fastest kernel of each row
    /// up to `max_bytes` (the ratio of their times), for the rows where it is above 1.05.
    fn slower_than_fastest(config: &Config, max_bytes: usize) -> Vec<String> {
        let mut slow = Vec::new();
        for ((dtype, world, bytes), times) in committed_rows() {
            if bytes > max_bytes {
                continue;
            }
            let auto = choose(bytes, dtype, world, config, Algorithm::Auto);
            let time = |algo| times.iter().find(|(a, _)| *a == algo).map(|(_, t)| *t);
            let best = times.iter().map(|(_, t)| *t).fold(f64::INFINITY, f64::min);
            let ratio = time(auto).unwrap() / best;
            if ratio > 1.05 {
                slow.push(format!(
                    "{dtype} W={world} {bytes} B: {auto} {ratio:.3}× the fastest"
                ));
            }
        }
        slow.sort();
        slow
    }

    #[test]
    fn auto_is_within_5_percent_of_the_fastest_kernel_in_the_committed_measurements() {
        // With the table measured from these rows, at every size.
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/tuning/h100-virtual.json");
        let tuned = Config::default().with_tuning_file(path).unwrap();
        assert_eq!(slower_than_fastest(&tuned, usize::MAX), Vec::<String>::new());
        // With the published thresholds, up to 256 KiB (the low-latency / one-shot choice:
        // the two push or read the same `(W-1)·S` bytes, so one GPU orders them as NVLink
        // does). Above, the one-shot / two-shot crossover is a bandwidth one, set for NVLink
        // (the one-shot reads `(W-1)·S`, the two-shot `2·(W-1)/W·S`): one GPU's memory puts
        // it higher (W = 4 up to 1.5 MiB, W = 8 up to 512 KiB), and a table measured on the
        // machine moves it.
        assert_eq!(
            slower_than_fastest(&Config::default(), 256 << 10),
            Vec::<String>::new()
        );
    }

    #[test]
    fn auto_follows_published_crossovers() {
        let c = Config::default();
        for (world, limit) in [
            (2, 2 << 20),
            (3, 512 << 10),
            (4, 512 << 10),
            (8, 256 << 10),
            (6, 256 << 10),
        ] {
            let at = plan_all_reduce(limit / 2, DType::BF16, world, WIDE, &c, Algorithm::Auto);
            let above = plan_all_reduce(limit / 2 + 8, DType::BF16, world, WIDE, &c, Algorithm::Auto);
            assert_eq!(at.algorithm, Algorithm::OneShot, "world {world}");
            assert_eq!(above.algorithm, Algorithm::TwoShot, "world {world}");
        }
        // One rank: the two-shot is one pass from input to output.
        let p = plan_all_reduce(64 << 20, DType::F32, 1, WIDE, &c, Algorithm::Auto);
        assert_eq!(p.algorithm, Algorithm::TwoShot);
    }

    #[test]
    fn auto_uses_the_low_latency_kernel_for_small_messages() {
        let c = Config::default();
        // The published thresholds: 256 KiB up to four ranks, 64 KiB above.
        for (world, max) in [
            (1, 256 << 10),
            (2, 256 << 10),
            (3, 256 << 10),
            (4, 256 << 10),
            (8, 64 << 10),
        ] {
            let len = max / 2;
            let at = plan_all_reduce(len, DType::BF16, world, WIDE, &c, Algorithm::Auto);
            let above = plan_all_reduce(len + 1, DType::BF16, world, WIDE, &c, Algorithm::Auto);
            assert_eq!(at.algorithm, Algorithm::LowLatency, "world {world}");
            let next = if world == 1 {
                Algorithm::TwoShot
            } else {
                Algorithm::OneShot
            };
            assert_eq!(above.algorithm, next, "world {world}");
        }
        // One thread per 32-bit word in 128-thread blocks: 8 KiB is 2048 words, 16 blocks;
        // 16 KiB 32.
        let ll = |len| plan_all_reduce(len, DType::BF16, 8, WIDE, &c, Algorithm::Auto);
        assert_eq!((ll(4096).blocks, ll(4096).threads), (16, 128));
        assert_eq!((ll(8192).blocks, ll(8192).threads), (32, 128));
        let one = plan_all_reduce(1, DType::F32, 8, WIDE, &c, Algorithm::Auto);
        assert_eq!((one.blocks, one.threads), (1, 128));
        // Once the block limit binds, blocks grow back towards 512 threads: 64 KiB forced is
        // 16384 words over at most 32 blocks, 512 threads each; 128 KiB (32768 words) no
        // longer fits a word per thread, and the kernel takes 16-byte lines (8192 of them).
        let mid = plan_all_reduce(32768, DType::BF16, 8, WIDE, &c, Algorithm::LowLatency);
        assert_eq!((mid.blocks, mid.threads), (32, 512));
        let big = plan_all_reduce(65536, DType::BF16, 8, WIDE, &c, Algorithm::LowLatency);
        assert_eq!((big.blocks, big.threads), (32, 512));
        // The multicast low-latency kernel takes the same grid: a thread per word.
        let mm = grid(Kernel::LowLatencyMultimem, 4096, DType::BF16, 8, WIDE);
        assert_eq!((mm.blocks, mm.threads), (16, 128));
        // Off when 0, and never beyond the capacity.
        let off = Config {
            low_latency_max_bytes: Some(0),
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
        assert_eq!(tiny.low_latency_limit(8), 1024);
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
        // 8 KiB bf16 = 512 packs: one block of 512 threads.
        assert_eq!(grid(Kernel::OneShot, 4096, DType::BF16, 8, WIDE).blocks, 1);
        assert_eq!(grid(Kernel::OneShot, 4097 * 8, DType::BF16, 8, WIDE).blocks, 9);
        // Tail-only message still launches one block.
        assert_eq!(grid(Kernel::OneShot, 3, DType::F32, 8, WIDE).blocks, 1);
        let tight = Limits {
            one_shot_blocks: 4,
            two_shot_blocks: 2,
        };
        assert_eq!(grid(Kernel::OneShot, 1 << 24, DType::F32, 8, tight).blocks, 4);
        assert_eq!(grid(Kernel::LowLatency, 1 << 24, DType::F32, 8, tight).blocks, 4);
        assert_eq!(grid(Kernel::TwoShot, 1 << 24, DType::F32, 8, tight).blocks, 2);
        assert_eq!(grid(Kernel::InPlace, 1 << 24, DType::F32, 8, tight).blocks, 2);
        // Two-shot sizes its grid by the slice, not the whole message.
        assert_eq!(grid(Kernel::TwoShot, 8 * 512 * 8, DType::BF16, 8, WIDE).blocks, 1);
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
}
