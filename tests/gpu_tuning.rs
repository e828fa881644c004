//! The tuning table on the GPU: a loaded table moves `Auto`'s choice (and grows the
//! low-latency slots) while the sums stay exact, and its fused section moves the fused
//! all-reduce + residual + RMSNorm call's choice while the bits stay those of the published
//! choice; ranks that disagree on the table, or read a bad one through
//! `SYMM_ALLREDUCE_TUNING`, fail setup on every rank with a typed error.
//! Virtual ranks on device 0; run by the libtest-mimic harness (skips without a GPU).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{check_against_f64, check_bits, collect_outputs, emulate, group, random_input, rng};
use half::bf16;
use symm_allreduce::cudarc::driver::{CudaContext, CudaSlice};
use symm_allreduce::{
    Algorithm, Communicator, Config, Crossovers, DType, Error, FusedCrossovers, LocalHub, Measured,
    TuningProblem, TuningTable, TUNING_ENV, TUNING_VERSION,
};

/// The environment variable is process-wide: the tests that depend on it take turns.
static ENV: Mutex<()> = Mutex::new(());

fn measured() -> Measured {
    Measured {
        device: "test".into(),
        driver: "test".into(),
        date: "2026-12-03T00:00:00Z".into(),
        crate_version: symm_allreduce::VERSION.into(),
        placement: "virtual".into(),
        note: String::new(),
    }
}

/// bf16 at W=`world`: low-latency up to 96 KiB (above the default 32 KiB slots), one-shot up
/// to `one_shot`, two-shot above.
fn table(world: usize, one_shot: usize) -> TuningTable {
    TuningTable::new(
        measured(),
        vec![Crossovers {
            dtype: DType::BF16,
            world,
            low_latency_max_bytes: 96 << 10,
            two_shot_ll_max_bytes: None,
            one_shot_max_bytes: one_shot,
            two_shot_max_bytes: None,
        }],
    )
    .unwrap()
}

