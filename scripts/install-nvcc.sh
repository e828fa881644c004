#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler from PyPI into .toolchain/nvcc (ignored by git), and
# cuobjdump with nvdisasm into .toolchain/cuobjdump (the SASS checks).
# No GPU and no CUDA toolkit are needed. The versions match the GPU machine's driver
# (CUDA 13.0): newer PTX would not JIT there.
#
#   bash scripts/install-nvcc.sh        # then build.rs finds .toolchain/nvcc/nvidia/cu13/bin/nvcc
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.toolchain/nvcc"
nvcc="$dest/nvidia/cu13/bin/nvcc"
if [ -x "$nvcc" ] && "$nvcc" --version | grep -q "V13.0.88" && [ -f "$dest/nvidia/cu13/include/nvtx3/nvToolsExt.h" ]; then
  echo "nvcc already installed: $nvcc"
else
  rm -rf "$dest"
  mkdir -p "$dest"
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --target "$dest" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 \
    nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88 nvidia-nvtx==13.0.85
  "$nvcc" --version | tail -n 2
  echo "nvcc installed: $nvcc"
fi

# cuobjdump and nvdisasm, for the SASS checks of tests/kernel_code.rs (about 6 MiB). No 13.0
# release of them is on PyPI; 13.2 reads the 13.0 cubins.
tools="$root/.toolchain/cuobjdump"
cuobjdump="$tools/nvidia/cu13/bin/cuobjdump"
if [ -x "$cuobjdump" ] && [ -x "$tools/nvidia/cu13/bin/nvdisasm" ]; then
  echo "cuobjdump already installed: $cuobjdump"
  exit 0
fi
rm -rf "$tools"
mkdir -p "$tools"
python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
  --target "$tools" nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.86
echo "cuobjdump installed: $cuobjdump"
