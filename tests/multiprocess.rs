//! Several rank processes on one host. The test binary re-executes itself once per rank
//! (`SYMM_MP_CHILD` selects the scenario, `SYMM_MP_RANK`/`SYMM_MP_WORLD` the rank), the
//! ranks meet through a [`SocketStore`], and the parent checks every rank's exit status
//! within a time limit (overrunning ranks are killed and reported, never waited for).
//!
//! On the one-GPU machine all ranks share the device: their VMM allocations travel as file
//! descriptors over `SCM_RIGHTS`, each process maps every peer's memory, and the kernels
//! spin-synchronise across processes. Without MPS the GPU time-slices the processes (about
//! 2 ms per barrier per peer), so these tests make few calls and use generous timeouts.
//!
//! Also here, in one process: the NCCL bootstrap and fallback with a world of one (NCCL
//! refuses two ranks on one device).
//!
//! Run by [`common::harness`] (`harness = false`): without a GPU (or NCCL) the tests that
//! need one are reported as ignored with the reason, and the run ends with a line counting
//! GPU tests ran and skipped.

mod common;

use std::cell::Cell;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{check_against_f64, check_bits, emulate, gpu, open_fd_count, random_input, rng, TestElem};
use half::{bf16, f16};
use symm_allreduce::cudarc::driver::{result as cuda, CudaContext, CudaStream};
use symm_allreduce::{Algorithm, Bootstrap, Communicator, Config, DType, Error, SocketStore, StoreAddress};

const CHILD_ENV: &str = "SYMM_MP_CHILD";
const RANK_ENV: &str = "SYMM_MP_RANK";
const WORLD_ENV: &str = "SYMM_MP_WORLD";
const ADDR_ENV: &str = "SYMM_MP_ADDR";
const DIE_RANK_ENV: &str = "SYMM_MP_DIE_RANK";
const DIE_AT_ENV: &str = "SYMM_MP_DIE_AT";

type Outcome = Result<String, String>;

fn text<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

// ---- Parent side -----------------------------------------------------------------------------

struct Rank {
    rank: usize,
    child: Child,
    log: PathBuf,
}

struct Finished {
    rank: usize,
    /// `None`: killed by the parent after the time limit.
    status: Option<ExitStatus>,
    log: String,
}

/// Starts `world` rank processes running `scenario`.
fn launch(scenario: &str, world: usize, extra: &[(&str, String)]) -> Vec<Rank> {
    let exe = std::env::current_exe().expect("test binary path");
    let address = StoreAddress::unique("symm-mp-test").unwrap().to_string();
    let dir = std::env::temp_dir();
    (0..world)
        .map(|rank| {
            let log = dir.join(format!("symm-mp-{scenario}-{}-{rank}.log", std::process::id()));
            let out = std::fs::File::create(&log).expect("log file");
            let mut cmd = Command::new(&exe);
            cmd.env(CHILD_ENV, scenario)
                .env(RANK_ENV, rank.to_string())
                .env(WORLD_ENV, world.to_string())
                .env(ADDR_ENV, &address)
                .stdin(Stdio::null())
                .stdout(Stdio::from(out.try_clone().expect("dup log")))
                .stderr(Stdio::from(out));
            for (k, v) in extra {
                cmd.env(k, v);
            }
            Rank {
                rank,
                child: cmd.spawn().expect("spawn a rank process"),
                log,
            }
        })
        .collect()
}

