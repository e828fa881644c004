//! The multicast (NVLS) sibling of the workspace: binds every rank's workspace allocation to
//! one driver multicast object and maps its multicast address, as voted steps over the
//! bootstrap (docs/multicast.md). Runs after the peer workspace is mapped; any failure makes
//! every rank fall back to the peer kernels together, with the reason.
//!
//! Order (every rank, each step ends in a vote):
//! 1. **eligibility**: `Config::multicast` is not `Off`, no veto variable is set, the world has
//!    at least 2 ranks, then (only then) the device attribute `MULTICAST_SUPPORTED`;
//! 2. **granularity**: minimum and recommended multicast granularity, all-gathered; the
//!    largest minimum is agreed and the bound size rounded up to it (it must fit the
//!    allocation);
//! 3. **create**: rank 0 creates the object and exports a POSIX fd; the fd is all-gathered
//!    (SCM_RIGHTS, as for the peer allocations; the others contribute a placeholder);
//! 4. **import**: every other rank imports it;
//! 5. **add device**: every rank adds its device (the vote makes every add precede any bind:
//!    a bind or map blocks until all devices are added);
//! 6. **bind**: every rank binds its own allocation;
//! 7. **map**: every rank maps the multicast address with read-write access.
//!
//! A failed vote unwinds this rank's part (unmap, unbind, release, in that order) and turns
//! multicast off on every rank. Teardown of a live object: [`MulticastMapping::close`] is the
//! collective close (a vote: every rank's multimem kernels have finished, so no peer still
//! writes through the multicast address), then unmap, unbind, release. `Drop` alone does the
//! same local teardown without the vote: safe for this process once its streams are idle, but a
//! peer still inside a multimem kernel may then write into memory that is no longer bound.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use super::{DATA_OFFSET, STATE_OFFSET};
use crate::bootstrap::{vote_soft, Bootstrap};
use crate::config::Multicast;
use crate::driver::multicast::{Granularity, McHandle, MulticastDriver};
use crate::error::{Error, Result};
use crate::kernels::abi::MAX_BLOCKS;
use crate::wire::{Reader, Wire, Writer};

/// Multicast barrier counters: `[phase 3][block]` u64 counters 64 bytes apart, reached through
/// the multicast address (kernels/multimem.cuh holds the same numbers; a test compares them).
pub(crate) const MC_SIGNAL_OFFSET: usize = 48 << 10;
pub(crate) const MC_SIGNAL_STRIDE: usize = 64;
/// The owner's per-(phase, block) arrival totals (unicast only).
pub(crate) const MC_EXPECTED_OFFSET: usize = 60 << 10;
pub(crate) const MC_PHASES: usize = 3;

// Between the call state (which keeps its first 4 KiB) and the data buffers.
const _: () = assert!(STATE_OFFSET + (4 << 10) <= MC_SIGNAL_OFFSET);
const _: () = assert!(MC_SIGNAL_OFFSET + MC_PHASES * MAX_BLOCKS * MC_SIGNAL_STRIDE <= MC_EXPECTED_OFFSET);
const _: () = assert!(MC_EXPECTED_OFFSET + MC_PHASES * MAX_BLOCKS * 8 <= DATA_OFFSET);

/// Environment variables that turn multicast off whatever the configuration says, and the
/// values that do (compared case-insensitively).
pub const VETOES: [(&str, &[&str]); 4] = [
    ("NCCL_NVLS_ENABLE", &["0", "false", "no", "off"]),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", &["1", "true", "yes", "on"]),
    ("NVSHMEM_DISABLE_NVLS", &["1", "true", "yes", "on"]),
    ("SYMM_ALLREDUCE_MULTICAST", &["0", "false", "no", "off"]),
];

/// The first veto set in `env` (`"NCCL_NVLS_ENABLE=0 is set"`), if any.
pub(crate) fn veto(env: impl Fn(&str) -> Option<String>) -> Option<String> {
    VETOES.iter().find_map(|(name, values)| {
        let v = env(name)?;
        let t = v.trim().to_ascii_lowercase();
        values
            .contains(&t.as_str())
            .then(|| format!("{name}={v} is set (a multicast veto)"))
    })
}

