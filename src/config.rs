//! Communicator settings: [`Config`], [`Algorithm`], their validation, the thresholds
//! `Auto` routes by (published, or from a measured [`TuningTable`] in [`tuning`]), and the
//! fingerprint every rank compares at setup. Every rank must use the same values.

mod tuning;

use std::ffi::OsString;
use std::time::Duration;

pub use crate::error::TuningProblem;
pub use tuning::{
    Crossovers, FusedCrossovers, Measured, TuningTable, TUNING_ENV, TUNING_FORMAT, TUNING_OLDEST_VERSION,
    TUNING_VERSION, VERSION,
};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::abi::{MAX_BLOCKS, MAX_RANKS};
use crate::wire::{Reader, Writer};

/// Which all-reduce to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Chosen by size, the same way on every rank: the low-latency kernel up to the
    /// low-latency threshold ([`Config::low_latency_max_bytes`], else the tuning table's, else
    /// 256 KiB for up to 4 ranks and 64 KiB above; the multimem low-latency kernel there when a
    /// multicast object is set up),
    /// the one-shot up to the one-shot crossover ([`Config::one_shot_max_bytes`], else the
    /// tuning table's, else 2 MiB for 2 ranks, 512 KiB for 3 or 4 and 256 KiB above), the
    /// two-shot above it (a lone rank: the two-shot above the low-latency limit), and NCCL above
    /// [`Config::nccl_above_bytes`] (or the tuning table's two-shot maximum) or above the
    /// capacity when the communicator has an NCCL fallback. With `Config::reproducible` off
    /// and multicast set up, the switch-reducing multimem kernels take the one-shot range and
    /// the symmetric calls above it. [`crate::Communicator::path`] says which, and why.
    #[default]
    Auto,
    /// Every rank reads every peer's whole input: one barrier, `(W-1)·S` bytes read per rank.
    OneShot,
    /// Reduce-scatter then all-gather, `2·(W-1)/W·S` bytes per rank: over the low-latency
    /// lines, without a barrier, where both halves of a shard (`2·⌈⌈S/16⌉/W⌉·16` bytes) fit
    /// the low-latency limit ([`Config::low_latency_limit`]) and the kernel's own bound (256
    /// KiB up to four ranks, 32 KiB above: S up to 512 KiB at W = 4, 128 KiB at W = 8), with
    /// two barriers above it (and for a lone rank).
    /// [`crate::Communicator::path`] names the kernel.
    TwoShot,
    /// One-shot without any barrier: every rank pushes its input into its slot of every
    /// peer's low-latency buffer, one 32-bit word per thread, and polls its own slots until
    /// no word reads as the all-ones "not arrived" sentinel, then sums in rank order (the
    /// other algorithms' bits) and re-arms them (`(W-1)·S` bytes pushed per rank: small
    /// messages).
    LowLatency,
    /// The NVLS multimem in-place two-shot: the NVSwitch reduces (`multimem.ld_reduce`, fp32
    /// accumulation) and broadcasts (`multimem.st`). Only for the zero-copy symmetric-buffer
    /// call, and only when a multicast object was set up (`Config::multicast`); the switch's
    /// summation order is unspecified (identical on every rank, not bit-identical to the peer
    /// kernels). As `Config::algorithm` it applies to symmetric calls; buffer calls then
    /// follow the size rule.
    Multimem,
    /// The NVLS one-shot for buffer calls: the input is copied into the rank's data buffer,
    /// then every rank reduces the whole message with `multimem.ld_reduce` (fp32 accumulation)
    /// through the multicast address. Needs a multicast object (`Config::multicast`); the
    /// switch's summation order is unspecified (not bit-identical to the peer kernels; every
    /// rank asks the switch for the same sum, which is expected but not documented to give
    /// the same bits on every rank), so `Auto` takes it only with `Config::reproducible` off.
    MultimemOneShot,
    /// The low-latency kernel with the push done by the NVSwitch: one multicast store per
    /// 16-byte line instead of one store per peer and 32-bit word. The readers sum in rank
    /// order, so its results are bit-identical to the peer kernels'; `Auto` takes it for small
    /// buffer calls whenever a multicast object is set up, `Config::reproducible` or not.
    MultimemLowLatency,
    /// `ncclAllReduce` through the communicator's NCCL fallback (only communicators created
    /// with one: [`crate::Communicator::from_nccl`], [`crate::Communicator::with_nccl_fallback`]).
    Nccl,
}

impl Algorithm {
    /// Every algorithm, `Auto` first (for bindings that pass an algorithm as its index here).
    pub const ALL: [Algorithm; 8] = [
        Algorithm::Auto,
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::LowLatency,
        Algorithm::Multimem,
        Algorithm::MultimemOneShot,
        Algorithm::MultimemLowLatency,
        Algorithm::Nccl,
    ];

    /// Lower-case name (`one_shot`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Auto => "auto",
            Algorithm::OneShot => "one_shot",
            Algorithm::TwoShot => "two_shot",
            Algorithm::LowLatency => "low_latency",
            Algorithm::Multimem => "multimem",
            Algorithm::MultimemOneShot => "multimem_one_shot",
            Algorithm::MultimemLowLatency => "multimem_low_latency",
            Algorithm::Nccl => "nccl",
        }
    }

    /// One of the NVLS algorithms (they need a multicast object; only the all-reduce has
    /// kernels for them).
    pub(crate) const fn is_multimem(self) -> bool {
        matches!(
            self,
            Algorithm::Multimem | Algorithm::MultimemOneShot | Algorithm::MultimemLowLatency
        )
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Algorithm::Auto),
            "one_shot" | "oneshot" => Ok(Algorithm::OneShot),
            "two_shot" | "twoshot" => Ok(Algorithm::TwoShot),
            "low_latency" | "ll" => Ok(Algorithm::LowLatency),
            "nccl" => Ok(Algorithm::Nccl),
            "multimem" | "nvls" => Ok(Algorithm::Multimem),
            "multimem_one_shot" | "nvls_one_shot" => Ok(Algorithm::MultimemOneShot),
            "multimem_low_latency" | "multimem_ll" | "nvls_ll" => Ok(Algorithm::MultimemLowLatency),
            _ => Err(format!(
                "unknown algorithm {s:?}: expected auto, low_latency (ll), one_shot, two_shot, multimem (nvls), \
                 multimem_one_shot, multimem_low_latency (multimem_ll) or nccl"
            )),
        }
    }
}