/// Sets every rank up on its own thread with its own configuration; every rank's result.
fn setup_each(ctx: &Arc<CudaContext>, configs: Vec<Config>) -> Vec<Result<Communicator, Error>> {
    let hub = LocalHub::new(configs.len(), Duration::from_secs(30));
    std::thread::scope(|s| {
        let handles: Vec<_> = configs
            .into_iter()
            .enumerate()
            .map(|(r, config)| {
                let hub = hub.rank(r);
                let ctx = ctx.clone();
                s.spawn(move || Communicator::new(&hub, ctx, config))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("setup thread"))
            .collect()
    })
}

fn ranks_disagreeing_on_the_tuning_table_fail_setup_on_every_rank(ctx: Arc<CudaContext>) {
    let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let tuned = Config::default().with_tuning(table(4, 1 << 20));
    let other = Config::default().with_tuning(table(4, 2 << 20));
    // (world, the odd rank, its configuration): another table; no table at all.
    for (world, odd, odd_config) in [
        (2, 1, other),
        (4, 0, Config::default()),
        (3, 2, Config::default()),
    ] {
        let configs = (0..world)
            .map(|r| {
                if r == odd {
                    odd_config.clone()
                } else {
                    tuned.clone()
                }
            })
            .collect();
        let results = setup_each(&ctx, configs);
        for (r, result) in results.into_iter().enumerate() {
            match result {
                Err(Error::TuningMismatch { rank, ours, theirs }) => {
                    let expected = if r == odd { usize::from(odd == 0) } else { odd };
                    assert_eq!(rank, expected, "W={world} rank {r}");
                    assert_ne!(ours, theirs);
                }
                Err(e) => panic!("W={world} rank {r}: expected TuningMismatch, got {e}"),
                Ok(_) => panic!("W={world} rank {r}: setup succeeded with mismatched tables"),
            }
        }
    }
    // The same table on every rank: setup succeeds, and every rank reports it.
    let comms = setup_each(&ctx, vec![tuned.clone(); 2]);
    for c in comms {
        let c = c.expect("same table on every rank");
        assert_eq!(c.config().tuning, tuned.tuning);
    }
}

fn a_bad_table_in_the_environment_fails_setup_on_every_rank(ctx: Arc<CudaContext>) {
    let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let dir = std::env::temp_dir().join(format!("symm-gpu-tuning-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("v9.json");
    std::fs::write(
        &bad,
        table(2, 1 << 20)
            .to_json()
            .replace(&format!("\"version\": {TUNING_VERSION}"), "\"version\": 9"),
    )
    .unwrap();
    let good = dir.join("good.json");
    std::fs::write(&good, table(2, 1 << 20).to_json()).unwrap();

    // The ENV lock keeps this file's other tests from reading the variable meanwhile.
    std::env::set_var(TUNING_ENV, &bad);
    let results = setup_each(&ctx, vec![Config::default(); 2]);
    std::env::set_var(TUNING_ENV, &good);
    let loaded = setup_each(&ctx, vec![Config::default(); 2]);
    std::env::remove_var(TUNING_ENV);

    for (r, result) in results.into_iter().enumerate() {
        match result {
            Err(Error::InvalidTuning {
                problem: TuningProblem::WrongVersion { found: 9, .. },
                table,
            }) => assert!(table.ends_with("v9.json"), "rank {r}: {table}"),
            Err(e) => panic!("rank {r}: expected InvalidTuning, got {e}"),
            Ok(_) => panic!("rank {r}: setup succeeded with a version-9 table"),
        }
    }
    for c in loaded {
        let c = c.expect("a good table from the environment");
        let t = c.config().tuning.as_ref().expect("the table was loaded");
        assert_eq!(t.origin(), Some(good.as_path()));
        let d = c.describe();
        assert!(d.contains(&format!("{:016x}", t.digest())), "{d}");
        assert!(d.contains("good.json"), "{d}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn run_auto_and_check<T: common::TestElem>(
    comms: &[Communicator],
    streams: &[Arc<symm_allreduce::cudarc::driver::CudaStream>],
    len: usize,
    seed: u64,
) {
    let mut g = rng(seed);
    let inputs: Vec<Vec<T>> = (0..comms.len()).map(|_| random_input(&mut g, len)).collect();
    let d_in: Vec<CudaSlice<T>> = streams
        .iter()
        .zip(&inputs)
        .map(|(s, x)| s.clone_htod(x).unwrap())
        .collect();
    let expected = emulate(&inputs);
    for algo in [Algorithm::Auto, Algorithm::TwoShot] {
        let mut d_out: Vec<CudaSlice<T>> = streams.iter().map(|s| s.alloc_zeros(len).unwrap()).collect();
        for r in 0..comms.len() {
            comms[r]
                .all_reduce_with(&d_in[r], &mut d_out[r], &streams[r], algo)
                .unwrap();
        }
        for (r, out) in collect_outputs(comms, streams, &d_out).iter().enumerate() {
            check_against_f64(&inputs, out).unwrap_or_else(|e| panic!("{algo} len {len} rank {r}: {e}"));
            check_bits(&format!("{algo} len {len} rank {r}"), &expected, out).unwrap();
        }
    }
}

fn a_loaded_table_moves_autos_choice_and_the_sums_stay_exact(ctx: Arc<CudaContext>) {
    // Eight ranks: the published low-latency threshold there is 32 KiB (up to four ranks it is
    // 256 KiB, above this table's).
    const W: usize = 8;
    let config = Config {
        capacity_bytes: 4 << 20,
        ..Config::default()
    }
    .with_tuning(table(W, 1536 << 10));
    let (comms, streams) = group(&ctx, W, config);
    let (plain, plain_streams) = group(
        &ctx,
        W,
        Config {
            capacity_bytes: 4 << 20,
            ..Config::default()
        },
    );
    // (bf16 elements, algorithm with the table, with the published starting points).
    for (len, with_table, published) in [
        (40_000usize, Algorithm::LowLatency, Algorithm::OneShot), // 80 KB: beyond the default slots
        (49_152, Algorithm::LowLatency, Algorithm::OneShot),      // exactly 96 KiB
        (49_153, Algorithm::OneShot, Algorithm::OneShot),
        (600_001, Algorithm::OneShot, Algorithm::TwoShot), // 1.2 MB: above the published 512 KiB
        (786_433, Algorithm::TwoShot, Algorithm::TwoShot), // just above 1.5 MiB
    ] {
        let p = comms[0].path(len, DType::BF16, Algorithm::Auto).unwrap();
        assert_eq!(p.algorithm, with_table, "len {len}: {p}");
        let q = plain[0].path(len, DType::BF16, Algorithm::Auto).unwrap();
        assert_eq!(q.algorithm, published, "len {len}: {q}");
        run_auto_and_check::<bf16>(&comms, &streams, len, len as u64);
    }
    // The published group refuses the low-latency kernel beyond its 32 KiB slots; the tuned
    // one's slots hold 96 KiB.
    assert!(matches!(
        plain[0].path(40_000, DType::BF16, Algorithm::LowLatency),
        Err(Error::ExceedsCapacity { .. })
    ));
    drop((plain, plain_streams));
    // f32 is not in the table: the published rule (80 KB: one-shot).
    let p = comms[0].path(20_000, DType::F32, Algorithm::Auto).unwrap();
    assert_eq!(p.algorithm, Algorithm::OneShot, "{p}");
    run_auto_and_check::<f32>(&comms, &streams, 20_000, 7);
    let d = comms[0].describe();
    assert!(
        d.contains("bf16 low-latency <= 98304, one-shot <= 1572864"),
        "{d}"
    );
    assert!(d.contains("(table)"), "{d}");
}

/// Every rank's (residual after the call, norm_out) of one fused `Auto` call of `tokens` rows
/// of `hidden` bf16 elements (the same data for the same seed).
fn fused_auto(
    comms: &[Communicator],
    streams: &[Arc<symm_allreduce::cudarc::driver::CudaStream>],
    tokens: usize,
    hidden: usize,
    seed: u64,
) -> Vec<(Vec<bf16>, Vec<bf16>)> {
    let len = tokens * hidden;
    let mut g = rng(seed);
    let residual: Vec<bf16> = random_input(&mut g, len);
    let weight: Vec<bf16> = random_input(&mut g, hidden);
    let mut d_res = Vec::new();
    let mut d_out = Vec::new();
    let mut keep = Vec::new();
    for (c, s) in comms.iter().zip(streams) {
        let input: Vec<bf16> = random_input(&mut g, len);
        let (x, w) = (s.clone_htod(&input).unwrap(), s.clone_htod(&weight).unwrap());
        let mut res = s.clone_htod(&residual).unwrap();
        let mut out = s.alloc_zeros::<bf16>(len).unwrap();
        // The uploads read the host vectors: wait before `input` is dropped.
        s.synchronize().unwrap();
        c.all_reduce_add_rmsnorm(&x, &mut res, &w, 1e-5, &mut out, s)
            .unwrap();
        d_res.push(res);
        d_out.push(out);
        keep.push((x, w));
    }
    let res = collect_outputs(comms, streams, &d_res);
    let out = collect_outputs(comms, streams, &d_out);
    res.into_iter().zip(out).collect()
}

fn a_loaded_table_moves_the_fused_auto_choice_and_the_bits_stay(ctx: Arc<CudaContext>) {
    const W: usize = 4;
    let fused = FusedCrossovers {
        dtype: DType::BF16,
        world: W,
        hidden: 8192,
        one_shot_max_tokens: 8,
    };
    let table = TuningTable::new(measured(), vec![])
        .unwrap()
        .with_fused(vec![fused])
        .unwrap();
    // The whole device for the four ranks' blocks (33 a rank on 132 SMs), so that no row
    // count here outnumbers the fused kernels' blocks (Auto then runs the all-reduce and the
    // epilogue kernel instead).
    let config = Config {
        capacity_bytes: 4 << 20,
        shared_sm_percent: 100,
        ..Config::default()
    };
    let (comms, streams) = group(&ctx, W, config.clone().with_tuning(table));
    let (plain, plain_streams) = group(&ctx, W, config);
    // Up to the low-latency limit (32 KiB) a device with thread-block clusters takes the fused
    // low-latency kernel, whatever the table's fused entry says.
    let clusters = ctx.compute_capability().unwrap().0 >= 9;
    // (tokens, hidden, algorithm with the table, with the published rule: one-shot up to
    // 512 KiB at W=4).
    for (tokens, hidden, with_table, published) in [
        (1, 8192, Algorithm::OneShot, Algorithm::OneShot),
        (2, 8192, Algorithm::OneShot, Algorithm::OneShot),
        (8, 8192, Algorithm::OneShot, Algorithm::OneShot),
        (9, 8192, Algorithm::TwoShot, Algorithm::OneShot),
        (32, 8192, Algorithm::TwoShot, Algorithm::OneShot), // exactly 512 KiB
        (9, 7168, Algorithm::TwoShot, Algorithm::OneShot),  // not measured: 8192's entry
        (33, 8192, Algorithm::TwoShot, Algorithm::TwoShot),
    ] {
        let low_latency = clusters && tokens * hidden * 2 <= 32 << 10;
        let (with_table, published) = if low_latency {
            (Algorithm::LowLatency, Algorithm::LowLatency)
        } else {
            (with_table, published)
        };
        // More rows than the fused kernel's blocks (a device smaller than 132 SMs): `Auto`
        // runs the all-reduce (its own choice) and the epilogue kernel instead.
        let expected = |c: &Communicator, fused: Algorithm| {
            if fused == Algorithm::LowLatency {
                return (fused, false);
            }
            let grid = c.add_rmsnorm_path(tokens, hidden, DType::BF16, fused).unwrap();
            if tokens > grid.plan.unwrap().blocks as usize {
                let all_reduce = c.path(tokens * hidden, DType::BF16, Algorithm::Auto).unwrap();
                (all_reduce.algorithm, true)
            } else {
                (fused, false)
            }
        };
        let (with_table, pair) = expected(&comms[0], with_table);
        let p = comms[0]
            .add_rmsnorm_path(tokens, hidden, DType::BF16, Algorithm::Auto)
            .unwrap();
        assert_eq!(p.algorithm, with_table, "{tokens}x{hidden}: {p}");
        assert!(
            low_latency || pair || p.reason.contains("tuning table's entry for hidden 8192"),
            "{tokens}x{hidden}: {p}"
        );
        let (published, _) = expected(&plain[0], published);
        let q = plain[0]
            .add_rmsnorm_path(tokens, hidden, DType::BF16, Algorithm::Auto)
            .unwrap();
        assert_eq!(q.algorithm, published, "{tokens}x{hidden}: {q}");
        // The kernels differ, the bits do not (the same arithmetic).
        let seed = (tokens * hidden) as u64;
        let tuned_bits = fused_auto(&comms, &streams, tokens, hidden, seed);
        let plain_bits = fused_auto(&plain, &plain_streams, tokens, hidden, seed);
        for (r, ((res, out), (res0, out0))) in tuned_bits.iter().zip(&plain_bits).enumerate() {
            let what = format!("{tokens}x{hidden} rank {r}");
            check_bits(&format!("{what} residual"), res0, res).unwrap();
            check_bits(&format!("{what} norm_out"), out0, out).unwrap();
        }
    }
    // f16 is not in the table: the published rule.
    let p = comms[0]
        .add_rmsnorm_path(9, 8192, DType::F16, Algorithm::Auto)
        .unwrap();
    assert_eq!(p.algorithm, Algorithm::OneShot, "{p}");
    assert!(p.reason.contains("bytes <= one-shot limit (524288)"), "{p}");
    let d = comms[0].describe();
    assert!(
        d.contains("bf16 one-shot <= 8 tokens at hidden 8192 (table"),
        "{d}"
    );
    assert!(!plain[0].describe().contains("tokens at hidden"));
}

fn main() -> std::process::ExitCode {
    common::harness::run(
        "gpu_tuning",
        vec![
            gpu_test!(ranks_disagreeing_on_the_tuning_table_fail_setup_on_every_rank),
            gpu_test!(a_bad_table_in_the_environment_fails_setup_on_every_rank),
            gpu_test!(a_loaded_table_moves_autos_choice_and_the_sums_stay_exact),
            gpu_test!(a_loaded_table_moves_the_fused_auto_choice_and_the_bits_stay),
        ],
    )
}
