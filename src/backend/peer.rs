//! The peer-kernel data path: the symmetric workspace, the error word its kernels report
//! through, the kernel table, and the argument block every launch passes.

use std::time::Duration;

use cudarc::driver::{CudaFunction, CudaStream};

use crate::config::Config;
use crate::driver::host::ErrorWord;
use crate::error::{Error, Result};
use crate::kernels::abi::SymmArgs;
use crate::kernels::coll::{self, GatherCounts};
use crate::kernels::launch;
use crate::kernels::registry::Kernel;
use crate::kernels::Kernels;
use crate::plan::validate::CallShape;
use crate::plan::Plan;
use crate::symmetric::{Layout, Workspace, DATA_OFFSET, SIGNAL_OFFSET, STATE_OFFSET};

/// The symmetric workspace and the kernels that use it.
#[derive(Debug)]
pub(crate) struct PeerBackend {
    // Field order is drop order: unmap before freeing the error word.
    workspace: Workspace,
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
        };
        PeerBackend {
            workspace,
            error,
            kernels,
            args,
        }
    }

    pub(crate) fn layout(&self) -> Layout {
        self.workspace.layout()
    }

    /// This rank's symmetric buffer.
    pub(crate) fn symmetric_buffer(&self) -> u64 {
        self.workspace.symmetric_buffer(self.args.rank as usize)
    }

    /// The error a kernel left for the host, if any (no CUDA call: also during capture).
    pub(crate) fn kernel_error(&self, timeout: Duration) -> Option<Error> {
        match self.error.read() {
            0 => None,
            code => Some(coll::decode(code, self.args.rank as usize, timeout)),
        }
    }

    /// Launches `kernel` over the call's buffers. The caller validated the shape (16-byte
    /// aligned buffers of `input_len` elements on this rank's device) and made the context
    /// current.
    pub(crate) fn launch(
        &self,
        kernel: Kernel,
        plan: Plan,
        call: &CallShape,
        stream: &CudaStream,
    ) -> Result<()> {
        let func = self.kernels.get(kernel, call.dtype)?;
        self.launch_function(
            func,
            plan,
            call.input_addr,
            call.output_addr,
            call.input_len,
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
        let func = self.kernels.get(Kernel::AllGather, crate::dtype::DType::F32)?;
        // SAFETY: the table's all-gather entries take (const T*, T*, u64, SymmArgs,
        // GatherCounts); the caller validated the ranges; the workspace and the error word
        // outlive the launch (the communicator's Drop synchronises first).
        unsafe {
            launch::launch_gather(
                func,
                (plan.blocks, plan.threads),
                input,
                output,
                &self.args,
                &counts,
                stream,
            )
        }
    }

    /// Launches the reduce-scatter kernel of `dtype`: `world · len` elements at `input`,
    /// this rank's `len` into `output`. The caller validated the ranges.
    pub(crate) fn launch_reduce_scatter(
        &self,
        plan: Plan,
        dtype: crate::dtype::DType,
        input: u64,
        output: u64,
        len: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let func = self.kernels.get(Kernel::ReduceScatter, dtype)?;
        self.launch_function(func, plan, input, output, len, stream)
    }

    /// Launches the body-less kernel with `plan`'s grid.
    pub(crate) fn launch_empty(&self, plan: Plan, stream: &CudaStream) -> Result<()> {
        self.launch_function(self.kernels.empty(), plan, 0, 0, 0, stream)
    }

    fn launch_function(
        &self,
        func: &CudaFunction,
        plan: Plan,
        input: u64,
        output: u64,
        len: usize,
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
                &self.args,
                stream,
            )
        }
    }
}
