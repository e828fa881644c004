//! `Communicator`: one rank of an all-reduce group. Collective setup (each step voted, with
//! the NCCL fallback), validation, routing, and the launch.

use std::cell::RefCell;
use std::ffi::c_void;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result, sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::bootstrap::nccl::{self, Fallback, OwnedNcclComm, RawComm};
use crate::bootstrap::{vote, vote_soft, Bootstrap, LocalHub, NcclBootstrap};
use crate::driver::host::ErrorWord;
use crate::driver::vmm::{self, Allocation};
use crate::dtype::{DType, Element};
use crate::error::{BarrierPhase, CudaResultExt, Error, Result};
use crate::kernels::{Kernels, SymmArgs};
use crate::nvtx;
use crate::plan::{
    self, Algorithm, CallShape, Config, Limits, PathDecision, PathFacts, Plan, THREADS_PER_BLOCK,
};
use crate::symmetric::{Layout, Workspace, DATA_OFFSET, SIGNAL_OFFSET, STATE_OFFSET};
use crate::topology::{self, RankPlacement, Topology};

const ERROR_PEER_TIMEOUT: u32 = 1;

/// Why a communicator made by [`Communicator::new`] or [`Communicator::local_group`] has no
/// NCCL fallback.
const NO_NCCL: &str = "the communicator was created without NCCL (Communicator::new or local_group)";

/// Environment variable: when set (and not `0`), every rank prints its
/// [`Communicator::describe`] report to stderr once set up.
pub const LOG_ENV: &str = "SYMM_ALLREDUCE_LOG";

/// The bound on each setup exchange: the configured timeout, but at least 30 s (setup steps
/// such as loading kernels or initialising NCCL take seconds on a busy machine).
fn setup_timeout(config: &Config) -> Duration {
    config.timeout.max(Duration::from_secs(30))
}

/// The symmetric workspace and the kernels that use it.
#[derive(Debug)]
struct PeerKernels {
    // Field order is drop order: unmap before freeing the error word.
    workspace: Workspace,
    error: ErrorWord,
    kernels: Kernels,
    args: SymmArgs,
}

/// A plain device buffer standing in for the symmetric buffer when every call goes to NCCL,
/// so that the zero-copy API keeps working.
struct StandIn {
    buffer: CudaSlice<u8>,
    ptr: u64,
}

impl std::fmt::Debug for StandIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StandIn({:#x}, {} bytes)", self.ptr, self.buffer.len())
    }
}

impl StandIn {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<StandIn> {
        let stream = ctx.default_stream();
        let buffer = stream.alloc_zeros::<u8>(bytes).during("cuMemAlloc")?;
        let ptr = {
            let (ptr, _sync) = buffer.device_ptr(&stream);
            ptr
        };
        stream.synchronize().during("cuStreamSynchronize")?;
        Ok(StandIn { buffer, ptr })
    }
}

/// One rank of an all-reduce group.
///
/// A communicator is `Send` but not `Sync`: it can move to another thread, but two threads
/// can never drive one rank at the same time (the compiler refuses to share it):
///
/// ```compile_fail
/// fn shared_between_threads<T: Sync>() {}
/// shared_between_threads::<symm_allreduce::Communicator>();
/// ```
///
/// Every call is asynchronous on the stream it is given. Calls that the peer kernels take
/// are CUDA-graph capturable: no allocation, no host synchronisation and no driver call other
/// than the kernel launch. Calls routed to NCCL ([`Communicator::path`] says which) are what
/// `ncclAllReduce` is.
#[derive(Debug)]
pub struct Communicator {
    // Field order is drop order: after `Drop` synchronised, the workspace is unmapped first,
    // then the stand-in buffer is freed, then the NCCL communicator is aborted.
    peer: Option<PeerKernels>,
    standin: Option<StandIn>,
    nccl: Option<Fallback>,
    ctx: Arc<CudaContext>,
    rank: usize,
    world: usize,
    limits: Limits,
    layout: Layout,
    config: Config,
    topology: Topology,
    /// Why the peer kernels are not set up (then every call goes to NCCL).
    peer_unavailable: Option<String>,
    /// Why there is no NCCL fallback.
    nccl_unavailable: Option<String>,
    poisoned: RefCell<Option<String>>,
}

/// What the collective setup produced, before the NCCL fallback is attached.
struct Setup {
    peer: Option<PeerKernels>,
    standin: Option<StandIn>,
    ctx: Arc<CudaContext>,
    rank: usize,
    world: usize,
    limits: Limits,
    layout: Layout,
    config: Config,
    topology: Topology,
    peer_unavailable: Option<String>,
}

