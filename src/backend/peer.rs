//! The peer-kernel data path: the symmetric workspace, the error word its kernels report
//! through, the kernel table, and the argument block every launch passes.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaFunction, CudaStream};

use crate::config::Config;
use crate::driver::host::ErrorWord;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::abi::{
    call_ident, check_shape, fused_check_len, gather_check_len, ll_rotation, SymmArgs, BLOCK_STATE_BYTES,
    FLAG_CONSUMER_WAITS, FLAG_PDL_AT_EXIT, FLAG_PDL_EARLY, MAX_BLOCKS, THREADS_PER_BLOCK,
};
use crate::kernels::coll::{self, GatherCounts};
use crate::kernels::launch::{self, LaunchAttrs};
use crate::kernels::norm_abi::NormArgs;
use crate::kernels::registry::Kernel;
use crate::kernels::Kernels;
use crate::plan::validate::CallShape;
use crate::plan::Plan;
use crate::symmetric::multicast::{MulticastMapping, Outcome};
use crate::symmetric::{Layout, Workspace, DATA_OFFSET, SIGNAL_OFFSET, STATE_OFFSET};

/// What one launch runs: a kernel of the table (every collective, the fused and the unfused
/// norm kernels) or one of the helpers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Launched {
    Table(Kernel),
    /// The body-less kernel (the benchmark's launch floor).
    Empty,
    /// The protocol alone (the benchmark's sync floor).
    SyncFloor,
    /// One thread spinning (a late rank, in tests).
    Spin,
    /// The producer: launched as a user's GEMM would be, with no attribute.
    Produce,
    /// The test consumer: Programmatic Dependent Launch as configured (it stands for the
    /// kernel after a call), in the default memory-synchronisation domain.
    Consume,
}

impl Launched {
    /// The attributes this launch carries, given the ones `configured` (and supported by the
    /// device). Every kernel of the table and every helper but the producer and the consumer
    /// gets all of them: every one of those waits (`griddepcontrol.wait`) before it touches
    /// memory its predecessor may have written (tests/kernel_code.rs reads that in the SASS).
    pub(crate) fn attributes(self, configured: LaunchAttrs) -> LaunchAttrs {
        match self {
            Launched::Table(_) | Launched::Empty | Launched::SyncFloor | Launched::Spin => configured,
            Launched::Produce => LaunchAttrs::default(),
            Launched::Consume => LaunchAttrs {
                pdl: configured.pdl,
                remote_domain: false,
                cluster: 0,
            },
        }
    }
}

/// The symmetric workspace and the kernels that use it.
#[derive(Debug)]
pub(crate) struct PeerBackend {
    // Field order is drop order: the multicast object is unmapped, unbound and released
    // before the workspace's allocations; unmap before freeing the error word. The workspace
    // is shared with the symmetric pool's buffers, which keep it mapped while they live.
    /// The multicast object over every rank's allocation, or why there is none.
    multicast: std::result::Result<MulticastMapping, String>,
    workspace: Arc<Workspace>,
    error: ErrorWord,
    kernels: Arc<Kernels>,
    args: SymmArgs,
    /// The launch attributes configured and supported by the device: Programmatic Dependent
    /// Launch (`Config::pdl`) and the remote memory-synchronisation domain
    /// (`Config::remote_sync_domain`), each only on compute capability 9.0 and newer.
    attrs: LaunchAttrs,
    /// The divergence check is on (`Config::check_divergence` or `SYMM_ALLREDUCE_CHECK=1`).
    check: bool,
}