/// Waits for every rank until `limit`, killing the ones still running then.
fn finish(ranks: Vec<Rank>, limit: Duration) -> Vec<Finished> {
    let deadline = Instant::now() + limit;
    let mut ranks: Vec<(Rank, Option<ExitStatus>)> = ranks.into_iter().map(|r| (r, None)).collect();
    while Instant::now() < deadline && ranks.iter().any(|(_, s)| s.is_none()) {
        for (r, status) in ranks.iter_mut().filter(|(_, s)| s.is_none()) {
            *status = r.child.try_wait().expect("try_wait");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ranks
        .into_iter()
        .map(|(mut r, status)| {
            if status.is_none() {
                let _ = r.child.kill();
                let _ = r.child.wait();
            }
            let log = std::fs::read_to_string(&r.log).unwrap_or_default();
            let _ = std::fs::remove_file(&r.log);
            Finished {
                rank: r.rank,
                status,
                log,
            }
        })
        .collect()
}

/// Asserts that every rank exited successfully, printing every rank's log otherwise.
/// A rank passed if it exited successfully *and* reported its scenario done (a child that
/// ran no test at all would also exit successfully).
fn assert_all_passed(what: &str, finished: &[Finished]) {
    let reported = |f: &Finished| {
        let mark = format!("RANK {}/", f.rank);
        f.log.lines().any(|l| l.starts_with(&mark) && l.contains(" OK: "))
    };
    let bad: Vec<&Finished> = finished
        .iter()
        .filter(|f| !f.status.is_some_and(|s| s.success()) || !reported(f))
        .collect();
    // Past the harness's capture, so that the GPU run's log shows what each rank proved.
    use std::io::Write;
    let mut err = std::io::stderr();
    for f in finished {
        for line in f
            .log
            .lines()
            .filter(|l| l.starts_with("RANK ") || l.starts_with("SKIP"))
        {
            let _ = writeln!(err, "[{what}] {line}");
        }
    }
    if !bad.is_empty() {
        for f in finished {
            eprintln!("---- {what}: rank {} ({:?}) ----\n{}", f.rank, f.status, f.log);
        }
        panic!(
            "{what}: rank(s) {:?} failed or overran",
            bad.iter().map(|f| f.rank).collect::<Vec<_>>()
        );
    }
}

// ---- Child side ------------------------------------------------------------------------------

/// The entry point of every rank process: `main` calls it instead of the tests when
/// `SYMM_MP_CHILD` is set. A failure panics, so the process exits non-zero.
fn rank_process_entry(scenario: String) {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let rank: usize = var(RANK_ENV).parse().expect("rank");
    let world: usize = var(WORLD_ENV).parse().expect("world");
    let address = StoreAddress::parse(&var(ADDR_ENV));
    let die_rank: Option<usize> = std::env::var(DIE_RANK_ENV).ok().and_then(|v| v.parse().ok());
    let die_at: usize = std::env::var(DIE_AT_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let outcome = match scenario.as_str() {
        "store" => child_store(rank, world, &address),
        "store_dies" => child_store_dies(rank, world, &address, die_rank.expect("die rank")),
        "allreduce" => child_allreduce(rank, world, &address),
        "killed" => child_killed(rank, world, &address, die_rank.expect("die rank"), die_at),
        "leak" => child_leak(rank, world, &address),
        "nccl_refused" => child_nccl_refused(rank, world, &address),
        other => Err(format!("unknown scenario {other}")),
    };
    match outcome {
        // On a line of its own.
        Ok(msg) => println!("\nRANK {rank}/{world} {scenario} OK: {msg}"),
        Err(e) => panic!("RANK {rank}/{world} {scenario} FAILED: {e}"),
    }
}

/// Kills this process with SIGKILL: no destructor, no goodbye on any socket.
fn kill_self() -> ! {
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    std::process::abort()
}

fn child_store(rank: usize, world: usize, address: &StoreAddress) -> Outcome {
    let store = SocketStore::new(address, rank, world, Duration::from_secs(20)).map_err(text)?;
    for round in 0..10 {
        let mine = format!(
            "rank {rank} pid {} round {round} {}",
            std::process::id(),
            "x".repeat(rank * 300)
        );
        let all = store.all_gather(mine.as_bytes()).map_err(text)?;
        for (q, b) in all.iter().enumerate() {
            let s = String::from_utf8_lossy(b);
            if !s.starts_with(&format!("rank {q} pid ")) || !s.contains(&format!("round {round} ")) {
                return Err(format!("round {round}: rank {q} sent {s:?}"));
            }
        }
    }
    // A descriptor of a file only this process wrote: the peers read it through the copy
    // that arrived by SCM_RIGHTS.
    let path = std::env::temp_dir().join(format!("symm-mp-fd-{}-{rank}", std::process::id()));
    std::fs::write(
        &path,
        format!("written by rank {rank}, pid {}", std::process::id()),
    )
    .map_err(text)?;
    let file = std::fs::File::open(&path).map_err(text)?;
    let fds = store.all_gather_fds(file.as_fd()).map_err(text)?;
    let mut pids = Vec::new();
    for (q, fd) in fds.into_iter().enumerate() {
        let f = std::fs::File::from(fd);
        let mut buf = vec![0u8; 128];
        let n = f.read_at(&mut buf, 0).map_err(text)?;
        let s = String::from_utf8_lossy(&buf[..n]).into_owned();
        if !s.starts_with(&format!("written by rank {q}, pid ")) {
            return Err(format!("descriptor from rank {q} reads {s:?}"));
        }
        pids.push(s.rsplit(' ').next().unwrap_or_default().to_string());
    }
    store.all_gather(b"done").map_err(text)?;
    let _ = std::fs::remove_file(&path);
    Ok(format!(
        "10 all-gathers and one descriptor exchange with pids {pids:?}"
    ))
}

fn child_store_dies(rank: usize, world: usize, address: &StoreAddress, die_rank: usize) -> Outcome {
    let store = SocketStore::new(address, rank, world, Duration::from_secs(20)).map_err(text)?;
    store.all_gather(b"first").map_err(text)?;
    if rank == die_rank {
        kill_self();
    }
    let started = Instant::now();
    match store.all_gather(b"second") {
        Ok(_) => Err("the all-gather succeeded without the dead rank".into()),
        Err(e)
            if started.elapsed() < Duration::from_secs(10)
                && e.to_string().contains(&format!("rank {die_rank}")) =>
        {
            Ok(format!("error after {:?}: {e}", started.elapsed()))
        }
        Err(e) => Err(format!("unexpected error after {:?}: {e}", started.elapsed())),
    }
}

/// How one checked call reaches the communicator.
#[derive(Debug, Clone, Copy)]
enum How {
    Call(Algorithm),
    /// copy_to_symmetric + all_reduce_symmetric + copy_from_symmetric.
    Symmetric,
}

/// One all-reduce of `len` random elements (every rank derives every rank's input from the
/// seed), checked against the fp32 rank-order emulation bit for bit and the f64 reference.
fn checked_call<T: TestElem>(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    len: usize,
    how: How,
    seed: u64,
) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let inputs: Vec<Vec<T>> = (0..world)
        .map(|q| random_input(&mut rng(seed * 64 + q as u64), len))
        .collect();
    let poison: Vec<T> = vec![bytemuck::cast_slice::<u8, T>(&[0xFFu8; 16])[0]; len];
    let d_in = stream.clone_htod(&inputs[rank]).map_err(text)?;
    let mut d_out = stream.clone_htod(&poison).map_err(text)?;
    match how {
        How::Call(a) => comm.all_reduce_with(&d_in, &mut d_out, stream, a).map_err(text)?,
        How::Symmetric => {
            comm.copy_to_symmetric(&d_in, stream).map_err(text)?;
            comm.all_reduce_symmetric::<T>(len, stream).map_err(text)?;
            comm.copy_from_symmetric(&mut d_out, stream).map_err(text)?;
        }
    }
    comm.synchronize(stream).map_err(text)?;
    let out = stream.clone_dtoh(&d_out).map_err(text)?;
    let what = format!("{} len {len} {how:?} W={world}", T::DTYPE);
    check_bits(
        &format!("{what}: fp32 rank-order emulation"),
        &emulate(&inputs),
        &out,
    )?;
    check_against_f64(&inputs, &out).map_err(|e| format!("{what}: {e}"))
}

fn checked(
    dtype: DType,
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    len: usize,
    how: How,
    seed: u64,
) -> Result<(), String> {
    match dtype {
        DType::F32 => checked_call::<f32>(comm, stream, len, how, seed),
        DType::F16 => checked_call::<f16>(comm, stream, len, how, seed),
        DType::BF16 => checked_call::<bf16>(comm, stream, len, how, seed),
    }
}

fn child_gpu(test: &str) -> Result<Arc<CudaContext>, String> {
    gpu(test).ok_or_else(|| "no GPU in the rank process".to_string())
}

/// Multi-process config: generous kernel timeout (time-sliced processes), small capacity.
fn mp_config() -> Config {
    Config {
        capacity_bytes: 4 << 20,
        timeout: Duration::from_secs(20),
        ..Config::default()
    }
}

const CALLS: [(DType, usize, How); 10] = [
    (DType::F32, 1000, How::Call(Algorithm::Auto)),
    (DType::BF16, 4097, How::Call(Algorithm::OneShot)),
    (DType::F16, 100_003, How::Call(Algorithm::TwoShot)),
    (DType::BF16, 300_000, How::Call(Algorithm::Auto)),
    (DType::F32, 3, How::Call(Algorithm::Auto)),
    (DType::F32, 1 << 20, How::Call(Algorithm::TwoShot)),
    (DType::BF16, 77_777, How::Symmetric),
    (DType::F16, 9, How::Call(Algorithm::OneShot)),
    (DType::F32, 65_536, How::Symmetric),
    (DType::BF16, 2 << 20, How::Call(Algorithm::Auto)),
];

fn child_allreduce(rank: usize, world: usize, address: &StoreAddress) -> Outcome {
    let ctx = child_gpu("multi-process all-reduce")?;
    let store = SocketStore::new(address, rank, world, Duration::from_secs(60)).map_err(text)?;
    let comm = Communicator::new(&store, ctx.clone(), mp_config()).map_err(text)?;
    if !comm.has_peer_kernels() {
        return Err(format!("no peer kernels: {:?}", comm.peer_kernels_unavailable()));
    }
    if rank == 0 {
        println!("{}", comm.describe());
    }
    let stream = ctx.new_stream().map_err(text)?;
    let started = Instant::now();
    // Twice through the list: 20 calls.
    for round in 0..2u64 {
        for (i, &(dtype, len, how)) in CALLS.iter().enumerate() {
            checked(dtype, &comm, &stream, len, how, round * 100 + i as u64)
                .map_err(|e| format!("call {i} of round {round}: {e}"))?;
        }
    }
    let elapsed = started.elapsed();
    store.all_gather(b"done").map_err(text)?;
    Ok(format!(
        "20 all-reduces over {world} processes on device {}, each bit-identical to the fp32 rank-order \
         emulation and within the f64 bound ({elapsed:?}, time-sliced: not a timing)",
        comm.device()
    ))
}

/// A bootstrap that kills its own process at its `die_at`-th exchange (counting from 1).
struct Dying<'a> {
    inner: &'a SocketStore,
    die_at: usize,
    calls: Cell<usize>,
}

impl Dying<'_> {
    fn tick(&self) {
        let n = self.calls.get() + 1;
        self.calls.set(n);
        if n == self.die_at {
            kill_self();
        }
    }
}

