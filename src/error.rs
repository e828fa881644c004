//! The crate's one error type.

use std::time::Duration;

use cudarc::driver::DriverError;

use crate::dtype::DType;

/// Which synchronisation point a timed-out wait belonged to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarrierPhase {
    /// Before reading peers' inputs (every algorithm).
    Start,
    /// Between two-shot's reduce-scatter and all-gather.
    Middle,
    /// After the zero-copy in-place call's pushes.
    End,
    /// Waiting for a peer's low-latency lines to arrive.
    Arrival,
    /// The divergence check's exchange of call shapes (before any data).
    Check,
    /// A code this version does not know (newer kernels).
    Unknown(u32),
}

impl std::fmt::Display for BarrierPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BarrierPhase::Start => f.write_str("start barrier"),
            BarrierPhase::Middle => f.write_str("middle barrier"),
            BarrierPhase::End => f.write_str("end barrier"),
            BarrierPhase::Arrival => f.write_str("arrival of its low-latency lines"),
            BarrierPhase::Check => f.write_str("divergence check"),
            BarrierPhase::Unknown(c) => write!(f, "barrier phase {c}"),
        }
    }
}

/// Everything that can go wrong. Bad input is reported before anything is launched, so an
/// error from [`crate::Communicator::all_reduce`] never leaves a half-written output behind
/// (except [`Error::PeerTimeout`], whose output contents are documented there).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `libcuda` could not be loaded.
    #[error(
        "the CUDA driver library could not be loaded ({detail}); install the NVIDIA driver, or run on a \
         machine with a GPU"
    )]
    DriverUnavailable {
        /// What the loader said.
        detail: String,
    },

    /// `Config::multicast` is `Required`, but multicast (NVLS) could not be set up: a veto
    /// variable is set, a device reports no multicast support, the world has one rank, or a
    /// setup step failed (the reason names which).
    #[error(
        "multicast (NVLS) is required by Config::multicast = Required but is unavailable: {reason}; set \
         Config::multicast to Auto (falls back to the peer kernels) or Off"
    )]
    MulticastUnavailable {
        /// Why (the veto variable, the attribute, or the failed step).
        reason: String,
    },

    /// The driver loaded but shows no device.
    #[error("no CUDA device is visible (check CUDA_VISIBLE_DEVICES and nvidia-smi)")]
    NoDevice,

    /// A device ordinal beyond the devices present.
    #[error("device {ordinal} does not exist: {count} CUDA device(s) are visible")]
    DeviceNotFound {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },

    /// A CUDA driver call failed.
    #[error("CUDA call {call} failed: {}", cuda_code(source))]
    Cuda {
        /// The driver function (or step) that failed.
        call: &'static str,
        /// The driver's code.
        #[source]
        source: DriverError,
    },

    /// The kernels were not compiled into this build (no nvcc when the crate was built).
    /// Turn on the crate's `require-kernels` feature to make that a build error instead.
    #[error(
        "the all-reduce kernels are not in this build: nvcc was not found (or failed) when symm-allreduce \
         was compiled. To fix: as a path dependency or in a checkout, run scripts/install-nvcc.sh in the \
         crate's directory (or put nvcc on PATH) and build again; as a git or registry dependency, put nvcc \
         on PATH or set NVCC=/path/to/nvcc or CUDA_HOME and build again (the crate rebuilds when these \
         change; `cargo clean -p symm-allreduce` forces it). Enable the `require-kernels` feature to make \
         a build without kernels fail"
    )]
    KernelsUnavailable,

    /// The device cannot run these kernels.
    #[error("device {ordinal} is not supported: {reason}")]
    Unsupported {
        /// The device.
        ordinal: usize,
        /// Why.
        reason: String,
    },

    /// The world size is outside 1..=8 or does not match what the peers said.
    #[error("invalid world size {world}: {reason}")]
    InvalidWorldSize {
        /// The world size given.
        world: usize,
        /// Why it is refused.
        reason: String,
    },

    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    /// An all-reduce of zero elements.
    #[error("all_reduce of an empty buffer: pass at least one element")]
    Empty,

    /// Input and output lengths differ.
    #[error("input has {input} elements but output has {output}: they must be equal")]
    LengthMismatch {
        /// Input length in elements.
        input: usize,
        /// Output length in elements.
        output: usize,
    },

    /// A buffer of the fused all-reduce + residual + RMSNorm call has the wrong shape.
    #[error("all_reduce_add_rmsnorm: {what}: {reason}")]
    InvalidShape {
        /// The argument at fault: "input", "residual", "weight", "norm_out" or "eps".
        what: &'static str,
        /// What is wrong and what it must be.
        reason: String,
    },

    /// The message does not fit the symmetric workspace.
    #[error(
        "{bytes} bytes exceed this communicator's capacity of {capacity} bytes: raise Config::capacity_bytes \
         or split the call"
    )]
    ExceedsCapacity {
        /// Bytes asked for.
        bytes: usize,
        /// Configured capacity.
        capacity: usize,
    },

    /// A buffer is not aligned to its element size (a view at any element offset of a
    /// typed buffer is; only a raw address can be misaligned).
    #[error(
        "{which} buffer at {address:#x} is not aligned to its element size: pass a typed buffer or a view of one"
    )]
    Misaligned {
        /// "input" or "output".
        which: &'static str,
        /// Its device address.
        address: u64,
    },

    /// A buffer or stream belongs to another device than this rank's.
    #[error("{which} is on device {found} but this rank runs on device {expected}")]
    WrongDevice {
        /// "input", "output" or "stream".
        which: &'static str,
        /// This rank's device.
        expected: usize,
        /// Where the argument lives.
        found: usize,
    },

    /// A peer did not arrive in time. The communicator is poisoned: every later call returns
    /// [`Error::Poisoned`]. The output of the call that timed out holds unspecified values
    /// (parts may be summed, parts untouched); the input is never modified.
    #[error(
        "rank {rank} waited more than {timeout:?} for rank {peer} at the {phase}; the communicator is now \
         unusable (a peer died, diverged, or launched a different sequence of collectives)"
    )]
    PeerTimeout {
        /// The rank that reports it.
        rank: usize,
        /// The rank it waited for.
        peer: usize,
        /// Where.
        phase: BarrierPhase,
        /// The configured bound.
        timeout: Duration,
    },

    /// The divergence check (`Config::check_divergence`, `SYMM_ALLREDUCE_CHECK=1`) found that
    /// two ranks ran different calls at the same point of their sequences: another length,
    /// dtype, algorithm or collective, or a rank that made more or fewer calls. The
    /// communicator is poisoned; no data was read or written by the call.
    #[error(
        "rank {rank} ran {this_call} but rank {peer} ran {peer_call} at the same point of the call sequence; \
         every rank must make the same calls in the same order (the communicator is now unusable: create a new one)"
    )]
    Diverged {
        /// The rank that found it.
        rank: usize,
        /// The rank whose call differs.
        peer: usize,
        /// `rank`'s call.
        this_call: String,
        /// `peer`'s call.
        peer_call: String,
    },

    /// An all-gather whose per-rank counts differ across ranks, detected on the device
    /// before any peer data is read: every rank reports it (at its next call or
    /// `synchronize`), the output's peer chunks are left unwritten, and the communicator stays
    /// usable.
    #[error(
        "rank {rank}: the all-gather counts differ from rank {peer}'s; every rank must pass the same \
         per-rank counts (and the same length to all_gather)"
    )]
    CountsMismatch {
        /// The rank that reports it.
        rank: usize,
        /// The lowest rank whose counts differ from this rank's.
        peer: usize,
    },

    /// Bad arguments to all_gather, all_gather_v or reduce_scatter (say which and why).
    #[error("{call}: {reason}")]
    InvalidCollective {
        /// The call.
        call: &'static str,
        /// What is wrong and what to pass instead.
        reason: String,
    },

    /// Setup failed on some rank; every rank returns this (or its own error) together.
    #[error("setup step '{step}' failed {}: {reason}", on_rank(*.rank))]
    PeerSetupFailed {
        /// The collective setup step.
        step: &'static str,
        /// The first rank that reported the failure (`None`: not attributable to one rank,
        /// e.g. a malformed message or a setup thread that panicked).
        rank: Option<usize>,
        /// That rank's error.
        reason: String,
    },

    /// A previous failure made the communicator unusable.
    #[error("the communicator is unusable after an earlier failure ({cause}); create a new one")]
    Poisoned {
        /// The earlier failure (a [`Error::PeerTimeout`], a [`Error::KernelFault`], ...).
        #[source]
        cause: Box<Error>,
    },

    /// A call came on another stream than this communicator's previous call, and the two
    /// could not be ordered (an event recorded on the old stream, waited for by the new one).
    #[error(
        "this call is on another stream than the communicator's previous call, and ordering it after that \
         call failed ({}); keep one stream per communicator while capturing a graph, or synchronize the \
         previous stream before switching",
        cuda_code(source)
    )]
    StreamOrder {
        /// The driver's code.
        #[source]
        source: DriverError,
    },

    /// A kernel wrote an error code this version does not know into the error word.
    #[error(
        "a kernel reported error code {code:#x}, which this version of symm-allreduce does not know: every rank \
         must run the same build"
    )]
    KernelFault {
        /// The raw error word.
        code: u32,
    },

    /// NCCL reported an error (fallback, bootstrap, or loading the library).
    #[error("NCCL call {call} failed: {detail}")]
    Nccl {
        /// The NCCL function (or `dlopen` when the library was not found).
        call: &'static str,
        /// Code and message.
        detail: String,
    },

    /// A call needs the NCCL fallback but this communicator has none.
    #[error(
        "this call needs the NCCL fallback, which this communicator does not have: {reason}. Create it with \
         Communicator::from_nccl or Communicator::with_nccl_fallback, with libnccl.so or libnccl.so.2 on the \
         loader path"
    )]
    NcclUnavailable {
        /// Why there is no fallback (and what path would have been taken).
        reason: String,
    },

    /// The symmetric pool has no free region large enough for an allocation.
    #[error(
        "the symmetric pool cannot hold {requested} more bytes: {free} of {capacity} bytes are free, the \
         largest free region holds {largest}; drop pool buffers you no longer need or raise Config::pool_bytes"
    )]
    PoolExhausted {
        /// Bytes asked for (rounded up to the pool's 256-byte alignment).
        requested: usize,
        /// The largest free region.
        largest: usize,
        /// All free bytes.
        free: usize,
        /// `Config::pool_bytes`, as laid out.
        capacity: usize,
    },

    /// A pool buffer of another communicator was passed where this communicator's pool
    /// buffer is required.
    #[error(
        "this pool buffer belongs to another communicator (pool {found}, this one is pool {expected}): \
         allocate it with this communicator's alloc_symmetric, or pass it to all_reduce as an ordinary buffer"
    )]
    ForeignPoolBuffer {
        /// This communicator's pool id.
        expected: u64,
        /// The buffer's pool id.
        found: u64,
    },

    /// A zero-copy pool call found that the ranks' pool buffers differ: the ranks did not make
    /// the same sequence of `alloc_symmetric` calls (or passed different buffers or views).
    /// Nothing was read or written; the communicator is poisoned.
    #[error(
        "rank {rank}: the pool buffer of this zero-copy call differs from rank {peer}'s (allocation sequence \
         number, offset, size, dtype or view): every rank must make the same sequence of alloc_symmetric calls \
         and drops, and pass the same buffer; nothing was reduced, create a new communicator"
    )]
    PoolMismatch {
        /// The rank that reports it.
        rank: usize,
        /// The first rank whose buffer differs from this one's.
        peer: usize,
    },

    /// The communicator has made `calls` calls, the most its 48-bit epochs count (446 years
    /// at 20 000 calls a second): the call was refused on every rank rather than let a
    /// barrier flag wrap. Create a new communicator.
    #[error(
        "this communicator has made {calls} calls, the most its epochs count: the call was refused on every \
         rank; create a new communicator"
    )]
    CallsExhausted {
        /// Calls made.
        calls: u64,
    },

    /// A socket-store address without a launch secret (or with a malformed one).
    #[error(
        "the socket store address {address} {problem}: create it on the launcher with StoreAddress::unique \
         (or StoreAddress::with_secret) and pass its full text, `#secret` included, to every rank"
    )]
    MissingSecret {
        /// The address, secret hidden.
        address: String,
        /// What is wrong with it.
        problem: String,
    },

    /// A bootstrap peer was refused: another user, a wrong launch secret, or a listener that is
    /// not this job's.
    #[error("bootstrap peer refused: {reason}")]
    PeerRefused {
        /// Why, and what to do about it.
        reason: String,
    },

    /// A tuning table could not be used: unreadable, another format version, an unknown
    /// algorithm, dtype or world, thresholds that decrease, or a missing field.
    #[error("tuning table {table} {problem}")]
    InvalidTuning {
        /// The file, or how the table was given.
        table: String,
        /// What is wrong, and what to do about it.
        problem: TuningProblem,
    },

    /// The ranks do not use the same tuning table; every rank returns this at setup.
    #[error(
        "rank {rank} routes with {theirs}, but this rank with {ours}: every rank must use the same table. \
         Point SYMM_ALLREDUCE_TUNING at the same file on every rank (or pass the same table to Config::with_tuning \
         everywhere, or unset it everywhere)",
    )]
    TuningMismatch {
        /// A rank whose table differs from this rank's.
        rank: usize,
        /// This rank's table (`tuning table <digest>` or the published starting points).
        ours: String,
        /// That rank's.
        theirs: String,
    },

    /// The bootstrap channel could not be set up here (socket, address, or OS error).
    #[error("bootstrap failed on this rank: {reason}")]
    Bootstrap {
        /// What failed, and what to do about it.
        reason: String,
    },
}

