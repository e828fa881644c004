#!/usr/bin/env bash
# Second call: the four suites whose expectations followed the new thresholds (rebuilt).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
L=$OUT/f; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1
mkdir -p fix && tar -xJf .gpux/fix.tar.xz -C fix
for t in gpu_collectives gpu_tuning multiprocess gpu_pool; do
  timeout 100 fix/bin/test-$t --test-threads=1 > $L/test-$t.log 2>&1; echo "$t rc=$? t=$((SECONDS-T0))"
done
grep -hE "test result|FAILED|panicked" $L/*.log
cd $OUT && tar czf f.tgz f && rm -rf f
