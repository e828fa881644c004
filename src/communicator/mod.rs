//! `Communicator`: one rank of an all-reduce group. The struct, its constructors (which run
//! the collective [`crate::setup`]), accessors and the setup report; the calls are in
//! [`call`], the in-process group in [`local_group`].

mod call;
mod collectives;
mod fused;
mod local_group;
mod order;
mod pool;

pub use pool::SymmetricTensor;

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{sys, CudaContext, CudaEvent};

use crate::backend::nccl::{Fallback, StandIn};
use crate::backend::peer::PeerBackend;
use crate::bootstrap::{Bootstrap, NcclBootstrap};
use crate::config::{Algorithm, Config};
use crate::dtype::DType;
use crate::error::{CudaResultExt, Error, Result};
use crate::events;
use crate::nccl::comm::{self, OwnedNcclComm};
use crate::nccl::window::{self, Windowed, Windows};
use crate::plan::explain::{explain, PathDecision};
use crate::plan::grid::plan_all_reduce;
use crate::plan::route::{route, CallKind, PathFacts, Route};
use crate::plan::{Limits, Plan};
use crate::setup::{self, setup_timeout, Established, Setup};
use crate::symmetric::Layout;
use crate::topology::Topology;

/// Why a communicator made by [`Communicator::new`] or [`Communicator::local_group`] has no
/// NCCL fallback.
const NO_NCCL: &str = "the communicator was created without NCCL (Communicator::new or local_group)";

/// Why a communicator over the caller's cudarc communicator has no NCCL windows.
const CALLERS_NCCL_NO_WINDOWS: &str =
    "the fallback is the caller's cudarc communicator, whose raw handle cudarc does \
     not expose; Communicator::with_nccl_fallback creates one that registers windows";

/// Why a communicator without the peer kernels has no NCCL windows.
const NCCL_ONLY_NO_WINDOWS: &str = "the peer kernels are not set up: no symmetric allocation to register";

/// Environment variable: when set (and not `0`), every rank prints its
/// [`Communicator::describe`] report to stderr once set up.
pub const LOG_ENV: &str = "SYMM_ALLREDUCE_LOG";

/// The data paths a communicator has: one of its two valid states. (One value per
/// communicator, never moved on the call path: boxing the larger variant would buy nothing.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Paths {
    /// The peer kernels take the calls routed to them; NCCL, if there is a fallback, the
    /// rest. Field order is drop order: the NCCL window over the workspace is deregistered
    /// (`Windowed`), then the workspace is released (unmapped once the pool's buffers are
    /// gone too), then NCCL is aborted.
    Peer {
        peer: Windowed<PeerBackend>,
        nccl: std::result::Result<Fallback, String>,
    },
    /// Every call goes to NCCL (`why`: the peer kernels could not be set up); the stand-in
    /// serves as the symmetric buffer.
    NcclOnly {
        standin: StandIn,
        nccl: Fallback,
        why: String,
    },
}

/// One rank of an all-reduce group.
///
/// A communicator is `Send` and `Sync`: it can be shared between threads (candle's custom ops
/// and Python bindings need that). Its calls are serialised by an internal lock, so two
/// threads calling at once each get a whole call; but the *order* of calls is part of the
/// contract between ranks (every rank makes the same sequence of calls), so calls of one rank
/// from several threads must still come in an order every rank agrees on.
///
/// Every call is asynchronous on the stream it is given. Calls that the peer kernels take
/// are CUDA-graph capturable: no allocation, no host synchronisation and no driver call other
/// than the kernel launch (plus one `cuStreamIsCapturing` when cudarc's event tracking is on,
/// its default: while the stream is being captured, cudarc's per-buffer event bookkeeping is
/// done on a stream of the communicator's own, so a capture never waits on an event recorded
/// outside it). Calls routed to NCCL ([`Communicator::path`] says which) are what
/// `ncclAllReduce` is.
#[derive(Debug)]
pub struct Communicator {
    // Field order is drop order: after `Drop` synchronised, the data paths go first.
    paths: Paths,
    /// The symmetric pool (`None` without peer kernels or with `Config::pool_bytes` 0).
    pool: Option<Arc<pool::Pool>>,
    ctx: Arc<CudaContext>,
    rank: usize,
    world: usize,
    limits: Limits,
    layout: Layout,
    config: Config,
    topology: Topology,
    /// The failure that made the communicator unusable.
    poisoned: Mutex<Option<Error>>,
    /// Orders every call after the previous one, across streams, captures and replays.
    order: Mutex<order::StreamOrder>,
    /// cudarc's bookkeeping under capture.
    shadow: Shadow,
}