/// The driver's code by name (`CUDA_ERROR_OUT_OF_MEMORY`). cudarc's own `Display` is its
/// `Debug` form, and it asks the driver for the description, which panics where `libcuda`
/// cannot be loaded; the name alone needs nothing.
fn cuda_code(e: &DriverError) -> String {
    format!("{:?}", e.0)
}

fn on_rank(rank: Option<usize>) -> String {
    match rank {
        Some(r) => format!("on rank {r}"),
        None => "in the group".to_string(),
    }
}

impl Error {
    /// Whether this error means there is no GPU to run on: no driver, no visible device, or
    /// the device asked for does not exist. The crate's programs exit with code 2 for it.
    pub fn is_no_gpu(&self) -> bool {
        matches!(
            self,
            Error::DriverUnavailable { .. } | Error::NoDevice | Error::DeviceNotFound { .. }
        )
    }

    /// Maps an error of cudarc's NCCL API (the caller's communicator), naming the call.
    pub(crate) fn from_cudarc_nccl(call: &'static str) -> impl Fn(cudarc::nccl::result::NcclError) -> Error {
        move |e| Error::Nccl {
            call,
            detail: format!("{:?} (set NCCL_DEBUG=WARN for NCCL's own account)", e.0),
        }
    }

    /// A message from a peer that does not parse.
    pub(crate) fn malformed(what: &str) -> Error {
        Error::PeerSetupFailed {
            step: "bootstrap",
            rank: None,
            reason: format!("malformed {what} message from a peer (mismatched crate versions?)"),
        }
    }
}