impl Bootstrap for Dying<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_gather(&self, bytes: &[u8]) -> symm_allreduce::Result<Vec<Vec<u8>>> {
        self.tick();
        self.inner.all_gather(bytes)
    }
    fn all_gather_fds(&self, fd: BorrowedFd<'_>) -> symm_allreduce::Result<Vec<OwnedFd>> {
        self.tick();
        self.inner.all_gather_fds(fd)
    }
}

fn child_killed(
    rank: usize,
    world: usize,
    address: &StoreAddress,
    die_rank: usize,
    die_at: usize,
) -> Outcome {
    let ctx = child_gpu("killed rank")?;
    let store = SocketStore::new(address, rank, world, Duration::from_secs(30)).map_err(text)?;
    if rank == die_rank {
        let dying = Dying {
            inner: &store,
            die_at,
            calls: Cell::new(0),
        };
        let _ = Communicator::new(&dying, ctx, mp_config());
        return Err(format!(
            "exchange {die_at} never came: setup made {} exchanges",
            dying.calls.get()
        ));
    }
    // Warm up the driver's own lazily opened descriptors (a world of one exports and imports
    // its memory as a descriptor too), so that only this setup's are counted.
    drop(Communicator::local_group(std::slice::from_ref(&ctx), mp_config()).map_err(text)?);
    let fds_before = open_fd_count();
    let started = Instant::now();
    let result = Communicator::new(&store, ctx.clone(), mp_config());
    let elapsed = started.elapsed();
    let err = match result {
        Ok(_) => return Err("setup succeeded although a rank was killed".into()),
        Err(e) => e,
    };
    // Everything the failed setup opened is closed again (the store's sockets stay).
    ctx.synchronize().map_err(text)?;
    let fds_after = open_fd_count();
    if fds_after != fds_before {
        return Err(format!(
            "{fds_before} descriptors before the failed setup, {fds_after} after"
        ));
    }
    if elapsed >= store.timeout() {
        return Err(format!("the error took {elapsed:?}, the whole timeout: {err}"));
    }
    if !err.to_string().contains(&format!("rank {die_rank}")) {
        return Err(format!("the error does not name rank {die_rank}: {err}"));
    }
    Ok(format!(
        "error after {elapsed:?} (timeout {:?}), no descriptor leaked: {err}",
        store.timeout()
    ))
}