/// Whether to set up an NVLink multicast object (NVLS) for the multimem kernels
/// (docs/multicast.md). Whatever this says, multicast stays off when any of
/// `NCCL_NVLS_ENABLE=0`, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`, `NVSHMEM_DISABLE_NVLS=1` or
/// `SYMM_ALLREDUCE_MULTICAST=0` is set on any rank, and no multicast driver call is made when a
/// device reports `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Multicast {
    /// Never (no multicast driver call at all).
    #[default]
    Off,
    /// Set it up when every rank can; otherwise fall back to the peer kernels together and
    /// say why in `describe()`.
    Auto,
    /// Set it up or fail construction with [`Error::MulticastUnavailable`] naming the reason.
    Required,
}

impl Multicast {
    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Multicast::Off => "off",
            Multicast::Auto => "auto",
            Multicast::Required => "required",
        }
    }
}

/// Communicator settings. Every rank must use the same values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Largest message, in bytes, one call may reduce. Each rank allocates three times this
    /// (two data buffers used alternately and the zero-copy symmetric buffer), plus 128 KiB of
    /// signals, call state and divergence-check slots, plus the low-latency slots (`3 · world`
    /// slots, each the power of two at least eight times [`Config::low_latency_limit`] and at
    /// least 64 KiB), plus the symmetric
    /// pool ([`Config::pool_bytes`]), rounded up to the device granularity.
    pub capacity_bytes: usize,
    /// Algorithm used when a call does not force one.
    pub algorithm: Algorithm,
    /// `Auto` uses one-shot up to this many bytes (inclusive). `None`: the tuning table's
    /// crossover for the call's dtype and world, else the published crossovers, 2 MiB for 2
    /// ranks, 512 KiB for 3 or 4 and 256 KiB above.
    pub one_shot_max_bytes: Option<usize>,
    /// Most blocks one rank launches (1..=64, default 64). Fewer are used where the device
    /// cannot keep every rank's blocks resident at once (ranks sharing a GPU divide it), and
    /// small messages use fewer anyway (one thread per 16-byte pack). A lone rank moves
    /// 64 MiB at 0.81 × copy speed with 64 blocks, 0.54 × with 32 (H200, two-shot).
    pub max_blocks_per_rank: usize,
    /// Where ranks share a device (virtual ranks, or processes on one GPU under MPS), the
    /// percentage of its SMs that all their collective blocks together may take (1..=100,
    /// default 25): each rank launches at most `sms · percent / 100 / ranks` blocks (at least
    /// one). A collective waits on the device for its peers, and a peer on the same device may
    /// still be running the work queued before its own collective (a GEMM that needs many SMs
    /// at once); the share left free lets that work finish, so the peer gets to its
    /// collective. Measured with candle's tensor-parallel Llama at four virtual ranks on one
    /// H100 (132 SMs), batch 32: 33 blocks a rank stalled every run until the timeout, 8 ran
    /// every time. 100: the ranks' blocks may cover every SM, `sms / ranks` a rank (a
    /// benchmark of the collectives alone, with nothing else on the device: `symm-bench
    /// --virtual` uses it). No effect on a rank that has its device to itself.
    pub shared_sm_percent: u32,
    /// `Auto` uses the barrier-free low-latency kernel up to this many bytes (inclusive;
    /// `Some(0)` turns it off). `None`: the tuning table's threshold for the call's dtype and
    /// world, else the published one, 256 KiB for up to 4 ranks and 64 KiB above. Each rank
    /// reserves `3·W` slots of the power of two at least eight times
    /// [`Config::low_latency_limit`] (at least 64 KiB each): 12 MiB at W = 2, 24 MiB at
    /// W = 4, 12 MiB at W = 8 with the published values.
    pub low_latency_max_bytes: Option<usize>,
    /// Bound on every wait for a peer. Expiry poisons the communicator and surfaces as
    /// [`Error::PeerTimeout`].
    pub timeout: Duration,
    /// With an NCCL fallback, `Auto` calls of more than this many bytes go to NCCL. `None`:
    /// the tuning table's `two_shot` maximum for the call's dtype and world where it has one,
    /// else only calls above `capacity_bytes` do. Without a fallback this is ignored (the
    /// kernels take every call that fits `capacity_bytes`; [`crate::Communicator::path`] says so).
    pub nccl_above_bytes: Option<usize>,
    /// `false`: never set up the symmetric workspace; every call goes to the NCCL fallback
    /// (which the communicator must then have). For measuring NCCL behind the same API, and
    /// for testing the fallback where the kernels would run.
    pub peer_kernels: bool,
    /// Launch the peer kernels with Programmatic Dependent Launch where the device supports
    /// it (compute capability 9.0 and newer): a kernel's launch overlaps the end of the
    /// kernel before it on the stream, and it waits (`griddepcontrol.wait`) for that kernel
    /// to complete before it touches any memory. `false`: plain launches.
    pub pdl: bool,
    /// With PDL on, let the next kernel on the stream launch only when a collective kernel
    /// exits (its output complete), instead of once its first wait on the peers has passed.
    /// The default (`false`) overlaps the next kernel's launch with the end of the collective;
    /// it is safe for every consumer that waits (`griddepcontrol.wait`, as every kernel of
    /// this crate does) or that is launched without programmatic serialization (it then
    /// starts after the collective completes anyway). Set it when the next kernel is launched
    /// with programmatic serialization but reads the output without waiting (README,
    /// "Inside a decode step").
    pub pdl_at_exit: bool,
    /// With PDL on, let the next kernel on the stream launch as soon as a collective kernel
    /// has begun its call (passed its own `griddepcontrol.wait`), instead of once its last
    /// wait on the peers has passed: the next kernel's launch then overlaps the whole
    /// collective, not only its end. Consumers are affected exactly as by the default trigger
    /// (a consumer that waits sees the complete output). Takes effect only on a rank whose
    /// device no other rank of the communicator shares: where ranks share a device, the next
    /// kernel's blocks could take the multiprocessors a peer's collective still needs, and the
    /// collective would wait for that peer until the timeout. `Config::pdl_at_exit` wins over
    /// it. Default `true`; [`crate::Communicator::describe`] says which trigger each rank uses.
    pub early_trigger: bool,
    /// Launch the peer kernels in the remote memory-synchronisation domain
    /// (`CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN` = remote, as NCCL launches its kernels) where the
    /// device has domains (compute capability 9.0 and newer). A system-scope fence of a kernel
    /// (the `MEMBAR.SYS` of every barrier's release) then waits only for the memory traffic of
    /// its own domain, not for that of a GEMM running concurrently in the default domain. The
    /// kernels' cross-rank ordering is all at system scope, which orders across domains, and
    /// stream order and `griddepcontrol.wait` are unaffected. Off by default (`false`): its
    /// gain has not been measured here.
    pub remote_sync_domain: bool,
    /// Divergence check (a debugging aid, off by default; [`CHECK_ENV`]`=1` turns it on):
    /// before a kernel touches any
    /// data, every rank compares its call (length, dtype, algorithm, collective and call
    /// number) with every peer's; a mismatch is [`crate::Error::Diverged`] on every rank, naming
    /// both calls, and poisons the communicator. Costs one extra flag exchange per call.
    pub check_divergence: bool,
    /// `Auto`'s crossovers as measured on this machine (`symm-bench --tune` writes the
    /// table). `None`: the published starting points, unless the environment variable
    /// `SYMM_ALLREDUCE_TUNING` ([`TUNING_ENV`]) names a table file, which setup then loads
    /// on every rank. The explicit fields above (`one_shot_max_bytes`, `nccl_above_bytes`)
    /// win over the table. Every rank must use the same table: setup compares their digests
    /// and fails on every rank with [`Error::TuningMismatch`] when they differ.
    pub tuning: Option<TuningTable>,
    /// NVLink multicast (NVLS) for the multimem kernels: `Off` (default), `Auto` or
    /// `Required`; vetoed by environment variables whatever it says (see [`Multicast`]).
    pub multicast: Multicast,
    /// Bitwise reproducibility (default `true`): results never depend on an unspecified
    /// summation order, so `Auto` never routes to the multimem kernels that reduce in the
    /// switch (`Multimem`, `MultimemOneShot`: an unspecified order, not bit-identical to the
    /// peer kernels). The multimem low-latency kernel sums in rank order and is not affected.
    pub reproducible: bool,
    /// Bytes of the symmetric pool that [`crate::Communicator::alloc_symmetric`] carves
    /// buffers from (rounded up to 256 bytes; 0: no pool). Each rank allocates this much
    /// besides the workspace; every peer maps it. The pool does not grow (docs/pool.md).
    pub pool_bytes: usize,
    /// Register each rank's symmetric allocation (the symmetric buffer and the pool) as an
    /// NCCL window at setup (default `false`), on a communicator made by
    /// [`crate::Communicator::with_nccl_fallback`] with NCCL 2.27 or newer: calls routed to NCCL
    /// on those buffers then run NCCL's symmetric kernels where NCCL has one for the call
    /// (docs/nccl-windows.md). [`NCCL_WINDOWS_ENV`]`=1` turns it on, `=0` off.
    pub nccl_windows: bool,
}