/// `?` on a cudarc driver call in code that returns this crate's [`Result`] (an embedder's
/// own stream, event or buffer calls next to the collectives). The call is not known here:
/// [`Error::Cuda`] names it "a cudarc driver call"; the crate's own calls name theirs.
impl From<DriverError> for Error {
    fn from(source: DriverError) -> Error {
        Error::Cuda {
            call: "a cudarc driver call",
            source,
        }
    }
}

/// `?` on a cudarc NCCL call (`Comm::from_rank`, the caller's own collectives) in code that
/// returns this crate's [`Result`]: [`Error::Nccl`], the call unnamed.
impl From<cudarc::nccl::result::NcclError> for Error {
    fn from(e: cudarc::nccl::result::NcclError) -> Error {
        Error::from_cudarc_nccl("a cudarc NCCL call")(e)
    }
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) trait CudaResultExt<T> {
    /// Names the failing driver call.
    fn during(self, call: &'static str) -> Result<T>;
}

impl<T> CudaResultExt<T> for std::result::Result<T, DriverError> {
    fn during(self, call: &'static str) -> Result<T> {
        self.map_err(|source| Error::Cuda { call, source })
    }
}

/// What is wrong with a tuning table (inside [`Error::InvalidTuning`]). Each message says
/// what to do about it (the messages are written beside the table format, in
/// `config/tuning.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TuningProblem {
    /// The file could not be read.
    Io {
        /// What the OS said.
        detail: String,
    },
    /// Not JSON, or a value of the wrong type, or a field this format does not have.
    Malformed {
        /// What the parser said.
        detail: String,
    },
    /// JSON without `"format": "symm-allreduce tuning table"`.
    NotATable,
    /// A format version this build does not read.
    WrongVersion {
        /// The version in the file.
        found: u64,
        /// The newest version this build reads (it reads
        /// [`TUNING_OLDEST_VERSION`](crate::TUNING_OLDEST_VERSION) and up).
        supported: u64,
    },
    /// A required field is absent (or null).
    MissingField {
        /// Where, as a JSON path (`crossovers[2].max_bytes.one_shot`).
        field: String,
    },
    /// A `max_bytes` key that names no algorithm the table can set.
    UnknownAlgorithm {
        /// Where.
        at: String,
        /// The name.
        name: String,
    },
    /// A `dtype` this build does not have.
    UnknownDType {
        /// Where.
        at: String,
        /// The name.
        name: String,
    },
    /// A world size outside 1..=8.
    BadWorld {
        /// Where.
        at: String,
        /// The value.
        world: u64,
    },
    /// Thresholds that decrease in routing order.
    NonMonotone {
        /// The entry's dtype.
        dtype: DType,
        /// The entry's world.
        world: usize,
        /// Which two thresholds, and their values.
        detail: String,
    },
    /// Two entries for the same (dtype, world).
    Duplicate {
        /// The dtype.
        dtype: DType,
        /// The world.
        world: usize,
    },
    /// A `fused[..].max_tokens` key that names no fused algorithm the table can set.
    UnknownFusedAlgorithm {
        /// Where.
        at: String,
        /// The name.
        name: String,
    },
    /// A fused entry's hidden size that the fused call does not take.
    BadHidden {
        /// Where.
        at: String,
        /// The entry's dtype (the hidden size must be a multiple of its elements per pack).
        dtype: DType,
        /// The value.
        hidden: u64,
    },
    /// Two fused entries for the same (dtype, world, hidden).
    DuplicateFused {
        /// The dtype.
        dtype: DType,
        /// The world.
        world: usize,
        /// The hidden size.
        hidden: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_is_send_sync_static() {
        fn assert_bounds<T: Send + Sync + 'static + std::error::Error>() {}
        assert_bounds::<Error>();
    }

    /// Number of `Error` variants; `variant` below matches them exhaustively, so a new
    /// variant does not compile until it gets an index here, and the test fails until
    /// `every_error` constructs it.
    const VARIANTS: usize = 34;

    /// A stable index per variant and the text its message must contain to say what to do
    /// (`None` where the message carries the cause only).
    fn variant(e: &Error) -> (usize, Option<&'static str>) {
        match e {
            Error::DriverUnavailable { .. } => (0, Some("install the NVIDIA driver")),
            Error::NoDevice => (1, Some("CUDA_VISIBLE_DEVICES")),
            Error::DeviceNotFound { .. } => (2, Some("device(s) are visible")),
            Error::Cuda { .. } => (3, None),
            Error::KernelsUnavailable => (4, Some("scripts/install-nvcc.sh")),
            Error::Unsupported { .. } => (5, None),
            Error::InvalidWorldSize { .. } => (6, None),
            Error::InvalidConfig(_) => (7, None),
            Error::Empty => (8, Some("pass at least one element")),
            Error::LengthMismatch { .. } => (9, Some("must be equal")),
            Error::ExceedsCapacity { .. } => (10, Some("raise Config::capacity_bytes")),
            Error::Misaligned { .. } => (11, Some("pass a typed buffer")),
            Error::WrongDevice { .. } => (12, None),
            Error::PeerTimeout { .. } => (13, Some("a peer died, diverged")),
            Error::PeerSetupFailed { .. } => (14, None),
            Error::Poisoned { .. } => (15, Some("create a new one")),
            Error::StreamOrder { .. } => (16, Some("keep one stream per communicator")),
            Error::KernelFault { .. } => (17, Some("every rank must run the same build")),
            Error::Nccl { .. } => (18, None),
            Error::NcclUnavailable { .. } => (19, Some("Communicator::from_nccl")),
            Error::MissingSecret { .. } => (20, Some("StoreAddress::unique")),
            Error::PeerRefused { .. } => (21, None),
            Error::Bootstrap { .. } => (22, None),
            Error::Diverged { .. } => (23, Some("every rank must make the same calls")),
            Error::InvalidTuning { .. } => (24, None),
            Error::TuningMismatch { .. } => (25, Some("every rank must use the same table")),
            Error::CountsMismatch { .. } => (26, Some("every rank must pass the same")),
            Error::InvalidCollective { .. } => (27, None),
            Error::InvalidShape { .. } => (28, None),
            Error::MulticastUnavailable { .. } => (29, Some("set Config::multicast to Auto")),
            Error::PoolExhausted { .. } => (30, Some("raise Config::pool_bytes")),
            Error::ForeignPoolBuffer { .. } => {
                (31, Some("allocate it with this communicator's alloc_symmetric"))
            }
            Error::PoolMismatch { .. } => (32, Some("same sequence of alloc_symmetric calls")),
            Error::CallsExhausted { .. } => (33, Some("create a new communicator")),
        }
    }

    fn every_error() -> Vec<Error> {
        let code = cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        vec![
            Error::DriverUnavailable {
                detail: "libcuda.so.1: cannot open shared object file".into(),
            },
            Error::NoDevice,
            Error::DeviceNotFound { ordinal: 3, count: 1 },
            Error::Cuda {
                call: "cuMemCreate",
                source: DriverError(code),
            },
            Error::KernelsUnavailable,
            Error::Unsupported {
                ordinal: 0,
                reason: "compute capability 7.5 is below 8.0".into(),
            },
            Error::InvalidWorldSize {
                world: 9,
                reason: "at most 8 ranks".into(),
            },
            Error::InvalidConfig("max_blocks_per_rank must be in 1..=64, got 0".into()),
            Error::Empty,
            Error::LengthMismatch { input: 4, output: 5 },
            Error::ExceedsCapacity {
                bytes: 10,
                capacity: 4,
            },
            Error::Misaligned {
                which: "input",
                address: 0x7f00_0000_0004,
            },
            Error::WrongDevice {
                which: "stream",
                expected: 0,
                found: 1,
            },
            Error::PeerTimeout {
                rank: 0,
                peer: 1,
                phase: BarrierPhase::Arrival,
                timeout: Duration::from_secs(10),
            },
            Error::PeerSetupFailed {
                step: "mapping",
                rank: Some(2),
                reason: "cuMemMap failed".into(),
            },
            Error::Poisoned {
                cause: Box::new(Error::PeerTimeout {
                    rank: 1,
                    peer: 0,
                    phase: BarrierPhase::Unknown(9),
                    timeout: Duration::from_millis(1500),
                }),
            },
            Error::StreamOrder {
                source: DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_HANDLE),
            },
            Error::KernelFault { code: 0xdead },
            Error::from_cudarc_nccl("ncclAllReduce")(cudarc::nccl::result::NcclError(
                cudarc::nccl::sys::ncclResult_t::ncclInvalidUsage,
            )),
            Error::NcclUnavailable {
                reason: "the communicator was created without NCCL".into(),
            },
            Error::MissingSecret {
                address: "@job-1".into(),
                problem: "has no #secret".into(),
            },
            Error::PeerRefused {
                reason: "peer uid 1001 is not this job's uid 1000".into(),
            },
            Error::Bootstrap {
                reason: "bind @job-1: address in use".into(),
            },
            Error::Diverged {
                rank: 0,
                peer: 2,
                this_call: "one_shot of 1000 f32 elements".into(),
                peer_call: "one_shot of 1001 f32 elements".into(),
            },
            Error::InvalidTuning {
                table: "tuning.json".into(),
                problem: TuningProblem::WrongVersion {
                    found: 9,
                    supported: 1,
                },
            },
            Error::TuningMismatch {
                rank: 1,
                ours: "the published starting points".into(),
                theirs: "tuning table 0123abcd".into(),
            },
            Error::CountsMismatch { rank: 0, peer: 1 },
            Error::InvalidCollective {
                call: "all_gather_v",
                reason: "counts has 3 entries, the world is 4".into(),
            },
            Error::InvalidShape {
                what: "weight",
                reason: "has 4095 elements, hidden is 4096".into(),
            },
            Error::MulticastUnavailable {
                reason: "NCCL_NVLS_ENABLE=0 vetoes it".into(),
            },
            Error::PoolExhausted {
                requested: 4096,
                largest: 256,
                free: 512,
                capacity: 1024,
            },
            Error::ForeignPoolBuffer {
                expected: 1,
                found: 2,
            },
            Error::PoolMismatch { rank: 0, peer: 3 },
            Error::CallsExhausted { calls: (1 << 48) - 1 },
        ]
    }

    #[test]
    fn every_variant_displays_in_human_form_with_its_hint() {
        let errors = every_error();
        let mut seen = [false; VARIANTS];
        for e in &errors {
            let (index, hint) = variant(e);
            seen[index] = true;
            let text = e.to_string();
            // Printed so that `cargo test -- --nocapture` shows every message as users see it.
            println!("{text}");
            assert!(!text.trim().is_empty(), "variant {index}: empty message");
            // No Debug form: no `Name { field: .. }`, no `DriverError(..)` tuple.
            assert!(
                !text.contains('{') && !text.contains('}'),
                "variant {index}: {text}"
            );
            assert!(!text.contains("DriverError"), "variant {index}: {text}");
            // A string continued without `\` keeps the next line's indentation.
            assert!(
                !text.contains("   "),
                "variant {index} has a run of spaces: {text}"
            );
            if let Some(hint) = hint {
                assert!(
                    text.contains(hint),
                    "variant {index} lacks its hint {hint:?}: {text}"
                );
            }
        }
        let missing: Vec<usize> = (0..VARIANTS).filter(|&i| !seen[i]).collect();
        assert!(missing.is_empty(), "variants not constructed: {missing:?}");
        // The driver code by name, without asking the (absent) driver for a description.
        assert!(errors[3].to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"));
        assert!(errors[16].to_string().contains("CUDA_ERROR_INVALID_HANDLE"));
        // A poisoned communicator says why, with the cause's own words.
        assert!(errors[15].to_string().contains("barrier phase 9"));
    }

    #[test]
    fn messages_say_what_to_do() {
        let e = Error::ExceedsCapacity {
            bytes: 10,
            capacity: 4,
        };
        assert!(e.to_string().contains("capacity_bytes"));
        assert!(Error::NoDevice.is_no_gpu() && !Error::KernelsUnavailable.is_no_gpu());
        assert!(Error::DeviceNotFound { ordinal: 3, count: 1 }.is_no_gpu());
        // What to do for each way of depending on the crate, and how to make it a build error.
        let k = Error::KernelsUnavailable.to_string();
        for fix in [
            "path dependency",
            "scripts/install-nvcc.sh",
            "git or registry dependency",
            "NVCC=",
            "PATH",
            "require-kernels",
        ] {
            assert!(k.contains(fix), "{fix:?} missing from {k}");
        }
        let e = Error::PeerSetupFailed {
            step: "mapping",
            rank: None,
            reason: "x".into(),
        };
        assert!(!e.to_string().contains("18446744073709551615"), "{e}");
        assert_eq!(e.to_string(), "setup step 'mapping' failed in the group: x");
        let p = Error::Poisoned {
            cause: Box::new(Error::KernelFault { code: 7 }),
        };
        assert!(matches!(&p, Error::Poisoned { cause } if matches!(**cause, Error::KernelFault { code: 7 })));
        assert!(std::error::Error::source(&p).is_some());
    }

    #[test]
    fn question_mark_converts_cudarc_errors() {
        use cudarc::driver::sys::CUresult as Code;
        fn driver() -> Result<()> {
            Err(DriverError(Code::CUDA_ERROR_OUT_OF_MEMORY))?;
            Ok(())
        }
        fn nccl() -> Result<()> {
            Err(cudarc::nccl::result::NcclError(
                cudarc::nccl::sys::ncclResult_t::ncclInvalidArgument,
            ))?;
            Ok(())
        }
        let e = driver().unwrap_err();
        assert!(matches!(
            e,
            Error::Cuda {
                source: DriverError(Code::CUDA_ERROR_OUT_OF_MEMORY),
                ..
            }
        ));
        assert!(e.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"), "{e}");
        let e = nccl().unwrap_err();
        assert!(
            matches!(&e, Error::Nccl { detail, .. } if detail.contains("ncclInvalidArgument")),
            "{e}"
        );
    }
}
