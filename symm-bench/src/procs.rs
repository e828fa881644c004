//! `--launcher processes`: one process per rank, as tensor-parallel engines run.
//!
//! **Launcher** (no `SYMM_BENCH_RANK` in the environment): checks for a GPU, decides whether
//! NCCL can run (at least W GPUs and a loadable libnccl; then it makes the NCCL unique id) and
//! re-executes itself once per rank with the same flags. The environment carries the rank,
//! the world, a fresh abstract socket-store address, the NCCL id in hex (or why NCCL is
//! skipped), the launcher's pid and the NVLink-multicast vetoes. Each rank's stderr is
//! forwarded with a `[rank r]` prefix; stdout (rank 0's tables) passes through. The wait is
//! bounded by `--timeout`, and by [`GRACE`] once a rank has failed; ranks still running then
//! are killed. Any failure makes the launcher exit 1 with the failing rank's message.
//!
//! **Rank**: binds device `rank % device_count`, joins the store (host barriers and the
//! exchange of results), builds its communicator (`Communicator::from_nccl` over its own NCCL
//! communicator on its stream when the launcher passed an id, else `Communicator::new` over
//! the store) and runs the same (dtype, size, algorithm, mode) sequence as every other rank.
//! Each measurement starts at a barrier and is timed with CUDA events on the rank's own
//! stream ([`crate::bench::measure`]); the medians are all-gathered and the row's time is the
//! largest. Rank 0 verifies its output once per row, prints the tables and writes the files.

use std::ffi::c_char;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStderr, Command, ExitCode, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use symm_allreduce::__codec::{Reader, Wire, Writer};
use symm_allreduce::cudarc::driver::{CudaSlice, CudaStream};
use symm_allreduce::cudarc::nccl::{Comm, Id};
use symm_allreduce::{
    Algorithm, Bootstrap, Communicator, Config, DType, Multicast, SocketStore, StoreAddress,
};

use crate::args::{format_size, round_to_elements, AlgoChoice, Args, Mode, RunPlan, ONE_SHOT_SWEEP_MAX};
use crate::bench::{self, measure, BenchError, Measured, Placement};
use crate::data::{random_input, seed, BenchElem, Expected};
use crate::report::{self, Meta, Row};
use crate::timing::Timer;
use crate::Stop;

const RANK_ENV: &str = "SYMM_BENCH_RANK";
const WORLD_ENV: &str = "SYMM_BENCH_WORLD";
const STORE_ENV: &str = "SYMM_BENCH_STORE";
const NCCL_ID_ENV: &str = "SYMM_BENCH_NCCL_ID";
const NCCL_SKIP_ENV: &str = "SYMM_BENCH_NCCL_SKIP";
const LAUNCHER_ENV: &str = "SYMM_BENCH_LAUNCHER_PID";

/// Set in every rank's environment: nothing here may create NVLink multicast objects.
const MULTICAST_VETOES: [(&str, &str); 3] = [
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
];

/// Bound on every wait in the socket store (barriers wait only for the skew between ranks).
const STORE_TIMEOUT: Duration = Duration::from_secs(300);
/// Kernel peer-wait bound when ranks share a device (time-sliced processes are slow).
const SHARED_DEVICE_TIMEOUT: Duration = Duration::from_secs(30);
/// ncclCommInitRank waits for every rank without a bound of its own.
const NCCL_INIT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the other ranks get to stop by themselves after one failed.
const GRACE: Duration = Duration::from_secs(60);

/// `--launcher processes`: the launcher, or one rank when started by it.
pub(crate) fn run(args: &Args) -> Result<ExitCode, Stop> {
    if args.virtual_ranks {
        return Err(Stop::Usage("--virtual applies to --launcher threads only".into()));
    }
    match ChildEnv::read(|k| std::env::var(k).ok()) {
        None => launch(args),
        Some(Ok(env)) => rank_main(args, &env),
        Some(Err(e)) => Err(Stop::Usage(e)),
    }
}

// ---- Launcher ----------------------------------------------------------------------------

fn launch(args: &Args) -> Result<ExitCode, Stop> {
    let devices = symm_allreduce::device_count().map_err(Stop::NoGpu)?;
    let world = args.world;
    let nccl = if args.algos.contains(&AlgoChoice::Nccl) {
        nccl_id(world, devices)
    } else {
        Err("not requested".to_string())
    };
    // Stopped (dropped) when this function returns, after every rank has ended.
    let daemon = if args.mps {
        Some(crate::mps::Daemon::start().map_err(Stop::Failed)?)
    } else {
        None
    };
    let exe =
        std::env::current_exe().map_err(|e| Stop::Failed(format!("cannot find this executable: {e}")))?;
    let store = StoreAddress::unique("symm-bench")
        .map_err(|e| Stop::Failed(e.to_string()))?
        .to_string();
    let commands = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.args(std::env::args_os().skip(1))
                .envs(MULTICAST_VETOES)
                .env(RANK_ENV, rank.to_string())
                .env(WORLD_ENV, world.to_string())
                .env(STORE_ENV, &store)
                .env(LAUNCHER_ENV, std::process::id().to_string());
            if let Some(d) = &daemon {
                cmd.envs(d.env());
            }
            match &nccl {
                Ok(hex) => cmd.env(NCCL_ID_ENV, hex),
                Err(why) => cmd.env(NCCL_SKIP_ENV, why),
            };
            cmd
        })
        .collect();
    let timeout = Duration::from_secs(args.timeout_secs);
    let finished = supervise(commands, timeout, GRACE).map_err(Stop::Failed)?;
    verdict(&finished, timeout).map_err(Stop::Failed)?;
    Ok(ExitCode::SUCCESS)
}

