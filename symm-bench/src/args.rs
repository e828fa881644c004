//! Command line: flags, size lists and the resolved run plan.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use symm_allreduce::{Algorithm, DType};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Capacity-sized buffers per rank without `--producer-chain`: 3 of workspace, an input and
/// an output.
pub const CAPACITIES_PER_RANK: usize = 5;

/// Capacity-sized buffers the `nccl_symm` rows add per rank: a pool input and a pool output.
pub const NCCL_SYMM_CAPACITIES: usize = 2;

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
Columns and files: see symm-bench/README.md.

nccl-tests flags: `-b 8 -e 128M -f 2 -n 50 -w 5 -d bfloat16 -g 8 -c 1 -o sum` means sizes
8 B, 16 B, ... 128 MiB, 50 timed and 5 warm-up rounds, bf16, 8 ranks, results checked, sum;
-b/-e/-f/-i replace --sizes (-f 1 or no -f: steps of -i, 1M by default, as nccl-tests). The
number of ranks is -t × -g (threads × GPUs per thread, as nccl-tests counts them; the ranks
run as --launcher says, -t does not start threads) or --world N. -c 0 skips the check (#wrong
then shows N/A). -o takes sum only. -a is accepted; every time reported is the slowest
rank's (nccl-tests -a 3). -m N: all-reduces per graph in graph_amortised (default 10). -G 0:
eager only; -G N: the graph modes, N timed graph launches per row unless -n is given. -z 1:
graph_isolated only (each all-reduce completes before the next starts).

MPS: with --launcher processes and more ranks than GPUs, an MPS daemon serving this user makes
the run a timing of processes sharing one GPU's SMs (reported in the header); without it the
processes are time-sliced and the run checks the path only. --mps starts a private MPS
daemon for the run (pipe and log directories in a fresh temporary directory) and stops it at
the end.

The estimated duration printed at start is a rough model, not a measurement: for every
(dtype, size, algorithm, mode), (warm-up + timed rounds) × all-reduces per round × (2·W µs of
launches + 5·W·S bytes through HBM at 4 TB/s), the empty-kernel twin's launches, and 30 ms
per row for verification and graph capture.";

/// Latency and bandwidth of symm-allreduce's all-reduce kernels, with NCCL beside it, in
/// nccl-tests style. The nccl-tests flags work too: -b/-e/-f for the size range, -n/-w for
/// iterations and warm-up, -d for the type, -g for the number of GPUs (ranks).
#[derive(Debug, Parser)]
#[command(name = "symm-bench", version, about, after_help = AFTER_HELP)]
pub struct Args {
    /// Total number of ranks [default: 8, or -t × -g].
    #[arg(long = "world", value_name = "N", conflicts_with_all = ["ngpus", "nthreads"])]
    pub world_flag: Option<usize>,

    /// nccl-tests -g/--ngpus: GPUs (ranks) per thread; total ranks = -t × -g.
    #[arg(short = 'g', long = "ngpus", value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub ngpus: Option<u64>,

    /// nccl-tests -t/--nthreads: threads per process; total ranks = -t × -g. The ranks run as
    /// --launcher says (threads: one host thread drives them all).
    #[arg(short = 't', long = "nthreads", value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub nthreads: Option<u64>,

    /// The number of ranks, resolved from --world or -t × -g ([`Args::resolve`]).
    #[arg(skip = 8usize)]
    pub world: usize,

