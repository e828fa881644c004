#!/usr/bin/env bash
# Builds the fused low-latency variants of the next device call beside the landed tree and
# packs them into .gpux/variants.tar.xz (.gpuv/<V>/{tp_decode,test-gpu_fused}, symbols
# stripped), for call-1.sh. Run from the repository root after
# `GPU_STAGE_PACK=1 bash scripts/gpu-stage.sh` (which stages the landed tree into .gpux).
#   A: ../grouped-kernel.patch (rows in groups, lines where words would give a thread more than two)
#   B: A with lines where words would give a thread more than one
#   C: the landed kernel, clusters shrunk until each takes one row (cluster-per-row-plan.patch)
#   D: B with C's plan
# Each variant is a detached worktree of HEAD under $VARIANTS (default /tmp/symm-variants),
# built into the repository's own target directory (the dependencies are reused).
set -euo pipefail
root=$(pwd)
here=docs/bench/fused-ll-groups-v20
base=${VARIANTS:-/tmp/symm-variants}
export PATH="$root/.toolchain/nvcc/nvidia/cu13/bin:$HOME/.cargo/bin:$PATH"
export SYMM_ALLREDUCE_REQUIRE_KERNELS=1 CARGO_TARGET_DIR="$root/target"
rm -rf .gpuv && mkdir -p .gpuv .gpux
for v in A B C D; do
    dir=$base/$v
    git worktree remove --force "$dir" 2>/dev/null || rm -rf "$dir"
    git worktree add --detach -q "$dir" HEAD
    (
        cd "$dir"
        case $v in A | B | D) git apply "$root/$here/grouped-kernel.patch" ;; esac
        case $v in B | D)
            # by_line from more than one word a thread instead of two
            sed -i 's/> 2ull \* blockDim.x;/> static_cast<uint64_t>(blockDim.x);/' kernels/fused_norm.cuh
            grep -q '> static_cast<uint64_t>(blockDim.x);' kernels/fused_norm.cuh
            ;;
        esac
        case $v in C | D) git apply "$root/$here/next/cluster-per-row-plan.patch" ;; esac
        cargo build --release --example tp_decode --test gpu_fused --message-format=json-render-diagnostics \
            > "$root/.gpuv/$v.json"
    )
    mkdir -p .gpuv/$v
    for kind in tp_decode gpu_fused; do
        exe=$(grep -o '"executable":"[^"]*/'"$kind"'[^"/]*"' .gpuv/$v.json | cut -d'"' -f4)
        name=$kind; [ $kind = gpu_fused ] && name=test-gpu_fused
        cp "$exe" .gpuv/$v/$name
    done
    strip --strip-debug .gpuv/$v/*
    rm .gpuv/$v.json
    git worktree remove --force "$dir"
    echo "built variant $v"
done
tar -cJf .gpux/variants.tar.xz .gpuv && rm -rf .gpuv
cp $here/next/call-1.sh .gpux/call-1.sh
echo "packed .gpux/variants.tar.xz; carry .gpux and run: bash .gpux/call-1.sh"
