//! # symm-allreduce
//!
//! Fast single-node all-reduce for tensor-parallel inference: one-shot and two-shot CUDA
//! kernels over symmetric VMM buffers that every rank maps from every peer, launched through
//! [`cudarc`]. Sums `f32`, `half::f16` and `half::bf16` with fp32 accumulation in absolute
//! rank order, so every rank gets bit-identical output, and one-shot and two-shot agree bit
//! for bit.
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
#![warn(missing_docs)]

mod bootstrap;
mod communicator;
mod driver;
mod dtype;
mod error;
mod kernels;
mod nvtx;
mod plan;
mod symmetric;
mod topology;

#[doc(hidden)]
pub use bootstrap::{nccl::gather_fds_over_abstract_sockets as __exchange_fds, wire as __wire};
pub use bootstrap::{
    nccl_library, nccl_teardown_failures, Bootstrap, LocalHub, NcclBootstrap, NcclLibraryInfo, PeerCheck,
    PeerCredentials, SocketStore, StoreAddress, StoreOptions,
};
pub use communicator::{Communicator, LOG_ENV};
pub use driver::probe::{context, device_count};
pub use dtype::{DType, Element};
pub use error::{BarrierPhase, Error, Result};
pub use kernels::{embedded_ptx, kernels_available, ptxas_report};
pub use plan::{
    decide_path, plan_all_reduce, validate_call, validate_world, Algorithm, CallShape, Config, Limits,
    PathDecision, PathFacts, Plan, MAX_BLOCKS, MAX_RANKS, THREADS_PER_BLOCK,
};
pub use symmetric::Layout;
pub use topology::{nvml_uuid_string, LinkKind, PeerDecision, PeerLink, RankPlacement, Topology};

/// Re-export of the cudarc this crate is built against (use its types for streams and
/// buffers so that they match).
pub use cudarc;