    /// Message sizes in bytes per rank: a comma list with optional K/M/G suffixes (powers of
    /// 1024), e.g. 1K,8K,64M,3000; or `sweep`: powers of two 1 KiB..256 MiB plus 3000 B,
    /// 24690 B and 1000000 B. Each size is rounded down to a whole number of elements.
    #[arg(long, default_value = "sweep", value_parser = parse_sizes,
          conflicts_with_all = ["minbytes", "maxbytes", "stepfactor"])]
    pub sizes: SizeSpec,

    /// nccl-tests style range, smallest size (K/M/G suffixes, fractions such as 1.5M) [default
    /// with -e, -f or -i: 1K]. -b, -e, -f and -i replace --sizes with minbytes, minbytes·f,
    /// minbytes·f², ... up to maxbytes (-f 1 or no -f: minbytes, minbytes + i, ...).
    #[arg(short = 'b', long = "minbytes", value_name = "SIZE", value_parser = parse_size,
          conflicts_with = "sizes")]
    pub minbytes: Option<usize>,

    /// nccl-tests style range, largest size [default with -b, -f or -i: 256M, or minbytes if
    /// larger].
    #[arg(short = 'e', long = "maxbytes", value_name = "SIZE", value_parser = parse_size,
          conflicts_with = "sizes")]
    pub maxbytes: Option<usize>,

    /// nccl-tests style range, factor between consecutive sizes; 1 (the nccl-tests default)
    /// steps by -i instead.
    #[arg(short = 'f', long = "stepfactor", value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "sizes")]
    pub stepfactor: Option<u64>,

    /// nccl-tests style range, the increment between sizes when -f is 1 or absent [default:
    /// 1M].
    #[arg(short = 'i', long = "stepbytes", value_name = "SIZE", value_parser = parse_size,
          conflicts_with = "sizes")]
    pub stepbytes: Option<usize>,

    /// nccl-tests -c/--check: 1 verifies every row against the exact sum before timing it
    /// (#wrong 0), 0 skips that (#wrong N/A).
    #[arg(short = 'c', long = "check", value_name = "0/1", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(0..=1))]
    pub check: u8,

    /// nccl-tests -o/--op: the reduction. Only `sum` (the library's all-reduce sums).
    #[arg(short = 'o', long = "op", value_name = "OP", default_value = "sum", value_parser = parse_op)]
    pub op: String,

    /// nccl-tests -a/--average: accepted (0..3); every time reported is the slowest rank's,
    /// as -a 3.
    #[arg(short = 'a', long = "average", value_name = "0/1/2/3",
          value_parser = clap::value_parser!(u8).range(0..=3))]
    pub average: Option<u8>,

    /// nccl-tests -m/--agg_iters: all-reduces per graph in graph_amortised [default: 10].
    #[arg(short = 'm', long = "agg_iters", visible_alias = "agg-iters", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub agg_iters: Option<u32>,

    /// nccl-tests -z/--blocking: 1 keeps only graph_isolated (each all-reduce completes
    /// before the next starts).
    #[arg(short = 'z', long = "blocking", value_name = "0/1",
          value_parser = clap::value_parser!(u8).range(0..=1), conflicts_with = "modes_flag")]
    pub blocking: Option<u8>,

    /// nccl-tests -G/--cudagraph: 0 times eager launches only; N > 0 the graph modes, with N
    /// timed graph launches per row unless -n is given.
    #[arg(
        short = 'G',
        long = "cudagraph",
        value_name = "N",
        conflicts_with = "modes_flag"
    )]
    pub cudagraph: Option<u32>,

    /// With --launcher processes: start a private MPS daemon for the run and stop it after,
    /// so several processes on one GPU share its SMs (a timing, not time slices).
    #[arg(long)]
    pub mps: bool,

    /// Element types: bf16, f16, f32 (nccl-tests names bfloat16, half, float also work).
    #[arg(long = "dtype", short = 'd', visible_alias = "datatype", value_delimiter = ',',
          default_value = "bf16,f32", value_parser = parse_dtype)]
    pub dtypes: Vec<DType>,

    /// Algorithms: low_latency (up to the low-latency limit), one_shot, two_shot, auto (the library's size-based choice), symmetric
    /// (zero-copy in place on the communicator's buffers), pool (zero-copy in place on a pool
    /// buffer from alloc_symmetric), nccl, nccl_symm (NCCL on pool buffers registered as NCCL
    /// symmetric windows).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "low_latency,one_shot,two_shot,auto,symmetric,pool,nccl,nccl_symm"
    )]
    pub algos: Vec<AlgoChoice>,

    /// Timing modes: eager, graph_amortised, graph_isolated [default: all three].
    #[arg(long = "modes", value_delimiter = ',', value_name = "LIST")]
    pub modes_flag: Option<Vec<Mode>>,

    /// The modes, resolved from --modes, -G and -z ([`Args::resolve`]).
    #[arg(skip = Mode::ALL.to_vec())]
    pub modes: Vec<Mode>,

    /// Timed rounds per row and mode [default: eager 200, graph_amortised 50 (of 10
    /// all-reduces each), graph_isolated 200; with --quick 50, 20, 100] (nccl-tests: -n).
    #[arg(long, short = 'n', value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: Option<u32>,

    /// Untimed warm-up rounds per row and mode before the timed ones [default: eager 10,
    /// graph modes 2] (nccl-tests: -w/--warmup_iters).
    #[arg(
        short = 'w',
        long = "warmup_iters",
        visible_alias = "warmup-iters",
        value_name = "N"
    )]
    pub warmup: Option<u32>,

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

    /// Launch the kernels without Programmatic Dependent Launch (`Config::pdl = false`), to
    /// compare with the default.
    #[arg(long = "no-pdl")]
    pub no_pdl: bool,

    /// Trigger the next launch only after a collective's first wait on the peers
    /// (`Config::early_trigger = false`), to compare with the default early trigger. Ranks that
    /// share a device (`--virtual`) never trigger early, so this changes nothing there.
    #[arg(long = "no-early-trigger")]
    pub no_early_trigger: bool,

    /// `Config::shared_sm_percent` where ranks share a GPU (`--virtual`): the share of its SMs
    /// all ranks' blocks may take together. Default 100 (every SM): the virtual ranks stand
    /// in for a GPU per rank, where no share applies, and nothing but the collectives runs.
    /// The library's default, 25, keeps SMs free for a rank's other kernels (a GEMM).
    #[arg(long = "shared-sm-percent", value_name = "PERCENT", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub shared_sm_percent: u32,

    /// Also time a producer kernel → all-reduce chain at each size (threads launcher, not with
    /// --tune): per rank, an ordinary copy kernel standing for the GEMM that writes the
    /// all-reduce's input, then `all_reduce_with(.., Auto)`, with PDL on (rows `chain_pdl`) and
    /// off (`chain_no_pdl`, a second set of communicators with `Config::pdl` flipped) in the
    /// same run, beside the producer alone (`producer_only`). Costs a second set of
    /// communicators: 4 × capacity more per rank.
    #[arg(long = "producer-chain")]
    pub producer_chain: bool,

    /// `Config::low_latency_max_bytes`: the largest message `auto` sends to the low-latency
    /// kernel, and the largest `low_latency` runs (K/M suffixes). Default: the published
    /// threshold of the world size (256 KiB up to 4 ranks, 64 KiB above).
    #[arg(long = "low-latency-max", value_name = "BYTES", value_parser = parse_size)]
    pub low_latency_max: Option<usize>,

    /// Run with the divergence check on (`Config::check_divergence`), to measure its cost.
    #[arg(long = "check-divergence")]
    pub check_divergence: bool,

    /// Measure where each algorithm wins on this machine and write a tuning table
    /// (`Config::with_tuning_file`, `SYMM_ALLREDUCE_TUNING`) to OUT_JSON [default:
    /// tuning.json]: W = 2, 4, ... up to --world, each --dtype, low_latency / one_shot /
    /// two_shot (and NCCL with one rank per GPU), and the fused all-reduce + residual +
    /// RMSNorm call's one-shot / two-shot (hidden 4096, 7168, 8192; 1..512 tokens),
    /// graph_amortised timing. See docs/crossovers.md.
    #[arg(long, value_name = "OUT_JSON", num_args = 0..=1, default_missing_value = "tuning.json")]
    pub tune: Option<PathBuf>,
    /// Collectives measured at each size: all_reduce (the --algos rows), all_gather and
    /// reduce_scatter (8 KiB..64 MiB, nccl-tests sizes: the gathered output / the
    /// reduce-scatter input; busbw = algbw·(W-1)/W). Threads launcher only.
    #[arg(long, value_delimiter = ',', default_value = "all_reduce")]
    pub collectives: Vec<CollectiveChoice>,
}

