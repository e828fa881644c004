//! Command line: flags, size lists and the resolved run plan.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use symm_allreduce::{Algorithm, DType};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// The largest size one-shot runs at in a sweep; above it only when `--sizes` names it.
pub const ONE_SHOT_SWEEP_MAX: usize = 64 * MIB;

const AFTER_HELP: &str = "\
Placement (--launcher threads, the default): all ranks run in this one process. With one GPU
(or --virtual, or fewer GPUs than --world) the W ranks are virtual ranks on --device, each
with its own stream, driven from one host thread. With at least --world GPUs there is one rank
per GPU (devices 0..W-1).

--launcher processes: one process per rank, as in production. This program re-executes itself
once per rank; rank r runs on device r mod the GPU count and the ranks meet through a socket
store. With at least --world GPUs NCCL is measured in the same run; with fewer it is skipped
(NCCL refuses two ranks on one device), and several processes on one GPU are time-sliced
(~2 ms per barrier without MPS): that checks the path, it is not a timing.

Every mode also times the same launch structure with the body-less kernel (`empty` column):
on one GPU the launch cost of all W ranks is paid serially, and `time - empty` cancels it.
Columns and files: see symm-bench/README.md.";

/// Latency and bandwidth of symm-allreduce's one-shot and two-shot all-reduce, with NCCL
/// beside it, in nccl-tests style.
#[derive(Debug, Parser)]
#[command(name = "symm-bench", version, about, after_help = AFTER_HELP)]
pub struct Args {
    /// Number of ranks.
    #[arg(long, default_value_t = 8)]
    pub world: usize,

    /// Message sizes in bytes per rank: a comma list with optional K/M/G suffixes (powers of
    /// 1024), e.g. 1K,8K,64M,3000; or `sweep`: powers of two 1 KiB..256 MiB plus 3000 B,
    /// 24690 B and 1000000 B. Each size is rounded down to a whole number of elements.
    #[arg(long, default_value = "sweep", value_parser = parse_sizes)]
    pub sizes: SizeSpec,

    /// Element types.
    #[arg(long = "dtype", value_delimiter = ',', default_value = "bf16,f32")]
    pub dtypes: Vec<DType>,

    /// Algorithms: low_latency (sizes up to 32 KiB), one_shot, two_shot, auto (the library's size-based choice), symmetric
    /// (zero-copy in place on the communicator's buffers), pool (zero-copy in place on a pool
    /// buffer from alloc_symmetric), nccl.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "low_latency,one_shot,two_shot,auto,symmetric,pool,nccl"
    )]
    pub algos: Vec<AlgoChoice>,

    /// Timing modes.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "eager,graph_amortised,graph_isolated"
    )]
    pub modes: Vec<Mode>,

    /// Timed rounds per row and mode [default: eager 200, graph_amortised 50 (of 10
    /// all-reduces each), graph_isolated 200; with --quick 50, 20, 100].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: Option<u32>,

    /// Directory for results.csv, results.json and latency.png.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,

    /// A short run for CI: sizes 3000 B, 8K, 64K, 1M, 16M (unless --sizes is given) and
    /// fewer rounds.
    #[arg(long)]
    pub quick: bool,

    /// Device of the virtual ranks (one-GPU placement).
    #[arg(long, default_value_t = 0)]
    pub device: usize,

    /// Redraw latency.png from an earlier run's results.json (no GPU needed) and exit; the
    /// picture is written next to the JSON file.
    #[arg(long, value_name = "RESULTS_JSON")]
    pub replot: Option<PathBuf>,

    /// Virtual ranks on --device even when there are enough GPUs for one rank per GPU.
    #[arg(long = "virtual")]
    pub virtual_ranks: bool,

    /// How the ranks run: `threads` (all ranks in this process) or `processes` (this program
    /// re-executes itself once per rank, rank r on device r mod the GPU count).
    #[arg(long, value_enum, default_value = "threads")]
    pub launcher: Launcher,

    /// With --launcher processes: the ranks still running after this many seconds are
    /// killed (and 60 s after one rank failed, if the others do not stop by themselves).
    #[arg(long = "timeout", value_name = "SECS", default_value_t = 3600,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout_secs: u64,
}

/// `--launcher`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Launcher {
    /// Every rank in this process.
    #[value(name = "threads")]
    Threads,
    /// One process per rank.
    #[value(name = "processes")]
    Processes,
}

/// `--sizes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SizeSpec {
    /// The default sweep (or the quick subset).
    Sweep,
    /// Sizes named on the command line, in bytes.
    List(Vec<usize>),
}

