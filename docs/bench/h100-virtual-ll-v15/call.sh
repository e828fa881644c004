#!/usr/bin/env bash
# One call: the per-world low-latency threshold and the pool calls' one-shot range.
# symm-bench Auto with the published thresholds (new) beside Auto with `--low-latency-max 32K`
# (the former published value for every world: the same kernels, the former routing),
# W = 4, 2, 8; the Rust GPU suites the routing reaches; the Python suite on this tree's wheel;
# the fused call at W = 2 and 4 (tp_decode, half the SMs for the collectives, so that several
# rows get a cluster each); the pool calls beside the zero-copy kernels (symmetric) and the
# one-shot; the collectives at W = 4; the other suites. Every step is skipped past LIMIT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
LIMIT=${LIMIT:-585}
L=$OUT/a; mkdir -p $L/sweep $L/coll $L/pool $L/suite $L/tp
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
tar -xJf .gpux/gpu.tar.xz
B=.gpu/bin
SIZES=1K,8K,32K,48K,64K,96K,128K,192K,256K,512K,1M,4M
left() { echo $((LIMIT-(SECONDS-T0))); }
sweep() {
  for v in new old; do
    [ $(left) -gt 60 ] || { echo "no time for sweep $1 $v"; return; }
    X=""; [ $v = old ] && X="--low-latency-max 32K"
    timeout 60 $B/bin-symm-bench --world $1 --virtual --dtype bf16,f32 --sizes $SIZES --algos auto $X \
      --modes graph_amortised,graph_isolated --out $L/sweep/w$1-$v > /dev/null 2> $L/sweep/w$1-$v.err || echo "sweep fail $1 $v"
  done
  echo "sweep w$1 t=$((SECONDS-T0))"
}
suites() {
  for t in "$@"; do
    [ $(left) -gt 10 ] || { echo "no time for $t"; continue; }
    f=$B/test-$t; [ -x $f ] || { echo "missing $f"; continue; }
    timeout $(left) $f --test-threads=1 > $L/suite/test-$t.log 2>&1; echo "$t rc=$? t=$((SECONDS-T0))"
  done
}
sweep 4; sweep 2
suites agreement gpu_all_reduce gpu_pool gpu_collectives gpu_fused gpu_tuning
python3 -m pip install --quiet --no-deps --force-reinstall .gpux/wheels/symm_allreduce-*.whl > $L/pip.log 2>&1; echo "pip rc=$?"
if [ $(left) -gt 150 ]; then
  (cd python && timeout $(($(left)-20)) python3 -m pytest -q -rs tests > $L/pytest.log 2>&1); echo "pytest rc=$? t=$((SECONDS-T0))"; tail -3 $L/pytest.log
else echo "no time for pytest"; fi
for w in 2 4; do
  [ $(left) -gt 40 ] || { echo "no time for tp $w"; continue; }
  timeout 40 $B/example-tp_decode --world $w --hidden 8192 --batch 1,2,4,8 --steps 100 --layers 4 \
    --shared-sm-percent 50 > $L/tp/w$w-h8192.log 2>&1 || echo "tp fail $w"
done
echo "tp t=$((SECONDS-T0))"
cd $OUT && tar czf a1.tgz a && cd - > /dev/null
for w in 8 4; do
  [ $(left) -gt 40 ] || { echo "no time for pool $w"; continue; }
  timeout 40 $B/bin-symm-bench --world $w --virtual --dtype bf16 --sizes 48K,64K,128K,256K,512K,1M,2M \
    --algos pool,symmetric,one_shot,two_shot --modes graph_amortised --out $L/pool/w$w > /dev/null 2> $L/pool/w$w.err || echo "pool fail $w"
done
echo "pool t=$((SECONDS-T0))"
sweep 8
for v in new old; do
  [ $(left) -gt 40 ] || { echo "no time for coll $v"; continue; }
  X=""; [ $v = old ] && X="--low-latency-max 32K"
  timeout 40 $B/bin-symm-bench --world 4 --virtual --dtype bf16 --sizes 64K,128K,256K,512K,1M \
    --collectives all_gather,reduce_scatter --algos auto $X --modes graph_amortised \
    --out $L/coll/w4-$v > /dev/null 2> $L/coll/w4-$v.err || echo "coll fail $v"
done
echo "coll t=$((SECONDS-T0))"
cd $OUT && tar czf a2.tgz a/pool a/sweep a/coll && cd - > /dev/null
suites protocol multiprocess gpu_candle reliability gpu_nccl_windows symm_allreduce symm-bench symm_allreduce_candle tracing_setup no_alloc multicast
grep -hE "test result|FAILED|panicked" $L/suite/*.log | sort | uniq -c | head -30
cd $OUT && tar czf a3.tgz a/suite; rm -rf a
echo "total t=$((SECONDS-T0))"
