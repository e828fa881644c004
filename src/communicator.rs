//! `Communicator`: one rank of an all-reduce group. Validation, planning and the launch.

use std::cell::RefCell;
use std::ffi::c_void;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result, sys, CudaContext, CudaStream, DevicePtr, DevicePtrMut};

use crate::bootstrap::{vote, Bootstrap, LocalHub};
use crate::driver::host::ErrorWord;
use crate::driver::vmm::{self, Allocation};
use crate::dtype::{DType, Element};
use crate::error::{BarrierPhase, CudaResultExt, Error, Result};
use crate::kernels::{Kernels, SymmArgs};
use crate::plan::{self, Algorithm, CallShape, Config, Limits, Plan, THREADS_PER_BLOCK};
use crate::symmetric::{Layout, Workspace, DATA_OFFSET, SIGNAL_OFFSET, STATE_OFFSET};

const ERROR_PEER_TIMEOUT: u32 = 1;

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
/// Every call is asynchronous on the stream it is given and CUDA-graph capturable: it does no
/// allocation, no host synchronisation and no driver call other than the kernel launch.
#[derive(Debug)]
pub struct Communicator {
    // Field order is drop order: the workspace is unmapped only after `Drop` synchronised.
    workspace: Workspace,
    error: ErrorWord,
    kernels: Kernels,
    ctx: Arc<CudaContext>,
    args: SymmArgs,
    rank: usize,
    world: usize,
    limits: Limits,
    config: Config,
    poisoned: RefCell<Option<String>>,
}

impl Communicator {
    /// Creates a group of `contexts.len()` ranks in this process, rank r on `contexts[r]`.
    /// Ranks may share a device ("virtual ranks": each has its own mapping of every peer's
    /// memory and its own stream, and the kernels really synchronise across grids).
    ///
    /// Each rank is set up by [`Communicator::new`] on its own thread over an in-process
    /// [`LocalHub`]: every allocation is exported as a POSIX file descriptor and imported by
    /// every other rank, the same path separate processes take.
    pub fn local_group(contexts: &[Arc<CudaContext>], config: Config) -> Result<Vec<Communicator>> {
        config.validate()?;
        plan::validate_world(contexts.len())?;
        let hub = LocalHub::new(contexts.len(), config.timeout.max(Duration::from_secs(30)));
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
        if results.iter().any(Result::is_err) {
            let mut errors: Vec<Error> = results.into_iter().filter_map(Result::err).collect();
            let own = errors
                .iter()
                .position(|e| !matches!(e, Error::PeerSetupFailed { .. }));
            return Err(errors.swap_remove(own.unwrap_or(0)));
        }
        Ok(results.into_iter().map(|r| r.expect("checked above")).collect())
    }

