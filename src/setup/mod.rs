//! The collective setup every constructor runs, as a table of steps ([`STEPS`]).
//!
//! Every rank runs the same steps in the same order. A step's local work ends in a vote
//! (one all-gather of ballots), so when one rank fails every rank learns it at the same step:
//! a *hard* step's failure ends setup on every rank; a *soft* step's failure turns the peer
//! kernels off on every rank (every call then goes to NCCL, when there is a fallback) and
//! every later soft step is skipped alike. After a successful vote, a step may exchange data
//! with the peers; a failed exchange means the group itself is broken.

mod hello;
mod multicast;

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaContext};

use crate::backend::nccl::StandIn;
use crate::backend::peer::PeerBackend;
use crate::bootstrap::{vote, vote_soft, Bootstrap};
use crate::config::{validate_world, Algorithm, Config};
use crate::driver::host::ErrorWord;
use crate::driver::vmm::{self, Allocation};
use crate::error::{CudaResultExt, Error, Result};
use crate::kernels::abi::THREADS_PER_BLOCK;
use crate::kernels::Kernels;
use crate::plan::Limits;
use crate::symmetric::{self, Layout, Workspace};
use crate::topology::{self, PeerLink, RankPlacement, Topology};
use crate::wire::{Reader, Wire, Writer};
use hello::Hello;

/// The bound on each setup exchange: the configured timeout, but at least 30 s (setup steps
/// such as loading kernels or initialising NCCL take seconds on a busy machine).
pub(crate) fn setup_timeout(config: &Config) -> Duration {
    config.timeout.max(Duration::from_secs(30))
}

/// The one place that tells a user at run time that this build has no kernels (a build
/// script's warning is hidden for git and registry dependencies): one line on stderr per
/// process, at the first setup that needs them.
pub(crate) fn warn_kernels_unavailable() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| eprintln!("symm-allreduce: warning: {}", Error::KernelsUnavailable));
}

/// What setup established, before an NCCL fallback is attached (moved once, into the
/// communicator).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub(crate) enum Established {
    /// The peer kernels over the symmetric workspace.
    Peer(PeerBackend),
    /// Every call goes to NCCL; the stand-in serves as the symmetric buffer.
    NcclOnly { standin: StandIn, why: String },
}

/// The outcome of [`run`].
#[derive(Debug)]
pub(crate) struct Setup {
    pub(crate) established: Established,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) limits: Limits,
    pub(crate) layout: Layout,
    pub(crate) config: Config,
    pub(crate) topology: Topology,
}

/// How a step's failure counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Every rank returns the error.
    Hard,
    /// The peer kernels are off on every rank; later soft steps are skipped.
    Soft,
}