fn child_leak(rank: usize, world: usize, address: &StoreAddress) -> Outcome {
    let ctx = child_gpu("leak check")?;
    let store = SocketStore::new(address, rank, world, Duration::from_secs(60)).map_err(text)?;
    let stream = ctx.new_stream().map_err(text)?;
    let mut baseline: Option<(usize, usize)> = None;
    let iterations = 6u64;
    for i in 0..iterations {
        {
            let comm = Communicator::new(&store, ctx.clone(), mp_config()).map_err(text)?;
            checked(DType::F32, &comm, &stream, 5000, How::Call(Algorithm::Auto), i)?;
        }
        // Freed stream-ordered memory goes back to the device at a synchronisation.
        ctx.bind_to_thread().map_err(text)?;
        ctx.synchronize().map_err(text)?;
        // Every rank has dropped its communicator before anyone measures, and everyone has
        // measured before anyone creates the next one (free memory is device-wide).
        store.all_gather(b"dropped").map_err(text)?;
        let fds = open_fd_count();
        let (free, _) = cuda::mem_get_info().map_err(text)?;
        store.all_gather(b"measured").map_err(text)?;
        match baseline {
            None => baseline = Some((fds, free)),
            Some((fds0, free0)) => {
                if fds != fds0 {
                    return Err(format!(
                        "iteration {i}: {fds} open descriptors, {fds0} after the first"
                    ));
                }
                // Each leaked workspace would cost every rank its allocation (14 MiB here).
                if free + (4 << 20) < free0 {
                    return Err(format!(
                        "iteration {i}: {} MiB less free device memory than after the first",
                        (free0 - free) >> 20
                    ));
                }
            }
        }
    }
    let (fds0, free0) = baseline.unwrap_or_default();
    Ok(format!(
        "{iterations} create/all-reduce/drop cycles: descriptors steady at {fds0}, free device memory steady \
         (within 4 MiB) at {} MiB",
        free0 >> 20
    ))
}