    /// Collective constructor: every rank of `bootstrap` calls this at the same time with its
    /// own device context and the same `config`. Each step ends in a vote, so when any rank
    /// fails, all ranks return an error (none is left waiting).
    pub fn new(bootstrap: &dyn Bootstrap, ctx: Arc<CudaContext>, config: Config) -> Result<Communicator> {
        let rank = bootstrap.rank();
        let world = bootstrap.world();
        let local = ctx
            .bind_to_thread()
            .during("cuCtxSetCurrent")
            .and_then(|()| config.validate())
            .and_then(|()| plan::validate_world(world))
            .and_then(|()| check_device(&ctx))
            .and_then(|()| ctx.uuid().during("cuDeviceGetUuid"));
        let uuid = vote(bootstrap, "device check", local)?;

        // Everyone checks everyone's world size and configuration, and counts the ranks
        // sharing its device (their blocks must be resident together).
        let hello = Hello {
            world,
            device: uuid.bytes.map(|b| b as u8),
            config: config_fingerprint(&config),
        };
        let hellos = bootstrap.all_gather(&hello.encode())?;
        let hellos: Vec<Hello> = hellos.iter().map(|b| Hello::decode(b)).collect::<Result<_>>()?;
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
        let sharing = hellos.iter().filter(|h| h.device == hello.device).count();
        vote(
            bootstrap,
            "peer access",
            check_peer_access(&ctx, &hello.device, &hellos),
        )?;

        // Kernels, residency limits and granularity: agree on the minimum grid and the
        // largest granularity.
        let local = (|| -> Result<(Kernels, Limits, usize)> {
            let kernels = Kernels::load(&ctx)?;
            let sms = ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .during("cuDeviceGetAttribute")? as usize;
            let (one, two) = kernels.blocks_per_sm(THREADS_PER_BLOCK)?;
            let limits = Limits::from_occupancy(one, two, sms, sharing, &config)?;
            Ok((kernels, limits, vmm::granularity(ctx.ordinal())?))
        })();
        let (kernels, my_limits, my_granularity) = vote(bootstrap, "kernels and limits", local)?;
        let mut payload = Vec::with_capacity(24);
        for v in [
            my_limits.one_shot_blocks,
            my_limits.two_shot_blocks,
            my_granularity,
        ] {
            payload.extend_from_slice(&(v as u64).to_le_bytes());
        }
        let mut limits = my_limits;
        let mut granularity = my_granularity;
        for p in bootstrap.all_gather(&payload)? {
            let v = |i: usize| -> Result<usize> {
                p.get(i * 8..i * 8 + 8)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
                    .ok_or_else(|| malformed("limits"))
            };
            limits = limits.min(Limits {
                one_shot_blocks: v(0)?,
                two_shot_blocks: v(1)?,
            });
            granularity = granularity.max(v(2)?);
        }
        let layout = Layout::new(config.capacity_bytes, granularity);

        // This rank's memory, exported for the peers.
        let local =
            Allocation::create(ctx.ordinal(), layout.alloc_bytes).and_then(|a| Ok((a.export_fd()?, a)));
        let (fd, own) = vote(bootstrap, "allocation", local)?;
        let fds = bootstrap.all_gather_fds(fd.as_fd())?;
        drop(fd);

        // Import and map every peer, zero this rank's signals, and make that visible before
        // any rank's first kernel (the vote is the barrier).
        let local = (|| -> Result<(Workspace, ErrorWord)> {
            let mut peers = Vec::with_capacity(world - 1);
            for (q, fd) in fds.iter().enumerate() {
                if q != rank {
                    peers.push((q, Allocation::import_fd(fd.as_fd(), layout.alloc_bytes)?));
                }
            }
            let workspace = Workspace::map(rank, own, peers, layout, ctx.ordinal())?;
            let error = ErrorWord::new()?;
            ctx.synchronize().during("cuCtxSynchronize")?;
            Ok((workspace, error))
        })();
        let (workspace, error) = vote(bootstrap, "mapping", local)?;
        drop(fds);

        let args = SymmArgs {
            base: workspace.base(),
            stride: layout.alloc_bytes as u64,
            signal_offset: SIGNAL_OFFSET as u64,
            state_offset: STATE_OFFSET as u64,
            data_offset: DATA_OFFSET as u64,
            data_bytes: layout.data_bytes as u64,
            error: error.device_ptr(),
            timeout_ns: config.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: rank as u32,
            world: world as u32,
        };
        Ok(Communicator {
            workspace,
            error,
            kernels,
            ctx,
            args,
            rank,
            world,
            limits,
            config,
            poisoned: RefCell::new(None),
        })
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

    /// The agreed per-rank block limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Sizes of this rank's symmetric allocation.
    pub fn layout(&self) -> Layout {
        self.workspace.layout()
    }

    /// What a call of `len` elements of `dtype` would launch.
    pub fn plan(&self, len: usize, dtype: DType, algorithm: Algorithm) -> Plan {
        plan::plan_all_reduce(len, dtype, self.world, self.limits, &self.config, algorithm)
    }

    /// Sums `input` over all ranks into `output` (out of place), choosing the algorithm by
    /// size. All ranks must make the same sequence of calls with the same lengths.
    pub fn all_reduce<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.all_reduce_with(input, output, stream, Algorithm::Auto)
    }

