#!/usr/bin/env bash
# The candle adapter (symm-allreduce-candle, issue 29) beside candle-core's `cuda` feature:
# clippy on the crate, its example and tests, its CPU tests (layout, dtype and device
# refusals; the GPU tests report themselves ignored, with the reason), and its docs.
#
# Its own cargo invocations (-p symm-allreduce-candle), not the workspace-wide ones: candle
# selects cudarc's `dynamic-linking`, and features unify across one invocation, so building
# it beside the core crate would link every core test binary against libcuda by name.
# candle-kernels compiles candle's CUDA kernels with nvcc in its build script: the pinned
# nvcc (scripts/install-nvcc.sh) for sm_90 only (CUDA_COMPUTE_CAP=90; there is no GPU to ask).
# The binaries link against the stand-ins of scripts/cuda-link-stubs.sh (same SONAMEs as the
# real libraries, which a GPU machine has instead).
#
#   bash .ci/candle.sh         (after scripts/install-nvcc.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

export PATH="$PWD/.toolchain/nvcc/nvidia/cu13/bin:$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
stubs=$(bash scripts/cuda-link-stubs.sh)
export LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

cargo clippy -p symm-allreduce-candle --all-targets -- -D warnings
echo "--- candle: clippy (candle-core with cuda, candle-kernels built) in $((SECONDS - start)) s"
cargo test -p symm-allreduce-candle
RUSTDOCFLAGS="-D warnings" cargo doc -p symm-allreduce-candle --no-deps
echo "--- candle: all steps in $((SECONDS - start)) s"
