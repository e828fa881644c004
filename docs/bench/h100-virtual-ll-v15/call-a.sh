#!/usr/bin/env bash
# Call A: the per-world low-latency threshold. symm-bench Auto with the published thresholds
# (new) beside Auto with `--low-latency-max 32K` (the former published value for every world:
# the same kernels, the former routing), W = 4, 2, 8; the collectives at W = 4; the pool
# calls' zero-copy kernels beside the copy-in one-shot; the Rust GPU suites.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
L=$OUT/a; mkdir -p $L/sweep $L/coll $L/pool $L/suite
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
tar -xJf .gpux/gpu.tar.xz
B=.gpu/bin
SIZES=1K,4K,8K,32K,48K,64K,96K,128K,192K,256K,512K,1M,4M
sweep() {
  for v in new old; do
    X=""; [ $v = old ] && X="--low-latency-max 32K"
    timeout 80 $B/bin-symm-bench --world $1 --virtual --dtype bf16,f32 --sizes $SIZES --algos auto $X \
      --modes graph_amortised,graph_isolated --out $L/sweep/w$1-$v > /dev/null 2> $L/sweep/w$1-$v.err || echo "sweep fail $1 $v"
  done
  echo "sweep w$1 t=$((SECONDS-T0))"
}
suites() {
  for t in "$@"; do
    left=$((${LIMIT:-590}-(SECONDS-T0))); [ $left -gt 5 ] || { echo "no time for $t"; continue; }
    f=$B/test-$t; [ -x $f ] || { echo "missing $f"; continue; }
    timeout $left $f --test-threads=1 > $L/suite/test-$t.log 2>&1; echo "$t rc=$? t=$((SECONDS-T0))"
  done
}
sweep 4; sweep 2
suites agreement gpu_all_reduce gpu_pool gpu_collectives gpu_fused
sweep 8
for v in new old; do
  X=""; [ $v = old ] && X="--low-latency-max 32K"
  timeout 60 $B/bin-symm-bench --world 4 --virtual --dtype bf16 --sizes 64K,128K,256K,512K,1M \
    --collectives all_gather,reduce_scatter --algos auto $X --modes graph_amortised \
    --out $L/coll/w4-$v > /dev/null 2> $L/coll/w4-$v.err || echo "coll fail $v"
done
echo "coll t=$((SECONDS-T0))"
for w in 8 4 2; do
  timeout 60 $B/bin-symm-bench --world $w --virtual --dtype bf16,f32 --sizes 48K,64K,128K,256K,512K,1M,2M \
    --algos pool,symmetric,one_shot,two_shot --modes graph_amortised --out $L/pool/w$w > /dev/null 2> $L/pool/w$w.err || echo "pool fail $w"
done
echo "pool t=$((SECONDS-T0))"
cd $OUT && tar czf a1.tgz a && cd - > /dev/null
suites gpu_tuning protocol multiprocess reliability gpu_candle gpu_nccl_windows symm_allreduce symm-bench symm_allreduce_candle tracing_setup no_alloc multicast
grep -hE "test result|FAILED|panicked" $L/suite/*.log | sort | uniq -c | head -30
cd $OUT && tar czf a2.tgz a/suite; rm -rf a
echo "total t=$((SECONDS-T0))"