fn child_nccl_refused(rank: usize, world: usize, address: &StoreAddress) -> Outcome {
    let ctx = child_gpu("NCCL refused")?;
    let store = SocketStore::new(address, rank, world, Duration::from_secs(60)).map_err(text)?;
    let config = Config {
        nccl_above_bytes: Some(256 << 10),
        ..mp_config()
    };
    let comm = Communicator::with_nccl_fallback(&store, ctx.clone(), config).map_err(text)?;
    if !comm.has_peer_kernels() {
        return Err("the peer kernels should run on one device".into());
    }
    let stream = ctx.new_stream().map_err(text)?;
    let big = 1 << 20; // 4 MiB of f32: above nccl_above_bytes
    let path = comm.path(big, DType::F32, Algorithm::Auto).map_err(text)?;
    let note = match comm.nccl_unavailable() {
        Some(why) => {
            // NCCL refused (two ranks on one GPU): the kernels take the big call and say why.
            if path.algorithm == Algorithm::Nccl || !path.reason.contains("ignored") {
                return Err(format!("without NCCL the path should be the kernels: {path}"));
            }
            format!("no NCCL fallback ({why}); 4 MiB path: {path}")
        }
        None => format!("NCCL accepted two ranks on one device; 4 MiB path: {path}"),
    };
    checked(DType::F32, &comm, &stream, big, How::Call(Algorithm::Auto), 1)?;
    checked(DType::BF16, &comm, &stream, 1000, How::Call(Algorithm::Auto), 2)?;
    store.all_gather(b"done").map_err(text)?;
    Ok(note)
}

