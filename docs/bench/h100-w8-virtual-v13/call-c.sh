#!/usr/bin/env bash
# Call C: the fused low-latency kernel with both of a thread's first two words prefetched
# (new) against 6c7145d (mid), tp_decode alternating; then gpu_fused, protocol, agreement.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
L=$OUT/c; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1
tar -xJf .gpux/mini.tar.xz
A=.gpu/ab
for r in 1 2; do
  for h in 8192 4096; do
    for v in new mid; do
      b=$A/x-tp_decode; [ $v = mid ] && b=$A/tp-mid
      timeout 40 $b --world 8 --hidden $h --batch 1 --steps 200 --layers 4 > $L/tp-$v-h$h-r$r.log 2>&1 || echo "tp fail $v $h $r"
    done
  done
done
grep -h "alone per call: all" $L/tp-*.log | head -0
for f in $L/tp-*.log; do echo "$(basename $f): $(grep -E 'alone per call: all' $f)"; done
echo "tp t=$((SECONDS-T0))"
for t in gpu_fused protocol agreement; do
  timeout $((200-(SECONDS-T0))) $A/x-$t --test-threads=1 > $L/test-$t.log 2>&1; echo "$t rc=$? t=$((SECONDS-T0))"; grep -E "test result|GPU tests" $L/test-$t.log
done
cd $OUT && tar czf c.tgz c && rm -rf c