    /// [`all_reduce`](Self::all_reduce) with a forced algorithm (`Auto` = the configured
    /// choice).
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
        let (in_ptr, _read) = input.device_ptr(stream);
        let (out_ptr, _write) = output.device_ptr_mut(stream);
        self.validate_and_launch(
            CallShape {
                input_addr: in_ptr,
                output_addr: out_ptr,
                ..shape
            },
            stream,
            algorithm,
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
        let (ptr, _write) = buffer.device_ptr_mut(stream);
        self.validate_and_launch(
            CallShape {
                dtype: T::DTYPE,
                input_len: len,
                output_len: len,
                input_addr: ptr,
                output_addr: ptr,
                input_device: device,
                output_device: device,
                stream_device: stream.context().ordinal(),
            },
            stream,
            algorithm,
        )
    }

    /// Device address of this rank's symmetric buffer: [`Layout::data_bytes`] bytes (at least
    /// `Config::capacity_bytes`), 16-byte aligned, mapped by every peer. Write the data to
    /// reduce there (from your own kernel's epilogue, or with
    /// [`copy_to_symmetric`](Self::copy_to_symmetric)), then call
    /// [`all_reduce_symmetric`](Self::all_reduce_symmetric), which skips the copy-in.
    pub fn symmetric_buffer(&self) -> u64 {
        self.workspace.symmetric_buffer(self.rank)
    }

    /// Sums the first `len` elements of every rank's symmetric buffer, in place, zero-copy:
    /// each rank reduces a 1/W slice from all peers and writes the sum into every rank's
    /// buffer, with a start and an end barrier. The buffer may be rewritten as soon as the
    /// call is complete on the stream. Same bits as [`all_reduce`](Self::all_reduce).
    pub fn all_reduce_symmetric<T: Element>(&self, len: usize, stream: &CudaStream) -> Result<()> {
        self.check_usable()?;
        let ptr = self.symmetric_buffer();
        plan::validate_call(
            &CallShape {
                dtype: T::DTYPE,
                input_len: len,
                output_len: len,
                input_addr: ptr,
                output_addr: ptr,
                input_device: self.device(),
                output_device: self.device(),
                stream_device: stream.context().ordinal(),
            },
            self.device(),
            self.config.capacity_bytes,
        )?;
        let plan = self.plan(len, T::DTYPE, Algorithm::TwoShot);
        self.launch(self.kernels.in_place(T::DTYPE), plan, ptr, ptr, len, stream)
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
        let shape = CallShape {
            dtype: T::DTYPE,
            input_len: len,
            output_len: len,
            input_addr: 0,
            output_addr: 0,
            input_device: device,
            output_device: device,
            stream_device: stream.context().ordinal(),
        };
        plan::validate_call(&shape, self.device(), self.workspace.layout().data_bytes)
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize, stream: &CudaStream) -> Result<()> {
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        // SAFETY: both ranges are device memory of this rank's device: one is the symmetric
        // buffer, the other a live cudarc buffer of `bytes` bytes; `check_symmetric_copy`
        // validated the devices and that `bytes` fits the symmetric buffer.
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
        let plan = self.plan(len, dtype, algorithm);
        self.launch(self.kernels.empty(), plan, 0, 0, len, stream)
    }

    /// Waits for `stream` and reports a timeout any earlier call hit.
    pub fn synchronize(&self, stream: &CudaStream) -> Result<()> {
        stream.synchronize().during("cuStreamSynchronize")?;
        self.check_usable()
    }

