//! `symm-bench`: latency and bandwidth of symm-allreduce's all-reduce kernels (low-latency,
//! one-shot, two-shot, zero-copy in place, `auto`), with NCCL beside them, in nccl-tests
//! style (nccl-tests' flags work too: `-b/-e/-f/-i/-n/-w/-d/-t/-g/-c/-o/-a/-m/-z/-G`).
//!
//! For every (dtype, size, algorithm, mode) it prints a table row to stdout and writes the
//! same rows to `results.csv` and `results.json` in `--out`, and draws `latency.png`.
//! Progress goes to stderr. `--launcher processes` runs one process per rank (see `procs.rs`).
//! Without a GPU it prints `symm-bench: no GPU: <error>` and exits
//! with code 2; a verification failure or an NCCL error exits with 1 after all rows ran.
//!
//! # Columns (results.csv, results.json `rows`)
//!
//! | column | meaning |
//! | --- | --- |
//! | `dtype` | `bf16`, `f16` or `f32` |
//! | `mode` | `eager`, `graph_amortised` (10 all-reduces per graph, time per all-reduce), `graph_isolated` (one per graph, each replay timed) |
//! | `algo` | what was asked: `low_latency`, `one_shot`, `two_shot`, `auto`, `symmetric`, `pool`, `nccl`, `multimem`, `multimem_one_shot`, `multimem_ll`; `sync_floor`; with `--producer-chain` `chain_pdl`, `chain_no_pdl`, `producer_only` (symm-bench/README.md) |
//! | `kernel` | what ran (`auto` resolves to `low_latency`, `one_shot` or `two_shot`, the two-shot to `two_shot_ll` over the low-latency lines; `symmetric` and `pool` run `in_place`; `nccl`) |
//! | `placement` | `virtual` (all ranks on one GPU), `per_gpu`, or `processes` (`--launcher processes`) |
//! | `world` | ranks in this row (NCCL on one GPU runs with world 1) |
//! | `blocks` | blocks per rank of the library's grid (empty for NCCL) |
//! | `size_bytes` | message size per rank in bytes (the asked size rounded down to whole elements) |
//! | `count` | elements per rank |
//! | `time_us` | median time per all-reduce, µs (GPU time between CUDA events) |
//! | `p10_us`, `p90_us` | 10th and 90th percentile of the samples |
//! | `samples` | samples behind the percentiles: eager, one per batch of 10 rounds; graph modes, one per replay round |
//! | `empty_us` | median of the same launch structure with the body-less kernel of the same grid (empty for NCCL) |
//! | `over_empty_us` | `time_us - empty_us`: the cost of the all-reduce itself above launch and replay cost |
//! | `host_us` | CPU time to enqueue one rank's work of one round: one `all_reduce` call (eager) or one graph launch |
//! | `empty_host_us` | the same for the empty kernel (`launch_empty`) |
//! | `algbw_gbs` | S / t, GB/s (10^9 B/s) |
//! | `busbw_gbs` | algbw · 2(W-1)/W, as nccl-tests |
//! | `hbm_gbs` | 2·W·S / t: distinct HBM bytes (each input read once, each output written once); the meaningful bandwidth for virtual ranks |
//! | `vs_nccl` | `time_us` / NCCL's `time_us` at the same dtype, mode and size (below 1: faster than NCCL); empty where NCCL did not run |
//! | `hidden` | the fused call's row length; empty for other rows |
//! | `place` | `in` (in-place calls: `symmetric`, `pool`, `multimem`) or `out` |
//! | `wrong` | nccl-tests' #wrong: 0 for a checked row (failing rows are not timed), empty with `-c 0` |
//!
//! results.json holds `{"meta": {...}, "rows": [...]}`; `meta` has the devices, placement,
//! the estimated duration, NCCL status, the 1 GiB D2D copy bandwidth, the empty-kernel graph replay floor, notes and
//! failures.

#![deny(clippy::undocumented_unsafe_blocks)]

mod args;
mod bench;
mod data;
mod mps;
mod nccl;
mod plot;
mod procs;
mod report;
mod timing;
mod tune;

use std::process::ExitCode;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use symm_allreduce::DType;