/// Where cudarc's event bookkeeping of a call's buffers runs while the caller's stream is
/// being captured (see `Communicator::bookkeeping` in call.rs).
#[derive(Debug)]
struct Shadow {
    /// A stream of this rank's context that is never captured by the crate; `None` when the
    /// context had event tracking off at setup (cudarc then records nothing). Not one of
    /// cudarc's counted streams, so the application's context keeps its stream mode.
    stream: Option<crate::driver::graph::UncountedStream>,
    /// Joins `stream` back into the caller's capture if a wait drew it in.
    join: CudaEvent,
}

impl Shadow {
    /// A shadow stream for `ctx`, or none when cudarc does no event bookkeeping in it.
    fn new(ctx: &Arc<CudaContext>, join: CudaEvent) -> Result<Shadow> {
        let stream = if ctx.is_event_tracking() {
            Some(crate::driver::graph::UncountedStream::new(ctx)?)
        } else {
            None
        };
        Ok(Shadow { stream, join })
    }
}

impl Communicator {
    /// Collective constructor: every rank of `bootstrap` calls this at the same time with its
    /// own device context and the same `config`. Each step ends in a vote, so when any rank
    /// fails, all ranks return an error (none is left waiting).
    ///
    /// There is no NCCL fallback (see [`Communicator::with_nccl_fallback`]): the peer kernels
    /// take every call, so setup fails where they cannot run (no peer access, several hosts).
    pub fn new(bootstrap: &dyn Bootstrap, ctx: Arc<CudaContext>, config: Config) -> Result<Communicator> {
        let _span = events::setup_span("new", bootstrap.rank(), bootstrap.world());
        let setup = setup::run(bootstrap, ctx, config, Err(NO_NCCL), Ok(()))?;
        Communicator::assemble(setup, Err(NO_NCCL.to_string()), Windows::off(NO_NCCL))
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
        Communicator::over_callers_nccl(OwnedNcclComm::new(comm), config)
    }

    /// [`from_nccl`](Self::from_nccl) over an NCCL communicator the application keeps and
    /// goes on using for its own collectives (as mistral.rs keeps its `Arc<Comm>`): the
    /// Communicator holds a clone of `comm`, calls NCCL on it for the fallback, and never
    /// aborts it. `C` is the application's handle (for example mistral.rs's `Comm`, which
    /// dereferences to cudarc's); it is `Send + Sync` by the application's own claim that it
    /// serialises the uses of one NCCL communicator, which holds when one thread drives the
    /// rank. Every rank of `comm` calls this, each with the same `config`.
    pub fn from_nccl_shared<C>(comm: Arc<C>, config: Config) -> Result<Communicator>
    where
        C: std::ops::Deref<Target = cudarc::nccl::Comm> + Send + Sync + 'static,
    {
        let comm: crate::nccl::SharedNcclComm = comm;
        Communicator::over_callers_nccl(OwnedNcclComm::shared(comm), config)
    }

