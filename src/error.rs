//! The crate's one error type.

use std::time::Duration;

use cudarc::driver::DriverError;

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
    #[error("CUDA call {call} failed: {source}")]
    Cuda {
        /// The driver function (or step) that failed.
        call: &'static str,
        /// The driver's code.
        #[source]
        source: DriverError,
    },

    /// The kernels were not compiled into this build.
    #[error(
        "the all-reduce kernels are not in this build: nvcc was not found when the crate was compiled. \
         Install CUDA (or run scripts/install-nvcc.sh), set NVCC if needed, and rebuild"
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
         call failed ({source}); keep one stream per communicator while capturing a graph, or synchronize the \
         previous stream before switching"
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

    /// The bootstrap channel could not be set up here (socket, address, or OS error).
    #[error("bootstrap failed on this rank: {reason}")]
    Bootstrap {
        /// What failed, and what to do about it.
        reason: String,
    },
}

fn on_rank(rank: Option<usize>) -> String {
    match rank {
        Some(r) => format!("on rank {r}"),
        None => "in the group".to_string(),
    }
}

impl Error {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_is_send_sync_static() {
        fn assert_bounds<T: Send + Sync + 'static + std::error::Error>() {}
        assert_bounds::<Error>();
    }

    #[test]
    fn messages_say_what_to_do() {
        let e = Error::ExceedsCapacity {
            bytes: 10,
            capacity: 4,
        };
        assert!(e.to_string().contains("capacity_bytes"));
        assert!(Error::KernelsUnavailable.to_string().contains("install-nvcc"));
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
}
