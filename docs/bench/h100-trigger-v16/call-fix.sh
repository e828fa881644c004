#!/usr/bin/env bash
# The suites the low-latency two-shot reaches, after its gather's timeout attribution fix.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
T0=$SECONDS; L=$OUT/f; mkdir -p $L
mkdir -p /tmp/fx && tar -xJf .gpux/fix.tar.xz -C /tmp/fx
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu.txt
for t in gpu_all_reduce protocol gpu_collectives reliability agreement; do
  timeout 150 /tmp/fx/bin/test-$t --test-threads=1 > $L/test-$t.log 2>&1; echo "$t rc=$? t=$((SECONDS-T0))"
done
for w in 3 8; do timeout 30 /tmp/fx/bin/symm-bench --world $w --virtual --dtype bf16,f32 --sizes 1K,7K,100K,500K \
  --algos two_shot,auto --modes graph_amortised --out $L/sb-w$w > /dev/null 2> $L/sb-w$w.err; echo "sb $w rc=$?"; done
grep -hE "test result|panicked" $L/*.log
cd $OUT && tar czf f.tgz f
