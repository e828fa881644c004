//! `--tune`: measures where each algorithm wins on the machine at hand and writes the
//! library's tuning table (`symm_allreduce::TuningTable`, read back by
//! `Config::with_tuning_file` or `SYMM_ALLREDUCE_TUNING`).
//!
//! For each world W (2, 4, ... up to `--world`, and `--world` itself), each `--dtype` and
//! each size of the tuning sweep it times low-latency (up to [`LL_TUNE_MAX`]), one-shot and
//! two-shot (and NCCL where it can run W ranks: one rank per GPU) with the sweep's own timing
//! code (graph_amortised: one CUDA graph of 10 all-reduces per rank, median per all-reduce),
//! every row verified against the f64 sum first. The crossovers are then read off the
//! medians in routing order ([`crossovers`]): between an algorithm and the best of the later
//! ones, the threshold is the measured size that minimises the summed relative slowdown over
//! the whole sweep, slowdowns under [`NOISE`] counting as none. Measured curves cross more
//! than once where grid sizes step (one algorithm gains a block at 6 KiB, the other at
//! 12 KiB): a first-crossing rule would follow the first step, this one follows the sweep.
//!
//! The fused all-reduce + residual + RMSNorm call is timed beside it, per world and dtype: the
//! fused one-shot and two-shot at each hidden size of [`FUSED_HIDDEN`] and each token count of
//! [`fused_tokens`], every row verified bit for bit against the unfused pair first, with the
//! same graph timing. Its crossover per (dtype, world, hidden) is the largest token count the
//! fused one-shot keeps, by the same least-summed-slowdown rule ([`fused_crossover`]); it goes
//! into the table's `fused` section.

use std::path::Path;
use std::process::ExitCode;

use indicatif::ProgressBar;
use symm_allreduce::{Config, Crossovers, DType, FusedCrossovers, Measured, TuningTable};

use crate::args::{format_size, AlgoChoice, Args, Mode, RunPlan, SizeSpec, ONE_SHOT_SWEEP_MAX};
use crate::bench::{self, Bench, Placement, FUSED_ALGOS};
use crate::report::{self, Meta, Row};
use crate::{timing, Stop};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Low-latency is timed up to this size (its slots are sized for it).
pub const LL_TUNE_MAX: usize = 256 * KIB;

/// Relative slowdowns below this count as none (the medians' p10..p90 spread is about ±1-2%
/// here): noise alone never buys a threshold, and one noisy size moves the sum by no more
/// than its own error.
pub const NOISE: f64 = 0.02;

/// The tuning sweep: 2^k and 3·2^(k-1) bytes, 1 KiB..32 MiB (two sizes per octave).
pub fn tune_sizes() -> Vec<usize> {
    sizes_between(KIB, 32 * MIB)
}

/// `--tune --quick`: 4 KiB..4 MiB.
pub fn quick_tune_sizes() -> Vec<usize> {
    sizes_between(4 * KIB, 4 * MIB)
}

fn sizes_between(lo: usize, hi: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut p = lo;
    while p <= hi {
        v.push(p);
        if p + p / 2 <= hi {
            v.push(p + p / 2);
        }
        p *= 2;
    }
    v
}

/// The hidden sizes the fused call is tuned at (Llama 3 8B and Mixtral 4096, DeepSeek-V3
/// 7168, Llama 3 70B 8192); the library applies the nearest one to other sizes.
pub const FUSED_HIDDEN: [usize; 3] = [4096, 7168, 8192];

/// The fused call's token counts: 1, 2, 3, 4, 6, 8, ... 384, 512 (two per octave).
pub fn fused_tokens() -> Vec<usize> {
    let mut v = vec![1];
    v.extend(sizes_between(2, 512));
    v
}

/// The plan of one world's tuning sweep over the sizes `here` (the largest is the capacity):
/// graph timing, every row verified, the low-latency kernel's slots sized for
/// [`LL_TUNE_MAX`], and the rest of the run's options (`--shared-sm-percent`, `--no-pdl`,
/// `--no-early-trigger`, `--iters`) as a sweep takes them. The communicators are made from
/// its [`RunPlan::config`], as a sweep's are.
fn tune_plan(args: &Args, here: &[usize], dtypes: &[DType], capacity: usize) -> RunPlan {
    RunPlan {
        sizes: here.to_vec(),
        explicit_sizes: true,
        dtypes: dtypes.to_vec(),
        algos: vec![],
        modes: vec![Mode::GraphAmortised],
        iters: args.iters.map(|n| n as usize),
        warmup: args.warmup.map(|n| n as usize),
        quick: args.quick,
        low_latency_max: Some(LL_TUNE_MAX.min(capacity)),
        pdl: !args.no_pdl,
        early_trigger: !args.no_early_trigger,
        shared_sm_percent: args.shared_sm_percent,
        check_divergence: false,
        collectives: vec![crate::args::CollectiveChoice::AllReduce],
        producer_chain: false,
        // A table is only as good as the rows behind it: always verified.
        check: true,
    }
}

/// The worlds `--tune` measures: 2, 4, 8, ... up to `max`, and `max` itself (1 alone for 1).
pub fn tune_worlds(max: usize) -> Vec<usize> {
    let mut v: Vec<usize> = std::iter::successors(Some(2usize), |w| Some(w * 2))
        .take_while(|&w| w <= max)
        .collect();
    if !v.contains(&max) {
        v.push(max);
    }
    v
}

/// The median times of one size (µs; `None` where the algorithm did not run).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Point {
    pub size: usize,
    pub low_latency: Option<f64>,
    pub one_shot: Option<f64>,
    pub two_shot: Option<f64>,
    /// Whether the two-shot row ran over the low-latency lines (kernel `two_shot_ll`).
    pub two_shot_ll: bool,
    pub nccl: Option<f64>,
    /// NCCL on pool buffers registered as symmetric windows.
    pub nccl_symm: Option<f64>,
}

/// Where the earlier algorithm of a pair should hand over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    /// No size to compare.
    Unmeasured,
    /// The later algorithm from the first size on.
    Never,
    /// The earlier one up to this size, the later one above.
    At(usize),
    /// The earlier one at every size measured, up to this one.
    Throughout(usize),
}