/// One entry of `--collectives`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum CollectiveChoice {
    #[value(name = "all_reduce")]
    AllReduce,
    #[value(name = "all_gather")]
    AllGather,
    #[value(name = "reduce_scatter")]
    ReduceScatter,
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
    /// low-latency limit: by default 256 KiB up to 4 ranks, 64 KiB above).
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
    /// NCCL's ncclAllReduce from a pool buffer into a pool buffer of communicators made by
    /// `with_nccl_fallback`, whose symmetric allocations are registered as NCCL windows
    /// (NCCL_WIN_COLL_SYMMETRIC): NCCL runs its symmetric kernels where it has one (NCCL 2.27
    /// and later). The rows are skipped, with the reason, where the windows are off.
    #[value(name = "nccl_symm")]
    NcclSymm,
    /// Opt-in, never in the default list: the zero-copy in-place call on the NVLS multimem
    /// kernel. The communicators are then built with `Config::multicast = Required`, so the
    /// run stops with the reason where no multicast object can be set up (no NVSwitch, a veto
    /// variable such as NCCL_NVLS_ENABLE=0, or the device attribute 0). docs/multicast.md.
    #[value(name = "multimem", alias = "nvls")]
    Multimem,
    /// Opt-in like `multimem`: the NVLS one-shot on the caller's buffers
    /// (`Algorithm::MultimemOneShot`: copy-in, then `multimem.ld_reduce` of the whole message).
    /// Compare with `one_shot` at the same size.
    #[value(name = "multimem_one_shot", alias = "nvls_one_shot")]
    MultimemOneShot,
    /// Opt-in like `multimem`: the low-latency kernel with one multicast store per line
    /// (`Algorithm::MultimemLowLatency`), up to `--low-latency-max`. Compare with
    /// `low_latency` at the same size.
    #[value(name = "multimem_ll", alias = "nvls_ll")]
    MultimemLowLatency,
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
            AlgoChoice::Multimem => Some(Algorithm::Multimem),
            AlgoChoice::MultimemOneShot => Some(Algorithm::MultimemOneShot),
            AlgoChoice::MultimemLowLatency => Some(Algorithm::MultimemLowLatency),
            AlgoChoice::Nccl | AlgoChoice::NcclSymm => None,
        }
    }

    /// Whether the row runs a multimem kernel: asking for one builds the communicators with
    /// `Config::multicast = Required` (never otherwise).
    pub fn needs_multicast(self) -> bool {
        matches!(
            self,
            AlgoChoice::Multimem | AlgoChoice::MultimemOneShot | AlgoChoice::MultimemLowLatency
        )
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
            AlgoChoice::NcclSymm => "nccl_symm",
            AlgoChoice::Multimem => "multimem",
            AlgoChoice::MultimemOneShot => "multimem_one_shot",
            AlgoChoice::MultimemLowLatency => "multimem_ll",
        }
    }
}

/// All-reduces per graph in graph_amortised unless `-m` says otherwise.
pub const DEFAULT_GRAPH_CHAIN: usize = 10;

/// `-m/--agg_iters`, set once at start ([`set_graph_chain`]): the run's one setting of how many
/// all-reduces a graph_amortised graph holds, read by [`Mode::ops_per_round`].
static GRAPH_CHAIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Applies `-m` for the whole run (call once, before any measurement).
pub fn set_graph_chain(args: &Args) {
    if let Some(m) = args.agg_iters {
        let _ = GRAPH_CHAIN.set(m as usize);
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
            Mode::GraphAmortised => *GRAPH_CHAIN.get().unwrap_or(&DEFAULT_GRAPH_CHAIN),
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

    /// Default warm-up rounds (eager: one batch of 10; graph modes: 2 replays).
    pub fn default_warmup(self) -> usize {
        match self {
            Mode::Eager => 10,
            Mode::GraphAmortised | Mode::GraphIsolated => 2,
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

/// Parses one size: `3000`, `8K`, `8KiB`, `64M`, `1G`, `512B`, and fractions as nccl-tests
/// takes them (`1.5M` = 1572864 bytes; a fraction of a byte is dropped).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let digits = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits);
    let bad = || format!("bad size {s:?}: expected a number with an optional K, M or G suffix");
    if num.contains('.') {
        let x: f64 = num.parse().map_err(|_| bad())?;
        let whole = parse_size(&format!("1{suffix}"))? as f64 * x;
        if !(1.0..9.0e15).contains(&whole) {
            return Err(format!("size {s:?} is below one byte or too large"));
        }
        return Ok(whole as usize);
    }
    let n: usize = num.parse().map_err(|_| bad())?;
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

/// Parses `-o/--op`: nccl-tests' names; only the sum runs.
pub fn parse_op(s: &str) -> Result<String, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "sum" => Ok("sum".into()),
        other @ ("prod" | "min" | "max" | "avg" | "mulsum" | "all") => Err(format!(
            "-o {other}: symm-bench times the sum only (the library's all-reduce sums; use NCCL for other \
             reductions)"
        )),
        other => Err(format!("unknown reduction {other:?}: symm-bench times `sum`")),
    }
}

/// Parses one `--dtype` entry: the crate's names (`bf16`, `f16`, `f32`) or nccl-tests'
/// (`bfloat16`, `half`, `float`; also `float16`, `float32`, `fp16`, `fp32`).
pub fn parse_dtype(s: &str) -> Result<DType, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "half" | "float16" | "fp16" => Ok(DType::F16),
        "f32" | "float" | "float32" | "fp32" => Ok(DType::F32),
        other => Err(format!(
            "unknown dtype {other:?}: expected bf16 (bfloat16), f16 (half) or f32 (float)"
        )),
    }
}