impl Communicator {
    /// Creates a group of `contexts.len()` ranks in this process, rank r on `contexts[r]`.
    /// Ranks may share a device ("virtual ranks": each has its own mapping of every peer's
    /// memory and its own stream, and the kernels really synchronise across grids).
    ///
    /// Each rank is set up by [`Communicator::new`] on its own thread over an in-process
    /// [`LocalHub`]: every allocation is exported as a POSIX file descriptor and imported by
    /// every other rank, the same path separate processes take. There is no NCCL fallback:
    /// `Config::nccl_above_bytes` is ignored and a call above `capacity_bytes` is an error.
    pub fn local_group(contexts: &[Arc<CudaContext>], config: Config) -> Result<Vec<Communicator>> {
        config.validate()?;
        plan::validate_world(contexts.len())?;
        let hub = LocalHub::new(contexts.len(), setup_timeout(&config));
        let results: Vec<Result<Communicator>> = std::thread::scope(|s| {
            let handles: Vec<_> = contexts
                .iter()
                .enumerate()
                .map(|(rank, ctx)| {
                    let hub = hub.rank(rank);
                    let config = config.clone();
                    s.spawn(move || Communicator::new(&hub, ctx.clone(), config))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::PeerSetupFailed {
                            step: "thread",
                            rank: usize::MAX,
                            reason: "a setup thread panicked".into(),
                        })
                    })
                })
                .collect()
        });
        // Report a rank's own error in preference to the echoes of it on other ranks.
        let mut comms = Vec::with_capacity(results.len());
        let mut errors = Vec::new();
        for r in results {
            match r {
                Ok(c) => comms.push(c),
                Err(e) => errors.push(e),
            }
        }
        if !errors.is_empty() {
            let own = errors
                .iter()
                .position(|e| !matches!(e, Error::PeerSetupFailed { .. }));
            return Err(errors.swap_remove(own.unwrap_or(0)));
        }
        Ok(comms)
    }

    /// Collective constructor: every rank of `bootstrap` calls this at the same time with its
    /// own device context and the same `config`. Each step ends in a vote, so when any rank
    /// fails, all ranks return an error (none is left waiting).
    ///
    /// There is no NCCL fallback (see [`Communicator::with_nccl_fallback`]): the peer kernels
    /// take every call, so setup fails where they cannot run (no peer access, several hosts).
    pub fn new(bootstrap: &dyn Bootstrap, ctx: Arc<CudaContext>, config: Config) -> Result<Communicator> {
        let setup = setup(bootstrap, ctx, config, Err(NO_NCCL), Ok(()))?;
        Ok(Communicator::assemble(setup, None, Some(NO_NCCL.to_string())))
    }

    /// Builds a communicator over an NCCL communicator the application already has (one
    /// process per GPU, as mistral.rs or vLLM run), taking ownership of it. Must be called by
    /// every rank of `comm`, each with the same `config`.
    ///
    /// Setup exchanges go through `comm` (bytes all-gathered through device memory; the VMM
    /// handles, as file descriptors, over per-rank abstract Unix sockets). If the peer kernels
    /// cannot be set up on every rank (ranks on several hosts, no peer access, a failed
    /// mapping), all ranks agree to send every call to NCCL and say why
    /// ([`Communicator::describe`]). Calls above `Config::nccl_above_bytes` or
    /// `Config::capacity_bytes` go to NCCL as well; [`Communicator::path`] tells which path a
    /// size takes. NCCL runs on `comm`'s stream, ordered after and before the caller's stream
    /// by two events (none when the caller passes `comm.stream()`).
    pub fn from_nccl(comm: cudarc::nccl::Comm, config: Config) -> Result<Communicator> {
        let ctx = comm.context().clone();
        let events = ctx
            .new_event(None)
            .and_then(|fork| Ok((fork, ctx.new_event(None)?)))
            .during("cuEventCreate");
        let precheck = match &events {
            Ok(_) => Ok(()),
            Err(e) => Err(Error::Bootstrap {
                reason: e.to_string(),
            }),
        };
        let comm = OwnedNcclComm::new(comm);
        let setup = {
            let bootstrap = NcclBootstrap::new(comm.get(), setup_timeout(&config));
            setup(&bootstrap, ctx, config, Ok(()), precheck)?
        };
        let (fork, join) = events?;
        Ok(Communicator::assemble(
            setup,
            Some(Fallback::Cudarc { comm, fork, join }),
            None,
        ))
    }

    /// [`Communicator::new`] plus an NCCL communicator of its own for the fallback, created
    /// through `bootstrap` (rank 0 makes the unique id). NCCL is loaded as `libnccl.so` or,
    /// failing that, `libnccl.so.2`. If NCCL is missing or cannot initialise (for example two
    /// ranks on one GPU, which NCCL refuses), every rank goes on without the fallback and
    /// [`Communicator::describe`] says why; that is an error only when the fallback is needed
    /// (the peer kernels cannot be set up, or `Config::algorithm` is `Nccl`). NCCL runs on the
    /// caller's stream.
    pub fn with_nccl_fallback(
        bootstrap: &dyn Bootstrap,
        ctx: Arc<CudaContext>,
        config: Config,
    ) -> Result<Communicator> {
        let (fallback, why) = match nccl_through(bootstrap, &ctx, setup_timeout(&config))? {
            Ok(comm) => (Some(Fallback::Raw(comm)), None),
            Err(e) => (None, Some(format!("NCCL is unavailable: {e}"))),
        };
        let nccl = match &why {
            Some(w) => Err(w.as_str()),
            None => Ok(()),
        };
        let setup = setup(bootstrap, ctx, config, nccl, Ok(()))?;
        Ok(Communicator::assemble(setup, fallback, why))
    }

    fn assemble(s: Setup, nccl: Option<Fallback>, nccl_unavailable: Option<String>) -> Communicator {
        let nccl_unavailable = match nccl {
            Some(_) => None,
            None => Some(nccl_unavailable.unwrap_or_else(|| NO_NCCL.to_string())),
        };
        let comm = Communicator {
            peer: s.peer,
            standin: s.standin,
            nccl,
            ctx: s.ctx,
            rank: s.rank,
            world: s.world,
            limits: s.limits,
            layout: s.layout,
            config: s.config,
            topology: s.topology,
            peer_unavailable: s.peer_unavailable,
            nccl_unavailable,
            poisoned: RefCell::new(None),
        };
        if std::env::var(LOG_ENV).is_ok_and(|v| !v.is_empty() && v != "0") {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "{}", comm.describe());
        }
        comm
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The device this rank runs on.
    pub fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The settings it was created with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The agreed per-rank block limits (zero when the peer kernels are not set up).
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Sizes of this rank's symmetric allocation (when every call goes to NCCL, only
    /// `data_bytes` is meaningful: the size of [`symmetric_buffer`](Self::symmetric_buffer)).
    pub fn layout(&self) -> Layout {
        match &self.peer {
            Some(p) => p.workspace.layout(),
            None => self.layout,
        }
    }

    /// The kernel grid a call of `len` elements of `dtype` would use if the peer kernels
    /// take it (see [`path`](Self::path) for whether they do).
    pub fn plan(&self, len: usize, dtype: DType, algorithm: Algorithm) -> Plan {
        plan::plan_all_reduce(len, dtype, self.world, self.limits, &self.config, algorithm)
    }

    /// Where a call of `len` elements of `dtype` goes (one-shot, two-shot or NCCL) and why;
    /// an error where the call would be refused (over the capacity without NCCL, or NCCL
    /// asked for without a fallback). Every rank decides the same.
    pub fn path(&self, len: usize, dtype: DType, algorithm: Algorithm) -> Result<PathDecision> {
        plan::decide_path(len, dtype, &self.config, algorithm, self.facts())
    }

    fn facts(&self) -> PathFacts<'_> {
        PathFacts {
            world: self.world,
            limits: self.limits,
            peer_kernels: self.peer_unavailable.as_deref().map_or(Ok(()), Err),
            nccl: self.nccl_unavailable.as_deref().map_or(Ok(()), Err),
        }
    }

    /// Placement of every rank and the links between their devices, as probed at setup.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Whether the symmetric workspace is set up (otherwise every call goes to NCCL).
    pub fn has_peer_kernels(&self) -> bool {
        self.peer.is_some()
    }

    /// Why the peer kernels are not set up, if they are not.
    pub fn peer_kernels_unavailable(&self) -> Option<&str> {
        self.peer_unavailable.as_deref()
    }

    /// Whether calls can go to NCCL.
    pub fn has_nccl_fallback(&self) -> bool {
        self.nccl.is_some()
    }

    /// Why there is no NCCL fallback, if there is none.
    pub fn nccl_unavailable(&self) -> Option<&str> {
        self.nccl_unavailable.as_deref()
    }

    /// A report of the setup: topology, mode, and the path each message size takes (bf16).
    /// Printed by every rank at setup when `SYMM_ALLREDUCE_LOG=1`.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "symm-allreduce rank {} of {} on device {}\n{}\n",
            self.rank,
            self.world,
            self.device(),
            self.topology.summary()
        );
        s += &match &self.peer_unavailable {
            None => format!(
                "peer kernels: on ({} one-shot / {} two-shot blocks per rank, capacity {} bytes)\n",
                self.limits.one_shot_blocks, self.limits.two_shot_blocks, self.config.capacity_bytes
            ),
            Some(why) => format!("peer kernels: off, every call goes to NCCL: {why}\n"),
        };
        s += &match (&self.nccl, &self.nccl_unavailable) {
            (Some(f), _) => format!("NCCL fallback: {}\n", f.describe()),
            (None, Some(why)) => format!("NCCL fallback: none ({why})\n"),
            (None, None) => "NCCL fallback: none\n".to_string(),
        };
        let sizes = [
            4usize << 10,
            64 << 10,
            512 << 10,
            1 << 20,
            4 << 20,
            16 << 20,
            64 << 20,
            256 << 20,
        ];
        for bytes in sizes {
            let line = match self.path(bytes / 2, DType::BF16, Algorithm::Auto) {
                Ok(p) => p.to_string(),
                Err(e) => format!("refused: {e}"),
            };
            s += &format!("  {:>9} bytes bf16 -> {line}\n", bytes);
        }
        s.pop();
        s
    }

    /// Sums `input` over all ranks into `output` (out of place), choosing the path by size
    /// (see [`path`](Self::path)). All ranks must make the same sequence of calls with the
    /// same lengths.
    pub fn all_reduce<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.all_reduce_with(input, output, stream, Algorithm::Auto)
    }

    /// [`all_reduce`](Self::all_reduce) with a forced algorithm (`Auto` = the configured
    /// choice; `Nccl` needs a fallback).
    pub fn all_reduce_with<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &CudaStream,
        algorithm: Algorithm,
    ) -> Result<()> {
        self.check_usable()?;
        let shape = CallShape {
            dtype: T::DTYPE,
            input_len: input.len(),
            output_len: output.len(),
            input_addr: 0,
            output_addr: 0,
            input_device: input.stream().context().ordinal(),
            output_device: output.stream().context().ordinal(),
            stream_device: stream.context().ordinal(),
        };
        plan::validate_lengths(&shape)?;
        let path = self.path(shape.input_len, T::DTYPE, algorithm)?;
        let (in_ptr, _read) = input.device_ptr(stream);
        let (out_ptr, _write) = output.device_ptr_mut(stream);
        self.run(
            CallShape {
                input_addr: in_ptr,
                output_addr: out_ptr,
                ..shape
            },
            &path,
            stream,
        )
    }

    /// Sums `buffer` over all ranks in place.
    pub fn all_reduce_in_place<T: Element>(
        &self,
        buffer: &mut impl DevicePtrMut<T>,
        stream: &CudaStream,
        algorithm: Algorithm,
    ) -> Result<()> {
        self.check_usable()?;
        let len = buffer.len();
        let device = buffer.stream().context().ordinal();
        let stream_device = stream.context().ordinal();
        plan::validate_lengths(&CallShape::in_place(T::DTYPE, len, 0, device, stream_device))?;
        let path = self.path(len, T::DTYPE, algorithm)?;
        let (ptr, _write) = buffer.device_ptr_mut(stream);
        let shape = CallShape::in_place(T::DTYPE, len, ptr, device, stream_device);
        self.run(shape, &path, stream)
    }

    /// Device address of this rank's symmetric buffer: [`Layout::data_bytes`] bytes (at least
    /// `Config::capacity_bytes`), 16-byte aligned, mapped by every peer. Write the data to
    /// reduce there (from your own kernel's epilogue, or with
    /// [`copy_to_symmetric`](Self::copy_to_symmetric)), then call
    /// [`all_reduce_symmetric`](Self::all_reduce_symmetric), which skips the copy-in. (When
    /// every call goes to NCCL this is a plain buffer of the same size, reduced by NCCL in
    /// place.)
    pub fn symmetric_buffer(&self) -> u64 {
        match (&self.peer, &self.standin) {
            (Some(p), _) => p.workspace.symmetric_buffer(self.rank),
            (None, Some(s)) => s.ptr,
            (None, None) => 0,
        }
    }

    /// Sums the first `len` elements of every rank's symmetric buffer, in place, zero-copy:
    /// each rank reduces a 1/W slice from all peers and writes the sum into every rank's
    /// buffer, with a start and an end barrier. The buffer may be rewritten as soon as the
    /// call is complete on the stream. Same bits as [`all_reduce`](Self::all_reduce). Sizes
    /// that [`path`](Self::path) sends to NCCL are reduced by NCCL in place.
    pub fn all_reduce_symmetric<T: Element>(&self, len: usize, stream: &CudaStream) -> Result<()> {
        self.check_usable()?;
        let ptr = self.symmetric_buffer();
        plan::validate_call(
            &CallShape::in_place(T::DTYPE, len, ptr, self.device(), stream.context().ordinal()),
            self.device(),
            self.config.capacity_bytes,
        )?;
        let path = self.path(len, T::DTYPE, Algorithm::Auto)?;
        match (&self.peer, path.algorithm) {
            (Some(peer), algorithm) if algorithm != Algorithm::Nccl => {
                let plan = self.plan(len, T::DTYPE, Algorithm::TwoShot);
                let _range = nvtx::Range::new(|| {
                    format!(
                        "symm all_reduce_symmetric {} {} B",
                        T::DTYPE,
                        len * T::DTYPE.size()
                    )
                });
                self.launch(peer, peer.kernels.in_place(T::DTYPE), plan, ptr, ptr, len, stream)
            }
            _ => self.nccl()?.all_reduce(ptr, ptr, len, T::DTYPE, stream),
        }
    }

    /// Copies `src` to the start of this rank's symmetric buffer (asynchronously, capturable).
    pub fn copy_to_symmetric<T: Element>(&self, src: &impl DevicePtr<T>, stream: &CudaStream) -> Result<()> {
        self.check_symmetric_copy::<T>(src.len(), src.stream().context().ordinal(), stream)?;
        let (ptr, _read) = src.device_ptr(stream);
        self.copy(self.symmetric_buffer(), ptr, src.len() * T::DTYPE.size(), stream)
    }

    /// Copies the first `dst.len()` elements of this rank's symmetric buffer into `dst`.
    pub fn copy_from_symmetric<T: Element>(
        &self,
        dst: &mut impl DevicePtrMut<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.check_symmetric_copy::<T>(dst.len(), dst.stream().context().ordinal(), stream)?;
        let len = dst.len();
        let (ptr, _write) = dst.device_ptr_mut(stream);
        self.copy(ptr, self.symmetric_buffer(), len * T::DTYPE.size(), stream)
    }

    /// Lengths and devices as for a call, against the symmetric buffer's size (copies need
    /// no alignment).
    fn check_symmetric_copy<T: Element>(&self, len: usize, device: usize, stream: &CudaStream) -> Result<()> {
        let shape = CallShape::in_place(T::DTYPE, len, 0, device, stream.context().ordinal());
        plan::validate_call(&shape, self.device(), self.layout.data_bytes)
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize, stream: &CudaStream) -> Result<()> {
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        // SAFETY: both ranges are device memory of this rank's device: one is the symmetric
        // buffer (or its stand-in, of the same size), the other a live cudarc buffer of
        // `bytes` bytes; `check_symmetric_copy` validated the devices and that `bytes` fits.
        let code = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream()) };
        crate::driver::check(code, "cuMemcpyDtoDAsync")
    }

    /// Launches the body-less kernel with exactly the grid a call of `len` elements would
    /// use: the benchmark's floor for launch and graph-replay cost.
    #[doc(hidden)]
    pub fn launch_empty(
        &self,
        len: usize,
        dtype: DType,
        stream: &CudaStream,
        algorithm: Algorithm,
    ) -> Result<()> {
        let peer = self.peer_kernels()?;
        let plan = self.plan(len, dtype, algorithm);
        self.launch(peer, peer.kernels.empty(), plan, 0, 0, len, stream)
    }

    /// Waits for `stream` and reports a timeout any earlier call hit (and an error NCCL
    /// recorded, for a fallback this crate created). A peer kernel's wait is bounded by
    /// `Config::timeout`; an NCCL call's is NCCL's own business.
    pub fn synchronize(&self, stream: &CudaStream) -> Result<()> {
        stream.synchronize().during("cuStreamSynchronize")?;
        if let Some(Fallback::Raw(c)) = &self.nccl {
            c.async_error()?;
        }
        self.check_usable()
    }

    /// Returns the error that made this communicator unusable, if any, without a CUDA call.
    pub fn check_usable(&self) -> Result<()> {
        if let Some(reason) = self.poisoned.borrow().as_ref() {
            return Err(Error::Poisoned {
                reason: reason.clone(),
            });
        }
        let Some(peer) = &self.peer else {
            return Ok(());
        };
        let code = peer.error.read();
        if code == 0 {
            return Ok(());
        }
        let err = decode_error(code, self.rank, self.config.timeout);
        *self.poisoned.borrow_mut() = Some(err.to_string());
        Err(err)
    }

    fn peer_kernels(&self) -> Result<&PeerKernels> {
        self.peer.as_ref().ok_or_else(|| Error::Unsupported {
            ordinal: self.device(),
            reason: format!(
                "the peer kernels are not set up: {}",
                self.peer_unavailable.as_deref().unwrap_or("unknown reason")
            ),
        })
    }

    fn nccl(&self) -> Result<&Fallback> {
        self.nccl.as_ref().ok_or_else(|| Error::NcclUnavailable {
            reason: self
                .nccl_unavailable
                .clone()
                .unwrap_or_else(|| NO_NCCL.to_string()),
        })
    }

    /// Validates placement for the chosen path and runs it.
    fn run(&self, shape: CallShape, path: &PathDecision, stream: &CudaStream) -> Result<()> {
        let _range = nvtx::Range::new(|| {
            format!(
                "symm all_reduce {} {} {} B",
                path.algorithm,
                shape.dtype,
                shape.input_len * shape.dtype.size()
            )
        });
        match path.plan {
            Some(plan) => {
                plan::validate_placement(&shape, self.device(), true)?;
                let peer = self.peer_kernels()?;
                let func = peer.kernels.get(plan.algorithm, shape.dtype);
                self.launch(
                    peer,
                    func,
                    plan,
                    shape.input_addr,
                    shape.output_addr,
                    shape.input_len,
                    stream,
                )
            }
            None => {
                plan::validate_placement(&shape, self.device(), false)?;
                self.nccl()?.all_reduce(
                    shape.input_addr,
                    shape.output_addr,
                    shape.input_len,
                    shape.dtype,
                    stream,
                )
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        peer: &PeerKernels,
        func: &cudarc::driver::CudaFunction,
        plan: Plan,
        input: u64,
        output: u64,
        len: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let mut input = input;
        let mut output = output;
        let mut n = len as u64;
        let mut args = peer.args;
        let mut params: [*mut c_void; 4] = [
            (&mut input as *mut u64).cast(),
            (&mut output as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
            (&mut args as *mut SymmArgs).cast(),
        ];
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        // SAFETY: the function comes from a live module of this context and takes exactly
        // (const T*, T*, u64, SymmArgs); `params` points at locals that outlive the call
        // (the driver copies them at launch). The addresses were validated: 16-byte aligned
        // device memory of this rank's device with `len` elements; the workspace outlives
        // the launch because Drop synchronises before unmapping.
        unsafe {
            result::launch_kernel(
                func.cu_function(),
                (plan.blocks, 1, 1),
                (plan.threads, 1, 1),
                0,
                stream.cu_stream(),
                &mut params,
            )
        }
        .during("cuLaunchKernel")
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Kernels may still read or signal through this rank's mappings; a peer stuck in a
        // barrier is bounded by the timeout. Errors cannot be reported from Drop.
        let _ = self.ctx.synchronize();
    }
}

/// What every rank tells the others before allocating anything.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hello {
    world: usize,
    device: [u8; 16],
    ordinal: usize,
    host_id: [u8; 16],
    config: [u64; CONFIG_WORDS],
    host: String,
}

const CONFIG_WORDS: usize = 7;
const HELLO_FIXED: usize = 8 + 16 + 8 + 16 + CONFIG_WORDS * 8;

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HELLO_FIXED + self.host.len());
        b.extend_from_slice(&(self.world as u64).to_le_bytes());
        b.extend_from_slice(&self.device);
        b.extend_from_slice(&(self.ordinal as u64).to_le_bytes());
        b.extend_from_slice(&self.host_id);
        for v in self.config {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(self.host.as_bytes());
        b
    }

    fn decode(b: &[u8]) -> Result<Hello> {
        if b.len() < HELLO_FIXED {
            return Err(malformed("hello"));
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let bytes16 = |i: usize| {
            let mut w = [0u8; 16];
            w.copy_from_slice(&b[i..i + 16]);
            w
        };
        Ok(Hello {
            world: word(0) as usize,
            device: bytes16(8),
            ordinal: word(24) as usize,
            host_id: bytes16(32),
            config: std::array::from_fn(|i| word(48 + 8 * i)),
            host: String::from_utf8_lossy(&b[HELLO_FIXED..]).into_owned(),
        })
    }
}