/// The first veto of this process's environment.
pub(crate) fn env_veto() -> Option<String> {
    veto(|k| std::env::var(k).ok())
}

/// What one rank brings to the pipeline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request {
    pub(crate) mode: Multicast,
    pub(crate) ordinal: usize,
    /// The rank's workspace allocation (physical handle) and its size.
    pub(crate) memory: u64,
    pub(crate) memory_size: usize,
    /// Bytes from the start of the allocation the multimem kernels reach (signals through the
    /// end of the low-latency slots; the symmetric pool after them is not bound).
    pub(crate) needed: usize,
}

/// A live multicast object bound to every rank's allocation and mapped on this rank.
pub(crate) struct MulticastMapping {
    driver: Arc<dyn MulticastDriver>,
    mc: McHandle,
    va: u64,
    size: usize,
    ordinal: usize,
    granularity: (usize, usize),
    torn_down: bool,
}

impl std::fmt::Debug for MulticastMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MulticastMapping")
            .field("va", &format_args!("{:#x}", self.va))
            .field("size", &self.size)
            .field("granularity", &self.granularity)
            .finish()
    }
}

impl MulticastMapping {
    /// The multicast address of the bound allocations (offsets as in each allocation).
    pub(crate) fn address(&self) -> u64 {
        self.va
    }

    /// Bound bytes.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The agreed (minimum, recommended) granularity.
    pub(crate) fn granularity(&self) -> (usize, usize) {
        self.granularity
    }

    /// The collective close: every rank votes that its multimem kernels have finished (the
    /// caller synchronised its streams), then tears down locally. Returns the first error.
    pub(crate) fn close(mut self, bootstrap: &dyn Bootstrap) -> Result<()> {
        let voted = vote_soft(bootstrap, "multicast close", Ok(()));
        let torn = self.teardown();
        voted?.and(torn)
    }

    /// Unmap, unbind, release (each once; the first error is returned, the rest still run).
    fn teardown(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.torn_down, true) {
            return Ok(());
        }
        let unmapped = self.driver.unmap(self.va, self.size);
        let unbound = self.driver.unbind(self.mc, self.ordinal, self.size);
        let released = self.driver.release(self.mc);
        unmapped.and(unbound).and(released)
    }
}

impl Drop for MulticastMapping {
    /// Local teardown without the collective vote (see the module docs); errors are dropped.
    fn drop(&mut self) {
        let _ = self.teardown();
    }
}

/// The pipeline's result: a mapping, or why multicast is off (the same on every rank).
#[derive(Debug)]
pub(crate) enum Outcome {
    On(MulticastMapping),
    Off(String),
}

/// Minimum and recommended granularity, as exchanged.
struct Granularities(usize, usize);

impl Wire for Granularities {
    fn put(&self, w: &mut Writer) {
        w.put(&self.0).put(&self.1);
    }
    fn take(r: &mut Reader<'_>) -> Option<Self> {
        Some(Granularities(r.take()?, r.take()?))
    }
}

/// This rank's partial state while the steps run; dropping it unwinds in order.
struct Partial<'d> {
    driver: &'d Arc<dyn MulticastDriver>,
    ordinal: usize,
    mc: Option<McHandle>,
    bound: Option<usize>,
    mapped: Option<(u64, usize)>,
}

impl Partial<'_> {
    fn unwind(&mut self) {
        if let Some((va, size)) = self.mapped.take() {
            let _ = self.driver.unmap(va, size);
        }
        if let (Some(mc), Some(size)) = (self.mc, self.bound.take()) {
            let _ = self.driver.unbind(mc, self.ordinal, size);
        }
        if let Some(mc) = self.mc.take() {
            let _ = self.driver.release(mc);
        }
    }
}

impl Drop for Partial<'_> {
    fn drop(&mut self) {
        self.unwind();
    }
}