/// The split of `(size, earlier, later)` points (ascending) that minimises the summed relative
/// slowdown, `max(0, chosen / other - 1 - noise)`, of giving the first k sizes to the earlier
/// algorithm and the rest to the later one; ties go to the smallest k.
fn best_split(points: &[(usize, f64, f64)], noise: f64) -> Split {
    if points.is_empty() {
        return Split::Unmeasured;
    }
    let slow = |chosen: f64, other: f64| (chosen / other - 1.0 - noise).max(0.0);
    let mut best = (f64::INFINITY, 0usize);
    for k in 0..=points.len() {
        let cost: f64 = points
            .iter()
            .enumerate()
            .map(|(i, &(_, early, late))| {
                if i < k {
                    slow(early, late)
                } else {
                    slow(late, early)
                }
            })
            .sum();
        // Strictly better only (ties keep the smaller k); 1e-12 absorbs rounding of the sums.
        if cost < best.0 - 1e-12 {
            best = (cost, k);
        }
    }
    match best.1 {
        0 => Split::Never,
        k if k == points.len() => Split::Throughout(points[k - 1].0),
        k => Split::At(points[k - 1].0),
    }
}

fn min_of(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// What [`crossovers`] found for one (dtype, world).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub low_latency_max: usize,
    /// The two-shot over the low-latency lines ahead of the one-shot above
    /// `low_latency_max` up to this (`None`: the one-shot there).
    pub two_shot_ll_max: Option<usize>,
    pub one_shot_max: usize,
    /// `None`: NCCL not measured, or two-shot wins at every size measured.
    pub two_shot_max: Option<usize>,
    /// Where NCCL's symmetric kernels on pool buffers (`nccl_symm`) overtake the best of this
    /// crate's kernels at each size: `Some(s)` = ours up to `s`, `nccl_symm` above (0: at
    /// every size); `None` = not measured, or ours at every size. Reported, not written
    /// into the table: `Auto`'s NCCL threshold serves plain buffers as well.
    pub nccl_symm_above: Option<usize>,
    /// What could not be decided (and what was assumed).
    pub notes: Vec<String>,
}

/// The crossovers in routing order, from points sorted by size: low-latency against the best
/// of the later algorithms, then one-shot (above low-latency's range) against the best of
/// two-shot and NCCL, then two-shot against NCCL. `None` when low-latency or one-shot has no
/// size to compare (then there is nothing to write).
pub fn crossovers(points: &[Point], noise: f64) -> Option<Found> {
    let mut notes = Vec::new();
    let pairs = |f: &dyn Fn(&Point) -> Option<(f64, f64)>, above: usize| -> Vec<(usize, f64, f64)> {
        points
            .iter()
            .filter(|p| p.size > above)
            .filter_map(|p| f(p).map(|(a, b)| (p.size, a, b)))
            .collect()
    };
    let ll = pairs(
        &|p| Some((p.low_latency?, min_of(min_of(p.one_shot, p.two_shot), p.nccl)?)),
        0,
    );
    let low_latency_max = match best_split(&ll, noise) {
        Split::Unmeasured => return None,
        Split::Never => 0,
        Split::At(s) => s,
        Split::Throughout(s) => {
            notes.push(format!(
                "low_latency won up to its largest measured size ({})",
                format_size(s)
            ));
            s
        }
    };
    let os = pairs(
        &|p| Some((p.one_shot?, min_of(p.two_shot, p.nccl)?)),
        low_latency_max,
    );
    let one_shot_max = match best_split(&os, noise) {
        Split::Unmeasured => return None,
        Split::Never => low_latency_max,
        Split::At(s) => s,
        Split::Throughout(s) => {
            notes.push(format!(
                "one_shot won up to the largest size compared ({}); two-shot assumed above",
                format_size(s)
            ));
            s
        }
    };
    // Within the one-shot's range, the band where the two-shot over the low-latency lines
    // beats it: it runs only where a shard fits the lines, so its sizes start right above
    // the low-latency range and the split is the band's top.
    let band: Vec<_> = pairs(
        &|p| Some((p.two_shot.filter(|_| p.two_shot_ll)?, p.one_shot?)),
        low_latency_max,
    )
    .into_iter()
    .filter(|&(size, ..)| size <= one_shot_max)
    .collect();
    let two_shot_ll_max = match best_split(&band, noise) {
        Split::Unmeasured | Split::Never => None,
        Split::At(s) | Split::Throughout(s) => {
            notes.push(format!(
                "the two-shot over the low-latency lines beat the one-shot above the low-latency range up to {}",
                format_size(s)
            ));
            Some(s)
        }
    };
    let ts = pairs(&|p| Some((p.two_shot?, p.nccl?)), one_shot_max);
    let two_shot_max = match best_split(&ts, noise) {
        Split::Unmeasured | Split::Throughout(_) => None,
        Split::Never => Some(one_shot_max),
        Split::At(s) => Some(s),
    };
    let best_ours = |p: &Point| min_of(min_of(p.low_latency, p.one_shot), p.two_shot);
    let symm = pairs(&|p| Some((best_ours(p)?, p.nccl_symm?)), 0);
    let nccl_symm_above = match best_split(&symm, noise) {
        Split::Unmeasured => None,
        Split::Never => {
            notes.push(
                "nccl_symm (NCCL's symmetric kernels on pool buffers) beat our kernels at every size".into(),
            );
            Some(0)
        }
        Split::At(s) => {
            notes.push(format!(
                "our best kernel beats nccl_symm (NCCL's symmetric kernels on pool buffers) up to {}; nccl_symm above \
                 (Config::nccl_above_bytes = {s} sends pool calls there; plain buffers get plain NCCL)",
                format_size(s)
            ));
            Some(s)
        }
        Split::Throughout(s) => {
            notes.push(format!(
                "our kernels beat nccl_symm at every size measured (up to {})",
                format_size(s)
            ));
            None
        }
    };
    Some(Found {
        low_latency_max,
        two_shot_ll_max,
        one_shot_max,
        two_shot_max,
        nccl_symm_above,
        notes,
    })
}

/// The points of one (dtype, world) from graph_amortised all-reduce rows, sorted by size.
pub fn points(rows: &[Row], dtype: DType, world: usize) -> Vec<Point> {
    let mut pts: Vec<Point> = Vec::new();
    // NCCL rows count only where NCCL ran all W ranks (not NCCL on one GPU, world 1).
    for r in rows.iter().filter(|r| {
        r.dtype == dtype.name() && r.mode == Mode::GraphAmortised && r.world == world && r.hidden.is_none()
    }) {
        let i = match pts.iter().position(|p| p.size == r.size_bytes) {
            Some(i) => i,
            None => {
                pts.push(Point {
                    size: r.size_bytes,
                    ..Point::default()
                });
                pts.len() - 1
            }
        };
        let slot = match r.algo.as_str() {
            "low_latency" => &mut pts[i].low_latency,
            "one_shot" => &mut pts[i].one_shot,
            "two_shot" => {
                pts[i].two_shot_ll = r.kernel == "two_shot_ll";
                &mut pts[i].two_shot
            }
            "nccl" => &mut pts[i].nccl,
            "nccl_symm" => &mut pts[i].nccl_symm,
            _ => continue,
        };
        *slot = Some(r.time_us);
    }
    pts.sort_by_key(|p| p.size);
    pts
}