    fn over_callers_nccl(comm: OwnedNcclComm, config: Config) -> Result<Communicator> {
        let constructor = if comm.is_shared() {
            "from_nccl_shared"
        } else {
            "from_nccl"
        };
        let _span = events::setup_span(constructor, comm.get().rank(), comm.get().world_size());
        let ctx = comm.get().context().clone();
        let events = ctx
            .new_event(None)
            .and_then(|fork| Ok((fork, ctx.new_event(None)?)))
            .during("cuEventCreate");
        let precheck = match &events {
            Ok(_) => Ok(()),
            Err(e) => Err(e.clone()),
        };
        let setup = {
            let bootstrap = NcclBootstrap::new(comm.get(), setup_timeout(&config));
            setup::run(&bootstrap, ctx, config, Ok(()), precheck)?
        };
        let (fork, join) = events?;
        Communicator::assemble(
            setup,
            Ok(Fallback::Cudarc { comm, fork, join }),
            Windows::off(CALLERS_NCCL_NO_WINDOWS),
        )
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
        let _span = events::setup_span("with_nccl_fallback", bootstrap.rank(), bootstrap.world());
        let fallback = match comm::create_over(bootstrap, &ctx, setup_timeout(&config))? {
            Ok(comm) => Ok(Fallback::Raw(comm)),
            Err(e) => Err(format!("NCCL is unavailable: {e}")),
        };
        let nccl = fallback.as_ref().map(|_| ()).map_err(String::as_str);
        let setup = setup::run(bootstrap, ctx, config, nccl, Ok(()))?;
        let windows = Communicator::register_windows(bootstrap, &setup, &fallback)?;
        Communicator::assemble(setup, fallback, windows)
    }

    /// The NCCL window over this rank's symmetric allocation, registered by every rank
    /// together (voted: [`window::register_over`]), or why there is none. Every rank takes the
    /// same branch here: the configuration, the setup outcome and the fallback are agreed.
    fn register_windows(
        bootstrap: &dyn Bootstrap,
        s: &Setup,
        fallback: &std::result::Result<Fallback, String>,
    ) -> Result<Windows> {
        let peer = match &s.established {
            Established::Peer(peer) => peer,
            Established::NcclOnly { .. } => return Ok(Windows::off(NCCL_ONLY_NO_WINDOWS)),
        };
        let comm = match fallback {
            Ok(Fallback::Raw(comm)) => comm,
            Ok(Fallback::Cudarc { .. }) => return Ok(Windows::off(CALLERS_NCCL_NO_WINDOWS)),
            Err(why) => return Ok(Windows::off(format!("no NCCL fallback ({why})"))),
        };
        if !s.config.nccl_windows {
            return Ok(Windows::off(format!(
                "Config::nccl_windows is false (the default; {}=1 turns it on)",
                crate::config::NCCL_WINDOWS_ENV
            )));
        }
        let region = peer
            .workspace()
            .own_mapping(s.rank)
            .and_then(|((ptr, bytes), range)| window::check_region(ptr, bytes, range));
        window::register_over(bootstrap, comm, region)
    }