    /// Returns the error that made this communicator unusable, if any, without a CUDA call.
    pub fn check_usable(&self) -> Result<()> {
        if let Some(reason) = self.poisoned.borrow().as_ref() {
            return Err(Error::Poisoned {
                reason: reason.clone(),
            });
        }
        let code = self.error.read();
        if code == 0 {
            return Ok(());
        }
        let err = decode_error(code, self.rank, self.config.timeout);
        *self.poisoned.borrow_mut() = Some(err.to_string());
        Err(err)
    }

    fn validate_and_launch(&self, shape: CallShape, stream: &CudaStream, algorithm: Algorithm) -> Result<()> {
        plan::validate_call(&shape, self.device(), self.config.capacity_bytes)?;
        let plan = self.plan(shape.input_len, shape.dtype, algorithm);
        let func = self.kernels.get(plan.algorithm, shape.dtype);
        self.launch(
            func,
            plan,
            shape.input_addr,
            shape.output_addr,
            shape.input_len,
            stream,
        )
    }

    fn launch(
        &self,
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
        let mut args = self.args;
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
struct Hello {
    world: usize,
    device: [u8; 16],
    config: [u64; 5],
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64);
        b.extend_from_slice(&(self.world as u64).to_le_bytes());
        b.extend_from_slice(&self.device);
        for v in self.config {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    fn decode(b: &[u8]) -> Result<Hello> {
        if b.len() != 8 + 16 + 40 {
            return Err(malformed("hello"));
        }
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(Hello {
            world: word(0) as usize,
            device: b[8..24].try_into().expect("16 bytes"),
            config: [word(24), word(32), word(40), word(48), word(56)],
        })
    }
}

fn config_fingerprint(c: &Config) -> [u64; 5] {
    [
        c.capacity_bytes as u64,
        c.algorithm as u64,
        c.one_shot_max_bytes.map_or(u64::MAX, |b| b as u64),
        c.max_blocks_per_rank as u64,
        c.timeout.as_nanos().min(u64::MAX as u128) as u64,
    ]
}

fn malformed(what: &str) -> Error {
    Error::PeerSetupFailed {
        step: "bootstrap",
        rank: usize::MAX,
        reason: format!("malformed {what} message from a peer (mismatched crate versions?)"),
    }
}

fn decode_error(code: u32, rank: usize, timeout: Duration) -> Error {
    if code & 0xff == ERROR_PEER_TIMEOUT {
        let phase = match (code >> 8) & 0xff {
            0 => BarrierPhase::Start,
            1 => BarrierPhase::Middle,
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

/// Every peer on another device must be reachable peer-to-peer from this one. Peers whose
/// device this process cannot see are left to the mapping step (which fails if they are not).
fn check_peer_access(ctx: &CudaContext, mine: &[u8; 16], peers: &[Hello]) -> Result<()> {
    let count = result::device::get_count().during("cuDeviceGetCount")?;
    for peer in peers.iter().filter(|h| &h.device != mine) {
        for ordinal in 0..count {
            let dev = result::device::get(ordinal).during("cuDeviceGet")?;
            let uuid = result::device::get_uuid(dev).during("cuDeviceGetUuid")?;
            if uuid.bytes.map(|b| b as u8) != peer.device {
                continue;
            }
            let mut can = 0;
            // SAFETY: valid out-pointer and device handles from the driver.
            let code = unsafe { sys::cuDeviceCanAccessPeer(&mut can, ctx.cu_device(), dev) };
            crate::driver::check(code, "cuDeviceCanAccessPeer")?;
            if can == 0 {
                return Err(Error::Unsupported {
                    ordinal: ctx.ordinal(),
                    reason: format!(
                        "device {} cannot access device {ordinal} peer-to-peer",
                        ctx.ordinal()
                    ),
                });
            }
        }
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
    fn communicator_is_send_but_not_sync() {
        fn assert_send<T: Send>() {}
        assert_send::<Communicator>();
        // Not Sync: checked by the compile_fail doc test on `Communicator`.
    }
}