/// Whether `r` is a graph_amortised fused row of (dtype, world).
fn is_fused_row(r: &Row, dtype: DType, world: usize) -> bool {
    r.hidden.is_some() && r.dtype == dtype.name() && r.mode == Mode::GraphAmortised && r.world == world
}

/// The hidden sizes the fused rows of (dtype, world) were measured at, ascending.
pub fn fused_hidden_sizes(rows: &[Row], dtype: DType, world: usize) -> Vec<usize> {
    let mut v: Vec<usize> = rows
        .iter()
        .filter(|r| is_fused_row(r, dtype, world))
        .filter_map(|r| r.hidden)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The fused call's medians at one (dtype, world, hidden): `(tokens, one-shot µs, two-shot
/// µs)` at every token count where both ran, ascending.
pub fn fused_points(rows: &[Row], dtype: DType, world: usize, hidden: usize) -> Vec<(usize, f64, f64)> {
    let [(_, one_shot), (_, two_shot)] = FUSED_ALGOS;
    let here: Vec<&Row> = rows
        .iter()
        .filter(|r| is_fused_row(r, dtype, world) && r.hidden == Some(hidden))
        .collect();
    let time = |algo: &str, count: usize| {
        here.iter()
            .find(|r| r.algo == algo && r.count == count)
            .map(|r| r.time_us)
    };
    let mut counts: Vec<usize> = here.iter().map(|r| r.count).collect();
    counts.sort_unstable();
    counts.dedup();
    counts
        .into_iter()
        .filter_map(|c| Some((c / hidden, time(one_shot, c)?, time(two_shot, c)?)))
        .collect()
}

/// The largest token count the fused one-shot keeps (two-shot above), from
/// [`fused_points`], with a note where the one-shot won throughout; `None` without points.
pub fn fused_crossover(points: &[(usize, f64, f64)], noise: f64) -> Option<(usize, Option<String>)> {
    match best_split(points, noise) {
        Split::Unmeasured => None,
        Split::Never => Some((0, None)),
        Split::At(t) => Some((t, None)),
        Split::Throughout(t) => Some((
            t,
            Some(format!(
                "the fused one-shot won up to the largest token count measured ({t}); two-shot assumed above"
            )),
        )),
    }
}

/// The table from measured rows (one entry per (dtype, world) that has points, one fused
/// entry per (dtype, world, hidden) that has fused points), with the notes on what could not
/// be decided.
pub fn table_from_rows(
    rows: &[Row],
    dtypes: &[DType],
    worlds: &[usize],
    measured: Measured,
) -> Result<(TuningTable, Vec<String>), symm_allreduce::Error> {
    let mut entries = Vec::new();
    let mut fused = Vec::new();
    let mut notes = Vec::new();
    for &dtype in dtypes {
        for &world in worlds {
            if let Some(f) = crossovers(&points(rows, dtype, world), NOISE) {
                entries.push(Crossovers {
                    dtype,
                    world,
                    low_latency_max_bytes: f.low_latency_max,
                    two_shot_ll_max_bytes: f.two_shot_ll_max,
                    one_shot_max_bytes: f.one_shot_max,
                    two_shot_max_bytes: f.two_shot_max,
                });
                notes.extend(f.notes.iter().map(|n| format!("{dtype} W={world}: {n}")));
            }
            for hidden in fused_hidden_sizes(rows, dtype, world) {
                let points = fused_points(rows, dtype, world, hidden);
                if let Some((one_shot_max_tokens, note)) = fused_crossover(&points, NOISE) {
                    fused.push(FusedCrossovers {
                        dtype,
                        world,
                        hidden,
                        one_shot_max_tokens,
                    });
                    notes.extend(note.map(|n| format!("{dtype} W={world} hidden {hidden}: {n}")));
                }
            }
        }
    }
    let table = TuningTable::new(measured, entries)?.with_fused(fused)?;
    Ok((table, notes))
}

/// The summary printed at the end (and pasted into the README).
pub fn summary(table: &TuningTable, notes: &[String]) -> String {
    let m = table.measured();
    let mut s = format!(
        "# Measured crossovers: {} (driver {}, {} ranks), {}; graph_amortised medians, least summed slowdown, {:.0}% noise band\n",
        m.device,
        m.driver,
        m.placement,
        m.date,
        NOISE * 100.0
    );
    s += &format!(
        "# {:<5} {:>5}  {:>13} {:>13} {:>11} {:>11}   | published: {:>13} {:>11}\n",
        "dtype",
        "world",
        "low_latency<=",
        "two_shot_ll<=",
        "one_shot<=",
        "two_shot<=",
        "low_latency<=",
        "one_shot<="
    );
    let published = Config::default();
    for e in table.entries() {
        s += &format!(
            "  {:<5} {:>5}  {:>13} {:>13} {:>11} {:>11}   | {:>24} {:>11}\n",
            e.dtype.name(),
            e.world,
            format_size(e.low_latency_max_bytes),
            e.two_shot_ll_max_bytes
                .map_or_else(|| "-".to_string(), format_size),
            format_size(e.one_shot_max_bytes),
            e.two_shot_max_bytes.map_or_else(|| "-".to_string(), format_size),
            format_size(published.low_latency_limit(e.world)),
            format_size(published.one_shot_limit(e.dtype, e.world)),
        );
    }
    s += "# two_shot_ll<= '-': no band where the two-shot over the low-latency lines beats the one-shot\n";
    s += "# two_shot<= '-': two-shot up to the capacity (NCCL not measured, or never faster)\n";
    if !table.fused_entries().is_empty() {
        s += "# Fused all-reduce + residual + RMSNorm: the largest token count of the fused one-shot (two-shot above)\n";
        s += &format!(
            "# {:<5} {:>5} {:>6}  {:>10}   | published: {:>10}\n",
            "dtype", "world", "hidden", "one_shot<=", "one_shot<="
        );
        for f in table.fused_entries() {
            let published = published.one_shot_limit(f.dtype, f.world) / (f.hidden * f.dtype.size());
            s += &format!(
                "  {:<5} {:>5} {:>6}  {:>10}   | {:>21}\n",
                f.dtype.name(),
                f.world,
                f.hidden,
                f.one_shot_max_tokens,
                published
            );
        }
        s += "# (tokens; published: the all-reduce's one-shot limit in bytes, as tokens at that hidden size)\n";
    }
    for n in notes {
        s += &format!("# note: {n}\n");
    }
    s
}

/// The fused rows' medians (µs), one-shot over two-shot, per (dtype, world, hidden) and token
/// count: what the fused crossovers were read from.
pub fn fused_times(rows: &[Row], dtypes: &[DType], worlds: &[usize]) -> String {
    let mut s = String::new();
    for &dtype in dtypes {
        for &world in worlds {
            for hidden in fused_hidden_sizes(rows, dtype, world) {
                let points = fused_points(rows, dtype, world, hidden);
                if s.is_empty() {
                    s += "# Fused call, graph_amortised medians in µs: one-shot / two-shot at each token count\n";
                }
                s += &format!("  {dtype} W={world} hidden {hidden}:");
                for (t, one, two) in points {
                    s += &format!(" {t}: {one:.1}/{two:.1}");
                }
                s += "\n";
            }
        }
    }
    s
}

/// The NVIDIA driver version, from the kernel module's report (Linux), else "unknown".
fn driver_version() -> String {
    std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|t| parse_driver_version(t.lines().next()?))
        .unwrap_or_else(|| "unknown".to_string())
}