// ---- Tests (parent side) ---------------------------------------------------------------------

fn socket_store_across_processes_gathers_bytes_and_passes_descriptors() {
    let finished = finish(launch("store", 3, &[]), Duration::from_secs(60));
    assert_all_passed("socket store, 3 processes", &finished);
}

/// Rank `die_rank` must have died (non-zero exit or signal); every other rank must report OK.
fn assert_survivors_passed(finished: Vec<Finished>, die_rank: usize, what: &str) {
    let dead = finished.iter().find(|f| f.rank == die_rank).expect("dead rank");
    assert!(
        dead.status.is_some_and(|s| !s.success()),
        "{what}: rank {die_rank} should have died:\n{}",
        dead.log
    );
    let alive: Vec<Finished> = finished.into_iter().filter(|f| f.rank != die_rank).collect();
    assert_all_passed(what, &alive);
}

fn a_store_rank_killed_mid_exchange_is_an_error_for_the_others_at_once() {
    for die_rank in [2usize, 0] {
        let started = Instant::now();
        let finished = finish(
            launch("store_dies", 3, &[(DIE_RANK_ENV, die_rank.to_string())]),
            Duration::from_secs(60),
        );
        assert_survivors_passed(finished, die_rank, &format!("store, rank {die_rank} killed"));
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "took {:?}",
            started.elapsed()
        );
    }
}

fn two_and_four_processes_on_one_gpu_map_each_other_and_reduce_correctly() {
    for world in [2usize, 4] {
        let finished = finish(launch("allreduce", world, &[]), Duration::from_secs(240));
        assert_all_passed(&format!("all-reduce, {world} processes"), &finished);
    }
}

fn a_rank_killed_during_setup_makes_the_others_fail_fast_without_leaks() {
    // Setup exchanges: 1 device vote, 2 hello, 3 topology, 4 device-check vote, 5 kernels
    // vote, 6 limits, 7 allocation vote, 8 descriptor exchange, 9 its vote, 10 mapping vote.
    for (die_rank, die_at, when) in [
        (
            2usize,
            8usize,
            "in the descriptor exchange, after exporting its memory",
        ),
        (0, 5, "after loading the kernels"),
        (1, 10, "after mapping its peers' memory, before the vote"),
    ] {
        let finished = finish(
            launch(
                "killed",
                3,
                &[
                    (DIE_RANK_ENV, die_rank.to_string()),
                    (DIE_AT_ENV, die_at.to_string()),
                ],
            ),
            Duration::from_secs(90),
        );
        assert_survivors_passed(finished, die_rank, &format!("rank {die_rank} killed {when}"));
    }
}

fn creating_and_dropping_multi_process_communicators_leaks_nothing() {
    let finished = finish(launch("leak", 2, &[]), Duration::from_secs(180));
    assert_all_passed("leak check, 2 processes", &finished);
}

fn nccl_refusing_two_ranks_on_one_gpu_leaves_the_kernels_working() {
    let finished = finish(launch("nccl_refused", 2, &[]), Duration::from_secs(180));
    assert_all_passed("with_nccl_fallback, 2 processes on one GPU", &finished);
}

// ---- NCCL, one process -----------------------------------------------------------------------