/// One entry of `--algos`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum AlgoChoice {
    /// symm-allreduce one-shot.
    #[value(name = "one_shot", alias = "one-shot")]
    OneShot,
    /// symm-allreduce two-shot.
    #[value(name = "two_shot", alias = "two-shot")]
    TwoShot,
    /// symm-allreduce low-latency one-shot (no barrier; messages up to the library's
    /// low-latency limit, 32 KiB by default).
    #[value(name = "low_latency", alias = "ll")]
    LowLatency,
    /// symm-allreduce, the library's own choice by size.
    #[value(name = "auto")]
    Auto,
    /// symm-allreduce zero-copy in place on the communicator's symmetric buffers
    /// (`all_reduce_symmetric`): the data is already there, as when the producing kernel
    /// writes into the buffer, so no copy-in is timed.
    #[value(name = "symmetric")]
    Symmetric,
    /// symm-allreduce zero-copy in place on a pool buffer (`alloc_symmetric` +
    /// `all_reduce_pool`): the producer wrote into the pool buffer, so no copy-in is timed.
    /// Compare with `two_shot` (out of place, copy-in fused) at the same size.
    #[value(name = "pool")]
    Pool,
    /// NCCL's ncclAllReduce, the baseline.
    #[value(name = "nccl")]
    Nccl,
}

impl AlgoChoice {
    /// The library algorithm, or `None` for NCCL.
    pub fn symm(self) -> Option<Algorithm> {
        match self {
            AlgoChoice::OneShot => Some(Algorithm::OneShot),
            AlgoChoice::TwoShot => Some(Algorithm::TwoShot),
            AlgoChoice::LowLatency => Some(Algorithm::LowLatency),
            AlgoChoice::Auto => Some(Algorithm::Auto),
            // The in-place kernel launches the two-shot grid.
            AlgoChoice::Symmetric | AlgoChoice::Pool => Some(Algorithm::TwoShot),
            AlgoChoice::Nccl => None,
        }
    }

    /// Name as written on the command line and in the results.
    pub fn name(self) -> &'static str {
        match self {
            AlgoChoice::OneShot => "one_shot",
            AlgoChoice::TwoShot => "two_shot",
            AlgoChoice::LowLatency => "low_latency",
            AlgoChoice::Auto => "auto",
            AlgoChoice::Symmetric => "symmetric",
            AlgoChoice::Pool => "pool",
            AlgoChoice::Nccl => "nccl",
        }
    }
}

/// How a row is timed.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Plain stream launches, batches of back-to-back rounds.
    #[default]
    #[value(name = "eager")]
    Eager,
    /// One CUDA graph of 10 all-reduces per rank; time per all-reduce.
    #[value(name = "graph_amortised", alias = "graph-amortised")]
    GraphAmortised,
    /// One CUDA graph of 1 all-reduce per rank, each replay timed alone.
    #[value(name = "graph_isolated", alias = "graph-isolated")]
    GraphIsolated,
}

impl Mode {
    /// Every mode, in table order.
    pub const ALL: [Mode; 3] = [Mode::Eager, Mode::GraphAmortised, Mode::GraphIsolated];

    /// Name as written on the command line and in the results.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Eager => "eager",
            Mode::GraphAmortised => "graph_amortised",
            Mode::GraphIsolated => "graph_isolated",
        }
    }

    /// All-reduces per rank in one round.
    pub fn ops_per_round(self) -> usize {
        match self {
            Mode::GraphAmortised => 10,
            Mode::Eager | Mode::GraphIsolated => 1,
        }
    }

    /// Rounds between one pair of timing events (one sample).
    pub fn rounds_per_sample(self) -> usize {
        match self {
            Mode::Eager => 10,
            Mode::GraphAmortised | Mode::GraphIsolated => 1,
        }
    }

    /// Default timed rounds.
    pub fn default_rounds(self, quick: bool) -> usize {
        match (self, quick) {
            (Mode::Eager, false) => 200,
            (Mode::GraphAmortised, false) => 50,
            (Mode::GraphIsolated, false) => 200,
            (Mode::Eager, true) => 50,
            (Mode::GraphAmortised, true) => 20,
            (Mode::GraphIsolated, true) => 100,
        }
    }
}

/// Parses `--sizes`.
pub fn parse_sizes(s: &str) -> Result<SizeSpec, String> {
    if s.trim() == "sweep" {
        return Ok(SizeSpec::Sweep);
    }
    let sizes = s.split(',').map(parse_size).collect::<Result<Vec<_>, _>>()?;
    if sizes.is_empty() {
        return Err("no sizes given".into());
    }
    Ok(SizeSpec::List(sizes))
}

