#!/usr/bin/env bash
# Call A: the per-world low-latency threshold. symm-bench Auto with the published thresholds
# (new) beside Auto with `--low-latency-max 32K` (the former published value for every world:
# the same kernels, the former routing), W = 2, 4, 8; the collectives at W = 4; then the Rust
# GPU suites that the routing reaches.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
L=$OUT/a; mkdir -p $L/sweep $L/coll $L/suite
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
tar -xJf .gpux/gpu.tar.xz
B=.gpu/bin
SIZES=1K,4K,8K,32K,48K,64K,96K,128K,192K,256K,512K,1M,4M
for w in 4 2 8; do
  for v in new old; do
    X=""; [ $v = old ] && X="--low-latency-max 32K"
    timeout 80 $B/bin-symm-bench --world $w --virtual --dtype bf16,f32 --sizes $SIZES --algos auto $X \
      --modes graph_amortised,graph_isolated --out $L/sweep/w$w-$v > /dev/null 2> $L/sweep/w$w-$v.err || echo "sweep fail $w $v"
  done
  echo "sweep w$w t=$((SECONDS-T0))"
done
for v in new old; do
  X=""; [ $v = old ] && X="--low-latency-max 32K"
  timeout 60 $B/bin-symm-bench --world 4 --virtual --dtype bf16 --sizes 64K,128K,256K,512K,1M \
    --collectives all_gather,reduce_scatter --algos auto $X --modes graph_amortised \
    --out $L/coll/w4-$v > /dev/null 2> $L/coll/w4-$v.err || echo "coll fail $v"
done
echo "coll t=$((SECONDS-T0))"
cd $OUT && tar czf a1.tgz a && cd - > /dev/null
for t in agreement gpu_all_reduce gpu_pool gpu_collectives gpu_fused gpu_tuning protocol multiprocess reliability gpu_candle gpu_nccl_windows symm_allreduce symm-bench symm_allreduce_candle tracing_setup no_alloc multicast; do
  left=$((${LIMIT:-590}-(SECONDS-T0))); [ $left -gt 5 ] || { echo "no time for $t"; continue; }
  f=$B/test-$t; [ -x $f ] || { echo "missing $f"; continue; }
  timeout $left $f --test-threads=1 > $L/suite/test-$t.log 2>&1; echo "$t rc=$? t=$((SECONDS-T0))"
done
grep -hE "test result|FAILED|panicked" $L/suite/*.log | sort | uniq -c | head -30
cd $OUT && tar czf a2.tgz a/suite; rm -rf a
echo "total t=$((SECONDS-T0))"
