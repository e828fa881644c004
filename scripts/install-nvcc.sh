#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler from PyPI into .toolchain/nvcc (ignored by git).
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
  exit 0
fi
rm -rf "$dest"
mkdir -p "$dest"
python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
  --target "$dest" \
  nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 \
  nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88 nvidia-nvtx==13.0.85
"$nvcc" --version | tail -n 2
echo "nvcc installed: $nvcc"