/// Parses one size: `3000`, `8K`, `8KiB`, `64M`, `1G`, `512B`.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits);
    let n: usize = num
        .parse()
        .map_err(|_| format!("bad size {s:?}: expected a number with an optional K, M or G suffix"))?;
    let unit = match suffix.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => KIB,
        "M" | "MB" | "MIB" => MIB,
        "G" | "GB" | "GIB" => 1 << 30,
        other => {
            return Err(format!(
                "bad size {s:?}: unknown suffix {other:?} (use K, M or G)"
            ))
        }
    };
    let bytes = n
        .checked_mul(unit)
        .ok_or_else(|| format!("size {s:?} overflows"))?;
    if bytes == 0 {
        return Err(format!("size {s:?} is zero"));
    }
    Ok(bytes)
}

/// The default sweep: powers of two 1 KiB..=256 MiB plus three odd sizes, ascending.
pub fn sweep_sizes() -> Vec<usize> {
    let mut v: Vec<usize> = (10..=28).map(|p| 1usize << p).collect();
    v.extend([3000, 12345 * 2, 1_000_000]);
    v.sort_unstable();
    v
}

/// The `--quick` subset.
pub fn quick_sizes() -> Vec<usize> {
    vec![3000, 8 * KIB, 64 * KIB, MIB, 16 * MIB]
}

/// Rounds `bytes` down to whole elements of `dtype` (at least one).
pub fn round_to_elements(bytes: usize, dtype: DType) -> usize {
    (bytes / dtype.size()).max(1) * dtype.size()
}

/// Everything the sweep needs, resolved from the flags.
#[derive(Debug, Clone)]
pub struct RunPlan {
    /// Sizes in bytes, ascending, before rounding to a dtype.
    pub sizes: Vec<usize>,
    /// Whether the sizes were named explicitly (one-shot then runs at every size).
    pub explicit_sizes: bool,
    /// Element types, in flag order, without repeats.
    pub dtypes: Vec<DType>,
    /// Algorithms, in flag order, without repeats.
    pub algos: Vec<AlgoChoice>,
    /// Modes, in table order, without repeats.
    pub modes: Vec<Mode>,
    /// `--iters`, if given.
    pub iters: Option<usize>,
    /// `--quick`.
    pub quick: bool,
}

impl RunPlan {
    /// Resolves the flags.
    pub fn from_args(args: &Args) -> Self {
        let (mut sizes, explicit_sizes) = match (&args.sizes, args.quick) {
            (SizeSpec::List(v), _) => (v.clone(), true),
            (SizeSpec::Sweep, false) => (sweep_sizes(), false),
            (SizeSpec::Sweep, true) => (quick_sizes(), false),
        };
        sizes.sort_unstable();
        sizes.dedup();
        RunPlan {
            sizes,
            explicit_sizes,
            dtypes: dedup(&args.dtypes),
            algos: dedup(&args.algos),
            modes: Mode::ALL.into_iter().filter(|m| args.modes.contains(m)).collect(),
            iters: args.iters.map(|n| n as usize),
            quick: args.quick,
        }
    }

    /// Timed rounds for `mode`.
    pub fn rounds(&self, mode: Mode) -> usize {
        self.iters.unwrap_or_else(|| mode.default_rounds(self.quick))
    }

    /// Whether `algo` runs at `bytes` (one-shot stops at 64 MiB in a sweep).
    pub fn runs(&self, algo: AlgoChoice, bytes: usize) -> bool {
        match algo {
            AlgoChoice::LowLatency => bytes <= symm_allreduce::Config::default().low_latency_max_bytes,
            AlgoChoice::OneShot => self.explicit_sizes || bytes <= ONE_SHOT_SWEEP_MAX,
            _ => true,
        }
    }

    /// Drops sizes above `max_bytes`; returns the dropped ones.
    pub fn cap_sizes(&mut self, max_bytes: usize) -> Vec<usize> {
        let dropped = self.sizes.iter().copied().filter(|&s| s > max_bytes).collect();
        self.sizes.retain(|&s| s <= max_bytes);
        dropped
    }
}