/// Runs the steps. `Ok(Outcome::Off(why))` when multicast is off on every rank (always with
/// `Auto`); `Err(Error::MulticastUnavailable)` instead with `Required`; any other `Err` means
/// the group itself is broken (an exchange failed).
pub(crate) fn establish(
    bootstrap: &dyn Bootstrap,
    driver: Arc<dyn MulticastDriver>,
    request: Request,
    veto: Option<String>,
) -> Result<Outcome> {
    let blocked = veto.is_some();
    let outcome = establish_steps(bootstrap, driver, request, veto);
    match &outcome {
        Ok(Outcome::On(m)) => crate::events::multicast(Ok(m.size()), false),
        Ok(Outcome::Off(why)) => crate::events::multicast(Err(why), blocked),
        Err(Error::MulticastUnavailable { reason }) => crate::events::multicast(Err(reason), blocked),
        Err(_) => {}
    }
    outcome
}

/// [`establish`] without its event.
fn establish_steps(
    bootstrap: &dyn Bootstrap,
    driver: Arc<dyn MulticastDriver>,
    request: Request,
    veto: Option<String>,
) -> Result<Outcome> {
    let off = |why: String| -> Result<Outcome> {
        match request.mode {
            Multicast::Required => Err(Error::MulticastUnavailable { reason: why }),
            _ => Ok(Outcome::Off(why)),
        }
    };
    // The mode is in the configuration fingerprint: the same on every rank, no vote needed.
    if request.mode == Multicast::Off {
        return Ok(Outcome::Off("Config::multicast is Off".into()));
    }
    let world = bootstrap.world();
    let rank = bootstrap.rank();
    let ordinal = request.ordinal;

    // 1. Eligibility: vetoes and the world size before any driver call; then the attribute.
    let eligible = match veto {
        Some(v) => Err(v),
        None if world < 2 => Err("the world has one rank (multicast needs at least 2)".to_string()),
        None => match driver.supported(ordinal) {
            Ok(true) => Ok(()),
            Ok(false) => Err(format!(
                "device {ordinal} reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0"
            )),
            Err(e) => Err(e.to_string()),
        },
    };
    let step =
        |name: &'static str, r: std::result::Result<(), String>| -> Result<std::result::Result<(), String>> {
            let outcome = r.map_err(|reason| Error::PeerSetupFailed {
                step: name,
                rank: Some(rank),
                reason,
            });
            Ok(vote_soft(bootstrap, name, outcome)?.map_err(|e| strip(&e, rank)))
        };
    if let Err(why) = step("multicast eligibility", eligible)? {
        return off(why);
    }

    let mut partial = Partial {
        driver: &driver,
        ordinal,
        mc: None,
        bound: None,
        mapped: None,
    };

    // 2. Granularity, agreed; the bound size rounded up to the largest minimum.
    let own = driver
        .granularity(ordinal, world, Granularity::Minimum)
        .and_then(|min| {
            Ok(Granularities(
                min,
                driver.granularity(ordinal, world, Granularity::Recommended)?,
            ))
        });
    let (own, local) = match own {
        Ok(g) => (g, Ok(())),
        Err(e) => (Granularities(1, 1), Err(e.to_string())),
    };
    if let Err(why) = step("multicast granularity", local)? {
        return off(why);
    }
    let mut agreed = (1usize, 1usize);
    for bytes in bootstrap.all_gather(&own.to_wire())? {
        let g = Granularities::from_wire(&bytes).ok_or_else(|| Error::malformed("multicast granularity"))?;
        agreed = (agreed.0.max(g.0), agreed.1.max(g.1));
    }
    let size = request.needed.next_multiple_of(agreed.0.max(1));
    if size > request.memory_size {
        // Same inputs on every rank (the allocation size is agreed): no vote needed.
        return off(format!(
            "the multicast object needs {size} bytes (the kernels' {} rounded to the multicast granularity \
             {}) but each workspace allocation has {}",
            request.needed, agreed.0, request.memory_size
        ));
    }

    // 3. Rank 0 creates and exports; everyone receives the descriptor.
    let exported: std::result::Result<OwnedFd, String> = if rank == 0 {
        driver
            .create(world, size)
            .and_then(|mc| {
                partial.mc = Some(mc);
                driver.export_fd(mc)
            })
            .map_err(|e| e.to_string())
    } else {
        placeholder_fd().map_err(|e| e.to_string())
    };
    let (fd, local) = match exported {
        Ok(fd) => (Some(fd), Ok(())),
        Err(why) => (None, Err(why)),
    };
    if let Err(why) = step("multicast create", local)? {
        return off(why);
    }
    let fd = fd.ok_or_else(|| Error::malformed("multicast setup order"))?;
    let mut fds = bootstrap.all_gather_fds(fd.as_fd())?;
    drop(fd);
    let object_fd = if fds.is_empty() {
        return Err(Error::malformed("multicast descriptor exchange"));
    } else {
        fds.swap_remove(0)
    };
    drop(fds);

    // 4. The others import.
    let imported = if rank == 0 {
        Ok(())
    } else {
        driver
            .import_fd(object_fd.as_fd())
            .map(|mc| partial.mc = Some(mc))
            .map_err(|e| e.to_string())
    };
    drop(object_fd);
    if let Err(why) = step("multicast import", imported)? {
        return off(why);
    }
    let mc = partial
        .mc
        .ok_or_else(|| Error::malformed("multicast setup order"))?;

    // 5. Every device added before any bind.
    let added = driver.add_device(mc, ordinal).map_err(|e| e.to_string());
    if let Err(why) = step("multicast add device", added)? {
        return off(why);
    }

    // 6. Each rank binds its own allocation.
    let bound = driver
        .bind_mem(mc, ordinal, request.memory, request.memory_size, size)
        .map(|()| partial.bound = Some(size))
        .map_err(|e| e.to_string());
    if let Err(why) = step("multicast bind", bound)? {
        return off(why);
    }

    // 7. Map with access.
    let mapped = driver
        .map(mc, ordinal, size, agreed.0.max(1))
        .map(|va| partial.mapped = Some((va, size)))
        .map_err(|e| e.to_string());
    if let Err(why) = step("multicast map", mapped)? {
        return off(why);
    }
    let (va, _) = partial
        .mapped
        .take()
        .ok_or_else(|| Error::malformed("multicast setup order"))?;
    partial.bound = None;
    partial.mc = None;
    drop(partial);
    Ok(Outcome::On(MulticastMapping {
        driver,
        mc,
        va,
        size,
        ordinal,
        granularity: agreed,
        torn_down: false,
    }))
}