/// The thresholds `Auto` routes one (dtype, world) by, resolved from the configuration and
/// the tuning table: plain numbers, found by an index (no allocation on the call path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Thresholds {
    /// Low-latency up to this (already capped by the slots).
    pub(crate) low_latency_max: usize,
    /// The two-shot over the low-latency lines above `low_latency_max` up to this, where a
    /// shard fits them (the tuning table's band; `None` without one, or when an explicit
    /// threshold field is set).
    pub(crate) two_shot_ll_max: Option<usize>,
    /// One-shot up to this.
    pub(crate) one_shot_max: usize,
    /// NCCL above this, with a fallback.
    pub(crate) nccl_above: Option<usize>,
    /// Whether the tuning table has an entry for this (dtype, world).
    pub(crate) tuned: bool,
}

/// How `Auto` splits the fused all-reduce + residual + RMSNorm call between its one-shot and
/// two-shot kernels, for one (dtype, world, hidden).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FusedLimit {
    /// One-shot up to this many bytes: `one_shot_max_bytes`, or the all-reduce's one-shot
    /// limit where the table has no fused entry for (dtype, world) (the published rule).
    Bytes(usize),
    /// One-shot up to `max` tokens: the tuning table's fused entry measured at `hidden`.
    Tokens {
        /// Largest one-shot token count.
        max: usize,
        /// The measured hidden size whose entry applies (the nearest to the call's).
        hidden: usize,
    },
}

/// Environment variable: `1` turns [`Config::check_divergence`] on. Read by every rank at
/// setup; the ranks compare their settings, so set it for all of them.
pub const CHECK_ENV: &str = "SYMM_ALLREDUCE_CHECK";