/// The nccl-tests size range: `min`, `min·factor`, ... while at most `max`; with factor 1,
/// `min`, `min + step`, ... (nccl-tests' -i).
pub fn size_range(min: usize, max: usize, factor: u64, step: usize) -> Result<Vec<usize>, String> {
    if min > max {
        return Err(format!(
            "-b/--minbytes {} is larger than -e/--maxbytes {}",
            format_size(min),
            format_size(max)
        ));
    }
    let factor = usize::try_from(factor).map_err(|_| format!("-f/--stepfactor {factor} is too large"))?;
    if factor == 0 || step == 0 {
        return Err("-f/--stepfactor and -i/--stepbytes must be at least 1".into());
    }
    const MAX_SIZES: usize = 10_000;
    let mut sizes = Vec::new();
    let mut s = min;
    loop {
        sizes.push(s);
        if sizes.len() > MAX_SIZES {
            return Err(format!(
                "the range -b {} -e {} gives more than {MAX_SIZES} sizes: raise -i or use -f 2",
                format_size(min),
                format_size(max)
            ));
        }
        let next = if factor == 1 {
            s.checked_add(step)
        } else {
            s.checked_mul(factor)
        };
        match next {
            Some(next) if next <= max => s = next,
            _ => break,
        }
    }
    Ok(sizes)
}