/// The version in the first line of `/proc/driver/nvidia/version` ("NVRM version: NVIDIA UNIX
/// Open Kernel Module for x86_64  580.159.04  Release Build ..."): the first word made of
/// digits and dots, with a dot.
fn parse_driver_version(line: &str) -> Option<String> {
    line.split_whitespace()
        .find(|w| w.contains('.') && w.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .map(str::to_string)
}

/// Now, as RFC 3339 UTC (`2026-12-03T08:10:00Z`).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    rfc3339(secs)
}

/// Seconds since the epoch as RFC 3339 UTC (civil-from-days, proleptic Gregorian).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Builds the table from the rows so far and writes it to `out` (after every world, so that
/// a run cut short keeps what it measured). Returns the table, the notes on what could not
/// be decided, and the placement label.
fn write_table(
    out: &Path,
    rows: &[Row],
    dtypes: &[DType],
    placements: &[(usize, Placement)],
    sizes: &[usize],
    device_names: &[String],
) -> Result<(TuningTable, Vec<String>, String), Stop> {
    let worlds: Vec<usize> = placements.iter().map(|&(w, _)| w).collect();
    let virtual_worlds: Vec<String> = placements
        .iter()
        .filter(|(_, p)| matches!(p, Placement::Virtual { .. }))
        .map(|(w, _)| w.to_string())
        .collect();
    let placement = match (virtual_worlds.len(), placements.len()) {
        (0, _) => "per_gpu".to_string(),
        (v, n) if v == n => "virtual".to_string(),
        _ => format!("per_gpu, virtual at W={}", virtual_worlds.join(",")),
    };
    let mut note = format!(
        "symm-bench --tune: graph_amortised medians, thresholds of least summed slowdown ({:.0}% noise band); sizes {}..{}",
        NOISE * 100.0,
        format_size(sizes[0]),
        format_size(*sizes.last().unwrap_or(&0))
    );
    if rows.iter().any(|r| r.hidden.is_some()) {
        let tokens = fused_tokens();
        note += &format!(
            "; fused all-reduce + residual + RMSNorm: hidden {} x tokens {}..{} (where they fit the capacity)",
            FUSED_HIDDEN.map(|h| h.to_string()).join(","),
            tokens[0],
            tokens[tokens.len() - 1]
        );
    }
    if !virtual_worlds.is_empty() {
        note += &format!(
            "; W={} ran as virtual ranks (all ranks on one GPU): those crossovers reflect one GPU's memory \
             and launch costs, not NVLink, and NCCL (which refuses two ranks on one device) was not measured",
            virtual_worlds.join(",")
        );
    }
    let measured = Measured {
        device: device_names.join(", "),
        driver: driver_version(),
        date: utc_now(),
        crate_version: symm_allreduce::VERSION.to_string(),
        placement: placement.clone(),
        note,
    };
    let (table, notes) = table_from_rows(rows, dtypes, &worlds, measured)
        .map_err(|e| Stop::Failed(format!("the measured crossovers do not make a table: {e}")))?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Stop::Failed(format!("{}: {e}", dir.display())))?;
    }
    std::fs::write(out, table.to_json()).map_err(|e| Stop::Failed(format!("{}: {e}", out.display())))?;

    Ok((table, notes, placement))
}