fn config_fingerprint(c: &Config) -> [u64; CONFIG_WORDS] {
    // Booleans share a word with the algorithm.
    let algorithm_and_flags = (c.peer_kernels as u64) << 8;
    [
        c.capacity_bytes as u64,
        algorithm_and_flags
            | match c.algorithm {
                Algorithm::Auto => 0,
                Algorithm::OneShot => 1,
                Algorithm::TwoShot => 2,
                Algorithm::Nccl => 3,
                Algorithm::LowLatency => 4,
            },
        c.one_shot_max_bytes.map_or(u64::MAX, |b| b as u64),
        c.max_blocks_per_rank as u64,
        c.timeout.as_nanos().min(u64::MAX as u128) as u64,
        c.nccl_above_bytes.map_or(u64::MAX, |b| b as u64),
        c.low_latency_max_bytes as u64,
    ]
}

fn malformed(what: &str) -> Error {
    Error::PeerSetupFailed {
        step: "bootstrap",
        rank: usize::MAX,
        reason: format!("malformed {what} message from a peer (mismatched crate versions?)"),
    }
}

/// Runs a setup step unless an earlier one failed, and votes on it. A failed vote is recorded
/// in `failed` (every rank records the same verdict, so every rank skips the same later
/// steps); a failed exchange is returned as the outer error.
fn soft_step<T>(
    bootstrap: &dyn Bootstrap,
    failed: &mut Option<Error>,
    step: &'static str,
    run: impl FnOnce() -> Result<T>,
) -> Result<Option<T>> {
    if failed.is_some() {
        return Ok(None);
    }
    match vote_soft(bootstrap, step, run())? {
        Ok(v) => Ok(Some(v)),
        Err(e) => {
            *failed = Some(e);
            Ok(None)
        }
    }
}

