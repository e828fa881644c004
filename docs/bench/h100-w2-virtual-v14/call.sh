#!/usr/bin/env bash
# One call: new (this tree) vs old (ad00aae) -- two-shot prefetch, W=2 one-shot crossover
# sweep, tp_decode (fused weight stash) -- the Python bench beside symm-bench, then every
# Rust GPU suite (the CPU-only bootstrap/SASS suites run in CI).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
L=$OUT/a; mkdir -p $L/twoshot $L/sweep $L/py $L/logs $L/suite
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
tar -xJf .gpux/gpu.tar.xz; tar -xJf .gpux/bench-at-commits.tar.xz; xz -dkf .gpux/tp-old.xz; chmod +x .gpux/tp-old
B=.gpu/bin
declare -A SB=([old]=.gpux/at/ad00aae [new]=$B/bin-symm-bench)
python3 -m pip install --quiet --no-deps --force-reinstall .gpux/wheels/symm_allreduce-*.whl > $L/logs/pip.log 2>&1; echo "pip rc=$?"
echo "start t=$((SECONDS-T0))"
for r in 1 2; do
  for v in new old; do
    timeout 40 ${SB[$v]} --world 2 --virtual --dtype bf16 --sizes 256K,1M,4M --algos two_shot,one_shot \
      --modes graph_amortised --out $L/twoshot/w2-r$r-$v > /dev/null 2> $L/twoshot/w2-r$r-$v.err || echo "ts fail 2 $r $v"
    timeout 40 ${SB[$v]} --world 4 --virtual --dtype bf16 --sizes 1M,4M --algos two_shot \
      --modes graph_amortised --out $L/twoshot/w4-r$r-$v > /dev/null 2> $L/twoshot/w4-r$r-$v.err || echo "ts fail 4 $r $v"
    timeout 40 ${SB[$v]} --world 8 --virtual --dtype bf16 --sizes 1M,4M --algos two_shot,pool \
      --modes graph_amortised --out $L/twoshot/w8-r$r-$v > /dev/null 2> $L/twoshot/w8-r$r-$v.err || echo "ts fail 8 $r $v"
  done
done
echo "twoshot done t=$((SECONDS-T0))"
for r in 1; do
  for h in 8192 4096; do
    timeout 60 $B/example-tp_decode --world 8 --hidden $h --batch 1,8,32 --steps 100 --layers 4 > $L/logs/tp-new-h$h-r$r.log 2>&1 || echo "tp new fail $h"
    timeout 60 .gpux/tp-old --world 8 --hidden $h --batch 1,8,32 --steps 100 --layers 4 > $L/logs/tp-old-h$h-r$r.log 2>&1 || echo "tp old fail $h"
  done
done
grep -E 'alone per call:' $L/logs/tp-*.log
echo "tp done t=$((SECONDS-T0))"
for t in gpu_all_reduce gpu_fused gpu_tuning protocol agreement; do
  left=$((${LIMIT:-590}-(SECONDS-T0))); [ $left -gt 5 ] || { echo "no time for $t"; continue; }
  timeout $left $B/test-$t --test-threads=1 > $L/suite/test-$t.log 2>&1; echo "$t rc=$? t=$((SECONDS-T0))"
done
for w in 2; do
  r=1; [ -f $L/sweep/r1-w$w-new.csv ] && r=2
  for v in new old; do
    [ $((SECONDS-T0)) -lt 250 ] || break 2
    timeout 60 ${SB[$v]} --world $w --virtual --dtype bf16,f32 --sizes 1K,4K,8K,32K,64K,128K,256K,512K,1M,4M \
      --algos auto --modes graph_amortised,graph_isolated --out $L/sweep/r$r-w$w-$v > /dev/null 2> $L/sweep/r$r-w$w-$v.err || echo "sweep fail $r $w $v"
  done
  echo "sweep w$w t=$((SECONDS-T0))"
done
PIN="taskset -c 2,3"; $PIN true || PIN=""
echo "pin: '$PIN'" | tee -a $L/gpu.txt
for r in 1 2 3; do
  [ $((SECONDS-T0)) -lt ${PYEND:-300} ] || break
  $PIN timeout 40 python3 -m symm_allreduce.bench --world 8 --dtype bf16 --sizes 8K,32K,512K,8M --modes eager --csv $L/py/py-r$r.csv > $L/py/py-bench-r$r.log 2>&1; echo "py rc=$?"
  $PIN timeout 40 $B/bin-symm-bench --world 8 --virtual --dtype bf16 --sizes 8K,32K,512K,8M --algos auto --modes eager --out $L/py/rust-r$r > $L/py/rust-bench-r$r.log 2>&1; echo "rust rc=$?"
done
echo "py bench t=$((SECONDS-T0))"
cd $OUT && tar czf a1.tgz a && cd - > /dev/null
for t in gpu_pool gpu_collectives reliability gpu_nccl_windows multiprocess gpu_candle symm_allreduce symm-bench tracing_setup no_alloc multicast _native symm_allreduce_candle; do
  left=$((${LIMIT:-590}-(SECONDS-T0))); [ $left -gt 5 ] || { echo "no time for $t"; continue; }
  f=$B/test-$t; [ -x $f ] || { echo "missing $f"; continue; }
  timeout $left $f --test-threads=1 > $L/suite/test-$t.log 2>&1; echo "$t rc=$? t=$((SECONDS-T0))"
done
grep -hE "test result|FAILED|panicked" $L/suite/*.log | sort | uniq -c | head -30
cd $OUT && tar czf a2.tgz a/suite a/logs; rm -rf a
echo "total t=$((SECONDS-T0))"