/// Environment variable: `1` turns [`Config::nccl_windows`] on, `0` off. Read by every rank at setup;
/// the ranks compare their settings, so set it for all of them.
pub const NCCL_WINDOWS_ENV: &str = "SYMM_ALLREDUCE_NCCL_WINDOWS";

impl Default for Config {
    fn default() -> Self {
        Config {
            capacity_bytes: 64 << 20,
            algorithm: Algorithm::Auto,
            one_shot_max_bytes: None,
            max_blocks_per_rank: MAX_BLOCKS,
            shared_sm_percent: 25,
            low_latency_max_bytes: None,
            timeout: Duration::from_secs(10),
            nccl_above_bytes: None,
            peer_kernels: true,
            pdl: true,
            pdl_at_exit: false,
            early_trigger: true,
            remote_sync_domain: false,
            check_divergence: false,
            tuning: None,
            multicast: Multicast::Off,
            reproducible: true,
            pool_bytes: 64 << 20,
            nccl_windows: false,
        }
    }
}

/// The published one-shot crossover (bytes, inclusive) for a world size. Two ranks: 2 MiB.
/// There the one-shot reads the peer's whole input once, the bytes the two-shot reads over its
/// two phases, with one barrier fewer (vLLM's custom all-reduce takes its one-stage kernel at
/// every size for two ranks). On one GPU, where the ranks' traffic shares one memory, the
/// one-shot measured faster up to 3 MiB (bf16; the tuning table's W = 2 rows) and the two-shot
/// faster at 4 MiB (docs/bench/h100-w2-virtual-v14), hence the bound. Three or four ranks:
/// 512 KiB; more: 256 KiB (the one-shot reads `(W-1)·S`, the two-shot `2·(W-1)/W·S`).
const fn published_one_shot_max(world: usize) -> usize {
    if world <= 2 {
        2 << 20
    } else if world <= 4 {
        512 << 10
    } else {
        256 << 10
    }
}

/// The published low-latency threshold (bytes, inclusive) for a world size: 256 KiB for up to
/// four ranks, 64 KiB above. The low-latency kernel pushes the `(W-1)·S` bytes the one-shot
/// reads, with no barrier, so it stays ahead while its polls are cheap. The committed tuning
/// rows (docs/tuning/h100-virtual-rows.csv: one H100, virtual ranks, bf16, chain of 10) have
/// it ahead of the one-shot at W = 4 up to 256 KiB (64 KiB 3.61 vs 5.89 µs, 256 KiB 5.72 vs
/// 6.68), at W = 2 likewise (128 KiB 2.79 vs 3.86, 256 KiB 3.78 vs 4.03) and at W = 8, where it
/// moves two words per thread, up to 64 KiB (48 KiB 5.53 vs 6.77, 64 KiB 5.80 vs 6.98); past
/// 64 KiB it takes 16-byte lines and loses (96 KiB 7.48 vs 6.99, 128 KiB 9.19 vs 7.78).
pub(crate) const fn published_low_latency_max(world: usize) -> usize {
    if world <= 4 {
        256 << 10
    } else {
        64 << 10
    }
}

impl Config {
    /// This configuration with the environment's switches applied ([`CHECK_ENV`],
    /// [`NCCL_WINDOWS_ENV`]); every constructor uses it, before the ranks compare their
    /// configurations.
    pub(crate) fn with_environment(mut self) -> Config {
        if std::env::var(CHECK_ENV).is_ok_and(|v| v == "1") {
            self.check_divergence = true;
        }
        match std::env::var(NCCL_WINDOWS_ENV).as_deref() {
            Ok("1") => self.nccl_windows = true,
            Ok("0") => self.nccl_windows = false,
            _ => {}
        }
        self
    }

