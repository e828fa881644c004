//! The peer-kernel data path: the symmetric workspace, the error word its kernels report
//! through, the kernel table, and the argument block every launch passes.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaFunction, CudaStream};

use crate::config::Config;
use crate::driver::host::ErrorWord;
use crate::error::{Error, Result};
use crate::kernels::abi::{decode_error, SymmArgs};
use crate::kernels::launch;
use crate::kernels::registry::Kernel;
use crate::kernels::Kernels;
use crate::plan::validate::CallShape;
use crate::plan::Plan;
use crate::symmetric::{Layout, Workspace, DATA_OFFSET, SIGNAL_OFFSET, STATE_OFFSET};

/// The symmetric workspace and the kernels that use it.
#[derive(Debug)]
pub(crate) struct PeerBackend {
    // Field order is drop order: unmap before freeing the error word. The workspace is shared
    // with the symmetric pool's buffers, which keep it mapped while they live.
    workspace: Arc<Workspace>,
    error: ErrorWord,
    kernels: Kernels,
    args: SymmArgs,
}

impl PeerBackend {
    pub(crate) fn new(
        workspace: Workspace,
        error: ErrorWord,
        kernels: Kernels,
        rank: usize,
        world: usize,
        config: &Config,
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
            pool_tag: 0,
        };
        PeerBackend {
            workspace: Arc::new(workspace),
            error,
            kernels,
            args,
        }
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
            code => Some(decode_error(code, self.args.rank as usize, timeout)),
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
        let args = SymmArgs {
            pool_tag,
            ..self.args
        };
        self.launch_function(
            func,
            plan,
            (call.input_addr, call.output_addr, call.input_len),
            &args,
            stream,
        )
    }

    /// Launches the body-less kernel with `plan`'s grid.
    pub(crate) fn launch_empty(&self, plan: Plan, stream: &CudaStream) -> Result<()> {
        self.launch_function(self.kernels.empty(), plan, (0, 0, 0), &self.args, stream)
    }

    fn launch_function(
        &self,
        func: &CudaFunction,
        plan: Plan,
        (input, output, len): (u64, u64, usize),
        args: &SymmArgs,
        stream: &CudaStream,
    ) -> Result<()> {
        // SAFETY: every kernel of the table (and the empty one) takes (const T*, T*, u64,
        // SymmArgs) with T the table column's dtype; the caller validated the ranges; the
        // workspace and the error word in `args` outlive the launch because the communicator's
        // Drop synchronises before they are released.
        unsafe {
            launch::launch(
                func,
                (plan.blocks, plan.threads),
                input,
                output,
                len,
                args,
                stream,
            )
        }
    }
}