/// `--tune OUT`: measure, write the table and the raw rows, print the summary.
pub fn run(args: &Args, out: &Path) -> Result<ExitCode, Stop> {
    let count = symm_allreduce::device_count().map_err(Stop::NoGpu)?;
    let worlds = tune_worlds(args.world);
    let sizes = match (&args.sizes, args.quick) {
        (SizeSpec::List(v), _) => {
            let mut v = v.clone();
            v.sort_unstable();
            v.dedup();
            v
        }
        (SizeSpec::Sweep, false) => tune_sizes(),
        (SizeSpec::Sweep, true) => quick_tune_sizes(),
    };
    let dtypes = RunPlan::from_args(args).dtypes;
    let mut meta = Meta {
        tool: format!("symm-bench {} --tune", env!("CARGO_PKG_VERSION")),
        world: args.world,
        ..Meta::default()
    };
    let mut rows: Vec<Row> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut placements: Vec<(usize, Placement)> = Vec::new();
    let mut device_names: Vec<String> = Vec::new();
    let pb = ProgressBar::hidden();

    for &world in &worlds {
        let placement = if !args.virtual_ranks && count >= 2 && world <= count {
            Placement::PerGpu
        } else {
            Placement::Virtual { device: args.device }
        };
        placements.push((world, placement));
        let ctxs = bench::contexts(placement, world).map_err(Stop::NoGpu)?;
        for ctx in &ctxs {
            let name = ctx.name().unwrap_or_else(|e| format!("unknown ({e})"));
            if !device_names.contains(&name) {
                device_names.push(name);
            }
        }
        let free = bench::free_memory(&ctxs).map_err(|e| Stop::Failed(format!("cuMemGetInfo: {e}")))?;
        let ranks_per_device = match placement {
            Placement::Virtual { .. } => world,
            Placement::PerGpu => 1,
        };
        // One rank per GPU also measures nccl_symm (a pool input and output per rank).
        let capacities = match placement {
            Placement::Virtual { .. } => crate::args::CAPACITIES_PER_RANK,
            Placement::PerGpu => crate::args::CAPACITIES_PER_RANK + crate::args::NCCL_SYMM_CAPACITIES,
        };
        let fits = bench::max_fitting_size(free, ranks_per_device, capacities);
        let here: Vec<usize> = sizes.iter().copied().filter(|&s| s <= fits).collect();
        let Some(&capacity) = here.last() else {
            return Err(Stop::Failed(format!("W={world}: no size fits in device memory")));
        };
        if here.len() < sizes.len() {
            meta.notes.push(format!(
                "W={world}: sizes above {} skipped (device memory)",
                format_size(capacity)
            ));
        }
        let with_nccl = placement == Placement::PerGpu;
        let plan = tune_plan(args, &here, &dtypes, capacity);
        // The run's own configuration (`--shared-sm-percent`, `--no-pdl`, ...), as a sweep's.
        let config = plan.config(capacity);
        let mut bench = match Bench::new(ctxs, placement, config, (with_nccl, with_nccl), false) {
            Ok(b) => b,
            Err(e) => {
                let msg = format!("W={world}: setup failed: {e}");
                eprintln!("symm-bench: {msg}");
                failures.push(msg);
                continue;
            }
        };
        let nccl_ok = with_nccl && bench.nccl_ready();
        if with_nccl && !nccl_ok {
            meta.notes.push(format!("W={world}: {}", bench.nccl_status()));
        }
        if with_nccl && !bench.nccl_symm_ready() {
            meta.notes
                .push(format!("W={world}: {}", bench.nccl_symm_status()));
        }
        eprintln!(
            "symm-bench --tune: W={world} ({}), {} sizes {}..{}",
            match placement {
                Placement::Virtual { device } => format!("virtual ranks on device {device}"),
                Placement::PerGpu => "one rank per GPU".into(),
            },
            here.len(),
            format_size(here[0]),
            format_size(capacity)
        );
        'world: for &dtype in &dtypes {
            let started = std::time::Instant::now();
            for &size in &here {
                let mut algos = Vec::with_capacity(4);
                if size <= LL_TUNE_MAX {
                    algos.push(AlgoChoice::LowLatency);
                }
                if size <= ONE_SHOT_SWEEP_MAX {
                    algos.push(AlgoChoice::OneShot);
                }
                algos.push(AlgoChoice::TwoShot);
                if nccl_ok && bench.nccl_ready() {
                    algos.push(AlgoChoice::Nccl);
                }
                if bench.nccl_symm_ready() {
                    algos.push(AlgoChoice::NcclSymm);
                }
                let done = match dtype {
                    DType::BF16 => {
                        bench.run_algos::<half::bf16>(&plan, size, &algos, &mut rows, &mut failures, &pb)
                    }
                    DType::F16 => {
                        bench.run_algos::<half::f16>(&plan, size, &algos, &mut rows, &mut failures, &pb)
                    }
                    DType::F32 => bench.run_algos::<f32>(&plan, size, &algos, &mut rows, &mut failures, &pb),
                };
                if let Err(e) = done {
                    // The communicators may be poisoned: this world stops here, the others
                    // still run, and the table holds what was measured.
                    let msg = format!(
                        "W={world} {dtype} {}: {e}; W={world} stops here",
                        format_size(size)
                    );
                    eprintln!("symm-bench: {msg}");
                    failures.push(msg);
                    break 'world;
                }
            }
            for hidden in FUSED_HIDDEN {
                let tokens: Vec<usize> = fused_tokens()
                    .into_iter()
                    .filter(|t| t * hidden * dtype.size() <= capacity)
                    .collect();
                let (r, f) = (&mut rows, &mut failures);
                let done = match dtype {
                    DType::BF16 => bench.fused_rows::<half::bf16>(&plan, hidden, &tokens, r, f, &pb),
                    DType::F16 => bench.fused_rows::<half::f16>(&plan, hidden, &tokens, r, f, &pb),
                    DType::F32 => bench.fused_rows::<f32>(&plan, hidden, &tokens, r, f, &pb),
                };
                if let Err(e) = done {
                    let msg = format!("W={world} {dtype} fused, hidden {hidden}: {e}; W={world} stops here");
                    eprintln!("symm-bench: {msg}");
                    failures.push(msg);
                    break 'world;
                }
            }
            eprintln!(
                "symm-bench --tune: W={world} {dtype}: {:.1} s",
                started.elapsed().as_secs_f64()
            );
        }
        drop(bench);
        write_table(out, &rows, &dtypes, &placements, &sizes, &device_names)?;
        meta.failures = failures.clone();
        if let Err(e) = report::write_files(&args.out, &meta, &rows) {
            eprintln!("symm-bench: cannot write results to {}: {e}", args.out.display());
        }
    }

    let (table, notes, placement) = write_table(out, &rows, &dtypes, &placements, &sizes, &device_names)?;
    meta.placement = placement;
    meta.devices = device_names;
    meta.capacity_bytes = sizes.last().copied().unwrap_or(0);
    meta.failures = failures.clone();
    meta.gate_timeouts = timing::gate_timeouts();
    if let Err(e) = report::write_files(&args.out, &meta, &rows) {
        eprintln!("symm-bench: cannot write results to {}: {e}", args.out.display());
    }
    print!("{}", fused_times(&rows, &dtypes, &worlds));
    print!("{}", summary(&table, &notes));
    for n in &meta.notes {
        println!("# note: {n}");
    }
    println!(
        "# table: {} (digest {:016x}); rows: {}",
        out.display(),
        table.digest(),
        args.out.display()
    );
    println!(
        "# use it: SYMM_ALLREDUCE_TUNING={} or Config::default().with_tuning_file(..)",
        out.display()
    );
    if failures.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("symm-bench: {} row(s) failed:", failures.len());
        for f in &failures {
            eprintln!("  {f}");
        }
        Ok(ExitCode::from(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The communicators a tuning sweep measures are configured as a sweep's: the run's SM
    /// share (virtual ranks default to every SM), PDL and trigger switches, and the slots of
    /// the low-latency sizes it times.
    #[test]
    fn the_tuning_sweep_runs_with_the_runs_own_configuration() {
        use clap::Parser;
        let args = |argv: &[&str]| Args::try_parse_from(argv).unwrap().resolve().unwrap();
        let sizes = [KIB, 32 * MIB];
        let virtual_default = args(&["symm-bench", "--tune", "--virtual", "--world", "8"]);
        let c = tune_plan(&virtual_default, &sizes, &DType::ALL, 32 * MIB).config(32 * MIB);
        assert_eq!(c.shared_sm_percent, 100);
        assert_eq!((c.pdl, c.early_trigger), (true, true));
        assert_eq!(c.low_latency_max_bytes, Some(LL_TUNE_MAX));
        assert_eq!(c.capacity_bytes, 32 * MIB);
        let shared = args(&[
            "symm-bench",
            "--tune",
            "--virtual",
            "--shared-sm-percent",
            "25",
            "--no-pdl",
            "--no-early-trigger",
        ]);
        let c = tune_plan(&shared, &sizes, &DType::ALL, 128 * KIB).config(128 * KIB);
        assert_eq!(c.shared_sm_percent, 25);
        assert_eq!((c.pdl, c.early_trigger), (false, false));
        assert_eq!(c.low_latency_max_bytes, Some(128 * KIB));
    }

    fn row(algo: &str, world: usize, size: usize, us: f64) -> Row {
        Row {
            dtype: "bf16".into(),
            mode: Mode::GraphAmortised,
            algo: algo.into(),
            kernel: algo.into(),
            world,
            size_bytes: size,
            time_us: us,
            ..Row::default()
        }
    }

    /// Synthetic latency curves: low-latency 5 µs + 1 µs per 8 KiB, one-shot 10 µs + 1 µs per
    /// 32 KiB, two-shot 15 µs + 1 µs per 128 KiB, NCCL 40 µs + 1 µs per 512 KiB.
    fn model(algo: &str, size: usize) -> f64 {
        let k = size as f64 / 1024.0;
        match algo {
            "low_latency" => 5.0 + k / 8.0,
            "one_shot" => 10.0 + k / 32.0,
            "two_shot" => 15.0 + k / 128.0,
            _ => 40.0 + k / 512.0,
        }
    }

    /// Synthetic fused curves over x = tokens · hidden / 8192: one-shot 5 µs + 0.5 µs per x,
    /// two-shot 8 µs + 0.2 µs per x (equal at x = 10), every token count of the grid.
    fn fused_rows_for(world: usize, hidden: usize) -> Vec<Row> {
        let mut rows = Vec::new();
        for t in fused_tokens() {
            let x = (t * hidden) as f64 / 8192.0;
            for (algo, us) in [
                ("fused_one_shot", 5.0 + 0.5 * x),
                ("fused_two_shot", 8.0 + 0.2 * x),
            ] {
                rows.push(Row {
                    count: t * hidden,
                    size_bytes: t * hidden * 2,
                    hidden: Some(hidden),
                    ..row(algo, world, t * hidden * 2, us)
                });
            }
        }
        rows
    }

    #[test]
    fn fused_crossovers_follow_the_curves() {
        assert_eq!(
            fused_tokens(),
            [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
        );
        let mut rows = fused_rows_for(8, 8192);
        rows.extend(fused_rows_for(8, 4096));
        // The all-reduce's points ignore the fused rows, and the other way round.
        assert!(points(&rows, DType::BF16, 8).is_empty());
        assert!(fused_points(&rows_for(8, false, &|_| 1.0), DType::BF16, 8, 8192).is_empty());
        assert_eq!(fused_hidden_sizes(&rows, DType::BF16, 8), [4096, 8192]);
        assert!(fused_hidden_sizes(&rows, DType::BF16, 4).is_empty());
        assert!(fused_hidden_sizes(&rows, DType::F16, 8).is_empty());
        // x = 10: 8 tokens at 8192 (x = 8; 12 tokens is x = 12), 16 at 4096 (x = 8; 24 is 12).
        let at = |hidden| fused_crossover(&fused_points(&rows, DType::BF16, 8, hidden), NOISE);
        assert_eq!(at(8192), Some((8, None)));
        assert_eq!(at(4096), Some((16, None)));
        assert_eq!(at(7168), None);
        // Eager rows are not read.
        let eager: Vec<Row> = rows
            .iter()
            .map(|r| Row {
                mode: Mode::Eager,
                ..r.clone()
            })
            .collect();
        assert!(fused_hidden_sizes(&eager, DType::BF16, 8).is_empty());
        // One-shot throughout, or never.
        let (t, note) = fused_crossover(&[(1, 5.0, 9.0), (2, 5.0, 9.0)], NOISE).unwrap();
        assert_eq!(t, 2);
        assert!(note.unwrap().contains("largest token count measured (2)"));
        assert_eq!(fused_crossover(&[(1, 9.0, 5.0)], NOISE), Some((0, None)));
        // A token count where only one algorithm ran is left out.
        rows.retain(|r| !(r.count == 8192 * 3 && r.algo == "fused_two_shot"));
        assert!(fused_points(&rows, DType::BF16, 8, 8192)
            .iter()
            .all(|&(t, ..)| t != 3));
    }

    fn rows_for(world: usize, nccl: bool, noise: &dyn Fn(usize) -> f64) -> Vec<Row> {
        let mut rows = Vec::new();
        for (i, size) in tune_sizes().into_iter().enumerate() {
            let mut algos = vec!["one_shot", "two_shot"];
            if size <= LL_TUNE_MAX {
                algos.insert(0, "low_latency");
            }
            if nccl {
                algos.push("nccl");
            }
            for a in algos {
                rows.push(row(a, world, size, model(a, size) * noise(i)));
            }
        }
        rows
    }

    #[test]
    fn the_nccl_symm_crossover_is_against_our_best_kernel() {
        // nccl_symm 20 µs + 1 µs per 1 MiB: above one-shot's line from 330 KiB on, but the
        // two-shot (15 µs + 1 µs per 128 KiB) is ours there; two-shot = nccl_symm at
        // 5/(1/128 - 1/1024) = 731 KiB: the last measured size below it is 512 KiB.
        let mut rows = rows_for(8, true, &|_| 1.0);
        for size in tune_sizes() {
            rows.push(row("nccl_symm", 8, size, 20.0 + size as f64 / 1024.0 / 1024.0));
        }
        let f = crossovers(&points(&rows, DType::BF16, 8), NOISE).unwrap();
        assert_eq!(f.nccl_symm_above, Some(512 * KIB));
        assert!(
            f.notes.iter().any(|n| n.contains("nccl_symm above")),
            "{:?}",
            f.notes
        );
        // The table's NCCL threshold still comes from plain NCCL.
        assert_eq!(f.two_shot_max, Some(4 * MIB));
        // Not measured: nothing said.
        let f = crossovers(&points(&rows_for(8, true, &|_| 1.0), DType::BF16, 8), NOISE).unwrap();
        assert_eq!(f.nccl_symm_above, None);
        assert!(!f.notes.iter().any(|n| n.contains("nccl_symm")));
    }

    #[test]
    fn sweeps_and_worlds() {
        let s = tune_sizes();
        assert_eq!(&s[..5], &[1024, 1536, 2048, 3072, 4096]);
        assert_eq!(*s.last().unwrap(), 32 * MIB);
        assert!(s.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(s.len(), 31);
        assert_eq!(quick_tune_sizes().len(), 21);
        assert_eq!(tune_worlds(8), vec![2, 4, 8]);
        assert_eq!(tune_worlds(6), vec![2, 4, 6]);
        assert_eq!(tune_worlds(2), vec![2]);
        assert_eq!(tune_worlds(1), vec![1]);
    }

    #[test]
    fn crossovers_follow_the_curves() {
        // Exact crossovers of the model: ll = os at k = 5/(1/8 - 1/32) = 53.3 KiB; os = ts at
        // k = 5/(1/32 - 1/128) = 213 KiB; ts = nccl at k = 25/(1/128 - 1/512) = 4267 KiB.
        let rows = rows_for(8, true, &|_| 1.0);
        let f = crossovers(&points(&rows, DType::BF16, 8), NOISE).unwrap();
        // The threshold is the last measured size before each exact crossover.
        assert_eq!(f.low_latency_max, 48 * KIB);
        assert_eq!(f.one_shot_max, 192 * KIB);
        assert_eq!(f.two_shot_max, Some(4 * MIB));
        // Without NCCL there is no NCCL threshold.
        let rows = rows_for(8, false, &|_| 1.0);
        let f = crossovers(&points(&rows, DType::BF16, 8), NOISE).unwrap();
        assert_eq!(
            (f.low_latency_max, f.one_shot_max, f.two_shot_max),
            (48 * KIB, 192 * KIB, None)
        );
    }

    #[test]
    fn a_two_shot_band_over_the_low_latency_lines_is_found_within_the_one_shot_range() {
        // Four ranks as measured on one H100: above the low-latency range the two-shot runs
        // over the low-latency lines (where a shard fits them) and beats the one-shot at 384
        // and 512 KiB, the one-shot wins from 768 KiB, the barrier two-shot far above.
        let mut rows = Vec::new();
        for (size, ll, os, ts, ts_kernel) in [
            (128 * KIB, 5.33, 5.88, 6.77, "two_shot_ll"),
            (256 * KIB, 6.20, 6.45, 6.99, "two_shot_ll"),
            (384 * KIB, 9.00, 7.96, 7.30, "two_shot_ll"),
            (512 * KIB, 9.50, 8.25, 7.74, "two_shot_ll"),
            (768 * KIB, 11.0, 9.54, 10.85, "two_shot"),
            (MIB, 13.0, 10.04, 11.2, "two_shot"),
            (4 * MIB, 40.0, 30.0, 20.0, "two_shot"),
        ] {
            rows.push(row("low_latency", 4, size, ll));
            rows.push(row("one_shot", 4, size, os));
            rows.push(Row {
                kernel: ts_kernel.into(),
                ..row("two_shot", 4, size, ts)
            });
        }
        let f = crossovers(&points(&rows, DType::BF16, 4), NOISE).unwrap();
        assert_eq!(
            (f.low_latency_max, f.two_shot_ll_max, f.one_shot_max),
            (256 * KIB, Some(512 * KIB), MIB)
        );
        // The barrier two-shot's rows never open a band; nor does a two-shot slower than the
        // one-shot.
        for r in &mut rows {
            if r.kernel == "two_shot_ll" && r.size_bytes > 256 * KIB {
                r.time_us += 1.0;
            }
        }
        let f = crossovers(&points(&rows, DType::BF16, 4), NOISE).unwrap();
        assert_eq!((f.two_shot_ll_max, f.one_shot_max), (None, MIB));
    }

    #[test]
    fn one_noisy_size_does_not_move_a_crossover() {
        // At 16 KiB (index 8) one-shot looks 30% faster than low-latency once; the next size
        // reverses it, so low-latency keeps its range.
        let clean = rows_for(4, false, &|_| 1.0);
        let mut noisy = clean.clone();
        for r in noisy
            .iter_mut()
            .filter(|r| r.size_bytes == 16 * KIB && r.algo == "low_latency")
        {
            r.time_us *= 2.0;
        }
        let a = crossovers(&points(&clean, DType::BF16, 4), NOISE).unwrap();
        let b = crossovers(&points(&noisy, DType::BF16, 4), NOISE).unwrap();
        assert_eq!(a, b);
        // A slowdown that hits every algorithm alike at some sizes (a clock change) moves
        // nothing: the algorithms are compared size by size.
        let slowed = rows_for(4, false, &|i| if i % 3 == 0 { 1.3 } else { 1.0 });
        assert_eq!(crossovers(&points(&slowed, DType::BF16, 4), NOISE).unwrap(), a);
    }

    #[test]
    fn edge_cases_of_the_scan() {
        assert_eq!(best_split(&[], NOISE), Split::Unmeasured);
        assert_eq!(best_split(&[(1, 10.0, 5.0), (2, 10.0, 5.0)], NOISE), Split::Never);
        assert_eq!(
            best_split(&[(1, 5.0, 10.0), (2, 5.0, 10.0)], NOISE),
            Split::Throughout(2)
        );
        assert_eq!(best_split(&[(1, 5.0, 10.0), (2, 10.0, 5.0)], NOISE), Split::At(1));
        // Within the noise band everywhere: nothing to win, the later algorithm from the start.
        assert_eq!(best_split(&[(1, 10.0, 9.9), (2, 9.9, 10.0)], NOISE), Split::Never);
        // Curves that cross three times: the split that loses least over the sweep. Keeping
        // the earlier algorithm through sizes 3 and 4 costs 3% above the band each; handing
        // sizes 5 to 7 to the later one, 4% each; with only size 5 left, the other way round.
        let wavy = [
            (1, 5.0, 6.0),
            (2, 5.0, 6.0),
            (3, 6.3, 6.0),
            (4, 6.3, 6.0),
            (5, 6.0, 6.36),
            (6, 6.0, 6.36),
            (7, 6.0, 6.36),
            (8, 8.0, 6.0),
        ];
        assert_eq!(best_split(&wavy, NOISE), Split::At(7));
        assert_eq!(best_split(&wavy[..5], NOISE), Split::At(2));
        // Low-latency never faster: off; one-shot never faster: one-shot gets no sizes.
        let pts = [
            Point {
                size: 1024,
                low_latency: Some(9.0),
                one_shot: Some(8.0),
                two_shot: Some(5.0),
                two_shot_ll: false,
                nccl: None,
                nccl_symm: None,
            },
            Point {
                size: 2048,
                low_latency: None,
                one_shot: Some(9.0),
                two_shot: Some(5.0),
                two_shot_ll: false,
                nccl: None,
                nccl_symm: None,
            },
        ];
        let f = crossovers(&pts, 0.05).unwrap();
        assert_eq!((f.low_latency_max, f.one_shot_max, f.two_shot_max), (0, 0, None));
        // Nothing measured for one-shot: no entry.
        assert_eq!(crossovers(&[], 0.05), None);
        // NCCL rows of another world (NCCL on one GPU) are not comparable.
        let mut rows = rows_for(8, false, &|_| 1.0);
        rows.push(row("nccl", 1, 1024, 0.1));
        assert!(points(&rows, DType::BF16, 8).iter().all(|p| p.nccl.is_none()));
    }

    #[test]
    fn the_written_table_reads_back_with_the_librarys_reader() {
        let mut rows = rows_for(2, false, &|_| 1.0);
        rows.extend(rows_for(8, true, &|_| 1.0));
        let mut f32_rows = rows_for(8, false, &|_| 1.3);
        for r in &mut f32_rows {
            r.dtype = "f32".into();
        }
        rows.extend(f32_rows);
        rows.extend(fused_rows_for(8, 8192));
        rows.extend(fused_rows_for(8, 4096));
        let measured = Measured {
            device: "NVIDIA H200".into(),
            driver: "580.95.05".into(),
            date: rfc3339(1_796_284_800),
            crate_version: symm_allreduce::VERSION.into(),
            placement: "virtual".into(),
            note: "test".into(),
        };
        let (table, notes) =
            table_from_rows(&rows, &[DType::BF16, DType::F32], &[2, 4, 8], measured).unwrap();
        // (bf16, 2), (bf16, 8), (f32, 8); nothing measured at W=4, f32 W=2.
        assert_eq!(table.entries().len(), 3);
        assert!(notes.is_empty(), "{notes:?}");
        // Fused: bf16 W=8 at hidden 4096 and 8192.
        let fused: Vec<(usize, usize)> = table
            .fused_entries()
            .iter()
            .map(|f| (f.hidden, f.one_shot_max_tokens))
            .collect();
        assert_eq!(fused, [(4096, 16), (8192, 8)]);
        let bf16_8 = table.get(DType::BF16, 8).unwrap();
        assert_eq!(bf16_8.two_shot_max_bytes, Some(4 * MIB));
        assert_eq!(table.get(DType::BF16, 4), None);

        let text = table.to_json();
        let back = TuningTable::from_json(&text).unwrap();
        assert_eq!(back, table);
        assert_eq!(back.digest(), table.digest());
        assert_eq!(back.measured().date, "2026-12-03T08:00:00Z");

        // The file loads through Config, and Auto then follows it.
        let path = std::env::temp_dir().join(format!("symm-bench-tune-{}.json", std::process::id()));
        std::fs::write(&path, &text).unwrap();
        let config = Config::default().with_tuning_file(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(config.one_shot_limit(DType::BF16, 8), 192 * KIB);
        assert_eq!(config.one_shot_limit(DType::BF16, 4), 512 * KIB);
        assert_eq!(
            config.tuning.unwrap().fused(DType::BF16, 8, 7168).unwrap().hidden,
            8192
        );

        let s = summary(&table, &notes);
        // Published at W=8: 256 KiB, 16 tokens of 8192 bf16, 32 of 4096.
        for line in [
            ["bf16", "8", "8192", "8", "|", "16"],
            ["bf16", "8", "4096", "16", "|", "32"],
        ] {
            assert!(
                s.lines()
                    .any(|l| l.split_whitespace().collect::<Vec<_>>() == line),
                "{s}"
            );
        }
        let times = fused_times(&rows, &[DType::BF16], &[8]);
        assert!(
            times.contains("bf16 W=8 hidden 8192: 1: 5.5/8.2 2: 6.0/8.4"),
            "{times}"
        );
        assert_eq!(times.lines().count(), 3, "{times}");
        assert!(s.contains("NVIDIA H200 (driver 580.95.05, virtual ranks)"), "{s}");
        assert!(
            s.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["bf16", "8", "48K", "-", "192K", "4M", "|", "64K", "256K"]),
            "{s}"
        );
    }

    /// The rows of a results.csv (the columns `--tune` reads).
    fn rows_of_csv(text: &str) -> Vec<Row> {
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
        // Rows written before the fused call was tuned have no `hidden` column; every
        // results.csv has `kernel`.
        let h = header.iter().position(|h| *h == "hidden");
        let k = col("kernel");
        let c = header.iter().position(|h| *h == "count");
        lines
            .map(|l| {
                let f: Vec<&str> = l.split(',').collect();
                Row {
                    dtype: f[d].into(),
                    mode: if f[m] == "graph_amortised" {
                        Mode::GraphAmortised
                    } else {
                        Mode::Eager
                    },
                    algo: f[a].into(),
                    kernel: f[k].into(),
                    world: f[w].parse().unwrap(),
                    size_bytes: f[s].parse().unwrap(),
                    time_us: f[t].parse().unwrap(),
                    hidden: h.and_then(|h| f[h].parse().ok()),
                    count: c.map_or(0, |c| f[c].parse().unwrap()),
                    ..Row::default()
                }
            })
            .collect()
    }

    /// The table committed under docs/tuning is what its committed rows give.
    #[test]
    fn the_committed_table_follows_from_its_rows() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/tuning");
        let rows = rows_of_csv(&std::fs::read_to_string(dir.join("h100-virtual-rows.csv")).unwrap());
        let committed = TuningTable::load(dir.join("h100-virtual.json")).unwrap();
        let (table, notes) =
            table_from_rows(&rows, &DType::ALL, &[2, 4, 8], committed.measured().clone()).unwrap();
        println!("{}", fused_times(&rows, &DType::ALL, &[2, 4, 8]));
        println!("{}", summary(&table, &notes));
        assert_eq!(table.entries(), committed.entries());
        assert_eq!(table.fused_entries(), committed.fused_entries());
        assert_eq!(table.digest(), committed.digest());
    }

    #[test]
    fn driver_versions_are_read_from_the_module_line() {
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)";
        assert_eq!(parse_driver_version(open).as_deref(), Some("580.159.04"));
        let closed =
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023";
        assert_eq!(parse_driver_version(closed).as_deref(), Some("535.104.05"));
        assert_eq!(parse_driver_version("no version here"), None);
    }

    #[test]
    fn dates_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_284_800 + 3_661), "2026-12-03T09:01:01Z");
        assert!(utc_now().ends_with('Z'));
    }
}