use crate::args::{format_size, AlgoChoice, Args, Launcher, RunPlan, ONE_SHOT_SWEEP_MAX};
use crate::bench::{Bench, BenchError, Placement};
use crate::report::{Meta, Row};

/// Why the run stopped early.
enum Stop {
    /// No driver or device: exit 2.
    NoGpu(symm_allreduce::Error),
    /// Bad flags: exit 2.
    Usage(String),
    /// Setup or a fatal row error: exit 1.
    Failed(String),
}

fn main() -> ExitCode {
    let args = match Args::parse().resolve() {
        Ok(args) => args,
        Err(msg) => {
            eprintln!("symm-bench: {msg}");
            return ExitCode::from(2);
        }
    };
    args::set_graph_chain(&args);
    match run(&args) {
        Ok(code) => code,
        Err(Stop::NoGpu(e)) => {
            eprintln!("symm-bench: no GPU: {e}");
            ExitCode::from(2)
        }
        Err(Stop::Usage(msg)) => {
            eprintln!("symm-bench: {msg}");
            ExitCode::from(2)
        }
        Err(Stop::Failed(msg)) => {
            eprintln!("symm-bench: {msg}");
            ExitCode::from(1)
        }
    }
}

/// `--replot`: the picture from saved rows, without a GPU.
fn replot(json: &std::path::Path) -> Result<ExitCode, Stop> {
    #[derive(serde::Deserialize)]
    struct Saved {
        meta: serde_json::Value,
        rows: Vec<Row>,
    }
    let text = std::fs::read_to_string(json).map_err(|e| Stop::Usage(format!("{}: {e}", json.display())))?;
    let saved: Saved =
        serde_json::from_str(&text).map_err(|e| Stop::Usage(format!("{}: {e}", json.display())))?;
    let devices = saved.meta["devices"]
        .as_array()
        .map(|d| d.iter().filter_map(|v| v.as_str()).collect::<Vec<_>>().join(", "))
        .unwrap_or_default();
    let world = saved.rows.iter().map(|r| r.world).max().unwrap_or(0);
    let title = match saved.meta["placement"].as_str() {
        Some("virtual") => format!("W={world} virtual ranks on device {devices}"),
        Some("processes") => format!("W={world} processes ({devices})"),
        _ => format!("W={world}, one rank per GPU ({devices})"),
    };
    let png = json.with_file_name("latency.png");
    plot::latency_png(&png, &saved.rows, &title).map_err(|e| Stop::Failed(format!("latency.png: {e}")))?;
    println!("wrote {}", png.display());
    Ok(ExitCode::SUCCESS)
}