/// One step: local work (voted on), then an exchange with the peers.
struct Step {
    name: &'static str,
    kind: Kind,
    local: Option<fn(&mut State<'_>) -> Result<()>>,
    exchange: Option<fn(&mut State<'_>) -> Result<()>>,
}

/// The steps, in order.
const STEPS: [Step; 7] = [
    Step {
        name: "device check",
        kind: Kind::Hard,
        local: Some(|s| s.check_locally()),
        exchange: Some(|s| s.exchange_hellos()),
    },
    Step {
        name: "topology",
        kind: Kind::Hard,
        local: None,
        exchange: Some(|s| s.exchange_topology()),
    },
    Step {
        name: "device support",
        kind: Kind::Soft,
        local: Some(|s| s.check_device_support()),
        exchange: None,
    },
    Step {
        name: "kernels and limits",
        kind: Kind::Soft,
        local: Some(|s| s.load_kernels()),
        exchange: Some(|s| s.agree_on_limits()),
    },
    Step {
        name: "allocation",
        kind: Kind::Soft,
        local: Some(|s| s.allocate()),
        exchange: None,
    },
    Step {
        name: "descriptor exchange",
        kind: Kind::Soft,
        local: Some(|s| s.exchange_descriptors()),
        exchange: None,
    },
    Step {
        name: "mapping",
        kind: Kind::Soft,
        local: Some(|s| s.map()),
        exchange: None,
    },
];

/// Everything the steps build up.
struct State<'a> {
    bootstrap: &'a dyn Bootstrap,
    ctx: Arc<CudaContext>,
    config: Config,
    rank: usize,
    world: usize,
    /// `Err(why)` when no NCCL fallback will be attached.
    nccl: std::result::Result<(), &'a str>,
    /// A condition of the caller's that joins the first vote.
    precheck: Option<Result<()>>,
    device: [u8; 16],
    placements: Vec<RankPlacement>,
    /// Ranks sharing this rank's device (their blocks must be resident together).
    sharing: usize,
    topology: Topology,
    kernels: Option<Arc<Kernels>>,
    limits: Limits,
    granularity: usize,
    own: Option<(Allocation, OwnedFd)>,
    fds: Option<Vec<OwnedFd>>,
    mapped: Option<(Workspace, ErrorWord)>,
    /// The soft failure that turned the peer kernels off.
    failed: Option<Error>,
}

/// The agreed-on grid limits and granularity, as exchanged.
struct LimitsMessage {
    limits: Limits,
    granularity: usize,
}

impl Wire for LimitsMessage {
    fn put(&self, w: &mut Writer) {
        w.put(&self.limits.one_shot_blocks)
            .put(&self.limits.two_shot_blocks)
            .put(&self.granularity);
    }
    fn take(r: &mut Reader<'_>) -> Option<Self> {
        Some(LimitsMessage {
            limits: Limits {
                one_shot_blocks: r.take()?,
                two_shot_blocks: r.take()?,
            },
            granularity: r.take()?,
        })
    }
}

impl State<'_> {
    fn check_locally(&mut self) -> Result<()> {
        self.precheck.take().unwrap_or(Ok(()))?;
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        self.config.load_tuning_from_env()?;
        self.config.validate()?;
        validate_world(self.world)?;
        if let (Algorithm::Nccl, Err(why)) = (self.config.algorithm, self.nccl) {
            return Err(Error::NcclUnavailable {
                reason: format!("Config::algorithm is Nccl, but {why}"),
            });
        }
        self.device = self.ctx.uuid().during("cuDeviceGetUuid")?.bytes.map(|b| b as u8);
        Ok(())
    }

    /// Everyone checks everyone's world size and configuration, and learns where each rank
    /// runs (host and device).
    fn exchange_hellos(&mut self) -> Result<()> {
        let (host, host_id) = topology::this_host();
        let own = Hello {
            world: self.world,
            device: self.device,
            ordinal: self.ctx.ordinal(),
            host_id,
            config: self.config.fingerprint(),
            host,
        };
        let hellos = hello::check_all(&own, &self.bootstrap.all_gather(&own.to_wire())?)?;
        self.sharing = hellos
            .iter()
            .filter(|h| h.device == own.device && h.host_id == own.host_id)
            .count();
        self.placements = hellos.iter().map(Hello::placement).collect();
        Ok(())
    }

    /// Every rank probes its row, everyone decides on the whole table.
    fn exchange_topology(&mut self) -> Result<()> {
        let row = topology::probe_links(&self.ctx, self.rank, &self.placements);
        let rows = self.bootstrap.all_gather(&topology::encode_links(&row))?;
        let mut links: Vec<PeerLink> = Vec::with_capacity(self.world * self.world.saturating_sub(1));
        for r in &rows {
            links.extend(topology::decode_links(r, self.world).map_err(|_| Error::malformed("topology"))?);
        }
        self.topology = Topology {
            ranks: std::mem::take(&mut self.placements),
            links,
        };
        let decision = self.topology.decide();
        self.failed = if !self.config.peer_kernels {
            Some(Error::InvalidConfig(
                "Config::peer_kernels is false: every call goes to NCCL, so the communicator needs an NCCL \
                 fallback"
                    .into(),
            ))
        } else if !decision.allowed {
            Some(Error::Unsupported {
                ordinal: self.ctx.ordinal(),
                reason: decision.reason,
            })
        } else {
            None
        };
        Ok(())
    }