fn dedup<T: PartialEq + Copy>(v: &[T]) -> Vec<T> {
    let mut out = Vec::with_capacity(v.len());
    for &x in v {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

/// `1024` -> `1K`, `3000` -> `3000`, `64 << 20` -> `64M`: exact, for labels.
pub fn format_size(bytes: usize) -> String {
    for (unit, suffix) in [(1usize << 30, "G"), (MIB, "M"), (KIB, "K")] {
        if bytes >= unit && bytes % unit == 0 {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("3000"), Ok(3000));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("8k"), Ok(8192));
        assert_eq!(parse_size("8KiB"), Ok(8192));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size(" 1G "), Ok(1 << 30));
        assert_eq!(parse_size("512B"), Ok(512));
        assert!(parse_size("0").is_err());
        assert!(parse_size("K").is_err());
        assert!(parse_size("8X").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    #[test]
    fn size_lists_and_sweep() {
        assert_eq!(parse_sizes("sweep"), Ok(SizeSpec::Sweep));
        assert_eq!(
            parse_sizes("1K,8K,64M"),
            Ok(SizeSpec::List(vec![1024, 8192, 64 << 20]))
        );
        assert!(parse_sizes("1K,,8K").is_err());
        let s = sweep_sizes();
        assert_eq!(s.first(), Some(&1024));
        assert_eq!(s.last(), Some(&(256 << 20)));
        assert!(s.contains(&3000) && s.contains(&24690) && s.contains(&1_000_000));
        assert!(s.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(s.len(), 19 + 3);
    }

    #[test]
    fn sizes_round_down_to_elements() {
        assert_eq!(round_to_elements(3000, DType::F32), 3000);
        assert_eq!(round_to_elements(24690, DType::F32), 24688);
        assert_eq!(round_to_elements(24690, DType::BF16), 24690);
        assert_eq!(round_to_elements(1, DType::F32), 4);
    }

    #[test]
    fn labels_are_exact() {
        assert_eq!(format_size(1024), "1K");
        assert_eq!(format_size(3000), "3000");
        assert_eq!(format_size(64 << 20), "64M");
        assert_eq!(format_size(1 << 30), "1G");
        assert_eq!(format_size(1536), "1536");
    }

    #[test]
    fn flags_resolve_into_a_plan() {
        let args = Args::try_parse_from(["symm-bench"]).unwrap();
        assert_eq!(args.world, 8);
        assert_eq!(args.dtypes, vec![DType::BF16, DType::F32]);
        assert_eq!(args.algos.len(), 7);
        let plan = RunPlan::from_args(&args);
        assert_eq!(plan.sizes, sweep_sizes());
        assert_eq!(plan.rounds(Mode::GraphIsolated), 200);
        assert_eq!(plan.rounds(Mode::GraphAmortised), 50);
        assert!(!plan.runs(AlgoChoice::OneShot, 128 << 20));
        assert!(plan.runs(AlgoChoice::TwoShot, 256 << 20));

        let args = Args::try_parse_from([
            "symm-bench",
            "--sizes",
            "128M,8K",
            "--algos",
            "two_shot,one-shot,two_shot",
            "--modes",
            "graph_isolated,eager",
            "--iters",
            "7",
            "--dtype",
            "f16",
        ])
        .unwrap();
        let mut plan = RunPlan::from_args(&args);
        assert_eq!(plan.sizes, vec![8192, 128 << 20]);
        assert_eq!(plan.algos, vec![AlgoChoice::TwoShot, AlgoChoice::OneShot]);
        assert_eq!(plan.modes, vec![Mode::Eager, Mode::GraphIsolated]);
        assert_eq!(plan.rounds(Mode::GraphAmortised), 7);
        assert_eq!(plan.dtypes, vec![DType::F16]);
        assert!(plan.runs(AlgoChoice::OneShot, 128 << 20));
        assert_eq!(plan.cap_sizes(64 << 20), vec![128 << 20]);
        assert_eq!(plan.sizes, vec![8192]);

        let quick = RunPlan::from_args(&Args::try_parse_from(["symm-bench", "--quick"]).unwrap());
        assert_eq!(quick.sizes, quick_sizes());
        assert_eq!(quick.rounds(Mode::GraphIsolated), 100);

        assert_eq!(quick.sizes.len(), 5);
        let args = Args::try_parse_from(["symm-bench"]).unwrap();
        assert_eq!((args.launcher, args.timeout_secs), (Launcher::Threads, 3600));
        let args =
            Args::try_parse_from(["symm-bench", "--launcher", "processes", "--timeout", "90"]).unwrap();
        assert_eq!((args.launcher, args.timeout_secs), (Launcher::Processes, 90));
        assert!(Args::try_parse_from(["symm-bench", "--launcher", "mpi"]).is_err());
        assert!(Args::try_parse_from(["symm-bench", "--timeout", "0"]).is_err());
        assert!(Args::try_parse_from(["symm-bench", "--algos", "ring"]).is_err());
        assert!(Args::try_parse_from(["symm-bench", "--dtype", "f64"]).is_err());
        assert!(Args::try_parse_from(["symm-bench", "--iters", "0"]).is_err());
    }
}