/// Where the kernels trigger the next launch (PDL), as `SymmArgs::flags` bits, for a rank whose
/// device `sharing` ranks use (itself included): at exit with `Config::pdl_at_exit`; as soon
/// as the call has begun with `Config::early_trigger` where this rank owns its device (the
/// next kernel's blocks can then only sit beside blocks that are all resident already); else
/// after the first wait on the peers: every peer's blocks of the call are resident by then, so
/// the next kernel's blocks never hold a multiprocessor a peer sharing the device still needs.
fn pdl_trigger_flags(config: &Config, sharing: usize) -> u32 {
    if config.pdl_at_exit {
        FLAG_PDL_AT_EXIT
    } else if config.early_trigger && sharing <= 1 {
        FLAG_PDL_EARLY
    } else {
        0
    }
}

impl PeerBackend {
    pub(crate) fn new(
        workspace: Workspace,
        error: ErrorWord,
        kernels: Arc<Kernels>,
        rank: usize,
        world: usize,
        config: &Config,
        sharing: usize,
    ) -> PeerBackend {
        let layout = workspace.layout();
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
            check_shape: 0,
            check_len: 0,
            pool_tag: 0,
            mc_base: 0,
            ident: 0,
            flags: pdl_trigger_flags(config, sharing),
            ll_rot: 0,
        };
        let attrs = LaunchAttrs {
            pdl: config.pdl && kernels.supports_pdl(),
            remote_domain: config.remote_sync_domain && kernels.supports_pdl(),
            cluster: 0,
        };
        let check = config.check_divergence;
        PeerBackend {
            multicast: Err("Config::multicast is Off".into()),
            workspace: Arc::new(workspace),
            error,
            kernels,
            args,
            attrs,
            check,
        }
    }

    /// Attaches the multicast pipeline's outcome (symmetric/multicast.rs): the multimem
    /// kernels find the multicast address in `SymmArgs::mc_base`.
    pub(crate) fn with_multicast(mut self, outcome: Outcome) -> Self {
        self.multicast = match outcome {
            Outcome::On(m) => Ok(m),
            Outcome::Off(why) => Err(why),
        };
        self.args.mc_base = self.multicast.as_ref().map_or(0, MulticastMapping::address);
        self
    }

    /// Takes the multicast mapping out (for the collective close); the backend keeps the
    /// reason "closed" (and launches no multimem kernel after it).
    pub(crate) fn take_multicast(&mut self) -> Option<MulticastMapping> {
        self.args.mc_base = 0;
        std::mem::replace(&mut self.multicast, Err("closed".into())).ok()
    }

    /// How this rank's kernels launch their successor (`Communicator::describe`).
    pub(crate) fn pdl_summary(&self) -> &'static str {
        if !self.attrs.pdl {
            return "off (Config::pdl is false, or the device is older than compute capability 9.0)";
        }
        match self.args.flags {
            f if f & FLAG_PDL_AT_EXIT != 0 => "on, the next kernel launches when a collective exits (Config::pdl_at_exit)",
            f if f & FLAG_PDL_EARLY != 0 => {
                "on, the next kernel launches as soon as a collective has begun (Config::early_trigger; this rank \
                 owns its device)"
            }
            _ => "on, the next kernel launches once a collective's first wait on the peers has passed",
        }
    }

    /// The multicast mapping, or why there is none.
    pub(crate) fn multicast(&self) -> std::result::Result<&MulticastMapping, &str> {
        self.multicast.as_ref().map_err(String::as_str)
    }

    pub(crate) fn layout(&self) -> Layout {
        self.workspace.layout()
    }

    /// The workspace, for the symmetric pool (its buffers keep it mapped).
    pub(crate) fn workspace(&self) -> &Arc<Workspace> {
        &self.workspace
    }

    /// This rank's symmetric buffer.
    pub(crate) fn symmetric_buffer(&self) -> u64 {
        self.workspace.symmetric_buffer(self.args.rank as usize)
    }

    /// The error a kernel left for the host, if any (no CUDA call: also during capture).
    pub(crate) fn kernel_error(&self, timeout: Duration) -> Option<Error> {
        match self.error.read() {
            0 => None,
            code => Some(coll::decode(
                code,
                self.args.rank as usize,
                self.error.record(),
                timeout,
            )),
        }
    }

    /// Launches `kernel` over the call's buffers, with a pool tag (kernels/pool.cuh; 0 off
    /// the pool: the zero-copy kernel compares it across ranks before touching the buffer).
    /// The caller validated the shape (buffers of `input_len` elements, aligned to their
    /// element, on this rank's device) and made the context current.
    pub(crate) fn launch_tagged(
        &self,
        kernel: Kernel,
        plan: Plan,
        call: &CallShape,
        pool_tag: u64,
        stream: &CudaStream,
    ) -> Result<()> {
        let func = self.kernels.get(kernel, call.dtype)?;
        // The multimem kernels reach every rank through the multicast address (mc_base).
        let multimem = matches!(
            kernel,
            Kernel::InPlaceMultimem | Kernel::OneShotMultimem | Kernel::LowLatencyMultimem
        );
        if let (true, Err(why)) = (multimem, &self.multicast) {
            return Err(Error::MulticastUnavailable { reason: why.clone() });
        }
        let args = self.call_args(Some(kernel), call.dtype, call.input_len as u64, pool_tag);
        self.launch_function(
            (func, Launched::Table(kernel)),
            plan,
            (call.input_addr, call.output_addr, call.input_len),
            args,
            stream,
        )
    }

    /// Clears the error word if it still holds `code` (a reported counts mismatch, which
    /// leaves the protocol consistent); a code a later kernel wrote meanwhile is kept.
    pub(crate) fn clear_error(&self, code: u32) {
        self.error.clear_if(code);
    }

    /// The error word's raw code (0: none).
    pub(crate) fn error_code(&self) -> u32 {
        self.error.read()
    }

    /// Launches the all-gather kernel: `counts` are the per-rank byte counts (this rank's
    /// bytes at `input`, the gathered bytes into `output`). The caller validated both ranges (16-byte aligned,
    /// this rank's device, the counts' sizes) and made the context current.
    pub(crate) fn launch_gather(
        &self,
        plan: Plan,
        input: u64,
        output: u64,
        counts: impl IntoIterator<Item = usize>,
        stream: &CudaStream,
    ) -> Result<()> {
        let counts = GatherCounts::from_bytes(counts);
        // Every dtype column holds the same byte kernel.
        let (kernel, column) = (Kernel::AllGather, DType::F32);
        let func = self.kernels.get(kernel, column)?;
        let args = self.call_args(Some(kernel), column, gather_check_len(&counts.bytes), 0);
        // SAFETY: the table's all-gather entries take (const T*, T*, u64, SymmArgs,
        // GatherCounts); the caller validated the ranges; the workspace and the error word
        // outlive the launch (the communicator's Drop synchronises first).
        unsafe {
            launch::launch_gather(
                func,
                (
                    plan.blocks,
                    plan.threads,
                    self.attributes(Launched::Table(kernel)),
                ),
                input,
                output,
                &args,
                &counts,
                stream,
            )
        }
    }

    /// Launches the low-latency all-gather: this rank's `chunk_bytes` at `input`, every
    /// rank's (rank-major) into `output`. The caller validated both ranges (16-byte aligned,
    /// this rank's device) and made the context current.
    pub(crate) fn launch_gather_low_latency(
        &self,
        plan: Plan,
        input: u64,
        output: u64,
        chunk_bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        // Every dtype column holds the same byte kernel; the length is in bytes.
        let (kernel, column) = (Kernel::AllGatherLowLatency, DType::F32);
        let func = self.kernels.get(kernel, column)?;
        let args = self.call_args(Some(kernel), column, chunk_bytes as u64, 0);
        self.launch_function(
            (func, Launched::Table(kernel)),
            plan,
            (input, output, chunk_bytes),
            args,
            stream,
        )
    }

    /// Launches a reduce-scatter kernel (`ReduceScatter` or `ReduceScatterLowLatency`) of
    /// `dtype`: `world · len` elements at `input`, this rank's `len` into `output`. The
    /// caller validated the ranges.
    pub(crate) fn launch_reduce_scatter(
        &self,
        kernel: Kernel,
        plan: Plan,
        dtype: DType,
        (input, output, len): (u64, u64, usize),
        stream: &CudaStream,
    ) -> Result<()> {
        let func = self.kernels.get(kernel, dtype)?;
        let args = self.call_args(Some(kernel), dtype, len as u64, 0);
        self.launch_function(
            (func, Launched::Table(kernel)),
            plan,
            (input, output, len),
            args,
            stream,
        )
    }

    /// Launches a residual + RMSNorm kernel: a fused all-reduce one (`FusedOneShot`,
    /// `FusedTwoShot`, `FusedLowLatency`, over the workspace) or the unfused epilogue (`RmsNorm`). The caller
    /// validated the shape (16-byte aligned buffers of `tokens × hidden` elements, `hidden`
    /// for the weight, on this rank's device, within the capacity for the fused kernels) and
    /// made the context current.
    pub(crate) fn launch_norm(
        &self,
        kernel: Kernel,
        plan: Plan,
        dtype: crate::dtype::DType,
        norm: &NormArgs,
        stream: &CudaStream,
    ) -> Result<()> {
        let func = self.kernels.get(kernel, dtype)?;
        let args = (kernel != Kernel::RmsNorm)
            .then(|| self.call_args(Some(kernel), dtype, fused_check_len(norm.tokens, norm.hidden), 0));
        let grid = (
            plan.blocks,
            plan.threads,
            self.attributes(Launched::Table(kernel))
                .with_cluster(plan.cluster),
        );
        let norm = NormArgs {
            cluster: plan.cluster.max(1),
            ..*norm
        };
        // SAFETY: the fused kernels take (NormArgs, SymmArgs) and the unfused one (NormArgs),
        // with the table column's dtype; the caller validated the ranges; the workspace and
        // the error word in `args` outlive the launch (the communicator's Drop synchronises);
        // the attributes are set only on devices of compute capability 9.0 and newer (a plan
        // has a cluster only where `PathFacts::clusters` said so: `plan/fused.rs`), and a
        // clustered plan's blocks are a multiple of its cluster.
        unsafe { launch::launch_norm(func, grid, &norm, args.as_ref(), stream) }
    }

    /// Launches the body-less kernel with `plan`'s grid.
    pub(crate) fn launch_empty(&self, plan: Plan, stream: &CudaStream) -> Result<()> {
        self.launch_function(
            (self.kernels.empty(), Launched::Empty),
            plan,
            (0, 0, 0),
            self.args,
            stream,
        )
    }

    /// Launches the protocol alone (one flag exchange per block) with `plan`'s grid: a call
    /// of the group like any other, so every rank must make it.
    pub(crate) fn launch_sync_floor(
        &self,
        plan: Plan,
        dtype: DType,
        len: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let args = self.call_args(None, dtype, len as u64, 0);
        let floor = (self.kernels.sync_floor(), Launched::SyncFloor);
        self.launch_function(floor, plan, (0, 0, len), args, stream)
    }

    /// The argument block of one call: the divergence check's announcement of a call of
    /// `kernel` (`None`: the sync floor) of `dtype` with length `len` (elements; bytes for the
    /// all-gathers; [`fused_check_len`] and [`gather_check_len`] for the fused call and the
    /// one-shot all-gather) when the check is on, and the pool tag (0 off the pool).
    fn call_args(&self, kernel: Option<Kernel>, dtype: DType, len: u64, pool_tag: u64) -> SymmArgs {
        SymmArgs {
            check_shape: if self.check { check_shape(kernel, dtype) } else { 0 },
            check_len: len,
            pool_tag,
            // The one-shot all-gather(-v) compares the ranks' counts itself before reading any
            // peer's data (CountsMismatch, which leaves the communicator usable): its
            // identity leaves the counts out, so that check, not the flags, reports them.
            ident: call_ident(
                kernel,
                dtype,
                if kernel == Some(Kernel::AllGather) { 0 } else { len },
            ),
            ll_rot: match kernel {
                Some(k) if k.is_low_latency() => ll_rotation(k, dtype, len, self.args.ll_slot_bytes),
                _ => 0,
            },
            ..self.args
        }
    }

    /// Holds `stream` for `ns` nanoseconds with one spinning thread.
    pub(crate) fn launch_spin(&self, ns: u64, stream: &CudaStream) -> Result<()> {
        let one = Plan {
            algorithm: crate::config::Algorithm::OneShot,
            blocks: 1,
            threads: 32,
            cluster: 1,
        };
        let spin = (self.kernels.spin(), Launched::Spin);
        self.launch_function(spin, one, (0, 0, ns as usize), self.args, stream)
    }

    /// Copies `bytes` from `src` to `dst` with the producer kernel, launched as an ordinary
    /// kernel (no Programmatic Dependent Launch, whatever `Config::pdl` says), as a user's GEMM
    /// would be. The caller validated that both are device ranges of at least `bytes` bytes on
    /// this rank's device and made the context current.
    pub(crate) fn launch_producer(
        &self,
        src: u64,
        dst: u64,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        // Enough blocks for one 16-byte access a thread, at most 1024 (then grid-stride).
        const MAX_BLOCKS: usize = 1024;
        let threads = THREADS_PER_BLOCK as usize;
        let blocks = bytes.div_ceil(16 * threads).clamp(1, MAX_BLOCKS) as u32;
        // SAFETY: the producer takes (const void*, void*, u64 bytes, SymmArgs) and reads
        // nothing of `args`; it handles any alignment (16-byte accesses only where both
        // addresses allow them); the caller validated `bytes` against both ranges and their
        // device.
        unsafe {
            launch::launch(
                self.kernels.produce(),
                (blocks, THREADS_PER_BLOCK, self.attributes(Launched::Produce)),
                src,
                dst,
                bytes,
                &self.args,
                stream,
            )
        }
    }

    /// Copies `bytes` from `src` to `dst` with the test consumer kernel, launched with
    /// programmatic serialization (when PDL is on), calling `griddepcontrol.wait` first only
    /// when `waits`. The caller validated both ranges and made the context current.
    pub(crate) fn launch_consumer(
        &self,
        src: u64,
        dst: u64,
        bytes: usize,
        waits: bool,
        stream: &CudaStream,
    ) -> Result<()> {
        const MAX_BLOCKS: usize = 1024;
        let threads = THREADS_PER_BLOCK as usize;
        let blocks = bytes.div_ceil(threads).clamp(1, MAX_BLOCKS) as u32;
        let args = SymmArgs {
            flags: if waits { FLAG_CONSUMER_WAITS } else { 0 },
            ..self.args
        };
        // SAFETY: the consumer takes (const void*, void*, u64 bytes, SymmArgs), reads only
        // `flags` of the arguments and copies byte by byte (any alignment); the caller
        // validated `bytes` against both ranges and their device.
        unsafe {
            launch::launch(
                self.kernels.consume(),
                (blocks, THREADS_PER_BLOCK, self.attributes(Launched::Consume)),
                src,
                dst,
                bytes,
                &args,
                stream,
            )
        }
    }

    /// Sets this rank's completed-call counter, in every block's entry of its call state
    /// (tests: the protocol near 2^31 and 2^32).
    pub(crate) fn set_call_counter(&self, calls: u64, stream: &CudaStream) -> Result<()> {
        let (state, _) = self.call_state_region();
        // SAFETY: the first 8 bytes of each of the MAX_BLOCKS 16-byte entries of this rank's
        // call state, mapped on its device.
        unsafe { launch::write_u64_strided(state, (BLOCK_STATE_BYTES, MAX_BLOCKS), calls, stream) }
    }

    /// The device range of this rank's call state: (address, bytes).
    pub(crate) fn call_state_region(&self) -> (u64, usize) {
        let state = self.workspace.base() + self.args.rank as u64 * self.args.stride + self.args.state_offset;
        (state, MAX_BLOCKS * BLOCK_STATE_BYTES)
    }

    /// The device range of this rank's low-latency slots: (address, bytes).
    pub(crate) fn low_latency_region(&self) -> (u64, usize) {
        let layout = self.layout();
        (
            self.workspace.base() + self.args.rank as u64 * self.args.stride + self.args.ll_offset,
            layout.ll_bytes(self.args.world as usize),
        )
    }

    /// Whether the device launches thread-block clusters (the fused low-latency kernel's rows
    /// over several blocks).
    pub(crate) fn clusters(&self) -> bool {
        self.kernels.clusters()
    }

    /// The launch attributes of `what`: the configured ones ([`Launched::attributes`]).
    fn attributes(&self, what: Launched) -> LaunchAttrs {
        what.attributes(self.attrs)
    }

    fn launch_function(
        &self,
        (func, what): (&CudaFunction, Launched),
        plan: Plan,
        (input, output, len): (u64, u64, usize),
        args: SymmArgs,
        stream: &CudaStream,
    ) -> Result<()> {
        // SAFETY: every kernel of the table (and the empty one) takes (const T*, T*, u64,
        // SymmArgs) with T the table column's dtype; the caller validated the ranges; the
        // workspace and the error word in `args` outlive the launch because the communicator's
        // Drop synchronises before they are released.
        unsafe {
            launch::launch(
                func,
                (plan.blocks, plan.threads, self.attributes(what)),
                input,
                output,
                len,
                &args,
                stream,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use cudarc::driver::sys::{CUlaunchAttributeID as Id, CUlaunchMemSyncDomain};

    use super::*;
    use crate::kernels::registry::KERNELS;

    /// The trigger follows the configuration and the device: early only where this rank owns
    /// its device and `pdl_at_exit` is off, at exit whenever `pdl_at_exit` is on.
    #[test]
    fn the_early_trigger_needs_a_device_of_its_own() {
        let config = |early_trigger, pdl_at_exit| Config {
            early_trigger,
            pdl_at_exit,
            ..Config::default()
        };
        assert!(Config::default().early_trigger);
        assert_eq!(pdl_trigger_flags(&config(true, false), 1), FLAG_PDL_EARLY);
        for sharing in [2, 3, 8] {
            assert_eq!(
                pdl_trigger_flags(&config(true, false), sharing),
                0,
                "{sharing} ranks on a device"
            );
        }
        assert_eq!(pdl_trigger_flags(&config(false, false), 1), 0);
        for (early, sharing) in [(true, 1), (true, 8), (false, 1)] {
            assert_eq!(pdl_trigger_flags(&config(early, true), sharing), FLAG_PDL_AT_EXIT);
        }
    }

    /// The driver attributes of `attrs`, as (id, value) in the order they are passed.
    fn driver(attrs: LaunchAttrs) -> Vec<(Id, i64)> {
        let (list, n) = attrs.driver();
        list[..n]
            .iter()
            .map(|a| {
                // SAFETY: the union member read is the one `driver()` set for this id.
                let value = unsafe {
                    match a.id {
                        Id::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION => {
                            i64::from(a.value.programmaticStreamSerializationAllowed)
                        }
                        Id::CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN => a.value.memSyncDomain as i64,
                        Id::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION => {
                            let d = a.value.clusterDim;
                            assert_eq!((d.y, d.z), (1, 1), "a cluster is a row of blocks");
                            i64::from(d.x)
                        }
                        other => panic!("unexpected launch attribute {other:?}"),
                    }
                };
                (a.id, value)
            })
            .collect()
    }

    /// Every launch path of the backend: every kernel of the table (the collectives, the
    /// all-gathers, the fused and unfused norm kernels) and the helpers.
    fn every_path() -> Vec<Launched> {
        KERNELS
            .iter()
            .map(|spec| Launched::Table(spec.kernel))
            .chain([
                Launched::Empty,
                Launched::SyncFloor,
                Launched::Spin,
                Launched::Produce,
                Launched::Consume,
            ])
            .collect()
    }

    #[test]
    fn every_launch_path_carries_pdl_and_the_configured_domain() {
        let pdl = (Id::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1);
        let remote = (
            Id::CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN,
            CUlaunchMemSyncDomain::CU_LAUNCH_MEM_SYNC_DOMAIN_REMOTE as i64,
        );
        let only_pdl = LaunchAttrs {
            pdl: true,
            remote_domain: false,
            cluster: 0,
        };
        let both = LaunchAttrs {
            pdl: true,
            remote_domain: true,
            cluster: 0,
        };
        for path in every_path() {
            let (with_pdl, with_both) = (driver(path.attributes(only_pdl)), driver(path.attributes(both)));
            match path {
                // Launched as a user's GEMM would be: no attribute, whatever is configured.
                Launched::Produce => {
                    assert!(with_pdl.is_empty() && with_both.is_empty(), "{path:?}")
                }
                // The kernel after a call: PDL as configured, the default domain.
                Launched::Consume => {
                    assert_eq!(with_pdl, [pdl], "{path:?}");
                    assert_eq!(with_both, [pdl], "{path:?}");
                }
                _ => {
                    assert_eq!(with_pdl, [pdl], "{path:?}");
                    assert_eq!(with_both, [pdl, remote], "{path:?}");
                }
            }
            // Nothing configured (PDL off, or a device older than 9.0): a plain launch.
            assert!(
                driver(path.attributes(LaunchAttrs::default())).is_empty(),
                "{path:?}"
            );
        }
        // The remote domain alone (PDL off) is passed alone.
        let domain_only = LaunchAttrs {
            pdl: false,
            remote_domain: true,
            cluster: 0,
        };
        assert_eq!(
            driver(Launched::Table(Kernel::FusedOneShot).attributes(domain_only)),
            [remote]
        );
        // A cluster of the fused low-latency kernel's plan travels beside the configured
        // attributes (`launch_norm`); a cluster of one is no attribute.
        let cluster = Id::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        for (blocks, expected) in [
            (0, vec![pdl, remote]),
            (1, vec![pdl, remote]),
            (8, vec![pdl, remote, (cluster, 8)]),
        ] {
            let attrs = Launched::Table(Kernel::FusedLowLatency).attributes(both);
            assert_eq!(driver(attrs.with_cluster(blocks)), expected, "cluster {blocks}");
        }
    }

    /// The attributes of every launch come from `Launched::attributes` (so the table test above
    /// covers every launch path; `kernels/launch.rs` checks that it has one launch helper).
    #[test]
    fn every_launch_takes_its_attributes_from_the_launch_table() {
        let peer = include_str!("peer.rs");
        let code: String = peer
            .split("#[cfg(test)]")
            .next()
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let calls = code.matches("launch::launch").count();
        // The gather, the norm, the producer, the consumer and `launch_function`.
        assert_eq!(
            calls, 5,
            "launch::launch, launch_gather, launch_norm calls in peer.rs"
        );
        // Every grid passed to a launch holds `self.attributes(…)`: directly (the gather, the
        // norm, the producer, the consumer) or through `launch_function` (everything else).
        assert_eq!(code.matches("self.attributes(").count(), calls);
        // `LaunchAttrs` values are built only in `new` (the configured ones) and in
        // `Launched::attributes`.
        let literals = code.matches("LaunchAttrs {").count() - code.matches("-> LaunchAttrs {").count();
        assert_eq!(literals, 2);
        assert_eq!(code.matches("LaunchAttrs::default()").count(), 1);
    }
}
