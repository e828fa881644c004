//! # symm-allreduce
//!
//! Fast single-node all-reduce for tensor-parallel inference: low-latency, one-shot,
//! two-shot and zero-copy in-place CUDA kernels over symmetric VMM buffers that every rank
//! maps from every peer, launched through [`cudarc`], with NCCL as the fallback where they
//! do not win. Sums `f32`, `half::f16` and `half::bf16` with fp32 accumulation in absolute
//! rank order, so every rank gets bit-identical output, and every peer-kernel algorithm gives
//! the same bits.
//!
//! ```no_run
//! use symm_allreduce::{Communicator, Config};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ctx = symm_allreduce::context(0)?; // never panics without a driver or device
//! // Two "virtual ranks" on one GPU; with several GPUs pass one context per device.
//! let comms = Communicator::local_group(&[ctx.clone(), ctx.clone()], Config::default())?;
//! let streams = [ctx.new_stream()?, ctx.new_stream()?];
//! let inputs = [streams[0].clone_htod(&[1.0f32; 1000])?, streams[1].clone_htod(&[2.0f32; 1000])?];
//! let mut outputs = [streams[0].alloc_zeros::<f32>(1000)?, streams[1].alloc_zeros::<f32>(1000)?];
//! for r in 0..2 {
//!     comms[r].all_reduce(&inputs[r], &mut outputs[r], &streams[r])?;
//! }
//! for r in 0..2 {
//!     comms[r].synchronize(&streams[r])?; // also reports a peer timeout
//!     assert!(streams[r].clone_dtoh(&outputs[r])?.iter().all(|&x| x == 3.0));
//! }
//! # Ok(()) }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod backend;
mod bootstrap;
mod communicator;
mod config;
mod digest;
mod driver;
mod dtype;
mod error;
mod events;
mod kernels;
mod nccl;
mod plan;
mod setup;
mod symmetric;
mod topology;
mod wire;

#[doc(hidden)]
pub use bootstrap::{fds::gather_fds_over_abstract_sockets as __exchange_fds, frames as __wire};
/// The message encoding, for symm-bench (not a stable API).
#[doc(hidden)]
pub mod __codec {
    pub use crate::wire::{Reader, Wire, Writer};
}
pub use bootstrap::{
    Bootstrap, LocalHub, NcclBootstrap, PeerCheck, PeerCredentials, SocketStore, StoreAddress, StoreOptions,
};
pub use communicator::{Communicator, SymmetricTensor, LOG_ENV};
pub use config::{
    validate_world, Algorithm, Config, Crossovers, FusedCrossovers, Measured, Multicast, TuningProblem,
    TuningTable, CHECK_ENV, NCCL_WINDOWS_ENV, TUNING_ENV, TUNING_FORMAT, TUNING_OLDEST_VERSION,
    TUNING_VERSION, VERSION,
};
pub use driver::probe::{context, device_count};
pub use dtype::{DType, Element, Gatherable};
pub use error::{BarrierPhase, Error, Result};
/// The `tracing` target of the setup events and spans (see [`Communicator`]).
pub use events::TARGET as TRACING_TARGET;
pub use kernels::abi::MAX_RANKS;
pub use kernels::norm_abi::MAX_HIDDEN;
pub use kernels::{embedded_fatbin, embedded_ptx, kernels_available, ptxas_report};
pub use nccl::{nccl_group, nccl_library, nccl_teardown_failures, NcclLibraryInfo, SharedNcclComm};
pub use plan::{Limits, PathDecision, Plan};
#[doc(hidden)]
pub use symmetric::multicast::{probe_attribute_only as __multicast_probe, VETOES as __MULTICAST_VETOES};
pub use symmetric::Layout;
pub use topology::{LinkKind, PeerDecision, PeerLink, RankPlacement, Topology};

/// Re-export of the cudarc this crate is built against (use its types for streams and
/// buffers so that they match).
pub use cudarc;
/// Re-export of the `half` crate whose `f16` and `bf16` are this crate's 16-bit [`Element`]
/// types (and cudarc's and candle's).
pub use half;

// The README's Rust examples compile (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
