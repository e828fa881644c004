//! One process per rank, as tensor-parallel engines run: this program starts `--world N`
//! copies of itself (rank r on device r mod the device count), the ranks build their
//! communicators, run all-reduces of several sizes, check every result against a host
//! reference, and exit.
//!
//! ```text
//! cargo run --release --example multiprocess -- --world 2                   # socket store
//! cargo run --release --example multiprocess -- --world 1 --bootstrap nccl  # NCCL id passed to the ranks
//! ```
//!
//! - `--bootstrap socket` (default): the ranks meet through a [`SocketStore`] on an abstract
//!   Unix socket whose name the parent passes down; works with several ranks on one GPU.
//! - `--bootstrap nccl`: the parent makes an NCCL unique id and passes it to the children
//!   (hex, in an environment variable), each child builds its cudarc NCCL communicator, as an
//!   engine would, and hands it to [`Communicator::from_nccl`]; calls above 1 MiB go to NCCL.
//!   NCCL refuses two ranks on one device, so there `--world` must not exceed the GPU count.
//!
//! Set `SYMM_ALLREDUCE_LOG=1` to see each rank's topology and path table.

use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use symm_allreduce::cudarc::driver::CudaStream;
use symm_allreduce::cudarc::nccl::{Comm, Id};
use symm_allreduce::{Communicator, Config, Element, SocketStore, StoreAddress};

const RANK_ENV: &str = "SYMM_EXAMPLE_RANK";
const ADDRESS_ENV: &str = "SYMM_EXAMPLE_STORE";
const NCCL_ID_ENV: &str = "SYMM_EXAMPLE_NCCL_ID";

/// How the ranks meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Boot {
    /// A socket store on an abstract Unix socket (several ranks may share a GPU).
    Socket,
    /// An NCCL unique id made by the parent; each rank builds its own NCCL communicator.
    Nccl,
}

/// One process per rank: starts `--world` copies of itself, each runs checked all-reduces.
#[derive(Debug, clap::Parser)]
#[command(name = "multiprocess")]
struct Args {
    /// Number of ranks (1..=8), one process each.
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// How the ranks meet.
    #[arg(long = "bootstrap", value_enum, default_value = "socket")]
    boot: Boot,
    /// The launcher kills ranks still running after this many seconds.
    #[arg(long = "timeout-secs", value_name = "S", default_value = "300", value_parser = parse_secs)]
    timeout: Duration,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|e| format!("{s:?}: {e}"))
}

