#!/usr/bin/env bash
# Call a: the Python hot path's pieces (micro.py), the fused suite with the grouped fused
# low-latency kernel, and tp_decode with forced low-latency rows sharing a cluster.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
L=$OUT/ca; mkdir -p $L/tp $L/suite
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt; lscpu | grep -i "model name" >> $L/gpu.txt
tar -xJf .gpux/gpu.tar.xz
B=.gpu/bin; TP=$B/example-tp_decode
mkdir -p .gpux/x && python3 -m zipfile -e .gpux/wheels/symm_allreduce-*.whl .gpux/x
PIN="taskset -c 2,3"; $PIN true || PIN=""
PYTHONPATH=.gpux/x $PIN timeout 150 python3 .gpux/micro.py > $L/micro.log 2>&1; echo "micro rc=$? t=$((SECONDS-T0))"
cat $L/micro.log
timeout 200 $B/test-gpu_fused --test-threads=1 > $L/suite/test-gpu_fused.log 2>&1; echo "gpu_fused rc=$? t=$((SECONDS-T0))"
grep -hE "^test |^test result|FAILED|panicked" $L/suite/*.log | head -30
for h in 4096 8192; do
  timeout 60 $TP --world 8 --hidden $h --batch 1,2,4,8 --steps 100 --layers 4 > $L/tp/h$h.log 2>&1; echo "tp h$h rc=$? t=$((SECONDS-T0))"
  grep -E "^batch|forced|alone per call" $L/tp/h$h.log
done
echo "total t=$((SECONDS-T0))"