fn run(args: &Args) -> Result<ExitCode, Stop> {
    if let Some(json) = &args.replot {
        return replot(json);
    }
    symm_allreduce::validate_world(args.world).map_err(|e| Stop::Usage(e.to_string()))?;
    if let Some(out) = &args.tune {
        if args.launcher == Launcher::Processes {
            return Err(Stop::Usage(
                "--tune runs with --launcher threads (virtual ranks or one rank per GPU)".into(),
            ));
        }
        return tune::run(args, out);
    }
    if args.launcher == Launcher::Processes {
        return procs::run(args);
    }
    let mut plan = RunPlan::from_args(args);
    let mut meta = Meta {
        tool: format!("symm-bench {}", env!("CARGO_PKG_VERSION")),
        world: args.world,
        ..Meta::default()
    };

    let count = symm_allreduce::device_count().map_err(Stop::NoGpu)?;
    let placement = if !args.virtual_ranks && count >= 2 && args.world <= count {
        Placement::PerGpu
    } else {
        if count >= 2 && !args.virtual_ranks {
            meta.notes.push(format!(
                "{count} GPUs are fewer than --world {}: virtual ranks on device {}",
                args.world, args.device
            ));
        }
        Placement::Virtual { device: args.device }
    };
    let ctxs = bench::contexts(placement, args.world).map_err(Stop::NoGpu)?;

    // The copy runs first, while its 2 GiB are still free.
    let copy = ctxs[0]
        .new_stream()
        .map_err(BenchError::from)
        .and_then(|s| bench::d2d_copy_gbs(&s));
    match copy {
        Ok(gbs) => meta.d2d_copy_gbs = Some(gbs),
        Err(e) => meta.notes.push(format!("D2D copy not measured: {e}")),
    }

    let free = bench::free_memory(&ctxs).map_err(|e| Stop::Failed(format!("cuMemGetInfo: {e}")))?;
    let ranks_per_device = match placement {
        Placement::Virtual { .. } => args.world,
        Placement::PerGpu => 1,
    };
    let dropped = plan.cap_sizes(bench::max_fitting_size(
        free,
        ranks_per_device,
        plan.capacities_per_rank(),
    ));
    if !dropped.is_empty() {
        meta.notes.push(format!(
            "sizes {} skipped: {ranks_per_device} rank(s) × {} × capacity (3 of workspace, input, output{}) do not \
             fit in {} MiB free",
            dropped.iter().map(|&s| format_size(s)).collect::<Vec<_>>().join(","),
            plan.capacities_per_rank(),
            if plan.producer_chain {
                ", the PDL twin's workspace and the chain's staged input"
            } else {
                ""
            },
            free >> 20
        ));
    }
    let Some(&capacity) = plan.sizes.last() else {
        return Err(Stop::Failed("no size fits in device memory".into()));
    };
    if !plan.explicit_sizes && plan.algos.contains(&AlgoChoice::OneShot) && capacity > ONE_SHOT_SWEEP_MAX {
        meta.notes.push(format!(
            "one_shot skipped above {} in the sweep (name the sizes with --sizes to run it)",
            format_size(ONE_SHOT_SWEEP_MAX)
        ));
    }

    meta.estimated_duration_s = Some(plan.estimate(args.world).as_secs_f64());

    let with_nccl = plan.algos.contains(&AlgoChoice::Nccl);
    let with_nccl_symm = plan.algos.contains(&AlgoChoice::NcclSymm);
    let mut bench = Bench::new(
        ctxs,
        placement,
        plan.config(capacity),
        (with_nccl, with_nccl_symm),
        plan.producer_chain,
    )
    .map_err(|e| Stop::Failed(format!("setup failed: {e}")))?;
    meta.placement = placement.name().into();
    meta.devices = bench.device_names();
    meta.capacity_bytes = capacity;
    match bench.empty_graph_floor() {
        Ok((us, blocks)) => {
            meta.empty_graph_floor_us = Some(us);
            meta.empty_graph_floor_blocks = Some(blocks);
        }
        Err(e) => meta
            .notes
            .push(format!("empty-kernel graph floor not measured: {e}")),
    }
    meta.nccl = bench.nccl_status();
    if with_nccl_symm {
        meta.notes.push(bench.nccl_symm_status());
    }
    let title = match placement {
        Placement::Virtual { device } => format!(
            "W={} virtual ranks on device {device} ({}), their blocks on up to {}% of its SMs \
             (--shared-sm-percent)",
            args.world,
            meta.devices.join(", "),
            plan.shared_sm_percent
        ),
        Placement::PerGpu => format!("W={}, one rank per GPU", args.world),
    };
    print!("{}", header(&meta, &title));
    if with_nccl && !bench.nccl_ready() {
        eprintln!("symm-bench: {}; continuing without it", meta.nccl);
    }

    let units: usize = plan
        .sizes
        .iter()
        .map(|&s| {
            plan.algos
                .iter()
                .filter(|&&a| plan.runs(a, s, args.world))
                .count()
                + usize::from(plan.producer_chain)
        })
        .sum::<usize>()
        * plan.dtypes.len();
    let pb = ProgressBar::new(units as u64);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    let mut rows: Vec<Row> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut fatal: Option<String> = None;
    'sweep: for &dtype in &plan.dtypes {
        for &size in &plan.sizes {
            let done = match dtype {
                DType::BF16 => bench.run_size::<half::bf16>(&plan, size, &mut rows, &mut failures, &pb),
                DType::F16 => bench.run_size::<half::f16>(&plan, size, &mut rows, &mut failures, &pb),
                DType::F32 => bench.run_size::<f32>(&plan, size, &mut rows, &mut failures, &pb),
            };
            report::fill_nccl_ratios(&mut rows);
            report::fill_checked(&mut rows, plan.check);
            save(args, &mut meta, &rows, &failures, &pb);
            if let Err(e) = done {
                fatal = Some(format!("{dtype} {size} B: {e}"));
                pb.suspend(|| print_tables(&rows, dtype, &plan, args.world, &title));
                break 'sweep;
            }
        }
        pb.suspend(|| print_tables(&rows, dtype, &plan, args.world, &title));
    }
    pb.finish_and_clear();
    meta.nccl = bench.nccl_status();
    drop(bench);

    if let Some(msg) = fatal {
        failures.push(msg.clone());
        save(args, &mut meta, &rows, &failures, &pb);
        return Err(Stop::Failed(format!(
            "stopped: {msg} (partial results in {})",
            args.out.display()
        )));
    }
    Ok(finish(args, &mut meta, &rows, &failures, &title, &pb))
}