fn main() -> ExitCode {
    // Bad flags: clap prints the usage and exits with 2.
    let args = <Args as clap::Parser>::parse();
    // Errors are printed in their human (Display) form, which says what to do.
    if let Err(e) = symm_allreduce::validate_world(args.world) {
        eprintln!("multiprocess: {e}");
        return ExitCode::from(2);
    }
    if let Err(e) = symm_allreduce::device_count() {
        eprintln!("multiprocess: no GPU: {e}");
        return ExitCode::from(2);
    }
    let result = match std::env::var(RANK_ENV) {
        Ok(rank) => match rank.parse::<usize>() {
            Ok(rank) => rank_main(rank, &args),
            Err(e) => Err(format!("{RANK_ENV}={rank}: {e}")),
        },
        Err(_) => launcher(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("multiprocess: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The parent: prepares the rendezvous, starts one process per rank, waits (bounded).
fn launcher(args: &Args) -> Result<(), String> {
    let devices = symm_allreduce::device_count().map_err(|e| e.to_string())?;
    let mut env: Vec<(&str, String)> = Vec::new();
    match args.boot {
        Boot::Socket => env.push((
            ADDRESS_ENV,
            StoreAddress::unique("symm-example")
                .map_err(|e| e.to_string())?
                .to_string(),
        )),
        Boot::Nccl => {
            if args.world > devices {
                return Err(format!(
                    "NCCL cannot put two ranks on one device and there are {devices} device(s): use --world <= \
                     {devices}, or --bootstrap socket"
                ));
            }
            let info = symm_allreduce::nccl_library().map_err(|e| e.to_string())?;
            // cudarc's own loader must find NCCL too (it panics otherwise): it looks for
            // libnccl.so, not libnccl.so.2.
            // SAFETY: only loads the library to see whether it is there.
            if !unsafe { symm_allreduce::cudarc::nccl::sys::is_culib_present() } {
                return Err(format!(
                    "NCCL is installed as {} only; cudarc needs a libnccl.so on the loader path (a symlink \
                     to it will do)",
                    info.name
                ));
            }
            let id = Id::new().map_err(|e| format!("ncclGetUniqueId: {:?}", e.0))?;
            let hex = hex::encode(id.internal().map(|c| c as u8));
            println!(
                "launcher: NCCL {} ({}), unique id made here and passed to every rank",
                info.version, info.name
            );
            env.push((NCCL_ID_ENV, hex));
        }
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Vec::with_capacity(args.world);
    for rank in 0..args.world {
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args().skip(1)).env(RANK_ENV, rank.to_string());
        for (k, v) in &env {
            cmd.env(k, v);
        }
        match cmd.spawn() {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                for (_, c) in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("cannot start rank {rank}: {e}"));
            }
        }
    }
    let deadline = Instant::now() + args.timeout;
    let mut status = vec![None; args.world];
    while status.iter().any(Option::is_none) && Instant::now() < deadline {
        for (rank, child) in &mut children {
            if status[*rank].is_none() {
                status[*rank] = child.try_wait().map_err(|e| e.to_string())?;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut failed = Vec::new();
    for (rank, child) in &mut children {
        match status[*rank] {
            Some(s) if s.success() => {}
            Some(s) => failed.push(format!("rank {rank} exited with {s}")),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                failed.push(format!(
                    "rank {rank} still ran after {:?} and was killed",
                    args.timeout
                ));
            }
        }
    }
    if failed.is_empty() {
        println!("launcher: all {} ranks finished cleanly", args.world);
        Ok(())
    } else {
        Err(format!("launcher: {}", failed.join("; ")))
    }
}

/// Every rank's input element i: a multiple of 1/4 in [-2, 2], so every sum of up to 8 ranks
/// is exact in f32, f16 and bf16 and the reference is exact too.
fn value(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13) % 17) as f32 * 0.25 - 2.0
}

/// One rank.
fn rank_main(rank: usize, args: &Args) -> Result<(), String> {
    let world = args.world;
    let devices = symm_allreduce::device_count().map_err(|e| e.to_string())?;
    let ctx = symm_allreduce::context(rank % devices).map_err(|e| e.to_string())?;
    let config = Config {
        capacity_bytes: 4 << 20,
        // Several processes on one GPU are time-sliced: be patient.
        timeout: Duration::from_secs(30),
        nccl_above_bytes: Some(1 << 20),
        ..Config::default()
    };
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let comm = match args.boot {
        Boot::Socket => {
            let address = StoreAddress::parse(&std::env::var(ADDRESS_ENV).map_err(|_| "no store address")?);
            let store = SocketStore::new(&address, rank, world, Duration::from_secs(60))
                .map_err(|e| e.to_string())?;
            Communicator::new(&store, ctx.clone(), config).map_err(|e| e.to_string())?
        }
        Boot::Nccl => {
            let hex = std::env::var(NCCL_ID_ENV).map_err(|_| "no NCCL id")?;
            let mut bytes = [0u8; 128];
            hex::decode_to_slice(&hex, &mut bytes).map_err(|e| format!("{NCCL_ID_ENV}: {e}"))?;
            let internal = bytes.map(|b| b as std::ffi::c_char);
            ctx.bind_to_thread().map_err(|e| e.to_string())?;
            // What an engine already has: its own NCCL communicator on its own stream.
            let nccl = Comm::from_rank(stream.clone(), rank, world, Id::uninit(internal))
                .map_err(|e| format!("ncclCommInitRank: {:?}", e.0))?;
            Communicator::from_nccl(nccl, config).map_err(|e| e.to_string())?
        }
    };
    // (With SYMM_ALLREDUCE_LOG=1 every rank has printed this already.)
    if rank == 0 && std::env::var_os(symm_allreduce::LOG_ENV).is_none() {
        println!("{}", comm.describe());
    }
    let started = Instant::now();
    let sizes = [1000usize, 4097, 100_003, 300_000, 1 << 20];
    for &len in &sizes {
        check::<f32>(&comm, &stream, len)?;
        check::<half::bf16>(&comm, &stream, len)?;
    }
    println!(
        "rank {rank}: {} all-reduces correct ({:?}; with several processes on one GPU this is time-sliced, not a timing)",
        2 * sizes.len(),
        started.elapsed()
    );
    drop(comm);
    Ok(())
}

trait FromF32: Element + Copy {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl FromF32 for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl FromF32 for half::bf16 {
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

fn check<T: FromF32>(
    comm: &Communicator,
    stream: &std::sync::Arc<CudaStream>,
    len: usize,
) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let input: Vec<T> = (0..len).map(|i| T::from_f32(value(rank, i))).collect();
    let d_in = stream.clone_htod(&input).map_err(|e| e.to_string())?;
    let mut d_out = stream.alloc_zeros::<T>(len).map_err(|e| e.to_string())?;
    let path = comm
        .path(len, T::DTYPE, symm_allreduce::Algorithm::Auto)
        .map_err(|e| e.to_string())?;
    comm.all_reduce(&d_in, &mut d_out, stream)
        .map_err(|e| e.to_string())?;
    comm.synchronize(stream).map_err(|e| e.to_string())?;
    let out = stream.clone_dtoh(&d_out).map_err(|e| e.to_string())?;
    for (i, got) in out.iter().enumerate() {
        let expected: f64 = (0..world).map(|q| value(q, i) as f64).sum();
        if got.to_f32() as f64 != expected {
            return Err(format!(
                "rank {rank}: {len} x {} element {i} is {} but the host reference is {expected} (path {path})",
                T::DTYPE,
                got.to_f32()
            ));
        }
    }
    if rank == 0 {
        println!(
            "rank 0: {len:>8} x {:<4} -> {path}: matches the host reference",
            T::DTYPE.name()
        );
    }
    Ok(())
}