/// The NCCL unique id in hex, or why NCCL does not run.
fn nccl_id(world: usize, devices: usize) -> Result<String, String> {
    if devices < world {
        return Err(format!(
            "NCCL refuses two ranks on one device and there are {devices} GPU(s) for {world} ranks \
             (with at least {world} GPUs it is measured in the same run)"
        ));
    }
    crate::nccl::library()?;
    let id = Id::new().map_err(|e| format!("ncclGetUniqueId failed: {:?}", e.0))?;
    Ok(hex(id.internal().iter().map(|&c| c as u8)))
}

fn hex(bytes: impl IntoIterator<Item = u8>) -> String {
    bytes.into_iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex_id(hex: &str) -> Result<[u8; 128], String> {
    let mut id = [0u8; 128];
    if hex.len() != 2 * id.len() || !hex.is_ascii() {
        return Err(format!("{NCCL_ID_ENV}: expected 256 hex digits, got {:?}", hex));
    }
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|e| format!("{NCCL_ID_ENV}: {e}"))?;
    }
    Ok(id)
}

/// How a rank's process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Exited(ExitStatus),
    /// Still running at the deadline, and killed.
    Killed,
}

/// One rank's end, in the order the ranks ended (`order`).
#[derive(Debug)]
struct Finished {
    rank: usize,
    ended: Ended,
    order: usize,
    /// Its last `symm-bench:` line on stderr (else its last line).
    message: Option<String>,
}