/// The collective setup every constructor runs. `nccl` says whether an NCCL fallback will be
/// attached: with one, a failure to set up the peer kernels makes every call go to NCCL;
/// without one, it is returned as the error. `precheck` is a local condition of the caller's
/// that joins the first vote.
fn setup(
    bootstrap: &dyn Bootstrap,
    ctx: Arc<CudaContext>,
    config: Config,
    nccl: std::result::Result<(), &str>,
    precheck: Result<()>,
) -> Result<Setup> {
    let rank = bootstrap.rank();
    let world = bootstrap.world();
    let local = precheck
        .and_then(|()| ctx.bind_to_thread().during("cuCtxSetCurrent"))
        .and_then(|()| config.validate())
        .and_then(|()| plan::validate_world(world))
        .and_then(|()| match (config.algorithm, nccl) {
            (Algorithm::Nccl, Err(why)) => Err(Error::NcclUnavailable {
                reason: format!("Config::algorithm is Nccl, but {why}"),
            }),
            _ => Ok(()),
        })
        .and_then(|()| ctx.uuid().during("cuDeviceGetUuid"));
    let uuid = vote(bootstrap, "device check", local)?;

    // Everyone checks everyone's world size and configuration, and learns where each rank
    // runs (host and device).
    let (host, host_id) = topology::this_host();
    let hello = Hello {
        world,
        device: uuid.bytes.map(|b| b as u8),
        ordinal: ctx.ordinal(),
        host_id,
        config: config_fingerprint(&config),
        host,
    };
    let hellos = bootstrap.all_gather(&hello.encode())?;
    let hellos: Vec<Hello> = hellos.iter().map(|b| Hello::decode(b)).collect::<Result<_>>()?;
    if hellos.len() != world {
        return Err(malformed("hello"));
    }
    for (q, h) in hellos.iter().enumerate() {
        if h.world != world {
            return Err(Error::InvalidWorldSize {
                world,
                reason: format!("rank {q} was created for a world of {}", h.world),
            });
        }
        if h.config != hello.config {
            return Err(Error::InvalidConfig(format!(
                "rank {q} uses a different Config; every rank must pass the same one"
            )));
        }
    }
    // Ranks sharing this device (their blocks must be resident together).
    let sharing = hellos
        .iter()
        .filter(|h| h.device == hello.device && h.host_id == hello.host_id)
        .count();
    let placements: Vec<RankPlacement> = hellos
        .into_iter()
        .map(|h| RankPlacement {
            host: h.host,
            host_id: h.host_id,
            device_uuid: h.device,
            ordinal: h.ordinal,
        })
        .collect();

    // Topology: every rank probes its row, everyone decides on the whole table.
    let row = topology::probe_links(&ctx, rank, &placements);
    let rows = bootstrap.all_gather(&topology::encode_links(&row))?;
    let mut links = Vec::with_capacity(world * world.saturating_sub(1));
    for r in &rows {
        links.extend(topology::decode_links(r, world).map_err(|_| malformed("topology"))?);
    }
    let topology = Topology {
        ranks: placements,
        links,
    };
    let decision = topology.decide();
    let mut failed = if !config.peer_kernels {
        Some(Error::InvalidConfig(
            "Config::peer_kernels is false: every call goes to NCCL, so the communicator needs an NCCL \
             fallback"
                .into(),
        ))
    } else if !decision.allowed {
        Some(Error::Unsupported {
            ordinal: ctx.ordinal(),
            reason: decision.reason.clone(),
        })
    } else {
        None
    };

    soft_step(bootstrap, &mut failed, "device check", || check_device(&ctx))?;

    // Kernels, residency limits and granularity: agree on the minimum grid and the
    // largest granularity.
    let loaded = soft_step(bootstrap, &mut failed, "kernels and limits", || {
        let kernels = Kernels::load(&ctx)?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .during("cuDeviceGetAttribute")? as usize;
        let (one, two) = kernels.blocks_per_sm(THREADS_PER_BLOCK)?;
        let limits = Limits::from_occupancy(one, two, sms, sharing, &config)?;
        Ok((kernels, limits, vmm::granularity(ctx.ordinal())?))
    })?;
    let mut limits = Limits {
        one_shot_blocks: 0,
        two_shot_blocks: 0,
    };
    let mut granularity = 4096;
    let mut kernels = None;
    if let Some((k, my_limits, my_granularity)) = loaded {
        let mut payload = Vec::with_capacity(24);
        for v in [
            my_limits.one_shot_blocks,
            my_limits.two_shot_blocks,
            my_granularity,
        ] {
            payload.extend_from_slice(&(v as u64).to_le_bytes());
        }
        limits = my_limits;
        granularity = my_granularity;
        for p in bootstrap.all_gather(&payload)? {
            let v = |i: usize| -> Result<usize> {
                let mut w = [0u8; 8];
                w.copy_from_slice(p.get(i * 8..i * 8 + 8).ok_or_else(|| malformed("limits"))?);
                Ok(u64::from_le_bytes(w) as usize)
            };
            limits = limits.min(Limits {
                one_shot_blocks: v(0)?,
                two_shot_blocks: v(1)?,
            });
            granularity = granularity.max(v(2)?);
        }
        kernels = Some(k);
    }
    let layout = Layout::new(
        config.capacity_bytes,
        config.low_latency_max_bytes,
        world,
        granularity,
    );

    // This rank's memory, exported for the peers.
    let own = soft_step(bootstrap, &mut failed, "allocation", || {
        let a = Allocation::create(ctx.ordinal(), layout.alloc_bytes)?;
        Ok((a.export_fd()?, a))
    })?;
    let fds = match &own {
        Some((fd, _)) => soft_step(bootstrap, &mut failed, "descriptor exchange", || {
            bootstrap.all_gather_fds(fd.as_fd())
        })?,
        None => None,
    };
    let own = own.map(|(fd, a)| {
        drop(fd);
        a
    });

    // Import and map every peer, zero this rank's signals, and make that visible before
    // any rank's first kernel (the vote is the barrier).
    let mapped = match (own, fds) {
        (Some(own), Some(fds)) => soft_step(bootstrap, &mut failed, "mapping", || {
            let mut peers = Vec::with_capacity(world - 1);
            for (q, fd) in fds.iter().enumerate() {
                if q != rank {
                    peers.push((q, Allocation::import_fd(fd.as_fd(), layout.alloc_bytes)?));
                }
            }
            drop(fds);
            let workspace = Workspace::map(rank, own, peers, layout, ctx.ordinal())?;
            let error = ErrorWord::new()?;
            ctx.synchronize().during("cuCtxSynchronize")?;
            Ok((workspace, error))
        })?,
        _ => None,
    };

    let peer = match (mapped, kernels, &failed) {
        (Some((workspace, error)), Some(kernels), None) => {
            let args = SymmArgs {
                base: workspace.base(),
                stride: layout.alloc_bytes as u64,
                signal_offset: SIGNAL_OFFSET as u64,
                state_offset: STATE_OFFSET as u64,
                data_offset: DATA_OFFSET as u64,
                data_bytes: layout.data_bytes as u64,
                ll_offset: layout.ll_offset() as u64,
                ll_slot_bytes: layout.ll_slot_bytes as u64,
                error: error.device_ptr(),
                timeout_ns: config.timeout.as_nanos().min(u64::MAX as u128) as u64,
                rank: rank as u32,
                world: world as u32,
            };
            Some(PeerKernels {
                workspace,
                error,
                kernels,
                args,
            })
        }
        _ => None,
    };
    let (peer_unavailable, standin) = match failed {
        None => (None, None),
        Some(e) => match nccl {
            Err(_) => return Err(e),
            Ok(()) => {
                // Every call goes to NCCL; the zero-copy API gets a plain buffer.
                let standin = vote(
                    bootstrap,
                    "NCCL-only buffer",
                    StandIn::new(&ctx, layout.data_bytes),
                )?;
                limits = Limits {
                    one_shot_blocks: 0,
                    two_shot_blocks: 0,
                };
                (Some(e.to_string()), Some(standin))
            }
        },
    };
    Ok(Setup {
        peer,
        standin,
        ctx,
        rank,
        world,
        limits,
        layout,
        config,
        topology,
        peer_unavailable,
    })
}