    fn check_device_support(&mut self) -> Result<()> {
        let ordinal = self.ctx.ordinal();
        crate::driver::graph::require_capture_queries(ordinal)?;
        let (major, minor) = self.ctx.compute_capability().during("cuDeviceGetAttribute")?;
        if major < 8 {
            return Err(Error::Unsupported {
                ordinal,
                reason: format!("compute capability {major}.{minor}; the kernels need 8.0 or newer"),
            });
        }
        let attr = |a| self.ctx.attribute(a).during("cuDeviceGetAttribute");
        if attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? == 0 {
            return Err(Error::Unsupported {
                ordinal,
                reason: "no virtual memory management (cuMemCreate)".into(),
            });
        }
        if attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?
            == 0
        {
            return Err(Error::Unsupported {
                ordinal,
                reason: "VMM memory cannot be exported as a POSIX file descriptor".into(),
            });
        }
        Ok(())
    }

    /// Kernels, residency limits and granularity of this rank.
    fn load_kernels(&mut self) -> Result<()> {
        let kernels = Kernels::load(&self.ctx).inspect_err(|e| {
            if matches!(e, Error::KernelsUnavailable) {
                warn_kernels_unavailable();
            }
        })?;
        let sms = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .during("cuDeviceGetAttribute")? as usize;
        let (one, two) = kernels.blocks_per_sm(THREADS_PER_BLOCK)?;
        self.limits = Limits::from_occupancy(one, two, sms, self.sharing, &self.config)?;
        self.granularity = vmm::granularity(self.ctx.ordinal())?;
        self.kernels = Some(kernels);
        Ok(())
    }

    /// Every rank takes the smallest grid and the largest granularity.
    fn agree_on_limits(&mut self) -> Result<()> {
        let own = LimitsMessage {
            limits: self.limits,
            granularity: self.granularity,
        };
        for bytes in self.bootstrap.all_gather(&own.to_wire())? {
            let peer = LimitsMessage::from_wire(&bytes).ok_or_else(|| Error::malformed("limits"))?;
            self.limits = self.limits.min(peer.limits);
            self.granularity = self.granularity.max(peer.granularity);
        }
        Ok(())
    }

    fn layout(&self) -> Layout {
        Layout::new(
            self.config.capacity_bytes,
            self.config.low_latency_limit(self.world),
            self.world,
            self.config.pool_bytes,
            self.granularity,
        )
    }

    /// This rank's memory, exported for the peers.
    fn allocate(&mut self) -> Result<()> {
        self.own = Some(symmetric::allocate(self.ctx.ordinal(), &self.layout())?);
        Ok(())
    }

    fn exchange_descriptors(&mut self) -> Result<()> {
        let (_, fd) = self.own.as_ref().ok_or_else(|| Error::malformed("setup order"))?;
        self.fds = Some(self.bootstrap.all_gather_fds(fd.as_fd())?);
        Ok(())
    }

    /// Imports and maps every peer, zeroes this rank's signals, and makes that visible
    /// before any rank's first kernel (the step's vote is the barrier).
    fn map(&mut self) -> Result<()> {
        let (own, fd) = self.own.take().ok_or_else(|| Error::malformed("setup order"))?;
        drop(fd);
        let fds = self.fds.take().ok_or_else(|| Error::malformed("setup order"))?;
        let workspace = Workspace::import_and_map(self.rank, own, fds, self.layout(), self.ctx.ordinal())?;
        let error = ErrorWord::new()?;
        self.ctx.synchronize().during("cuCtxSynchronize")?;
        self.mapped = Some((workspace, error));
        Ok(())
    }
}

