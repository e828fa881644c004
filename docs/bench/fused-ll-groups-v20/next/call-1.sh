#!/usr/bin/env bash
# The first device call of run v21 (docs/bench/fused-ll-groups-v21): the landed tree's fused suite; the
# Python bench beside symm-bench (eager host time, pinned to two CPUs, two rounds); tp_decode of
# the landed build beside the variants A-D of build-variants.sh; the variants' fused suites, D first.
# Needs in .gpux: gpu.tar.xz (GPU_STAGE_PACK=1 bash scripts/gpu-stage.sh), variants.tar.xz
# (build-variants.sh) and the wheel (python3 -m maturin build --release -m python/Cargo.toml
# -o .gpux/wheels). Run there as: bash .gpux/call-1.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
left() { echo $(( 570 - (SECONDS - T0) )); }
L=$OUT/c1; mkdir -p $L/tp $L/suite $L/host
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt; lscpu | grep -i "model name" >> $L/gpu.txt
cat $L/gpu.txt
tar -xJf .gpux/gpu.tar.xz; tar -xJf .gpux/variants.tar.xz
echo "untar t=$((SECONDS-T0))"
B=.gpu/bin; X=$B/bin-symm-bench
(python3 -m pip install --quiet --no-deps --force-reinstall .gpux/wheels/symm_allreduce-*.whl > $L/pip.log 2>&1; echo "pip rc=$?" >> $L/pip.log) &
timeout 150 $B/test-gpu_fused --test-threads=1 > $L/suite/landed-gpu_fused.log 2>&1; echo "landed gpu_fused rc=$? t=$((SECONDS-T0))"
grep -hE "^test |^test result|FAILED|panicked" $L/suite/landed-gpu_fused.log | head -20
wait; cat $L/pip.log
PIN="taskset -c 2,3"; $PIN true || PIN=""
for r in 1 2; do
  [ $(left) -gt 90 ] || { echo "no time for host round $r"; break; }
  $PIN timeout 45 python3 -m symm_allreduce.bench --world 8 --dtype bf16 --sizes 8K,32K,512K,8M --modes eager \
    --csv $L/host/py-r$r.csv > $L/host/py-r$r.log 2>&1; echo "py r$r rc=$? t=$((SECONDS-T0))"
  $PIN timeout 30 $X --world 8 --virtual --dtype bf16 --sizes 8K,32K,512K,8M --algos auto \
    --modes eager --out $L/host/rust-r$r > $L/host/rust-r$r.log 2>&1; echo "rust r$r rc=$? t=$((SECONDS-T0))"
done
cat $L/host/py-r1.log $L/host/py-r2.log
for h in 4096 8192; do
  for v in landed A B C D; do
    TP=$B/example-tp_decode; [ $v = landed ] || TP=.gpuv/$v/tp_decode
    timeout 40 $TP --world 8 --hidden $h --batch 1,2,8,32 --steps 100 --layers 4 > $L/tp/$v-h$h.log 2>&1; echo "tp $v h$h rc=$? t=$((SECONDS-T0))"
    grep -E "^batch|forced|alone per call" $L/tp/$v-h$h.log
  done
done
for v in D C B A; do
  [ $(left) -gt 70 ] || { echo "no time for suite $v"; break; }
  timeout $(( $(left) - 10 )) .gpuv/$v/test-gpu_fused --test-threads=1 > $L/suite/$v-gpu_fused.log 2>&1; echo "$v gpu_fused rc=$? t=$((SECONDS-T0))"
  grep -hE "^test result|FAILED|panicked" $L/suite/$v-gpu_fused.log | head -10
done
echo "total t=$((SECONDS-T0))"