    fn assemble(
        s: Setup,
        nccl: std::result::Result<Fallback, String>,
        windows: Windows,
    ) -> Result<Communicator> {
        let paths = match (s.established, nccl) {
            (Established::Peer(peer), nccl) => Paths::Peer {
                peer: Windowed::new(peer, windows),
                nccl,
            },
            (Established::NcclOnly { standin, why }, Ok(nccl)) => Paths::NcclOnly { standin, nccl, why },
            // Setup returns its error instead of `NcclOnly` when no fallback will be attached.
            (Established::NcclOnly { why, .. }, Err(no_nccl)) => {
                return Err(Error::NcclUnavailable {
                    reason: format!("the peer kernels are not set up ({why}) and {no_nccl}"),
                })
            }
        };
        let event = s
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .during("cuEventCreate")?;
        let scratch = s
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .during("cuEventCreate")?;
        let join = s
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .during("cuEventCreate")?;
        let shadow = Shadow::new(&s.ctx, join)?;
        let pool = match &paths {
            Paths::Peer { peer, .. } => pool::Pool::new(peer.workspace(), s.rank),
            Paths::NcclOnly { .. } => None,
        };
        let comm = Communicator {
            order: Mutex::new(order::StreamOrder::new(event, scratch)),
            shadow,
            paths,
            pool,
            ctx: s.ctx,
            rank: s.rank,
            world: s.world,
            limits: s.limits,
            layout: s.layout,
            config: s.config,
            topology: s.topology,
            poisoned: Mutex::new(None),
        };
        match (comm.nccl(), comm.nccl_unavailable()) {
            (Ok(f), _) => events::nccl_fallback(Ok(&f.describe())),
            (Err(_), why) => events::nccl_fallback(Err(why.unwrap_or("none"))),
        }
        events::nccl_windows(comm.nccl_windows_unavailable());
        events::report(|| comm.describe());
        if std::env::var(LOG_ENV).is_ok_and(|v| !v.is_empty() && v != "0") {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "{}", comm.describe());
        }
        Ok(comm)
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
        match &self.paths {
            Paths::Peer { peer, .. } => peer.layout(),
            Paths::NcclOnly { .. } => self.layout,
        }
    }

    /// The kernel grid a buffer call of `len` elements of `dtype` would use if the peer
    /// kernels take it (see [`path`](Self::path) for whether they do).
    pub fn plan(&self, len: usize, dtype: DType, algorithm: Algorithm) -> Plan {
        plan_all_reduce(len, dtype, self.world, self.limits, &self.config, algorithm)
    }

    /// Where a call of `len` elements of `dtype` on the caller's buffers goes (low-latency,
    /// one-shot, two-shot or NCCL) and why; an error where the call would be refused (over
    /// the capacity without NCCL, or NCCL asked for without a fallback). Every rank decides
    /// the same.
    pub fn path(&self, len: usize, dtype: DType, algorithm: Algorithm) -> Result<PathDecision> {
        self.explain(CallKind::Buffers, len, dtype, algorithm)
    }

    /// Where a zero-copy call on a pool buffer of `len` elements goes
    /// ([`all_reduce_pool`](Self::all_reduce_pool),
    /// [`all_reduce_pool_buffer`](Self::all_reduce_pool_buffer)): the low-latency kernel or
    /// the copy-in one-shot in their ranges, else "zero-copy (pool)", the in-place two-shot
    /// kernel reading the peers' pool memory, or NCCL. `out_of_place`: where `all_reduce` from
    /// a pool buffer into another buffer goes (the same below, then the zero-copy two-shot up to
    /// `capacity_bytes`, then what an ordinary buffer gets).
    pub fn pool_path(&self, len: usize, dtype: DType, out_of_place: bool) -> Result<PathDecision> {
        let kind = if out_of_place {
            CallKind::PoolInput
        } else {
            CallKind::Pool
        };
        self.explain(kind, len, dtype, Algorithm::Auto)
    }

    /// Where [`all_reduce_symmetric`](Self::all_reduce_symmetric) of `len` elements goes: the
    /// zero-copy in-place two-shot kernel, or NCCL (the decision that call takes).
    pub fn symmetric_path(&self, len: usize, dtype: DType) -> Result<PathDecision> {
        self.explain(CallKind::Symmetric, len, dtype, Algorithm::Auto)
    }

    fn explain(
        &self,
        kind: CallKind,
        len: usize,
        dtype: DType,
        algorithm: Algorithm,
    ) -> Result<PathDecision> {
        let r = self.route(kind, len, dtype, algorithm)?;
        Ok(explain(&r, algorithm, &self.config, self.facts()))
    }

    /// The decision a call takes (no allocation unless it refuses).
    fn route(&self, kind: CallKind, len: usize, dtype: DType, algorithm: Algorithm) -> Result<Route> {
        route(kind, len, dtype, &self.config, algorithm, self.facts())
    }

    fn facts(&self) -> PathFacts<'_> {
        let (peer_kernels, nccl, multicast, clusters) = match &self.paths {
            Paths::Peer { nccl, peer } => (
                Ok(()),
                nccl.as_ref().map(|_| ()).map_err(String::as_str),
                peer.multicast().map(|_| ()),
                peer.clusters(),
            ),
            Paths::NcclOnly { why, .. } => (
                Err(why.as_str()),
                Ok(()),
                Err("the peer kernels are not set up"),
                false,
            ),
        };
        PathFacts {
            world: self.world,
            limits: self.limits,
            peer_kernels,
            nccl,
            multicast,
            clusters,
        }
    }

    /// Placement of every rank and the links between their devices, as probed at setup.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Whether the symmetric workspace is set up (otherwise every call goes to NCCL).
    pub fn has_peer_kernels(&self) -> bool {
        matches!(self.paths, Paths::Peer { .. })
    }

    /// Why the peer kernels are not set up, if they are not.
    pub fn peer_kernels_unavailable(&self) -> Option<&str> {
        self.facts().peer_kernels.err()
    }

    /// Whether a multicast (NVLS) object is set up, so the multimem kernel can run.
    pub fn has_multicast(&self) -> bool {
        self.facts().multicast.is_ok()
    }

    /// Why there is no multicast object, if there is none (`Config::multicast` is `Off`, a
    /// veto variable, the device attribute, or the setup step that failed).
    pub fn multicast_unavailable(&self) -> Option<&str> {
        self.facts().multicast.err()
    }

    /// The collective close (every rank calls it, with the bootstrap the communicator was
    /// built over, or any bootstrap of the same ranks): waits for this rank's last call, then
    /// votes, so no rank unmaps, unbinds or releases the multicast object (if any) while a peer
    /// may still write through its multicast address; then drops the communicator. `Drop`
    /// alone tears the multicast object down locally without the vote: safe for this process,
    /// but a peer still inside a multimem kernel may then write into memory that is no longer
    /// bound (docs/multicast.md). Without multicast this is a synchronise, a vote and a drop.
    pub fn close(mut self, bootstrap: &dyn crate::bootstrap::Bootstrap) -> Result<()> {
        let synced = lock(&self.order).wait_for_all().during("cuStreamSynchronize");
        let mapping = match &mut self.paths {
            Paths::Peer { peer, .. } => peer.take_multicast(),
            Paths::NcclOnly { .. } => None,
        };
        let closed = match mapping {
            Some(m) => m.close(bootstrap),
            None => crate::bootstrap::vote(bootstrap, "multicast close", Ok(())),
        };
        synced.and(closed)
    }

    /// Whether this rank's symmetric allocation (the symmetric buffer and the pool) is
    /// registered as an NCCL window, so that calls routed to NCCL on those buffers may run
    /// NCCL's symmetric kernels (docs/nccl-windows.md).
    pub fn has_nccl_windows(&self) -> bool {
        self.nccl_windows_unavailable().is_none()
    }

    /// Why there is no NCCL window, if there is none (the setup step that failed and why,
    /// NCCL older than 2.27, `Config::nccl_windows`, no fallback of this crate's own).
    pub fn nccl_windows_unavailable(&self) -> Option<&str> {
        match &self.paths {
            Paths::Peer { peer, .. } => peer.windows().unavailable(),
            Paths::NcclOnly { .. } => Some(NCCL_ONLY_NO_WINDOWS),
        }
    }

    /// Whether calls can go to NCCL.
    pub fn has_nccl_fallback(&self) -> bool {
        self.facts().nccl.is_ok()
    }

    /// Why there is no NCCL fallback, if there is none.
    pub fn nccl_unavailable(&self) -> Option<&str> {
        self.facts().nccl.err()
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
        if !crate::kernels_available() {
            s += &format!("kernels: not in this build ({})\n", Error::KernelsUnavailable);
        }
        s += &match &self.paths {
            Paths::Peer { .. } => format!(
                "peer kernels: on ({} one-shot / {} two-shot blocks per rank, capacity {} bytes)\n",
                self.limits.one_shot_blocks, self.limits.two_shot_blocks, self.config.capacity_bytes
            ),
            Paths::NcclOnly { why, .. } => format!("peer kernels: off, every call goes to NCCL: {why}\n"),
        };
        if let Paths::Peer { peer, .. } = &self.paths {
            s += &format!("PDL: {}\n", peer.pdl_summary());
        }
        s += &match &self.paths {
            Paths::Peer { peer, .. } => match peer.multicast() {
                Ok(m) => format!(
                    "multicast (NVLS): on ({} bytes bound, granularity {} minimum / {} recommended; under Auto: \
                     multimem low-latency in the low-latency range (same bits as the peer kernels), {})\n",
                    m.size(),
                    m.granularity().0,
                    m.granularity().1,
                    if self.config.reproducible {
                        "the multimem.ld_reduce kernels only when asked for: Config::reproducible is on"
                    } else {
                        "multimem one-shot in the one-shot range, multimem in-place two-shot for symmetric calls \
                         above it"
                    }
                ),
                Err(why) => format!("multicast (NVLS): off ({why})\n"),
            },
            Paths::NcclOnly { .. } => "multicast (NVLS): off (the peer kernels are not set up)\n".to_string(),
        };
        if self.pool.is_some() {
            let (free, largest) = self.pool_free();
            s += &format!(
                "symmetric pool: {} bytes, {free} free (largest region {largest}); zero-copy calls: {}\n",
                self.layout().pool_bytes,
                match self.pool_path(1 << 20, DType::BF16, false) {
                    Ok(p) => p.to_string(),
                    Err(e) => format!("refused: {e}"),
                }
            );
        }
        s += &match (self.nccl(), self.nccl_unavailable()) {
            (Ok(f), _) => format!("NCCL fallback: {}\n", f.describe()),
            (Err(_), Some(why)) => format!("NCCL fallback: none ({why})\n"),
            (Err(_), None) => "NCCL fallback: none\n".to_string(),
        };
        s += &match &self.paths {
            Paths::Peer { peer, .. } => format!("NCCL windows: {}\n", peer.windows().describe()),
            Paths::NcclOnly { .. } => format!("NCCL windows: off ({NCCL_ONLY_NO_WINDOWS})\n"),
        };
        s += &self.config.tuning_summary(self.world);
        s.push('\n');
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
        let line = match self.symmetric_path((4 << 20) / 2, DType::BF16) {
            Ok(p) => p.to_string(),
            Err(e) => format!("refused: {e}"),
        };
        s += &format!("  symmetric call, {:>9} bytes bf16 -> {line}\n", 4 << 20);
        s.pop();
        s
    }

    fn peer(&self) -> Result<&PeerBackend> {
        match &self.paths {
            Paths::Peer { peer, .. } => Ok(&**peer),
            Paths::NcclOnly { why, .. } => Err(Error::Unsupported {
                ordinal: self.device(),
                reason: format!("the peer kernels are not set up: {why}"),
            }),
        }
    }

    fn nccl(&self) -> Result<&Fallback> {
        match &self.paths {
            Paths::Peer { nccl: Ok(f), .. } | Paths::NcclOnly { nccl: f, .. } => Ok(f),
            Paths::Peer { nccl: Err(why), .. } => Err(Error::NcclUnavailable { reason: why.clone() }),
        }
    }
}

/// Locks one of the communicator's mutexes. A panic while it was held (only a bug can cause
/// one: nothing on the call path panics) leaves plain state behind; keep using it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // This communicator's kernels may still read or signal through its mappings: wait for
        // its own last call (every earlier call is ordered before it, whatever its stream),
        // not for the whole context, which may hold other groups' work. A peer stuck in a
        // barrier is bounded by the timeout. Errors cannot be reported from Drop.
        let _ = lock(&self.order).wait_for_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn communicator_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Communicator>();
    }
}