/// Runs [`STEPS`]. `nccl` says whether an NCCL fallback will be attached: with one, a soft
/// failure makes every call go to NCCL; without one, it is returned as the error.
/// `precheck` is a local condition of the caller's that joins the first vote.
pub(crate) fn run(
    bootstrap: &dyn Bootstrap,
    ctx: Arc<CudaContext>,
    config: Config,
    nccl: std::result::Result<(), &str>,
    precheck: Result<()>,
) -> Result<Setup> {
    let mut s = State {
        bootstrap,
        rank: bootstrap.rank(),
        world: bootstrap.world(),
        ctx,
        config: config.with_environment(),
        nccl,
        precheck: Some(precheck),
        device: [0; 16],
        placements: Vec::new(),
        sharing: 1,
        topology: Topology::default(),
        kernels: None,
        limits: Limits::NONE,
        granularity: 4096,
        own: None,
        fds: None,
        mapped: None,
        failed: None,
    };
    for step in &STEPS {
        if step.kind == Kind::Soft && s.failed.is_some() {
            continue;
        }
        if let Some(local) = step.local {
            let outcome = local(&mut s);
            match step.kind {
                Kind::Hard => vote(bootstrap, step.name, outcome)?,
                Kind::Soft => {
                    if let Err(e) = vote_soft(bootstrap, step.name, outcome)? {
                        crate::events::soft_step_failed(step.name, &e);
                        s.failed = Some(e);
                        continue;
                    }
                }
            }
        }
        if let Some(exchange) = step.exchange {
            exchange(&mut s)?;
        }
    }
    let layout = s.layout();
    let established = match (s.failed.take(), s.mapped.take(), s.kernels.take()) {
        (None, Some((workspace, error)), Some(kernels)) => {
            // The multicast steps (issue 12): after the peer workspace is mapped, voted.
            let mc = multicast::run(bootstrap, &s.config, s.ctx.ordinal(), &workspace, &kernels)?;
            crate::events::peer_kernels(Ok((s.limits.one_shot_blocks, s.limits.two_shot_blocks)), false);
            Established::Peer(
                PeerBackend::new(workspace, error, kernels, s.rank, s.world, &s.config, s.sharing)
                    .with_multicast(mc),
            )
        }
        (failed, _, _) => {
            let e = failed.unwrap_or_else(|| Error::malformed("setup order"));
            multicast::require_none(&s.config, &e)?;
            crate::events::peer_kernels(Err(&e.to_string()), s.nccl.is_ok());
            if s.nccl.is_err() {
                return Err(e);
            }
            // Every call goes to NCCL; the zero-copy API gets a plain buffer.
            let standin = vote(
                bootstrap,
                "NCCL-only buffer",
                StandIn::new(&s.ctx, layout.data_bytes),
            )?;
            s.limits = Limits::NONE;
            Established::NcclOnly {
                standin,
                why: e.to_string(),
            }
        }
    };
    Ok(Setup {
        established,
        ctx: s.ctx,
        rank: s.rank,
        world: s.world,
        limits: s.limits,
        layout,
        config: s.config,
        topology: s.topology,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_have_unique_names_and_start_hard() {
        let mut names: Vec<&str> = STEPS.iter().map(|s| s.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), STEPS.len());
        // Soft steps come after every hard one (a soft failure skips only soft steps).
        let first_soft = STEPS.iter().position(|s| s.kind == Kind::Soft).unwrap();
        assert!(STEPS[first_soft..].iter().all(|s| s.kind == Kind::Soft));
    }

    #[test]
    fn limits_message_round_trips() {
        let m = LimitsMessage {
            limits: Limits {
                one_shot_blocks: 32,
                two_shot_blocks: 16,
            },
            granularity: 2 << 20,
        };
        let back = LimitsMessage::from_wire(&m.to_wire()).unwrap();
        assert_eq!(back.limits, m.limits);
        assert_eq!(back.granularity, m.granularity);
        assert!(LimitsMessage::from_wire(&m.to_wire()[..23]).is_none());
    }
}