/// The same sentence on every rank: the failing rank's own error text ("setup step
/// 'multicast bind' failed on rank 1: ..."), which is what its ballot carried to the others.
fn strip(e: &Error, rank: usize) -> String {
    match e {
        Error::PeerSetupFailed {
            rank: Some(r),
            reason,
            ..
        } if *r != rank => reason.clone(),
        other => other.to_string(),
    }
}

/// A descriptor for the ranks that have nothing to contribute to the fd all-gather.
fn placeholder_fd() -> Result<OwnedFd> {
    std::fs::File::open("/dev/null")
        .map(OwnedFd::from)
        .map_err(|e| Error::InvalidConfig(format!("open /dev/null: {e}")))
}

/// The multicast check for machines that must never create a multicast object: the real
/// attribute query of `ordinal` and then the eligibility step of the pipeline over an
/// in-process group of `world` ranks on that device, with a driver that refuses every call
/// but the attribute query (so it cannot create anything even where the attribute is 1).
/// Ignores the veto variables (it cannot go past the query). Returns `(attribute, the
/// sentence describe() prints after "multicast (NVLS): ")`. The driver must be initialised
/// (a context exists).
#[doc(hidden)]
pub fn probe_attribute_only(ordinal: usize, world: usize) -> Result<(bool, String)> {
    use crate::driver::multicast::AttributeOnly;
    let attribute = AttributeOnly.supported(ordinal)?;
    let hub = crate::bootstrap::LocalHub::new(world, std::time::Duration::from_secs(30));
    let outcomes: Vec<Result<Outcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let hub = hub.rank(rank);
                s.spawn(move || {
                    let request = Request {
                        mode: Multicast::Auto,
                        ordinal,
                        memory: 0,
                        memory_size: 0,
                        needed: 0,
                    };
                    establish(&hub, Arc::new(AttributeOnly), request, None)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::MulticastUnavailable {
                        reason: "a probe thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    let mut sentence = String::new();
    for o in outcomes {
        sentence = match o? {
            Outcome::On(_) => "on".into(),
            Outcome::Off(why) => format!("off ({why})"),
        };
    }
    Ok((attribute, sentence))
}

#[cfg(test)]
mod tests;