    /// Checks ranges; called by every constructor.
    pub fn validate(&self) -> Result<()> {
        if self.capacity_bytes == 0 {
            return Err(Error::InvalidConfig("capacity_bytes must be at least 1".into()));
        }
        if self.capacity_bytes > (1usize << 40) {
            return Err(Error::InvalidConfig(format!(
                "capacity_bytes {} is above 1 TiB",
                self.capacity_bytes
            )));
        }
        if self.pool_bytes > (1usize << 40) {
            return Err(Error::InvalidConfig(format!(
                "pool_bytes {} is above 1 TiB",
                self.pool_bytes
            )));
        }
        if !(1..=MAX_BLOCKS).contains(&self.max_blocks_per_rank) {
            return Err(Error::InvalidConfig(format!(
                "max_blocks_per_rank must be in 1..={MAX_BLOCKS}, got {}",
                self.max_blocks_per_rank
            )));
        }
        if !(1..=100).contains(&self.shared_sm_percent) {
            return Err(Error::InvalidConfig(format!(
                "shared_sm_percent must be in 1..=100, got {}",
                self.shared_sm_percent
            )));
        }
        if self.timeout.is_zero() || self.timeout > Duration::from_secs(3600) {
            return Err(Error::InvalidConfig(format!(
                "timeout must be in (0, 1 h], got {:?}",
                self.timeout
            )));
        }
        if self.multicast == Multicast::Required && !self.peer_kernels {
            return Err(Error::InvalidConfig(
                "Config::multicast is Required but Config::peer_kernels is false: the multimem kernels \
                 run over the symmetric workspace"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Largest message the low-latency kernel takes at `world` ranks, and the size of its
    /// slots: `low_latency_max_bytes` (else the published threshold of `world`) or the tuning
    /// table's largest low-latency threshold, whichever is larger, never above the capacity.
    pub fn low_latency_limit(&self, world: usize) -> usize {
        let table = self.tuning.as_ref().map_or(0, TuningTable::max_low_latency_bytes);
        self.low_latency_max(None, world)
            .max(table)
            .min(self.capacity_bytes)
    }

    /// `low_latency_max_bytes`, else `tuned` (the tuning table's threshold where one applies),
    /// else the published threshold of `world`; never above the capacity.
    fn low_latency_max(&self, tuned: Option<usize>, world: usize) -> usize {
        self.low_latency_max_bytes
            .or(tuned)
            .unwrap_or(published_low_latency_max(world))
            .min(self.capacity_bytes)
    }

    /// `Auto`'s low-latency threshold for a call of `dtype` (explicit field, else the tuning
    /// table, else the published value) at `world` ranks; a byte collective without a dtype
    /// (the all-gather) takes the explicit field, else the published value.
    pub(crate) fn low_latency_threshold(&self, dtype: Option<DType>, world: usize) -> usize {
        match dtype {
            Some(d) => self.thresholds(d, world).low_latency_max,
            None => self.low_latency_max(None, world),
        }
    }

    /// The `Auto` one-shot crossover for a dtype and world size (explicit field, else the
    /// tuning table, else the published value).
    pub fn one_shot_limit(&self, dtype: DType, world: usize) -> usize {
        self.thresholds(dtype, world).one_shot_max
    }

    /// Where `Auto` splits the fused call of rows of `hidden` elements: the explicit
    /// `one_shot_max_bytes`, else the tuning table's fused entry of the nearest measured
    /// hidden size, else the all-reduce's one-shot limit. Pure and allocation-free.
    pub(crate) fn fused_limit(&self, dtype: DType, world: usize, hidden: usize) -> FusedLimit {
        let entry = self.tuning.as_ref().and_then(|t| t.fused(dtype, world, hidden));
        match (self.one_shot_max_bytes, entry) {
            (None, Some(e)) => FusedLimit::Tokens {
                max: e.one_shot_max_tokens,
                hidden: e.hidden,
            },
            _ => FusedLimit::Bytes(self.one_shot_limit(dtype, world)),
        }
    }

    /// Uses a measured tuning table for `Auto` (see [`Config::tuning`]). The low-latency
    /// slots grow to hold the table's largest low-latency threshold
    /// ([`Config::low_latency_limit`]).
    pub fn with_tuning(mut self, table: TuningTable) -> Config {
        self.tuning = Some(table);
        self
    }

    /// [`Config::with_tuning`] with the table in a file ([`TuningTable::load`]).
    pub fn with_tuning_file(self, path: impl AsRef<std::path::Path>) -> Result<Config> {
        Ok(self.with_tuning(TuningTable::load(path)?))
    }

    /// Setup's first step: without a table, loads the one `SYMM_ALLREDUCE_TUNING` names (if
    /// set and not empty). A file that cannot be used fails setup on every rank.
    pub(crate) fn load_tuning_from_env(&mut self) -> Result<()> {
        self.apply_env_tuning(std::env::var_os(TUNING_ENV))
    }

    fn apply_env_tuning(&mut self, value: Option<OsString>) -> Result<()> {
        match value {
            Some(path) if self.tuning.is_none() && !path.is_empty() => {
                *self = std::mem::take(self).with_tuning(TuningTable::load(path)?);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The thresholds `Auto` uses for one (dtype, world). Pure and allocation-free: the table
    /// was resolved into a dense array when it was built.
    pub(crate) fn thresholds(&self, dtype: DType, world: usize) -> Thresholds {
        let entry = self.tuning.as_ref().and_then(|t| t.get(dtype, world));
        let explicit = self.low_latency_max_bytes.is_some() || self.one_shot_max_bytes.is_some();
        Thresholds {
            low_latency_max: self.low_latency_max(entry.map(|e| e.low_latency_max_bytes), world),
            two_shot_ll_max: entry.and_then(|e| e.two_shot_ll_max_bytes).filter(|_| !explicit),
            one_shot_max: self
                .one_shot_max_bytes
                .or(entry.map(|e| e.one_shot_max_bytes))
                .unwrap_or(published_one_shot_max(world)),
            nccl_above: self.nccl_above_bytes.or(entry.and_then(|e| e.two_shot_max_bytes)),
            tuned: entry.is_some(),
        }
    }

    /// Which tuning table is in force, for `describe`: the published starting points, or the
    /// table's origin, digest and provenance, and the thresholds of each dtype at `world`.
    pub(crate) fn tuning_summary(&self, world: usize) -> String {
        let mut s = match &self.tuning {
            None => format!(
                "tuning: published starting points (no table; set {TUNING_ENV} or Config::with_tuning to use \
                 one measured by `symm-bench --tune`)"
            ),
            Some(t) => {
                let m = t.measured();
                format!(
                    "tuning: table {} (digest {}), measured on {} (driver {}, {} ranks) at {} by symm-allreduce {}",
                    t.origin()
                        .map_or_else(|| "given in memory".to_string(), |p| p.display().to_string()),
                    digest_hex(t.digest()),
                    m.device,
                    m.driver,
                    m.placement,
                    m.date,
                    m.crate_version
                )
            }
        };
        s += &format!("\n  Auto at W={world}:");
        for dtype in DType::ALL {
            let th = self.thresholds(dtype, world);
            s += &format!(
                " {dtype} low-latency <= {}, one-shot <= {}, NCCL above {}{};",
                th.low_latency_max,
                th.one_shot_max,
                th.nccl_above
                    .map_or_else(|| "capacity".to_string(), |n| n.to_string()),
                match (&self.tuning, th.tuned) {
                    (None, _) => "",
                    (Some(_), true) => " (table)",
                    (Some(_), false) => " (not in the table: published)",
                }
            );
        }
        s.pop();
        s += &format!("\n  fused all-reduce + residual + RMSNorm, Auto at W={world}:");
        for dtype in DType::ALL {
            let fused = self
                .tuning
                .as_ref()
                .map_or(&[][..], |t| t.fused_for(dtype, world));
            if fused.is_empty() || self.one_shot_max_bytes.is_some() {
                let why = match (&self.tuning, fused.is_empty()) {
                    (_, false) => "one_shot_max_bytes wins over the table",
                    (Some(t), true) if !t.fused_entries().is_empty() => "not in the table: the all-reduce's",
                    _ => "the all-reduce's",
                };
                s += &format!(
                    " {dtype} one-shot <= {} bytes ({why});",
                    self.one_shot_limit(dtype, world)
                );
            } else {
                let by_hidden: Vec<String> = fused
                    .iter()
                    .map(|f| format!("{} tokens at hidden {}", f.one_shot_max_tokens, f.hidden))
                    .collect();
                s += &format!(
                    " {dtype} one-shot <= {} (table; other hidden sizes: the nearest);",
                    by_hidden.join(", ")
                );
            }
        }
        s.pop();
        s
    }
}

/// A table digest as text (16 hex digits).
pub(crate) fn digest_hex(digest: u64) -> String {
    format!("{digest:016x}")
}

/// How a rank's tuning table is named in [`Error::TuningMismatch`], from its digest (0: no
/// table).
pub(crate) fn tuning_label(digest: u64) -> String {
    if digest == 0 {
        "the published starting points (no tuning table)".to_string()
    } else {
        format!("tuning table {}", digest_hex(digest))
    }
}

/// The tuning digests in two fingerprints, when they differ (`None`: the same table, or a
/// fingerprint that does not parse).
pub(crate) fn tuning_disagreement(ours: &[u8], theirs: &[u8]) -> Option<(u64, u64)> {
    let digest = |f: &[u8]| {
        let mut r = Reader::new(f);
        let _rest: Vec<u8> = r.take()?;
        let d: u64 = r.take()?;
        r.is_empty().then_some(d)
    };
    match (digest(ours)?, digest(theirs)?) {
        (a, b) if a != b => Some((a, b)),
        _ => None,
    }
}

/// Checks a world size.
pub fn validate_world(world: usize) -> Result<()> {
    if (1..=MAX_RANKS).contains(&world) {
        Ok(())
    } else {
        Err(Error::InvalidWorldSize {
            world,
            reason: format!("supported world sizes are 1..={MAX_RANKS}"),
        })
    }
}

impl Config {
    /// The bytes every rank compares at setup: the fields, then the tuning table's digest (0
    /// without a table), so that [`tuning_disagreement`] can tell a table mismatch apart.
    /// Built by destructuring, so a field added to `Config` does not compile until it is part
    /// of the comparison.
    pub(crate) fn fingerprint(&self) -> Vec<u8> {
        let Config {
            capacity_bytes,
            algorithm,
            one_shot_max_bytes,
            max_blocks_per_rank,
            shared_sm_percent,
            low_latency_max_bytes,
            timeout,
            nccl_above_bytes,
            peer_kernels,
            pdl,
            pdl_at_exit,
            early_trigger,
            remote_sync_domain,
            check_divergence,
            tuning,
            multicast,
            reproducible,
            pool_bytes,
            nccl_windows,
        } = self;
        let mut w = Writer::with_capacity(64);
        w.put(capacity_bytes)
            .put(&(*algorithm as u8))
            .put(one_shot_max_bytes)
            .put(max_blocks_per_rank)
            .put(shared_sm_percent)
            .put(low_latency_max_bytes)
            .put(&(timeout.as_nanos().min(u64::MAX as u128) as u64))
            .put(nccl_above_bytes)
            .put(peer_kernels)
            .put(pdl)
            .put(pdl_at_exit)
            .put(early_trigger)
            .put(remote_sync_domain)
            .put(check_divergence)
            .put(&(*multicast as u8))
            .put(reproducible)
            .put(pool_bytes)
            .put(nccl_windows);
        let fields = w.finish();
        let digest = tuning.as_ref().map_or(0u64, TuningTable::digest);
        Writer::with_capacity(fields.len() + 16)
            .put(&fields)
            .put(&digest)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_ranges_are_checked() {
        assert!(Config::default().validate().is_ok());
        for bad in [
            Config {
                capacity_bytes: 0,
                ..Config::default()
            },
            Config {
                max_blocks_per_rank: 0,
                ..Config::default()
            },
            Config {
                max_blocks_per_rank: 65,
                ..Config::default()
            },
            Config {
                shared_sm_percent: 0,
                ..Config::default()
            },
            Config {
                shared_sm_percent: 101,
                ..Config::default()
            },
            Config {
                timeout: Duration::ZERO,
                ..Config::default()
            },
            Config {
                pool_bytes: (1 << 40) + 1,
                ..Config::default()
            },
        ] {
            assert!(matches!(bad.validate(), Err(Error::InvalidConfig(_))), "{bad:?}");
        }
        assert!(validate_world(0).is_err());
        assert!(validate_world(9).is_err());
        for w in 1..=8 {
            validate_world(w).unwrap();
        }
    }

    #[test]
    fn every_field_changes_the_fingerprint() {
        let base = Config::default();
        let variants = [
            Config {
                capacity_bytes: 1 << 20,
                ..base.clone()
            },
            Config {
                algorithm: Algorithm::TwoShot,
                ..base.clone()
            },
            Config {
                one_shot_max_bytes: Some(1),
                ..base.clone()
            },
            Config {
                max_blocks_per_rank: 7,
                ..base.clone()
            },
            Config {
                low_latency_max_bytes: Some(0),
                ..base.clone()
            },
            Config {
                timeout: Duration::from_millis(1),
                ..base.clone()
            },
            Config {
                nccl_above_bytes: Some(0),
                ..base.clone()
            },
            Config {
                peer_kernels: false,
                ..base.clone()
            },
            Config {
                pdl: false,
                ..base.clone()
            },
            Config {
                remote_sync_domain: true,
                ..base.clone()
            },
            Config {
                check_divergence: true,
                ..base.clone()
            },
            base.clone().with_tuning(test_table(1 << 20)),
            Config {
                multicast: Multicast::Auto,
                ..base.clone()
            },
            Config {
                multicast: Multicast::Required,
                ..base.clone()
            },
            Config {
                reproducible: false,
                ..base.clone()
            },
            Config {
                pool_bytes: 1 << 20,
                ..base.clone()
            },
        ];
        for v in &variants {
            assert_ne!(v.fingerprint(), base.fingerprint(), "{v:?}");
        }
        assert_eq!(base.fingerprint(), Config::default().fingerprint());
        // Two tables that differ in one threshold differ in the fingerprint, and only there.
        let a = base.clone().with_tuning(test_table(1 << 20)).fingerprint();
        let b = base.clone().with_tuning(test_table(2 << 20)).fingerprint();
        let (da, db) = tuning_disagreement(&a, &b).unwrap();
        assert_ne!(da, db);
        assert!(da != 0 && db != 0);
        assert_eq!(tuning_disagreement(&a, &a), None);
        assert_eq!(tuning_disagreement(&base.fingerprint(), &a).unwrap().0, 0);
        // Another field differs: no tuning disagreement to report.
        let other = Config {
            capacity_bytes: 1 << 20,
            ..base.clone()
        };
        assert_eq!(
            tuning_disagreement(&base.fingerprint(), &other.fingerprint()),
            None
        );
        assert_eq!(tuning_disagreement(&[1, 2, 3], &a), None);
    }

    /// A table with one entry, bf16 at W=8: low-latency up to 96 KiB, one-shot up to
    /// `one_shot`, two-shot up to 4 MiB, NCCL above.
    pub(crate) fn test_table(one_shot: usize) -> TuningTable {
        TuningTable::new(
            Measured {
                device: "Test GPU".into(),
                driver: "1".into(),
                date: "2026-12-03T00:00:00Z".into(),
                crate_version: VERSION.into(),
                placement: "virtual".into(),
                note: String::new(),
            },
            vec![Crossovers {
                dtype: DType::BF16,
                world: 8,
                low_latency_max_bytes: 96 << 10,
                two_shot_ll_max_bytes: None,
                one_shot_max_bytes: one_shot,
                two_shot_max_bytes: Some(4 << 20),
            }],
        )
        .unwrap()
    }

    #[test]
    fn thresholds_come_from_the_fields_then_the_table_then_the_published_values() {
        let published = Config::default();
        let th = published.thresholds(DType::BF16, 8);
        assert_eq!(
            (th.low_latency_max, th.one_shot_max, th.nccl_above, th.tuned),
            (64 << 10, 256 << 10, None, false)
        );
        assert_eq!(published.thresholds(DType::F32, 4).one_shot_max, 512 << 10);
        assert_eq!(published.one_shot_limit(DType::F16, 2), 2 << 20);
        assert_eq!(published.one_shot_limit(DType::F16, 3), 512 << 10);
        // The low-latency threshold (and the slots) by world: 256 KiB up to 4 ranks, 64 KiB above.
        for (world, ll) in [
            (1, 256 << 10),
            (2, 256 << 10),
            (3, 256 << 10),
            (4, 256 << 10),
            (5, 64 << 10),
            (8, 64 << 10),
        ] {
            assert_eq!(
                published.thresholds(DType::F32, world).low_latency_max,
                ll,
                "W={world}"
            );
            assert_eq!(published.low_latency_threshold(None, world), ll, "W={world}");
            assert_eq!(published.low_latency_limit(world), ll, "W={world}");
        }

        let tuned = Config::default().with_tuning(test_table(1 << 20));
        // The slots grow to hold the table's low-latency threshold.
        assert_eq!(tuned.low_latency_limit(8), 96 << 10);
        assert_eq!(published.low_latency_limit(8), 64 << 10);
        assert_eq!(tuned.low_latency_limit(4), 256 << 10);
        let th = tuned.thresholds(DType::BF16, 8);
        assert_eq!(
            (th.low_latency_max, th.one_shot_max, th.nccl_above, th.tuned),
            (96 << 10, 1 << 20, Some(4 << 20), true)
        );
        // Not in the table: the published values (other dtype, other world), the slots'
        // growth notwithstanding.
        let f16 = tuned.thresholds(DType::F16, 8);
        assert_eq!(
            (f16.low_latency_max, f16.one_shot_max, f16.nccl_above, f16.tuned),
            (64 << 10, 256 << 10, None, false)
        );
        assert_eq!(tuned.thresholds(DType::BF16, 4).one_shot_max, 512 << 10);
        // Explicit fields win over the table.
        let explicit = Config {
            one_shot_max_bytes: Some(100 << 10),
            nccl_above_bytes: Some(8 << 20),
            low_latency_max_bytes: Some(16 << 10),
            ..tuned.clone()
        };
        let th = explicit.thresholds(DType::BF16, 8);
        assert_eq!(
            (th.low_latency_max, th.one_shot_max, th.nccl_above),
            (16 << 10, 100 << 10, Some(8 << 20))
        );
        // The slots still hold the table's threshold (a forced low-latency call may use it).
        assert_eq!(explicit.low_latency_limit(8), 96 << 10);
        // Larger configured slots stay; the capacity caps everything.
        let big = Config {
            low_latency_max_bytes: Some(1 << 20),
            ..Config::default()
        }
        .with_tuning(test_table(1 << 20));
        assert_eq!(big.low_latency_limit(8), 1 << 20);
        assert_eq!(big.thresholds(DType::BF16, 8).low_latency_max, 1 << 20);
        assert_eq!(big.thresholds(DType::F16, 8).low_latency_max, 1 << 20);
        let small = Config {
            capacity_bytes: 4096,
            ..tuned.clone()
        };
        assert_eq!(small.low_latency_limit(8), 4096);
        assert_eq!(small.thresholds(DType::BF16, 8).low_latency_max, 4096);
        assert_eq!(small.low_latency_threshold(None, 2), 4096);
    }

    #[test]
    fn the_environment_variable_loads_a_table_only_without_one() {
        let dir = std::env::temp_dir().join(format!("symm-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("table.json");
        std::fs::write(&path, test_table(1 << 20).to_json()).unwrap();

        let mut c = Config::default();
        c.apply_env_tuning(Some(path.clone().into())).unwrap();
        let t = c.tuning.as_ref().unwrap();
        assert_eq!(t.origin(), Some(path.as_path()));
        assert_eq!(t.digest(), test_table(1 << 20).digest());
        assert_eq!(c.low_latency_limit(8), 96 << 10);

        // An explicit table wins; unset or empty changes nothing.
        let mut explicit = Config::default().with_tuning(test_table(2 << 20));
        let before = explicit.clone();
        explicit.apply_env_tuning(Some(path.clone().into())).unwrap();
        assert_eq!(explicit, before);
        let mut plain = Config::default();
        plain.apply_env_tuning(None).unwrap();
        plain.apply_env_tuning(Some(OsString::new())).unwrap();
        assert_eq!(plain, Config::default());

        // A file that cannot be used is a typed error naming it.
        let bad = dir.join("bad.json");
        std::fs::write(
            &bad,
            test_table(1 << 20)
                .to_json()
                .replace(&format!("\"version\": {TUNING_VERSION}"), "\"version\": 7"),
        )
        .unwrap();
        let e = Config::default().apply_env_tuning(Some(bad.into())).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidTuning { problem: TuningProblem::WrongVersion { found: 7, .. }, table } if table.ends_with("bad.json")),
            "{e}"
        );
        assert!(matches!(
            Config::default().apply_env_tuning(Some(dir.join("none.json").into())),
            Err(Error::InvalidTuning {
                problem: TuningProblem::Io { .. },
                ..
            })
        ));
        assert!(Config::default().with_tuning_file(dir.join("none.json")).is_err());
        assert_eq!(
            Config::default()
                .with_tuning_file(&path)
                .unwrap()
                .tuning
                .unwrap()
                .origin(),
            Some(path.as_path())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_summary_names_the_table_in_force() {
        let s = Config::default().tuning_summary(8);
        assert!(s.starts_with("tuning: published starting points"), "{s}");
        assert!(
            s.contains("bf16 low-latency <= 65536, one-shot <= 262144, NCCL above capacity"),
            "{s}"
        );
        let t = test_table(1 << 20);
        let s = Config::default().with_tuning(t.clone()).tuning_summary(8);
        assert!(s.contains(&format!("digest {}", digest_hex(t.digest()))), "{s}");
        assert!(
            s.contains("measured on Test GPU (driver 1, virtual ranks)"),
            "{s}"
        );
        assert!(
            s.contains("bf16 low-latency <= 98304, one-shot <= 1048576, NCCL above 4194304 (table)"),
            "{s}"
        );
        assert!(
            s.contains("f16 low-latency <= 65536, one-shot <= 262144, NCCL above capacity (not in the table: published)"),
            "{s}"
        );
        // The fused call's split: the all-reduce's one-shot limit in bytes without fused
        // entries, the token limits per measured hidden size with them.
        assert!(
            s.contains("fused all-reduce + residual + RMSNorm, Auto at W=8: f32 one-shot <= 262144 bytes (the all-reduce's);"),
            "{s}"
        );
        let fused = |hidden, one_shot_max_tokens| FusedCrossovers {
            dtype: DType::BF16,
            world: 8,
            hidden,
            one_shot_max_tokens,
        };
        let with_fused = t
            .clone()
            .with_fused(vec![fused(8192, 16), fused(4096, 48)])
            .unwrap();
        let s = Config::default()
            .with_tuning(with_fused.clone())
            .tuning_summary(8);
        assert!(
            s.contains("bf16 one-shot <= 48 tokens at hidden 4096, 16 tokens at hidden 8192 (table; other hidden sizes: the nearest)"),
            "{s}"
        );
        assert!(
            s.contains("f16 one-shot <= 262144 bytes (not in the table: the all-reduce's)"),
            "{s}"
        );
        let explicit = Config {
            one_shot_max_bytes: Some(1000),
            ..Config::default().with_tuning(with_fused)
        };
        assert!(
            explicit
                .tuning_summary(8)
                .contains("bf16 one-shot <= 1000 bytes (one_shot_max_bytes wins over the table)"),
            "{}",
            explicit.tuning_summary(8)
        );
        assert!(tuning_label(0).contains("published"));
        assert!(tuning_label(t.digest()).contains(&digest_hex(t.digest())));
    }

    #[test]
    fn algorithm_names_round_trip_and_the_error_lists_all() {
        // Fails to compile when `Algorithm` gains a variant: add it to `Algorithm::ALL` too.
        let _: fn(Algorithm) = |a| match a {
            Algorithm::Auto
            | Algorithm::OneShot
            | Algorithm::TwoShot
            | Algorithm::LowLatency
            | Algorithm::Multimem
            | Algorithm::MultimemOneShot
            | Algorithm::MultimemLowLatency
            | Algorithm::Nccl => {}
        };
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
            assert!(
                "bogus".parse::<Algorithm>().unwrap_err().contains(a.name()),
                "{a}"
            );
        }
        assert_eq!("ll".parse::<Algorithm>().unwrap(), Algorithm::LowLatency);
        assert_eq!(
            "multimem_ll".parse::<Algorithm>().unwrap(),
            Algorithm::MultimemLowLatency
        );
    }
}