/// Creates this crate's own NCCL communicator through `bootstrap`: outer error = the group
/// is broken; inner error = NCCL is not usable here (the same verdict on every rank).
fn nccl_through(
    bootstrap: &dyn Bootstrap,
    ctx: &Arc<CudaContext>,
    timeout: Duration,
) -> Result<Result<RawComm>> {
    let rank = bootstrap.rank();
    let local = nccl::library().and_then(|lib| {
        if rank == 0 {
            lib.unique_id().map(Some)
        } else {
            Ok(None)
        }
    });
    let id = match vote_soft(bootstrap, "NCCL library", local)? {
        Ok(id) => id,
        Err(e) => return Ok(Err(e)),
    };
    let ids = bootstrap.all_gather(id.as_ref().map_or(&[][..], |i| &i[..]))?;
    let id: [u8; 128] = ids
        .first()
        .and_then(|b| b.as_slice().try_into().ok())
        .ok_or_else(|| malformed("NCCL unique id"))?;
    let comm = RawComm::init(ctx, id, rank, bootstrap.world(), timeout);
    vote_soft(bootstrap, "NCCL init", comm)
}

fn decode_error(code: u32, rank: usize, timeout: Duration) -> Error {
    if code & 0xff == ERROR_PEER_TIMEOUT {
        let phase = match (code >> 8) & 0xff {
            0 => BarrierPhase::Start,
            1 => BarrierPhase::Middle,
            2 => BarrierPhase::End,
            3 => BarrierPhase::Arrival,
            p => BarrierPhase::Unknown(p),
        };
        Error::PeerTimeout {
            rank,
            peer: (code >> 16) as usize,
            phase,
            timeout,
        }
    } else {
        Error::Poisoned {
            reason: format!("a kernel reported error code {code:#x}"),
        }
    }
}

