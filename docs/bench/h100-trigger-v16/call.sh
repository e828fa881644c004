#!/usr/bin/env bash
# One call. The staged tree (.gpux/gpu.tar.xz, "new") is the trigger change (every collective
# kernel triggers the next launch after its first wait on the peers) with the two-shot over the
# low-latency lines on top; "old" (.gpux/old) is the tree before the trigger change, whose
# two-shot and in-place kernels triggered after their last barrier and whose fused one-shot /
# two-shot, pool two-shot and one-shot all-gather / reduce-scatter at exit. Alternating rounds
# of symm-bench (W = 8, 4, 2) and tp_decode (W = 8 and 4); kernel variants (exp); between them
# the GPU suites (those the new kernel reaches first), then pytest on the tree's wheel.
# Every step is skipped past LIMIT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
LIMIT=${LIMIT:-570}
L=$OUT/a; mkdir -p $L/sweep $L/coll $L/tp $L/suite
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
tar -xJf .gpux/gpu.tar.xz
# The tree before (old/) and the experiments' binaries (exp/), packed to fit the carry limit.
[ -f .gpux/extra.tar.xz ] && tar -xJf .gpux/extra.tar.xz -C .gpux
B=.gpu/bin
left() { echo $((LIMIT-(SECONDS-T0))); }
sb() { [ $1 = new ] && echo $B/bin-symm-bench || echo .gpux/old/symm-bench; }
sweep() {  # sweep <world> <round>
  for v in new old; do
    [ $(left) -gt 45 ] || { echo "no time for sweep $1 r$2 $v"; return; }
    timeout 45 $(sb $v) --world $1 --virtual --dtype bf16 --sizes 1K,8K,32K,128K,256K,512K,1M,4M \
      --algos auto,one_shot,two_shot,pool --modes graph_amortised,graph_isolated \
      --out $L/sweep/w$1-r$2-$v > /dev/null 2> $L/sweep/w$1-r$2-$v.err || echo "sweep fail $1 r$2 $v"
  done
  echo "sweep w$1 r$2 t=$((SECONDS-T0))"
}
coll() {
  for v in new old; do
    [ $(left) -gt 40 ] || { echo "no time for coll $1 $v"; return; }
    timeout 40 $(sb $v) --world $1 --virtual --dtype bf16 --sizes 64K,256K,1M,4M \
      --collectives all_gather,reduce_scatter --algos auto --low-latency-max 16K --modes graph_amortised \
      --out $L/coll/w$1-r$2-$v > /dev/null 2> $L/coll/w$1-r$2-$v.err || echo "coll fail $1 $v"
  done
  echo "coll w$1 r$2 t=$((SECONDS-T0))"
}
tp() {
  for v in new old; do
    [ $(left) -gt 60 ] || { echo "no time for tp $1 $v"; return; }
    X=$B/example-tp_decode; [ $v = old ] && X=.gpux/old/tp_decode
    timeout 60 $X --world $1 --hidden 8192 --batch 1,8,32 --steps 100 --layers 4 \
      > $L/tp/w$1-r$2-$v.log 2>&1 || echo "tp fail $1 $v"
  done
  echo "tp w$1 r$2 t=$((SECONDS-T0))"
}
suites() {
  for t in "$@"; do
    [ $(left) -gt 10 ] || { echo "no time for $t"; continue; }
    f=$B/test-$t; [ -x $f ] || { echo "missing $f"; continue; }
    timeout $(left) $f --test-threads=1 > $L/suite/test-$t.log 2>&1; echo "$t rc=$? t=$((SECONDS-T0))"
  done
}
# Kernel variants beside the staged tree (only where .gpux/exp/ is staged), at W = 8 and 4:
# `main`, the tree with the trigger change alone; `relax`, that tree with block_barrier's polls
# relaxed and one acquire re-read once the flag has arrived; `wide`, that tree with the two-shot
# kernel itself over the low-latency lines wherever a shard's two halves fit a whole slot (not
# only the low-latency limit: how far the form would carry with larger slots).
exp() {
  [ -x .gpux/exp/symm-bench-main ] || return
  mkdir -p $L/exp
  for w in 8 4; do for v in new main relax wide; do
    [ $(left) -gt 40 ] || { echo "no time for exp $w r$1 $v"; return; }
    X=$B/bin-symm-bench; [ $v = new ] || X=.gpux/exp/symm-bench-$v
    timeout 40 $X --world $w --virtual --dtype bf16 --sizes 8K,64K,128K,256K,512K,1M,2M \
      --algos one_shot,two_shot,pool --modes graph_amortised \
      --out $L/exp/w$w-r$1-$v > /dev/null 2> $L/exp/w$w-r$1-$v.err || echo "exp fail $w r$1 $v"
  done; done
  echo "exp r$1 t=$((SECONDS-T0))"
}
sweep 8 1
suites gpu_all_reduce agreement protocol gpu_collectives gpu_tuning multiprocess
exp 1
sweep 4 1; tp 8 1
cd $OUT && tar czf a1.tgz a/gpu.txt a/sweep a/coll a/tp a/suite $( [ -d a/exp ] && echo a/exp ) && cd - > /dev/null
suites gpu_fused gpu_pool reliability
python3 -m pip install --quiet --no-deps --force-reinstall .gpux/wheels/symm_allreduce-*.whl > $L/pip.log 2>&1; echo "pip rc=$?"
if [ $(left) -gt 200 ]; then
  (cd python && timeout 120 python3 -m pytest -q -rs -x tests > $L/pytest.log 2>&1); echo "pytest rc=$? t=$((SECONDS-T0))"; tail -3 $L/pytest.log
else echo "no time for pytest"; fi
sweep 2 1; coll 8 1; exp 2; sweep 8 2; sweep 4 2; tp 4 1; tp 8 2; coll 4 1
cd $OUT && tar czf a2.tgz a/sweep a/coll a/tp a/pytest.log a/pip.log $( [ -d a/exp ] && echo a/exp ) && cd - > /dev/null
grep -hE "test result|FAILED|panicked" $L/suite/*.log | sort | uniq -c | head -30
cd $OUT && tar czf a3.tgz a/suite; rm -rf a
echo "total t=$((SECONDS-T0))"