impl Args {
    /// Applies the nccl-tests range flags (-b/-e/-f): when any is given, `sizes` becomes the
    /// list they describe. Call once after parsing.
    pub fn resolve(mut self) -> Result<Args, String> {
        if self.minbytes.is_some()
            || self.maxbytes.is_some()
            || self.stepfactor.is_some()
            || self.stepbytes.is_some()
        {
            let min = self.minbytes.unwrap_or(KIB);
            let max = self.maxbytes.unwrap_or((256 * MIB).max(min));
            let sizes = size_range(
                min,
                max,
                self.stepfactor.unwrap_or(1),
                self.stepbytes.unwrap_or(MIB),
            )?;
            self.sizes = SizeSpec::List(sizes);
        }
        self.world = match (self.world_flag, self.nthreads, self.ngpus) {
            (Some(w), _, _) => w,
            (None, None, None) => 8,
            (None, t, g) => {
                usize::try_from(t.unwrap_or(1).saturating_mul(g.unwrap_or(1))).unwrap_or(usize::MAX)
            }
        };
        self.modes = match (&self.modes_flag, self.cudagraph) {
            (Some(m), _) => m.clone(),
            (None, None) => Mode::ALL.to_vec(),
            (None, Some(0)) => vec![Mode::Eager],
            (None, Some(n)) => {
                if self.iters.is_none() {
                    self.iters = Some(n);
                }
                vec![Mode::GraphAmortised, Mode::GraphIsolated]
            }
        };
        if self.blocking == Some(1) {
            self.modes.retain(|&m| m == Mode::GraphIsolated);
            if self.modes.is_empty() {
                return Err("-z 1 keeps graph_isolated only, and -G 0 asked for eager only".into());
            }
        }
        if self.mps && self.launcher != Launcher::Processes {
            return Err("--mps is for --launcher processes (several rank processes on one GPU)".into());
        }
        if self.producer_chain && (self.launcher == Launcher::Processes || self.tune.is_some()) {
            return Err(
                "--producer-chain runs with the sweep of --launcher threads (not with --launcher \
                        processes or --tune)"
                    .into(),
            );
        }
        Ok(self)
    }
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
    /// `--warmup_iters`, if given.
    pub warmup: Option<usize>,
    /// `--quick`.
    pub quick: bool,
    /// `Config::low_latency_max_bytes` for the run (`--low-latency-max`; `None`: the published
    /// threshold of the world size).
    pub low_latency_max: Option<usize>,
    /// `Config::pdl` for the run (off with `--no-pdl`).
    pub pdl: bool,
    /// `Config::early_trigger` for the run (off with `--no-early-trigger`).
    pub early_trigger: bool,
    /// `Config::shared_sm_percent` for the run (`--shared-sm-percent`).
    pub shared_sm_percent: u32,
    /// `Config::check_divergence` for the run (`--check-divergence`).
    pub check_divergence: bool,
    /// `--collectives`, in flag order, without repeats.
    pub collectives: Vec<CollectiveChoice>,
    /// `--producer-chain`: the producer → all-reduce rows, PDL on and off.
    pub producer_chain: bool,
    /// `-c 1` (the default): each row is verified before it is timed.
    pub check: bool,
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
            warmup: args.warmup.map(|n| n as usize),
            quick: args.quick,
            collectives: dedup(&args.collectives),
            low_latency_max: args.low_latency_max,
            pdl: !args.no_pdl,
            early_trigger: !args.no_early_trigger,
            shared_sm_percent: args.shared_sm_percent,
            check_divergence: args.check_divergence,
            producer_chain: args.producer_chain,
            check: args.check == 1,
        }
    }

    /// Capacity-sized buffers per rank: 3 of symmetric workspace plus an input and an output;
    /// with `--producer-chain` also the PDL twin's workspace and the chain's staged input;
    /// with `nccl_symm` rows the pool input and output of the windowed communicator.
    pub fn capacities_per_rank(&self) -> usize {
        let chain = if self.producer_chain { 4 } else { 0 };
        let windowed = if self.algos.contains(&AlgoChoice::NcclSymm) {
            NCCL_SYMM_CAPACITIES
        } else {
            0
        };
        CAPACITIES_PER_RANK + chain + windowed
    }

    /// The communicator configuration of the run, for messages of up to `capacity_bytes`.
    pub fn config(&self, capacity_bytes: usize) -> symm_allreduce::Config {
        symm_allreduce::Config {
            capacity_bytes,
            low_latency_max_bytes: self.low_latency_max,
            pdl: self.pdl,
            early_trigger: self.early_trigger,
            shared_sm_percent: self.shared_sm_percent,
            check_divergence: self.check_divergence,
            // The `pool` rows reduce one pool buffer of the message size.
            pool_bytes: if self.algos.contains(&AlgoChoice::Pool) {
                capacity_bytes
            } else {
                symm_allreduce::Config::default().pool_bytes
            },
            // Only when multimem rows are asked for (opt-in; see AlgoChoice::Multimem).
            multicast: if self.algos.iter().any(|a| a.needs_multicast()) {
                symm_allreduce::Multicast::Required
            } else {
                symm_allreduce::Multicast::Off
            },
            ..symm_allreduce::Config::default()
        }
    }

    /// Timed rounds for `mode`.
    pub fn rounds(&self, mode: Mode) -> usize {
        self.iters.unwrap_or_else(|| mode.default_rounds(self.quick))
    }

    /// Warm-up rounds for `mode`.
    pub fn warmup(&self, mode: Mode) -> usize {
        self.warmup.unwrap_or_else(|| mode.default_warmup())
    }

    /// A rough estimate of the run's duration, printed at start. For every (dtype, size,
    /// algorithm that runs at that size, mode): (warm-up + timed rounds) × all-reduces per
    /// round × an estimated time per all-reduce, the same rounds again for the empty-kernel
    /// twin (not for NCCL), and a fixed cost for verification and graph capture. The time
    /// per all-reduce is `2·W µs` of launches plus `5·W·S` bytes through HBM at 4 TB/s (what
    /// W virtual ranks on one H200 cost); one rank per GPU over NVLink differs.
    pub fn estimate(&self, world: usize) -> std::time::Duration {
        const ROW_OVERHEAD_S: f64 = 0.03;
        let launch_us = 2.0 * world as f64;
        let mut seconds = 0.0;
        for _ in &self.dtypes {
            for &size in &self.sizes {
                for &algo in self.algos.iter().filter(|&&a| self.runs(a, size, world)) {
                    let op_us = launch_us + 5.0 * world as f64 * size as f64 / 4e6;
                    for &mode in &self.modes {
                        let rounds = (self.warmup(mode) + self.rounds(mode)) as f64;
                        let ops = rounds * mode.ops_per_round() as f64;
                        let empty_us = if matches!(algo, AlgoChoice::Nccl | AlgoChoice::NcclSymm) {
                            0.0
                        } else {
                            ops * launch_us
                        };
                        seconds += (ops * op_us + empty_us) * 1e-6 + ROW_OVERHEAD_S;
                    }
                }
                if self.producer_chain {
                    // Two chain rows (a producer and an all-reduce a round) and the producer
                    // alone (W launches and 2·W·S bytes a round).
                    let producer_us = launch_us + 2.0 * world as f64 * size as f64 / 4e6;
                    let op_us = launch_us + 5.0 * world as f64 * size as f64 / 4e6;
                    for &mode in &self.modes {
                        let rounds = (self.warmup(mode) + self.rounds(mode)) as f64;
                        let ops = rounds * mode.ops_per_round() as f64;
                        seconds += ops * (3.0 * producer_us + 2.0 * op_us) * 1e-6 + 3.0 * ROW_OVERHEAD_S;
                    }
                }
            }
        }
        std::time::Duration::from_secs_f64(seconds)
    }

    /// Whether `algo` runs at `bytes` over `world` ranks (the low-latency kernel within its
    /// slots; one-shot stops at 64 MiB in a sweep).
    pub fn runs(&self, algo: AlgoChoice, bytes: usize, world: usize) -> bool {
        match algo {
            AlgoChoice::LowLatency | AlgoChoice::MultimemLowLatency => {
                bytes <= self.config(usize::MAX).low_latency_limit(world)
            }
            AlgoChoice::OneShot | AlgoChoice::MultimemOneShot => {
                self.explicit_sizes || bytes <= ONE_SHOT_SWEEP_MAX
            }
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

    fn parse(argv: &[&str]) -> Args {
        Args::try_parse_from(argv).unwrap().resolve().unwrap()
    }

    #[test]
    fn nccl_tests_flags_give_the_same_plan_as_the_long_ones() {
        let short = parse(&["symm-bench", "-b", "1K", "-e", "1M", "-f", "4", "-d", "bfloat16"]);
        let long = parse(&[
            "symm-bench",
            "--sizes",
            "1K,4K,16K,64K,256K,1M",
            "--dtype",
            "bf16",
        ]);
        assert_eq!(
            short.sizes,
            SizeSpec::List(vec![1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20])
        );
        assert_eq!(short.sizes, long.sizes);
        assert_eq!(short.dtypes, vec![DType::BF16]);
        let (a, b) = (RunPlan::from_args(&short), RunPlan::from_args(&long));
        assert_eq!(
            (a.sizes, a.dtypes, a.explicit_sizes),
            (b.sizes, b.dtypes, b.explicit_sizes)
        );

        // The example of the issue, and the long spellings of every short flag.
        let a = parse(&[
            "symm-bench",
            "-b",
            "8",
            "-e",
            "128M",
            "-f",
            "2",
            "-n",
            "50",
            "-w",
            "5",
            "-d",
            "bfloat16",
            "-g",
            "8",
        ]);
        let b = parse(&[
            "symm-bench",
            "--minbytes",
            "8",
            "--maxbytes",
            "128M",
            "--stepfactor",
            "2",
            "--iters",
            "50",
            "--warmup_iters",
            "5",
            "--datatype",
            "bf16",
            "--ngpus",
            "8",
        ]);
        for args in [&a, &b] {
            let plan = RunPlan::from_args(args);
            assert_eq!(plan.sizes.len(), 25, "8 B · 2^0..=24 = 128 MiB");
            assert_eq!((plan.sizes[0], plan.sizes[24]), (8, 128 << 20));
            assert_eq!(
                (plan.rounds(Mode::Eager), plan.warmup(Mode::GraphIsolated)),
                (50, 5)
            );
            assert_eq!((args.world, plan.dtypes.clone()), (8, vec![DType::BF16]));
        }
        // nccl-tests type names.
        for (name, dtype) in [
            ("float", DType::F32),
            ("half", DType::F16),
            ("bfloat16", DType::BF16),
            ("f16", DType::F16),
        ] {
            assert_eq!(parse(&["symm-bench", "-d", name]).dtypes, vec![dtype]);
        }
        assert_eq!(
            parse(&["symm-bench", "-d", "half,float"]).dtypes,
            vec![DType::F16, DType::F32]
        );
        // Defaults of a partial range (no -f: steps of -i, as nccl-tests); a range that stops
        // below max; bad ranges.
        assert_eq!(
            parse(&["symm-bench", "-e", "4K", "-f", "2"]).sizes,
            SizeSpec::List(vec![1024, 2048, 4096])
        );
        assert_eq!(
            parse(&["symm-bench", "-e", "4K", "-i", "1K"]).sizes,
            SizeSpec::List(vec![1024, 2048, 3072, 4096])
        );
        assert_eq!(
            parse(&["symm-bench", "-b", "3000", "-e", "10000", "-f", "3"]).sizes,
            SizeSpec::List(vec![3000, 9000])
        );
        assert_eq!(
            parse(&["symm-bench", "-b", "1G"]).sizes,
            SizeSpec::List(vec![1 << 30])
        );
        assert!(Args::try_parse_from(["symm-bench", "-b", "1M", "-e", "1K"])
            .unwrap()
            .resolve()
            .is_err());
        assert!(Args::try_parse_from(["symm-bench", "-f", "0"]).is_err());
        assert!(Args::try_parse_from(["symm-bench", "-b", "1K", "--sizes", "8K"]).is_err());
        assert!(Args::try_parse_from(["symm-bench", "-d", "double"]).is_err());
        // Without -w the defaults: one eager batch, two graph replays.
        let plan = RunPlan::from_args(&parse(&["symm-bench"]));
        assert_eq!(
            (plan.warmup(Mode::Eager), plan.warmup(Mode::GraphAmortised)),
            (10, 2)
        );
    }

    #[test]
    fn the_estimate_grows_with_the_work() {
        let plan = |argv: &[&str]| RunPlan::from_args(&parse(argv));
        let full = plan(&["symm-bench"]).estimate(8);
        let quick = plan(&["symm-bench", "--quick"]).estimate(8);
        let one = plan(&[
            "symm-bench",
            "--sizes",
            "8K",
            "--algos",
            "one_shot",
            "--modes",
            "eager",
            "--dtype",
            "bf16",
        ]);
        assert!(quick < full, "{quick:?} vs {full:?}");
        println!("estimate of the default sweep at W=8: {full:?}; --quick: {quick:?}");
        // The default sweep: minutes, not seconds or hours.
        assert!(full.as_secs() > 60 && full.as_secs() < 3600, "{full:?}");
        // One row: 30 ms + 210 rounds × (16 µs + 16 µs empty) + the bytes.
        let secs = one.estimate(8).as_secs_f64();
        let bytes_us = 5.0 * 8.0 * 8192.0 / 4e6;
        let expected = 0.03 + 210.0 * (16.0 + bytes_us + 16.0) * 1e-6;
        assert!((secs - expected).abs() < 1e-9, "{secs} vs {expected}");
        let more = plan(&[
            "symm-bench",
            "--sizes",
            "8K",
            "--algos",
            "one_shot",
            "--modes",
            "eager",
            "--dtype",
            "bf16",
            "-n",
            "2000",
        ]);
        assert!(more.estimate(8) > one.estimate(8));
    }

    #[test]
    fn flags_resolve_into_a_plan() {
        let args = parse(&["symm-bench"]);
        assert_eq!(args.world, 8);
        assert_eq!(args.dtypes, vec![DType::BF16, DType::F32]);
        assert_eq!(args.algos.len(), 8);
        assert_eq!(args.algos[6..], [AlgoChoice::Nccl, AlgoChoice::NcclSymm]);
        let plan = RunPlan::from_args(&args);
        assert_eq!(plan.sizes, sweep_sizes());
        assert_eq!(plan.rounds(Mode::GraphIsolated), 200);
        assert_eq!(plan.rounds(Mode::GraphAmortised), 50);
        assert!(!plan.runs(AlgoChoice::OneShot, 128 << 20, 8));
        assert!(plan.runs(AlgoChoice::TwoShot, 256 << 20, 8));

        let args = parse(&[
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
        ]);
        let mut plan = RunPlan::from_args(&args);
        assert_eq!(plan.sizes, vec![8192, 128 << 20]);
        assert_eq!(plan.algos, vec![AlgoChoice::TwoShot, AlgoChoice::OneShot]);
        assert_eq!(plan.modes, vec![Mode::Eager, Mode::GraphIsolated]);
        assert_eq!(plan.rounds(Mode::GraphAmortised), 7);
        assert_eq!(plan.dtypes, vec![DType::F16]);
        assert!(plan.runs(AlgoChoice::OneShot, 128 << 20, 8));
        assert_eq!(plan.cap_sizes(64 << 20), vec![128 << 20]);
        assert_eq!(plan.sizes, vec![8192]);

        // The default list never asks for multicast; any multimem row makes it required.
        assert_eq!(plan.config(1 << 20).multicast, symm_allreduce::Multicast::Off);
        let mm = RunPlan::from_args(
            &Args::try_parse_from(["symm-bench", "--algos", "multimem_ll,nvls_one_shot,two_shot,nccl"])
                .unwrap(),
        );
        assert_eq!(
            mm.algos,
            vec![
                AlgoChoice::MultimemLowLatency,
                AlgoChoice::MultimemOneShot,
                AlgoChoice::TwoShot,
                AlgoChoice::Nccl
            ]
        );
        assert_eq!(mm.config(1 << 20).multicast, symm_allreduce::Multicast::Required);
        assert!(!mm.runs(AlgoChoice::MultimemLowLatency, 1 << 20, 8));
        assert!(mm.runs(AlgoChoice::MultimemOneShot, 1 << 20, 8));
        assert_eq!(
            AlgoChoice::MultimemOneShot.symm(),
            Some(symm_allreduce::Algorithm::MultimemOneShot)
        );

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

    #[test]
    fn producer_chain_is_opt_in_and_sized_for_its_twin() {
        let off = RunPlan::from_args(&parse(&["symm-bench"]));
        assert!(!off.producer_chain);
        // The default list has nccl_symm: its pool input and output.
        assert_eq!(off.capacities_per_rank(), 5 + NCCL_SYMM_CAPACITIES);
        let argv = [
            "symm-bench",
            "--world",
            "8",
            "--sizes",
            "8K,32K",
            "--dtype",
            "bf16",
            "--algos",
            "auto",
            "--modes",
            "graph_amortised",
        ];
        let plain = RunPlan::from_args(&parse(&argv));
        let on = RunPlan::from_args(&parse(&[&argv[..], &["--producer-chain"]].concat()));
        assert!(on.producer_chain && on.pdl);
        assert_eq!(on.capacities_per_rank(), 9);
        assert!(on.estimate(8) > plain.estimate(8));
        // With --no-pdl the twin is the PDL-on half; the flag itself is unchanged.
        let no_pdl = RunPlan::from_args(&parse(&["symm-bench", "--producer-chain", "--no-pdl"]));
        assert!(no_pdl.producer_chain && !no_pdl.pdl);
        // Only with the threads launcher's sweep.
        for argv in [
            &["symm-bench", "--producer-chain", "--launcher", "processes"][..],
            &["symm-bench", "--producer-chain", "--tune"][..],
        ] {
            let err = Args::try_parse_from(argv).unwrap().resolve().unwrap_err();
            assert!(err.contains("--producer-chain"), "{err}");
        }
    }

    #[test]
    fn tune_takes_an_optional_path() {
        let none = Args::try_parse_from(["symm-bench"]).unwrap();
        assert_eq!(none.tune, None);
        let bare = parse(&["symm-bench", "--tune", "--world", "4"]);
        assert_eq!(bare.tune, Some(PathBuf::from("tuning.json")));
        assert_eq!(bare.world, 4);
        let named = Args::try_parse_from(["symm-bench", "--tune", "out/h200.json"]).unwrap();
        assert_eq!(named.tune, Some(PathBuf::from("out/h200.json")));
    }

    /// The issue's command line and the other nccl-tests spellings: each parses, and plans
    /// what nccl-tests would run.
    #[test]
    fn nccl_tests_command_lines_parse_and_plan() {
        let a = parse(&[
            "symm-bench",
            "-g",
            "8",
            "-b",
            "8",
            "-e",
            "128M",
            "-f",
            "2",
            "-c",
            "1",
            "-o",
            "sum",
        ]);
        let plan = RunPlan::from_args(&a);
        assert_eq!(a.world, 8);
        assert_eq!(plan.sizes.len(), 25);
        assert_eq!((plan.sizes[0], plan.sizes[24]), (8, 128 << 20));
        assert!(plan.check);
        assert_eq!(plan.modes, Mode::ALL.to_vec());

        // -t × -g ranks; --world alone; --world with -g is a contradiction.
        assert_eq!(parse(&["symm-bench", "-t", "2", "-g", "4"]).world, 8);
        assert_eq!(parse(&["symm-bench", "-t", "4"]).world, 4);
        assert_eq!(parse(&["symm-bench", "-g", "1"]).world, 1);
        assert_eq!(parse(&["symm-bench", "--ngpus", "2", "--nthreads", "2"]).world, 4);
        assert_eq!(parse(&["symm-bench", "--world", "4"]).world, 4);
        assert!(Args::try_parse_from(["symm-bench", "--world", "4", "-g", "4"]).is_err());
        assert!(Args::try_parse_from(["symm-bench", "-g", "0"]).is_err());

        // -c 0: no check; -c takes 0 or 1.
        assert!(!RunPlan::from_args(&parse(&["symm-bench", "-c", "0"])).check);
        assert!(Args::try_parse_from(["symm-bench", "-c", "2"]).is_err());
        // -o: sum only, with a message that says so.
        assert_eq!(parse(&["symm-bench", "-o", "sum"]).op, "sum");
        let e = Args::try_parse_from(["symm-bench", "-o", "max"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("sum only"), "{e}");
        // -a: accepted 0..=3.
        for a in ["0", "1", "2", "3"] {
            assert_eq!(parse(&["symm-bench", "-a", a]).average, Some(a.parse().unwrap()));
        }
        assert!(Args::try_parse_from(["symm-bench", "-a", "4"]).is_err());
        // -m: all-reduces per graph.
        assert_eq!(parse(&["symm-bench", "-m", "4"]).agg_iters, Some(4));
        // -G: 0 eager only; N the graph modes with N timed launches (unless -n).
        let p = |argv: &[&str]| RunPlan::from_args(&parse(argv));
        assert_eq!(p(&["symm-bench", "-G", "0"]).modes, vec![Mode::Eager]);
        let g = p(&["symm-bench", "-G", "30"]);
        assert_eq!(g.modes, vec![Mode::GraphAmortised, Mode::GraphIsolated]);
        assert_eq!(g.rounds(Mode::GraphIsolated), 30);
        assert_eq!(
            p(&["symm-bench", "-G", "30", "-n", "7"]).rounds(Mode::GraphIsolated),
            7
        );
        // -z 1: graph_isolated only; with -G 0 nothing is left.
        assert_eq!(p(&["symm-bench", "-z", "1"]).modes, vec![Mode::GraphIsolated]);
        assert_eq!(p(&["symm-bench", "-z", "0"]).modes, Mode::ALL.to_vec());
        assert!(Args::try_parse_from(["symm-bench", "-z", "1", "-G", "0"])
            .unwrap()
            .resolve()
            .is_err());
        assert!(Args::try_parse_from(["symm-bench", "-G", "1", "--modes", "eager"]).is_err());
        // --modes still works.
        assert_eq!(
            p(&["symm-bench", "--modes", "graph_isolated,eager"]).modes,
            vec![Mode::Eager, Mode::GraphIsolated]
        );

        // Fractional sizes and -f 1 (steps of -i).
        assert_eq!(parse_size("1.5M"), Ok(3 << 19));
        assert_eq!(parse_size("0.5K"), Ok(512));
        assert!(parse_size("0.1").is_err());
        assert!(parse_size("1.2.3M").is_err());
        assert_eq!(
            parse(&["symm-bench", "-b", "1M", "-e", "4M", "-f", "1", "-i", "1.5M"]).sizes,
            SizeSpec::List(vec![1 << 20, 5 << 19, 4 << 20])
        );
        // No -f and no -i: steps of 1M, as nccl-tests.
        assert_eq!(
            parse(&["symm-bench", "-b", "1M", "-e", "3M"]).sizes,
            SizeSpec::List(vec![1 << 20, 2 << 20, 3 << 20])
        );
        // A range of more than 10000 sizes is refused with the fix.
        let e = Args::try_parse_from(["symm-bench", "-b", "8", "-e", "1G", "-i", "8"])
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(e.contains("raise -i"), "{e}");

        // --mps belongs to the processes launcher.
        assert!(parse(&["symm-bench", "--launcher", "processes", "--mps", "-g", "8"]).mps);
        assert!(Args::try_parse_from(["symm-bench", "--mps"])
            .unwrap()
            .resolve()
            .is_err());
    }

    /// The symm-bench arguments of `line` when it runs symm-bench (`symm-bench ARGS`, `cargo
    /// run ... symm-bench -- ARGS`, `.gpu/bin/bin-symm-bench ARGS`), up to a `#` comment.
    fn bench_args(line: &str) -> Option<Vec<String>> {
        let line = line.rsplit("&&").find(|part| part.contains("symm-bench"))?;
        let words: Vec<&str> = line
            .split_whitespace()
            .take_while(|w| !w.starts_with('#'))
            .collect();
        let start = if words.first() == Some(&"cargo") {
            match words.iter().position(|w| *w == "--") {
                Some(i) => i + 1,
                None => words.len(),
            }
        } else {
            let first = words.first()?;
            if !(first.ends_with("symm-bench") || first.ends_with("bin-symm-bench")) {
                return None;
            }
            1
        };
        if words.first() == Some(&"cargo") && !line.contains("symm-bench") {
            return None;
        }
        Some(words[start..].iter().map(|w| w.to_string()).collect())
    }

    /// Every symm-bench command in a shell block, or in inline code, of `md`.
    fn documented_commands(md: &str) -> Vec<Vec<String>> {
        let mut found = Vec::new();
        let mut block: Option<String> = None;
        let mut pending = String::new();
        for line in md.lines() {
            let t = line.trim();
            if t.starts_with("```") {
                if block.is_none() {
                    found.extend(inline_commands(&pending));
                }
                pending.clear();
                block = match block {
                    None => Some(t.trim_start_matches('`').to_string()),
                    Some(_) => None,
                };
                continue;
            }
            match &block {
                Some(lang) if lang == "sh" || lang == "bash" => {
                    pending.push_str(t.trim_end_matches('\\'));
                    pending.push(' ');
                    if !t.ends_with('\\') {
                        found.extend(bench_args(&pending));
                        pending.clear();
                    }
                }
                Some(_) => {}
                // Prose: inline code may wrap, so a paragraph is scanned as one line.
                None if t.is_empty() => {
                    found.extend(inline_commands(&pending));
                    pending.clear();
                }
                None => {
                    pending.push_str(t);
                    pending.push(' ');
                }
            }
        }
        found.extend(inline_commands(&pending));
        found
    }

    fn inline_commands(paragraph: &str) -> Vec<Vec<String>> {
        paragraph
            .split('`')
            .enumerate()
            .filter(|(i, code)| i % 2 == 1 && code.starts_with("symm-bench "))
            .filter_map(|(_, code)| bench_args(code))
            .collect()
    }

    /// Every symm-bench command the documentation shows parses and resolves with these flags.
    #[test]
    fn documented_commands_parse() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = vec![
            root.join("README.md"),
            root.join("symm-bench/README.md"),
            root.join("docs/bench/README.md"),
        ];
        for e in std::fs::read_dir(root.join("docs")).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "md") {
                files.push(p);
            }
        }
        let mut checked = 0;
        let mut problems = Vec::new();
        for f in &files {
            let Ok(md) = std::fs::read_to_string(f) else {
                continue;
            };
            for argv in documented_commands(&md) {
                checked += 1;
                let full: Vec<String> = std::iter::once("symm-bench".to_string())
                    .chain(argv.iter().cloned())
                    .collect();
                let r = Args::try_parse_from(&full)
                    .map_err(|e| e.to_string())
                    .and_then(Args::resolve);
                if let Err(e) = r {
                    problems.push(format!("{}: `{}`: {e}", f.display(), argv.join(" ")));
                }
            }
        }
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        assert!(checked >= 10, "only {checked} commands found: the scan is broken");
    }

    #[test]
    fn documented_commands_are_found_and_bad_ones_fail() {
        let md = "```sh\ncargo run --release -p symm-bench -- --world 8 \\\n    --quick   # short\nbash x.sh && cargo run --release --bin symm-bench\ncargo test\n```\nrun `symm-bench -g 8 -c 1` or `cargo test`\n";
        let found = documented_commands(md);
        assert_eq!(
            found,
            vec![
                vec!["--world", "8", "--quick"],
                vec![],
                vec!["-g", "8", "-c", "1"]
            ]
        );
        assert!(Args::try_parse_from(["symm-bench", "-c", "7"]).is_err());
    }
}