fn nccl_world_of_one(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> symm_allreduce::cudarc::nccl::Comm {
    use symm_allreduce::cudarc::nccl::{Comm, Id};
    ctx.bind_to_thread().unwrap();
    let id = Id::new().expect("ncclGetUniqueId");
    Comm::from_rank(stream.clone(), 0, 1, id).expect("ncclCommInitRank")
}

fn nccl_bootstrap_world_of_one_routes_large_calls_to_nccl_correctly(ctx: Arc<CudaContext>) {
    let nccl_stream = ctx.new_stream().unwrap();
    let config = Config {
        capacity_bytes: 1 << 20,
        nccl_above_bytes: Some(64 << 10),
        // Below the NCCL threshold (a lone rank's published limit, 256 KiB, is above it).
        low_latency_max_bytes: Some(32 << 10),
        ..Config::default()
    };
    let comm = Communicator::from_nccl(nccl_world_of_one(&ctx, &nccl_stream), config).unwrap();
    eprintln!("{}", comm.describe());
    assert!(comm.has_peer_kernels(), "{:?}", comm.peer_kernels_unavailable());
    assert!(comm.has_nccl_fallback());
    let path = |len, dtype| comm.path(len, dtype, Algorithm::Auto).unwrap();
    assert_eq!(path(1024, DType::F32).algorithm, Algorithm::LowLatency);
    // One rank above the low-latency limit: the two-shot, a single pass from input to output.
    assert_eq!(path(10_000, DType::F32).algorithm, Algorithm::TwoShot);
    let above = path(64 << 10, DType::F32);
    assert_eq!(above.algorithm, Algorithm::Nccl);
    assert!(above.reason.contains("nccl_above_bytes"), "{above}");
    // Above both the threshold and the capacity: the threshold rule is checked first.
    let over = path(1 << 20, DType::F32);
    assert_eq!(over.algorithm, Algorithm::Nccl);
    assert!(over.reason.contains("nccl_above_bytes"), "{over}");
    // Forcing a kernel above the capacity is refused before anything runs.
    assert!(matches!(
        comm.path(1 << 20, DType::F32, Algorithm::TwoShot),
        Err(Error::ExceedsCapacity { .. })
    ));

    let own_stream = ctx.new_stream().unwrap();
    for (stream, which) in [
        (&own_stream, "own stream (event fork/join)"),
        (&nccl_stream, "the comm's stream"),
    ] {
        for (dtype, len, how) in [
            (DType::F32, 1000, How::Call(Algorithm::Auto)),     // kernel
            (DType::F32, 100_000, How::Call(Algorithm::Auto)),  // NCCL: above the threshold
            (DType::BF16, 3 << 20, How::Call(Algorithm::Auto)), // NCCL: above the capacity
            (DType::F16, 777, How::Call(Algorithm::Nccl)),      // NCCL: forced
            (DType::BF16, 200_000, How::Symmetric),             // NCCL in place on the symmetric buffer
            (DType::BF16, 1000, How::Symmetric),                // kernel, zero-copy
        ] {
            checked(dtype, &comm, stream, len, how, len as u64)
                .unwrap_or_else(|e| panic!("{which}: {dtype} len {len} {how:?}: {e}"));
        }
    }
    // Bad input to the NCCL path is still a typed error, before anything runs.
    let a = own_stream.alloc_zeros::<f32>(100_000).unwrap();
    let mut b = own_stream.alloc_zeros::<f32>(99_999).unwrap();
    assert!(matches!(
        comm.all_reduce(&a, &mut b, &own_stream),
        Err(Error::LengthMismatch { .. })
    ));
}

fn peer_kernels_off_without_nccl_is_refused_and_nccl_calls_fail_typed(ctx: Arc<CudaContext>) {
    // Without a fallback, turning the kernels off is refused with a reason.
    let off = Config {
        peer_kernels: false,
        capacity_bytes: 1 << 20,
        ..Config::default()
    };
    let err = Communicator::local_group(std::slice::from_ref(&ctx), off.clone()).unwrap_err();
    assert!(err.to_string().contains("peer_kernels"), "{err}");
    let plain = Communicator::local_group(std::slice::from_ref(&ctx), Config::default()).unwrap();
    let s = ctx.new_stream().unwrap();
    let x = s.alloc_zeros::<f32>(64).unwrap();
    let mut y = s.alloc_zeros::<f32>(64).unwrap();
    let err = plain[0]
        .all_reduce_with(&x, &mut y, &s, Algorithm::Nccl)
        .unwrap_err();
    assert!(matches!(err, Error::NcclUnavailable { .. }), "{err}");
}

fn every_call_goes_to_nccl_when_the_peer_kernels_are_off(ctx: Arc<CudaContext>) {
    let off = Config {
        peer_kernels: false,
        capacity_bytes: 1 << 20,
        ..Config::default()
    };
    let nccl_stream = ctx.new_stream().unwrap();
    let comm = Communicator::from_nccl(nccl_world_of_one(&ctx, &nccl_stream), off).unwrap();
    eprintln!("{}", comm.describe());
    assert!(!comm.has_peer_kernels());
    assert!(comm
        .peer_kernels_unavailable()
        .unwrap()
        .contains("peer_kernels is false"));
    assert_eq!(
        comm.path(8, DType::F32, Algorithm::OneShot).unwrap().algorithm,
        Algorithm::Nccl
    );
    for (dtype, len, how) in [
        (DType::F32, 5, How::Call(Algorithm::Auto)),
        (DType::BF16, 4096, How::Call(Algorithm::TwoShot)),
        (DType::F16, 100_000, How::Symmetric),
        (DType::F32, 1 << 20, How::Call(Algorithm::Auto)),
    ] {
        checked(dtype, &comm, &nccl_stream, len, how, 9).unwrap();
    }
}

fn own_nccl_fallback_over_a_socket_store_world_of_one(ctx: Arc<CudaContext>) {
    let info = symm_allreduce::nccl_library().unwrap();
    let store = SocketStore::new(
        &StoreAddress::unique("symm-test").unwrap(),
        0,
        1,
        Duration::from_secs(10),
    )
    .unwrap();
    let config = Config {
        capacity_bytes: 1 << 20,
        nccl_above_bytes: Some(16 << 10),
        ..Config::default()
    };
    let comm = Communicator::with_nccl_fallback(&store, ctx.clone(), config).unwrap();
    eprintln!(
        "NCCL {} loaded as {}\n{}",
        info.version,
        info.name,
        comm.describe()
    );
    assert!(comm.has_nccl_fallback(), "{:?}", comm.nccl_unavailable());
    assert!(comm.has_peer_kernels());
    let stream = ctx.new_stream().unwrap();
    for (dtype, len, how) in [
        (DType::F32, 100, How::Call(Algorithm::Auto)),
        (DType::BF16, 100_000, How::Call(Algorithm::Auto)),
        (DType::F32, 1 << 20, How::Call(Algorithm::Auto)),
        (DType::F16, 50_000, How::Symmetric),
    ] {
        checked(dtype, &comm, &stream, len, how, 3).unwrap();
    }
}

fn main() -> std::process::ExitCode {
    if let Ok(scenario) = std::env::var(CHILD_ENV) {
        rank_process_entry(scenario);
        return std::process::ExitCode::SUCCESS;
    }
    common::harness::run(
        "multiprocess",
        vec![
            cpu_test!(socket_store_across_processes_gathers_bytes_and_passes_descriptors),
            cpu_test!(a_store_rank_killed_mid_exchange_is_an_error_for_the_others_at_once),
            gpu_processes_test!(two_and_four_processes_on_one_gpu_map_each_other_and_reduce_correctly),
            gpu_processes_test!(a_rank_killed_during_setup_makes_the_others_fail_fast_without_leaks),
            gpu_processes_test!(creating_and_dropping_multi_process_communicators_leaks_nothing),
            gpu_processes_test!(nccl_refusing_two_ranks_on_one_gpu_leaves_the_kernels_working),
            gpu_nccl_test!(nccl_bootstrap_world_of_one_routes_large_calls_to_nccl_correctly),
            gpu_test!(peer_kernels_off_without_nccl_is_refused_and_nccl_calls_fail_typed),
            gpu_nccl_test!(every_call_goes_to_nccl_when_the_peer_kernels_are_off),
            gpu_nccl_test!(own_nccl_fallback_over_a_socket_store_world_of_one),
        ],
    )
}