fn check_device(ctx: &Arc<CudaContext>) -> Result<()> {
    let ordinal = ctx.ordinal();
    let (major, minor) = ctx.compute_capability().during("cuDeviceGetAttribute")?;
    if major < 8 {
        return Err(Error::Unsupported {
            ordinal,
            reason: format!("compute capability {major}.{minor}; the kernels need 8.0 or newer"),
        });
    }
    let attr = |a| ctx.attribute(a).during("cuDeviceGetAttribute");
    if attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? == 0 {
        return Err(Error::Unsupported {
            ordinal,
            reason: "no virtual memory management (cuMemCreate)".into(),
        });
    }
    if attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)? == 0 {
        return Err(Error::Unsupported {
            ordinal,
            reason: "VMM memory cannot be exported as a POSIX file descriptor".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_decode_to_peer_timeouts() {
        let t = Duration::from_millis(5);
        match decode_error(1 | (1 << 8) | (5 << 16), 2, t) {
            Error::PeerTimeout {
                rank: 2,
                peer: 5,
                phase: BarrierPhase::Middle,
                timeout,
            } => assert_eq!(timeout, t),
            e => panic!("unexpected {e:?}"),
        }
        assert!(matches!(
            decode_error(1 | (3 << 16), 0, t),
            Error::PeerTimeout {
                peer: 3,
                phase: BarrierPhase::Start,
                ..
            }
        ));
        assert!(matches!(decode_error(0x42, 0, t), Error::Poisoned { .. }));
    }

    #[test]
    fn hello_round_trips_with_any_host_name() {
        for host in ["", "gpu-node-17.cluster.example", "ünïcode"] {
            let h = Hello {
                world: 8,
                device: [7; 16],
                ordinal: 3,
                host_id: [9; 16],
                config: config_fingerprint(&Config {
                    nccl_above_bytes: Some(1 << 20),
                    ..Config::default()
                }),
                host: host.to_string(),
            };
            assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        }
        assert!(Hello::decode(&[0; HELLO_FIXED - 1]).is_err());
        // The fallback threshold is part of the configuration every rank must share.
        let a = config_fingerprint(&Config::default());
        let b = config_fingerprint(&Config {
            nccl_above_bytes: Some(0),
            ..Config::default()
        });
        assert_ne!(a, b);
        let c = config_fingerprint(&Config {
            peer_kernels: false,
            ..Config::default()
        });
        assert_ne!(a, c);
    }

    #[test]
    fn communicator_is_send_but_not_sync() {
        fn assert_send<T: Send>() {}
        assert_send::<Communicator>();
        // Not Sync: checked by the compile_fail doc test on `Communicator`.
    }
}
