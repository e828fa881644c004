//! The peer-kernel data path: the symmetric workspace, the error word its kernels report
//! through, the kernel table, and the argument block every launch passes.

use std::time::Duration;

use cudarc::driver::{CudaFunction, CudaStream};

use crate::config::Config;
use crate::driver::host::ErrorWord;
use crate::error::{Error, Result};
use crate::kernels::abi::{decode_error, SymmArgs};
use crate::kernels::launch;
use crate::kernels::norm_abi::NormArgs;
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
            code => Some(decode_error(code, self.args.rank as usize, timeout)),
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

    /// Launches a residual + RMSNorm kernel: a fused all-reduce one (`FusedOneShot`,
    /// `FusedTwoShot`, over the workspace) or the unfused epilogue (`RmsNorm`). The caller
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
        let args = (kernel != Kernel::RmsNorm).then_some(&self.args);
        // SAFETY: the fused kernels take (NormArgs, SymmArgs) and the unfused one (NormArgs),
        // with the table column's dtype; the caller validated the ranges; the workspace and
        // the error word in `args` outlive the launch (the communicator's Drop synchronises).
        unsafe { launch::launch_norm(func, (plan.blocks, plan.threads), norm, args, stream) }
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