/// Starts `commands` (rank r = index r), forwards their stderr and waits until all have
/// exited, at most `timeout`, and at most `grace` after the first failure; then kills the
/// rest. Errs only when a rank cannot be started (the started ones are killed).
fn supervise(commands: Vec<Command>, timeout: Duration, grace: Duration) -> Result<Vec<Finished>, String> {
    let mut running: Vec<(Child, Option<Forwarded>)> = Vec::new();
    for (rank, mut cmd) in commands.into_iter().enumerate() {
        cmd.stdin(Stdio::null()).stderr(Stdio::piped());
        match cmd.spawn() {
            Ok(mut child) => {
                let reader = child.stderr.take().and_then(|e| forward(rank, e));
                running.push((child, reader));
            }
            Err(e) => {
                for (child, _) in &mut running {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(format!("cannot start rank {rank}: {e}"));
            }
        }
    }
    let mut ended: Vec<Option<(Ended, usize)>> = vec![None; running.len()];
    let mut order = 0;
    let mut deadline = Instant::now() + timeout;
    let mut failed = false;
    loop {
        for ((child, _), slot) in running.iter_mut().zip(&mut ended) {
            if slot.is_some() {
                continue;
            }
            if let Ok(Some(status)) = child.try_wait() {
                if !status.success() && !failed {
                    failed = true;
                    deadline = deadline.min(Instant::now() + grace);
                }
                *slot = Some((Ended::Exited(status), order));
                order += 1;
            }
        }
        if ended.iter().all(Option::is_some) {
            break;
        }
        if Instant::now() >= deadline {
            for ((child, _), slot) in running.iter_mut().zip(&mut ended) {
                if slot.is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                    *slot = Some((Ended::Killed, order));
                    order += 1;
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // A pipe stays open while a grandchild holds it: wait for the rest of the output, briefly.
    let drained = Instant::now() + Duration::from_secs(2);
    Ok(running
        .into_iter()
        .zip(ended)
        .enumerate()
        .map(|(rank, ((_, reader), slot))| {
            let (ended, order) = slot.unwrap_or((Ended::Killed, usize::MAX));
            let message = reader.and_then(|r| r.last(drained));
            Finished {
                rank,
                ended,
                order,
                message,
            }
        })
        .collect())
}

/// A thread copying a rank's stderr to ours.
struct Forwarded {
    last: Arc<Mutex<LastMessage>>,
    done: mpsc::Receiver<()>,
}

impl Forwarded {
    /// The rank's last message, once its stderr closed or `deadline` passed.
    fn last(self, deadline: Instant) -> Option<String> {
        let _ = self
            .done
            .recv_timeout(deadline.saturating_duration_since(Instant::now()));
        let mut last = self.last.lock().ok()?;
        std::mem::take(&mut *last).get()
    }
}

/// Copies a rank's stderr to ours, line by line with a `[rank r]` prefix, keeping its last
/// message. `None` if no thread could be started (the pipe is then dropped).
fn forward(rank: usize, stderr: ChildStderr) -> Option<Forwarded> {
    let last = Arc::new(Mutex::new(LastMessage::default()));
    let (done, finished) = mpsc::channel();
    let keep = last.clone();
    std::thread::Builder::new()
        .name(format!("rank {rank} stderr"))
        .spawn(move || {
            let mut reader = BufReader::new(stderr);
            let mut buf = Vec::new();
            while matches!(reader.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
                let line = String::from_utf8_lossy(&buf);
                let line = line.trim_end();
                let _ = writeln!(std::io::stderr().lock(), "[rank {rank}] {line}");
                if let Ok(mut last) = keep.lock() {
                    last.see(line);
                }
                buf.clear();
            }
            let _ = done.send(());
        })
        .ok()?;
    Some(Forwarded { last, done: finished })
}

/// A rank's last own message (`symm-bench: ...`, prefix removed), else its last line.
#[derive(Debug, Default)]
struct LastMessage {
    own: Option<String>,
    other: Option<String>,
}

impl LastMessage {
    fn see(&mut self, line: &str) {
        if let Some(m) = line.strip_prefix("symm-bench: ") {
            self.own = Some(m.trim().to_string());
        } else if !line.trim().is_empty() {
            self.other = Some(line.trim().to_string());
        }
    }

    fn get(self) -> Option<String> {
        self.own.or(self.other)
    }
}

/// `Ok` when every rank exited with 0; otherwise the message of the rank that failed
/// first (killed ranks count after those that exited).
fn verdict(finished: &[Finished], timeout: Duration) -> Result<(), String> {
    let failed: Vec<&Finished> = finished
        .iter()
        .filter(|f| !matches!(f.ended, Ended::Exited(s) if s.success()))
        .collect();
    let Some(first) = failed.iter().min_by_key(|f| (f.ended == Ended::Killed, f.order)) else {
        return Ok(());
    };
    let mut msg = match first.ended {
        Ended::Exited(status) => format!("rank {} failed ({status})", first.rank),
        Ended::Killed => format!(
            "rank {} was still running after --timeout {} s and was killed",
            first.rank,
            timeout.as_secs()
        ),
    };
    if let Some(m) = &first.message {
        msg += &format!(": {m}");
    }
    let others: Vec<String> = failed
        .iter()
        .filter(|f| f.rank != first.rank)
        .map(|f| match f.ended {
            Ended::Killed => format!("{} (killed)", f.rank),
            Ended::Exited(_) => f.rank.to_string(),
        })
        .collect();
    if !others.is_empty() {
        msg += &format!(" [also failed: rank {}]", others.join(", "));
    }
    Err(msg)
}

// ---- Rank --------------------------------------------------------------------------------

/// What the launcher passed to a rank.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ChildEnv {
    rank: usize,
    world: usize,
    store: String,
    /// The NCCL unique id, or why NCCL is skipped.
    nccl: Result<[u8; 128], String>,
    launcher: Option<u32>,
}

impl ChildEnv {
    /// `None` when this process is not a rank (no `SYMM_BENCH_RANK`).
    fn read(var: impl Fn(&str) -> Option<String>) -> Option<Result<ChildEnv, String>> {
        let rank = var(RANK_ENV)?;
        let number = |name: &str, v: Option<String>| -> Result<usize, String> {
            let v = v.ok_or_else(|| format!("{name} is not set"))?;
            v.trim().parse().map_err(|e| format!("{name}={v:?}: {e}"))
        };
        Some((|| {
            let rank = number(RANK_ENV, Some(rank))?;
            let world = number(WORLD_ENV, var(WORLD_ENV))?;
            if rank >= world {
                return Err(format!("{RANK_ENV}={rank} is not below {WORLD_ENV}={world}"));
            }
            let store = var(STORE_ENV).ok_or_else(|| format!("{STORE_ENV} is not set"))?;
            let nccl = match (var(NCCL_ID_ENV), var(NCCL_SKIP_ENV)) {
                (Some(hex), _) => Ok(unhex_id(&hex)?),
                (None, Some(why)) => Err(why),
                (None, None) => Err("the launcher passed no NCCL id".into()),
            };
            let launcher = var(LAUNCHER_ENV).and_then(|p| p.trim().parse().ok());
            Ok(ChildEnv {
                rank,
                world,
                store,
                nccl,
                launcher,
            })
        })())
    }
}

/// One rank's timing of one row and mode.
#[derive(Debug, Clone, Copy, PartialEq)]
struct RankTiming {
    median: f64,
    p10: f64,
    p90: f64,
    samples: usize,
    host_us: f64,
    empty_us: Option<f64>,
    empty_host_us: Option<f64>,
}

impl RankTiming {
    fn of(m: &Measured, empty: Option<&Measured>) -> RankTiming {
        RankTiming {
            median: m.stats.median,
            p10: m.stats.p10,
            p90: m.stats.p90,
            samples: m.samples,
            host_us: m.host_us,
            empty_us: empty.map(|e| e.stats.median),
            empty_host_us: empty.map(|e| e.host_us),
        }
    }

    /// The row over all ranks: the largest median, with that rank's percentiles and sample
    /// count; the largest empty median and host costs.
    fn slowest(all: &[RankTiming]) -> Option<RankTiming> {
        let slowest = all.iter().max_by(|a, b| a.median.total_cmp(&b.median))?;
        let max = |f: fn(&RankTiming) -> Option<f64>| all.iter().filter_map(f).reduce(f64::max);
        Some(RankTiming {
            host_us: max(|t| Some(t.host_us)).unwrap_or(slowest.host_us),
            empty_us: max(|t| t.empty_us),
            empty_host_us: max(|t| t.empty_host_us),
            ..*slowest
        })
    }
}

impl Wire for RankTiming {
    fn put(&self, w: &mut Writer) {
        w.put(&self.median)
            .put(&self.p10)
            .put(&self.p90)
            .put(&self.samples)
            .put(&self.host_us)
            .put(&self.empty_us)
            .put(&self.empty_host_us);
    }
    fn take(r: &mut Reader<'_>) -> Option<Self> {
        Some(RankTiming {
            median: r.take()?,
            p10: r.take()?,
            p90: r.take()?,
            samples: r.take()?,
            host_us: r.take()?,
            empty_us: r.take()?,
            empty_host_us: r.take()?,
        })
    }
}

fn gather<T: Wire>(b: &dyn Bootstrap, value: &T) -> Result<Vec<T>, BenchError> {
    b.all_gather(&value.to_wire())?
        .iter()
        .enumerate()
        .map(|(r, bytes)| {
            T::from_wire(bytes)
                .ok_or_else(|| BenchError::Ranks(format!("rank {r} sent {} malformed bytes", bytes.len())))
        })
        .collect()
}

fn barrier(b: &dyn Bootstrap) -> Result<(), BenchError> {
    b.all_gather(&[])?;
    Ok(())
}

/// Ends the process with a message unless dropped within `limit`: the bound on a call that
/// has none of its own.
struct Watchdog {
    _release: Option<mpsc::Sender<()>>,
}

impl Watchdog {
    fn start(limit: Duration, what: &'static str) -> Watchdog {
        let (release, wait) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new().spawn(move || {
            if let Err(RecvTimeoutError::Timeout) = wait.recv_timeout(limit) {
                let _ = writeln!(
                    std::io::stderr(),
                    "symm-bench: {what} did not return within {} s",
                    limit.as_secs()
                );
                std::process::exit(1);
            }
        });
        // Without the thread the launcher's --timeout is the bound.
        Watchdog {
            _release: thread.ok().map(|_| release),
        }
    }
}

/// Makes this rank die with its launcher (SIGKILL), so that no rank outlives it.
fn die_with_launcher(launcher: Option<u32>) -> Result<(), Stop> {
    extern "C" {
        fn prctl(option: std::ffi::c_int, ...) -> std::ffi::c_int;
    }
    const PR_SET_PDEATHSIG: std::ffi::c_int = 1;
    const SIGKILL: std::ffi::c_ulong = 9;
    // SAFETY: prctl(PR_SET_PDEATHSIG, signal) reads one integer argument, passed with the
    // unsigned long width the kernel expects; it touches no memory of ours.
    if unsafe { prctl(PR_SET_PDEATHSIG, SIGKILL) } != 0 {
        return Err(Stop::Failed(format!(
            "prctl(PR_SET_PDEATHSIG): {}",
            std::io::Error::last_os_error()
        )));
    }
    // The launcher may have exited before that call; then this process was re-parented.
    if let Some(pid) = launcher {
        if std::os::unix::process::parent_id() != pid {
            return Err(Stop::Failed(format!("the launcher (pid {pid}) has exited")));
        }
    }
    Ok(())
}

/// One rank's communicator, stream and timer. Field order is drop order: timing events,
/// communicator (its Drop synchronises), stream, store.
struct RankBench {
    timer: Timer,
    comm: Communicator,
    stream: Arc<CudaStream>,
    store: SocketStore,
    rank: usize,
    world: usize,
    /// NCCL rows run (through `comm`'s NCCL fallback, on `stream`), or why not.
    nccl: Result<(), String>,
}

fn rank_main(args: &Args, env: &ChildEnv) -> Result<ExitCode, Stop> {
    die_with_launcher(env.launcher)?;
    if env.world != args.world {
        return Err(Stop::Usage(format!(
            "{WORLD_ENV}={} differs from --world {}",
            env.world, args.world
        )));
    }
    let (rank, world) = (env.rank, env.world);
    let root = rank == 0;
    let mut plan = RunPlan::from_args(args);
    let mut meta = Meta {
        tool: format!("symm-bench {}", env!("CARGO_PKG_VERSION")),
        world,
        placement: "processes".into(),
        ..Meta::default()
    };
    let devices = symm_allreduce::device_count().map_err(Stop::NoGpu)?;
    let ctx = bench::contexts(
        Placement::Virtual {
            device: rank % devices,
        },
        1,
    )
    .map_err(Stop::NoGpu)?
    .into_iter()
    .next()
    .ok_or_else(|| Stop::Failed("no context".into()))?;
    let store = SocketStore::new(&StoreAddress::parse(&env.store), rank, world, STORE_TIMEOUT)
        .map_err(|e| Stop::Failed(format!("socket store: {e}")))?;
    let setup = |meta: &mut Meta, plan: &mut RunPlan| -> Result<(RankBench, String), BenchError> {
        let stream = ctx.new_stream()?;
        // The copy runs alone on the GPU while the other ranks wait at the barrier.
        if root {
            match bench::d2d_copy_gbs(&stream) {
                Ok(gbs) => meta.d2d_copy_gbs = Some(gbs),
                Err(e) => meta.notes.push(format!("D2D copy not measured: {e}")),
            }
            // Its 2 GiB are freed on the stream: gone before free memory is read.
            stream.synchronize()?;
        }
        barrier(&store)?;
        let free = gather(&store, &(bench::free_memory(std::slice::from_ref(&ctx))? as u64))?;
        let free = free.into_iter().min().unwrap_or(0) as usize;
        let per_device = world.div_ceil(devices);
        let dropped = plan.cap_sizes(bench::max_fitting_size(
            free,
            per_device,
            crate::args::CAPACITIES_PER_RANK,
        ));
        if !dropped.is_empty() {
            meta.notes.push(format!(
                "sizes {} skipped: {per_device} rank(s) × (3×capacity + input + output) do not fit in {} MiB free",
                dropped.iter().map(|&s| format_size(s)).collect::<Vec<_>>().join(","),
                free >> 20
            ));
        }
        let capacity = *plan
            .sizes
            .last()
            .ok_or_else(|| BenchError::Ranks("no size fits in device memory".into()))?;
        if !plan.explicit_sizes && plan.algos.contains(&AlgoChoice::OneShot) && capacity > ONE_SHOT_SWEEP_MAX
        {
            meta.notes.push(format!(
                "one_shot skipped above {} in the sweep (name the sizes with --sizes to run it)",
                format_size(ONE_SHOT_SWEEP_MAX)
            ));
        }
        meta.capacity_bytes = capacity;
        meta.estimated_duration_s = Some(plan.estimate(world).as_secs_f64());
        let config = Config {
            capacity_bytes: capacity,
            // The `pool` rows reduce one pool buffer of the message size.
            pool_bytes: capacity,
            timeout: if world > devices {
                SHARED_DEVICE_TIMEOUT
            } else {
                Config::default().timeout
            },
            // Only when multimem rows are asked for (opt-in; see AlgoChoice::Multimem).
            multicast: if plan.algos.iter().any(|a| a.needs_multicast()) {
                Multicast::Required
            } else {
                Multicast::Off
            },
            ..Config::default()
        };
        let (comm, nccl) = communicator(&store, &ctx, &stream, env, config)?;
        if !comm.has_peer_kernels() {
            return Err(BenchError::Ranks(format!(
                "the peer kernels are not set up: {}",
                comm.peer_kernels_unavailable().unwrap_or("unknown reason")
            )));
        }
        meta.nccl = match &nccl {
            Ok(()) => format!(
                "NCCL with world {world}, one process per GPU (ncclAllReduce through Communicator::from_nccl, \
                 on the rank's stream)"
            ),
            Err(why) => format!("NCCL skipped: {why}"),
        };
        let name = ctx.name().unwrap_or_else(|e| format!("unknown ({e})"));
        for d in gather(&store, &format!("{}: {name}", ctx.ordinal()))? {
            if !meta.devices.contains(&d) {
                meta.devices.push(d);
            }
        }
        let mps_dir = crate::mps::pipe_dir(|k| std::env::var(k).ok());
        meta.mps = crate::mps::describe(&mps_dir);
        let title = if world <= devices {
            format!("W={world} processes, one per GPU")
        } else if crate::mps::is_on(&mps_dir) {
            format!(
                "W={world} processes on {} GPU(s) ({}) under MPS: the processes share the SMs, a timing of \
                 that sharing (not of one rank per GPU)",
                devices,
                meta.devices.join(", ")
            )
        } else {
            format!(
                "W={world} processes on {} GPU(s) ({}) without MPS: time-sliced, checks the path, not a timing \
                 (--mps starts a private MPS daemon for a timing)",
                devices,
                meta.devices.join(", ")
            )
        };
        let timer = Timer::new(std::slice::from_ref(&stream))?;
        let mut rb = RankBench {
            timer,
            comm,
            stream,
            store,
            rank,
            world,
            nccl,
        };
        // An error here is fatal: a rank that went on without its gather would pair its next
        // exchange with the others' gather.
        let (us, blocks) = rb.empty_graph_floor()?;
        meta.empty_graph_floor_us = Some(us);
        meta.empty_graph_floor_blocks = Some(blocks);
        Ok((rb, title))
    };
    if plan.algos.contains(&AlgoChoice::NcclSymm) {
        // A rank process's communicator is built over the launcher's NCCL communicator
        // (cudarc's, whose handle cannot register windows).
        plan.algos.retain(|&a| a != AlgoChoice::NcclSymm);
        meta.notes
            .push("nccl_symm rows run with --launcher threads only".into());
    }
    let (mut rb, title) =
        setup(&mut meta, &mut plan).map_err(|e| Stop::Failed(format!("setup failed: {e}")))?;

    let pb = ProgressBar::hidden();
    if root {
        print!("{}", crate::header(&meta, &title));
        if plan.algos.contains(&AlgoChoice::Nccl) && rb.nccl.is_err() {
            eprintln!("symm-bench: {}; continuing without it", meta.nccl);
        }
    }
    let mut rows: Vec<Row> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    for &dtype in &plan.dtypes {
        for &size in &plan.sizes {
            let done = match dtype {
                DType::BF16 => rb.run_size::<half::bf16>(&plan, size, &mut rows, &mut failures),
                DType::F16 => rb.run_size::<half::f16>(&plan, size, &mut rows, &mut failures),
                DType::F32 => rb.run_size::<f32>(&plan, size, &mut rows, &mut failures),
            };
            if root {
                report::fill_nccl_ratios(&mut rows);
                report::fill_checked(&mut rows, plan.check);
                crate::save(args, &mut meta, &rows, &failures, &pb);
            }
            if let Err(e) = done {
                let msg = format!("{dtype} {size} B: {e}");
                if !root {
                    return Err(Stop::Failed(format!("stopped: {msg}")));
                }
                failures.push(msg.clone());
                crate::save(args, &mut meta, &rows, &failures, &pb);
                crate::print_tables(&rows, dtype, &plan, world, &title);
                return Err(Stop::Failed(format!(
                    "stopped: {msg} (partial results in {})",
                    args.out.display()
                )));
            }
        }
        if root {
            crate::print_tables(&rows, dtype, &plan, world, &title);
        }
    }
    // The last exchange: every rank is done before any drops its communicator.
    let gates = gather(&rb.store, &(crate::timing::gate_timeouts() as u64))
        .map_err(|e| Stop::Failed(format!("final barrier: {e}")))?;
    drop(rb);
    if !root {
        return Ok(ExitCode::SUCCESS);
    }
    let other_gates: u64 = gates.iter().skip(1).sum();
    if other_gates > 0 {
        meta.notes.push(format!(
            "ranks 1..{world}: the launch gate opened by timeout {other_gates} time(s)"
        ));
    }
    Ok(crate::finish(args, &mut meta, &rows, &failures, &title, &pb))
}

/// The rank's communicator over its own NCCL communicator when the launcher passed an id
/// and every rank created one, else over the store; and whether NCCL rows run.
fn communicator(
    store: &SocketStore,
    ctx: &Arc<symm_allreduce::cudarc::driver::CudaContext>,
    stream: &Arc<CudaStream>,
    env: &ChildEnv,
    config: Config,
) -> Result<(Communicator, Result<(), String>), BenchError> {
    let nccl = env.nccl.clone().and_then(|id| {
        ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // cudarc panics where it cannot load libnccl: check first.
        crate::nccl::library()?;
        let _watchdog = Watchdog::start(NCCL_INIT_TIMEOUT, "ncclCommInitRank");
        let id = Id::uninit(id.map(|b| b as c_char));
        Comm::from_rank(stream.clone(), env.rank, env.world, id)
            .map_err(|e| format!("ncclCommInitRank failed: {:?}", e.0))
    });
    // Every rank goes the same way.
    let mine = nccl.as_ref().err().cloned().unwrap_or_default();
    let votes = gather(store, &mine)?;
    let nccl = match (nccl, votes.iter().position(|v| !v.is_empty())) {
        (Ok(comm), None) => Ok(comm),
        (Ok(comm), Some(q)) => {
            // cudarc's Comm::drop panics when ncclCommAbort fails; the driver reclaims it.
            std::mem::forget(comm);
            Err(format!("rank {q}: {}", votes[q]))
        }
        (Err(why), _) => Err(why),
    };
    Ok(match nccl {
        Ok(comm) => (Communicator::from_nccl(comm, config)?, Ok(())),
        Err(why) => (Communicator::new(store, ctx.clone(), config)?, Err(why)),
    })
}

impl RankBench {
    /// Median replay of a graph holding one empty kernel (grid of an 8 KiB bf16 one-shot),
    /// the largest over ranks, and the blocks per rank.
    fn empty_graph_floor(&mut self) -> Result<(f64, u32), BenchError> {
        let len = 4096;
        let blocks = self.comm.plan(len, DType::BF16, Algorithm::OneShot).blocks;
        barrier(&self.store)?;
        let (comm, stream) = (&self.comm, &self.stream);
        let mut round = || -> Result<(), BenchError> {
            Ok(comm.launch_empty(len, DType::BF16, stream, Algorithm::OneShot)?)
        };
        let m = measure(
            &mut self.timer,
            std::slice::from_ref(stream),
            Mode::GraphIsolated,
            200,
            2,
            &mut round,
        )?;
        let all = gather(&self.store, &RankTiming::of(&m, None))?;
        let t = RankTiming::slowest(&all).ok_or(BenchError::NoSamples)?;
        Ok((t.median, blocks))
    }

    /// Every algorithm and mode at one size, like `Bench::run_size`. A failed verification
    /// skips the row on every rank (rank 0 records it); other errors end the run.
    fn run_size<T: BenchElem>(
        &mut self,
        plan: &RunPlan,
        size: usize,
        rows: &mut Vec<Row>,
        failures: &mut Vec<String>,
    ) -> Result<(), BenchError> {
        let dtype = T::DTYPE;
        let bytes = round_to_elements(size, dtype);
        let len = bytes / dtype.size();
        let host = random_input::<T>(len, seed(bytes, dtype, self.rank));
        let input = self.stream.clone_htod(&host)?;
        let mut output = self.stream.alloc_zeros::<T>(len)?;
        // The upload reads `host` asynchronously: wait before it is dropped.
        self.stream.synchronize()?;
        drop(host);
        let expected = (self.rank == 0).then(|| {
            let mut e = Expected::new(len);
            for r in 0..self.world {
                e.add_seeded::<T>(seed(bytes, dtype, r));
            }
            e
        });
        for &algo in &plan.algos {
            if !plan.runs(algo, size, self.world) || (algo == AlgoChoice::Nccl && self.nccl.is_err()) {
                continue;
            }
            match self.algo_rows(plan, algo, bytes, &input, &mut output, expected.as_ref(), rows) {
                Ok(()) => {}
                Err(BenchError::Verify(why)) => {
                    if self.rank == 0 {
                        let msg = format!(
                            "{dtype} {bytes} B {}: verification failed, row skipped: {why}",
                            algo.name()
                        );
                        eprintln!("symm-bench: {msg}");
                        failures.push(msg);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// Verifies `algo` once at this size, then times it (and the empty kernel) in every mode.
    #[allow(clippy::too_many_arguments)]
    fn algo_rows<T: BenchElem>(
        &mut self,
        plan: &RunPlan,
        algo: AlgoChoice,
        bytes: usize,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        expected: Option<&Expected>,
        rows: &mut Vec<Row>,
    ) -> Result<(), BenchError> {
        let dtype = T::DTYPE;
        let len = input.len();
        let symmetric = matches!(algo, AlgoChoice::Symmetric | AlgoChoice::Multimem);
        let nccl = algo == AlgoChoice::Nccl;
        let pool = algo == AlgoChoice::Pool;
        let algorithm = algo.symm().unwrap_or(Algorithm::Nccl);
        let (kernel, blocks) = if nccl {
            ("nccl".to_string(), None)
        } else {
            let grid = self.comm.plan(len, dtype, algorithm);
            let name = bench::kernel_label(&self.comm, algo, grid.algorithm, len, dtype);
            (name, Some(grid.blocks))
        };
        let RankBench {
            timer,
            comm,
            stream,
            store,
            rank,
            world,
            ..
        } = self;
        let (comm, stream, store) = (&*comm, &*stream, &*store);
        // Pool rows: the input copied into a pool buffer once (untimed), as a producer kernel
        // would have written it.
        let mut pool_buf = if pool {
            Some(comm.alloc_symmetric::<T>(len, stream)?)
        } else {
            None
        };

        // Verify once: zeroed output, one call, rank 0 compares with the sum of all inputs.
        stream.memset_zeros(output)?;
        stream.synchronize()?;
        barrier(store)?;
        if symmetric {
            comm.copy_to_symmetric(input, stream)?;
            comm.all_reduce_symmetric_with::<T>(len, stream, algorithm)?;
            comm.copy_from_symmetric(output, stream)?;
        } else if let Some(buf) = pool_buf.as_mut() {
            stream.memcpy_dtod(input, buf)?;
            comm.all_reduce_pool(buf, stream)?;
            stream.memcpy_dtod(buf, output)?;
        } else {
            comm.all_reduce_with(input, output, stream, algorithm)?;
        }
        comm.synchronize(stream)?;
        let mine = match expected.filter(|_| plan.check) {
            Some(e) => e.check(&stream.clone_dtoh(output)?).err().unwrap_or_default(),
            None => String::new(),
        };
        if let Some(why) = gather(store, &mine)?.into_iter().find(|v| !v.is_empty()) {
            return Err(BenchError::Verify(why));
        }

        let streams = std::slice::from_ref(stream);
        for &mode in &plan.modes {
            let rounds = plan.rounds(mode);
            barrier(store)?;
            // Timed symmetric rounds reduce the buffer in place again and again (see bench.rs).
            let mut real = || -> Result<(), BenchError> {
                if symmetric {
                    comm.all_reduce_symmetric_with::<T>(len, stream, algorithm)?;
                } else if let Some(buf) = pool_buf.as_mut() {
                    comm.all_reduce_pool(buf, stream)?;
                } else {
                    comm.all_reduce_with(input, &mut *output, stream, algorithm)?;
                }
                Ok(())
            };
            let m = measure(timer, streams, mode, rounds, plan.warmup(mode), &mut real)?;
            let e = if nccl {
                None
            } else {
                barrier(store)?;
                let mut empty =
                    || -> Result<(), BenchError> { Ok(comm.launch_empty(len, dtype, stream, algorithm)?) };
                Some(measure(
                    timer,
                    streams,
                    mode,
                    rounds,
                    plan.warmup(mode),
                    &mut empty,
                )?)
            };
            comm.synchronize(stream)?;
            let all = gather(store, &RankTiming::of(&m, e.as_ref()))?;
            if *rank != 0 {
                continue;
            }
            let t = RankTiming::slowest(&all).ok_or(BenchError::NoSamples)?;
            rows.push(
                Row {
                    dtype: dtype.name().into(),
                    mode,
                    algo: algo.name().into(),
                    kernel: kernel.clone(),
                    placement: "processes".into(),
                    world: *world,
                    blocks,
                    size_bytes: bytes,
                    count: len,
                    time_us: t.median,
                    p10_us: t.p10,
                    p90_us: t.p90,
                    samples: t.samples,
                    empty_us: t.empty_us,
                    host_us: t.host_us,
                    empty_host_us: t.empty_host_us,
                    ..Row::default()
                }
                .with_derived(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn nccl_ids_travel_as_hex() {
        let id: Vec<u8> = (0..128u32).map(|i| (i * 37 + 5) as u8).collect();
        let text = hex(id.iter().copied());
        assert_eq!(text.len(), 256);
        assert_eq!(unhex_id(&text).unwrap().to_vec(), id);
        assert!(unhex_id(&text[..254]).is_err());
        assert!(unhex_id(&format!("zz{}", &text[2..])).is_err());
        assert!(unhex_id(&"é".repeat(128)).is_err());
    }

    #[test]
    fn child_environment_is_parsed_and_checked() {
        assert!(ChildEnv::read(env_of(&[])).is_none());
        let id = hex([7u8; 128]);
        let env = ChildEnv::read(env_of(&[
            (RANK_ENV, "1"),
            (WORLD_ENV, "2"),
            (STORE_ENV, "@symm-bench.1.ab"),
            (NCCL_ID_ENV, &id),
            (LAUNCHER_ENV, "4242"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((env.rank, env.world, env.launcher), (1, 2, Some(4242)));
        assert_eq!(env.store, "@symm-bench.1.ab");
        assert_eq!(env.nccl, Ok([7u8; 128]));
        let skip = ChildEnv::read(env_of(&[
            (RANK_ENV, "0"),
            (WORLD_ENV, "2"),
            (STORE_ENV, "@s"),
            (NCCL_SKIP_ENV, "one GPU"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(skip.nccl, Err("one GPU".to_string()));
        assert_eq!(skip.launcher, None);
        for bad in [
            vec![(RANK_ENV, "2"), (WORLD_ENV, "2"), (STORE_ENV, "@s")],
            vec![(RANK_ENV, "x"), (WORLD_ENV, "2"), (STORE_ENV, "@s")],
            vec![(RANK_ENV, "0"), (STORE_ENV, "@s")],
            vec![(RANK_ENV, "0"), (WORLD_ENV, "2")],
            vec![
                (RANK_ENV, "0"),
                (WORLD_ENV, "2"),
                (STORE_ENV, "@s"),
                (NCCL_ID_ENV, "00"),
            ],
        ] {
            let err = ChildEnv::read(env_of(&bad)).unwrap().unwrap_err();
            assert!(err.contains("SYMM_BENCH_"), "{err}");
        }
    }

    fn timing(median: f64, empty: Option<f64>) -> RankTiming {
        RankTiming {
            median,
            p10: median - 1.0,
            p90: median + 1.0,
            samples: 20,
            host_us: median / 10.0,
            empty_us: empty,
            empty_host_us: empty.map(|e| e / 10.0),
        }
    }

    #[test]
    fn timings_travel_and_the_slowest_rank_sets_the_row() {
        for t in [timing(12.5, Some(3.0)), timing(4.0, None)] {
            assert_eq!(RankTiming::from_wire(&t.to_wire()), Some(t));
        }
        assert_eq!(RankTiming::from_wire(&[0u8; 55]), None);
        assert_eq!(u64::from_wire(&42u64.to_wire()), Some(42));
        assert_eq!(u64::from_wire(&[1, 2]), None);
        assert_eq!(String::from_wire(&"ok".to_string().to_wire()), Some("ok".into()));

        let all = [
            timing(10.0, Some(4.0)),
            timing(30.0, Some(2.0)),
            timing(20.0, Some(5.0)),
        ];
        let row = RankTiming::slowest(&all).unwrap();
        assert_eq!((row.median, row.p10, row.p90), (30.0, 29.0, 31.0));
        assert_eq!(row.empty_us, Some(5.0));
        assert_eq!(row.host_us, 3.0);
        assert_eq!(row.empty_host_us, Some(0.5));
        let nccl = RankTiming::slowest(&[timing(7.0, None), timing(9.0, None)]).unwrap();
        assert_eq!((nccl.median, nccl.empty_us), (9.0, None));
        assert_eq!(RankTiming::slowest(&[]), None);
    }

    #[test]
    fn gathers_and_barriers_over_a_bootstrap() {
        let hub = symm_allreduce::LocalHub::new(3, Duration::from_secs(10));
        let results: Vec<Vec<RankTiming>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|r| {
                    let hub = hub.rank(r);
                    s.spawn(move || {
                        barrier(&hub).unwrap();
                        gather(&hub, &timing(r as f64, None)).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for all in results {
            assert_eq!(
                all.iter().map(|t| t.median).collect::<Vec<_>>(),
                vec![0.0, 1.0, 2.0]
            );
        }
    }

    #[test]
    fn the_last_own_message_is_kept() {
        let mut m = LastMessage::default();
        for line in [
            "warming up",
            "symm-bench: setup failed: no peer access",
            "  detail",
            "",
        ] {
            m.see(line);
        }
        assert_eq!(m.get().as_deref(), Some("setup failed: no peer access"));
        let mut m = LastMessage::default();
        m.see("thread panicked");
        assert_eq!(m.get().as_deref(), Some("thread panicked"));
        assert_eq!(LastMessage::default().get(), None);
    }

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn a_failing_rank_fails_the_run_with_its_message_and_a_hung_one_is_killed() {
        let started = Instant::now();
        let finished = supervise(
            vec![
                sh("exec sleep 60"),
                sh("echo 'symm-bench: setup failed: boom' >&2; exit 3"),
            ],
            Duration::from_secs(60),
            Duration::from_millis(300),
        )
        .unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(finished[0].ended, Ended::Killed);
        assert!(matches!(finished[1].ended, Ended::Exited(s) if s.code() == Some(3)));
        let msg = verdict(&finished, Duration::from_secs(60)).unwrap_err();
        assert!(
            msg.starts_with("rank 1 failed (exit status: 3): setup failed: boom"),
            "{msg}"
        );
        assert!(msg.contains("also failed: rank 0 (killed)"), "{msg}");
    }

    #[test]
    fn a_hung_run_is_killed_at_the_timeout_and_a_clean_one_passes() {
        let finished = supervise(
            vec![sh("exit 0"), sh("exec sleep 60")],
            Duration::from_millis(300),
            Duration::from_secs(60),
        )
        .unwrap();
        let msg = verdict(&finished, Duration::from_millis(300)).unwrap_err();
        assert!(
            msg.starts_with("rank 1 was still running after --timeout"),
            "{msg}"
        );

        let finished = supervise(
            vec![sh("exit 0"), sh("echo hi >&2")],
            Duration::from_secs(30),
            GRACE,
        )
        .unwrap();
        assert_eq!(verdict(&finished, Duration::from_secs(30)), Ok(()));
        assert_eq!(finished[1].message.as_deref(), Some("hi"));

        let err = supervise(
            vec![Command::new("/nonexistent/symm-bench")],
            Duration::from_secs(1),
            GRACE,
        );
        assert!(err.unwrap_err().starts_with("cannot start rank 0"));
    }
}