/// The end of a run that went through: picture, files, target proxies, notes; exit code 1
/// when a row failed.
fn finish(
    args: &Args,
    meta: &mut Meta,
    rows: &[Row],
    failures: &[String],
    title: &str,
    pb: &ProgressBar,
) -> ExitCode {
    if !rows.is_empty() {
        let png = args.out.join("latency.png");
        if let Err(e) = plot::latency_png(&png, rows, title) {
            meta.notes.push(format!("latency.png not drawn: {e}"));
        }
    }
    if timing::gate_timeouts() > 0 {
        meta.notes.push(format!(
            "the launch gate opened by timeout {} time(s): those samples include host enqueue time",
            timing::gate_timeouts()
        ));
    }
    save(args, meta, rows, failures, pb);
    for line in report::summary(rows, meta.d2d_copy_gbs) {
        println!("{line}");
    }
    println!("#");
    for line in report::nccl_tests_summary(rows, failures.len()) {
        println!("{line}");
    }
    for note in &meta.notes {
        println!("# note: {note}");
    }
    println!("# results: {}", args.out.display());
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("symm-bench: {} row(s) failed:", failures.len());
        for f in failures {
            eprintln!("  {f}");
        }
        ExitCode::from(1)
    }
}

fn header(meta: &Meta, title: &str) -> String {
    let mut s = format!("# symm-bench: {title}\n");
    s += &format!("# capacity {} per rank\n", format_size(meta.capacity_bytes));
    if let Some(secs) = meta.estimated_duration_s {
        s += &format!(
            "# estimated duration: {} (an estimate: rounds × a per-call time model, see --help)\n",
            report::format_duration(secs)
        );
    }
    s += &format!("# {}\n", meta.nccl);
    if !meta.mps.is_empty() {
        s += &format!("# {}\n", meta.mps);
    }
    if let Some(gbs) = meta.d2d_copy_gbs {
        s += &format!("# D2D copy, 1 GiB, (read + write) / time: {gbs:.1} GB/s\n");
    }
    if let (Some(us), Some(blocks)) = (meta.empty_graph_floor_us, meta.empty_graph_floor_blocks) {
        s += &format!(
            "# empty-kernel graph replay floor, W={} × {blocks} block(s) of 512 threads: {us:.2} µs\n",
            meta.world
        );
    }
    s
}

fn print_tables(rows: &[Row], dtype: DType, plan: &RunPlan, world: usize, title: &str) {
    for &mode in &plan.modes {
        let here: Vec<&Row> = rows
            .iter()
            .filter(|r| r.dtype == dtype.name() && r.mode == mode)
            .collect();
        if !here.is_empty() {
            print!("{}", report::table(&here, dtype.name(), mode, world, title));
        }
    }
}

/// Writes results.csv and results.json (after every size, so a cut-short run keeps its rows).
fn save(args: &Args, meta: &mut Meta, rows: &[Row], failures: &[String], pb: &ProgressBar) {
    meta.failures = failures.to_vec();
    meta.gate_timeouts = timing::gate_timeouts();
    if let Err(e) = report::write_files(&args.out, meta, rows) {
        pb.suspend(|| eprintln!("symm-bench: cannot write results to {}: {e}", args.out.display()));
    }
}
