#!/usr/bin/env bash
# Call A: A/B of the entry prefetch (814011f = old, this tree = new, 9ca53d2 = base of the
# round), the #27 sweep, tp_decode old/new, then every Rust GPU suite.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
L=$OUT/a; mkdir -p $L/readme $L/sweep $L/logs
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1
tar -xJf .gpux/gpu.tar.xz; tar -xJf .gpux/bench-at-commits.tar.xz; tar -xJf .gpux/tp-old.tar.xz
B=.gpu/bin
declare -A SB=([base]=.gpux/at/9ca53d2 [old]=.gpux/at/814011f [new]=$B/bin-symm-bench)
echo "start t=$((SECONDS-T0))"
for r in 1 2 3; do
  for v in new old base; do
    timeout 40 ${SB[$v]} --world 8 --virtual --dtype bf16 --sizes 1K,8K,32K,64K,128K,1M \
      --algos low_latency,one_shot,two_shot,pool,auto --modes graph_amortised,graph_isolated \
      --out $L/readme/r$r-$v > /dev/null 2> $L/readme/r$r-$v.err || echo "readme fail $r $v"
  done
done
echo "readme done t=$((SECONDS-T0))"
for r in 1 2; do
  for w in 8 4 2; do
    for v in new old base; do
      [ $((SECONDS-T0)) -lt 300 ] || break 3
      timeout 60 ${SB[$v]} --world $w --virtual --dtype bf16,f32 --sizes 1K,4K,8K,32K,64K,128K,256K,512K,1M,4M \
        --algos auto --modes graph_amortised,graph_isolated --out $L/sweep/r$r-w$w-$v > /dev/null 2> $L/sweep/r$r-w$w-$v.err || echo "sweep fail $r $w $v"
    done
  done
  echo "sweep round $r t=$((SECONDS-T0))"
done
for h in 8192 4096; do
  timeout 60 $B/example-tp_decode --world 8 --hidden $h --batch 1,8,32 --steps 100 --layers 4 > $L/logs/tp-new-h$h.log 2>&1 || echo "tp new fail $h"
  timeout 60 .gpux/tp-old --world 8 --hidden $h --batch 1,8,32 --steps 100 --layers 4 > $L/logs/tp-old-h$h.log 2>&1 || echo "tp old fail $h"
  grep -E 'alone per call' $L/logs/tp-*-h$h.log
done
echo "tp done t=$((SECONDS-T0))"
cd $OUT && tar czf a1.tgz a && cd - > /dev/null
OUT=$L/suite timeout $((590-(SECONDS-T0))) bash .gpu/run.sh > $L/logs/suite.log 2>&1; echo "suite rc=$? t=$((SECONDS-T0))"
grep -E "test result|FAILED|panicked" $L/logs/suite.log | sort | uniq -c | head -30
cd $OUT && tar czf a2.tgz a/logs a/suite 2>/dev/null; rm -rf a
echo "total t=$((SECONDS-T0))"
